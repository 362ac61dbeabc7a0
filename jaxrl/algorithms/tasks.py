"""Algorithms (trainers) by name: `config.algorithm` selects one.

    build = get_trainer(config.algorithm)       # "sft" | "dpo" | "grpo" | "ppo" | "pkg.module:factory"
    task = build(config, model, mesh)           # a jaxrl.train.loop Task (objective + batches)

    @register_trainer("my_algo")                # from a user's module, imported before run_training
    def build_my_algo(config, model, mesh): ...

A factory gets the resolved config, the policy model (LoRA already attached; it may add modules such as a value
head before returning) and the mesh, and returns a `Task`. The built-in factories are imported on first use.
A factory may declare the config blocks it reads as `factory.config_blocks = {"my_algo": Block(...), ...}`
(`register_trainer(name, blocks=...)` sets it): their keys are then checked like the built-in algorithms' blocks.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from jaxrl.utils.registry import PluginError, Registry, resolve

TRAINERS = Registry("trainer", lazy={
    "sft": "jaxrl.algorithms.sft_task:build_sft",
    "dpo": "jaxrl.algorithms.dpo_task:build_dpo",
    "grpo": "jaxrl.algorithms.grpo_task:build_grpo",
    "ppo": "jaxrl.algorithms.ppo_task:build_ppo",
})


class UnknownAlgorithm(KeyError):
    """config.algorithm names no registered trainer."""

    def __str__(self):
        return str(self.args[0])


def register_trainer(name: str, blocks: Optional[Mapping] = None) -> Callable:
    """Decorator registering a Task factory as `config.algorithm = name` (see the module docstring)."""

    def deco(factory: Callable) -> Callable:
        if blocks is not None:
            factory.config_blocks = dict(blocks)
        TRAINERS.add(name, factory, overwrite=True)
        return factory

    return deco


def trainer_names() -> list[str]:
    return list(TRAINERS.names())


def get_trainer(name: str) -> Callable:
    """The factory registered as `name`, or the one a "pkg.module:factory" names."""
    if ":" in name:
        try:
            return resolve(name)
        except PluginError as e:
            raise UnknownAlgorithm(f"algorithm={name!r}: {e}") from e
    if name not in TRAINERS:
        raise UnknownAlgorithm(f"algorithm={name!r} is not a registered trainer; registered: {trainer_names()}")
    return TRAINERS.get(name)
