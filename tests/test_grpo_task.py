"""GRPO trainer (jaxrl.algorithms.grpo_task): micro-batch split invariance of one update, learning on the
token task, bounded KL, reproducibility, rollout options, configs."""

import jax
import numpy as np
import pytest

from configs import grpo as grpo_family
from conftest import first_batch, tiny_config
from jaxrl.algorithms import grpo as grpo_lib
from jaxrl.algorithms.online import passes as completion_passes
from jaxrl.algorithms.grpo_task import GRPOObjective, GRPOTask
from jaxrl.parallel.mesh import make_mesh
from jaxrl.algorithms.run import build_model, resolve_config, run_training
from jaxrl.algorithms.tasks import get_task_factory
from jaxrl.train.loop import Trainer
from jaxrl.train.step import accumulate_gradients, make_micro_loss, split_batch

MESH = (1, 1, 1)


def _records_by_step(records):
    return {r["step"]: r for r in records}


# ------------------------------------------------------------------------------------------------- one update


@pytest.mark.heavy
@pytest.mark.slow
def test_update_is_invariant_to_the_micro_batch_split(tmp_path):
    """One rollout through the real task, then the summed gradients of GRPOObjective for 1 x 16 and 4 x 4 splits
    (ragged completion lengths, dropped groups), for every aggregation: equal up to float rounding; and the
    three aggregations differ."""
    cfg = tiny_config("grpo", num_generations=4, prompts_per_step=4, num_iterations=2, drop_zero_variance_groups=True,
                      mask_truncated=True, beta=0.1, kl_estimator="k3")
    cfg.batch.micro_batch_size, cfg.batch.grad_accum = 4, 4
    cfg = resolve_config(cfg)
    model = build_model(cfg)
    task = get_task_factory("grpo")(cfg, model, make_mesh(MESH))
    assert isinstance(task, GRPOTask)
    trainer = Trainer(cfg, model, task, str(tmp_path / "run"), mesh=make_mesh(MESH))
    batch, host = first_batch(trainer)
    assert set(batch) == {"input_ids", "attention_mask", "completion_mask", "advantages", "sequence_mask",
                          "ref_logp", "old_logp"}
    assert batch["input_ids"].shape == (16, 6 + 8) and batch["completion_mask"].shape == (16, 8)
    # Ragged completions (as stop tokens make them): cut some rows short, so per-sequence lengths differ.
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, size=16)
    batch["completion_mask"] = batch["completion_mask"] * (np.arange(8)[None, :] < lengths[:, None])
    # The current policy differs from both the behaviour and the reference policy: random LoRA B factors.
    params = dict(jax.device_get(trainer.state.params))
    for name in params:
        if name.endswith("lora_B"):
            params[name] = rng.standard_normal(params[name].shape).astype(np.float32) * 0.3
    objectives = [GRPOObjective(max_new_tokens=8, aggregation=a, beta=0.1, kl_estimator="k3",
                                epsilon_low=0.2, epsilon_high=0.28, temperature=0.2, chunk_size=64)
                  for a in grpo_lib.AGGREGATIONS]
    rng_key = jax.random.key(0)

    def grads(n_micro):
        b = split_batch(batch, n_micro)

        def f(p):
            return [accumulate_gradients(make_micro_loss(o, trainer.graphdef, trainer.codec), o, p, trainer.frozen,
                                         b, rng_key) for o in objectives]
        # a quick compile: the numbers are the same, the program is just optimised less
        return jax.device_get(jax.jit(f, compiler_options={"xla_backend_optimization_level": 0})(params))

    results = {n: grads(n) for n in (1, 4)}  # 1 x 16 rows and 4 x 4 rows
    for k, agg in enumerate(grpo_lib.AGGREGATIONS):
        loss1, g1, m1 = results[1][k]
        assert np.isfinite(loss1)
        scale = max(float(np.abs(g).max()) for g in g1.values())
        assert scale > 0
        for n in (4,):
            loss_n, g_n, m_n = results[n][k]
            np.testing.assert_allclose(loss_n, loss1, rtol=2e-5, atol=1e-7, err_msg=f"{agg} loss, split {n}")
            for name in g1:  # float32 sums in another order: relative to the largest gradient entry
                np.testing.assert_allclose(g_n[name], g1[name], rtol=1e-4, atol=2e-5 * scale,
                                           err_msg=f"{agg} grad {name}, split {n}")
            for key in ("policy_loss", "kl", "ratio", "clip_fraction/region", "entropy"):
                np.testing.assert_allclose(m_n[key], m1[key], rtol=2e-5, atol=1e-7, err_msg=f"{agg} {key}")
        # the update is not trivially on-policy: ratios move and some clip binds
        assert abs(m1["ratio"] - 1.0) > 1e-3 and m1["clip_fraction/region"] > 0
    losses = [results[1][k][0] for k in range(3)]
    assert len({round(float(x), 6) for x in losses}) == 3, losses


