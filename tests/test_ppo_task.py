"""PPO trainer (jaxrl.algorithms.ppo_task): learning on the token task with a falling value loss, a NaN
injected into a step skipped and counted, exact resume inside a rollout, the value head's place in checkpoints,
configs."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from configs import ppo as ppo_family
from conftest import make_rollout, tiny_config
from jaxrl.algorithms.ppo_task import PPOTask, ValueHead
from jaxrl.models.qwen35.checkpoint import is_base_param
from jaxrl.parallel.mesh import make_mesh
from jaxrl.models.adapters import load_adapter
from jaxrl.algorithms.run import build_model, resolve_config, run_training
from jaxrl.train.loop import Trainer
from jaxrl.train.metrics import read_metrics

MESH = (1, 1, 1)
NAN, INF = float("nan"), float("inf")


def _run(cfg, workdir, **kwargs):
    cfg = resolve_config(cfg)
    model = build_model(cfg)
    task = PPOTask(cfg, model, make_mesh(MESH))
    trainer = Trainer(cfg, model, task, workdir, mesh=make_mesh(MESH), **kwargs)
    return trainer, trainer.run()


# ------------------------------------------------------------------------------------------------- learning


@pytest.mark.heavy
@pytest.mark.slow
def test_ppo_raises_reward_and_lowers_value_loss(tmp_path):
    cfg = tiny_config("ppo")
    records = run_training(cfg, str(tmp_path / "run")).records
    steps_per_rollout = cfg.ppo.epochs * cfg.ppo.minibatches
    rollout_reward = np.array([r["reward/mean"] for r in records[::steps_per_rollout]])
    vf = np.array([r["vf_loss"] for r in records])
    kl = np.array([r["rollout/kl"] for r in records])
    start, end = rollout_reward[:3].mean(), rollout_reward[-3:].mean()
    print(f"PPO reward {start:.3f} -> {end:.3f}; value loss {vf[:4].mean():.4f} -> {vf[-12:].mean():.4f}; "
          f"rollout KL max {kl.max():.3f}")
    assert 0.35 < start < 0.6  # chance is 0.5
    assert end >= start + 0.1
    assert vf[-12:].mean() < 0.5 * vf[:4].mean()
    assert np.all(np.isfinite(kl)) and kl.max() < 2.0
    expected = {"pg_loss", "vf_loss", "clip_fraction", "vf_clip_fraction", "approx_kl", "ratio", "entropy",
                "reward/mean", "reward/std", "explained_variance", "kl_coef", "rollout/kl", "advantage/mean",
                "advantage/std", "value/mean", "return/mean", "completion/length_mean", "completion/truncation_rate"}
    assert expected <= set(records[0])
    assert {"time/sample_s", "time/score_s", "time/policy_pass_s", "time/ref_logp_s", "time/rollout_s"} <= set(
        records[steps_per_rollout])
    assert "time/rollout_s" not in records[1]  # the second step trains on the buffered rollout
    # the first update of each rollout is on-policy: ratio 1 up to the fp32 noise of two passes
    assert abs(records[0]["ratio"] - 1.0) < 1e-4 and records[0]["clip_fraction"] == 0.0


# ------------------------------------------------------------------------------------------------- faults


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_nan_in_a_ppo_step_is_skipped_counted_and_the_run_finishes(tmp_path):
    cfg = tiny_config("ppo")
    cfg.steps = 8
    cfg.checkpoint_every = 4
    cfg.max_consecutive_nonfinite = 3
    cfg.compile_options.xla_backend_optimization_level = 0  # a quicker compile
    faults = {2: (NAN, 0.0), 5: (0.0, INF)}  # 0-based step -> (loss add, value-head gradient add)
    snapshots = {}

    def snapshot(done, trainer):
        snapshots[done] = dict(jax.device_get(trainer.state.params))

    workdir = str(tmp_path / "run")
    trainer, result = _run(cfg, workdir, fault_fn=lambda step: faults.get(step), fault_group="value_head",
                           on_step_end=snapshot)
    assert result.final_step == 8
    records = {r["step"]: r for r in read_metrics(workdir)}
    assert sorted(records) == list(range(1, 9))
    assert [records[s]["update_skipped"] for s in range(1, 9)] == [0, 0, 1, 0, 0, 1, 0, 0]
    assert records[8]["skipped_updates"] == 2
    assert records[3]["nonfinite_reason"] == "loss is nan"
    assert records[6]["nonfinite_groups"] == ["value_head"]
    for skipped in (3, 6):  # nothing moved, value head included
        for name, value in snapshots[skipped].items():
            np.testing.assert_array_equal(value, snapshots[skipped - 1][name])
    for applied in (4, 7):
        assert not np.array_equal(snapshots[applied]["value_head.bias"], snapshots[applied - 1]["value_head.bias"])
    assert all(np.isfinite(v).all() for v in snapshots[8].values())


# ------------------------------------------------------------------------------------------------- resume


@pytest.mark.heavy
@pytest.mark.slow
def test_resume_inside_a_rollout_gives_identical_adapters(tmp_path):
    """A run stopped after step 6 (inside rollout 1 of 4 steps each) and resumed ends with the same adapters,
    value head, KL coefficient (adaptive controller) and metrics as an uninterrupted one."""
    cfg = tiny_config("ppo", adaptive_kl=True, kl_target=0.01, kl_horizon=100.0)
    cfg.steps = 10
    cfg.checkpoint_every = 3
    cfg.keep_checkpoints = 1
    cfg.compile_options.xla_backend_optimization_level = 0

    full_dir = str(tmp_path / "full")
    full_trainer, _ = _run(cfg, full_dir)
    full = jax.device_get(full_trainer.state.params)

    class Stop(Exception):
        pass

    def stop_after_6(done, trainer):
        if done == 6:
            raise Stop

    part_dir = str(tmp_path / "part")
    with pytest.raises(Stop):
        _run(cfg, part_dir, on_step_end=stop_after_6)
    assert os.path.exists(os.path.join(part_dir, "rollouts", "1.npz"))  # rollout 1 = steps 5-8
    resumed_trainer, result = _run(cfg, part_dir)
    assert [r["step"] for r in result.records] == [7, 8, 9, 10]
    resumed = jax.device_get(resumed_trainer.state.params)
    assert set(resumed) == set(full) and any(n.startswith("value_head.") for n in full)
    for name in full:
        np.testing.assert_array_equal(resumed[name], full[name], err_msg=name)
    a = {r["step"]: r for r in read_metrics(full_dir)}
    b = {r["step"]: r for r in read_metrics(part_dir)}
    for step in range(1, 11):
        for key in ("loss", "reward/mean", "vf_loss", "kl_coef", "rollout/kl"):
            assert a[step][key] == b[step][key], (step, key)
    assert a[10]["kl_coef"] != cfg.ppo.init_kl_coef  # the adaptive controller moved and was restored
    # buffers no kept checkpoint needs are deleted (keep_checkpoints=1: the state of step 9 needs rollout 2)
    assert sorted(os.listdir(os.path.join(part_dir, "rollouts"))) == ["2.npz"]
    # adapter artifacts hold LoRA factors only; the value head lives in the training state
    adapter, meta = load_adapter(part_dir)
    assert adapter and all(".lora." in n for n in adapter)
    assert not is_base_param(("value_head", "weight"))


# ------------------------------------------------------------------------------------------------- KL controller


@pytest.mark.slow  # a rollout and its teacher-forced passes compile
def test_adaptive_kl_controller_sees_the_mean_of_per_sequence_kl(tmp_path):
    """verl and OpenRLHF feed the controller the mean over sequences of each sequence's token-mean KL (so a few
    long completions do not dominate it). A real rollout with ragged completions (temperature 1 reaches the stop
    token early in some rows) and a policy away from its reference (random LoRA B)."""
    from jaxrl.algorithms import kl as kl_lib
    from jaxrl.algorithms.online import passes as completion_passes
    from jaxrl.algorithms import ppo as ppo_lib
    from jaxrl.models.lora import iter_lora

    cfg = resolve_config(tiny_config("ppo", adaptive_kl=True, temperature=1.0, kl_estimator="k1"))
    model = build_model(cfg)
    rng = np.random.default_rng(0)
    for _, lora in iter_lora(model):
        lora.lora_B[...] = rng.standard_normal(lora.lora_B.shape).astype(np.float32) * 0.3
    task = PPOTask(cfg, model, make_mesh(MESH))
    seen = []

    class Recording(ppo_lib.AdaptiveKLController):
        def update(self, coef, current_kl, n_steps):
            seen.append((float(current_kl), int(n_steps)))
            return super().update(coef, current_kl, n_steps)

    task.controller = Recording(*task.controller)
    buffer, metrics = make_rollout(task, model)
    ref = completion_passes.teacher_forced(model, buffer, max_new_tokens=cfg.ppo.max_new_tokens, adapters=False,
                                           batch_size=cfg.ppo.logprob_batch_size, temperature=1.0,
                                           chunk_size=cfg.logprob_chunk_size)["logp"]
    mask = buffer["completion_mask"] > 0
    kl = np.asarray(kl_lib.kl(buffer["old_logp"], ref, "k1", mask=mask), np.float64)
    lengths = mask.sum(-1)
    assert len(set(lengths[lengths > 0])) > 1  # ragged, or both means would coincide
    per_sequence = kl.sum(-1)[lengths > 0] / lengths[lengths > 0]
    token_mean = kl.sum() / lengths.sum()
    assert abs(per_sequence.mean() - token_mean) > 1e-3 * abs(token_mean)
    (current_kl, n_steps), = seen
    assert n_steps == 64
    np.testing.assert_allclose(current_kl, per_sequence.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["rollout/kl"], token_mean, rtol=1e-5)  # the token mean stays a metric


# ------------------------------------------------------------------------------------------------- value head


def test_value_head_learning_rate_scale_and_zero_init():
    head = ValueHead(16, lr_scale=100.0)
    h = np.random.default_rng(0).standard_normal((2, 3, 16)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(head(h)), 0.0)

    graphdef, _ = nnx.split(head)

    def v(weight, bias):  # the head as a function of its parameters
        return nnx.merge(graphdef, nnx.State({"weight": nnx.Param(weight), "bias": nnx.Param(bias)}))(h).sum()

    w0, b0 = np.ones((1, 16), np.float32) * 0.01, np.ones((1,), np.float32) * 0.5
    value = v(w0, b0)
    np.testing.assert_allclose(value, 100.0 * (h.sum((0, 1)) @ w0[0] / 4.0 + 6 * 0.5), rtol=1e-5)
    gw, gb = jax.grad(lambda w, b: v(w, b), argnums=(0, 1))(w0, b0)
    # the gradient is that of the unscaled head: the scale acts as a learning-rate multiplier under Adam
    np.testing.assert_allclose(gw[0], h.sum((0, 1)) / 4.0, rtol=1e-5)
    np.testing.assert_allclose(gb, [6.0])


# ------------------------------------------------------------------------------------------------- configs


def test_configs_reproduce_the_users_runs():
    for run, coef, model in (("4b_kl005", 0.05, "qwen3.5-4b"), ("4b_kl01", 0.1, "qwen3.5-4b"),
                             ("9b_kl005", 0.05, "qwen3.5-9b"), ("9b_kl01", 0.1, "qwen3.5-9b")):
        c = ppo_family.get_config(f"run={run}")
        assert c.ppo.init_kl_coef == coef and c.algorithm == "ppo" and c.steps == 125
        assert c.model_preset == "" and c.max_consecutive_nonfinite == 10
        rows = c.ppo.prompts_per_rollout * c.ppo.num_generations
        assert rows == c.ppo.minibatches * c.batch.micro_batch_size * c.batch.grad_accum
    c = ppo_family.get_config("model=9b,kl=0.1,adaptive=1,epochs=2,minibatches=4,mb=2")
    assert c.ppo.adaptive_kl and c.ppo.epochs == 2 and (c.batch.micro_batch_size, c.batch.grad_accum) == (2, 4)
    with pytest.raises(ValueError, match="minibatches=5 must divide the 32 rows"):
        ppo_family.get_config("minibatches=5")


@pytest.mark.slow
def test_rows_must_equal_minibatches_times_the_global_batch():
    cfg = resolve_config(tiny_config("ppo", minibatches=3))
    with pytest.raises(ValueError, match=r"must equal ppo.minibatches \(3\)"):
        PPOTask(cfg, build_model(cfg), make_mesh(MESH))
