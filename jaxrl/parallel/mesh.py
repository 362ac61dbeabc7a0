"""The device mesh from the config: `mesh.shape = (data, fsdp, tensor)`.

    mesh = mesh_from_config(config.mesh)     # a run's `mesh` block, e.g. (1, -1, 1): FSDP over every device
    mesh = make_mesh((2, 2, 2))
    mesh = local_mesh((-1, 1, 1))            # this process's devices only, all data-parallel (rollouts, eval)

One entry may be -1 (all remaining devices). On a single process the mesh may use fewer devices than exist
(the first ones), which is what a one-device run on a many-device host wants; across processes a training mesh
must use them all (every process has to own part of the mesh). A local mesh holds one process's devices: work
that each process does on its own share (offline rollouts, evaluation) runs on it without any collective across
processes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl.parallel.settings import MeshConfig

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)


class MeshConfigError(ValueError):
    """`mesh.shape` does not fit the devices; names the key and what would be valid."""


def resolve_shape(shape: Sequence[int], n_devices: int) -> tuple[int, int, int]:
    shape = [int(s) for s in shape]
    if len(shape) != 3:
        raise MeshConfigError(f"mesh.shape must have 3 entries {MESH_AXES}, got {tuple(shape)}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise MeshConfigError(f"mesh.shape={tuple(shape)}: entries must be positive, with at most one -1")
    if -1 in shape:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        if n_devices % known:
            raise MeshConfigError(f"mesh.shape={tuple(shape)}: {n_devices} devices are not a multiple of {known}")
        shape[shape.index(-1)] = n_devices // known
    return tuple(shape)


def _mesh(shape: Sequence[int], devices: list, span_all: bool) -> Mesh:
    resolved = resolve_shape(shape, len(devices))
    total = resolved[0] * resolved[1] * resolved[2]
    if total > len(devices):
        raise MeshConfigError(f"mesh.shape={tuple(shape)} needs {total} devices; {len(devices)} are available")
    if total < len(devices):
        if span_all:
            raise MeshConfigError(f"mesh.shape={tuple(shape)} uses {total} of {len(devices)} devices; with "
                                  f"{jax.process_count()} processes the mesh must span every device")
        devices = devices[:total]
    return Mesh(np.array(devices).reshape(resolved), MESH_AXES)


def make_mesh(shape: Sequence[int], devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all); fewer devices than exist on one process."""
    devices = list(devices if devices is not None else jax.devices())
    return _mesh(shape, devices, span_all=jax.process_count() > 1)


def local_mesh(shape: Sequence[int] = (-1, 1, 1)) -> Mesh:
    """A (data, fsdp, tensor) mesh over this process's own devices (the first ones when it needs fewer); the
    default puts every local device on `data`."""
    return _mesh(shape, list(jax.local_devices()), span_all=False)


def mesh_from_config(mesh: MeshConfig) -> Mesh:
    """A run's `mesh` block (`mesh.shape`) -> Mesh."""
    return make_mesh(mesh.shape)
