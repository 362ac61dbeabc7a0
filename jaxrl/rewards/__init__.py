"""Rewards: the sandboxed code verifier and small toy rewards, all behind one ``Reward`` protocol.

    from jaxrl.rewards import get_reward
    reward = get_reward("code", timeout_s=6.0)          # or "exact_match", "pattern", "arithmetic",
    results = reward.score(completions, problems)       # or "my_package.my_module:my_function"

The names below are imported on first use, so `jaxrl.rewards.settings` (the `reward.*` block: configs import it)
stays free of numpy and the sandbox.
"""

from __future__ import annotations

from jaxrl.utils.registry import lazy_exports

_EXPORTS = {
    "Reward": "jaxrl.rewards.base", "RewardResult": "jaxrl.rewards.base", "TEST_STATUSES": "jaxrl.rewards.base",
    "CodeVerifier": "jaxrl.rewards.code",
    "REWARDS": "jaxrl.rewards.registry", "available_rewards": "jaxrl.rewards.registry",
    "get_reward": "jaxrl.rewards.registry", "register_reward": "jaxrl.rewards.registry",
    "ArithmeticReward": "jaxrl.rewards.toy", "CharsetReward": "jaxrl.rewards.toy",
    "ExactMatchReward": "jaxrl.rewards.toy", "FunctionReward": "jaxrl.rewards.toy",
    "PatternReward": "jaxrl.rewards.toy",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