@pytest.mark.slow
def test_rollout_masks_and_advantages_follow_the_options(tmp_path):
    """drop_zero_variance_groups removes whole groups from the loss and num_sequences; advantages are the
    group-normalised rewards of grpo.group_advantages; the reference is the policy at step 0 (KL 0)."""
    cfg = tiny_config("grpo", num_generations=4, prompts_per_step=8, drop_zero_variance_groups=True, beta=0.04)
    cfg.batch.micro_batch_size, cfg.batch.grad_accum = 8, 4
    cfg.data.score_tokens = 2  # coarse rewards: some groups come out all-equal
    cfg = resolve_config(cfg)
    model = build_model(cfg)
    task = GRPOTask(cfg, model, make_mesh(MESH))
    trainer = Trainer(cfg, model, task, str(tmp_path / "run"), mesh=make_mesh(MESH))
    batch, host = first_batch(trainer)
    assert "old_logp" not in batch  # one update per rollout: on-policy, ratio exactly 1
    seq = batch["sequence_mask"]
    groups = seq.reshape(-1, 4)
    assert np.all((groups == 0) | (groups == 1)) and np.all(groups == groups[:, :1])
    dropped = groups[:, 0] == 0
    assert host["zero_variance_groups"] == pytest.approx(dropped.mean())
    assert 0 < dropped.sum() < len(dropped)  # this seed has both kinds
    assert np.all(batch["completion_mask"][seq == 0] == 0)
    adv = batch["advantages"].reshape(-1, 4)
    np.testing.assert_array_equal(adv[dropped], 0.0)
    assert np.all(np.abs(adv[~dropped].sum(1)) < 1e-4)  # centred per group
    # the policy is the reference at step 0 (LoRA B = 0): identical log-probs, k3 KL 0
    ref = batch["ref_logp"]
    cur = completion_passes.teacher_forced(trainer.current_model(), batch, max_new_tokens=8, adapters=True,
                                           batch_size=32, temperature=0.2, chunk_size=64)["logp"]
    on = batch["completion_mask"] > 0
    np.testing.assert_allclose(cur[on], ref[on], atol=1e-6)
    assert np.all(ref[on] < 0)


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_off_policy_old_logprobs_in_bf16_are_teacher_forced(tmp_path):
    """Off-policy (num_iterations=2) in bf16: the ratio's denominator must be the teacher-forced log-probs of the
    sampling parameters. The sampler's KV-cache decode differs from that pass by ~1e-2 in bf16 (equal to ~1e-6
    in fp32, where the sampler's are kept)."""
    cfg = tiny_config("grpo", num_generations=4, prompts_per_step=4, num_iterations=2, temperature=1.0, beta=0.0)
    cfg.batch.micro_batch_size, cfg.batch.grad_accum = 4, 4
    cfg.dtype = "bfloat16"
    cfg = resolve_config(cfg)
    model = build_model(cfg)
    task = GRPOTask(cfg, model, make_mesh(MESH))
    trainer = Trainer(cfg, model, task, str(tmp_path / "run"), mesh=make_mesh(MESH))
    batch, _ = first_batch(trainer)
    teacher = completion_passes.teacher_forced(trainer.current_model(), batch, max_new_tokens=8, adapters=True,
                                               batch_size=cfg.grpo.logprob_batch_size,
                                               chunk_size=cfg.logprob_chunk_size)
    on = batch["completion_mask"] > 0
    assert on.any()
    np.testing.assert_allclose(batch["old_logp"][on], teacher["logp"][on], atol=1e-6, rtol=0)
    fp32 = tiny_config("grpo", num_generations=4, prompts_per_step=4, num_iterations=2, temperature=1.0, beta=0.0)
    fp32.batch.micro_batch_size, fp32.batch.grad_accum = 4, 4
    fp32 = resolve_config(fp32)
    assert not GRPOTask(fp32, build_model(fp32), make_mesh(MESH)).recompute


