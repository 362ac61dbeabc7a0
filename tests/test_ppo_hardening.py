"""PPO hardening (issue 29 item 5; GRPO shares the clamp): the log-ratio clamped before exp (finite loss and gradient at log-ratio 100
with A < 0, bit-identical inside the window), ppo.dual_clip reaching the loss, the ratio/max and value/abs_max
maxima reduced exactly over micro-batches, critic warm-up, and a tiny PPO run at 100x the learning rate that
skips no update."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxrl.algorithms import grpo, ppo
from jaxrl.algorithms.ppo_task import PPOTask
from jaxrl.algorithms.run import build_model, resolve_config
from jaxrl.parallel.mesh import make_mesh
from jaxrl.train.loop import Trainer
from jaxrl.train.step import is_max_metric

MESH = (1, 1, 1)


def _batch(seed=0, b=4, t=6, spread=1.0):
    rng = np.random.default_rng(seed)
    old = -rng.exponential(1.0, (b, t)).astype(np.float32)
    logp = (old + rng.normal(0.0, spread, (b, t))).astype(np.float32)
    adv = rng.normal(size=(b, t)).astype(np.float32)
    values = rng.normal(size=(b, t)).astype(np.float32)
    old_values = (values + rng.normal(0.0, 0.3, (b, t))).astype(np.float32)
    returns = rng.normal(size=(b, t)).astype(np.float32)
    mask = (np.arange(t)[None, :] < rng.integers(1, t + 1, size=b)[:, None]).astype(np.float32)
    return logp, old, adv, values, old_values, returns, mask


@functools.partial(jax.jit, static_argnames=("clamp", "dual_clip"))
def _loss_and_grads(logp, old, adv, values, old_values, returns, mask, clamp, dual_clip=None):
    norm = grpo.global_normalizers(mask)

    def f(lp, v):
        return ppo.ppo_loss(lp, old, adv, v, old_values, returns, mask, norm, log_ratio_clamp=clamp,
                            dual_clip=dual_clip)
    (loss, metrics), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(logp, values)
    return loss, metrics, grads


def test_log_ratio_100_with_a_negative_advantage_gives_a_finite_loss_and_gradient():
    b = list(_batch())
    b[0] = b[0].copy()
    b[0][0, 0] = b[1][0, 0] + 100.0  # the policy raised this token's probability by e^100
    b[2] = b[2].copy()
    b[2][0, 0] = -1.0
    b[6] = b[6].copy()
    b[6][0, 0] = 1.0
    # without the clamp: rho = exp(100) = inf in float32, -rho A = +inf, and the gradient is NaN
    loss, _, grads = _loss_and_grads(*b, clamp=None)
    assert not np.isfinite(float(loss)) and not np.isfinite(np.asarray(grads[0])).all()
    loss, metrics, grads = _loss_and_grads(*b, clamp=20.0)
    assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert float(metrics["ratio/max"]) == pytest.approx(np.exp(20.0), rel=1e-6)  # the clamped ratio
    assert float(grads[0][0, 0]) == 0.0  # past the clamp the token's gradient is 0 (verl)
    # with the dual clip the token's loss is capped at -A * 3 = 3 (verl clip_ratio_c)
    per_token = ppo.policy_loss(b[0], b[1], b[2], 0.2, log_ratio_clamp=20.0, dual_clip=3.0)
    assert float(per_token[0, 0]) == pytest.approx(3.0)
    assert float(ppo.policy_loss(b[0], b[1], b[2], 0.2, log_ratio_clamp=20.0)[0, 0]) == pytest.approx(np.exp(20.0),
                                                                                                     rel=1e-6)


def test_inside_the_window_the_clamp_changes_no_bit():
    """Log-ratios within +-20 (typical ones and some near the edge): loss and both gradients equal the unclamped
    formula's bit for bit, the metrics to float32 rounding."""
    b = list(_batch(seed=3, b=8, t=16, spread=2.0))
    b[0] = b[0].copy()
    b[0][0, :4] = b[1][0, :4] + np.array([19.9, -19.9, 12.0, -7.5], np.float32)
    lr = b[0] - b[1]
    assert np.abs(lr).max() < 20.0 and np.abs(lr).max() > 19.0
    ref_loss, ref_metrics, ref_grads = _loss_and_grads(*b, clamp=None)
    loss, metrics, grads = _loss_and_grads(*b, clamp=20.0)
    assert np.asarray(loss).tobytes() == np.asarray(ref_loss).tobytes()
    for k in ref_metrics:  # sums of per-token values: XLA may fuse them in another order once the clamp is there
        np.testing.assert_allclose(np.asarray(metrics[k]), np.asarray(ref_metrics[k]), rtol=1e-6, err_msg=k)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    # and the unclamped formula is PPO's: max(-A rho, -A clip(rho)) token-mean, + vf_coef * the value loss
    rho = np.exp(lr.astype(np.float64))
    pg = np.maximum(-b[2] * rho, -b[2] * np.clip(rho, 0.8, 1.2))
    vf = 0.5 * np.maximum((b[3] - b[5]) ** 2, (np.clip(b[3], b[4] - 0.2, b[4] + 0.2) - b[5]) ** 2)
    m = b[6] > 0
    np.testing.assert_allclose(float(loss), pg[m].mean() + 0.1 * vf[m].mean(), rtol=1e-5)


