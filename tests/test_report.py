"""The run report: built from a synthetic workdir by the launcher, self-contained, and rendered in headless
Chromium (no console errors, every image decoded, a non-blank screenshot showing the plots).

Chromium comes from Debian: ``apt-get install -y chromium`` (/usr/bin/chromium). Without it the browser tests
skip, unless JAXRL_REQUIRE_BROWSER is set (CI sets it, so they cannot silently skip there).
"""

import html.parser
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl.utils.io import atomic_write_json, write_jsonl
from jaxrl.data import formats
from jaxrl.diagnostics.drift import checkpoint_drift
from jaxrl.evaluation.metrics import model_metrics, per_prompt_values
from jaxrl.evaluation.stats import compare, write_results

pytestmark = pytest.mark.slow  # every test renders a report of a trained workdir

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CAP = 512
STEPS = (4, 8, 12)


def _sample(pid, partial, tokens, finish):
    text = ("Let me think. " * 40) if finish == "length" else \
        f"Plan.\n```python\nn = int(input())\nprint(n * {int(partial * 4)})\n```\n"
    return {"problem_id": pid, "sample_index": 0, "completion": text, "completion_tokens": tokens,
            "finish_reason": finish, "partial": partial, "strict": partial == 1.0,
            "tests": [] if finish == "length" else ["pass"] * int(partial * 4) + ["wrong"] * (4 - int(partial * 4)),
            "reason": "truncated" if finish == "length" else None, "max_new_tokens": CAP}


