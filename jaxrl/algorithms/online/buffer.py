"""Where a rollout's rows go between sampling and training: the mapping of rollouts onto train steps (`Schedule`)
and the rollout buffer on disk (`RolloutStore`) that a run resumed inside a rollout reads back.

Rollouts and train steps (the Trainer's unit is one optimizer update per step): a rollout of N rows is made when
one is due and then served as U = N / B_global minibatches (B_global = batch.micro_batch_size x
batch.grad_accum), `iterations` times over (GRPO num_iterations, PPO epochs), so rollout r covers train steps
[r*S, (r+1)*S) with S = iterations x U. Within a rollout, pass i serves its rows in a permutation seeded by
(seed, r, i): of the rows, or, with `group` > 1 (a layout that computes a prompt once for its rows:
jaxrl/algorithms/online/layout.py `keeps_groups`), of the rollout's prompt groups (the `group` consecutive rows
sampled from one prompt), each kept whole and in order, so every minibatch holds whole groups. Either is a uniform
random split of the rollout; the grouped one keeps a prompt's samples in one update, as GRPO's group-relative
advantages are computed.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
from typing import Optional

import numpy as np

from jaxrl.parallel.distributed import is_main_process
from jaxrl.utils.io import atomic_write_bytes

ROLLOUT_DIR = "rollouts"

@dataclasses.dataclass(frozen=True)
class Schedule:
    """Rollout r serves train steps [r*S, (r+1)*S), S = iterations x minibatches (module docstring)."""

    rows: int  # N per rollout
    global_batch: int  # B_global per train step
    iterations: int  # passes over each rollout (GRPO num_iterations, PPO epochs)
    seed: int
    group: int = 1  # rows per prompt kept together in a minibatch (module docstring); 1: rows permuted one by one

    def __post_init__(self):
        if self.iterations < 1:
            raise ValueError(f"the number of passes over a rollout must be >= 1, got {self.iterations}")

    @property
    def minibatches(self) -> int:
        return self.rows // self.global_batch

    @property
    def steps_per_rollout(self) -> int:
        return self.iterations * self.minibatches

    @property
    def whole_groups(self) -> bool:
        """Minibatches of whole groups: asked for (group > 1) and possible (a global batch holds whole groups)."""
        return self.group > 1 and self.global_batch % self.group == 0 and self.rows % self.group == 0

    def locate(self, step: int) -> tuple[int, int, int]:
        """(rollout, pass, minibatch) of 0-based train step `step`."""
        r, within = divmod(step, self.steps_per_rollout)
        i, u = divmod(within, self.minibatches)
        return r, i, u

    def rows_of(self, rollout: int, iteration: int, minibatch: int) -> np.ndarray:
        """Row indices of one minibatch: rows (or whole groups of rows) in a permutation seeded by (seed, rollout,
        pass)."""
        if self.minibatches == 1:
            return np.arange(self.rows)
        rng = np.random.default_rng([self.seed, rollout, iteration, 3571])
        if self.whole_groups:
            groups = rng.permutation(self.rows // self.group)
            perm = (groups[:, None] * self.group + np.arange(self.group)[None, :]).reshape(-1)
        else:
            perm = rng.permutation(self.rows)
        return perm[minibatch * self.global_batch:(minibatch + 1) * self.global_batch]


def check_rows(rows: int, global_batch: int, what: str) -> None:
    if rows % global_batch:
        raise ValueError(f"{what} = {rows} rows per rollout is not a multiple of the global batch "
                         f"batch.micro_batch_size x batch.grad_accum = {global_batch}; each rollout is served as "
                         f"whole global batches")


def _npz_bytes(arrays: dict, meta: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays, __meta__=np.asarray(json.dumps(meta)))
    return buf.getvalue()


class RolloutStore:
    """`<workdir>/rollouts/<r>.npz`: written atomically (temp file + rename, fsync'd) by the main process."""

    def __init__(self, workdir: str):
        self.dir = os.path.join(workdir, ROLLOUT_DIR)

    def path(self, rollout: int) -> str:
        return os.path.join(self.dir, f"{rollout}.npz")

    def save(self, rollout: int, arrays: dict, meta: dict) -> str:
        if is_main_process():
            atomic_write_bytes(self.path(rollout), _npz_bytes(arrays, meta))
        return os.path.basename(self.path(rollout))

    def load(self, rollout: int) -> Optional[tuple[dict, dict]]:
        path = self.path(rollout)
        if not os.path.exists(path):
            return None
        with np.load(path) as f:
            arrays = {k: np.asarray(f[k]) for k in f.files if k != "__meta__"}
            meta = json.loads(str(f["__meta__"]))
        return arrays, meta

    def prune(self, keep_from: int) -> list[int]:
        """Delete buffers of rollouts < keep_from; returns them."""
        if not is_main_process() or not os.path.isdir(self.dir):
            return []
        gone = []
        for name in os.listdir(self.dir):
            m = re.fullmatch(r"(\d+)\.npz", name)
            if m and int(m.group(1)) < keep_from:
                os.remove(os.path.join(self.dir, name))
                gone.append(int(m.group(1)))
        return sorted(gone)
