"""The results.json sections beyond the comparisons, on constructed sample records with hand-computable numbers:
censoring (finished-only, bounds, finish / quality decomposition, the extended cap), pass@k with intervals,
identical copies, claims, and the power planner on the users' numbers."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl.data import formats
from jaxrl.evaluation import planning
from jaxrl.evaluation.analysis import analyze, sampling_warning
from jaxrl.evaluation.censoring import censored_comparison, load_resampled, save_resampled
from jaxrl.evaluation.metrics import model_metrics, per_prompt_pass_at_k
from jaxrl.evaluation.results import write_results

REPO = Path(__file__).resolve().parents[1]


def rec(pid, idx, partial, finish="stop", text=None, cap=100):
    return {"problem_id": pid, "sample_index": idx, "completion": text if text is not None else f"{pid}-{idx}",
            "completion_tokens": cap if finish == "length" else 10, "finish_reason": finish,
            "partial": 0.0 if finish == "length" else partial, "strict": finish != "length" and partial == 1.0,
            "tests": [], "reason": "truncated" if finish == "length" else None, "max_new_tokens": cap}


def two_models():
    """6 prompts, 2 samples each. The model finishes p0-p2 where the base runs out, and is no better there."""
    base, model = [], []
    for i in range(6):
        pid = f"p{i}"
        if i < 3:  # base: one sample truncated, the other finished with 0.5; model: both finished, 0.5
            base += [rec(pid, 0, 0.5), rec(pid, 1, 0.0, "length")]
            model += [rec(pid, 0, 0.5), rec(pid, 1, 0.5)]
        else:  # both finish both samples; model +0.25 better on p3..p5
            base += [rec(pid, 0, 0.5), rec(pid, 1, 0.5)]
            model += [rec(pid, 0, 0.75), rec(pid, 1, 0.75)]
    return model, base


def test_censored_comparison_by_hand():
    model, base = two_models()
    c = censored_comparison(model, base, metrics=["partial_reward_mean"], n_resamples=999)["partial_reward_mean"]
    # observed per-prompt diffs: p0-2: 0.5 - 0.25 = +0.25 (finishing); p3-5: +0.25 (quality)
    dec = c["decomposition"]
    # finish part: (f_m - f_b)(q_m + q_b)/2 = (1 - 0.5)(0.5 + 0.5)/2 = 0.25 on p0-2, 0 elsewhere -> mean 0.125
    assert dec["finish"]["diff"] == pytest.approx(0.125) and dec["quality"]["diff"] == pytest.approx(0.125)
    assert dec["residual"] == pytest.approx(0.0)
    # finished only: every prompt has finished samples for both; q diffs 0 on p0-2, +0.25 on p3-5
    assert c["finished"]["n_pairs"] == 6 and c["finished"]["diff"] == pytest.approx(0.125)
    # bounds: lower = model - base imputed (truncated -> 0.5 => base 0.5 everywhere but p3-5 0.5): 0.125
    #         upper = model imputed (no truncation: = model) - base as scored: 0.25
    assert c["bounds"]["lower"]["diff"] == pytest.approx(0.125) and c["bounds"]["upper"]["diff"] == pytest.approx(0.25)
    assert c["bounds"]["ci_low"] <= 0.125 and c["bounds"]["ci_high"] >= 0.25
    assert c["finish_rate_model"] == 1.0 and c["finish_rate_baseline"] == 0.75


def test_analyze_sections_and_round_trip(tmp_path):
    model, base = two_models()
    out = analyze({"base": base, "m": model}, "base", n_resamples=999)
    assert set(out) == {"models", "comparisons", "family", "selection", "censoring", "protocol", "warnings"}
    metrics = [c["metric"] for c in out["comparisons"]]
    # 2 samples a prompt: pass@2 is compared too; the family is every row
    assert metrics == ["partial_reward_mean", "strict_rate", "truncation_rate", "mean_completion_tokens",
                       "pass_at_2"]
    assert out["family"]["size"] == 5 and all(c["family_size"] == 5 for c in out["comparisons"])
    assert all(c["claim"] == "exploratory" for c in out["comparisons"]) and out["protocol"]["role"] == "exploratory"
    assert out["selection"] is None  # one candidate: nothing was selected
    iv = out["models"]["base"]["intervals"]
    assert iv["partial_reward_mean"][0] <= out["models"]["base"]["partial_reward_mean"] <= iv["partial_reward_mean"][1]
    assert set(iv["pass_at_k"]) == {"1", "2"}
    p = out["comparisons"][0]["power"]
    assert p["mde"] > 0 and p["n_for_diff"] >= 1 and p["mde_family"] > p["mde"]
    # censoring section from the records, no resampled cap
    assert out["censoring"]["extended_cap"] is None and "m" in out["censoring"]["models"]
    # written and read back by the diagnostics' validator
    json_path, md_path = write_results(tmp_path, out.pop("models"), out.pop("comparisons"),
                                       warnings=out.pop("warnings"), extra=out)
    res = formats.read_results(json_path)
    assert res["comparisons"][0]["simultaneous_ci_low"] <= res["comparisons"][0]["ci_low"]
    md = md_path.read_text()
    for section in ("## Comparisons", "**Multiplicity.** This file makes 5 comparisons", "## Censoring",
                    "## Power (80%, two-sided)", "## Protocol", "Role: **exploratory**"):
        assert section in md, section
    bad = json.loads(json_path.read_text())
    bad["comparisons"][0]["claim"] = "proven"
    with pytest.raises(formats.FormatError, match="claim must be one of"):
        formats.validate_results(bad)


def test_extended_cap_compares_both_models_resampled(tmp_path):
    model, base = two_models()
    # at a larger cap the base's truncated samples finish with 0.5: the model's edge on p0-p2 disappears
    base_ext = [dict(r, finish_reason="stop", partial=0.5, completion_tokens=150, max_new_tokens=400,
                     reason=None, resampled=True) if r["finish_reason"] == "length" else r for r in base]
    for name, recs in (("base", base_ext), ("m", model)):
        save_resampled(tmp_path, 400, name, recs)
    loaded = load_resampled(tmp_path)
    assert list(loaded) == [400] and set(loaded[400]) == {"base", "m"}
    out = analyze({"base": base, "m": model}, "base", resampled=loaded, n_resamples=999)
    ext = out["censoring"]["extended_cap"]
    assert ext["max_new_tokens"] == 400
    rows = {c["metric"]: c for c in ext["models"]["m"]["comparisons"]}
    assert rows["partial_reward_mean"]["diff"] == pytest.approx(0.125)  # only the quality gain is left
    assert rows["truncation_rate"]["diff"] == 0.0 and ext["models"]["m"]["baseline_n_resampled"] == 3
    assert out["comparisons"][0]["diff"] == pytest.approx(0.25)  # at the original cap


def test_pass_at_k_intervals_and_identical_copies():
    recs = [rec(f"p{i}", j, 1.0 if (i + j) % 3 == 0 else 0.0) for i in range(10) for j in range(4)]
    pk = per_prompt_pass_at_k(recs)
    assert set(pk) == {"1", "2", "4"}
    m = model_metrics(recs)
    assert np.mean(list(pk["2"].values())) == pytest.approx(m["pass_at_k"]["2"])
    same = [rec(f"p{i}", j, 0.5, text="same answer") for i in range(5) for j in range(3)]
    out = analyze({"base": same, "m": same}, "base", n_resamples=199)
    assert any("identical copies (5 prompts)" in w for w in out["warnings"])
    assert "temperature 0 with num_samples=4" in sampling_warning(0.0, 4) and sampling_warning(1.0, 4) is None


def test_planner_on_the_users_numbers():
    # SD of per-prompt differences 15.9 pp (their interval [+0.05, +6.30] pp on 100 prompts)
    sd = planning.sd_from_interval(0.0005, 0.063, 100)
    assert sd == pytest.approx(0.159, abs=0.001)
    assert 480 <= planning.required_prompts(0.159, 0.02) <= 510  # "about 500"
    assert 770 <= planning.required_prompts(0.159, 0.02, family=7) <= 800  # "790 over 7 checkpoints"
    assert planning.power_at(100, 0.159, 0.02) == pytest.approx(0.24, abs=0.01)
    assert planning.minimum_detectable_effect(0.159, 100) == pytest.approx(0.0445, abs=0.0005)
    # the same through the launcher
    proc = subprocess.run([sys.executable, "-m", "launchers.plan", "--sd_diff=0.159", "--effect=0.02", "--family=7"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith("1 "))
    assert line.split()[2:] == ["497", "497", "789", "789"]


def test_variance_components_split_between_and_within(tmp_path):
    """Per-prompt effects with SD 0.2 (between) and per-sample noise SD 0.3 (within, paired difference): the
    planner recovers both and what more samples buy."""
    rng = np.random.default_rng(0)
    n, k = 400, 8
    effect = rng.normal(0.02, 0.2, n)
    base, model = [], []
    for i in range(n):
        for j in range(k):
            b = float(np.clip(0.5 + 0.05 * rng.normal(), 0, 1))
            base.append({"problem_id": f"p{i}", "sample_index": j, "partial": b})
            model.append({"problem_id": f"p{i}", "sample_index": j, "partial": b + effect[i] + 0.3 * rng.normal()})
    comps = planning.variance_components(model, base)
    assert comps["within"] == pytest.approx(0.09, rel=0.1) and comps["between"] == pytest.approx(0.04, rel=0.2)
    table = planning.plan_table(comps, 0.02, ks=(1, 16))
    assert table[0]["sd_diff"] == pytest.approx(np.sqrt(0.13), rel=0.1)
    assert table[1]["prompts"] < table[0]["prompts"] / 2  # more samples shrink the within part only
    with pytest.raises(ValueError, match="base-only pilot needs"):
        planning.variance_components(None, base)
    solo = planning.variance_components(None, base, correlation=0.5)
    assert solo["between"] == pytest.approx(2 * solo["base_between"] * 0.5)


def test_a_reference_row_is_compared_but_never_a_candidate(tmp_path):
    """--references (a distillation's teacher): its metrics and its marginal comparison with the baseline are the
    same as when it is an ordinary model, but the simultaneous family, the selection and the protocol's candidate
    count hold the candidates only (here one: so nothing is selected, although the teacher is the best)."""
    model, base = two_models()
    teacher = [dict(r, partial=1.0, strict=True, finish_reason="stop", completion_tokens=10, reason=None)
               for r in model]
    records = {"base": base, "m": model, "teacher": teacher}
    plain = analyze(records, "base", n_resamples=999)
    out = analyze(records, "base", n_resamples=999, references=["teacher"])
    assert plain["family"]["size"] == 10 and out["family"]["size"] == 5
    assert out["family"]["models"] == ["m"] and plain["selection"] is not None and out["selection"] is None
    rows = {(c["model"], c["metric"]): c for c in out["comparisons"]}
    before = {(c["model"], c["metric"]): c for c in plain["comparisons"]}
    for (name, metric), row in rows.items():
        assert row.get("reference", False) == (name == "teacher")
        for key in ("diff", "ci_low", "ci_high", "p_value"):
            assert row[key] == before[(name, metric)][key], (name, metric, key)
        assert ("simultaneous_ci_low" in row) == (name != "teacher")
    assert rows[("teacher", "partial_reward_mean")]["diff"] > rows[("m", "partial_reward_mean")]["diff"]
    assert out["models"]["teacher"]["reference"] is True and "reference" not in out["models"]["m"]
    write_results(tmp_path, out.pop("models"), out.pop("comparisons"), warnings=out.pop("warnings"), extra=out)
    md = (tmp_path / "results.md").read_text()
    assert "| teacher (reference) |" in md and "not among them" in md
    assert json.loads((tmp_path / "results.json").read_text())["models"]["teacher"]["reference"] is True
    with pytest.raises(ValueError, match="baseline"):
        analyze(records, "base", n_resamples=99, references=["base"])
