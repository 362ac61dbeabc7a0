"""Select on dev, confirm once on held-out: split identity from the manifest, the selection record, the one
confirmation per (weights, manifest, split), and the claim labels in the results."""

import json

import pytest

from jaxrl.data.problems import Problem
from jaxrl.data.splits import freeze_splits
from jaxrl.evaluation import protocol as P
from jaxrl.evaluation.analysis import analyze


def _problems(n=20):
    return [Problem.from_dict({"id": f"toy/{i:02d}", "messages": [{"role": "user", "content": f"q{i}"}],
                               "test_type": "stdin", "tests": [{"input": "", "output": "x"}]}) for i in range(n)]


def _results(split, fingerprints=("f_base", "f_a", "f_b")):
    """A results.json-like dict with a selection between step_4 (+0.05) and step_8 (+0.02)."""
    models = {n: {"step": s, "fingerprint": f, "adapter_digest": None,
                  "source": {"kind": "adapter" if s else "base", "path": f"/run/ckpt/{s}"}}
              for n, s, f in zip(("base", "step_4", "step_8"), (None, 4, 8), fingerprints)}
    comps = [{"model": m, "baseline": "base", "metric": "partial_reward_mean", "diff": d, "ci_low": d - 0.03,
              "ci_high": d + 0.03, "n_pairs": 10} for m, d in (("step_4", 0.05), ("step_8", 0.02))]
    return {"models": models, "comparisons": comps, "protocol": {"role": "selection", "split": split}}


@pytest.fixture()
def splits(tmp_path):
    problems = _problems()
    freeze_splits(problems, tmp_path / "splits", seed=0)
    return tmp_path / "splits"


def test_split_identity_comes_from_the_manifest(splits, tmp_path):
    dev = P.split_identity(splits / "dev.jsonl")
    held = P.split_identity(splits / "heldout.jsonl")
    assert dev["split"] == "dev" and held["split"] == "heldout" and dev["manifest_sha256"] == held["manifest_sha256"]
    assert dev["count"] + held["count"] == 20
    loose = tmp_path / "loose.jsonl"
    loose.write_text((splits / "dev.jsonl").read_text())
    assert P.split_identity(loose) is None
    (splits / "dev.jsonl").write_text((splits / "dev.jsonl").read_text() + "\n")
    with pytest.raises(P.ProtocolError, match="the split changed after it was frozen"):
        P.split_identity(splits / "dev.jsonl")


def test_a_reference_row_is_never_selected(splits, tmp_path):
    """A distillation's teacher shown as a reference (`--references`) beats every checkpoint; the selection still
    takes the best candidate. Before (2e1e1a6..this fix), write_selection took the best of every row: the teacher
    was selected and then confirmed on held-out as if it were the student (found by the reasoning-gym recipe)."""
    dev = P.split_identity(splits / "dev.jsonl")
    results = _results(dev)
    results["models"]["teacher"] = {"step": None, "fingerprint": "f_t", "adapter_digest": None, "reference": True,
                                    "source": {"kind": "hf", "path": "/models/teacher"}}
    results["comparisons"].append({"model": "teacher", "baseline": "base", "metric": "partial_reward_mean",
                                   "diff": 0.4, "ci_low": 0.3, "ci_high": 0.5, "n_pairs": 10, "reference": True})
    rec = P.write_selection(tmp_path / "eval_dev", results, metric="partial_reward_mean", base="/models/base")
    assert rec["model"]["name"] == "step_4" and rec["n_candidates"] == 2
    results["comparisons"] = [c for c in results["comparisons"] if c.get("reference")]
    with pytest.raises(P.ProtocolError, match="no comparison of a candidate"):
        P.write_selection(tmp_path / "eval_dev2", results, metric="partial_reward_mean", base="/models/base")


def test_select_then_confirm_once(splits, tmp_path):
    dev = P.split_identity(splits / "dev.jsonl")
    sel_dir = tmp_path / "eval_dev"
    rec = P.write_selection(sel_dir, _results(dev), metric="partial_reward_mean", base="/models/base")
    assert rec["model"]["name"] == "step_4" and rec["model"]["fingerprint"] == "f_a" and rec["n_candidates"] == 2
    selection = P.read_selection(sel_dir)
    with pytest.raises(P.ProtocolError, match="the one the model was selected on"):
        P.begin_confirmation(selection, splits / "dev.jsonl", tmp_path / "c0")
    other = tmp_path / "other"
    freeze_splits(_problems(30), other, seed=1)
    with pytest.raises(P.ProtocolError, match="confirm on the same manifest's other split"):
        P.begin_confirmation(selection, other / "heldout.jsonl", tmp_path / "c0")

    proto = P.begin_confirmation(selection, splits / "heldout.jsonl", tmp_path / "c1")
    assert proto["primary"] == {"model": "step_4", "metric": "partial_reward_mean", "baseline": "base"}
    assert P.read_protocol(tmp_path / "c1")["role"] == "confirmation"
    ledger = [json.loads(x) for x in (splits / P.LEDGER_FILE).read_text().splitlines()]
    assert len(ledger) == 1 and ledger[0]["fingerprint"] == "f_a" and ledger[0]["split"] == "heldout"
    # resuming the same confirmation folder is allowed, a second confirmation elsewhere is not
    P.begin_confirmation(selection, splits / "heldout.jsonl", tmp_path / "c1")
    assert len((splits / P.LEDGER_FILE).read_text().splitlines()) == 1
    with pytest.raises(P.ProtocolError, match="was already confirmed on split 'heldout'"):
        P.begin_confirmation(selection, splits / "heldout.jsonl", tmp_path / "c2")
    # the weights served must be the selected ones
    P.check_fingerprint(proto, {"step_4": "f_a", "base": "f_base"})
    with pytest.raises(P.ProtocolError, match="differ from the selected ones"):
        P.check_fingerprint(proto, {"step_4": "f_other"})


def test_claims_in_the_results(splits, tmp_path):
    rec = lambda pid, i, partial: {"problem_id": pid, "sample_index": i, "completion": "c", "completion_tokens": 5,  # noqa
                                   "finish_reason": "stop", "partial": partial, "strict": partial == 1.0,
                                   "tests": [], "reason": None, "max_new_tokens": 10}
    ids = [f"toy/{i:02d}" for i in range(12)]
    records = {"base": [rec(p, 0, 0.5) for p in ids], "step_4": [rec(p, 0, 0.75 if i % 2 else 0.5)
                                                                 for i, p in enumerate(ids)]}
    proto = {"role": "confirmation", "primary": {"model": "step_4", "metric": "partial_reward_mean",
                                                 "baseline": "base"}, "split": None}
    out = analyze(records, "base", protocol=proto, n_resamples=199)
    claims = {(c["model"], c["metric"]): c["claim"] for c in out["comparisons"]}
    assert claims.pop(("step_4", "partial_reward_mean")) == "confirmatory"
    assert set(claims.values()) == {"exploratory"}
    # several models compared on a held-out split without a protocol: a warning says what that spends
    records["step_8"] = records["step_4"]
    out = analyze(records, "base", problems=str(splits / "heldout.jsonl"), n_resamples=199)
    assert out["protocol"]["split"]["split"] == "heldout"
    assert any("spends this split on the selection" in w for w in out["warnings"])
    assert all(c["claim"] == "exploratory" for c in out["comparisons"])
