"""Evaluation metrics and statistics: hand-computed values, pass@k, bootstrap coverage, McNemar, results files."""

import json
import math
import os

import numpy as np
import pytest
import scipy.stats

from jaxrl.evaluation import stats
from jaxrl.evaluation.metrics import default_ks, model_metrics, pass_at_k, pass_at_k_per_problem, per_prompt_values


def _rec(pid, idx, partial, strict, finish, tokens, nested=False):
    r = {"problem_id": pid, "sample_index": idx, "finish_reason": finish, "completion_tokens": tokens}
    if nested:  # rollouts.jsonl layout
        r["reward"] = {"partial": partial, "strict": strict}
    else:
        r.update(partial=partial, strict=strict)
    return r


# A: 2 samples, B: 2 samples, C: 3 samples (so a pooled mean would differ from the per-prompt mean).
RECORDS = [
    _rec("A", 0, 1.0, True, "stop", 100),
    _rec("A", 1, 0.5, False, "length", 300, nested=True),
    _rec("B", 0, 0.0, False, "stop", 50),
    _rec("B", 1, 0.25, False, "stop", 70),
    _rec("C", 0, 1.0, True, "stop", 10),
    _rec("C", 1, 1.0, True, "stop", 20, nested=True),
    _rec("C", 2, 0.0, False, "length", 30),
]


def test_model_metrics_hand_computed():
    m = model_metrics(RECORDS)
    # per prompt partial: A 0.75, B 0.125, C 2/3  (pooled would be 3.75/7 = 0.5357)
    assert m["partial_reward_mean"] == pytest.approx((0.75 + 0.125 + 2 / 3) / 3)
    assert m["strict_rate"] == pytest.approx((0.5 + 0.0 + 2 / 3) / 3)
    # smallest n is 2 -> ks 1, 2; pass@1 == strict_rate; pass@2: A 1, B 0, C 1
    assert list(m["pass_at_k"]) == ["1", "2"]
    assert m["pass_at_k"]["1"] == pytest.approx((0.5 + 0.0 + 2 / 3) / 3)
    assert m["pass_at_k"]["2"] == pytest.approx(2 / 3)
    assert m["truncation_rate"] == pytest.approx((0.5 + 0.0 + 1 / 3) / 3)
    assert m["mean_completion_tokens"] == pytest.approx((200 + 60 + 15 + 5) / 3)  # A 200, B 60, C 20
    assert (m["n_prompts"], m["n_samples"]) == (3, 7)
    u = m["untruncated"]  # A keeps s0, B both, C s0 and s1
    assert (u["n_prompts"], u["n_samples"]) == (3, 5)
    assert u["partial_reward_mean"] == pytest.approx((1.0 + 0.125 + 1.0) / 3)
    assert u["strict_rate"] == pytest.approx(2 / 3)
    assert u["pass_at_k"] == {"1": pytest.approx(2 / 3)}
    assert u["mean_completion_tokens"] == pytest.approx((100 + 60 + 15) / 3)
    assert "truncation_rate" not in u

    pp = per_prompt_values(RECORDS)
    assert pp["partial_reward_mean"] == {"A": 0.75, "B": 0.125, "C": pytest.approx(2 / 3)}
    assert pp["truncation_rate"]["C"] == pytest.approx(1 / 3)


def test_model_metrics_all_truncated_and_bad_records():
    m = model_metrics([_rec("A", 0, 0.0, False, "length", 8192)])
    assert m["truncation_rate"] == 1.0
    assert m["untruncated"]["n_prompts"] == 0 and m["untruncated"]["partial_reward_mean"] is None
    with pytest.raises(ValueError, match="duplicate sample .*'A', sample_index 0"):
        model_metrics([_rec("A", 0, 1.0, True, "stop", 1), _rec("A", 0, 0.0, False, "stop", 1)])
    with pytest.raises(KeyError, match="record 1 .*'B'.*'completion_tokens'"):
        bad = dict(_rec("B", 0, 1.0, True, "stop", 1))
        del bad["completion_tokens"]
        model_metrics([_rec("A", 0, 1.0, True, "stop", 1), bad])
    with pytest.raises(ValueError, match="partial must be in"):
        model_metrics([_rec("A", 0, 1.5, True, "stop", 1)])