@pytest.mark.slow  # jitted programs compile
def test_maxima_are_exact_over_micro_batch_splits():
    """ratio/max and value/abs_max: the train step reduces metrics named `.../max` with max, so any split gives
    the full batch's maximum over its loss tokens (masked tokens left out)."""
    b = _batch(seed=5, b=8, t=6)
    full = _loss_and_grads(*b, clamp=20.0)[1]
    m = b[6] > 0
    assert float(full["ratio/max"]) == pytest.approx(np.exp((b[0] - b[1])[m]).max(), rel=1e-6)
    assert float(full["value/abs_max"]) == pytest.approx(np.abs(b[3][m]).max(), rel=1e-6)
    assert is_max_metric("ratio/max") and is_max_metric("value/abs_max") and not is_max_metric("ratio")
    norm = grpo.global_normalizers(jnp.asarray(b[6]))
    for n_micro in (2, 4):
        size = 8 // n_micro
        parts = [ppo.ppo_loss(*(jnp.asarray(x[k * size:(k + 1) * size]) for x in b), norm, log_ratio_clamp=20.0)[1]
                 for k in range(n_micro)]
        for key in ("ratio/max", "value/abs_max"):
            assert max(float(p[key]) for p in parts) == float(full[key])


@pytest.mark.slow  # builds the tiny model twice
def test_the_config_reaches_the_objective():
    cfg = resolve_config(tiny_config("ppo", dual_clip=3.0, log_ratio_clamp=10.0))
    task = PPOTask(cfg, build_model(cfg), make_mesh(MESH))
    assert task.objective.dual_clip == 3.0 and task.objective.log_ratio_clamp == 10.0
    off = resolve_config(tiny_config("ppo", log_ratio_clamp=0.0))
    assert PPOTask(off, build_model(off), make_mesh(MESH)).objective.log_ratio_clamp is None
    assert resolve_config(tiny_config("ppo")).ppo.log_ratio_clamp == 20.0  # verl's default
    with pytest.raises(ValueError, match="ppo.dual_clip=0.5 must exceed 1"):
        resolve_config(tiny_config("ppo", dual_clip=0.5))
    with pytest.raises(ValueError, match="ppo.critic_warmup_steps must be >= 0"):
        resolve_config(tiny_config("ppo", critic_warmup_steps=-1))


def test_grpo_clamps_the_log_ratio_too():
    """GRPO's loss (off-policy under overlap or num_iterations > 1) with log-ratio 100 and A < 0: +inf and a NaN
    gradient without the clamp, finite with grpo.log_ratio_clamp's default; inside the window bit-identical."""
    logp, old, _, _, _, _, mask = _batch(seed=7)
    adv = np.array([-1.0, 0.5, -0.3, 1.2], np.float32)
    mask[0, 0] = 1.0
    norm = grpo.global_normalizers(jnp.asarray(mask))

    def loss_and_grad(lp, clamp):
        f = lambda x: grpo.grpo_loss(x, old, adv, mask, norm, log_ratio_clamp=clamp, aggregation="token_mean")  # noqa: E731
        (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
        return loss, metrics, g

    inside = [np.asarray(x) for x in loss_and_grad(logp, None)[::2]]
    assert [np.asarray(x).tobytes() for x in loss_and_grad(logp, 20.0)[::2]] == [x.tobytes() for x in inside]
    far = logp.copy()
    far[0, 0] = old[0, 0] + 100.0
    loss, _, g = loss_and_grad(far, None)
    assert not np.isfinite(float(loss)) and not np.isfinite(np.asarray(g)).all()
    loss, metrics, g = loss_and_grad(far, 20.0)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(g)).all() and np.isfinite(float(metrics["ratio"]))
    assert float(g[0, 0]) == 0.0