# ------------------------------------------------------------------------------------------------- learning


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    cfg = tiny_config("grpo")
    result = run_training(cfg, str(tmp_path_factory.mktemp("grpo_learn")))
    return cfg, result.records


@pytest.mark.heavy
@pytest.mark.slow
def test_grpo_raises_reward_from_chance_to_above_0_8(learning_run):
    cfg, records = learning_run
    assert [r["step"] for r in records] == list(range(1, cfg.steps + 1))
    reward = np.array([r["reward/mean"] for r in records])
    kl = np.array([r["kl"] for r in records])
    start, end = reward[:3].mean(), reward[-5:].mean()
    print(f"GRPO reward {start:.3f} -> {end:.3f}; kl max {kl.max():.3f}")
    assert 0.35 < start < 0.6  # chance is 0.5
    assert end >= 0.8
    assert kl[0] < 1e-6  # step 1: the policy is the reference
    assert np.all(np.isfinite(kl)) and kl.max() < 6.0
    assert all(r["update_skipped"] == 0 for r in records)
    expected = {"loss", "policy_loss", "ratio", "ratio_abs_dev", "clip_fraction/low", "clip_fraction/high",
                "clip_fraction/region", "kl", "entropy", "reward/mean", "reward/std", "zero_variance_groups",
                "advantage/mean", "advantage/std", "advantage/min", "advantage/max", "completion/length_mean",
                "completion/truncation_rate", "rollout", "loss_tokens_fraction"}
    assert expected <= set(records[0])
    assert {"time/sample_s", "time/score_s", "time/ref_logp_s", "time/old_logp_s", "time/rollout_s"} <= set(
        records[1])
    assert records[1]["step_time_s"] >= records[1]["time/rollout_s"] > 0
    # entropy falls as the policy sharpens onto its block
    assert records[-1]["entropy"] < records[0]["entropy"] - 0.5