def test_pass_at_k_matches_combinatorial_definition():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    # known values for n=10, c=3
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    assert pass_at_k(10, 3, 8) == 1.0
    # stable for large n: C(199,100)/C(200,100) = 1/2
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5, abs=1e-12)
    # mean over problems
    assert pass_at_k([10, 5], [3, 0], 1) == pytest.approx(0.15)
    np.testing.assert_allclose(pass_at_k_per_problem([10, 5], [3, 5], 2), [1 - 21 / 45, 1.0])
    with pytest.raises(ValueError, match="k=3 exceeds"):
        pass_at_k([10, 2], [1, 1], 3)
    assert default_ks(1) == [1] and default_ks(8) == [1, 2, 4, 8] and default_ks(5) == [1, 2, 4, 5]


@pytest.mark.slow
def test_paired_bootstrap_coverage_percentile_and_bca():
    # 400 seeded trials of 100 paired prompts with a known mean difference; skewed noise so BCa matters.
    true_diff, n, trials = 0.03, 100, 400
    rng = np.random.default_rng(1234)
    widths, expected_widths = {"percentile": [], "bca": []}, []
    covered = {"percentile": 0, "bca": 0}
    for t in range(trials):
        difficulty = rng.uniform(0, 1, n)  # cancels in the paired difference
        noise = rng.exponential(0.15, n) - 0.15  # mean 0, right-skewed
        b = difficulty + rng.normal(0, 0.05, n)
        a = difficulty + true_diff + noise
        d = a - b
        expected_widths.append(2 * 1.96 * d.std(ddof=1) / math.sqrt(n))
        for method in covered:
            r = stats.paired_bootstrap(a, b, n_resamples=2000, seed=t, method=method)
            assert r["diff"] == pytest.approx(d.mean())
            covered[method] += r["ci_low"] <= true_diff <= r["ci_high"]
            widths[method].append(r["ci_high"] - r["ci_low"])
    for method, hits in covered.items():
        assert 0.93 <= hits / trials <= 0.97, (method, hits / trials)
        # and not by being wide: the width matches the normal-theory width within 10%
        assert np.mean(widths[method]) == pytest.approx(np.mean(expected_widths), rel=0.10), method


