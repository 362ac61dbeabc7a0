"""Reference resets (`grpo.ref_reset_every`, jaxrl/algorithms/online/reference.py): every k rollouts the KL anchor
becomes the policy that samples that rollout, the reset is logged, and a resumed run reads the same reference back."""

import os
from types import SimpleNamespace

import jax
import optax
import pytest

from conftest import tiny_config
from jaxrl.algorithms.online.reference import ReferenceResets


def test_each_rollouts_reference_is_the_last_reset_before_it():
    resets = ReferenceResets(3)
    assert [resets.last_reset(r) for r in range(8)] == [0, 0, 0, 3, 3, 3, 6, 6]
    assert ReferenceResets(0).last_reset(10) == 0


def test_a_negative_reset_interval_and_a_moment_reset_without_resets_are_refused():
    from jaxrl.algorithms.grpo_config import GRPOConfig
    from jaxrl.algorithms.ppo_config import PPOConfig
    with pytest.raises(ValueError, match=r"grpo.ref_reset_every must be >= 0"):
        GRPOConfig(ref_reset_every=-1)
    with pytest.raises(ValueError, match=r"ppo.ref_reset_optimizer=True needs ppo.ref_reset_every > 0"):
        PPOConfig(ref_reset_optimizer=True)
    with pytest.raises(ValueError, match=r"grpo.ref_reset_every=4 resets a reference nothing reads"):
        GRPOConfig(ref_reset_every=4, beta=0.0)
    GRPOConfig(ref_reset_every=4, beta=0.0, kl_in_reward=0.1, advantage_estimator="reinforce_plus_plus")


def test_the_moments_start_over_at_the_first_step_of_each_reset_rollout_only():
    from jaxrl.algorithms.online.buffer import Schedule
    from jaxrl.algorithms.online.task import OnlineTask
    task = SimpleNamespace(schedule=Schedule(rows=8, global_batch=4, iterations=2, seed=0),  # 4 steps a rollout
                           reference_resets=ReferenceResets(3), ref_reset_optimizer=True)
    assert [s for s in range(30) if OnlineTask.resets_optimizer(task, s)] == [12, 24]
    task.ref_reset_optimizer = False
    assert not any(OnlineTask.resets_optimizer(task, s) for s in range(30))


def test_reset_adam_moments_zeroes_the_moments_and_keeps_the_schedule():
    import jax.numpy as jnp
    from jaxrl.train.optim import make_optimizer, reset_adam_moments
    from jaxrl.train.settings import OptimizerConfig
    from jaxrl.train.state import init_train_state
    tx, _ = make_optimizer(OptimizerConfig(max_grad_norm=1.0), 10)
    params = {"a": jnp.arange(3.0)}
    state = init_train_state(params, tx, 0)
    opt = state.opt_state
    for _ in range(2):
        _, opt = tx.update({"a": jnp.ones(3)}, opt, params)
    fresh = reset_adam_moments(state._replace(opt_state=opt)).opt_state
    adam = [n for n in jax.tree.leaves(fresh, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
            if isinstance(n, optax.ScaleByAdamState)][0]
    assert int(adam.count) == 0 and float(jnp.abs(adam.mu["a"]).sum()) == 0 and float(adam.nu["a"].sum()) == 0
    sched = [n for n in jax.tree.leaves(fresh, is_leaf=lambda n: isinstance(n, optax.ScaleByScheduleState))
             if isinstance(n, optax.ScaleByScheduleState)][0]
    assert int(sched.count) == 2  # the learning-rate schedule goes on
    assert jax.tree.structure(fresh) == jax.tree.structure(tx.init(params))


@pytest.mark.heavy  # three short GRPO runs on the tiny model
def test_the_reference_resets_to_the_policy_and_a_resumed_run_reads_it_back(tmp_path):
    from jaxrl.algorithms.run import run_training

    def config(steps):
        cfg = tiny_config("grpo", ref_reset_every=3, beta=0.5)
        cfg.steps, cfg.checkpoint_every, cfg.keep_checkpoints = steps, 1, 5
        return cfg

    straight = run_training(config(5), str(tmp_path / "straight")).records
    by_step = {r["step"]: r for r in straight}
    # one update per rollout: rollout r is step r + 1; rollout 3 resets the reference to the policy sampling it
    assert by_step[4]["reference/reset"] == 1.0 and by_step[4]["reference/rollout"] == 3.0
    assert all("reference/reset" not in by_step[s] for s in (1, 2, 3, 5)) and by_step[5]["reference/rollout"] == 3.0
    assert by_step[3]["kl"] > 1e-6  # the policy has moved from the base (step 1's warm-up rate is 0)
    assert by_step[4]["kl"] < 1e-9  # on-policy at the reset: the policy IS the reference
    assert by_step[5]["kl"] > 1e-9
    assert os.path.exists(tmp_path / "straight" / "reference" / "rollout_3.npz")

    run_training(config(4), str(tmp_path / "resumed"))  # stops after the reset's step; then resumes to step 5
    resumed = run_training(config(5), str(tmp_path / "resumed")).records
    assert [r["step"] for r in resumed] == [5]
    assert "reference/reset" not in resumed[0]  # read back, not reset again
    for key in ("kl", "loss", "grad_norm", "reward/mean"):
        assert resumed[0][key] == by_step[5][key], key


@pytest.mark.heavy  # four short GRPO runs on the tiny model
def test_the_optimizer_moments_start_over_at_a_reset_and_a_resumed_run_does_the_same(tmp_path):
    from jaxrl.algorithms.run import run_training

    def config(steps, reset_moments):
        cfg = tiny_config("grpo", ref_reset_every=3, ref_reset_optimizer=reset_moments, beta=0.5)
        cfg.steps, cfg.checkpoint_every, cfg.keep_checkpoints = steps, 1, 5
        return cfg

    kept = {r["step"]: r for r in run_training(config(5, False), str(tmp_path / "kept")).records}
    reset = {r["step"]: r for r in run_training(config(5, True), str(tmp_path / "reset")).records}
    assert reset[4]["optimizer/reset"] == 1.0 and all("optimizer/reset" not in reset[s] for s in (1, 2, 3, 5))
    for s in (1, 2, 3, 4):  # the same until the reset's update (step 4's loss is computed before it)
        assert reset[s]["loss"] == kept[s]["loss"], s
    assert reset[5]["loss"] != kept[5]["loss"]  # the update of step 4 came from fresh moments

    run_training(config(3, True), str(tmp_path / "resumed"))  # stops before the reset; resumes through it
    resumed = {r["step"]: r for r in run_training(config(5, True), str(tmp_path / "resumed")).records}
    assert sorted(resumed) == [4, 5] and resumed[4]["optimizer/reset"] == 1.0
    for s in (4, 5):
        for key in ("kl", "loss", "grad_norm", "reward/mean"):
            assert resumed[s][key] == reset[s][key], (s, key)
