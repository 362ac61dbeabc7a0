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

Sampling ahead (`grpo.max_staleness` / `ppo.max_staleness` = k, server backends only; 0 by default, `overlap` is
k = 1): at rollout r's first step one producer thread (`Producer`, one rollout on the servers at a time) is given
rollouts r+1 .. r+k it does not hold yet, each sampled (with its scoring and teacher-forced passes) from a copy of
the policy at that step; so a rollout trains at most k policy versions after the one that sampled it, and the
trainer waits only when the producer is behind. With k = 1 rollout r >= 1 comes from the parameters of step
(r-1) S instead of r S, the one difference from a synchronous run (prompts and sampling keys are the same). The
updates are off-policy: the ratio's denominator (and the rollout correction) are the behaviour policy's log-probs,
`make_rollout` running on the behaviour parameters (`on_policy` is False). Every rollout sampled ahead is written to
the buffer; a checkpoint waits for those in flight (`state_dict`), so a resumed run reads back the rollouts the
interrupted run had sampled from parameters it no longer has, and stays bit-exact; one read back older than k
versions (a resume with a smaller k) is dropped, counted and sampled again. Each step logs `rollout/policy_step`
(the step of the parameters its rollout was sampled from), `rollout/staleness` (updates between those and the ones
it updates), `rollout/staleness_mean` / `_max` (in policy versions, one per rollout; every token of a rollout has
its rollout's version), `rollout/dropped_stale`, `rollout/samples_digest` (which samples the step trains), and at a
rollout's first step `time/trainer_idle_s` (the trainer's wait: the whole rollout when synchronous),
`time/rollout_wait_s` and `time/rollout_idle_s` (the producer's wait for the staleness bound before that rollout).
Without partial rollouts every rollout is sampled whole by one version.

Partial rollouts (`partial_rollouts`, launchers.serve only, with max_staleness k >= 1 and the decoupled loss): the
producer runs up to k rollouts on the servers at once (prompts of rollouts r+1 .. r+k queued behind the long tail of
the ones before them: the servers' slots stay full), and the policy is published at every rollout's first step
(`Rollouts.publish`, before the trainer waits for that rollout): the servers reload the run's one adapter name in
place and the rows in flight continue under the new version from their next round. Rollout q is submitted after
version q - k is published, so each of its tokens is sampled by a version in [q - k, q]; every token's version comes
back from the server (`Sampled.token_versions`, kept in the buffer) and the staleness metrics become per token:
`rollout/staleness_mean` / `_max` over the rollout's sampled tokens, `rollout/version_span_max` (the most versions
one sample's tokens span) and `rollout/partial_fraction` (samples whose tokens span several versions). A sample
with a token over the bound (not possible unless a server misbehaves) is dropped from the loss and counted in
`rollout/dropped_stale_samples`. The decoupled weight proximal / sampler is taken per token against the log-prob
the sampler reported, so each token's own behaviour policy enters. Which version reaches a row when depends on
timing: runs with partial rollouts are not bit-reproducible (a resume still trains every stored rollout once).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import queue
import threading
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from jaxrl.algorithms.online import correction
from jaxrl.algorithms.online.buffer import RolloutStore, Schedule
from jaxrl.algorithms.online.passes import RolloutPasses, Role
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
        self.block = block
        self.max_staleness = int(block.max_staleness)  # overlap is max_staleness 1
        self.overlap = self.max_staleness > 0
        self.decoupled = self.overlap and block.off_policy_loss == "decoupled"
        self.partial = bool(block.partial_rollouts)  # the config checks it comes with k >= 1 and decoupled
        if self.partial and getattr(block, "environment", ""):  # distillation blocks have no episodes
            raise ValueError(f"{config.algorithm}.partial_rollouts with {config.algorithm}.environment="
                             f"{block.environment!r}: an episode's turns are separate requests; partial rollouts "
                             "cover single-turn rollouts only")
        self.dropped_stale_samples = 0  # partial rollouts: samples with a token over the bound (this process)
        self.publish_metrics: dict = {}  # partial rollouts: the sync metrics of the version published last
        self._on_policy = False
        self._pending: dict[int, concurrent.futures.Future] = {}  # rollout -> the producer's work on it
        self._producer_thread: Optional[Producer] = None
        self.dropped_stale = 0  # rollouts read back over the staleness bound, dropped (this process)
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
        step (with max_staleness k: taken from the producer, sampled up to k rollouts earlier), else (a run resumed
        inside a rollout, or ahead of training at a rollout the interrupted run had sampled) read back from the
        buffer the interrupted run wrote. With k > 0 it then has the producer sample ahead up to rollout + k."""
        rollout = self.schedule.locate(step)[0]
        first = step % self.schedule.steps_per_rollout == 0
        self.rollout_timing = {}
        # the new version reaches the rows in flight before the trainer waits on them; a run resumed inside a
        # rollout publishes too (a rollout it must sample again needs a version served)
        if self.partial and (first or not self.rollouts.published):
            published = self.rollouts.publish(policy, rollout)
            self.publish_metrics = {k: v for k, v in published.items() if not k.startswith("time/")}
            self.rollout_timing.update({k: v for k, v in published.items() if k.startswith("time/")})
        t0 = time.perf_counter()
        pending = self._take_pending(rollout)
        if pending is not None:
            self._install(rollout, *pending)
        elif not first or (self.overlap and rollout > 0):
            # it must be the one trained on: made by the interrupted run (ahead of training, from parameters of an
            # earlier step than this one)
            loaded = self._load_stored(rollout, step)
            if loaded is not None:
                self._install(rollout, *loaded)
            else:
                self._install(rollout, *self._make(rollout, step, policy))
        else:
            self._install(rollout, *self._make(rollout, step, policy))
        # the trainer's wait: the whole synchronous rollout, or what it waited for the producer (the publish before
        # it and the proximal pass after it are work: time/adapter_sync_s, time/proximal_logp_s)
        self.rollout_timing["time/trainer_idle_s"] = time.perf_counter() - t0
        # at its first step, or a run resumed inside a rollout it had to sample again: the proximal pass is due
        if self.decoupled and not self.rollout_metrics.get("offpolicy/decoupled"):
            self._decouple(rollout, policy)
        if self.overlap and first:
            self._sample_ahead(rollout, step, policy)
        if (rollout + 1) * self.schedule.steps_per_rollout >= self.config.steps and not self._pending:
            self.rollouts.close()  # the run's last rollout: servers unload our adapter, a vLLM we started stops

    # rollouts: made now, or ahead of training by the producer ------------------------------------------------
    def _make(self, rollout: int, step: int, policy) -> tuple[dict, dict, dict]:
        """(buffer, metrics, timing) of rollout `rollout` sampled from `policy`, the parameters of train step
        `step`; written to the buffer store when a resume could need it."""
        t0 = time.perf_counter()
        buffer, metrics = self.make_rollout(rollout, policy)
        metrics = {k: v if isinstance(v, str) else float(v) for k, v in metrics.items()}
        metrics.update(self.rollouts.last_sync)
        metrics["rollout/policy_step"] = float(step)
        metrics["rollout/samples_digest"] = samples_digest(buffer)
        timing = {k: v for k, v in metrics.items() if k.startswith("time/")}
        kept = {k: v for k, v in metrics.items() if not k.startswith("time/")}
        timing["time/rollout_s"] = time.perf_counter() - t0
        if self.schedule.steps_per_rollout > 1 or self.overlap:  # a resume inside (or before) it will need it
            self.store.save(rollout, buffer, kept)
        return buffer, kept, timing

    def _load_stored(self, rollout: int, step: int) -> Optional[tuple[dict, dict, dict]]:
        """Rollout `rollout` as the interrupted run wrote it, or None (missing: warned; older than max_staleness
        allows: dropped and counted)."""
        loaded = self.store.load(rollout)
        if loaded is None:
            logging.warning("resumed at step %d, in rollout %d, but %s is missing; sampling a new rollout from the "
                            "current policy (training goes on, but not bit-identical to an uninterrupted run)", step,
                            rollout, self.store.path(rollout))
            return None
        buffer, metrics = loaded
        staleness = self._staleness(rollout, metrics)
        if self.overlap and staleness > self.max_staleness:
            self.dropped_stale += 1
            logging.warning("rollout %d in %s was sampled %d policy versions before it would be trained, over "
                            "max_staleness=%d: dropped (rollout/dropped_stale) and sampled again", rollout,
                            self.store.path(rollout), staleness, self.max_staleness)
            return None
        logging.info("resumed inside rollout %d: loaded %s (step %d)", rollout, self.store.path(rollout), step)
        return buffer, metrics, {}

    def _staleness(self, rollout: int, metrics: dict) -> int:
        """Policy versions (one per rollout) between the parameters that sampled `rollout` and its own."""
        behaviour = metrics.get("rollout/policy_step")
        return 0 if behaviour is None else rollout - int(behaviour) // self.schedule.steps_per_rollout

    def _install(self, rollout: int, buffer: dict, metrics: dict, timing: dict) -> None:
        self.buffer, self.rollout_metrics, self.buffer_rollout = buffer, metrics, rollout
        self.rollout_timing = {**self.rollout_timing, **timing}
        if "token_versions" in buffer:
            self._bound_tokens(rollout)

    def _bound_tokens(self, rollout: int) -> None:
        """Partial rollouts: the samples with a token over the bound dropped from the loss (counted), the per-token
        staleness metrics set (module docstring)."""
        dropped, metrics = bound_token_versions(self.buffer, rollout, self.max_staleness)
        if dropped:
            logging.warning("rollout %d: %d samples have tokens more than max_staleness=%d versions old: dropped "
                            "from the loss (rollout/dropped_stale_samples)", rollout, dropped, self.max_staleness)
            self.dropped_stale_samples += dropped
        self.rollout_metrics = {**self.rollout_metrics, **metrics}

    def _decouple(self, rollout: int, policy) -> None:
        """The decoupled PPO objective (AReaL; `off_policy_loss='decoupled'`) for the rollout just installed: its
        `old_logp` becomes the proximal policy's (a teacher-forced pass with `policy`, the parameters at the rollout's
        first step, or at the step a resumed run sampled it again, so the clip is taken against where this
        rollout's updates start), and the behaviour
        policy enters as the importance weight proximal / sampler per token (`is_weights`), truncated or masked by
        the block's rollout_correction mode at its bounds (token_truncate when the mode is none). The buffer is
        written back, so a resume inside the rollout trains on the same proximal log-probs."""
        block, buffer = self.block, self.buffer
        arrays = {k: buffer[k] for k in ("input_ids", "attention_mask", "completion_mask")}
        passes = RolloutPasses(policy, arrays, temperature=block.temperature, batch_size=block.logprob_batch_size,
                               chunk_size=self.chunk_size, mesh=self.mesh, compile_options=self.compile_options)
        mode = block.rollout_correction if block.rollout_correction != "none" else "token_truncate"
        # the sampler reports untempered log-probs: the weight compares them with the proximal pass at temperature 1
        weights, gap = correction.rollout_correction(passes.logp(Role.MISMATCH), buffer["sampler_logp"],
                                                     buffer["completion_mask"], mode,
                                                     block.rollout_correction_min or None,
                                                     block.rollout_correction_max)
        buffer["old_logp"], buffer["is_weights"] = passes.logp(Role.OLD), weights
        metrics = {k.replace("mismatch/", "offpolicy/", 1): v for k, v in gap.items()}
        metrics["offpolicy/decoupled"] = 1.0
        self.rollout_metrics = {**self.rollout_metrics, **metrics}
        self.rollout_timing["time/proximal_logp_s"] = sum(passes.seconds.values())
        self.store.save(rollout, buffer, self.rollout_metrics)

    def _snapshot(self, policy):
        """`policy` with copies of its trained variables: the train step donates the state those arrays belong
        to, and the producer must keep the parameters it samples from."""
        graphdef, trained, rest = nnx.split(policy, self.trainable, ...)
        return nnx.merge(graphdef, jax.tree.map(jnp.copy, trained), rest)

    def _sample_ahead(self, rollout: int, step: int, policy) -> None:
        """Has the producer sample rollouts rollout + 1 .. rollout + k (k = max_staleness) that it does not hold
        yet, from `policy` (the parameters of step `step`): each is then at most k versions old when trained. A
        resumed run takes rollouts rollout + 1 .. rollout + k - 1 from the buffer store when the interrupted run
        had sampled them (from parameters no checkpoint holds)."""
        last = -(-self.config.steps // self.schedule.steps_per_rollout) - 1
        behaviour = None
        for q in range(rollout + 1, min(rollout + self.max_staleness, last) + 1):
            if q in self._pending:
                continue
            if q < rollout + self.max_staleness and os.path.exists(self.store.path(q)):
                stored = self._load_stored(q, step)
                if stored is not None:
                    done: concurrent.futures.Future = concurrent.futures.Future()
                    done.set_result(stored)
                    self._pending[q] = done
                    continue
            behaviour = behaviour if behaviour is not None else self._snapshot(policy)
            self._pending[q] = self._producer().submit(q, step, behaviour)
            logging.info("rollout %d: sampling ahead from the parameters of step %d", q, step)

    def _producer(self) -> "Producer":
        if self._producer_thread is None:  # partial rollouts: up to k rollouts on the servers at once
            self._producer_thread = Producer(self._make, workers=self.max_staleness if self.partial else 1)
        return self._producer_thread

    def _take_pending(self, rollout: int) -> Optional[tuple[dict, dict, dict]]:
        """Rollout `rollout` from the producer (waits for it; its error raised here), or None when it has none.
        What the producer holds for earlier rollouts (not possible in the Trainer's order) is dropped."""
        for stale in [q for q in self._pending if q < rollout]:
            logging.warning("dropping rollout %d sampled ahead: step needs rollout %d", stale, rollout)
            self._pending.pop(stale)
        future = self._pending.pop(rollout, None)
        if future is None:
            return None
        t0 = time.perf_counter()
        buffer, metrics, timing = future.result()
        return buffer, metrics, {**timing, "time/rollout_wait_s": time.perf_counter() - t0}

    def settle(self) -> None:
        """Waits for the rollouts the producer holds (each writes itself to the buffer store); raises an error of
        theirs. One a signal stopped (it was waiting for servers) is dropped with those after it: the checkpoint
        the Trainer then writes does not need them (a resume samples them again)."""
        for q in sorted(self._pending):
            try:
                self._pending[q].result()
            except interrupt.Interrupted:
                logging.warning("rollouts %s: stopped by a signal while sampling ahead; dropped",
                                [p for p in sorted(self._pending) if p >= q])
                self._pending = {p: f for p, f in self._pending.items() if p < q}
                return

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
            if "rollout/version_span_max" not in self.rollout_metrics:
                # in policy versions (one per rollout; every token of a rollout is sampled by one version)
                versions = float(self._staleness(r, self.rollout_metrics))
                host.update({"rollout/staleness_mean": versions, "rollout/staleness_max": versions})
            host["rollout/dropped_stale"] = float(self.dropped_stale)
        if self.partial:
            host.update({**self.publish_metrics, "rollout/dropped_stale_samples": float(self.dropped_stale_samples)})
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


def samples_digest(buffer: dict) -> str:
    """A short digest of a rollout's samples (its token ids, which are real, and the sampler's log-probs where the
    buffer keeps them: a rollout sampled again from other weights may draw the same tokens, never the same
    log-probs): logged with every step that trains on it, so which samples a step trained is on record (a resumed
    run logs the digest of the rollout it read back)."""
    h = hashlib.sha256()
    for key in ("input_ids", "attention_mask", "sampler_logp"):
        if key in buffer:
            h.update(np.ascontiguousarray(buffer[key]).tobytes())
    return h.hexdigest()[:16]


def bound_token_versions(buffer: dict, rollout: int, max_staleness: int) -> tuple[int, dict]:
    """Drops from the loss (`completion_mask`, and `sequence_mask` where the buffer has one, set to 0 in place) the
    samples of rollout `rollout` with a token sampled more than `max_staleness` versions before it (by the buffer's
    `token_versions`); returns (samples dropped, the per-token staleness metrics of the samples kept)."""
    versions = buffer["token_versions"]
    real = versions >= 0
    oldest = np.where(real, versions, np.iinfo(np.int32).max).min(-1)
    stale = real.any(-1) & (rollout - oldest > max_staleness)
    if stale.any():
        buffer["completion_mask"] = np.where(stale[:, None], 0, buffer["completion_mask"]).astype(
            buffer["completion_mask"].dtype)
        if "sequence_mask" in buffer:
            buffer["sequence_mask"] = np.where(stale, 0, buffer["sequence_mask"]).astype(buffer["sequence_mask"].dtype)
    return int(stale.sum()), token_version_metrics(versions[~stale], rollout)


def token_version_metrics(versions: np.ndarray, rollout: int) -> dict:
    """Per-token staleness of a rollout trained at version `rollout` from its samples' token versions ([N, C],
    -1 past the end): the mean and max over sampled tokens, the most versions one sample spans, and the fraction of
    samples whose tokens come from more than one version (partial rollouts)."""
    real = versions >= 0
    if not real.any():
        return {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0, "rollout/version_span_max": 0.0,
                "rollout/partial_fraction": 0.0}
    staleness = rollout - versions[real]
    rows = real.any(-1)
    newest = np.where(real, versions, -1).max(-1)[rows]
    oldest = np.where(real, versions, np.iinfo(np.int32).max).min(-1)[rows]
    return {"rollout/staleness_mean": float(staleness.mean()), "rollout/staleness_max": float(staleness.max()),
            "rollout/version_span_max": float((newest - oldest).max()),
            "rollout/partial_fraction": float((newest > oldest).mean())}


class Producer:
    """The threads that sample rollouts ahead of training, taking them in the order they are submitted: one
    (`workers` = 1: one rollout on the servers at a time, as a synchronous run has) or, with partial rollouts, k (k
    rollouts on the servers at once). `submit(rollout, step, policy)` -> a Future of `make(...)`. The seconds a
    worker waited for work before a rollout (`time/rollout_idle_s`: the staleness bound holding it back) join that
    rollout's timings."""

    def __init__(self, make, workers: int = 1):
        self.make = make
        self.jobs: queue.Queue = queue.Queue()
        for k in range(max(1, int(workers))):
            threading.Thread(target=self._work, name=f"jaxrl-rollout-producer-{k}", daemon=True).start()

    def submit(self, rollout: int, step: int, policy) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((rollout, step, policy, future))
        return future

    def _work(self) -> None:
        idle_since = time.perf_counter()
        while True:
            rollout, step, policy, future = self.jobs.get()
            idle = time.perf_counter() - idle_since
            if future.set_running_or_notify_cancel():
                try:
                    buffer, metrics, timing = self.make(rollout, step, policy)
                    future.set_result((buffer, metrics, {**timing, "time/rollout_idle_s": idle}))
                except BaseException as e:  # raised where the rollout is used (or at the next checkpoint)
                    future.set_exception(e)
            idle_since = time.perf_counter()
