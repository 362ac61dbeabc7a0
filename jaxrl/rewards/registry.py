"""Rewards by name: the built-ins, rewards registered by code, and reward plug-ins checked before training.

    reward = get_reward("code", timeout_s=6.0)        # a registered name (the factory gets the kwargs)
    reward = get_reward("my_package.my_module:my_fn")  # or "module:attr" / "file.py:attr" of user code
    register_reward("mine", factory)                   # get_reward("mine", **kw) -> factory(**kw)

An entry is a factory ``(**kwargs) -> Reward``. The attribute of a "module:attr" may be a Reward class or
factory (called with the kwargs), a Reward instance, or a per-sample function
``fn(completion, problem, **kwargs) -> bool | float in [0, 1] | RewardResult`` (wrapped in FunctionReward).
A reward plug-in (``REWARDS.load("file.py:fn")``) is first called on two example completions of a toy problem.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

from jaxrl.data.problems import Problem, load_problems
from jaxrl.rewards.base import Reward, RewardResult
from jaxrl.rewards.code import CodeVerifier
from jaxrl.rewards.toy import (ArithmeticReward, CharsetReward, ExactMatchReward, FunctionReward, PatternReward,
                               TokenBlockReward)
from jaxrl.utils.registry import PluginError, Registry, resolve

__all__ = ["REWARDS", "REWARD_SIGNATURE", "available_rewards", "check_reward_plugin", "example_problem",
           "get_reward", "register_reward"]

REWARD_SIGNATURE = ("fn(completion: str, problem: jaxrl.data.problems.Problem, **kwargs) -> bool | float in "
                    "[0, 1] | RewardResult, or a Reward class (with score(completions, problems, truncated))")
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


def check_reward_plugin(label: str, target: Any) -> None:
    """PluginError unless `target` is a Reward class or a per-sample reward function that scores two example
    completions of a toy problem with one number in [0, 1] each."""
    if isinstance(target, type):
        if not callable(getattr(target, "score", None)):
            raise PluginError(f"{label}: class {target.__name__} has no score(completions, problems, truncated); "
                              f"expected {REWARD_SIGNATURE}")
        return
    if not callable(target):
        raise PluginError(f"{label}: {type(target).__name__} is not callable; expected {REWARD_SIGNATURE}")
    try:
        inspect.signature(target).bind("completion", "problem")
    except TypeError as e:
        raise PluginError(f"{label}: wrong signature {inspect.signature(target)}; expected {REWARD_SIGNATURE} "
                          f"({e})") from None
    except ValueError:
        pass  # builtins without a signature: the call below decides
    problem = example_problem()
    for completion in ("", "```python\nprint(input())\n```"):
        try:
            value = target(completion, problem)
        except Exception as e:  # noqa: BLE001 - re-raised naming the plug-in
            raise PluginError(f"{label}: raised {type(e).__name__} on the example completion {completion!r} of toy "
                              f"problem {problem.id!r}; expected {REWARD_SIGNATURE}. Error: {e}") from e
        if isinstance(value, RewardResult):
            value = value.partial
        if isinstance(value, bool):
            continue
        if getattr(value, "ndim", 0) != 0 or isinstance(value, (list, tuple, dict, str)):
            raise PluginError(f"{label}: returned {type(value).__name__} {value!r}, not one number; expected "
                              f"{REWARD_SIGNATURE}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise PluginError(f"{label}: returned {type(value).__name__} {value!r}; expected "
                              f"{REWARD_SIGNATURE}") from None
        if not 0.0 <= number <= 1.0:  # also false for NaN
            raise PluginError(f"{label}: returned {number!r} on the example completion {completion!r}; rewards "
                              f"are in [0, 1]: {REWARD_SIGNATURE}")


REWARDS = Registry("reward", signature=REWARD_SIGNATURE, validate=check_reward_plugin, prepare=as_factory,
                   hint="Or name a reward of your own as 'module:function'")
for _name, _factory in (("code", CodeVerifier), ("exact_match", ExactMatchReward), ("pattern", PatternReward),
                        ("arithmetic", ArithmeticReward), ("charset", CharsetReward),
                        ("token_block", TokenBlockReward)):
    REWARDS.add(_name, _factory)


def register_reward(name: str, factory: Callable[..., Reward]) -> None:
    """Make ``get_reward(name, **kwargs)`` return ``factory(**kwargs)``."""
    if ":" in name:
        raise ValueError(f"reward names may not contain ':' (reserved for module:function), got {name!r}")
    REWARDS.add(name, factory, overwrite=True)


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
