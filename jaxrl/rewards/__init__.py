"""Rewards: the sandboxed code verifier and small toy rewards, all behind one ``Reward`` protocol.

    from jaxrl.rewards import get_reward
    reward = get_reward("code", timeout_s=6.0)          # or "exact_match", "pattern", "arithmetic",
    results = reward.score(completions, problems)       # or "my_package.my_module:my_function"
"""

from __future__ import annotations

from jaxrl.rewards.base import TEST_STATUSES, Reward, RewardResult
from jaxrl.rewards.code import CodeVerifier
from jaxrl.rewards.registry import REWARDS, available_rewards, get_reward, register_reward
from jaxrl.rewards.toy import (ArithmeticReward, CharsetReward, ExactMatchReward, FunctionReward,
                               PatternReward)

__all__ = ["Reward", "RewardResult", "TEST_STATUSES", "CodeVerifier", "ExactMatchReward", "PatternReward",
           "ArithmeticReward", "CharsetReward", "FunctionReward", "REWARDS", "get_reward", "register_reward",
           "available_rewards"]
