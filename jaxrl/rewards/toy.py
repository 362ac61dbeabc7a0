"""Small rewards for demos and learning tests, behind the same interface as the code verifier.

They read the expected answer from the problem: ``problem["answer"]`` when present (toy task records), else
the output of the problem's first test (canonical coding problems). Reasoning is stripped first, as for code.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import re
from fractions import Fraction
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl.data.token_ids import token_text  # noqa: F401 - the text TokenBlockReward scores, named here too
from jaxrl.rewards.base import (RewardResult, TruncationPolicy, check_batch, normalize_truncated,
                                problem_field, truncated_result)
from jaxrl.rewards.extract import strip_reasoning


def expected_answer(problem: Any) -> str:
    answer = problem_field(problem, "answer")
    if answer is not None:
        return str(answer)
    tests = problem_field(problem, "tests")
    if tests:
        first = tests[0]
        return str(first["output"] if isinstance(first, dict) else first.output)
    raise KeyError("problem has neither an 'answer' nor tests to take the expected answer from")


class PerSampleReward:
    """Shared batch logic: truncation (the one loop of every toy reward), then a per-sample score: reasoning
    stripping and a check by default."""

    def __init__(self, truncation: TruncationPolicy = "zero"):
        self.truncation = truncation

    def check(self, answer: str, problem: Any) -> bool:
        raise NotImplementedError

    def result(self, answer: str, problem: Any) -> RewardResult:
        """The score of one answer (reasoning stripped): pass/fail from `check`; partial-credit rewards override."""
        return RewardResult.from_tests(["pass" if self.check(answer, problem) else "wrong"])

    def score_one(self, completion: str, problem: Any) -> RewardResult:
        """The score of one completion that was not truncated: its reasoning stripped (an unclosed <think>:
        wrong), then `result`."""
        answer = strip_reasoning(completion)
        if answer is None:
            return RewardResult.nothing_ran("unclosed_think", n_tests=1, status="wrong")
        return self.result(answer, problem)

    def score(self, completions: Sequence[str], problems: Sequence[Any],
              truncated: Sequence[bool | str] | None = None) -> list[RewardResult]:
        """A truncated completion scores by the truncation policy, any other one by `score_one`."""
        check_batch(completions, problems)
        return [truncated_result(self.truncation) if cut else self.score_one(completion, problem)
                for completion, problem, cut in zip(completions, problems,
                                                    normalize_truncated(truncated, len(completions)))]


class ExactMatchReward(PerSampleReward):
    """1 if the answer equals the expected one after stripping whitespace (optionally ignoring case)."""

    def __init__(self, case_sensitive: bool = True, truncation: TruncationPolicy = "zero"):
        super().__init__(truncation)
        self.case_sensitive = case_sensitive

    def check(self, answer: str, problem: Any) -> bool:
        got, want = answer.strip(), expected_answer(problem).strip()
        return got == want if self.case_sensitive else got.casefold() == want.casefold()


class PatternReward(PerSampleReward):
    """1 if a regular expression matches the answer: ``pattern=`` here, or the problem's "pattern" field."""

    def __init__(self, pattern: str | None = None, fullmatch: bool = False, flags: int = re.DOTALL,
                 truncation: TruncationPolicy = "zero"):
        super().__init__(truncation)
        self.pattern = re.compile(pattern, flags) if pattern is not None else None
        self.fullmatch, self.flags = fullmatch, flags

    def check(self, answer: str, problem: Any) -> bool:
        pattern = self.pattern
        if pattern is None:
            raw = problem_field(problem, "pattern")
            if raw is None:
                raise KeyError("PatternReward needs pattern= or a 'pattern' field in the problem")
            pattern = re.compile(raw, self.flags)
        text = answer.strip()
        return bool(pattern.fullmatch(text) if self.fullmatch else pattern.search(text))


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate_arithmetic(expression: str) -> Fraction:
    """Exact value of + - * / // % ** on numbers; nothing else is evaluated (no names, calls or attributes)."""

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > 64):
                raise ValueError("only small integer powers are evaluated")
            return Fraction(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        raise ValueError(f"not plain arithmetic: {ast.dump(node)[:60]}")

    return walk(ast.parse(expression, mode="eval"))


class ArithmeticReward(PerSampleReward):
    """1 if the last number in the answer equals the problem's value within ``tolerance``.

    The value is ``problem["answer"]`` (or the first test's output), or ``problem["expression"]`` evaluated
    exactly, e.g. {"expression": "12 * (3 + 4)"} -> 84.
    """

    def __init__(self, tolerance: float = 1e-6, truncation: TruncationPolicy = "zero"):
        super().__init__(truncation)
        self.tolerance = tolerance

    def check(self, answer: str, problem: Any) -> bool:
        numbers = _NUMBER.findall(answer.replace(",", ""))
        if not numbers:
            return False
        got = Fraction(numbers[-1])
        expression = problem_field(problem, "expression")
        want = evaluate_arithmetic(expression) if expression is not None else Fraction(expected_answer(problem).strip())
        return math.isclose(float(got), float(want), rel_tol=0.0, abs_tol=self.tolerance) or got == want


class CharsetReward(PerSampleReward):
    """Partial credit: the fraction of the answer's non-space characters that lie in the allowed set.

    The set is ``charset=`` here, or the problem's ``metadata["charset"]``, or its first test's output. An empty
    answer scores 0; strict = every character allowed. The demo's task (a tiny model learns to answer in the
    requested alphabet): random answers spread over [0, 1], so best-vs-worst pairs have real margins.
    """

    def __init__(self, charset: str | None = None, truncation: TruncationPolicy = "zero"):
        super().__init__(truncation)
        self.charset = charset

    def allowed(self, problem: Any) -> str:
        if self.charset is not None:
            return self.charset
        metadata = problem_field(problem, "metadata") or {}
        if isinstance(metadata, dict) and metadata.get("charset"):
            return str(metadata["charset"])
        return expected_answer(problem)

    def fraction(self, answer: str, problem: Any) -> float:
        chars = [c for c in answer if not c.isspace()]
        if not chars:
            return 0.0
        allowed = set(self.allowed(problem))
        return sum(c in allowed for c in chars) / len(chars)

    def result(self, answer: str, problem: Any) -> RewardResult:
        partial = self.fraction(answer, problem)
        return RewardResult(partial=partial, strict=partial >= 1.0, tests=[])


class FunctionReward(PerSampleReward):
    """Wraps a user function ``fn(answer, problem, **kwargs) -> bool | float | RewardResult``."""

    def __init__(self, fn: Callable[..., Any], truncation: TruncationPolicy = "zero", **kwargs: Any):
        super().__init__(truncation)
        self.fn, self.kwargs = fn, kwargs

    def score_one(self, completion: str, problem: Any) -> RewardResult:
        """The function's value on the completion as it is (reasoning kept: the function decides)."""
        value = self.fn(completion, problem, **self.kwargs)
        if isinstance(value, RewardResult):
            return value
        partial = float(value)
        if not 0.0 <= partial <= 1.0:
            raise ValueError(f"{self.fn!r} returned {value!r}; rewards are in [0, 1]")
        return RewardResult(partial=partial, strict=partial >= 1.0, tests=[])


# ------------------------------------------------------------------------------------------------- token task
# The CPU learning task of the online algorithms (GRPO / PPO tests and configs/grpo_tiny.py): raw token ids, no
# tokenizer.


@dataclasses.dataclass(frozen=True)
class TokenTask:
    """A verifiable task on raw token ids that a random tiny model starts at chance on (CPU learning tests).

    Token ids [first, first + num_classes) are instruction tokens; the rest of [first, vocab) is split into
    `num_classes` contiguous blocks. A prompt is `prompt_len - 1` random tokens from the blocks, then the
    instruction token of a random class c; the completion should consist of tokens of block c. Reward: the
    fraction of the first `score_tokens` completion tokens inside block c (a missing or stop token is a miss),
    so chance is 1 / num_classes. `first` = 2 skips the tiny vocabulary's pad (0) and eos (1).
    """

    vocab_size: int
    prompt_len: int = 6
    num_classes: int = 2
    score_tokens: int = 8
    first: int = 2

    def __post_init__(self):
        if self.prompt_len < 1 or self.num_classes < 2 or self.score_tokens < 1:
            raise ValueError(f"TokenTask: prompt_len ({self.prompt_len}) >= 1, num_classes ({self.num_classes}) "
                             f">= 2 and score_tokens ({self.score_tokens}) >= 1 are required")
        if self.vocab_size - self.first - self.num_classes < self.num_classes:
            raise ValueError(f"TokenTask: vocab_size {self.vocab_size} too small for {self.num_classes} classes")

    def block(self, c: int) -> tuple[int, int]:
        """[lo, hi) of class c's target tokens."""
        start = self.first + self.num_classes
        span = self.vocab_size - start
        return start + c * span // self.num_classes, start + (c + 1) * span // self.num_classes

    def prompts(self, seed: int, rollout: int, count: int) -> tuple[list[list[int]], list[dict]]:
        """`count` prompts of rollout `rollout` (a function of (seed, rollout) only) and their problem records."""
        rng = np.random.default_rng([int(seed), int(rollout), 4211])
        start = self.first + self.num_classes
        ids, problems = [], []
        for j in range(count):
            c = int(rng.integers(self.num_classes))
            filler = rng.integers(start, self.vocab_size, size=self.prompt_len - 1).tolist()
            lo, hi = self.block(c)
            ids.append([int(t) for t in filler] + [self.first + c])
            problems.append({"id": f"token_task/{rollout}/{j}", "lo": lo, "hi": hi, "score_tokens": self.score_tokens})
        return ids, problems


class TokenBlockReward:
    """Reward of `TokenTask` behind the Reward protocol: completions are `token_text` strings, problems carry
    `lo`, `hi`, `score_tokens`. Truncation is ignored: the task asks for exactly the generation cap."""

    def score(self, completions: Sequence[str], problems: Sequence[Any],
              truncated: Sequence[bool | str] | None = None) -> list[RewardResult]:
        del truncated
        check_batch(completions, problems)
        out = []
        for text, problem in zip(completions, problems):
            lo, hi = int(problem_field(problem, "lo")), int(problem_field(problem, "hi"))
            k = int(problem_field(problem, "score_tokens"))
            toks = [int(t) for t in text.split()][:k]
            hits = sum(lo <= t < hi for t in toks)
            out.append(RewardResult(partial=hits / k, strict=hits == k, tests=[]))
        return out
