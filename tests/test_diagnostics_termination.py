"""Termination analysis: reward vs length, censoring flags, metrics without truncation and after re-sampling."""

import pytest

from jaxrl.diagnostics.termination import resample_truncated, reward_vs_length, termination_analysis
from jaxrl.evaluation.metrics import model_metrics


def rec(pid, partial, tokens, finish="stop", idx=0, cap=100):
    return {"problem_id": pid, "sample_index": idx, "completion": "x", "completion_tokens": tokens,
            "finish_reason": finish, "partial": partial, "strict": partial == 1.0, "tests": [],
            "reason": "truncated" if finish == "length" else None, "max_new_tokens": cap}


def censored_model():
    """10 prompts: 6 finish (partial 1.0 when short, 0.5 when long), 4 hit the 100-token cap (scored 0)."""
    return ([rec(f"p{i}", 1.0, 10 + i) for i in range(3)] + [rec(f"p{i}", 0.5, 60 + i) for i in range(3, 6)]
            + [rec(f"p{i}", 0.0, 100, "length") for i in range(6, 10)])


def test_reward_vs_length_bins():
    bins = reward_vs_length(censored_model(), n_bins=4)  # edges 0, 25, 50, 75, 100 (the cap)
    assert [b["n"] for b in bins] == [3, 0, 3, 4]
    assert bins[0]["partial_mean"] == 1.0 and bins[1]["partial_mean"] is None
    assert bins[2]["partial_mean"] == 0.5 and bins[2]["truncated_fraction"] == 0.0
    assert bins[3]["partial_mean"] == 0.0 and bins[3]["truncated_fraction"] == 1.0
    assert bins[3]["hi"] == 100.0


def test_termination_analysis_flags_censoring_and_reports_untruncated_metrics():
    clean = [rec(f"p{i}", 1.0, 20) for i in range(10)]
    slightly = [rec(f"p{i}", 1.0, 20) for i in range(8)] + [rec(f"p{i}", 0.0, 100, "length") for i in (8, 9)]
    t = termination_analysis({"base": censored_model(), "step_4": slightly, "step_8": clean})
    m = t["models"]["base"]
    assert m["n_truncated"] == 4 and m["truncation_rate"] == pytest.approx(0.4) and m["max_new_tokens"] == 100
    assert m["metrics"]["partial_reward_mean"] == pytest.approx(0.45)
    assert m["metrics"]["untruncated"]["partial_reward_mean"] == pytest.approx(0.75)
    assert m["metrics"]["untruncated"]["n_samples"] == 6
    assert m["reward_truncated_mean"] == 0.0 and m["reward_finished_mean"] == pytest.approx(0.75)
    assert m["reasons"] == {"truncated": 4}
    by_model = {f["evidence"]["model"]: f for f in t["flags"]}
    assert set(by_model) == {"base", "step_4"}  # 0% is not flagged
    assert by_model["base"]["severity"] == "error"  # 40% > 3 x 10%
    assert by_model["step_4"]["severity"] == "warning"
    assert "truncation 40%" in by_model["base"]["message"] and "100-token cap" in by_model["base"]["message"]
    assert "4 of 10 samples" in by_model["base"]["message"]


def test_resample_truncated_reruns_only_the_truncated_prompts():
    records = censored_model()
    calls = []

    def resample_fn(problem_ids, max_new_tokens):
        calls.append((list(problem_ids), max_new_tokens))
        # At 400 tokens, three of the four finish and solve the problem; p9 still runs out.
        return [rec(pid, 0.0, 400, "length", cap=400) if pid == "p9" else rec(pid, 1.0, 250, cap=400)
                for pid in problem_ids]

    r = resample_truncated(records, resample_fn, 400, n_resamples=500)
    assert calls == [(["p6", "p7", "p8", "p9"], 400)]
    assert r["n_resampled"] == 4 and r["still_truncated"] == 1
    assert r["before"]["partial_reward_mean"] == pytest.approx(0.45)
    assert r["after"]["partial_reward_mean"] == pytest.approx(0.75)
    assert r["after"]["truncation_rate"] == pytest.approx(0.1)
    assert r["after"] == model_metrics(r["records"])
    diff = {c["metric"]: c for c in r["comparisons"]}
    assert diff["partial_reward_mean"]["diff"] == pytest.approx(0.3)
    assert diff["truncation_rate"]["diff"] == pytest.approx(-0.3)
    assert diff["partial_reward_mean"]["n_pairs"] == 10
    untouched = {x["problem_id"]: x for x in r["records"]}
    assert untouched["p0"] is records[0] and untouched["p6"]["resampled"] is True


def test_resample_truncated_rejects_bad_inputs():
    records = censored_model()
    with pytest.raises(ValueError, match="must exceed the original cap 100"):
        resample_truncated(records, lambda ids, cap: [], 100)
    with pytest.raises(ValueError, match="returned 1 records for 4 truncated samples"):
        resample_truncated(records, lambda ids, cap: [rec("p6", 1.0, 5)], 400)
    with pytest.raises(ValueError, match="record 0: problem_id 'p9', expected 'p6'"):
        resample_truncated(records, lambda ids, cap: [rec(p, 1.0, 5) for p in reversed(ids)], 400)
    with pytest.raises(ValueError, match="record 0: missing key 'sample_index'"):
        resample_truncated(records, lambda ids, cap: [{"problem_id": p} for p in ids], 400)
