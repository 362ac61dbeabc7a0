"""Rewards by name: the built-ins, and rewards of user code.

    reward = get_reward("code", timeout_s=6.0)        # a registered name (the factory gets the kwargs)
    reward = get_reward("my_package.my_module:my_fn")  # or "module:attr" / "file.py:attr" of user code

An entry is a factory ``(**kwargs) -> Reward``. The attribute of a "module:attr" may be a Reward class or
factory (called with the kwargs), a Reward instance, or a per-sample function
``fn(completion, problem, **kwargs) -> bool | float in [0, 1] | RewardResult`` (wrapped in FunctionReward).
A reward plug-in registered by name (a `plugins` entry of kind reward, or ``plugins.register("reward", name)``;
jaxrl.algorithms.plugins) is first scored on :func:`example_problem` and stored through :func:`as_factory`.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from jaxrl.data.problems import Problem, load_problems
from jaxrl.rewards.base import Reward
from jaxrl.rewards.code import CodeVerifier
from jaxrl.rewards.reasoning_gym import ReasoningGymReward
from jaxrl.rewards.toy import (ArithmeticReward, CharsetReward, ExactMatchReward, FunctionReward, PatternReward,
                               TokenBlockReward)
from jaxrl.data.reasoning_gym import require as require_reasoning_gym
from jaxrl.utils.registry import PluginError, Registry, resolve

__all__ = ["REWARDS", "as_factory", "available_rewards", "example_problem", "get_reward", "register_reward"]

EXAMPLE_PROBLEMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tasks",
                                "problems.jsonl")


def example_problem() -> Problem:
    """The first toy problem shipped with the package (a real Problem, so user rewards see the real type)."""
    return load_problems(EXAMPLE_PROBLEMS)[0]


def as_factory(target: Any) -> Callable[..., Reward]:
    """A Reward class stays itself; a per-sample function becomes ``(**kw) -> FunctionReward(fn, **kw)``."""
    if isinstance(target, type):
        return target

    def factory(**kwargs):
        return FunctionReward(target, **kwargs)

    return factory


class _Rewards(Registry):
    """The reward registry, where a reward may need an optional package: looking it up (`get`) runs its check, so
    a run, rollout or evaluation that names it without the package is refused in one line by the first check that
    looks the name up (jaxrl.rollout.runner.check_reward_choice, before any model loads), not when it is built."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.needs: dict[str, Callable[[], Any]] = {}  # name -> a check that raises when its package is missing

    def get(self, name: str) -> Any:
        if name in self.needs:
            self.needs[name]()
        return super().get(name)


REWARDS = _Rewards("reward", hint="Or name a reward of your own as 'module:function'")
for _name, _factory in (("code", CodeVerifier), ("exact_match", ExactMatchReward), ("pattern", PatternReward),
                        ("arithmetic", ArithmeticReward), ("charset", CharsetReward),
                        ("token_block", TokenBlockReward), ("reasoning_gym", ReasoningGymReward)):
    REWARDS.add(_name, _factory)
REWARDS.needs["reasoning_gym"] = require_reasoning_gym  # pip install -e '.[tasks]'


def register_reward(name: str, factory: Callable[..., Reward]) -> None:
    """Make ``get_reward(name, **kwargs)`` return ``factory(**kwargs)``: a factory added unchecked, for library
    code; a user's reward goes through jaxrl.algorithms.plugins, which scores it on an example first. A built-in
    name is refused (KeyError)."""
    if ":" in name:
        raise ValueError(f"reward names may not contain ':' (reserved for module:function), got {name!r}")
    REWARDS.add(name, factory)


def available_rewards() -> list[str]:
    return list(REWARDS.names())


def get_reward(name: str, **kwargs: Any) -> Reward:
    """A reward by registered name, or ``"module:attribute"`` for user code (module docstring)."""
    if ":" not in name:
        return REWARDS.get(name)(**kwargs)
    try:
        target = resolve(name, callable_only=False)
    except PluginError as exc:
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
