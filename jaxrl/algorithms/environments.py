"""Environments of multi-turn episodes: what answers a sampled turn, and the episode's reward.

    env = ENVIRONMENTS.get("code_feedback")(public_tests=1, feedback_chars=1500)   # one object per episode
    env.seed = 1234                                   # set by the runner: the episode's own number
    messages = env.reset(problem)                     # the conversation the first turn answers
    messages, reward, done = env.step(Turn(text, token_ids, "stop", index=0, last=False))

An episode (jaxrl/algorithms/online/episodes.py) calls `reset` once, then `step` after every sampled turn: the
messages it returns are the next observation (rendered as an append-only delta of the chat template), `reward` is
added to the episode's return, and `done` ends it. `Turn.last` tells the environment that no further turn will be
sampled (max_turns, the cap of the turn, or the episode's token budget), so it gives its final reward then. An
environment may set `solved` (what evaluation counts as solved); left None, solved means a return >= 1. An
exception from `reset` or `step` fails that episode only (its reward is masked and its error kept); the run goes
on.

An environment may offer tools: `tools` (OpenAI function tools) is passed to the chat template when the first
prompt is rendered (Qwen3.5's lists them in its system block, with the `<tool_call>` format), and the turn's calls
are read with jaxrl.data.tool_calls.

Built-in: `code_feedback` and `python_tool` (the verifier of jaxrl/rewards in its sandbox). User environments are
`environment` plug-ins (jaxrl.algorithms.plugins): a class with `reset` and `step`, constructed with
`environment_options`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from typing import Any, Mapping, Optional, Sequence

from jaxrl.data.problems import Problem, TestCase, coerce_problem
from jaxrl.data.tool_calls import TOOL_CALL_START, parse_tool_calls
from jaxrl.rewards.code import CodeVerifier, classify
from jaxrl.rewards.extract import extract_code, strip_reasoning
from jaxrl.rewards.sandbox import Execution, Job
from jaxrl.utils.registry import Registry

__all__ = ["ENVIRONMENTS", "CodeFeedback", "Environment", "PythonTool", "Turn", "check_messages"]


@dataclasses.dataclass(frozen=True)
class Turn:
    """One sampled assistant turn, as the environment sees it."""

    text: str  # the decoded turn (the stop token dropped, special tokens skipped; <think> kept)
    token_ids: tuple[int, ...]  # exactly as sampled, the stop token included
    finish_reason: str  # "stop" | "length" (the turn hit max_new_tokens)
    index: int  # 0-based
    last: bool  # no further turn will be sampled: the environment gives its final reward now


class Environment:
    """Base of environments (module docstring). Subclasses implement `reset` and `step`; one object serves one
    episode."""

    seed: int = 0  # the episode's own number (set by the runner before reset): draw any randomness from it
    solved: Optional[bool] = None
    tools: Optional[list[dict]] = None  # OpenAI function tools the first prompt's template renders (module doc)

    def reset(self, problem: Any) -> list[dict]:
        raise NotImplementedError

    def step(self, turn: Turn) -> tuple[list[dict], float, bool]:
        raise NotImplementedError


def check_messages(messages: Any, where: str) -> list[dict]:
    """`messages` as a list of {"role": str, "content": str} dicts; ValueError naming `where` otherwise."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{where} returned {type(messages).__name__}, not a list of messages")
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {i} is {m!r}; expected {{'role': str, 'content': str}}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


# ------------------------------------------------------------------------------------------------ code_feedback

REWARD_TESTS = ("hidden", "all")
SCORES = ("partial", "strict")


@functools.lru_cache(maxsize=4)
def _shared_verifier(options: str) -> CodeVerifier:
    """One sandbox pool per verifier setting, shared by every episode of the process (starting workers is the
    expensive part; the pool runs one batch of jobs at a time)."""
    return CodeVerifier(**json.loads(options))


def _clip(text: str, limit: int) -> str:
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
        # The verifier scores truncated turns 0 ("zero"): an episode's reward is never masked by truncation.
        self.verifier = _shared_verifier(json.dumps({**verifier, "truncation": "zero"}, sort_keys=True))
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
            part = (f"\nTest {i + 1}: {status.replace('_', ' ')}\nInput:\n{_clip(test.input, field)}\n"
                    f"Expected output:\n{_clip(test.output, field)}\nYour output:\n{_clip(got, field)}")
            if error:
                part += f"\nError:\n{_clip(error, field)}"
            parts.append(part)
        ask = "\n\nFix the program and answer with the complete corrected program in one ```python code block."
        return _clip("\n".join(parts), self.feedback_chars - len(ask)) + ask


# ------------------------------------------------------------------------------------------------ python_tool

PYTHON_TOOL = {"type": "function", "function": {
    "name": "python",
    "description": ("Run a Python 3 program in a sandbox (no network, no input on stdin) and read what it printed: "
                    "its stdout, then its stderr."),
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The program."}},
                   "required": ["code"]}}}


_SANDBOX_FRAME = re.compile(r'^  File "[^"\n]*_sandbox_server\.py", line \d+, in \w+\n', re.M)


