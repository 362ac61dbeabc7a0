"""Extraction, comparison, status classification, toy rewards and the reward registry (no sandbox needed)."""

from __future__ import annotations

import signal

import pytest

from jaxrl.rewards import (ArithmeticReward, CodeVerifier, ExactMatchReward, PatternReward, Reward, RewardResult,
                           available_rewards, get_reward, register_reward)
from jaxrl.rewards.base import normalize_truncated
from jaxrl.rewards.code import LCB_PREAMBLE, classify
from jaxrl.rewards.compare import functional_matches, stdout_matches
from jaxrl.rewards.extract import closed_fences, extract_code, strip_reasoning
from jaxrl.rewards.sandbox import Execution, Isolation
from jaxrl.rewards.toy import evaluate_arithmetic


# ------------------------------------------------------------------------------------------------ extraction
@pytest.mark.parametrize("completion,code,reason", [
    ("```python\nprint(1)\n```", "print(1)\n", None),
    ("```py\nprint(1)\n```", "print(1)\n", None),
    ("```\nprint(1)\n```", "print(1)\n", None),
    ("first\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```", "print(2)\n", None),
    # a tagged block wins over a later untagged one; another language never runs
    ("```python\nprint(1)\n```\n```\nplain\n```", "print(1)\n", None),
    ("```cpp\nint main(){}\n```", None, "no_code"),
    # the last *closed* block: a trailing unclosed fence (truncation) is ignored
    ("```python\nprint(1)\n```\n```python\nprint(2", "print(1)\n", None),
    ("```python\nprint(2", None, "no_code"),
    ("no code at all", None, "no_code"),
    ("```python\n\n```", None, "no_code"),
    # reasoning is stripped; code inside it never counts
    ("<think>```python\nprint(0)\n```</think>```python\nprint(1)\n```", "print(1)\n", None),
    ("<think>```python\nprint(0)\n```</think>no code here", None, "no_code"),
    ("<think>still thinking ```python\nprint(0)\n```", None, "unclosed_think"),
    # Qwen3 templates put <think> in the prompt: the completion holds only the closing tag
    ("reasoning...</think>\n```python\nprint(1)\n```", "print(1)\n", None),
    ("</think>done<think>again ```python\nprint(0)\n```", None, "unclosed_think"),
    ("  ```python\n  indented = 1\n  ```", "  indented = 1\n", None),
])
def test_extract_code(completion, code, reason):
    extraction = extract_code(completion)
    assert (extraction.code, extraction.reason) == (code, reason)


def test_strip_reasoning_and_fences():
    assert strip_reasoning("<think>a</think>b") == "b"
    assert strip_reasoning("<think>a") is None
    assert closed_fences("```Python3 extra\nx\n```") == [("python3", "x")]


# ------------------------------------------------------------------------------------------------ comparison
@pytest.mark.parametrize("actual,expected,match", [
    ("3\n", "3", True),
    ("  3  \n\n", "3\n", True),
    ("1 2\n3 4\n", "1 2\r\n3 4", True),
    ("1.0\n", "1", True),  # Decimal tokens: exact numeric equality
    ("1.000 2\n", "1 2.0", True),
    ("0.30000000000000004", "0.3", False),  # no epsilon, as LiveCodeBench
    ("3\n4", "3", False),  # line counts must match: printing extra lines fails
    ("3", "3\n4", False),  # ... and so does printing fewer (a zip-truncating comparison would pass this)
    ("abc", "abd", False),
    ("1 2", "1  2", True),  # token split
    ("YES", "yes", False),
    ("nan", "nan", True),  # equal strings
    ("nan 1", "nan  1", False),  # as Decimals NaN != NaN
    ("sNaN", "sNaN 1", False),
    ("", "", True),
])
def test_stdout_matches_livecodebench_rules(actual, expected, match):
    assert stdout_matches(actual, expected) is match


@pytest.mark.parametrize("actual,expected,match", [
    ("[1, 2]", "[1,2]", True),
    ("3", "3.0", True),
    ("true", "1", True),  # Python equality of the decoded values, as LiveCodeBench
    ('"3"', "3", False),
    ("[[1, 2], [3]]", "[[1,2],[3]]", True),
    ("1" + "0" * 9999, "1" + "0" * 9999, True),  # no int-string limit in the comparison
    ("1" + "0" * 9999, "1" + "0" * 9998 + "1", False),
    ("NaN", "NaN", False),
    ("not json", "1", False),
    ('{"a": 1}', '{"a": 1.0}', True),
])
def test_functional_matches_decoded_json(actual, expected, match):
    assert functional_matches(actual, expected) is match


