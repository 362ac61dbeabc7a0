"""What an environment of multi-turn episodes is: the `Environment` protocol, the `Turn` it answers, and the checks of
what it returns.

    env = ENVIRONMENTS.get("code_feedback")(public_tests=1, feedback_chars=1500)   # one object per episode
    env.seed = 1234                                   # set by the runner: the episode's own number
    messages = env.reset(problem)                     # the conversation the first turn answers
    messages, reward, done = env.step(Turn(text, token_ids, "stop", index=0, last=False))

An episode (jaxrl/environments/runner.py) calls `reset` once, then `step` after every sampled turn: the messages it
returns are the next observation (rendered as an append-only delta of the chat template), `reward` is added to the
episode's return, and `done` ends it. `Turn.last` tells the environment that no further turn will be sampled
(max_turns, the cap of the turn, or the episode's token budget), so it gives its final reward then. An environment
may set `solved` (what evaluation counts as solved); left None, solved means a return >= 1. It may offer tools:
`tools` (OpenAI function tools) is passed to the chat template when the first prompt is rendered (Qwen3.5's lists
them in its system block, with the `<tool_call>` format), and the turn's calls are read with
jaxrl.data.tool_calls. An exception from `reset` or `step` fails that episode only (its reward is masked and its
error kept); the run goes on. So does a call that runs past the run's `step_timeout_s` (the calls run on an
environment thread, not the main thread: jaxrl/environments/limits.py).

Every environment the runner meets has the protocol's attributes: the built-ins derive from `Environment`, and a
user's class registered as an `environment` plug-in (jaxrl.algorithms.plugins) is given its defaults
(`as_environment`), so nothing probes for them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import threading
from typing import Any, Mapping, Optional

import numpy as np

from jaxrl.rewards.code import CodeVerifier

__all__ = ["Environment", "SCORES", "Turn", "as_environment", "check_messages", "shared_verifier", "verifier_of"]

SCORES = ("partial", "strict")  # the verifier's result an environment's reward may be


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


def check_step_result(result: Any) -> tuple[list[dict], float, bool]:
    """An environment's `step` result as (messages, reward, done), each of its type: the messages as
    `check_messages`, the reward a finite int or float (not a bool or a string: `float("0.5")` would hide a bug),
    `done` a bool (any truthy value, "no" among them, would end the episode). ValueError / TypeError naming what is
    wrong otherwise: the runner fails that episode and keeps the error."""
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        raise TypeError(f"step returned {type(result).__name__}; expected (messages, reward, done)")
    messages, reward, done = result
    if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, (int, float, np.integer, np.floating)):
        raise TypeError(f"step's reward is {reward!r} ({type(reward).__name__}); expected a number")
    if not math.isfinite(float(reward)):
        raise ValueError(f"step's reward {float(reward)} is not finite")
    if not isinstance(done, (bool, np.bool_)):
        raise TypeError(f"step's done is {done!r} ({type(done).__name__}); expected a bool")
    return check_messages(messages, "step"), float(reward), bool(done)


def as_environment(cls: type) -> type:
    """`cls` (a class with `reset` and `step`) as an Environment: itself when it derives from one, else a subclass
    of it and Environment, so an instance has the protocol's attributes (`seed`, `solved`, `tools`) at their
    defaults unless the class sets them."""
    if issubclass(cls, Environment):
        return cls
    return type(cls.__name__, (cls, Environment), {"__module__": cls.__module__, "__doc__": cls.__doc__})


_VERIFIERS_LOCK = threading.Lock()


def shared_verifier(options: str) -> CodeVerifier:
    """One sandbox pool per verifier setting (`options`: its keyword arguments as sorted JSON), shared by every
    episode of the process (starting workers is the expensive part; the pool runs one batch of jobs at a time, and
    episodes of several rollouts may start at once: partial rollouts sample on several threads)."""
    with _VERIFIERS_LOCK:
        return _verifier(options)


@functools.lru_cache(maxsize=4)
def _verifier(options: str) -> CodeVerifier:
    return CodeVerifier(**json.loads(options))


def verifier_of(options: Mapping[str, Any]) -> CodeVerifier:
    """The shared verifier of an environment's verifier options; a truncated turn scores 0 ("zero"), so an
    episode's reward is never masked by truncation."""
    return shared_verifier(json.dumps({**options, "truncation": "zero"}, sort_keys=True))
