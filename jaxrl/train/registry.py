"""Algorithms (trainers) by name: `config.algorithm` selects one.

    @register_trainer("dpo")
    def build_dpo(config, model, mesh) -> Task: ...     # jaxrl.train.loop.Task

    build = get_trainer(config.algorithm)               # "sft" | "dpo" | "grpo" | "ppo" | "pkg.module:fn"

A factory gets the resolved config, the policy model (LoRA already attached; it may add modules such as a value
head before returning) and the mesh, and returns a `Task` (objective + batches). Modules are imported on first
use: `sft` from `jaxrl.train.sft`; for any other name `jaxrl.algorithms.<name>_trainer`, then
`jaxrl.algorithms.<name>`, so an algorithm registers itself by decorating its factory in one of those.
`"pkg.module:fn"` names a factory directly.
"""

from __future__ import annotations

import importlib
from typing import Callable

_TRAINERS: dict[str, Callable] = {}
_BUILTIN_MODULES = {"sft": "jaxrl.train.sft", "dpo": "jaxrl.algorithms.dpo_trainer"}


class UnknownAlgorithm(KeyError):
    """config.algorithm names no registered trainer."""

    def __str__(self):
        return str(self.args[0])


def register_trainer(name: str) -> Callable:
    def deco(factory: Callable) -> Callable:
        _TRAINERS[name] = factory
        return factory
    return deco


def _algorithm_trainer_modules() -> list[str]:
    """`jaxrl.algorithms.*_trainer` modules (where the algorithms register their factories)."""
    import pkgutil
    try:
        package = importlib.import_module("jaxrl.algorithms")
    except ImportError:
        return []
    return [f"jaxrl.algorithms.{m.name}" for m in pkgutil.iter_modules(package.__path__)
            if m.name.endswith("_trainer")]


def _try_import(module: str) -> None:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:  # the module exists but one of its own imports is missing: say so
            raise


def trainer_names() -> list[str]:
    for module in list(_BUILTIN_MODULES.values()) + _algorithm_trainer_modules():
        _try_import(module)
    return sorted(_TRAINERS)


def get_trainer(name: str) -> Callable:
    """The factory registered as `name`, importing (in order, until it is registered) the built-in module,
    `jaxrl.algorithms.<name>_trainer` and `jaxrl.algorithms.<name>`."""
    if ":" in name:
        module, attr = name.split(":", 1)
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise UnknownAlgorithm(f"algorithm={name!r}: cannot import {attr!r} from {module!r} ({e})") from e
    for module in (_BUILTIN_MODULES.get(name), f"jaxrl.algorithms.{name}_trainer", f"jaxrl.algorithms.{name}"):
        if name in _TRAINERS:
            break
        if module:
            _try_import(module)
    if name not in _TRAINERS:
        raise UnknownAlgorithm(f"algorithm={name!r} is not a registered trainer; registered: {trainer_names()}")
    return _TRAINERS[name]
