"""The small items of issue 33: a functional problem named after a keyword is refused, `rollout` refuses greedy
decoding with several samples as `evaluate` does, the import log no longer says "wrote" beside "unchanged", and
`export --merge` ends with one summary line instead of its provenance record as JSON."""

from __future__ import annotations

import json

import pytest

import launcher_env
from launcher_env import error_lines, launch


def test_a_functional_problem_named_class_is_refused(tmp_path):
    from jaxrl.data.problems import ProblemFormatError, load_problems
    record = {"id": "kw", "messages": [{"role": "user", "content": "q"}], "test_type": "functional",
              "fn_name": "class", "starter_code": "", "tests": [{"input": "[1]", "output": "1"}]}
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ProblemFormatError, match=rf"^{path}:1: .*fn_name.*'class' is a Python keyword"):
        load_problems(path)


@pytest.mark.slow  # the rollout launcher imports jax before it refuses
def test_rollout_refuses_greedy_decoding_with_several_samples(tmp_path):
    proc = launch("rollout", f"--problems={launcher_env.TASKS}", "--model=unused", f"--out={tmp_path / 'r.jsonl'}",
                  "--temperature=0", "--num_samples=4")
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = error_lines(proc)
    assert line.startswith("rollout: temperature 0 with num_samples=4: greedy decoding repeats the same completion")
    assert list(tmp_path.iterdir()) == []


def test_the_import_log_says_what_it_did_once(tmp_path):
    out = tmp_path / "problems.jsonl"
    args = ("--format=problems", f"--input={launcher_env.TASKS}", f"--output={out}")
    first, again = launch("import_problems", *args), launch("import_problems", *args)
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    assert first.stdout.strip().endswith("(written)") and "wrote" not in first.stderr
    assert again.stdout.strip().endswith("(unchanged: it already held them; nothing written)")
    assert "wrote" not in again.stdout + again.stderr


@pytest.mark.slow  # a merged export of the tiny model
def test_export_merge_prints_one_summary_line(tmp_path):
    env = launcher_env.build(tmp_path / "env", n_problems=1)
    out = tmp_path / "merged"
    proc = launch("export", f"--checkpoint={env['run']}", f"--base={env['model']}", f"--out={out}", "--merge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = proc.stdout.strip().splitlines()
    assert line.startswith(f"export: wrote the merged checkpoint of step 5 to {out} (2 modules, rank 2, adapter "
                           "digest ")
    assert line.endswith("); details in jaxrl_export.json")
    assert json.loads((out / "jaxrl_export.json").read_text())["step"] == 5
