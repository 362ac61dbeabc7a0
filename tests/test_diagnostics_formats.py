"""Readers and validators of the files the diagnostics consume (jaxrl.data.formats)."""

import json

import pytest

from jaxrl.utils.io import JsonlError, write_jsonl
from jaxrl.data import formats
from jaxrl.evaluation.metrics import model_metrics, per_prompt_values
from jaxrl.evaluation.stats import compare, write_results


def _s(pid, idx=0, partial=1.0, tokens=10, finish="stop", **kw):
    rec = {"problem_id": pid, "sample_index": idx, "completion": "x", "completion_tokens": tokens,
           "finish_reason": finish, "partial": partial, "strict": partial == 1.0, "tests": ["pass"],
           "reason": None, "max_new_tokens": 64}
    rec.update(kw)
    return rec


def test_training_metrics_resume_keeps_last_record_and_sorts(tmp_path):
    p = tmp_path / "metrics.jsonl"
    # A resumed run re-logs step 2: the later record wins; NaN (a diverging loss) is accepted.
    p.write_text('{"step": 1, "loss": 0.7}\n{"step": 3, "loss": 0.5}\n{"step": 2, "loss": 9.0}\n'
                 '{"step": 2, "loss": 0.6, "nonfinite": false}\n{"step": 4, "loss": NaN, "nonfinite": true}\n')
    recs = formats.read_training_metrics(p)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[1]["loss"] == 0.6
    assert recs[3]["nonfinite"] is True


def test_eval_records_merge_into_their_step_and_rl_names_are_aliased(tmp_path):
    # The DPO trainer logs a train record and then an eval_* record for a checkpoint step: neither may be lost.
    # GRPO / PPO log namespaced names ("reward/mean"); the report reads them under its own keys.
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 4, "loss": 0.6, "preference_accuracy": 0.75}\n{"step": 4, "eval_loss": 0.65}\n'
                 '{"step": 5, "reward/mean": 0.5, "reward/std": 0.1, "completion/truncation_rate": 0.25, '
                 '"clip_fraction/region": 0.0, "kl": 0.01, "vf_loss": 0.3}\n')
    recs = formats.read_training_metrics(p)
    assert recs[0]["loss"] == 0.6 and recs[0]["preference_accuracy"] == 0.75 and recs[0]["eval_loss"] == 0.65
    assert (recs[1]["reward_mean"], recs[1]["reward_std"], recs[1]["truncation_rate"]) == (0.5, 0.1, 0.25)
    assert recs[1]["clip_fraction"] == 0.0 and recs[1]["kl"] == 0.01 and recs[1]["value_loss"] == 0.3


def test_training_metrics_as_the_trainer_writes_them(tmp_path):
    # jaxrl.train: non-finite values as null, update_skipped 0/1, a reason string and a list of groups.
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 0.7, "update_skipped": 0, "skipped_updates": 0, "nonfinite_groups": []}\n'
                 '{"step": 2, "loss": null, "update_skipped": 1, "skipped_updates": 1, "loss_finite": false, '
                 '"nonfinite_reason": "loss is nan", "nonfinite_groups": ["q_proj"]}\n')
    recs = formats.read_training_metrics(p)
    assert [r["nonfinite"] for r in recs] == [False, True]
    assert recs[1]["nonfinite_groups"] == ["q_proj"]
    from jaxrl.diagnostics.red_flags import nonfinite_updates
    flag = nonfinite_updates(recs)
    assert flag.evidence["steps"] == [2] and "reported: loss is nan" in flag.message


@pytest.mark.parametrize("line,needle", [
    ('{"loss": 0.5}', "missing key 'step'"),
    ('{"step": -1}', "key 'step'"),
    ('{"step": 1, "loss": "high"}', "key 'loss'"),
    ('{"step": 1, "nonfinite": 3}', "key 'nonfinite'"),
    ('{"step": 1, "update_skipped": "yes"}', "key 'update_skipped'"),
])
def test_training_metrics_errors_name_file_line_and_key(tmp_path, line, needle):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0, "loss": 1.0}\n' + line + "\n")
    with pytest.raises(JsonlError) as e:
        formats.read_training_metrics(p)
    assert str(e.value).startswith(f"{p}:2: ") and needle in str(e.value)


def test_results_written_by_the_evaluator_validate_and_errors_name_the_key(tmp_path):
    recs = {"base": [_s("a", partial=0.0), _s("b")], "step_4": [_s("a"), _s("b")]}
    metrics = {n: {**model_metrics(r), "step": formats.model_step(n)} for n, r in recs.items()}
    comps = compare({n: per_prompt_values(r) for n, r in recs.items()}, baseline="base", n_resamples=200)
    path, _ = write_results(tmp_path, metrics, comps)
    res = formats.read_results(tmp_path)  # a folder works too
    assert res["models"]["step_4"]["step"] == 4
    assert formats.model_step("base", res["models"]["base"]) == 0

    bad = json.loads(path.read_text())
    del bad["models"]["step_4"]["strict_rate"]
    path.write_text(json.dumps(bad))
    with pytest.raises(formats.FormatError, match=r"results.json: models\['step_4'\]: missing key 'strict_rate'"):
        formats.read_results(path)
    bad["models"]["step_4"]["strict_rate"] = 1.5
    path.write_text(json.dumps(bad))
    with pytest.raises(formats.FormatError, match="strict_rate' = 1.5 is outside"):
        formats.read_results(path)
    bad["models"]["step_4"]["strict_rate"] = 1.0
    bad["comparisons"][0]["baseline"] = "nope"
    path.write_text(json.dumps(bad))
    with pytest.raises(formats.FormatError, match=r"comparisons\[0\]: baseline 'nope'"):
        formats.read_results(path)
    path.write_text('{"models": {\n')
    with pytest.raises(formats.FormatError, match="invalid JSON at line 2"):
        formats.read_results(path)


def test_model_step_and_order():
    assert formats.model_step("step_125") == 125
    assert formats.model_step("base") == 0
    assert formats.model_step("m0") is None
    assert formats.model_step("x", {"step": 7}) == 7
    assert sorted(["step_40", "m0", "step_8", "base"], key=formats.model_order) == ["base", "step_8", "step_40", "m0"]


def test_samples_roundtrip_and_errors(tmp_path):
    path = formats.samples_path(tmp_path, "base")
    formats.write_samples(path, [_s("a"), _s("a", 1, 0.5, finish="length", reason="truncated")])
    recs = formats.read_samples(path)
    assert [(r["problem_id"], r["sample_index"], r["finish_reason"]) for r in recs] == \
        [("a", 0, "stop"), ("a", 1, "length")]
    assert formats.available_samples(tmp_path) == {"base": path}
    with pytest.raises(ValueError, match="record 1: key 'finish_reason'"):
        formats.write_samples(path, [_s("a"), _s("b", finish="eos")])
    with pytest.raises(ValueError, match="record 0: missing key 'tests'"):
        formats.write_samples(path, [{k: v for k, v in _s("a").items() if k != "tests"}])
    write_jsonl(path, [_s("a"), _s("b"), _s("a")])
    with pytest.raises(JsonlError, match=r":3: duplicate sample .*first at line 1"):
        formats.read_samples(path)
    write_jsonl(path, [_s("a", partial=2.0)])
    with pytest.raises(JsonlError, match=r":1: key 'partial'"):
        formats.read_samples(path)