def test_paired_bootstrap_seeded_degenerate_and_errors():
    rng = np.random.default_rng(0)
    a, b = rng.uniform(size=50), rng.uniform(size=50)
    r1 = stats.paired_bootstrap(a, b, n_resamples=500, seed=7)
    assert r1 == stats.paired_bootstrap(a, b, n_resamples=500, seed=7)
    assert r1 != stats.paired_bootstrap(a, b, n_resamples=500, seed=8)
    assert r1["ci_low"] < r1["diff"] < r1["ci_high"] and r1["n_pairs"] == 50
    # all differences equal: zero-width interval, for both methods, also with one prompt
    for method in ("percentile", "bca"):
        r = stats.paired_bootstrap(a, a + 0.1, method=method)
        assert (r["diff"], r["ci_low"], r["ci_high"]) == pytest.approx((-0.1, -0.1, -0.1))
    r = stats.paired_bootstrap([1.0], [0.0])
    assert (r["diff"], r["ci_low"], r["ci_high"]) == (1.0, 1.0, 1.0)
    # one discordant prompt out of 100: a lopsided bootstrap distribution; BCa still gives a finite interval
    x = np.zeros(100)
    x[0] = 1.0
    r = stats.paired_bootstrap(x, np.zeros(100), n_resamples=2000, method="bca")
    assert r["method"] == "bca" and r["ci_low"] == 0.0 and 0.01 < r["ci_high"] < 0.1
    # tiny data / few resamples: some seeds leave BCa undefined (scipy gives NaN); we fall back, never NaN
    results = [stats.paired_bootstrap([0.0, 1.0, 0.0], [0.0, 0.0, 0.0], n_resamples=3, seed=s, method="bca")
               for s in range(30)]
    assert all(math.isfinite(r["ci_low"]) and math.isfinite(r["ci_high"]) for r in results)
    assert any(r["method"].startswith("percentile (bca undefined") for r in results)
    with pytest.raises(ValueError, match="lengths 3 and 2"):
        stats.paired_bootstrap([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="NaN"):
        stats.paired_bootstrap([1, np.nan], [1, 2])


def test_mcnemar_exact_matches_binomtest():
    rng = np.random.default_rng(5)
    for trial in range(30):
        n = int(rng.integers(5, 60))
        a = rng.integers(0, 2, n)
        b = np.where(rng.uniform(size=n) < 0.7, a, 1 - a)
        r = stats.mcnemar_exact(a, b)
        assert r["b01"] == int(np.sum((a == 0) & (b == 1))) and r["b10"] == int(np.sum((a == 1) & (b == 0)))
        discordant = r["b01"] + r["b10"]
        expected = scipy.stats.binomtest(r["b10"], discordant, 0.5).pvalue if discordant else 1.0
        assert r["p_value"] == pytest.approx(expected, rel=1e-12), trial
    # hand values: 6 wins, 0 losses -> 2 / 64
    assert stats.mcnemar_exact([1] * 6 + [0] * 4, [0] * 6 + [0] * 4)["p_value"] == pytest.approx(2 / 64)
    assert stats.mcnemar_exact([1, 0, 1], [1, 0, 1]) == {"p_value": 1.0, "b01": 0, "b10": 0, "n_pairs": 3}
    with pytest.raises(ValueError, match="0/1"):
        stats.mcnemar_exact([0.5, 1], [1, 1])


def test_compare_records_and_mismatched_ids():
    ids = [f"p{i}" for i in range(40)]
    base_strict = {p: float(i % 2) for i, p in enumerate(ids)}  # passes the odd ones
    model_strict = {p: 1.0 if i < 10 else base_strict[p] for i, p in enumerate(ids)}  # +5 wins, 0 losses
    base_partial = {p: 0.5 for p in ids}
    model_partial = {p: 0.5 + (0.2 if i < 20 else -0.1) for i, p in enumerate(ids)}
    models = {"base": {"strict_rate": base_strict, "partial_reward_mean": base_partial},
              "step28": {"strict_rate": dict(reversed(model_strict.items())), "partial_reward_mean": model_partial}}
    rows = stats.compare(models, "base", ["partial_reward_mean", "strict_rate"], n_resamples=2000)
    assert [(r["model"], r["metric"]) for r in rows] == [("step28", "partial_reward_mean"), ("step28", "strict_rate")]
    part, strict = rows
    assert part["diff"] == pytest.approx(0.05) and part["n_pairs"] == 40
    assert part["ci_low"] < 0.05 < part["ci_high"] and part["ci_crosses_zero"] == (part["ci_low"] <= 0)
    assert part["test"] == "sign_flip" and (part["p_value"] < 0.05) == (part["ci_low"] > 0) == part["significant"]
    assert strict["diff"] == pytest.approx(5 / 40)
    assert (strict["b01"], strict["b10"], strict["test"], strict["p_value_test"]) == (0, 5, "mcnemar_midp",
                                                                                   "mcnemar_midp")
    assert strict["p_value"] == pytest.approx(1 / 32) and strict["p_value_exact"] == pytest.approx(2 / 32)
    assert strict["significant"] and strict["ci_low"] > 0  # the interval agrees with the (mid-p) test
    assert strict["model_value"] == pytest.approx(25 / 40) and strict["baseline_value"] == pytest.approx(0.5)
    for key in ("model", "baseline", "metric", "diff", "ci_low", "ci_high", "n_pairs", "ci_crosses_zero",
                "simultaneous_ci_low", "simultaneous_ci_high", "simultaneous_p_value", "family_size"):
        assert key in strict
    assert strict["family_size"] == 2 and strict["simultaneous_ci_low"] <= strict["ci_low"]
    # fractional strict rates (several samples a prompt) -> sign-flip test, exact over the 2 differing prompts
    frac = {"base": {"strict_rate": {"a": 0.25, "b": 0.5, "c": 0.0}},
            "m": {"strict_rate": {"a": 0.5, "b": 0.5, "c": 0.125}}}
    row = stats.compare(frac, "base", ["strict_rate"], n_resamples=200)[0]
    assert (row["b01"], row["b10"], row["test"]) == (0, 2, "sign_flip") and row["p_value"] == 0.5
    assert row["ci_method"] == "sign_flip (exact)"

    bad = {"base": {"strict_rate": {"p1": 1.0, "p2": 0.0, "p3": 1.0}},
           "m": {"strict_rate": {"p1": 1.0, "p2": 1.0, "p9": 0.0}}}
    with pytest.raises(ValueError, match=r"missing from model 'm': \['p3'\].*missing from baseline 'base': \['p9'\]"):
        stats.compare(bad, "base", ["strict_rate"])
    with pytest.raises(KeyError, match="no per-prompt values for metric 'truncation_rate'"):
        stats.compare(bad, "base", ["truncation_rate"])
    with pytest.raises(KeyError, match="baseline 'nope'"):
        stats.compare(bad, "nope")


def test_truncation_warning():
    assert stats.truncation_warning(0.45, max_new_tokens=8192) == \
        "truncation 45%: numbers are censored by the 8192-token cap"
    assert stats.truncation_warning(0.45) == "truncation 45%: numbers are censored by the generation cap"
    assert stats.truncation_warning(0.10) is None  # at the threshold: no warning
    assert stats.truncation_warning(0.11, threshold=0.2) is None
    assert stats.truncation_warning(None) is None


def test_write_results_files(tmp_path):
    base_recs = [_rec(f"p{i}", 0, 0.5 if i % 3 else 0.0, i % 3 == 1, "length" if i < 9 else "stop", 8192 if i < 9
                      else 1000) for i in range(20)]
    step_recs = [_rec(f"p{i}", 0, 0.75 if i % 3 else 0.25, i % 3 != 0, "stop", 900) for i in range(20)]
    metrics = {"base": model_metrics(base_recs), "step28": model_metrics(step_recs)}
    assert metrics["base"]["truncation_rate"] == pytest.approx(0.45)
    comps = stats.compare({"base": per_prompt_values(base_recs), "step28": per_prompt_values(step_recs)}, "base",
                          n_resamples=500)
    json_path, md_path = stats.write_results(tmp_path, metrics, comps, max_new_tokens=8192,
                                             extra={"config": {"n": 1}})
    assert sorted(os.listdir(tmp_path)) == ["results.json", "results.md"]  # no temp files left
    res = json.loads(json_path.read_text())
    assert res["warnings"] == ["base: truncation 45%: numbers are censored by the 8192-token cap"]
    assert res["config"] == {"n": 1}
    assert res["models"]["step28"]["partial_reward_mean"] == pytest.approx((13 * 0.75 + 7 * 0.25) / 20)
    assert res["models"]["base"]["pass_at_k"] == {"1": pytest.approx(7 / 20)}
    assert [c["metric"] for c in res["comparisons"]] == ["partial_reward_mean", "strict_rate"]
    part = res["comparisons"][0]
    assert part["diff"] == pytest.approx(0.25)  # every prompt +0.25: no spread, which is not certainty
    psi = 1 - 0.025 ** (1 / 20)
    assert part["test"] == "zero_spread" and part["ci_low"] == pytest.approx(0.25 - 1.25 * psi)
    assert part["ci_high"] == pytest.approx(0.25 + 0.75 * psi)
    md = md_path.read_text()
    assert "truncation 45%: numbers are censored by the 8192-token cap" in md
    lo, hi = part["ci_low"], part["ci_high"]
    assert (f"| step28 | base | partial_reward_mean | +0.2500 | 95% [{lo:+.4f}, {hi:+.4f}] | "
            f"[{part['simultaneous_ci_low']:+.4f}, {part['simultaneous_ci_high']:+.4f}] | 20 | ") in md
    assert "| base | 20 | 20 | 0.3250 |" in md  # without the analysis' intervals the plain value
    with pytest.raises(ValueError, match="extra key 'models'"):
        stats.write_results(tmp_path, metrics, comps, extra={"models": {}})
    with pytest.raises(KeyError, match=r"models_metrics\['x'\] lacks 'strict_rate'"):
        stats.write_results(tmp_path, {"x": {"partial_reward_mean": 0.0}}, [])