class PythonTool(Environment):
    """The model may call the `python` tool (Qwen3.5's `<tool_call>` format, `PYTHON_TOOL`) before it answers:
    each call's code runs in the verifier's sandbox (its limits and isolation; no stdin; `tool_timeout_s`, default
    the verifier's `timeout_s`) and its stdout then stderr, at most `output_chars` characters with the kill reason
    when the sandbox stopped it, come back as a `tool` message (one per call, in the call order). A turn without a
    `<tool_call>` after its reasoning (after the last `</think>`) is the final answer: the verifier scores it on
    every test of the problem (`score`: partial | strict) and the episode ends. A turn whose `<tool_call>` text
    does not parse (unclosed, no `<function=...>`, a tool other than `python`, text after the calls) or whose call
    has no string `code` gets an error as a user message, and the episode goes on. A call on the last turn
    (max_turns, the token budget) gets no answer: the episode ends unanswered with reward 0; a turn cut at its cap
    scores 0. `turn_cost` is subtracted for each tool turn. Other options go to CodeVerifier (timeout_s, memory_mb,
    workers, isolation, lcb_compat, ...)."""

    tools = [PYTHON_TOOL]

    def __init__(self, output_chars: int = 2000, tool_timeout_s: float = 0.0, score: str = "partial",
                 turn_cost: float = 0.0, **verifier: Any):
        if int(output_chars) < 64:
            raise ValueError(f"python_tool: output_chars must be >= 64, got {output_chars}")
        if score not in SCORES:
            raise ValueError(f"python_tool: score must be one of {SCORES}, got {score!r}")
        for key, value in (("turn_cost", turn_cost), ("tool_timeout_s", tool_timeout_s)):
            if not math.isfinite(float(value)) or float(value) < 0:
                raise ValueError(f"python_tool: {key} must be a finite number >= 0, got {value}")
        self.output_chars, self.score, self.turn_cost = int(output_chars), score, float(turn_cost)
        self.verifier = _shared_verifier(json.dumps({**verifier, "truncation": "zero"}, sort_keys=True))
        self.tool_timeout_s = float(tool_timeout_s) or self.verifier.timeout_s
        self.problem: Optional[Problem] = None

    def reset(self, problem: Any) -> list[dict]:
        self.problem = coerce_problem(problem, where="python_tool problem")
        self.solved = None
        return [dict(m) for m in self.problem.messages]

    def step(self, turn: Turn) -> tuple[list[dict], float, bool]:
        if self.problem is None:
            raise RuntimeError("python_tool: step before reset")
        if turn.finish_reason == "length":
            self.solved = False
            return [], 0.0, True
        # calls are read after the reasoning (vLLM's reasoning parser hands its tool parser the content only): a
        # `<tool_call>` mentioned while thinking is not a call; an open think block is an (unfinished) answer
        answer = strip_reasoning(turn.text) or ""
        _, calls = parse_tool_calls(answer, self.tools)
        called = TOOL_CALL_START in answer
        if not called:  # the final answer
            result = self.verifier.score([turn.text], [self.problem], truncated=[turn.finish_reason])[0]
            self.solved = bool(result.strict)
            return [], float(result.strict if self.score == "strict" else result.partial), True
        if turn.last:  # a call nobody will read the answer of: no final answer was given
            self.solved = False
            return [], 0.0, True
        codes = [c.arguments.get("code") for c in calls or ()]
        if calls is None or not all(isinstance(c, str) for c in codes):
            why = ("a call has no `code` parameter" if calls is not None else
                   "write each call as <tool_call>\n<function=python>\n<parameter=code>\n...\n</parameter>\n"
                   "</function>\n</tool_call>, with nothing after the last call")
            return [{"role": "user", "content": f"Your tool call could not be read: {why}. Call the python tool "
                     "again, or give your final answer without a tool call."}], -self.turn_cost, False
        runs = self.verifier.pool.run([Job(code=code, input="", fn_name=None, timeout_s=self.tool_timeout_s)
                                       for code in codes])
        return [{"role": "tool", "content": self.output(run)} for run in runs], -self.turn_cost, False

    def output(self, run: Execution) -> str:
        """A run's stdout then stderr, clipped to `output_chars`, with why the sandbox stopped it."""
        record = run.record or {}
        status = ""
        if run.infra_error:
            status = f"[the sandbox failed: {run.infra_error}]"
        elif run.output_exceeded:
            status = "[killed: output limit]"
        elif run.timed_out:
            status = f"[killed: time limit of {self.tool_timeout_s:g} s]"
        elif record.get("kind") == "syntax_error":
            status = f"{record.get('type', 'SyntaxError')}: {record.get('message', '')}"
        elif run.signal is not None:
            status = f"[killed by signal {run.signal}]"
        out = run.stdout.decode("utf-8", errors="replace")
        # the sandbox's own frame heads every traceback: the program's are what the model can act on
        err = _SANDBOX_FRAME.sub("", run.stderr.decode("utf-8", errors="replace"))
        text = "\n".join(part for part in (out.rstrip("\n"), err.rstrip("\n"), status) if part)
        if not text:
            return "(no output)"
        # the end of a long output holds the error and the kill reason: keep both ends
        if len(text) > self.output_chars:
            cut = f"\n... [{len(text)} characters, the middle cut] ...\n"
            half = (self.output_chars - len(cut)) // 2
            text = text[:half] + cut + text[len(text) - half:]
        return text


ENVIRONMENTS = Registry("environment", hint="Or add one of your own as an `environment` plug-in "
                        "(jaxrl.algorithms.plugins)")
ENVIRONMENTS.add("code_feedback", CodeFeedback)
ENVIRONMENTS.add("python_tool", PythonTool)
