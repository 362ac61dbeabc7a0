"""The task base of online GRPO and PPO: the mapping of rollouts onto train steps, the rollout buffer on disk, and
its Task phases over them (jaxrl.train.task: setup, needs_rollout / rollout, batch, on_checkpoint).

Rollouts and train steps (the Trainer's unit is one optimizer update per step): a rollout of N rows is made when
one is due and then served as U = N / B_global minibatches (B_global = batch.micro_batch_size x
batch.grad_accum), `iterations` times over (GRPO num_iterations, PPO epochs), so rollout r covers train steps
[r*S, (r+1)*S) with S = iterations x U. Within a rollout, pass i serves its rows in a permutation seeded by
(seed, r, i). The policy the Trainer holds at the rollout's first step is the behaviour policy.

Resume: a rollout made from the same parameters is bit-identical (`jaxrl.algorithms.online_rollouts`). A run
resumed at a rollout boundary therefore regenerates it from the restored parameters; a run resumed in the middle
of a rollout (S > 1) needs the rollout as it was: each rollout with S > 1 is written atomically to
`<workdir>/rollouts/<r>.npz` before it is trained on, and buffers no kept checkpoint can need are deleted at each
checkpoint. The task's state_dict (JSON, saved with every checkpoint) holds the rollout index, that file's name
and the algorithm's host state (PPO's KL coefficient).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import time
from typing import Optional

import numpy as np
from absl import logging

from jaxrl.parallel.distributed import is_main_process
from jaxrl.train.task import TaskContext
from jaxrl.utils.io import atomic_write_bytes
from jaxrl.utils.train_config import TrainConfig

ROLLOUT_DIR = "rollouts"

# ------------------------------------------------------------------------------------------------- schedule


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Rollout r serves train steps [r*S, (r+1)*S), S = iterations x minibatches (module docstring)."""

    rows: int  # N per rollout
    global_batch: int  # B_global per train step
    iterations: int  # passes over each rollout (GRPO num_iterations, PPO epochs)
    seed: int

    def __post_init__(self):
        if self.iterations < 1:
            raise ValueError(f"the number of passes over a rollout must be >= 1, got {self.iterations}")

    @property
    def minibatches(self) -> int:
        return self.rows // self.global_batch

    @property
    def steps_per_rollout(self) -> int:
        return self.iterations * self.minibatches

    def locate(self, step: int) -> tuple[int, int, int]:
        """(rollout, pass, minibatch) of 0-based train step `step`."""
        r, within = divmod(step, self.steps_per_rollout)
        i, u = divmod(within, self.minibatches)
        return r, i, u

    def rows_of(self, rollout: int, iteration: int, minibatch: int) -> np.ndarray:
        """Row indices of one minibatch: rows in a permutation seeded by (seed, rollout, pass)."""
        if self.minibatches == 1:
            return np.arange(self.rows)
        perm = np.random.default_rng([self.seed, rollout, iteration, 3571]).permutation(self.rows)
        return perm[minibatch * self.global_batch:(minibatch + 1) * self.global_batch]


def check_rows(rows: int, global_batch: int, what: str) -> None:
    if rows % global_batch:
        raise ValueError(f"{what} = {rows} rows per rollout is not a multiple of the global batch "
                         f"batch.micro_batch_size x batch.grad_accum = {global_batch}; each rollout is served as "
                         f"whole global batches")


# ------------------------------------------------------------------------------------------------- the buffer


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


# ------------------------------------------------------------------------------------------------- the task base


