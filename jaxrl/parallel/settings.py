"""The settings the parallel layout owns: the device mesh of a training run (`mesh.*`, jaxrl.parallel.mesh acts on
it). No jax here: configs import this module (through jaxrl.algorithms.config)."""

from __future__ import annotations

import dataclasses

from jaxrl.utils.typed_config import Block, setting

__all__ = ["MeshConfig"]


@dataclasses.dataclass(frozen=True)
class MeshConfig(Block):
    shape: tuple = setting((1, -1, 1), tuple, "(data, fsdp, tensor); -1 takes the remaining devices")
