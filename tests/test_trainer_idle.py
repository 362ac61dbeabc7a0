"""`time/trainer_idle_s` counts every wait of the trainer on rollouts (jaxrl/algorithms/online/controller.py): the wait
for its rollout and, reported with the next rollout, the checkpoint's wait for the rollouts sampled ahead to land
(`settle`). The real RolloutController, its Producer thread and its RolloutStore, driven in the Trainer's order
(rollout, train, checkpoint), with rollouts that take a known time to sample; the sampler's servers are left out
(the controller only asks them for their last sync record and to close)."""

from __future__ import annotations

import time

import numpy as np

from jaxrl.algorithms.online.buffer import Schedule
from jaxrl.algorithms.online.controller import RolloutController
from jaxrl.algorithms.online.settings import AsyncPolicy

SAMPLE_S = 0.6  # the seconds one rollout takes to sample


class IdleServers:
    """The sampler's side the controller touches: its last adapter sync (none here) and its end."""

    last_sync: dict = {}

    def close(self) -> None:
        pass


def slow_rollout(rollout: int, policy) -> tuple[dict, dict, None]:
    """A rollout of two rows that takes SAMPLE_S seconds, as sampling on busy servers does."""
    time.sleep(SAMPLE_S)
    ids = np.full((2, 4), rollout, np.int32)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}, {"reward/mean": 0.5}, None


def test_the_checkpoints_wait_for_rollouts_in_flight_is_counted_as_trainer_idle_time(tmp_path):
    """Reproduction on 2e1e1a6: with grpo.max_staleness >= 1 a checkpoint waits (`settle`) for the rollouts the
    producer samples ahead, about 21 s a checkpoint on the finding's run where a second client kept the servers
    busy, and `time/trainer_idle_s` logged 0: only the wait inside `rollout()` was timed, and the producer had
    finished during the drain. Here the drain (about SAMPLE_S) is part of the next rollout's trainer_idle_s."""
    controller = RolloutController(AsyncPolicy(max_staleness=1), IdleServers(),
                                   Schedule(rows=2, global_batch=2, iterations=1, seed=0), make=slow_rollout,
                                   steps=3, snapshot=lambda policy: policy)
    controller.open(str(tmp_path))
    policy = object()

    _, _, first = controller.rollout(0, policy)  # sampled now (nothing ahead yet); rollout 1 goes to the producer
    assert first["time/trainer_idle_s"] >= SAMPLE_S

    t0 = time.perf_counter()
    controller.settle()  # the checkpoint of step 1: rollout 1 is still being sampled
    drain_s = time.perf_counter() - t0
    assert drain_s >= 0.5 * SAMPLE_S, "premise: the checkpoint waited for the rollout in flight"

    _, _, second = controller.rollout(1, policy)  # already landed: no wait of its own
    assert second["time/rollout_wait_s"] < 0.5 * SAMPLE_S
    assert second["time/trainer_idle_s"] >= drain_s

    t0 = time.perf_counter()
    controller.settle()  # the checkpoint of step 2: rollout 2, sampled ahead at step 1
    drain2_s = time.perf_counter() - t0
    _, _, third = controller.rollout(2, policy)
    # this drain, and not the one already reported with rollout 1
    assert drain2_s <= third["time/trainer_idle_s"] < drain2_s + 0.5 * drain_s