@pytest.mark.heavy
@pytest.mark.slow
def test_grpo_curve_is_reproducible(learning_run, tmp_path):
    """Seeded: a second run gives the same first steps (rollouts, rewards, losses) bit for bit."""
    cfg, records = learning_run
    cfg = tiny_config("grpo")
    cfg.steps = 3  # constant schedule after warm-up: the first steps do not depend on the run length
    again = run_training(cfg, str(tmp_path / "again")).records
    for a, b in zip(records[:3], again):
        for key in ("reward/mean", "reward/std", "loss", "grad_norm", "kl", "advantage/std", "entropy"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


@pytest.mark.heavy
@pytest.mark.slow
def test_kl_stays_bounded_and_shrinks_with_beta(learning_run, tmp_path):
    """beta = 0.2 holds the per-token KL to the reference below 1 over 40 steps, well under the beta = 0.04
    run at the same steps, while the reward still rises."""
    _, loose = learning_run
    cfg = tiny_config("grpo", beta=0.2)
    cfg.steps = 40
    records = run_training(cfg, str(tmp_path / "beta02")).records
    kl = np.array([r["kl"] for r in records])
    kl_loose = np.array([r["kl"] for r in loose[:40]])
    reward = np.array([r["reward/mean"] for r in records])
    print(f"beta 0.2: kl max {kl.max():.3f} (beta 0.04: {kl_loose.max():.3f}); reward {reward[:3].mean():.3f} -> "
          f"{reward[-5:].mean():.3f}")
    assert kl.max() < 1.0
    assert kl[-10:].mean() < 0.6 * kl_loose[-10:].mean()
    assert reward[-5:].mean() > reward[:3].mean() + 0.1


# ------------------------------------------------------------------------------------------------- configs


def test_configs_reproduce_the_users_runs():
    c = grpo_family.get_config("run=4b_base")
    assert (c.optimizer.learning_rate, c.grpo.beta, c.grpo.num_generations, c.grpo.prompts_per_step,
            c.grpo.max_new_tokens, c.lora.rank, c.lora.alpha) == (5e-6, 0.01, 8, 20, 4096, 16, 32.0)
    assert c.model_preset == "" and c.batch.micro_batch_size * c.batch.grad_accum == 160
    probes = {p: grpo_family.get_config(f"run=9b_probe,probe={p}") for p in ("default", "aggressive", "capacity")}
    assert {p: (c.optimizer.learning_rate, c.grpo.beta, c.lora.rank, c.lora.alpha, c.steps)
            for p, c in probes.items()} == {"default": (1e-6, 0.05, 16, 32.0, 16),
                                            "aggressive": (5e-6, 0.01, 16, 32.0, 16),
                                            "capacity": (1e-6, 0.05, 32, 64.0, 16)}
    assert c.grpo.kl_estimator == "k3" and c.grpo.aggregation == "sequence_mean"
    assert grpo_family.get_config("model=9b,mb=8,k=8,prompts=20").batch.grad_accum == 20
    with pytest.raises(ValueError, match="unknown override key 'betta'"):
        grpo_family.get_config("betta=0.1")
    with pytest.raises(ValueError, match="mb=3 must divide the 160 rows"):
        grpo_family.get_config("mb=3")


@pytest.mark.slow
def test_rollout_rows_must_fill_whole_global_batches():
    cfg = resolve_config(tiny_config("grpo", prompts_per_step=3))  # 24 rows, global batch 64
    with pytest.raises(ValueError, match=r"grpo.prompts_per_step x grpo.num_generations = 24 rows"):
        GRPOTask(cfg, build_model(cfg), make_mesh(MESH))
    with pytest.raises(ValueError, match="grpo.aggregation='mean'"):
        resolve_config(tiny_config("grpo", aggregation="mean"))


# ------------------------------------------------------------------------------------------------- buffers


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_rollout_buffers_go_with_the_checkpoints_that_needed_them(tmp_path):
    """Two passes over each rollout (S = 2: every rollout lands in rollouts/<r>.npz), a checkpoint at steps 3 and
    4, one training state kept. After step 3 the state of step 3 (inside rollout 1) needs 1.npz, and nothing needs
    0.npz; once the state of step 4 replaces it, nothing needs 1.npz either: the run ends with no buffer left."""
    import os

    cfg = tiny_config("grpo", num_generations=4, prompts_per_step=4, num_iterations=2, max_new_tokens=4)
    cfg.batch.micro_batch_size, cfg.batch.grad_accum = 8, 2
    cfg.steps, cfg.checkpoint_every, cfg.keep_checkpoints = 4, 3, 1
    workdir = tmp_path / "run"
    seen = {}

    def look(done, trainer):
        seen[done] = (sorted(os.listdir(workdir / "checkpoints" / "state")), sorted(os.listdir(workdir / "rollouts")))

    run_training(cfg, str(workdir), on_step_end=look)
    assert seen[3] == (["3"], ["1.npz"])  # the buffer the kept state resumes from stays, the older one went
    assert sorted(os.listdir(workdir / "checkpoints" / "state")) == ["4"]
    assert os.listdir(workdir / "rollouts") == []
