"""No false alarm and no silent nothing: the pair audit re-scores with the reward the pairs were scored with (or
says it cannot judge), a partial chosen answer is no failure of its pair, `build_pairs` warns on a truncation
buffer at the cap and refuses a build that keeps no pair (nothing written), and `report` shows the evaluation its
checkpoint curves were drawn from."""

from __future__ import annotations

import json
from pathlib import Path

from jaxrl.utils.io import write_jsonl
from launcher_env import error_lines, launch, snapshot


def charset_pairs(folder: Path, reward_in_audit: str | None) -> tuple[Path, Path]:
    """The demo's task: problems asking for digits, pairs whose chosen answer is mostly digits (a partial score,
    as recorded by the charset reward) and whose rejected one is letters; plus one pair whose recorded 1.0 a
    re-run does not reproduce."""
    from jaxrl.demo import make_problems
    problems = make_problems(8, 0, "train")
    write_jsonl(folder / "problems.jsonl", problems)
    digits = [p for p in problems if p["metadata"]["kind"] == "digits"]
    pairs = [{"problem_id": p["id"], "messages": p["messages"], "chosen": "12a", "rejected": "abc",
              "chosen_reward": 2 / 3, "rejected_reward": 0.0, "chosen_tokens": 3, "rejected_tokens": 3,
              "pair_id": f"partial-{i}"} for i, p in enumerate(digits)]
    write_jsonl(folder / "pairs" / "pairs.jsonl", pairs)
    if reward_in_audit is not None:
        (folder / "pairs" / "audit.json").write_text(json.dumps({"reward": reward_in_audit}))
    return folder / "pairs" / "pairs.jsonl", folder / "problems.jsonl"


def test_the_audit_rescores_with_the_pairs_reward_and_a_partial_chosen_answer_is_no_failure(tmp_path):
    from jaxrl.diagnostics.pair_audit import audit_pairs
    pairs, problems = charset_pairs(tmp_path, "charset")
    audit = audit_pairs(pairs, problems=problems, sample_size=20)
    sem = audit["semantic"]
    assert (sem["reward"], sem["n_checked"], sem["n_failed"], sem["n_below_recorded"]) == ("charset", 4, 0, 0)
    assert sem["n_not_strict"] == 4  # partial solutions, recorded as such: counted, not flagged
    assert not [f for f in audit["flags"] if f["code"] == "semantic_failures_in_pairs"]


def test_the_audit_still_flags_a_recorded_reward_that_does_not_reproduce(tmp_path):
    from jaxrl.diagnostics.pair_audit import audit_pairs
    pairs, problems = charset_pairs(tmp_path, "charset")
    records = [json.loads(line) for line in pairs.read_text().splitlines()]
    records[0]["chosen_reward"] = 1.0  # recorded as a full score; "12a" is 2/3 digits
    write_jsonl(pairs, records)
    sem = audit_pairs(pairs, problems=problems, sample_size=20)["semantic"]
    assert (sem["n_failed"], sem["failures"][0]["pair_id"]) == (1, "partial-0")


def test_the_audit_says_it_cannot_judge_without_the_reward(tmp_path):
    from jaxrl.diagnostics.pair_audit import audit_pairs
    pairs, problems = charset_pairs(tmp_path, None)
    audit = audit_pairs(pairs, problems=problems)
    assert audit["semantic"]["reward"] is None
    assert audit["semantic"]["skipped"].startswith("cannot judge: the reward these pairs were scored with is unknown")
    assert not [f for f in audit["flags"] if f["code"] == "semantic_failures_in_pairs"]


def test_build_pairs_warns_on_a_buffer_at_the_cap_and_refuses_to_keep_no_pair(tmp_path):
    rollouts = tmp_path / "rollouts.jsonl"
    records = [{"problem_id": f"p{j}", "sample_index": i, "completion": "x" * (2 + i), "completion_tokens": 2 + i,
                "finish_reason": "stop", "reward": {"partial": p, "strict": p == 1.0}, "model": "m",
                "max_new_tokens": 8, "messages": [{"role": "user", "content": "q"}]}
               for j in range(3) for i, p in enumerate((1.0, 0.0))]
    write_jsonl(rollouts, records)
    (tmp_path / "rollouts.jsonl.meta.json").write_text(json.dumps({"settings": {"reward": "exact_match"}}))
    before = snapshot(tmp_path)
    proc = launch("build_pairs", f"--rollouts={rollouts}", f"--out_dir={tmp_path / 'pairs'}")  # buffer 24 > cap 8
    assert proc.returncode == 1, proc.stderr[-3000:]
    warning, line = error_lines(proc)
    assert warning.endswith(f"--truncation_buffer=24 >= max_new_tokens=8 (the cap of {rollouts}): every completion "
                            "counts as truncated and no pair can be kept; pass a --truncation_buffer below the cap "
                            "(e.g. 1)")
    assert line == (f"build_pairs: {rollouts}: no pair kept: 3 candidate pairs all dropped (first failing reason: "
                    "chosen_truncated 3); nothing written. Loosen the filter that drops them (--min_margin, "
                    "--truncation_buffer, --max_length_diff) or sample more completions a prompt")
    assert snapshot(tmp_path) == before
    kept = launch("build_pairs", f"--rollouts={rollouts}", f"--out_dir={tmp_path / 'pairs'}", "--truncation_buffer=1")
    assert kept.returncode == 0, kept.stderr[-3000:]
    assert json.loads((tmp_path / "pairs" / "audit.json").read_text())["reward"] == "exact_match"


def test_the_report_shows_the_evaluation_its_curves_were_drawn_from(tmp_path):
    from jaxrl.data import formats
    from jaxrl.diagnostics.curves import curves_from_eval_dir
    from jaxrl.diagnostics.report import build_report
    from jaxrl.evaluation.metrics import model_metrics, per_prompt_values
    from jaxrl.evaluation.stats import compare, write_results
    wd, eval_dev = tmp_path / "run", tmp_path / "run" / "eval_dev"
    samples = {name: [{"problem_id": f"p{i}", "sample_index": 0, "completion": "c", "completion_tokens": 5,
                       "finish_reason": "stop", "partial": float((i + shift) % 2), "strict": bool((i + shift) % 2),
                       "tests": [], "reason": None, "max_new_tokens": 8} for i in range(6)]
               for name, shift in (("base", 0), ("step_4", 1), ("step_8", 1))}
    for name, rows in samples.items():
        formats.write_samples(formats.samples_path(eval_dev, name), rows)
    write_results(eval_dev, {n: {**model_metrics(r), "step": formats.model_step(n)} for n, r in samples.items()},
                  compare({n: per_prompt_values(r) for n, r in samples.items()}, baseline="base", n_resamples=200),
                  max_new_tokens=8)
    # what `launchers.diagnose --what=curves --workdir=run --eval_dir=run/eval_dev` writes
    formats.write_diagnostic(formats.diagnostics_path(wd, "curves"), curves_from_eval_dir(eval_dev, n_resamples=200))
    page = build_report(wd).read_text()
    assert "No evaluation:" not in page and "step_8" in page and str(eval_dev) in page
