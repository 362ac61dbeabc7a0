"""The settings environments own: multi-turn episodes of an online algorithm (`<algorithm>.environment`, ...; the
episode runner, jaxrl.environments.runner, and docs/guides/episodes.md). No jax here: configs import this module."""

from __future__ import annotations

import dataclasses

from jaxrl.environments.limits import STEP_TIMEOUT_S, check_step_timeout
from jaxrl.utils.typed_config import Block, at_least, setting

__all__ = ["EpisodeSettings"]


@dataclasses.dataclass(frozen=True)
class EpisodeSettings(Block):
    """Multi-turn episodes: each row is a policy and an environment taking turns. A part of an online algorithm's
    block, which says what one turn may take (`turn_budget`)."""

    environment: str = setting("", doc="'' = single-turn; else an environment (code_feedback, python_tool, "
                               "answer_retry, or an `environment` plug-in): each row is an episode of up to "
                               "max_turns turns")
    environment_options: dict = setting({}, dict, "keyword arguments of the environment (code_feedback: "
                                        "public_tests, feedback_chars, score, turn_cost, reward_tests and the "
                                        "verifier's; python_tool: output_chars, tool_timeout_s, score, turn_cost and "
                                        "the verifier's)")
    max_turns: int = setting(4, doc="sampled turns per episode at most")
    max_episode_tokens: int = setting(8192, doc="E: the tokens an episode may add after its prompt (every turn and "
                                      "observation); training rows are data.max_prompt_len + E wide")
    step_timeout_s: float = setting(STEP_TIMEOUT_S, doc="seconds one environment call (construct and reset, or "
                                    "a step) may take; past it that episode fails with an error naming the "
                                    "environment and the run goes on (the call is left on an abandoned thread); "
                                    "0 = no limit")

    def turn_budget(self) -> tuple[int, int]:
        """(the cap of one turn, the overlong-penalty buffer): the block that composes this part says."""
        raise NotImplementedError(f"{type(self).__name__} composes EpisodeSettings: it must define turn_budget()")

    def __post_init__(self):
        check_step_timeout(f"{self.NAME}.step_timeout_s", self.step_timeout_s)
        if self.environment:
            at_least(self.NAME, {"max_turns": 1}, self)
            cap, overlong_buffer = self.turn_budget()
            if self.max_episode_tokens < cap:
                raise ValueError(f"{self.NAME}.max_episode_tokens={self.max_episode_tokens} must hold one turn of "
                                 f"{self.NAME}.max_new_tokens={cap}")
            if overlong_buffer > 0:
                raise ValueError(f"{self.NAME}.overlong_buffer penalises one completion's length; with "
                                 f"{self.NAME}.environment set the budget is max_episode_tokens (set it to 0)")
        super().__post_init__()
