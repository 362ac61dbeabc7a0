"""Replay of groups that carried a signal (`grpo.replay_groups`, jaxrl/algorithms/online/replay.py): zero-variance
groups are replaced by kept groups of earlier rollouts, newest first and at most max_age old, read back from the
workdir by a resumed run; in a GRPO run the rows trained with zero advantage fall to near zero, and the replayed
fraction and age are in the metrics."""

import numpy as np
import pytest

from jaxrl.algorithms.online.replay import GroupReplay
from test_curriculum import pool, pool_config  # noqa: F401 - the fixture and its config

G = 2


def rollout_buffer(r: int, signal=(True, True, True)) -> dict:
    """Rollout r's arrays: 3 groups of G rows; a group without a signal has advantage 0."""
    rows = len(signal) * G
    adv = np.where(np.arange(rows) % 2 == 0, 1.0, -1.0) * (r + 1) * np.repeat(signal, G)
    return {"input_ids": np.full((rows, 4), r, np.int32) + np.arange(rows)[:, None],
            "advantages": adv.astype(np.float32), "old_logp": np.full((rows, 3), -float(r), np.float32)}


def test_groups_without_a_signal_take_the_newest_kept_groups_and_a_new_instance_reads_them_back(tmp_path):
    replay = GroupReplay(groups=2, max_age=2, group=G)
    replay.open(str(tmp_path))
    _, m0 = replay.apply(0, rollout_buffer(0, (True, False, True)), np.array([True, False, True]))
    assert m0["replay/groups"] == 0 and m0["replay/available"] == 0  # nothing kept yet
    _, m1 = replay.apply(1, rollout_buffer(1), np.array([True, True, True]))
    out, m2 = replay.apply(2, rollout_buffer(2, (False, True, False)), np.array([False, True, False]))
    # groups 0 and 2 of rollout 2 take rollout 1's first two groups (newest first)
    assert m2["replay/groups"] == 2 and m2["replay/age_mean"] == 1.0 and m2["replay/available"] == 2
    np.testing.assert_array_equal(out["input_ids"][0:2], rollout_buffer(1)["input_ids"][0:2])
    np.testing.assert_array_equal(out["input_ids"][4:6], rollout_buffer(1)["input_ids"][2:4])
    np.testing.assert_array_equal(out["old_logp"][4:6], rollout_buffer(1)["old_logp"][2:4])  # its own denominator
    np.testing.assert_array_equal(out["input_ids"][2:4], rollout_buffer(2)["input_ids"][2:4])
    assert m2["replay/zero_advantage_rows"] == 0.0
    assert sorted(p.name for p in (tmp_path / "replay").iterdir()) == ["1.npz", "2.npz"]  # rollout 0 out of reach

    resumed = GroupReplay(groups=2, max_age=2, group=G)
    resumed.open(str(tmp_path))
    again, m3 = resumed.apply(3, rollout_buffer(3, (False, False, False)), np.array([False, False, False]))
    assert m3["replay/groups"] == 2 and m3["replay/age_max"] == 2.0  # rollout 2's one kept group, then rollout 1's
    np.testing.assert_array_equal(again["input_ids"][0:2], rollout_buffer(2)["input_ids"][2:4])
    assert m3["replay/zero_advantage_rows"] == pytest.approx(2 / 6)  # the third group had nothing to take


def test_replay_needs_synchronous_rollouts():
    from jaxrl.algorithms.grpo_config import GRPOConfig
    with pytest.raises(ValueError, match=r"grpo.replay_groups replays groups of the rollouts before this one: it "
                                         r"needs grpo.max_staleness=0"):
        GRPOConfig(replay_groups=4, max_staleness=1, rollout_backend="server", rollout_servers=("http://x:1",))


@pytest.mark.heavy  # one GRPO run of 8 steps on the tiny model
def test_rows_trained_with_zero_advantage_fall_to_near_zero_with_replay(pool, tmp_path):  # noqa: F811
    from jaxrl.algorithms.run import run_training

    cfg = pool_config(pool, "uniform", steps=8)
    cfg.grpo.replay_groups, cfg.grpo.replay_max_age = 4, 4
    records = run_training(cfg, str(tmp_path / "run")).records
    assert all(np.isfinite(r["loss"]) and r["update_skipped"] == 0 for r in records)
    # the first rollout has nothing kept to replay, the second only the first's few groups with a signal; a row whose
    # reward is its group's mean keeps advantage 0 (replay cannot change that)
    later = records[2:]
    zero_groups = np.mean([r["zero_variance_groups"] for r in later])
    zero_rows = np.mean([r["replay/zero_advantage_rows"] for r in later])
    print({"zero_variance_groups": zero_groups, "zero_advantage_rows_after_replay": zero_rows,
           "replayed": np.mean([r["replay/fraction"] for r in later])})
    assert zero_groups > 0.5 and zero_rows <= 0.1
    assert all(1 <= r["replay/age_max"] <= 4 for r in records if r["replay/groups"])
    assert records[0]["replay/groups"] == 0 and all(r["replay/groups"] > 0 for r in later if r["zero_variance_groups"])