# -------------------------------------------------------------------------------------------- classification
def _ok(result=None, **kw):
    record = {"kind": "ok"} if result is None else {"kind": "ok", "result": result}
    return Execution(record=record, exit_code=0, **kw)


@pytest.mark.parametrize("execution,expected,functional,status", [
    (_ok(stdout=b"42\n"), "42", False, "pass"),
    (_ok(stdout=b"41\n"), "42", False, "wrong"),
    (Execution(stdout=b"42\n", exit_code=0), "42", False, "pass"),  # os._exit(0) after printing: judged on output
    (Execution(stdout=b"42\n", exit_code=7), "42", False, "error"),
    (_ok("42"), "42", True, "pass"),
    (_ok("41"), "42", True, "wrong"),
    (_ok(stdout=b"42"), "42", True, "error"),  # functional: printing the answer is not returning it
    (Execution(record={"kind": "exception", "type": "MemoryError"}, exit_code=1), "1", False, "memory"),
    (Execution(record={"kind": "exception", "type": "OSError", "errno": 27}, exit_code=1), "1", False, "output_limit"),
    (Execution(record={"kind": "exception", "type": "ValueError"}, exit_code=1, stdout=b"1"), "1", False, "error"),
    (Execution(timed_out=True, signal=signal.SIGKILL), "1", False, "timeout"),
    (Execution(signal=signal.SIGXCPU), "1", False, "timeout"),
    (Execution(signal=signal.SIGKILL, cpu_s=3.0), "1", False, "timeout"),  # RLIMIT_CPU's hard kill
    (Execution(signal=signal.SIGKILL, cpu_s=0.2), "1", False, "memory"),  # the memory cgroup's OOM kill
    (Execution(signal=signal.SIGSEGV), "1", False, "error"),
    (Execution(output_exceeded=True, signal=signal.SIGKILL), "1", False, "output_limit"),
    (Execution(infra_error="worker died"), "1", False, "error"),
    (None, "1", False, "error"),
])
def test_classify(execution, expected, functional, status):
    assert classify(execution, expected, functional, timeout_s=2.0) == status


# ------------------------------------------------------------------------------------------- result helpers
def test_reward_result_from_tests():
    result = RewardResult.from_tests(["pass", "wrong", "pass", "timeout"])
    assert result.partial == 0.5 and result.strict is False
    assert RewardResult.from_tests(["pass"] * 3).strict is True
    assert RewardResult.from_tests([]).partial == 0.0 and RewardResult.from_tests([]).strict is False


def test_normalize_truncated():
    assert normalize_truncated(None, 2) == [False, False]
    assert normalize_truncated(["length", "stop", True], 3) == [True, False, True]
    with pytest.raises(ValueError, match="entries"):
        normalize_truncated([True], 2)
    with pytest.raises(ValueError, match="finish reason"):
        normalize_truncated(["eos"], 1)


def test_isolation_describe():
    full = Isolation("namespaces", True, True, True, 1234, ("memory", "pids"))
    assert full.describe() == "namespaces+pidns+netns+private-root+uid+cgroup-memory+cgroup-pids+rlimits"
    assert Isolation("none").describe() == "none+rlimits"


def test_lcb_preamble_provides_implicit_names():
    namespace: dict = {}
    exec(LCB_PREAMBLE, namespace)
    for name in ("List", "defaultdict", "inf", "heappush", "bisect_left", "accumulate", "reduce", "Counter"):
        assert name in namespace, name


def test_verifier_rejects_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        CodeVerifier(timeout_s=0)
    with pytest.raises(ValueError, match="truncation"):
        CodeVerifier(truncation="drop")
    with pytest.raises(ValueError, match="isolation"):
        CodeVerifier(isolation="docker")
    with pytest.raises(ValueError, match="must match"):
        CodeVerifier().score(["a"], [])


