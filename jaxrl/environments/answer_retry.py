"""The `answer_retry` environment: the model answers, a reward scores the answer, a wrong one is told so (what was
read as the answer and, when the task gives partial credit, its score) and asked again (jaxrl/environments/base.py:
the protocol). For tasks where a second attempt is meaningful: reasoning-gym tasks (the `reasoning_gym` reward,
the default), or any reward that reads a short answer (exact_match, arithmetic, ...).

    grpo.environment = "answer_retry"
    grpo.environment_options = {"turn_cost": 0.1}     # reward, reward_options, score, turn_cost

The episode ends at a right answer (the reward's strict), on a turn cut at its token cap, or on its last turn; its
reward is then the last answer's score (`score`: partial | strict) less `turn_cost` per turn before it, so a right
first answer is worth most.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from jaxrl.environments.base import SCORES, Environment, Turn
from jaxrl.rewards.base import problem_field
from jaxrl.rewards.registry import get_reward

__all__ = ["AnswerRetry"]


class AnswerRetry(Environment):
    """Module docstring. `reward` and `reward_options`: the reward (jaxrl.rewards.get_reward) and its options; a
    truncated turn scores 0 (the reward's truncation "zero"), so an episode's reward is never masked."""

    def __init__(self, reward: str = "reasoning_gym", reward_options: Optional[dict] = None, score: str = "partial",
                 turn_cost: float = 0.0):
        if score not in SCORES:
            raise ValueError(f"answer_retry: score must be one of {SCORES}, got {score!r}")
        if not math.isfinite(float(turn_cost)) or float(turn_cost) < 0:
            raise ValueError(f"answer_retry: turn_cost must be a finite number >= 0, got {turn_cost}")
        self.reward = get_reward(reward, **{**(reward_options or {}), "truncation": "zero"})
        self.score, self.turn_cost = score, float(turn_cost)
        self.problem: Any = None

    def reset(self, problem: Any) -> list[dict]:
        self.problem, self.solved = problem, None
        return [dict(m) for m in problem_field(problem, "messages")]

    def step(self, turn: Turn) -> tuple[list[dict], float, bool]:
        if self.problem is None:
            raise RuntimeError("answer_retry: step before reset")
        [result] = self.reward.score([turn.text], [self.problem], truncated=[turn.finish_reason])
        if result.strict or turn.last or turn.finish_reason == "length":
            self.solved = bool(result.strict)
            return [], float(result.strict if self.score == "strict" else result.partial), True
        return [{"role": "user", "content": self.feedback(turn.text, result)}], -self.turn_cost, False

    def feedback(self, text: str, result) -> str:
        """Why the answer was wrong, as far as the reward says, and the request to answer again in the format the
        problem asks for."""
        answer = getattr(self.reward, "answer", None)
        read = answer(text, self.problem) if answer is not None and result.reason != "unclosed_think" else None
        if result.reason == "unclosed_think":
            why = "Your reasoning was not closed with </think>, so no answer was read."
        elif result.reason == "no_answer" or (answer is not None and read is None):
            why = "No answer was found in your reply."
        else:
            shown = f"Your answer {read!r}" if read is not None else "Your answer"
            why = f"{shown} is not correct" + (f" (it scores {result.partial:.2f} of 1)." if result.partial > 0
                                               else ".")
        fmt = (problem_field(self.problem, "metadata") or {}).get("answer_format") or {}
        if fmt.get("extract") == "tag":
            ask = f"Try again, and give your final answer between <{fmt.get('tag', 'answer')}> and " \
                  f"</{fmt.get('tag', 'answer')}>."
        elif fmt.get("extract") == "last_line":
            ask = "Try again, and give your final answer alone on the last line."
        else:
            ask = "Try again."
        return f"{why} {ask}"
