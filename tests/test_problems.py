"""The canonical problems schema, loading (JSONL and parquet through datasets), importers and frozen splits."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from jaxrl.data.importers import (decode_lcb_private_tests, encode_lcb_private_tests, humaneval_problem,
                                  import_file, lcb_problem, nemotron_problem)
from jaxrl.data.problems import (Problem, ProblemFormatError, load_problems, load_problems_dataset, read_problems,
                                 save_problems)
from jaxrl.data.splits import (SplitIntegrityError, assign_split, freeze_splits, load_split, read_manifest,
                               verify_split)
from jaxrl.utils.io import atomic_write_bytes

REPO = Path(__file__).parent.parent


def record(**overrides) -> dict:
    base = {"id": "p1", "messages": [{"role": "user", "content": "Add two numbers."}], "test_type": "stdin",
            "fn_name": None, "starter_code": "", "tests": [{"input": "1 2\n", "output": "3\n"}],
            "time_limit_s": None, "source": "unit"}
    base.update(overrides)
    return base


def functional_record(**overrides) -> dict:
    return record(**{"test_type": "functional", "fn_name": "add", "tests": [{"input": "1\n2", "output": "3"}],
                     **overrides})


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


# ---------------------------------------------------------------------------------------------------- schema
def test_round_trip_and_fingerprint():
    problem = Problem.from_dict(record(metadata={"difficulty": "easy"}))
    assert Problem.from_dict(problem.to_dict()) == problem
    assert list(problem.to_dict()) == ["id", "messages", "test_type", "fn_name", "starter_code", "tests",
                                       "time_limit_s", "source", "metadata"]
    assert problem.fingerprint == Problem.from_dict(json.loads(problem.to_json())).fingerprint
    changed = Problem.from_dict(record(tests=[{"input": "1 2\n", "output": "4\n"}]))
    assert changed.fingerprint != problem.fingerprint


def test_optional_keys_default():
    minimal = {k: v for k, v in record().items() if k in ("id", "messages", "test_type", "tests")}
    problem = Problem.from_dict(minimal)
    assert (problem.fn_name, problem.starter_code, problem.time_limit_s, problem.source) == (None, "", None, "")


@pytest.mark.parametrize("bad,key,message", [
    (record(extra=1), "extra", "unknown key"),
    ({k: v for k, v in record().items() if k != "tests"}, "tests", "missing"),
    (record(id=""), "id", "non-empty"),
    (record(messages=[]), "messages", "non-empty"),
    (record(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", "must be one of"),
    (record(messages=[{"role": "user", "content": 3}]), "messages[0].content", "string"),
    (record(test_type="interactive"), "test_type", "must be one of"),
    (record(fn_name="add"), "fn_name", "null for stdin"),
    (record(test_type="functional", fn_name=None), "fn_name", "function name"),
    (record(test_type="functional", fn_name="not an identifier"), "fn_name", "identifier"),
    (record(tests=[]), "tests", "non-empty"),
    (record(tests=[{"input": "1", "output": 3}]), "tests[0].output", "string"),
    (record(tests=[{"input": "1", "output": "3", "testtype": "stdin"}]), "tests[0].testtype", "unknown key"),
    (functional_record(tests=[{"input": "1\nnot json", "output": "3"}]), "tests[0].input", "line 2"),
    (functional_record(tests=[{"input": "1", "output": "three"}]), "tests[0].output", "JSON"),
    (record(time_limit_s=-1), "time_limit_s", "positive"),
    (record(time_limit_s=True), "time_limit_s", "positive"),
    (record(metadata=[1]), "metadata", "object"),
    ([1, 2], None, "JSON object"),
])
def test_malformed_records_name_the_key(bad, key, message):
    with pytest.raises(ProblemFormatError, match=message) as info:
        Problem.from_dict(bad, where="data.jsonl:7")
    assert info.value.where == "data.jsonl:7" and info.value.key == key
    assert str(info.value).startswith("data.jsonl:7: ")


def test_load_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [record(id="a"), "", record(id="b", test_type="bogus")])
    with pytest.raises(ProblemFormatError) as info:
        load_problems(path)
    assert f"{path}:3" in str(info.value) and "test_type" in str(info.value)


def test_load_invalid_json_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [record(id="a"), '{"id": "b", broken'])
    with pytest.raises(ProblemFormatError, match=rf"{path}:2: invalid JSON"):
        load_problems(path)


def test_duplicate_ids_are_malformed(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [record(id="a"), record(id="a")])
    with pytest.raises(ProblemFormatError, match=r"p.jsonl:2: key 'id': duplicate id 'a' \(first at .*p.jsonl:1\)"):
        load_problems(path)


def test_skip_malformed_counts(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [record(id="a"), "not json", record(id="b", tests=[]), record(id="c")])
    loaded = read_problems(path, skip_malformed=True)
    assert [p.id for p in loaded.problems] == ["a", "c"]
    assert len(loaded.skipped) == 2
    assert f"{path}:2" in loaded.skipped[0] and f"{path}:3" in loaded.skipped[1]


def test_shipped_toy_tasks_are_valid():
    problems = load_problems(REPO / "jaxrl" / "assets" / "tasks" / "problems.jsonl")
    assert len(problems) >= 6 and {p.test_type for p in problems} == {"stdin", "functional"}


def test_parquet_round_trip_through_datasets(tmp_path):
    problems = [Problem.from_dict(record(id="a", metadata={"difficulty": "easy"})),
                Problem.from_dict(functional_record(id="b", time_limit_s=2.5))]
    save_problems(problems, tmp_path / "p.parquet")
    assert load_problems(tmp_path / "p.parquet") == problems
    dataset = load_problems_dataset(tmp_path / "p.parquet")
    assert len(dataset) == 2 and dataset[1]["fn_name"] == "add" and json.loads(dataset[0]["metadata"]) == {
        "difficulty": "easy"}
    jsonl = save_problems(problems, tmp_path / "p.jsonl")
    assert load_problems_dataset(tmp_path / "p.jsonl")["id"] == ["a", "b"]
    assert len(jsonl) == 64


def test_parquet_errors_name_the_row(tmp_path):
    import datasets

    rows = [record(id="a"), record(id="b", test_type="bogus")]
    for row in rows:
        row["metadata"] = "{}"
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ProblemFormatError, match=r"bad.parquet row 1: key 'test_type'"):
        load_problems(tmp_path / "bad.parquet")


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "p.jsonl"
    save_problems([Problem.from_dict(record(id="old"))], target)
    before = target.read_bytes()

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(target, b"half written")
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


# ------------------------------------------------------------------------------------------------- importers
def lcb_record(**overrides) -> dict:
    base = {
        "question_title": "Double", "question_content": "Print twice the input.", "platform": "atcoder",
        "question_id": "abc999_a", "contest_id": "abc999", "contest_date": "2025-01-11T18:30:00",
        "starter_code": "", "difficulty": "easy",
        "public_test_cases": json.dumps([{"input": "2\n", "output": "4\n", "testtype": "stdin"}]),
        "private_test_cases": encode_lcb_private_tests([{"input": "5\n", "output": "10\n", "testtype": "stdin"},
                                                        {"input": "0\n", "output": "0\n", "testtype": "stdin"}]),
        "metadata": "{}",
    }
    base.update(overrides)
    return base


def test_lcb_stdin_record_with_compressed_private_tests():
    problem = lcb_problem(lcb_record(), "lcb.jsonl:1")
    assert problem.id == "lcb/abc999_a" and problem.test_type == "stdin" and problem.fn_name is None
    assert [(t.input, t.output) for t in problem.tests] == [("2\n", "4\n"), ("5\n", "10\n"), ("0\n", "0\n")]
    assert "Print twice the input." in problem.messages[-1]["content"]
    assert problem.metadata["contest_date"] == "2025-01-11T18:30:00"


def test_lcb_functional_record_with_plain_json_private_tests():
    problem = lcb_problem(lcb_record(
        question_id="3708", platform="leetcode",
        starter_code="class Solution:\n    def double(self, x: int) -> int:\n        ",
        public_test_cases=json.dumps([{"input": "2", "output": "4", "testtype": "functional"}]),
        private_test_cases=json.dumps([{"input": "7", "output": "14", "testtype": "functional"}]),
        metadata=json.dumps({"func_name": "double"})), "lcb.jsonl:2")
    assert problem.test_type == "functional" and problem.fn_name == "double" and len(problem.tests) == 2
    assert "class Solution" in problem.messages[-1]["content"]


def test_lcb_private_tests_refuse_pickled_globals(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    malicious = base64.b64encode(zlib.compress(pickle.dumps(Exploit()))).decode()
    with pytest.raises(ProblemFormatError, match="private_test_cases.*refusing global"):
        lcb_problem(lcb_record(private_test_cases=malicious), "lcb.jsonl:3")
    assert not marker.exists()
    assert decode_lcb_private_tests(encode_lcb_private_tests([{"input": "1", "output": "2"}])) == [
        {"input": "1", "output": "2"}]


def test_lcb_import_then_grade_end_to_end(tmp_path):
    from jaxrl.rewards import CodeVerifier

    path = write_jsonl(tmp_path / "test6.jsonl", [lcb_record()])
    (problem,) = import_file(path, "lcb").problems
    with CodeVerifier(timeout_s=20.0, workers=1) as verifier:
        right, wrong = verifier.score(["```python\nprint(2 * int(input()))\n```",
                                       "```python\nprint(int(input()) + 2)\n```"], [problem, problem])
    assert right.strict and wrong.tests == ["pass", "wrong", "wrong"]


def nemotron_record(**overrides) -> dict:
    base = {"responses_create_params": {"input": [{"role": "user", "content": "Read n, print n squared."}]},
            "verifier_metadata": {"unit_tests": {"inputs": ["3\n", "4\n"], "outputs": ["9\n", "16\n"]}},
            "hash_id": "c69268d8", "dataset": "taco", "source": "codeforces"}
    base.update(overrides)
    return base


def test_nemotron_record():
    problem = nemotron_problem(nemotron_record(), "nemo.jsonl:1")
    assert problem.id == "nemotron/c69268d8" and problem.source == "nemotron/taco"
    assert problem.test_type == "stdin" and len(problem.tests) == 2
    content = [{"type": "input_text", "text": "Read n, "}, {"type": "input_text", "text": "go"}]
    parts = nemotron_problem(nemotron_record(responses_create_params={"input": [{"role": "user", "content": content}]}),
                             "nemo.jsonl:2")
    assert parts.messages[0]["content"] == "Read n, go"
    functional = nemotron_problem(nemotron_record(verifier_metadata={"unit_tests": {
        "inputs": ["[1, 2]"], "outputs": ["3"], "fn_name": "total"}}), "nemo.jsonl:3")
    assert functional.test_type == "functional" and functional.fn_name == "total"


@pytest.mark.parametrize("bad,message", [
    (nemotron_record(verifier_metadata={}), "unit_tests"),
    (nemotron_record(verifier_metadata={"unit_tests": {"inputs": ["1"], "outputs": []}}), "1 inputs but 0 outputs"),
    (nemotron_record(hash_id=None), "hash_id"),
    (nemotron_record(responses_create_params=None), "responses_create_params"),
])
def test_nemotron_malformed(bad, message):
    with pytest.raises(ProblemFormatError, match=message):
        nemotron_problem(bad, "nemo.jsonl:9")


def test_nemotron_file_with_a_bad_line(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [nemotron_record(), nemotron_record(hash_id="x2",
                                                                                     verifier_metadata={})])
    with pytest.raises(ProblemFormatError, match=rf"{path}:2"):
        import_file(path, "nemotron")
    result = import_file(path, "nemotron", skip_malformed=True)
    assert len(result.problems) == 1 and len(result.skipped) == 1


HUMANEVAL_TEST = '''
METADATA = {"author": "x"}


def check(candidate):
    assert True, "trivial"
    assert candidate([1, 2]) == 3
    assert 7 == candidate([3, 4])
    assert candidate([]) is False or True
    assert candidate([5]) == (5, 0)
    assert not candidate([0])
    assert abs(candidate([1.5]) - 1.5) < 1e-6
    for x in range(3):
        assert candidate([x]) == x
'''


def test_humaneval_asserts_split_into_functional_tests():
    problem = humaneval_problem({"task_id": "HumanEval/999", "prompt": "def total(xs):\n    \"\"\"Sum.\"\"\"\n",
                                 "entry_point": "total", "canonical_solution": "    return sum(xs)\n",
                                 "test": HUMANEVAL_TEST}, "he.jsonl:1")
    assert [(t.input, t.output) for t in problem.tests] == [("[1, 2]", "3"), ("[3, 4]", "7"), ("[5]", "[5, 0]"),
                                                            ("[0]", "false")]
    assert problem.metadata == {"asserts_converted": 4, "asserts_unconverted": 3}
    assert problem.fn_name == "total" and problem.starter_code.startswith("def total")
    with pytest.raises(ProblemFormatError, match="3 assert"):
        humaneval_problem({"task_id": "x", "prompt": "", "entry_point": "total", "test": HUMANEVAL_TEST},
                          "he.jsonl:2", require_all_asserts=True)


def test_humaneval_literals_must_survive_json():
    test = "def check(candidate):\n    assert candidate({1: 2}) == 1\n    assert candidate(1) == 1.0\n" \
           "    assert candidate(2) == 2\n"
    problem = humaneval_problem({"task_id": "x", "prompt": "", "entry_point": "f", "test": test}, "he:1")
    # {1: 2} would arrive as {"1": 2}; 1.0 and 1 are kept apart by type, so that assert is still exact
    assert [(t.input, t.output) for t in problem.tests] == [("1", "1.0"), ("2", "2")]


# ---------------------------------------------------------------------------------------------------- splits
def many_problems(n: int, prefix: str = "p") -> list[Problem]:
    return [Problem.from_dict(record(id=f"{prefix}{i:03d}")) for i in range(n)]


def test_freeze_splits_writes_files_and_manifest(tmp_path):
    problems = many_problems(60)
    manifest = freeze_splits(problems[::-1], tmp_path, seed=3, source_path=None)
    assert manifest == read_manifest(tmp_path)
    dev, held = manifest["splits"]["dev"], manifest["splits"]["heldout"]
    assert dev["count"] + held["count"] == 60 and 15 < dev["count"] < 45
    assert set(dev["ids"]).isdisjoint(held["ids"]) and sorted(dev["ids"] + held["ids"]) == [p.id for p in problems]
    assert [p.id for p in load_split(tmp_path, "heldout")] == held["ids"]
    # same input in another order, same seed: byte-identical files
    other = tmp_path / "again"
    assert freeze_splits(problems, other, seed=3)["splits"] == manifest["splits"]
    assert (other / "dev.jsonl").read_bytes() == (tmp_path / "dev.jsonl").read_bytes()
    assert freeze_splits(problems, tmp_path / "seed4", seed=4)["splits"]["dev"]["ids"] != dev["ids"]


def test_split_assignment_is_stable_when_data_is_added(tmp_path):
    fractions = {"dev": 0.5, "heldout": 0.5}
    before = {p.id: assign_split(p.id, 0, fractions) for p in many_problems(50)}
    freeze_splits(many_problems(50) + many_problems(30, prefix="new"), tmp_path, seed=0)
    after = read_manifest(tmp_path)["splits"]
    assert {i: ("dev" if i in after["dev"]["ids"] else "heldout") for i in before} == before


def test_tampered_split_is_detected(tmp_path):
    freeze_splits(many_problems(20), tmp_path, seed=0, source_path=None)
    verify_split(tmp_path, "heldout")
    path = tmp_path / "heldout.jsonl"
    path.write_text(path.read_text().replace('"3\\n"', '"4\\n"', 1))
    with pytest.raises(SplitIntegrityError, match="sha256"):
        load_split(tmp_path, "heldout")
    with pytest.raises(KeyError, match="no split"):
        verify_split(tmp_path, "test")


def test_refreezing_with_different_content_is_refused(tmp_path):
    freeze_splits(many_problems(20), tmp_path, seed=0)
    freeze_splits(many_problems(20), tmp_path, seed=0)  # identical: fine
    with pytest.raises(SplitIntegrityError, match="would change"):
        freeze_splits(many_problems(21), tmp_path, seed=0)
    freeze_splits(many_problems(21), tmp_path, seed=0, overwrite=True)
    assert read_manifest(tmp_path)["splits"]["dev"]["count"] + read_manifest(tmp_path)["splits"]["heldout"][
        "count"] == 21


@pytest.mark.parametrize("fractions", [{"dev": 0.6, "heldout": 0.6}, {"dev": -0.1, "heldout": 1.1}, {}])
def test_bad_fractions(tmp_path, fractions):
    with pytest.raises(ValueError):
        freeze_splits(many_problems(3), tmp_path, fractions=fractions)


# -------------------------------------------------------------------------------------------------- launcher
def test_import_launcher_converts_and_freezes(tmp_path):
    source = write_jsonl(tmp_path / "test6.jsonl", [lcb_record(question_id=f"abc{i}_a") for i in range(10)]
                         + ["{not json"])
    out = tmp_path / "lcb.jsonl"
    cmd = [sys.executable, "-m", "launchers.import_problems", "--format=lcb", f"--input={source}",
           f"--output={out}", "--split", "--seed=1", "--dev_fraction=0.3"]
    failed = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert failed.returncode != 0 and f"{source}:11" in failed.stderr
    done = subprocess.run(cmd + ["--skip_malformed"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skipped 1 malformed" in done.stdout
    assert len(load_problems(out)) == 10
    manifest = read_manifest(tmp_path / "lcb_splits")
    assert manifest["seed"] == 1 and manifest["fractions"] == {"dev": 0.3, "heldout": 0.7}
    assert manifest["source"]["path"] == str(out)
    assert sum(s["count"] for s in manifest["splits"].values()) == 10
