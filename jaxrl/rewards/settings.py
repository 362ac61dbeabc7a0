"""The reward block of online algorithms (`reward.*`): which reward scores the samples, which of its fields is the
scalar, and the reward's own constructor arguments (jaxrl.rewards.get_reward makes it). No jax, no numpy here:
configs import this module."""

from __future__ import annotations

import dataclasses

from jaxrl.utils.typed_config import Block, setting

__all__ = ["REWARD_SCORES", "RewardConfig"]

REWARD_SCORES = ("partial", "strict")  # the RewardResult fields a reward's scalar may be


@dataclasses.dataclass(frozen=True)
class RewardConfig(Block):
    """`name` and `score`; every other key of the block is a keyword argument of the reward's constructor."""

    EXTRA_KEYS = "options"
    name: str = setting("code", doc="jaxrl.rewards.get_reward name or 'module:function'")
    score: str = setting("partial", doc="the RewardResult field that is the scalar reward: partial | strict",
                         choices=REWARD_SCORES)
    options: dict = dataclasses.field(default_factory=dict)  # the reward's constructor arguments