@pytest.mark.slow  # builds the tiny model
def test_grpo_config_reaches_the_objective():
    from jaxrl.algorithms.grpo_task import GRPOTask
    assert resolve_config(tiny_config("grpo")).grpo.log_ratio_clamp == 20.0
    cfg = resolve_config(tiny_config("grpo", log_ratio_clamp=0.0))
    assert GRPOTask(cfg, build_model(cfg), make_mesh(MESH)).objective.log_ratio_clamp is None
    with pytest.raises(ValueError, match="grpo.log_ratio_clamp must be >= 0"):
        resolve_config(tiny_config("grpo", log_ratio_clamp=-1.0))


@pytest.mark.heavy
@pytest.mark.slow
def test_tiny_ppo_at_100x_the_learning_rate_skips_no_update_and_the_critic_warms_up_first(tmp_path):
    """configs/ppo_tiny.py with both learning rates x100 (adapters 0.3, value head 3.0, no schedule warm-up), dual
    clip 3, the token_truncate rollout correction and two critic warm-up steps, one rollout of four steps: no
    update is skipped; in the warm-up steps the LoRA factors stay bit-identical while the value head moves, after
    them both move; the maxima and the (float32: below 1e-5) sampler-trainer gap are logged."""
    cfg = tiny_config("ppo", dual_clip=3.0, critic_warmup_steps=2, rollout_correction="token_truncate")
    cfg.steps = 4
    cfg.optimizer.learning_rate *= 100
    cfg.ppo.value_learning_rate *= 100
    cfg.optimizer.warmup_steps = 0  # the full rate from the first update (the schedule's warm-up would give 0)
    cfg.checkpoint_every = 4
    cfg = resolve_config(cfg)
    model = build_model(cfg)
    snapshots = {}
    task = PPOTask(cfg, model, make_mesh(MESH))
    assert "is_weights" in task.train_keys  # the rollout correction reaches PPO's batch (and loss) too
    trainer = Trainer(cfg, model, task, str(tmp_path / "run"), mesh=make_mesh(MESH),
                      on_step_end=lambda done, t: snapshots.__setitem__(done, dict(jax.device_get(t.state.params))))
    snapshots[0] = dict(jax.device_get(trainer.state.params))
    records = trainer.run().records
    for r in records:
        print(r["step"], {k: r[k] for k in ("loss", "ratio", "ratio/max", "value/abs_max", "critic_warmup",
                                            "update_skipped", "skipped_updates", "grad_norm")})
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["update_skipped"] == 0 for r in records) and records[-1]["skipped_updates"] == 0
    assert [r["critic_warmup"] for r in records] == [1.0, 1.0, 0.0, 0.0]
    lora = [n for n in snapshots[0] if ".lora." in n]
    head = [n for n in snapshots[0] if n.startswith("value_head.")]
    assert lora and head
    for step in (1, 2):
        for n in lora:
            np.testing.assert_array_equal(snapshots[step][n], snapshots[0][n], err_msg=f"{n} moved in warm-up")
        assert any(not np.array_equal(snapshots[step][n], snapshots[step - 1][n]) for n in head)
    for step in (3, 4):
        assert any(not np.array_equal(snapshots[step][n], snapshots[step - 1][n]) for n in lora)
    for r in records:
        assert r["ratio/max"] >= r["ratio"] - 1e-5 and np.isfinite(r["ratio/max"])  # the mean: a float32 sum
        assert r["value/abs_max"] >= 0 and np.isfinite(r["value/abs_max"])
    # the warm-up left the policy where the rollout was sampled: ratio 1 up to the two passes' rounding
    assert all(r["ratio/max"] == pytest.approx(1.0, abs=1e-4) for r in records[:3])
    assert records[3]["ratio/max"] > 1.5  # the policy update of step 3 moved it
    assert records[-1]["value/abs_max"] > 0  # the head moved off its zero init
    assert records[0]["mismatch/logp_abs_max"] < 1e-5 and records[0]["mismatch/clipped_fraction"] == 0.0  # float32
