"""Checkpoint curves and their flags, on constructed evaluation results with known shapes."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl.diagnostics import red_flags
from jaxrl.diagnostics.curves import checkpoint_curves
from jaxrl.data.formats import write_samples, samples_path
from jaxrl.evaluation.metrics import model_metrics, per_prompt_values
from jaxrl.evaluation.stats import compare, write_results

REPO = Path(__file__).resolve().parents[1]


def entry(partial, strict=0.1, trunc=0.4, step=None, n=100):
    return {"partial_reward_mean": partial, "strict_rate": strict, "truncation_rate": trunc,
            "mean_completion_tokens": 5000.0, "pass_at_k": {"1": strict}, "n_prompts": n, "n_samples": n,
            "step": step}


def comp(model, diff, lo, hi, metric="partial_reward_mean", n=100):
    return {"model": model, "baseline": "base", "metric": metric, "diff": diff, "ci_low": lo, "ci_high": hi,
            "n_pairs": n, "confidence": 0.95}


def users_results():
    """The users' final 4B DPO run: step 28 +2.82 pp [+0.05, +6.30], step 125 -2.55 pp (100 prompts)."""
    return {"models": {"base": entry(0.30), "step_28": entry(0.3282, step=28), "step_125": entry(0.2745, step=125)},
            "comparisons": [comp("step_28", 0.0282, 0.0005, 0.0630), comp("step_125", -0.0255, -0.061, 0.010)]}


def codes(res, code):
    return [f for f in res["flags"] if f["code"] == code]


def test_the_users_rise_then_fall_is_flagged():
    res = checkpoint_curves(users_results(), metrics=["partial_reward_mean"])
    pts = res["metrics"]["partial_reward_mean"]["points"]
    assert [(p["step"], p["model"]) for p in pts] == [(0, "base"), (28, "step_28"), (125, "step_125")]
    assert pts[1]["ci_low"] == 0.0005 and pts[1]["ci_crosses_zero"] is False
    (nm,) = codes(res, "non_monotonic_checkpoints")
    assert nm["evidence"]["best_step"] == 28 and nm["evidence"]["last_step"] == 125
    assert "best at step 28 (32.82%)" in nm["message"] and "27.45% at step 125" in nm["message"]
    # Interval excludes zero, but it is the best of 2 checkpoints and no samples allow a corrected interval.
    (eg,) = codes(res, "early_gain_not_significant")
    assert eg["severity"] == "info" and eg["evidence"]["step"] == 28 and "best of 2 checkpoints" in eg["message"]


def test_an_early_gain_whose_interval_crosses_zero_is_flagged():
    results = {"models": {"base": entry(0.30), "step_4": entry(0.31, step=4), "step_8": entry(0.32, step=8),
                          "step_12": entry(0.29, step=12)},
               "comparisons": [comp("step_4", 0.01, -0.02, 0.04), comp("step_8", 0.02, -0.01, 0.05),
                               comp("step_12", -0.01, -0.04, 0.02)]}
    res = checkpoint_curves(results, metrics=["partial_reward_mean"])
    flagged = codes(res, "early_gain_not_significant")
    assert [f["evidence"]["step"] for f in flagged] == [4, 8]
    assert all(f["severity"] == "warning" for f in flagged)
    assert "+2.00 pp vs base, 95% interval [-1.00, +5.00] pp over 100 prompts crosses zero" in flagged[1]["message"]


def test_a_monotonic_curve_is_not_flagged():
    results = {"models": {"base": entry(0.30), "step_4": entry(0.33, step=4), "step_8": entry(0.36, step=8)},
               "comparisons": [comp("step_4", 0.03, 0.01, 0.05), comp("step_8", 0.06, 0.04, 0.08)]}
    res = checkpoint_curves(results, metrics=["partial_reward_mean"])
    # No shape flag; the best (here the last) is still the best of 2, and nothing corrects its interval for that.
    (f,) = res["flags"]
    assert (f["code"], f["severity"], f["evidence"]["step"]) == ("early_gain_not_significant", "info", 8)
    # With the evaluation's simultaneous intervals (they exclude zero here): nothing to say.
    for c in results["comparisons"]:
        c.update(simultaneous_ci_low=c["ci_low"] - 0.005, simultaneous_ci_high=c["ci_high"] + 0.005, family_size=4)
    assert checkpoint_curves(results, metrics=["partial_reward_mean"])["flags"] == []


def test_the_best_checkpoint_is_corrected_even_when_it_is_the_last():
    """The audit's hole (flags.py:211): a best-is-last checkpoint escaped the selection correction."""
    results = {"models": {"base": entry(0.30), "step_4": entry(0.31, step=4), "step_8": entry(0.33, step=8)},
               "comparisons": [comp("step_4", 0.01, -0.02, 0.04), comp("step_8", 0.03, 0.001, 0.06)]}
    for c in results["comparisons"]:
        c.update(simultaneous_ci_low=c["ci_low"] - 0.01, simultaneous_ci_high=c["ci_high"] + 0.01, family_size=8)
    res = checkpoint_curves(results, metrics=["partial_reward_mean"])
    flagged = {f["evidence"]["step"]: f for f in codes(res, "early_gain_not_significant")}
    assert flagged[8]["severity"] == "warning" and "best of 2 checkpoints" in flagged[8]["message"]
    assert "after the 8 comparisons of the evaluation (max-T)" in flagged[8]["message"]
    pts = {p["model"]: p for p in res["metrics"]["partial_reward_mean"]["points"]}
    assert pts["step_8"]["ci_low_adjusted"] == pytest.approx(-0.009) and pts["step_4"]["family_size"] == 8


