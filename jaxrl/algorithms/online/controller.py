"""Where an online task's rollouts come from, and the asynchronous policy: `RolloutController` owns the policy
versions, the producer that samples ahead, publishing, the staleness bound and the proximal pass. The task sees
none of it: it makes a rollout's arrays (`make`) and trains on what the controller hands it.

    controller = RolloutController(AsyncPolicy(k, partial, decoupled), rollouts, schedule, make=task.make_rollout,
                                   steps=config.steps, proximal=ProximalPass(...), snapshot=copy_of_policy)
    controller.open(workdir)                        # the task's setup: the buffer store
    buffer, metrics, timing = controller.rollout(step, policy)   # the rollout train step `step` trains on
    controller.host_metrics(step, rollout, metrics) # rollout/staleness* of a step
    controller.settle()                             # before a checkpoint: the rollouts sampled ahead are on disk

`make(rollout, policy) -> (arrays, metrics, samples)`: the algorithm's arrays of a rollout sampled from `policy`
and the `Sampled` whose rows they are (None where the rows are not all sampled: distillation's SFT rows); the
controller adds what the asynchronous policy needs: the sampler's log-probs (`sampler_logp`, decoupled) and each
token's version (`token_versions`, partial rollouts).

Resume: a rollout made from the same parameters is bit-identical (jaxrl/algorithms/online/rollouts.py). A run
resumed at a rollout boundary therefore regenerates it from the restored parameters; a run resumed in the middle
of a rollout (S > 1 train steps per rollout) needs the rollout as it was: each rollout with S > 1 is written
atomically to `<workdir>/rollouts/<r>.npz` before it is trained on (`RolloutStore`), and the buffers only pruned
checkpoints needed are deleted once the saves that pruned them have landed (`prune`).

Sampling ahead (`max_staleness` = k, server backends only; 0 by default, `overlap` is k = 1): at rollout r's first
step one producer thread (`Producer`, one rollout on the servers at a time) is given rollouts r+1 .. r+k it does
not hold yet, each sampled (with its scoring and teacher-forced passes) from a copy of the policy at that step; so
a rollout trains at most k policy versions after the one that sampled it, and the trainer waits only when the
producer is behind. With k = 1 rollout r >= 1 comes from the parameters of step (r-1) S instead of r S, the one
difference from a synchronous run (prompts and sampling keys are the same). The updates are off-policy: the
ratio's denominator (and the rollout correction) are the behaviour policy's log-probs. Every rollout sampled ahead
is written to the store; a checkpoint waits for those in flight (`settle`), so a resumed run reads back the
rollouts the interrupted run had sampled from parameters it no longer has, and stays bit-exact; one read back older
than k versions (a resume with a smaller k) is dropped, counted and sampled again. Each step logs
`rollout/policy_step` (the step of the parameters its rollout was sampled from), `rollout/staleness` (updates
between those and the ones it updates), `rollout/staleness_mean` / `_max` (in policy versions, one per rollout;
every token of a rollout has its rollout's version), `rollout/dropped_stale`, `rollout/samples_digest` (which
samples the step trains), and at a rollout's first step `time/trainer_idle_s` (every second the trainer waited on
rollouts since the previous rollout's first step: for this rollout, the whole of it when synchronous, and at each
checkpoint in between for the rollouts in flight to land, `settle`), `time/rollout_wait_s` (the wait for this
rollout alone) and `time/rollout_idle_s` (the producer's wait for the staleness bound before that rollout).
Without partial rollouts every rollout is sampled whole by one version.

Partial rollouts (`partial_rollouts`, launchers.serve only, with k >= 1 and the decoupled loss; single-turn rows and
episodes alike): the producer runs up to k rollouts on the servers at once (prompts of rollouts r+1 .. r+k queued
behind the long tail of the ones before them: the servers' slots stay full), and the policy is published at every
rollout's first step (`publish`, before the trainer waits for that rollout): the servers reload the run's one
adapter name in place and the rows in flight continue under the new version from their next round (an episode's
next turn too). Rollout q is submitted after version q - k is published, so each of its tokens is sampled by a
version in [q - k, q]; every token's digest comes back from the server and is mapped to the version that published
it (`token_versions`, kept in the buffer; -1 where no token was sampled), and the staleness metrics become per
token: `rollout/staleness_mean` / `_max` over the rollout's sampled tokens, `rollout/version_span_max` (the most
versions one sample's tokens span) and `rollout/partial_fraction` (samples whose tokens span several versions). A
sample with a token over the bound (not possible unless a server misbehaves) is dropped from the loss and counted
in `rollout/dropped_stale_samples`. The decoupled weight proximal / sampler is taken per token against the log-prob
the sampler reported, so each token's own behaviour policy enters. Which version reaches a row when depends on
timing: runs with partial rollouts are not bit-reproducible (a resume still trains every stored rollout once).

The decoupled objective (`off_policy_loss = 'decoupled'`, AReaL): the proximal pass (`ProximalPass`) replaces a
rollout's `old_logp` with the policy's at the rollout's first step, the behaviour policy entering as the importance
weight proximal / sampler per token.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import queue
import threading
import time
from typing import Any, Callable, Optional

import numpy as np
from absl import logging

from jaxrl.algorithms.online import correction
from jaxrl.algorithms.online.buffer import RolloutStore, Schedule
from jaxrl.algorithms.online.passes import RolloutPasses, Role
from jaxrl.algorithms.online.rollouts import Rollouts, Sampled
from jaxrl.algorithms.online.settings import AsyncPolicy
from jaxrl.backends.pool import AdapterSyncError
from jaxrl.utils import interrupt

__all__ = ["Producer", "ProximalPass", "RolloutController", "bound_token_versions", "proximal_pass",
           "samples_digest", "token_version_metrics"]

# make(rollout, policy) -> (arrays, metrics, the Sampled whose rows they are, or None)
MakeRollout = Callable[[int, Any], tuple[dict, dict, Optional[Sampled]]]


@dataclasses.dataclass(frozen=True)
class ProximalPass:
    """How the decoupled objective's proximal pass runs (the teacher-forced pass of jaxrl/algorithms/online/passes.py
    with the sampling temperature, and the rollout correction's mode and bounds for its weight)."""

    temperature: float
    batch_size: int
    chunk_size: int
    correction: str = "none"
    correction_min: float = 0.0
    correction_max: float = 3.0
    mesh: Any = None
    compile_options: Optional[dict] = None

    def __call__(self, policy, buffer: dict) -> tuple[dict, dict, float]:
        """(the buffer's new `old_logp` and `is_weights`, the offpolicy/* metrics, seconds) of `buffer` under
        `policy` (the proximal policy)."""
        arrays = {k: buffer[k] for k in ("input_ids", "attention_mask", "completion_mask")}
        passes = RolloutPasses(policy, arrays, temperature=self.temperature, batch_size=self.batch_size,
                               chunk_size=self.chunk_size, mesh=self.mesh, compile_options=self.compile_options)
        mode = self.correction if self.correction != "none" else "token_truncate"
        # the sampler reports untempered log-probs: the weight compares them with the proximal pass at temperature 1
        weights, gap = correction.rollout_correction(passes.logp(Role.MISMATCH), buffer["sampler_logp"],
                                                     buffer["completion_mask"], mode, self.correction_min or None,
                                                     self.correction_max)
        metrics = {k.replace("mismatch/", "offpolicy/", 1): v for k, v in gap.items()}
        metrics["offpolicy/decoupled"] = 1.0
        return {"old_logp": passes.logp(Role.OLD), "is_weights": weights}, metrics, sum(passes.seconds.values())


