"""Rewards: the sandboxed code verifier and small toy rewards, all behind one ``Reward`` protocol.

    from jaxrl.rewards import get_reward
    reward = get_reward("code", timeout_s=6.0)          # or "exact_match", "pattern", "arithmetic",
    results = reward.score(completions, problems)       # or "my_package.my_module:my_function"
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from jaxrl.rewards.base import TEST_STATUSES, Reward, RewardResult
from jaxrl.rewards.code import CodeVerifier
from jaxrl.rewards.toy import (ArithmeticReward, CharsetReward, ExactMatchReward, FunctionReward,
                               PatternReward)

__all__ = ["Reward", "RewardResult", "TEST_STATUSES", "CodeVerifier", "ExactMatchReward", "PatternReward",
           "ArithmeticReward", "CharsetReward", "FunctionReward", "get_reward", "register_reward", "available_rewards"]

_REGISTRY: dict[str, Callable[..., Reward]] = {
    "code": CodeVerifier,
    "exact_match": ExactMatchReward,
    "pattern": PatternReward,
    "arithmetic": ArithmeticReward,
    "charset": CharsetReward,
}


def register_reward(name: str, factory: Callable[..., Reward]) -> None:
    """Make ``get_reward(name, **kwargs)`` return ``factory(**kwargs)``."""
    if ":" in name:
        raise ValueError(f"reward names may not contain ':' (reserved for module:function), got {name!r}")
    _REGISTRY[name] = factory


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str, **kwargs: Any) -> Reward:
    """A reward by registered name, or ``"module:attribute"`` for user code.

    The attribute may be a Reward class or factory (called with ``kwargs``), a Reward instance, or a plain
    per-sample function ``fn(completion, problem, **kwargs) -> bool | float | RewardResult``.
    """
    if name in _REGISTRY:
        return _REGISTRY[name](**kwargs)
    if ":" not in name:
        raise KeyError(f"unknown reward {name!r}; registered: {available_rewards()}, or use 'module:function'")
    module_name, _, attribute = name.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"cannot load reward {name!r}: {exc}") from exc
    if isinstance(target, type):
        instance = target(**kwargs)
        if not isinstance(instance, Reward):
            raise TypeError(f"{name} built {instance!r}, which has no score(completions, problems, truncated)")
        return instance
    if isinstance(target, Reward):
        if kwargs:
            raise TypeError(f"{name} is a Reward instance; it takes no keyword arguments, got {sorted(kwargs)}")
        return target
    if callable(target):
        return FunctionReward(target, **kwargs)
    raise TypeError(f"{name} is neither a Reward nor a callable")