def build_workdir(wd: Path) -> Path:
    """A DPO run at toy scale: 40 logged steps (one non-finite), base + 3 checkpoints evaluated on 40 prompts
    with heavy truncation, a drift.json, and a length-biased pairs file. Returns the pairs path."""
    rng = np.random.default_rng(0)
    recs = []
    for s in range(1, 41):
        recs.append({"step": s, "loss": 0.69 - 0.004 * s + 0.01 * rng.normal(), "grad_norm": 1 + rng.random(),
                     "update_norm": 0.01 * (1 + rng.random()), "lora_norm": 0.1 * s, "learning_rate": 1e-6,
                     "skipped_updates": int(s >= 30), "nonfinite": s == 30, "tokens_per_s": 1000.0,
                     "step_time_s": 1.0, "preference_accuracy": 0.5 + 0.005 * s, "reward_margin": 0.01 * s,
                     "chosen_rewards": 0.01 * s, "rejected_rewards": -0.01 * s, "kl": 0.001 * s})
        if s == 30:  # what jaxrl.train writes for a skipped update: update_skipped, null loss, a reason
            recs[-1].update(nonfinite=None, update_skipped=1, loss=None, nonfinite_reason="loss is nan",
                            nonfinite_groups=[])
    write_jsonl(wd / formats.METRICS_FILE, recs)
    atomic_write_json(wd / formats.CONFIG_FILE, {"algorithm": "dpo", "model_path": "tiny", "steps": 40})

    samples = {}
    # base -> step_4 rises -> step_8 peaks -> step_12 falls; truncation 45% at base.
    for name, shift, trunc in (("base", 0.0, 0.45), ("step_4", 0.05, 0.35), ("step_8", 0.1, 0.3),
                               ("step_12", -0.05, 0.5)):
        rows = []
        for i in range(40):
            cut = (i * 17) % 40 < round(trunc * 40)  # exactly trunc of the 40 prompts (17 is coprime to 40)
            partial = 0.0 if cut else round(float(np.clip(0.5 + shift + 0.3 * rng.normal(), 0, 1)) * 4) / 4
            rows.append(_sample(f"p{i}", partial, CAP if cut else int(rng.integers(50, 400)),
                                "length" if cut else "stop"))
        samples[name] = rows
        formats.write_samples(formats.samples_path(wd / formats.EVAL_DIR, name), rows)
    metrics = {n: {**model_metrics(r), "step": formats.model_step(n)} for n, r in samples.items()}
    comps = compare({n: per_prompt_values(r) for n, r in samples.items()}, baseline="base", n_resamples=1000)
    write_results(wd / formats.EVAL_DIR, metrics, comps, max_new_tokens=CAP, extra={"max_new_tokens": CAP})

    # Drift: KL and update norm grow with the step (a constructed drift over callables).
    base_lp = [rng.normal(size=(6, 20)) for _ in range(3)]
    direction = [rng.normal(size=(6, 20)) for _ in range(3)]
    A, B = rng.normal(size=(2, 8)), rng.normal(size=(8, 2))
    res = checkpoint_drift(STEPS, lambda s: [b + (0 if s is None else s / 8) * d for b, d in zip(base_lp, direction)],
                           {s: {"layers.0.mlp.up_proj": (A, B * s / 8, 1.0)} for s in STEPS})
    formats.write_diagnostic(formats.diagnostics_path(wd, "drift"), res)

    pairs = [{"problem_id": f"p{i}", "messages": [{"role": "user", "content": "q"}], "chosen": "c", "rejected": "r",
              "chosen_reward": 1.0, "rejected_reward": 0.0, "chosen_tokens": 100,
              "rejected_tokens": 100 + (50 + i if i < 27 else -50), "max_new_tokens": CAP} for i in range(30)]
    write_jsonl(wd / "pairs.jsonl", pairs)
    return wd / "pairs.jsonl"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    wd = tmp_path_factory.mktemp("run")
    pairs = build_workdir(wd)
    proc = subprocess.run([sys.executable, "-m", "launchers.report", f"--workdir={wd}", f"--pairs={pairs}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"report: {wd / 'report.html'}" in proc.stdout
    return wd / "report.html"


class _Resources(html.parser.HTMLParser):
    """Every tag and every src/href value of a page."""

    def __init__(self):
        super().__init__()
        self.tags, self.refs, self.imgs = [], [], 0

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.imgs += tag == "img"
        self.refs += [(tag, k, v or "") for k, v in attrs if k in ("src", "href", "srcset", "data", "action")]


@pytest.mark.slow
def test_report_is_self_contained_and_has_every_section(report):
    text = report.read_text(encoding="utf-8")
    page = _Resources()
    page.feed(text)
    assert page.imgs == 7  # training, checkpoint curves, termination, pair audit, 2 generation diffs, drift
    for tag, attr, value in page.refs:
        if tag == "img":
            assert value.startswith("data:image/png;base64,"), (tag, attr, value[:60])
        else:
            assert value.startswith("#"), (tag, attr, value)  # in-page navigation only
    assert not {"script", "link", "iframe", "object", "embed"} & set(page.tags)
    for scheme in ("http://", "https://", "file://", "url("):
        assert scheme not in text
    for section in ("Flags", "Run summary", "Training curves", "Evaluation", "Checkpoint curves", "Termination",
                    "Pair audit", "Generation diffs", "Drift"):
        assert f">{section}</h2>" in text


def test_report_flags_say_what_is_wrong_in_plain_language(report):
    text = report.read_text(encoding="utf-8")
    flags = text[text.index("id='flags'"):text.index("id='summary'")]
    assert "base: truncation 45%: numbers are censored by the 512-token cap" in flags
    assert "interval crosses zero" in flags
    assert "1 of 40 logged steps had non-finite updates and were skipped (steps 30; reported: loss is nan)" in flags
    assert "not monotonic over checkpoints" in flags
    assert "Length bias in pairs: chosen is shorter than rejected in 90% of 30 pairs" in flags
    assert "KL rising while held-out partial reward falls" in flags  # drift KL grows while step_12 falls
    assert flags.index('class="flag error"') < flags.index('class="flag warning"')  # errors first
    # Every comparison carries its interval and sample size.
    assert "95% interval [" in text and "over 40 prompts" in text


@pytest.mark.slow
def test_report_on_a_workdir_with_only_training_metrics(tmp_path):
    write_jsonl(tmp_path / formats.METRICS_FILE, [{"step": s, "loss": 1.0 / s, "reward_mean": 0.1 * s,
                                                   "reward_std": 0.05, "kl": 0.01 * s} for s in range(1, 6)])
    from jaxrl.diagnostics.report import build_report
    out = build_report(tmp_path, tmp_path / "r.html")
    text = out.read_text(encoding="utf-8")
    assert text.count("<img ") == 1
    assert "No evaluation: run the evaluator" in text and "No drift" in text
    (tmp_path / formats.METRICS_FILE).write_text('{"step": 1}\n{"step": "two"}\n')
    proc = subprocess.run([sys.executable, "-m", "launchers.report", f"--workdir={tmp_path}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and f"{tmp_path / formats.METRICS_FILE}:2: key 'step'" in proc.stderr


# ------------------------------------------------------------------------------------------------ browser

# Injected into a copy of the page: records script errors, failed resource loads and console.error calls, then
# after load writes how many images decoded into the DOM for --dump-dom to show.
_CHECK = """<script>
window.__errs=[];
window.addEventListener('error',function(e){window.__errs.push(String(e.message||(e.target&&e.target.outerHTML&&
e.target.outerHTML.slice(0,80))||'error'))},true);
(function(){var o=console.error;console.error=function(){window.__errs.push([].slice.call(arguments).join(' '));
o.apply(console,arguments)}})();
window.addEventListener('load',function(){var im=[].slice.call(document.images);var p=document.createElement('pre');
p.id='jaxrl-check';p.textContent=JSON.stringify({n:im.length,decoded:im.filter(function(i){return i.complete&&
i.naturalWidth>0}).length,widths:im.map(function(i){return i.naturalWidth}),errors:window.__errs});
document.body.appendChild(p)});
</script>"""


def _chromium():
    if Path(CHROMIUM).exists():
        return CHROMIUM
    if os.environ.get("JAXRL_REQUIRE_BROWSER"):
        pytest.fail(f"{CHROMIUM} is missing and JAXRL_REQUIRE_BROWSER is set: apt-get install -y chromium")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium); set JAXRL_REQUIRE_BROWSER to require it")


def _run_chromium(tmp_path, *args):
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
           "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1",
           f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_report_renders_in_headless_chromium_without_errors(report, tmp_path):
    checked = tmp_path / "checked.html"
    checked.write_text(report.read_text(encoding="utf-8").replace("<head>", "<head>" + _CHECK, 1), encoding="utf-8")
    proc = _run_chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", checked.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    marker = '<pre id="jaxrl-check">'
    assert marker in proc.stdout, proc.stderr[-2000:]
    result = json.loads(html.unescape(proc.stdout.split(marker, 1)[1].split("</pre>", 1)[0]))
    assert result["errors"] == []
    assert result["n"] == 7 and result["decoded"] == 7, result
    assert min(result["widths"]) > 200  # real plots, not 1-pixel placeholders


def test_report_screenshot_shows_the_plots(report, tmp_path):
    shot = tmp_path / "shot.png"
    proc = _run_chromium(tmp_path, "--window-size=1200,3000", f"--screenshot={shot}", report.as_uri())
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    from PIL import Image  # matplotlib depends on Pillow
    img = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float64)
    assert img.shape == (3000, 1200, 3)
    assert img.std() > 20  # not a blank page
    # matplotlib's default blue (#1f77b4) only comes from the plots: they are painted, not just decoded.
    blue = np.all(np.abs(img - np.array([31, 119, 180])) < 12, axis=-1)
    assert blue.sum() > 500, blue.sum()
    # The flags sit at the top: the error banner's red border (#c62828) is within the first screen.
    red = np.all(np.abs(img[:900] - np.array([198, 40, 40])) < 12, axis=-1)
    assert red.sum() > 50, red.sum()


def test_chromium_requirement_is_enforced(monkeypatch):
    # The skip may only happen when the browser is absent AND the requirement is unset.
    monkeypatch.setenv("JAXRL_REQUIRE_BROWSER", "1")
    if Path(CHROMIUM).exists():
        assert _chromium() == CHROMIUM
    else:
        with pytest.raises(pytest.fail.Exception, match="JAXRL_REQUIRE_BROWSER is set"):
            _chromium()


@pytest.mark.slow
def test_stored_diagnostics_replace_the_computed_ones(report, tmp_path):
    wd = tmp_path / "run"
    shutil.copytree(report.parent, wd)
    proc = subprocess.run([sys.executable, "-m", "launchers.diagnose", "--what=diff", f"--workdir={wd}",
                           "--model_b=step_12"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("step_12 vs base: ") and (wd / "diagnostics" / "diff.json").is_file()
    from jaxrl.diagnostics.report import build_report
    text = build_report(wd).read_text(encoding="utf-8")
    diffs = text[text.index("id='diffs'"):text.index("id='drift'")]
    assert diffs.count("<h3>") == 1 and "step_12 vs base:" in diffs  # the stored diff, not the two defaults
    assert text.count("<img ") == 5  # no pairs file this time: no pair-audit plot
    assert "No pair audit" in text


def test_report_reads_the_evaluators_resampled_termination_analysis(report, tmp_path):
    # `launchers.evaluate --resample_max_new_tokens` writes eval/termination.json; the report must show it
    # (with its re-sampled numbers) rather than recompute a view without them.
    wd = tmp_path / "run"
    shutil.copytree(report.parent, wd)
    from jaxrl.diagnostics.report import collect
    from jaxrl.diagnostics.termination import termination_analysis
    samples = {n: formats.read_samples(formats.samples_path(wd / "eval", n)) for n in ("base", "step_4")}
    stored = termination_analysis(samples)
    stored["marker"] = "from the evaluator"
    (wd / "eval" / "termination.json").write_text(json.dumps(stored))
    assert collect(wd)["termination"]["marker"] == "from the evaluator"
    (wd / "diagnostics").mkdir(exist_ok=True)
    (wd / "diagnostics" / "termination.json").write_text(json.dumps({**stored, "marker": "diagnose"}))
    assert collect(wd)["termination"]["marker"] == "diagnose"  # an explicit diagnostic wins
