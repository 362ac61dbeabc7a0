"""Batched forward passes over many rows with one jitted program: DPO reference / held-out log-probs, online
log-probs and values of rollouts, the in-process distillation teacher's scores (jaxrl.backends.jax_teacher).

    program = jit_program(pass_fn, ("graphdef", "adapters"), config.compile_options, mesh)
    out = map_batches(lambda batch: program(graphdef, state, batch, adapters=False), arrays, keys,
                      batch_size=8, mesh=mesh)            # pytree of float32 [N, ...], one leaf per output

Every call sees `batch_size` rows (rounded up to a multiple of data x fsdp on a mesh; without one, at most the
number of rows): the last call is padded with copies of row 0, whose results are discarded, so each pass
compiles once. On a mesh the rows are split over data x fsdp and the results come back replicated, so every
process can read them (multi-host).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import numpy as np

from jaxrl.parallel import sharding as shd

_PROGRAMS: dict = {}


def jit_program(fn: Callable, static_argnames: Sequence[str], options: Optional[dict] = None, mesh=None):
    """`jax.jit(fn)` with these XLA options, outputs replicated on `mesh`; one per (fn, options, mesh), and jax
    caches its compilations by (static arguments, shapes)."""
    key = (fn, tuple(static_argnames), tuple(sorted((options or {}).items())), mesh)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = jax.jit(fn, static_argnames=tuple(static_argnames),
                                 out_shardings=None if mesh is None else shd.replicated(mesh),
                                 compiler_options=dict(key[2]) or None)
    return _PROGRAMS[key]


def pass_batch_size(batch_size: int, rows: int, mesh=None) -> int:
    """Rows per call: a multiple of data x fsdp on a mesh, else at most `rows` (and at least 1)."""
    if mesh is not None:
        shards = shd.batch_shards(mesh)
        return -(-int(batch_size) // shards) * shards
    return max(1, min(int(batch_size), int(rows)))


def put_rows(batch: dict, mesh) -> dict:
    """Host arrays -> global arrays split over data x fsdp on their first dimension (each process fills its own
    shards)."""
    return {k: jax.make_array_from_callback(v.shape, shd.batch_sharding(mesh, v.ndim), lambda idx, v=v: v[idx])
            for k, v in batch.items()}


def map_batches(apply: Callable[[dict], object], arrays: dict, keys: Sequence[str], *, batch_size: int,
                mesh=None):
    """`apply(batch)` over every row of `arrays[k]` (k in `keys`, [N, ...]), `batch_size` rows a call (module
    docstring); returns its outputs for all N rows, the same pytree with float32 [N, ...] leaves."""
    n = arrays[keys[0]].shape[0]
    batch_size = pass_batch_size(batch_size, n, mesh)
    outs = []
    for start in range(0, n, batch_size):
        rows = np.arange(start, start + batch_size)
        rows = np.where(rows < n, rows, 0)
        batch = {k: np.asarray(arrays[k][rows]) for k in keys}
        if mesh is not None:
            batch = put_rows(batch, mesh)
        keep = min(batch_size, n - start)
        outs.append(jax.tree.map(lambda v: np.asarray(v[:keep], np.float32), jax.device_get(apply(batch))))
    return jax.tree.map(lambda *parts: np.concatenate(parts), *outs)
