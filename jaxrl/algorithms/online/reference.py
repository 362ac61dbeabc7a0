"""Reference resets (`<block>.ref_reset_every`): in a long run the KL anchor moves with the policy. Every
`ref_reset_every` rollouts the reference becomes the policy that samples that rollout (its adapters), until the
next reset; before the first, the reference is the base model (the adapters off).

    resets = ReferenceResets(every=50)
    resets.open(workdir)
    model, event = resets.reference_for(rollout, policy)   # None: the adapters-off base; event: metrics to log

The adapters of each reset are written to `<workdir>/reference/rollout_<k>.npz` the first time rollout k is made,
so a resumed run (or a rollout made again from the same checkpoint) reads the same reference back, bit for bit; a
rollout sampled ahead (`max_staleness`) takes the reference of its own index. With `ref_reset_optimizer` the
optimizer's moments start over at each reset too (OnlineTask.resets_optimizer, jaxrl.train.optim.reset_adam_moments).
"""

from __future__ import annotations

import io
import os
from typing import Optional

import jax
import numpy as np
from absl import logging
from flax import nnx

from jaxrl.models.lora import LoRAParam
from jaxrl.utils.io import atomic_write_bytes

REFERENCE_DIR = "reference"


def _paths(state) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


class ReferenceResets:
    """The reference of each rollout (module docstring). `every` = 0: never reset (the base model throughout)."""

    def __init__(self, every: int):
        self.every = int(every)
        self.folder: Optional[str] = None
        self._cached: tuple[int, dict] = (-1, {})

    def open(self, workdir: str) -> None:
        self.folder = os.path.join(workdir, REFERENCE_DIR) if workdir else None

    def last_reset(self, rollout: int) -> int:
        """The rollout whose policy is rollout `rollout`'s reference (0: the base model)."""
        return (rollout // self.every) * self.every if self.every else 0

    def reference_for(self, rollout: int, policy) -> tuple[Optional[nnx.Module], dict]:
        """(the reference model of rollout `rollout`, or None for the adapters-off base; the metrics of the reset
        made at this rollout, if it is one)."""
        k = self.last_reset(rollout)
        if k == 0:
            return None, {}
        graphdef, adapters, rest = nnx.split(policy, LoRAParam, ...)
        names = _paths(adapters)
        event = {}
        if self._cached[0] != k:
            values = self._read(k)
            if values is None:
                if rollout != k:
                    raise FileNotFoundError(f"rollout {rollout}'s reference is the policy of rollout {k}, and "
                                            f"{self._path(k)} is missing: the reference folder was removed")
                values = {n: np.asarray(v) for n, v in zip(names, jax.tree_util.tree_leaves(adapters))}
                self._write(k, values)
                logging.info("reference reset at rollout %d: the reference is now the policy that samples it", k)
                event = {"reference/reset": 1.0}
            self._cached = (k, values)
        values = self._cached[1]
        if sorted(values) != sorted(names):
            raise ValueError(f"{self._path(k)} holds other adapters than this run's (a different LoRA config)")
        leaves = [jax.numpy.asarray(values[n], dtype=v.dtype) for n, v in
                  zip(names, jax.tree_util.tree_leaves(adapters))]
        snapshot = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(adapters), leaves)
        return nnx.merge(graphdef, snapshot, rest), {**event, "reference/rollout": float(k)}

    def _path(self, k: int) -> str:
        return os.path.join(self.folder or "", f"rollout_{k}.npz")

    def _read(self, k: int) -> Optional[dict]:
        if self.folder is None or not os.path.exists(self._path(k)):
            return None
        with np.load(self._path(k)) as f:
            names = [str(n) for n in f["__names__"]]
            return {n: f[f"a{i}"] for i, n in enumerate(names)}

    def _write(self, k: int, values: dict) -> None:
        if self.folder is None or jax.process_index() != 0:  # one writer; every host holds the values it made
            return
        os.makedirs(self.folder, exist_ok=True)
        buf = io.BytesIO()
        names = list(values)
        np.savez(buf, __names__=np.asarray(names), **{f"a{i}": values[n] for i, n in enumerate(names)})
        atomic_write_bytes(self._path(k), buf.getvalue())