class OnlineTask:
    """Task base of GRPO and PPO (the phases of jaxrl.train.task), see the module docstring. Subclasses implement
    `make_rollout(rollout, policy) -> (buffer: {key: [N, ...]}, metrics)` and `train_keys` (the buffer keys a train
    batch carries), and may keep host state in `host_state()` / `load_host_state(d)` (e.g. PPO's KL
    coefficient)."""

    train_keys: tuple[str, ...] = ()

    def __init__(self, config: TrainConfig, schedule: Schedule):
        self.config, self.schedule = config, schedule
        self.compile_options = dict(config.compile_options) or None
        self.buffer: Optional[dict] = None
        self.buffer_rollout = -1
        self.rollout_metrics: dict = {}
        self.rollout_timing: dict = {}  # time/* of the rollout made for the next batch (logged once)
        self.loaded_state: dict = {}
        self.context: Optional[TaskContext] = None
        self.store: Optional[RolloutStore] = None
        self.position = 0

    # subclasses -------------------------------------------------------------------------------------------
    def make_rollout(self, rollout: int, policy) -> tuple[dict, dict]:
        raise NotImplementedError

    def host_state(self) -> dict:
        return {}

    def load_host_state(self, state: dict) -> None:
        pass

    # Task phases --------------------------------------------------------------------------------------------
    def setup(self, context: TaskContext) -> None:
        self.context = context
        self.store = RolloutStore(context.workdir)

    def needs_rollout(self, step: int) -> bool:
        """Whether train step `step` trains on a rollout this task does not hold yet."""
        return self.buffer is None or self.buffer_rollout != self.schedule.locate(step)[0]

    def rollout(self, step: int, policy) -> None:
        """Make the rollout train step `step` trains on: sampled from `policy` when `step` is the rollout's first
        step, else (a run resumed inside a rollout) read back from the buffer the interrupted run wrote."""
        rollout = self.schedule.locate(step)[0]
        self.rollout_timing = {}
        if step % self.schedule.steps_per_rollout:  # resumed inside a rollout: it must be the one trained on
            loaded = self.store.load(rollout)
            if loaded is not None:
                self.buffer, self.rollout_metrics = loaded
                self.buffer_rollout = rollout
                logging.info("resumed inside rollout %d: loaded %s", rollout, self.store.path(rollout))
                return
            logging.warning("resumed inside rollout %d but %s is missing; sampling a new rollout from the current "
                            "policy (training goes on, but not bit-identical to an uninterrupted run)", rollout,
                            self.store.path(rollout))
        t0 = time.perf_counter()
        self.buffer, metrics = self.make_rollout(rollout, policy)
        metrics = {k: float(v) for k, v in metrics.items()}
        self.buffer_rollout = rollout
        timing = {k: v for k, v in metrics.items() if k.startswith("time/")}
        self.rollout_metrics = {k: v for k, v in metrics.items() if not k.startswith("time/")}
        timing["time/rollout_s"] = time.perf_counter() - t0
        self.rollout_timing = timing
        if self.schedule.steps_per_rollout > 1:  # a resume inside this rollout will need it
            self.store.save(rollout, self.buffer, self.rollout_metrics)

    def batch(self, step: int):
        r, i, u = self.schedule.locate(step)
        if self.buffer_rollout != r:
            raise RuntimeError(f"train step {step} needs rollout {r}; call rollout({step}, policy) first")
        rows = self.schedule.rows_of(r, i, u)
        out = {k: self.buffer[k][rows] for k in self.train_keys}
        self.position = step + 1
        host = {**self.rollout_metrics, **self.rollout_timing, "rollout": float(r), "rollout_pass": float(i)}
        self.rollout_timing = {}
        return out, host

    def state_dict(self) -> dict:
        return {"position": self.position, "rollout": self.buffer_rollout,
                "steps_per_rollout": self.schedule.steps_per_rollout, **self.host_state()}

    def load_state_dict(self, state: dict) -> None:
        self.loaded_state = dict(state)
        self.position = int(state.get("position", 0))
        old = state.get("steps_per_rollout")
        if old is not None and int(old) != self.schedule.steps_per_rollout:
            raise ValueError(f"the checkpoint was written with {old} train steps per rollout, this config gives "
                             f"{self.schedule.steps_per_rollout} (num_iterations / epochs / minibatches / batch "
                             f"sizes changed); resume with the same values or use a new --workdir")
        self.load_host_state(state)

    def on_checkpoint(self, step: int, policy) -> None:
        """Delete rollout buffers no kept checkpoint can need (a checkpoint at step s needs rollout s // S only
        when s is inside it)."""
        if self.store is None or self.schedule.steps_per_rollout == 1:
            return None
        steps = self.context.checkpoint_steps()
        if self.context.keep_checkpoints is None or not steps:
            return None
        self.store.prune(min(steps) // self.schedule.steps_per_rollout)
        return None
