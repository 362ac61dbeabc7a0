"""Algorithms by name: `config.algorithm` selects the `Algorithm` (its config blocks and the factory of its Task).

    algorithm = get_algorithm(config.algorithm)   # "sft" | "dpo" | "grpo" | "ppo" | "distill" | "pkg.module:factory"
    algorithm.blocks                              # {"grpo": GRPOConfig, "data": OnlineDataConfig, "reward": ...}
    task = algorithm(config, model, mesh)         # a Task (the contract: jaxrl.train.task)

    @register_task("my_algo", blocks={"my_algo": MyAlgoConfig})   # from a user's module, imported first
    def build_my_algo(config, model, mesh): ...

Every algorithm is registered the one way: an `Algorithm` (jaxrl.algorithms.config) of its name, the config
blocks it reads (config dataclasses whose fields are `jaxrl.utils.typed_config.setting`s: their keys are checked,
`config.<block>` holds the built dataclass; a block declared as None is taken as it is), the family-config labels
it records, and its factory. A built-in declares its blocks in its jax-free `<name>_config.py` and its factory in
`<name>_task.py` (imported when a run builds it), and is registered below with `register_task`, as a user's module
registers its own. A factory gets the resolved `TrainConfig`, the policy model (LoRA already attached; it may add
modules such as a value head before returning) and the mesh, and returns a Task.

No jax here: configs import this module (through jaxrl.algorithms.config).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

import ml_collections

from jaxrl.algorithms import config as run_config
from jaxrl.algorithms import distill_config, dpo_config, grpo_config, ppo_config, sft_config
from jaxrl.algorithms.config import OPEN_DATA, Algorithm
from jaxrl.utils.registry import PluginError, Registry, origin_of, resolve

__all__ = ["ALGORITHMS", "Algorithm", "UnknownAlgorithm", "algorithm_names", "algorithm_of", "default_config",
           "get_algorithm", "get_task_factory", "register_task", "registered"]


ALGORITHMS = Registry("algorithm")


class UnknownAlgorithm(KeyError):
    """config.algorithm names no registered algorithm."""

    def __str__(self):
        return str(self.args[0])


def register_task(name: str, blocks: Optional[Mapping] = None, labels: tuple = ()) -> Callable:
    """Decorator registering a Task factory as `config.algorithm = name`, with the config blocks it reads (see the
    module docstring; none declared: its `data` block is taken as it is) and the labels its family configs record.
    The factory is returned unchanged, its blocks also set as `factory.config_blocks`; a "module:attr" string in
    place of the factory is imported when a run builds the task (the built-ins below)."""

    def deco(factory: Union[str, Callable]) -> Union[str, Callable]:
        declared = dict(blocks) if blocks is not None else dict(OPEN_DATA)
        if blocks is not None and not isinstance(factory, str):
            factory.config_blocks = dict(blocks)
        origin = factory if isinstance(factory, str) else origin_of(factory)
        ALGORITHMS.add(name, Algorithm(name, declared, factory, tuple(labels)), overwrite=True, origin=origin)
        return factory

    return deco


# The built-in algorithms, registered as a user's is: each declares its blocks in its jax-free `<name>_config.py`
# (imported above: configs read them without jax) and its task factory in `<name>_task.py` (imported when a run
# builds it).
register_task("sft", sft_config.BLOCKS)("jaxrl.algorithms.sft_task:build_sft")
register_task("dpo", dpo_config.BLOCKS, labels=("run", "start"))("jaxrl.algorithms.dpo_task:build_dpo")
register_task("grpo", grpo_config.BLOCKS, labels=("run", "start", "probe"))("jaxrl.algorithms.grpo_task:build_grpo")
register_task("ppo", ppo_config.BLOCKS, labels=("run", "start"))("jaxrl.algorithms.ppo_task:build_ppo")
register_task("distill", distill_config.BLOCKS, labels=("run", "start"))("jaxrl.algorithms.distill_task:build_distill")


def algorithm_of(name: str, factory: Callable) -> Algorithm:
    """The Algorithm of a bare factory (a user's, named by "module:attr"): the blocks it declares in
    `config_blocks` (what `register_task` sets), else its `data` block taken as it is."""
    if isinstance(factory, Algorithm):
        return factory
    declared = getattr(factory, "config_blocks", None)  # a user's factory: the documented optional attribute
    return Algorithm(name, dict(declared) if declared is not None else dict(OPEN_DATA), factory)


def algorithm_names() -> list[str]:
    return list(ALGORITHMS.names())


def get_algorithm(name: str) -> Algorithm:
    """The Algorithm registered as `name`, or the one of the factory a "pkg.module:factory" names."""
    if ":" in name:
        try:
            return algorithm_of(name, resolve(name))
        except PluginError as e:
            raise UnknownAlgorithm(f"algorithm={name!r}: {e}") from e
    if name not in ALGORITHMS:
        raise UnknownAlgorithm(f"algorithm={name!r} is not a registered algorithm; registered: {algorithm_names()}")
    return ALGORITHMS.get(name)


def get_task_factory(name: str) -> Callable:
    """The task factory of algorithm `name` (a registered name or "pkg.module:factory")."""
    return get_algorithm(name).factory


def registered(name: str) -> Optional[Algorithm]:
    """The Algorithm registered as `name` (a built-in, or a user's registered in this process), None otherwise: a
    "pkg.module:factory" is not imported here (sweeps complete its config without it)."""
    return ALGORITHMS.get(name) if name in ALGORITHMS else None


def default_config(name: str = "sft") -> ml_collections.ConfigDict:
    """Every key a run of the registered algorithm `name` reads, at its default (what configs/base.py returns)."""
    algorithm = registered(name)
    if algorithm is None:
        raise ValueError(f"default_config: algorithm={name!r}; registered algorithms: {algorithm_names()}")
    return run_config.default_config(algorithm)