def test_non_monotonic_ignores_moves_within_tol_and_names_noisy_curves():
    assert red_flags.non_monotonic_checkpoints("strict_rate", [0, 4, 8], [0.1, 0.1005, 0.1], tol=0.001) is None
    f = red_flags.non_monotonic_checkpoints("strict_rate", [0, 4, 8, 12], [0.1, 0.2, 0.15, 0.25])
    assert f is not None and "changes direction 2 time(s)" in f.message  # best is last: noisy, not overtrained


def _samples(rng, shift, n=60):
    return [{"problem_id": f"p{i}", "sample_index": 0, "completion": "x", "completion_tokens": 10,
             "finish_reason": "stop", "partial": float(np.clip(0.4 + shift + 0.25 * rng.normal(), 0, 1)),
             "strict": False, "tests": [], "reason": None, "max_new_tokens": 64} for i in range(n)]


def test_missing_intervals_come_from_samples_and_the_best_gets_a_wider_adjusted_interval(tmp_path):
    rng = np.random.default_rng(0)
    base = _samples(rng, 0.0)
    noise = np.random.default_rng(1)
    recs = {"base": base}
    for step, shift in ((4, 0.05), (8, 0.02), (12, -0.03)):
        recs[f"step_{step}"] = [{**r, "partial": float(np.clip(r["partial"] + shift + 0.05 * noise.normal(), 0, 1))}
                                for r in base]
    results = {"models": {n: {**model_metrics(r), "step": None} for n, r in recs.items()}, "comparisons": []}
    res = checkpoint_curves(results, metrics=["partial_reward_mean"], samples=recs, n_resamples=2000)
    pts = {p["model"]: p for p in res["metrics"]["partial_reward_mean"]["points"]}
    want = compare({"step_8": per_prompt_values(recs["step_8"]), "base": per_prompt_values(base)}, "base",
                   metrics=["partial_reward_mean"], n_resamples=2000)[0]
    assert (pts["step_8"]["ci_low"], pts["step_8"]["ci_high"]) == (want["ci_low"], want["ci_high"])
    best = pts["step_4"]
    # Bonferroni over every checkpoint x flagged metric a checkpoint could be chosen on: 3 x 2
    assert best["adjusted_confidence"] == pytest.approx(1 - 0.05 / 6) and "Bonferroni over 6" in best["adjustment"]
    assert best["ci_low_adjusted"] < best["ci_low"] and best["ci_high_adjusted"] > best["ci_high"]
    # the fall from the best (step 4) to the last (step 12), paired, with its verdict
    bvl = res["metrics"]["partial_reward_mean"]["best_vs_last"]
    assert (bvl["best"], bvl["last"]) == ("step_4", "step_12") and bvl["ci_high"] < 0
    (nm,) = codes(res, "non_monotonic_checkpoints")
    assert nm["severity"] == "warning" and "the fall is more than noise" in nm["message"]


def test_adjusted_interval_crossing_zero_is_a_warning():
    pts = [{"step": 4, "diff": 0.03, "ci_low": 0.002, "ci_high": 0.06, "n_pairs": 100, "n_checkpoints": 10,
            "ci_low_adjusted": -0.01, "ci_high_adjusted": 0.07, "adjusted_confidence": 0.995},
           {"step": 8, "diff": -0.01, "ci_low": -0.04, "ci_high": 0.02, "n_pairs": 100}]
    (f,) = red_flags.early_gain_not_significant("partial_reward_mean", pts)
    assert f.severity == "warning" and "best of 10 checkpoints" in f.message
    assert "interval [-1.00, +7.00] pp" in f.message


def test_kl_rising_while_reward_falls():
    f = red_flags.kl_rising_reward_falling([0, 4, 8, 12], [0.0, 0.01, 0.03, 0.06], [0.20, 0.25, 0.22, 0.19], n=100)
    assert f is not None and f.evidence["peak_step"] == 4 and f.evidence["kl_last"] == 0.06
    assert "peaks at step 4 (0.2500)" in f.message
    assert red_flags.kl_rising_reward_falling([0, 4, 8, 12], [0.0, 0.01, 0.01, 0.005], [0.20, 0.25, 0.22, 0.19]) is None
    assert red_flags.kl_rising_reward_falling([0, 4, 8], [0.0, 0.01, 0.03], [0.20, 0.22, 0.25]) is None


def test_diagnose_launcher_curves(tmp_path):
    rng = np.random.default_rng(2)
    recs = {"base": _samples(rng, 0.0, 30), "step_4": _samples(rng, 0.1, 30), "step_8": _samples(rng, -0.05, 30)}
    for n, r in recs.items():
        write_samples(samples_path(tmp_path / "eval", n), r)
    metrics = {n: {**model_metrics(r), "step": None if n == "base" else int(n[5:])} for n, r in recs.items()}
    comps = compare({n: per_prompt_values(r) for n, r in recs.items()}, "base", n_resamples=1000)
    write_results(tmp_path / "eval", metrics, comps)
    proc = subprocess.run([sys.executable, "-m", "launchers.diagnose", "--what=curves", f"--workdir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / "diagnostics" / "curves.json").read_text())
    steps = [p["step"] for p in out["metrics"]["partial_reward_mean"]["points"]]
    assert steps == [0, 4, 8] and "partial_reward_mean: 0: " in proc.stdout
    assert any(f["code"] == "non_monotonic_checkpoints" for f in out["flags"])
