"""The `python_tool` environment: the model may run Python in the sandbox through the `python` tool before it answers
(jaxrl/environments/base.py: the protocol)."""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from jaxrl.data.problems import Problem, coerce_problem
from jaxrl.data.tool_calls import TOOL_CALL_START, parse_tool_calls
from jaxrl.environments.base import SCORES, Environment, Turn, verifier_of
from jaxrl.rewards.extract import strip_reasoning
from jaxrl.rewards.sandbox import Execution, Job

__all__ = ["PYTHON_TOOL", "PythonTool"]

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
        self.verifier = verifier_of(verifier)
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
