"""The `code_feedback` environment: the model answers with code, the sandbox runs the public tests, the failures come
back as the next user message (jaxrl/environments/base.py: the protocol)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Optional, Sequence

from jaxrl.data.problems import Problem, TestCase, coerce_problem
from jaxrl.environments.base import SCORES, Environment, Turn, verifier_of
from jaxrl.rewards.code import classify
from jaxrl.rewards.extract import extract_code
from jaxrl.rewards.sandbox import Execution, Job

__all__ = ["CodeFeedback", "REWARD_TESTS"]

REWARD_TESTS = ("hidden", "all")


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, saying it was."""
    return text if len(text) <= limit else text[:max(0, limit - 15)] + "... [truncated]"


class CodeFeedback(Environment):
    """The model answers with code; the sandbox runs the problem's public tests; failures (input, expected, got,
    error) come back as the next user message, at most `feedback_chars` characters; the episode ends when every
    public test passes or on its last turn, with the verifier's score on the hidden tests (`score`: partial |
    strict) less `turn_cost` per turn before the final one.

    Public tests: the first `public_tests` of the problem's tests (`metadata["public_tests"]`, a count, wins: an
    importer that keeps LiveCodeBench's public tests first can record it). Hidden tests (`reward_tests="hidden"`):
    the others, or every test when none is left; `"all"`: every test. Other options go to CodeVerifier (timeout_s,
    memory_mb, workers, isolation, lcb_compat, ...).
    """

    def __init__(self, public_tests: int = 1, feedback_chars: int = 2000, score: str = "partial",
                 turn_cost: float = 0.0, reward_tests: str = "hidden", **verifier: Any):
        if int(public_tests) < 0 or int(feedback_chars) < 64:
            raise ValueError(f"code_feedback: public_tests must be >= 0 and feedback_chars >= 64, got "
                             f"{public_tests} and {feedback_chars}")
        if score not in SCORES or reward_tests not in REWARD_TESTS:
            raise ValueError(f"code_feedback: score must be one of {SCORES} and reward_tests one of {REWARD_TESTS}, "
                             f"got {score!r} and {reward_tests!r}")
        if not math.isfinite(float(turn_cost)) or float(turn_cost) < 0:
            raise ValueError(f"code_feedback: turn_cost must be a finite number >= 0, got {turn_cost}")
        self.public_count, self.feedback_chars = int(public_tests), int(feedback_chars)
        self.score, self.turn_cost, self.reward_tests = score, float(turn_cost), reward_tests
        self.verifier = verifier_of(verifier)
        self.problem: Optional[Problem] = None

    def reset(self, problem: Any) -> list[dict]:
        self.problem = coerce_problem(problem, where="code_feedback problem")
        self.solved = None
        return [dict(m) for m in self.problem.messages]

    def split(self) -> tuple[tuple[TestCase, ...], tuple[TestCase, ...]]:
        """(public tests, tests the reward is computed on)."""
        tests = self.problem.tests
        count = (self.problem.metadata or {}).get("public_tests", self.public_count)
        public = tests[:max(0, int(count))]
        hidden = tests[len(public):] if self.reward_tests == "hidden" else tests
        return public, hidden or tests

    def step(self, turn: Turn) -> tuple[list[dict], float, bool]:
        if self.problem is None:
            raise RuntimeError("code_feedback: step before reset")
        public, hidden = self.split()
        code = extract_code(turn.text).code if turn.finish_reason != "length" else None
        failures = self.failures(code, public) if code is not None and public else None
        if turn.last or turn.finish_reason == "length" or failures == []:
            result = self.verifier.score([turn.text], [dataclasses.replace(self.problem, tests=hidden)],
                                         truncated=[turn.finish_reason])[0]
            self.solved = bool(result.strict)
            return [], float(result.strict if self.score == "strict" else result.partial), True
        if code is None:
            text = ("No program was found in your answer. Answer with the complete program in one ```python code "
                    "block.")
        else:
            text = self.feedback(failures, len(public))
        return [{"role": "user", "content": text}], -self.turn_cost, False

    def failures(self, code: str, tests: Sequence[TestCase]) -> list[tuple[int, TestCase, str, Execution]]:
        """(index, test, status, execution) of every public test the program fails, run in the sandbox."""
        p = self.problem
        timeout = p.time_limit_s * self.verifier.time_scale if p.time_limit_s else self.verifier.timeout_s
        runs = self.verifier.pool.run([Job(code=code, input=t.input, fn_name=p.fn_name, timeout_s=timeout)
                                       for t in tests])
        out = []
        for i, (test, run) in enumerate(zip(tests, runs)):
            status = classify(run, test.output, p.functional, timeout)
            if status != "pass":
                out.append((i, test, status, run))
        return out

    def feedback(self, failures, total: int) -> str:
        """The failures as one message of at most `feedback_chars` characters (each field clipped first)."""
        field = max(64, self.feedback_chars // (4 * max(1, len(failures))))
        parts = [f"Your program failed {len(failures)} of {total} public tests."]
        for i, test, status, run in failures:
            record = (run.record or {}) if run is not None else {}
            if self.problem.functional:
                got = json.dumps(record.get("result"), default=str) if "result" in record else ""
            else:
                got = (run.stdout if run is not None else b"").decode("utf-8", errors="replace")
            error = ""
            if record.get("kind") in ("exception", "syntax_error", "no_function"):
                error = f"{record.get('type', record['kind'])}: {record.get('message', '')}".strip()
            elif run is not None and run.stderr:
                error = run.stderr.decode("utf-8", errors="replace")[-field:]
            part = (f"\nTest {i + 1}: {status.replace('_', ' ')}\nInput:\n{clip(test.input, field)}\n"
                    f"Expected output:\n{clip(test.output, field)}\nYour output:\n{clip(got, field)}")
            if error:
                part += f"\nError:\n{clip(error, field)}"
            parts.append(part)
        ask = "\n\nFix the program and answer with the complete corrected program in one ```python code block."
        return clip("\n".join(parts), self.feedback_chars - len(ask)) + ask
