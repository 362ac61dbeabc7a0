"""Reference resets (`grpo.ref_reset_every`, jaxrl/algorithms/online/reference.py): every k rollouts the KL anchor
becomes the policy that samples that rollout, the reset is logged, and a resumed run reads the same reference back."""

import os

import pytest

from conftest import tiny_config
from jaxrl.algorithms.online.reference import ReferenceResets


def test_each_rollouts_reference_is_the_last_reset_before_it():
    resets = ReferenceResets(3)
    assert [resets.last_reset(r) for r in range(8)] == [0, 0, 0, 3, 3, 3, 6, 6]
    assert ReferenceResets(0).last_reset(10) == 0


def test_a_negative_reset_interval_is_refused():
    from jaxrl.algorithms.grpo_config import GRPOConfig
    with pytest.raises(ValueError, match=r"grpo.ref_reset_every must be >= 0"):
        GRPOConfig(ref_reset_every=-1)


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
