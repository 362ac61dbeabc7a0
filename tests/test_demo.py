"""`make demo` end to end (quick sizes): every stage runs from a bare folder, and the report is generated from
that run's own files (its evaluation numbers, its training steps, its flags), with the exports loadable."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # the demo end to end

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("demo") / "demo_workdir"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "launchers.demo", f"--workdir={workdir}", "--quick"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return workdir, proc.stdout + proc.stderr  # all the user sees


@pytest.mark.slow
def test_demo_runs_every_stage_and_prints_the_report(demo):
    workdir, out = demo
    for stage in ("model and tokenizer", "M0 warm-up", "rollouts", "pairs", "DPO", "GRPO", "exports", "evaluation",
                  "diagnostics", "report"):
        assert re.search(rf"\[demo\] {re.escape(stage)}.*: done in", out), stage
    assert f"report: {workdir / 'report.html'}" in out
    # the container layout the interfaces promise, the exports of the last DPO checkpoint
    base = json.loads((workdir / "base_model" / "config.json").read_text())
    assert base["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in base
    assert (workdir / "export" / "peft" / "adapter_model.safetensors").is_file()
    assert json.loads((workdir / "export" / "peft" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert (workdir / "export" / "merged" / "config.json").is_file()


def test_demo_output_is_two_lines_a_stage_and_the_report_opens_without_a_false_error(demo):
    """What `make demo` prints is no longer than before issue 33 (25 lines: each stage's start and end, where the
    report is), and its report no longer opens with an error flag: the pair audit re-scores with the run's reward
    (charset), under which a chosen answer of mostly the asked alphabet is a partial score, not a wrong program."""
    workdir, out = demo
    assert len(out.strip().splitlines()) <= 25, out
    html = (workdir / "report.html").read_text()
    assert 'class="flag error"' not in html
    semantic = json.loads((workdir / "dpo" / "diagnostics" / "pairs.json").read_text())["semantic"]
    assert semantic["reward"] == "charset" and semantic["n_failed"] == 0


def test_demo_prints_progress_not_orbax_notices(demo):
    """Orbax warns three lines per checkpoint opened read-only (dozens per evaluation): the launchers drop them."""
    _, out = demo
    assert "read_only" not in out and "Given directory is read only" not in out


def test_make_demo_runs_grpo_as_many_steps_as_dpo():
    """The report sets GRPO beside DPO. Both sit on a plateau for their first ~15-30 updates on this task (DPO's
    held-out reward is 0.48-0.56 up to step 24); at 12 steps GRPO had not left it (0.48), so the two are compared
    at equal step counts (`make demo`'s settings; --quick only checks that every stage runs)."""
    from jaxrl.demo import DemoSettings
    settings = DemoSettings()
    assert settings.grpo_steps >= settings.dpo_steps
    assert settings.grpo_steps % settings.grpo_checkpoint_every == 0


def test_report_is_generated_from_this_run(demo):
    workdir, _ = demo
    results = json.loads((workdir / "dpo" / "eval" / "results.json").read_text())
    models = results["models"]
    assert {"base", "step_8", "step_16", "grpo", "merged"} <= set(models)
    # the merged export and its adapter checkpoint are the same model: same held-out reward (same seeds)
    assert abs(models["merged"]["partial_reward_mean"] - models["step_16"]["partial_reward_mean"]) < 0.05
    html = (workdir / "report.html").read_text()
    assert str(workdir / "dpo") in html  # its own run
    for name in ("step_8", "step_16", "grpo"):
        assert name in html
    base_reward = f"{100 * models['base']['partial_reward_mean']:.2f}%"
    assert base_reward in html  # numbers come from this run's results.json
    assert html.count("data:image/png;base64,") >= 5  # training curves, evaluation, checkpoint curves, ...
    metrics = [json.loads(line) for line in (workdir / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in metrics) == 16
    assert "Flags" in html and 'class="flag' in html
    drift = json.loads((workdir / "dpo" / "diagnostics" / "drift.json").read_text())
    assert [r["step"] for r in drift["per_step"]] == [8, 16]
    assert drift["per_step"][-1]["kl_to_base"] > 0


def test_demo_evaluates_an_averaged_adapter_beside_its_steps(demo):
    """Issue 32: the demo exports the exact average of its last DPO checkpoints (dpo/averages/avg_<steps>), the
    evaluation scores it as a candidate of the family, and the report's curves and family count show it."""
    workdir, _ = demo
    [average] = [p.name for p in (workdir / "dpo" / "averages").iterdir()]
    results = json.loads((workdir / "dpo" / "eval" / "results.json").read_text())
    model = results["models"][average]
    assert model["average"]["steps"] and len(model["average"]["steps"]) >= 2
    steps = [n for n in results["models"] if n.startswith("step_")]
    assert all(f"step_{s}" in steps for s in model["average"]["steps"])  # evaluated beside the steps it averages
    html = (workdir / "report.html").read_text()
    assert "mean of " + ", ".join(map(str, model["average"]["steps"])) in html
    assert re.search(r"\d+ of them averaged checkpoints?", html)
