"""The task base of online GRPO and PPO: its Task phases (jaxrl.train.task: setup, needs_rollout / rollout, batch,
on_checkpoint) over the rollouts (jaxrl/algorithms/online/rollouts.py) and the schedule and buffer that map them
onto train steps (jaxrl/algorithms/online/buffer.py). The policy the Trainer holds at a rollout's first step is
the behaviour policy.

Resume: a rollout made from the same parameters is bit-identical (jaxrl/algorithms/online/rollouts.py). A run
resumed at a rollout boundary therefore regenerates it from the restored parameters; a run resumed in the middle
of a rollout (S > 1) needs the rollout as it was: each rollout with S > 1 is written atomically to
`<workdir>/rollouts/<r>.npz` before it is trained on, and the buffers only pruned checkpoints needed are deleted
once the saves that pruned them have landed (`on_saved`: at each checkpoint for the saves before it, and at the end
of the run). The task's state_dict (JSON, saved with every checkpoint) holds the rollout index, that file's name
and the algorithm's host state (PPO's KL coefficient).

Overlap (`grpo.overlap` / `ppo.overlap`, server backends only; off by default): rollout r+1 is sampled (on the
servers, with its scoring and teacher-forced passes, in a background thread) from the policy at the first step of
rollout r, while rollout r trains; so rollout r >= 1 comes from the parameters of step (r-1) S instead of r S, the
one difference from a run without overlap (prompts and sampling keys are the same). Its updates are off-policy:
the ratio's denominator (and the rollout correction) are the behaviour policy's log-probs, `make_rollout` running
on a copy of the behaviour parameters (`on_policy` is False under overlap). Every rollout made in the background is
written to the buffer; a checkpoint waits for the one in flight (`state_dict`), so a resumed run reads back the
rollouts the interrupted run had sampled from parameters it no longer has, and stays bit-exact. Each step logs
`rollout/policy_step` (the step of the parameters its rollout was sampled from) and `rollout/staleness` (updates
between those and the ones it updates: 0 on the first step of a rollout without overlap, S with it), and
`time/rollout_wait_s` (the step's wait for its rollout).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from jaxrl.algorithms.online.buffer import RolloutStore, Schedule
from jaxrl.algorithms.online.rollouts import Rollouts
from jaxrl.train.task import Task, TaskContext
from jaxrl.utils import interrupt
from jaxrl.utils.train_config import TrainConfig

class OnlineTask(Task):
    """Task base of GRPO and PPO (the phases of jaxrl.train.task), see the module docstring. Subclasses implement
    `make_rollout(rollout, policy) -> (buffer: {key: [N, ...]}, metrics)` and `train_keys` (the buffer keys a train
    batch carries), and may keep host state in `host_state()` / `load_host_state(d)` (e.g. PPO's KL
    coefficient). `rollouts` samples them; `block` is the algorithm's config block (its `overlap`)."""

    train_keys: tuple[str, ...] = ()

    def __init__(self, config: TrainConfig, schedule: Schedule, rollouts: Rollouts, block):
        self.config, self.schedule, self.rollouts = config, schedule, rollouts
        self.overlap = bool(block.overlap)
        self._on_policy = False
        self._pending: Optional[tuple[int, concurrent.futures.Future]] = None  # (rollout, its background work)
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

    @property
    def on_policy(self) -> bool:
        """Whether each rollout gets one update from the very parameters that sampled it (the ratio is then 1
        exactly; a subclass sets it, e.g. GRPO with one minibatch and one pass). Never under overlap: rollout r
        was sampled by the policy of rollout r - 1."""
        return self._on_policy and not self.overlap

    @on_policy.setter
    def on_policy(self, value: bool) -> None:
        self._on_policy = bool(value)

    # Task phases --------------------------------------------------------------------------------------------
    def setup(self, context: TaskContext) -> None:
        self.context = context
        self.store = RolloutStore(context.workdir)
        self.rollouts.open(context.workdir, context.current_policy())

    def needs_rollout(self, step: int) -> bool:
        """Whether train step `step` trains on a rollout this task does not hold yet."""
        return self.buffer is None or self.buffer_rollout != self.schedule.locate(step)[0]

    def rollout(self, step: int, policy) -> None:
        """Make the rollout train step `step` trains on: sampled from `policy` when `step` is the rollout's first
        step (under overlap: taken from the background, sampled one rollout earlier), else (a run resumed inside a
        rollout, or under overlap at a rollout the interrupted run had sampled) read back from the buffer the
        interrupted run wrote. Under overlap it then starts the next rollout in the background."""
        rollout = self.schedule.locate(step)[0]
        first = step % self.schedule.steps_per_rollout == 0
        self.rollout_timing = {}
        pending = self._take_pending(rollout)
        if pending is not None:
            self._install(rollout, *pending)
        elif not first or (self.overlap and rollout > 0):
            # it must be the one trained on: made by the interrupted run (under overlap, from parameters of an
            # earlier step than this one)
            loaded = self.store.load(rollout)
            if loaded is not None:
                self.buffer, self.rollout_metrics = loaded
                self.buffer_rollout = rollout
                logging.info("resumed inside rollout %d: loaded %s (step %d)", rollout, self.store.path(rollout),
                             step)
            else:
                logging.warning("resumed at step %d, in rollout %d, but %s is missing; sampling a new rollout from "
                                "the current policy (training goes on, but not bit-identical to an uninterrupted "
                                "run)", step, rollout, self.store.path(rollout))
                self._install(rollout, *self._make(rollout, step, policy))
        else:
            self._install(rollout, *self._make(rollout, step, policy))
        if self.overlap and first and (rollout + 1) * self.schedule.steps_per_rollout < self.config.steps:
            self._start(rollout + 1, step, policy)
        if (rollout + 1) * self.schedule.steps_per_rollout >= self.config.steps and self._pending is None:
            self.rollouts.close()  # the run's last rollout: servers unload our adapter, a vLLM we started stops

    # rollouts: made now, or in the background (overlap) ------------------------------------------------------
    def _make(self, rollout: int, step: int, policy) -> tuple[dict, dict, dict]:
        """(buffer, metrics, timing) of rollout `rollout` sampled from `policy`, the parameters of train step
        `step`; written to the buffer store when a resume could need it."""
        t0 = time.perf_counter()
        buffer, metrics = self.make_rollout(rollout, policy)
        metrics = {k: v if isinstance(v, str) else float(v) for k, v in metrics.items()}
        metrics.update(self.rollouts.last_sync)
        metrics["rollout/policy_step"] = float(step)
        timing = {k: v for k, v in metrics.items() if k.startswith("time/")}
        kept = {k: v for k, v in metrics.items() if not k.startswith("time/")}
        timing["time/rollout_s"] = time.perf_counter() - t0
        if self.schedule.steps_per_rollout > 1 or self.overlap:  # a resume inside (or before) it will need it
            self.store.save(rollout, buffer, kept)
        return buffer, kept, timing

    def _install(self, rollout: int, buffer: dict, metrics: dict, timing: dict) -> None:
        self.buffer, self.rollout_metrics, self.buffer_rollout = buffer, metrics, rollout
        self.rollout_timing = {**self.rollout_timing, **timing}

    def _snapshot(self, policy):
        """`policy` with copies of its trained variables: the train step donates the state those arrays belong
        to, and the background rollout must keep the parameters it samples from."""
        graphdef, trained, rest = nnx.split(policy, self.trainable, ...)
        return nnx.merge(graphdef, jax.tree.map(jnp.copy, trained), rest)

    def _start(self, rollout: int, step: int, policy) -> None:
        """Makes rollout `rollout` in a background (daemon) thread from a copy of `policy` (train step `step`)."""
        behaviour = self._snapshot(policy)
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work():
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._make(rollout, step, behaviour))
                except BaseException as e:  # raised where the rollout is used (or at the next checkpoint)
                    future.set_exception(e)

        self._pending = (rollout, future)
        threading.Thread(target=work, name=f"jaxrl-rollout-{rollout}", daemon=True).start()
        logging.info("rollout %d: sampling in the background from the parameters of step %d", rollout, step)

    def _take_pending(self, rollout: int) -> Optional[tuple[dict, dict, dict]]:
        """The background rollout `rollout` (waits for it; its error raised here), or None when none is in flight.
        A rollout in flight for another index (not possible in the Trainer's order) is waited for and dropped."""
        if self._pending is None:
            return None
        index, future = self._pending
        self._pending = None
        t0 = time.perf_counter()
        result = future.result()
        if index != rollout:
            logging.warning("dropping background rollout %d: step needs rollout %d", index, rollout)
            return None
        buffer, metrics, timing = result
        return buffer, metrics, {**timing, "time/rollout_wait_s": time.perf_counter() - t0}

    def settle(self) -> None:
        """Waits for the rollout in flight (it writes itself to the buffer store); raises its error. One a signal
        stopped (it was waiting for servers) is dropped: the checkpoint the Trainer then writes does not need it (a
        resume samples that rollout again)."""
        if self._pending is not None:
            try:
                self._pending[1].result()
            except interrupt.Interrupted:
                logging.warning("rollout %d: stopped by a signal while sampling in the background; dropped",
                                self._pending[0])
                self._pending = None

    def batch(self, step: int):
        r, i, u = self.schedule.locate(step)
        if self.buffer_rollout != r:
            raise RuntimeError(f"train step {step} needs rollout {r}; call rollout({step}, policy) first")
        rows = self.schedule.rows_of(r, i, u)
        out = {k: self.buffer[k][rows] for k in self.train_keys}
        self.position = step + 1
        host = {**self.rollout_metrics, **self.rollout_timing, "rollout": float(r), "rollout_pass": float(i)}
        if "rollout/policy_step" in self.rollout_metrics:
            host["rollout/staleness"] = float(step - self.rollout_metrics["rollout/policy_step"])
        self.rollout_timing = {}
        return out, host

    def state_dict(self) -> dict:
        """The data position; under overlap after the rollout in flight has landed in the buffer store (a resume
        from this state reads it back: it was sampled from parameters the state no longer holds), with the host
        state it left (PPO's KL coefficient after it)."""
        self.settle()
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

    def on_saved(self, steps: list) -> None:
        """Delete the rollout buffers that only pruned checkpoints needed: `steps` are the training states on disk
        after the saves landed (jaxrl.train.task). A state at step s needs rollout s // S (when s is inside it,
        and under overlap also the next one, sampled before s); older buffers belong to states Orbax deleted.
        Run after the saves, not at the checkpoint (which comes before its save): there the states about to be
        pruned are still on disk, and the buffers of the last ones pruned outlived the run."""
        if self.store is None or (self.schedule.steps_per_rollout == 1 and not self.overlap):
            return
        if self.context is None or self.context.keep_checkpoints is None or not steps:
            return  # every state is kept (or none landed yet): nothing was pruned
        self.store.prune(min(steps) // self.schedule.steps_per_rollout)