def proximal_pass(block, config, mesh) -> Optional[ProximalPass]:
    """The proximal pass of an online block whose asynchronous policy is decoupled (its sampling temperature,
    log-prob batch and rollout correction; the run's chunk size and compile options), else None."""
    if not block.async_policy.decoupled:
        return None
    return ProximalPass(temperature=block.temperature, batch_size=block.logprob_batch_size,
                        chunk_size=config.logprob_chunk_size, correction=block.rollout_correction,
                        correction_min=block.rollout_correction_min, correction_max=block.rollout_correction_max,
                        mesh=mesh, compile_options=dict(config.compile_options) or None)


class RolloutController:
    """The rollouts of an online task, made now, ahead of training, or read back (module docstring).

    policy: the asynchronous policy; rollouts: the sampler (its backend, prompts and versions served); schedule:
    rollouts -> train steps; make: the algorithm's rollout; steps: the run's train steps (its last rollout closes the
    backend); proximal: the decoupled objective's pass (needed when `policy.decoupled`); snapshot(policy): a copy of
    the policy the producer may keep while the trainer updates its own."""

    def __init__(self, policy: AsyncPolicy, rollouts: Rollouts, schedule: Schedule, *, make: MakeRollout,
                 steps: int, proximal: Optional[ProximalPass] = None,
                 snapshot: Optional[Callable[[Any], Any]] = None):
        if policy.decoupled and proximal is None:
            raise ValueError("the decoupled objective needs its proximal pass (RolloutController(proximal=...))")
        if policy.ahead and snapshot is None:
            raise ValueError("sampling ahead needs a copy of the policy the producer may keep (snapshot=...): the "
                             "train step donates the trainer's arrays")
        self.policy, self.rollouts, self.schedule = policy, rollouts, schedule
        self.make, self.steps, self.proximal = make, int(steps), proximal
        self.snapshot = snapshot
        self.store: Optional[RolloutStore] = None
        self.versions: dict[str, int] = {}  # partial rollouts: adapter digest -> the newest version published with it
        self.publish_metrics: dict = {}  # partial rollouts: the sync metrics of the version published last
        self.dropped_stale = 0  # rollouts read back over the staleness bound, dropped (this process)
        self.dropped_stale_samples = 0  # partial rollouts: samples with a token over the bound (this process)
        self._pending: dict[int, concurrent.futures.Future] = {}  # rollout -> the producer's work on it
        # the trainer's waits outside a rollout's own (checkpoint drains, `settle`), not yet in a trainer_idle_s
        self._idle_unreported = 0.0
        self._producer: Optional[Producer] = None
        # partial rollouts: the versions published when this thread's sampling last ended (the tokens' digests are
        # mapped with what was published by then, not with what the trainer published since)
        self._sampled_versions = threading.local()
        if policy.partial:
            rollouts.on_sampled = self._note_sampled

    def open(self, workdir: str) -> None:
        self.store = RolloutStore(workdir)

    # ----------------------------------------------------------------------------------------- the rollout
    def rollout(self, step: int, policy) -> tuple[dict, dict, dict]:
        """(buffer, metrics, timing) of the rollout train step `step` trains on: sampled from `policy` when `step`
        is the rollout's first step (with max_staleness k: taken from the producer, sampled up to k rollouts
        earlier), else (a run resumed inside a rollout, or ahead of training at a rollout the interrupted run had
        sampled) read back from the store. With k > 0 it then has the producer sample ahead up to rollout + k."""
        rollout = self.schedule.locate(step)[0]
        first = step % self.schedule.steps_per_rollout == 0
        timing: dict = {}
        # the new version reaches the rows in flight before the trainer waits on them; a run resumed inside a
        # rollout publishes too (a rollout it must sample again needs a version served)
        if self.policy.partial and (first or not self.versions):
            published = self.publish(policy, rollout)
            self.publish_metrics = {k: v for k, v in published.items() if not k.startswith("time/")}
            timing.update({k: v for k, v in published.items() if k.startswith("time/")})
        t0 = time.perf_counter()
        made = self._take_pending(rollout)
        if made is None and (not first or (self.policy.ahead and rollout > 0)):
            # it must be the one trained on: made by the interrupted run (ahead of training, from parameters of an
            # earlier step than this one)
            made = self._load_stored(rollout, step)
        if made is None:
            made = self._make(rollout, step, policy)
        buffer, metrics, made_timing = made
        timing.update(made_timing)
        # the trainer's wait: the whole synchronous rollout, or what it waited for the producer (the publish before
        # it and the proximal pass after it are work: time/adapter_sync_s, time/proximal_logp_s), and the checkpoint
        # drains since the last report (their steps' records were written before the drain)
        timing["time/trainer_idle_s"] = time.perf_counter() - t0 + self._idle_unreported
        self._idle_unreported = 0.0
        if "token_versions" in buffer:
            metrics = self._bound_tokens(rollout, buffer, metrics)
        # at its first step, or a run resumed inside a rollout it had to sample again: the proximal pass is due
        if self.policy.decoupled and not metrics.get("offpolicy/decoupled"):
            new, proximal_metrics, seconds = self.proximal(policy, buffer)
            buffer.update(new)
            metrics = {**metrics, **proximal_metrics}
            timing["time/proximal_logp_s"] = seconds
            self.store.save(rollout, buffer, metrics)
        if self.policy.ahead and first:
            self._sample_ahead(rollout, step, policy)
        if (rollout + 1) * self.schedule.steps_per_rollout >= self.steps and not self._pending:
            self.rollouts.close()  # the run's last rollout: servers unload our adapter, a vLLM we started stops
        return buffer, metrics, timing

    def _make(self, rollout: int, step: int, policy) -> tuple[dict, dict, dict]:
        """(buffer, metrics, timing) of rollout `rollout` sampled from `policy`, the parameters of train step
        `step`; written to the store when a resume could need it."""
        t0 = time.perf_counter()
        if self.policy.partial and not self.versions:
            raise RuntimeError("partial rollouts: a rollout sampled before any version was published")
        buffer, metrics, samples = self.make(rollout, policy)
        if self.policy.decoupled:  # the behaviour side of the decoupled objective's weight (ProximalPass)
            buffer["sampler_logp"] = samples.behaviour_logp
        if samples is not None and samples.token_digests is not None:  # partial rollouts
            buffer["token_versions"] = self.token_versions(samples.token_digests, samples.completion_mask > 0,
                                                           getattr(self._sampled_versions, "map", self.versions))
        metrics = {k: v if isinstance(v, str) else float(v) for k, v in metrics.items()}
        metrics.update(self.rollouts.last_sync)
        metrics["rollout/policy_step"] = float(step)
        metrics["rollout/samples_digest"] = samples_digest(buffer)
        timing = {k: v for k, v in metrics.items() if k.startswith("time/")}
        kept = {k: v for k, v in metrics.items() if not k.startswith("time/")}
        timing["time/rollout_s"] = time.perf_counter() - t0
        if self.schedule.steps_per_rollout > 1 or self.policy.ahead:  # a resume inside (or before) it will need it
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
        staleness = self.staleness(rollout, metrics)
        if self.policy.ahead and staleness > self.policy.max_staleness:
            self.dropped_stale += 1
            logging.warning("rollout %d in %s was sampled %d policy versions before it would be trained, over "
                            "max_staleness=%d: dropped (rollout/dropped_stale) and sampled again", rollout,
                            self.store.path(rollout), staleness, self.policy.max_staleness)
            return None
        logging.info("resumed inside rollout %d: loaded %s (step %d)", rollout, self.store.path(rollout), step)
        return buffer, metrics, {}

    def staleness(self, rollout: int, metrics: dict) -> int:
        """Policy versions (one per rollout) between the parameters that sampled `rollout` and its own."""
        behaviour = metrics.get("rollout/policy_step")
        return 0 if behaviour is None else rollout - int(behaviour) // self.schedule.steps_per_rollout

    def _bound_tokens(self, rollout: int, buffer: dict, metrics: dict) -> dict:
        """Partial rollouts: the samples with a token over the bound dropped from the loss (counted), the per-token
        staleness metrics set (module docstring)."""
        dropped, token_metrics = bound_token_versions(buffer, rollout, self.policy.max_staleness)
        if dropped:
            logging.warning("rollout %d: %d samples have tokens more than max_staleness=%d versions old: dropped "
                            "from the loss (rollout/dropped_stale_samples)", rollout, dropped,
                            self.policy.max_staleness)
            self.dropped_stale_samples += dropped
        return {**metrics, **token_metrics}

    # ------------------------------------------------------------------------------------ partial rollouts
    def publish(self, model, rollout: int) -> dict:
        """Partial rollouts: serves `model` as version `rollout` (the parameters at that rollout's first step) in
        place under the rows in flight; returns its metrics (digests, `time/adapter_sync_s`)."""
        policy = self.rollouts.policy(model, rollout)
        # known before any server serves it: a row may come back with it as soon as the first server loaded it
        self.versions[policy.adapter().digest()] = rollout
        served, seconds = self.rollouts.sync(policy)
        return {**self.rollouts.last_sync, "rollout/published_version": float(rollout),
                "time/adapter_sync_s": seconds}

    def _note_sampled(self) -> None:
        """Called by the rollouts as a rollout's sampling ends (on the producer's thread): the versions then."""
        self._sampled_versions.map = dict(self.versions)

    @staticmethod
    def token_versions(digests: np.ndarray, sampled: np.ndarray, published: dict) -> np.ndarray:
        """[N, C] int32: the published version of each sampled token (`sampled` [N, C]: the sampler's tokens) from
        its digest, -1 elsewhere. A sampled token without a digest (a server that reported none, or the base) or
        with one this run never published (another process reloaded the adapter) is an AdapterSyncError."""
        missing = [i for i, (row, mask) in enumerate(zip(digests, sampled)) if any(d is None for d in row[mask])]
        unknown = {d for row, mask in zip(digests, sampled) for d in row[mask] if d is not None and d not in published}
        if missing or unknown:
            raise AdapterSyncError(
                f"tokens sampled by adapter digest(s) {sorted(map(str, unknown))} that this run never published "
                f"(published: {sorted(published.values())}), or without a version (rows {missing[:8]}); another "
                "process reloaded the run's adapter on a server, or a server reported no version per token")
        return np.where(sampled, np.vectorize(lambda d: published.get(d, -1), otypes=[np.int32])(digests),
                        -1).astype(np.int32)

    # ------------------------------------------------------------------------------------- sampling ahead
    def _sample_ahead(self, rollout: int, step: int, policy) -> None:
        """Has the producer sample rollouts rollout + 1 .. rollout + k (k = max_staleness) that it does not hold
        yet, from `policy` (the parameters of step `step`): each is then at most k versions old when trained. A
        resumed run takes rollouts rollout + 1 .. rollout + k - 1 from the store when the interrupted run had
        sampled them (from parameters no checkpoint holds)."""
        k = self.policy.max_staleness
        last = -(-self.steps // self.schedule.steps_per_rollout) - 1
        behaviour = None
        for q in range(rollout + 1, min(rollout + k, last) + 1):
            if q in self._pending:
                continue
            if q < rollout + k and os.path.exists(self.store.path(q)):
                stored = self._load_stored(q, step)
                if stored is not None:
                    done: concurrent.futures.Future = concurrent.futures.Future()
                    done.set_result(stored)
                    self._pending[q] = done
                    continue
            behaviour = behaviour if behaviour is not None else self.snapshot(policy)
            if self._producer is None:  # partial rollouts: up to k rollouts on the servers at once
                self._producer = Producer(self._make, workers=k if self.policy.partial else 1)
            self._pending[q] = self._producer.submit(q, step, behaviour)
            logging.info("rollout %d: sampling ahead from the parameters of step %d", q, step)

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
        """Waits for the rollouts the producer holds (each writes itself to the store); raises an error of theirs.
        One a signal stopped (it was waiting for servers) is dropped with those after it: the checkpoint the Trainer
        then writes does not need them (a resume samples them again). The wait is the trainer's idle time, reported
        in the next rollout's time/trainer_idle_s."""
        t0 = time.perf_counter()
        try:
            self._drain()
        finally:
            self._idle_unreported += time.perf_counter() - t0

    def _drain(self) -> None:
        for q in sorted(self._pending):
            try:
                self._pending[q].result()
            except interrupt.Interrupted:
                logging.warning("rollouts %s: stopped by a signal while sampling ahead; dropped",
                                [p for p in sorted(self._pending) if p >= q])
                self._pending = {p: f for p, f in self._pending.items() if p < q}
                return

    # ------------------------------------------------------------------------------------------ per step
    def host_metrics(self, step: int, rollout: int, metrics: dict) -> dict:
        """The asynchronous policy's metrics of train step `step` on rollout `rollout` (module docstring)."""
        host = {}
        if "rollout/policy_step" in metrics:
            host["rollout/staleness"] = float(step - metrics["rollout/policy_step"])
            if "rollout/version_span_max" not in metrics:
                # in policy versions (one per rollout; every token of a rollout is sampled by one version)
                versions = float(self.staleness(rollout, metrics))
                host.update({"rollout/staleness_mean": versions, "rollout/staleness_max": versions})
            host["rollout/dropped_stale"] = float(self.dropped_stale)
        if self.policy.partial:
            host.update({**self.publish_metrics, "rollout/dropped_stale_samples": float(self.dropped_stale_samples)})
        return host

    def prune(self, steps: list, keep_checkpoints: Optional[int]) -> None:
        """Deletes the rollout buffers that only pruned checkpoints needed: `steps` are the training states on disk
        after the saves landed. A state at step s needs rollout s // S (when s is inside it, and when sampling
        ahead also the next one, sampled before s); older buffers belong to states Orbax deleted. Run after the
        saves, not at the checkpoint (which comes before its save): there the states about to be pruned are still
        on disk, and the buffers of the last ones pruned outlived the run."""
        if self.store is None or (self.schedule.steps_per_rollout == 1 and not self.policy.ahead):
            return
        if keep_checkpoints is None or not steps:
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
    -1 where no token was sampled): the mean and max over sampled tokens, the most versions one sample spans, and
    the fraction of samples whose tokens come from more than one version (partial rollouts)."""
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
