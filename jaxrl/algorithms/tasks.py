"""Algorithms by name: `config.algorithm` selects the factory that builds the algorithm's Task.

    build = get_task_factory(config.algorithm)  # "sft" | "dpo" | "grpo" | "ppo" | "pkg.module:factory"
    task = build(config, model, mesh)           # a Task (the contract: jaxrl.train.task)

    @register_task("my_algo", blocks={"my_algo": MyAlgoConfig})   # from a user's module, imported first
    def build_my_algo(config, model, mesh): ...

A factory gets the resolved `TrainConfig`, the policy model (LoRA already attached; it may add modules such as a
value head before returning) and the mesh, and returns a Task. The built-in factories are imported on first use.
A factory may declare the config blocks it reads, as config dataclasses whose fields are
`jaxrl.utils.typed_config.setting`s (`register_task(name, blocks=...)` sets `factory.config_blocks`): their keys
are then checked like the built-in algorithms' blocks, and `config.block(name)` holds the built dataclass.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from jaxrl.utils.registry import PluginError, Registry, resolve

TASK_FACTORIES = Registry("algorithm", lazy={
    "sft": "jaxrl.algorithms.sft_task:build_sft",
    "dpo": "jaxrl.algorithms.dpo_task:build_dpo",
    "grpo": "jaxrl.algorithms.grpo_task:build_grpo",
    "ppo": "jaxrl.algorithms.ppo_task:build_ppo",
    "distill": "jaxrl.algorithms.distill_task:build_distill",
})


class UnknownAlgorithm(KeyError):
    """config.algorithm names no registered algorithm."""

    def __str__(self):
        return str(self.args[0])


def register_task(name: str, blocks: Optional[Mapping] = None) -> Callable:
    """Decorator registering a Task factory as `config.algorithm = name` (see the module docstring)."""

    def deco(factory: Callable) -> Callable:
        if blocks is not None:
            factory.config_blocks = dict(blocks)
        TASK_FACTORIES.add(name, factory, overwrite=True)
        return factory

    return deco


def algorithm_names() -> list[str]:
    return list(TASK_FACTORIES.names())


def get_task_factory(name: str) -> Callable:
    """The factory registered as `name`, or the one a "pkg.module:factory" names."""
    if ":" in name:
        try:
            return resolve(name)
        except PluginError as e:
            raise UnknownAlgorithm(f"algorithm={name!r}: {e}") from e
    if name not in TASK_FACTORIES:
        raise UnknownAlgorithm(f"algorithm={name!r} is not a registered algorithm; registered: {algorithm_names()}")
    return TASK_FACTORIES.get(name)