# ----------------------------------------------------------------------------------------------- toy rewards
def test_exact_match():
    reward = ExactMatchReward()
    results = reward.score(["  42\n", "<think>hmm</think>42", "41", "<think>42"], [{"answer": 42}] * 4)
    assert [r.partial for r in results] == [1.0, 1.0, 0.0, 0.0]
    assert results[3].reason == "unclosed_think"
    assert ExactMatchReward(case_sensitive=False).score(["YES"], [{"answer": "yes"}])[0].strict
    # canonical problems: the first test's output is the answer
    assert reward.score(["3"], [{"tests": [{"input": "", "output": "3\n"}]}])[0].strict


def test_pattern():
    fence = PatternReward(pattern=r"```python\n.*\n```")
    assert [r.partial for r in fence.score(["x\n```python\nprint(1)\n```", "print(1)"], [{}, {}])] == [1.0, 0.0]
    assert PatternReward(fullmatch=True).score(["abc"], [{"pattern": "a.c"}])[0].strict
    with pytest.raises(KeyError, match="pattern"):
        PatternReward().score(["x"], [{}])


def test_charset_partial_credit_from_metadata_argument_or_first_test():
    from jaxrl.rewards import CharsetReward, get_reward
    digits = {"metadata": {"charset": "0123456789"}}
    r = get_reward("charset").score(["123", "1a2b", "", "  ", "<think>x</think>77", "12"],
                                    [digits] * 6, truncated=[False] * 5 + [True])
    assert [x.partial for x in r] == [1.0, 0.5, 0.0, 0.0, 1.0, 0.0]
    assert [x.strict for x in r] == [True, False, False, False, True, False]
    assert r[5].reason == "truncated"
    assert CharsetReward(charset="ab").score(["abc"], [{}])[0].partial == pytest.approx(2 / 3)
    from_test = {"tests": [{"input": "", "output": "xyz"}]}
    assert CharsetReward().score(["xx q"], [from_test])[0].partial == pytest.approx(2 / 3)  # spaces ignored


def test_arithmetic():
    reward = ArithmeticReward()
    results = reward.score(["The answer is 84.", "84.0000001", "I think 12*7 = 85", "1,000"],
                           [{"expression": "12 * (3 + 4)"}, {"answer": "84"}, {"answer": 84}, {"answer": 1000}])
    assert [r.partial for r in results] == [1.0, 1.0, 0.0, 1.0]
    assert evaluate_arithmetic("7 / 2 - 1") == pytest.approx(2.5)
    for bad in ("__import__('os')", "2 ** 1000", "x + 1", "[1]"):
        with pytest.raises(ValueError):
            evaluate_arithmetic(bad)


@pytest.mark.parametrize("policy,masked", [("zero", False), ("mask", True)])
def test_truncation_policy_for_toy_rewards(policy, masked):
    (result,) = ExactMatchReward(truncation=policy).score(["42"], [{"answer": 42}], truncated=["length"])
    assert (result.partial, result.reason, result.masked) == (0.0, "truncated", masked)


# -------------------------------------------------------------------------------------------------- registry
def score_by_length(completion, problem, target=3):
    """A user reward used through get_reward("module:function")."""
    return 1.0 if len(completion) == target else 0.0


class UserReward:
    def __init__(self, value=1.0):
        self.value = value

    def score(self, completions, problems, truncated=None):
        return [RewardResult(partial=self.value, strict=self.value == 1.0) for _ in completions]


def test_registry():
    assert {"code", "exact_match", "pattern", "arithmetic"} <= set(available_rewards())
    assert isinstance(get_reward("exact_match"), ExactMatchReward)
    assert isinstance(get_reward("code", timeout_s=2.0), CodeVerifier)  # built lazily: no sandbox started yet
    fn = get_reward(f"{__name__}:score_by_length", target=2)
    assert isinstance(fn, Reward)
    assert [r.partial for r in fn.score(["ab", "abc"], [{}, {}])] == [1.0, 0.0]
    cls = get_reward(f"{__name__}:UserReward", value=0.5)
    assert cls.score(["x"], [{}])[0].partial == 0.5
    register_reward("constant_test", lambda **kw: UserReward(**kw))
    assert get_reward("constant_test", value=1.0).score(["x"], [{}])[0].strict
    with pytest.raises(KeyError, match="unknown reward"):
        get_reward("nope")
    with pytest.raises(KeyError, match="cannot load"):
        get_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        get_reward(f"{__name__}:_out_of_range").score(["x"], [{}])


def _out_of_range(completion, problem):
    return 2.0
