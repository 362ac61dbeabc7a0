"""GRPO math and KL estimators against numpy transcriptions of docs/design/algorithms.md 2.2 and against TRL 1.16's own
``GRPOTrainer._compute_loss`` (called with a stand-in ``self``; torch autograd gives its gradients). TRL computes
advantages inline in ``_generate_and_score_completions`` (not callable without a full trainer), so those are
compared with a torch transcription of its lines that uses TRL's own ``nanstd``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import importlib.util

import numpy as np
import pytest

from jaxrl.algorithms import grpo, kl
from jaxrl.algorithms.online import correction

# Skipped only where the test extra is not installed: with torch and trl present a failing import is an error,
# never a silent skip.
if importlib.util.find_spec("torch") and importlib.util.find_spec("trl"):
    import torch
    from trl.trainer import grpo_trainer as trl_grpo
    from trl.trainer.utils import nanstd as trl_nanstd
else:
    trl_grpo = None
needs_trl = pytest.mark.skipif(trl_grpo is None, reason="torch/trl not installed")

# Jitted once per (shape, estimator): eager dispatch would compile every primitive for every new shape.
kl_jit = jax.jit(kl.kl, static_argnames="estimator")
adv_jit = jax.jit(grpo.group_advantages, static_argnums=(1, 2))

# --------------------------------------------------------------------------------------- advantages


def np_group_adv(r, G, scale, eps=1e-4):
    """docs/design/algorithms.md 2.2: A = r - mean_g; / (std_g + 1e-4) (group) or / (std_all + 1e-4) (batch); Bessel
    std; NaN rewards ignored, their advantage (and any NaN result) 0."""
    g = r.reshape(-1, G)
    out = np.zeros_like(g)
    all_valid = r[~np.isnan(r)]
    bstd = np.std(all_valid, ddof=1) if all_valid.size > 1 else np.nan
    for i, row in enumerate(g):
        v = row[~np.isnan(row)]
        mean = v.mean() if v.size else np.nan
        std = np.std(v, ddof=1) if v.size > 1 else np.nan
        a = row - mean
        if scale == "group":
            a = a / (std + eps)
        elif scale == "batch":
            a = a / (bstd + eps)
        out[i] = np.where(np.isnan(a), 0.0, a)
    return out.reshape(-1)


REWARDS = np.array([0.0, 1.0, 0.5, 1.0,   0.2, 0.2, 0.2, 0.2,   np.nan, 0.3, 0.9, np.nan,
                    np.nan, np.nan, np.nan, np.nan,   0.7, np.nan, np.nan, np.nan,   1.0, 0.0, 0.0, 0.25],
                   np.float32)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_numpy(scale):
    rng = np.random.default_rng(0)
    r = rng.standard_normal(32).astype(np.float32)
    out = adv_jit(jnp.asarray(r), 8, scale)
    np.testing.assert_allclose(np.asarray(out), np_group_adv(r.astype(np.float64), 8, scale), rtol=1e-5,
                               atol=1e-6)
    # NaN-safe batch: NaN rewards, an all-NaN group, a single-scored group, a zero-variance group
    out = np.asarray(adv_jit(jnp.asarray(REWARDS), 4, scale))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np_group_adv(REWARDS.astype(np.float64), 4, scale), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[4:8], 0.0)  # zero variance -> 0 (TRL: 0 / (0 + 1e-4))
    np.testing.assert_array_equal(out[12:20], 0.0)  # all-NaN group, and a group with one scored member
    assert out[8] == 0.0 and out[11] == 0.0  # unscored members


def test_group_advantages_known_numbers():
    # group [0, 1, 1, 0]: mean .5, Bessel std sqrt(1/3)
    out = np.asarray(adv_jit(jnp.array([0.0, 1.0, 1.0, 0.0]), 4, "group"))
    np.testing.assert_allclose(out, np.array([-0.5, 0.5, 0.5, -0.5]) / (np.sqrt(1 / 3) + 1e-4), rtol=1e-6)
    with pytest.raises(ValueError, match="num_generations=3"):
        grpo.group_advantages(jnp.zeros(8), 3)


@needs_trl
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_trl_transcription(scale):
    G = 4
    rewards = torch.tensor(REWARDS)
    # trl/trainer/grpo_trainer.py, sum_then_normalize branch (lines ~2763-2810 of trl 1.16)
    mean_grouped = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    if scale in ["group", "none"]:
        std = trl_nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    else:
        std = trl_nanstd(rewards).expand_as(rewards)
    adv = rewards - mean_grouped
    if scale != "none":
        adv = adv / (std + 1e-4)
    adv = torch.nan_to_num(adv, nan=0.0)
    ours = adv_jit(jnp.asarray(REWARDS), G, scale)
    np.testing.assert_allclose(np.asarray(ours), adv.numpy(), rtol=1e-6, atol=1e-7)
    is_std_zero = torch.isclose(std, torch.zeros_like(std)).numpy()
    flags = np.asarray(grpo.zero_variance_groups(jnp.asarray(REWARDS), G))
    if scale != "batch":  # TRL flags exact zero std; we also flag groups whose std is undefined (NaN)
        np.testing.assert_array_equal(flags, is_std_zero | np.isnan(std.numpy()))


def test_zero_variance_flags_and_combine_rewards():
    flags = np.asarray(grpo.zero_variance_groups(jnp.asarray(REWARDS), 4))
    np.testing.assert_array_equal(flags, np.repeat([False, True, False, True, True, False], 4))
    per_func = jnp.array([[1.0, np.nan], [np.nan, np.nan], [0.5, 2.0]])
    out = np.asarray(grpo.combine_rewards(per_func, jnp.array([2.0, 0.5])))
    assert out[0] == 2.0 and np.isnan(out[1]) and out[2] == 2.0


def test_rloo_and_registry_estimators():
    r = np.array([1.0, 0.0, 0.5, np.nan, 2.0, 2.0, 1.0, 3.0], np.float32)
    out = np.asarray(grpo.compute_advantages(jnp.asarray(r), 4, "rloo"))
    exp = [1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5, 0.0, 2.0 - 2.0, 2.0 - 2.0, 1.0 - 7 / 3, 3.0 - 5 / 3]
    np.testing.assert_allclose(out, exp, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grpo.compute_advantages(jnp.asarray(r), 4, "dr_grpo")),
                               np_group_adv(r.astype(np.float64), 4, "none"), rtol=1e-6)


# --------------------------------------------------------------------------------------- KL estimators


def test_kl_estimators_match_numpy_and_k3_is_stable():
    rng = np.random.default_rng(1)
    logp = (-3 + rng.standard_normal((3, 6))).astype(np.float32)
    ref = (logp + 0.8 * rng.standard_normal((3, 6))).astype(np.float32)
    d = ref.astype(np.float64) - logp.astype(np.float64)
    np.testing.assert_allclose(np.asarray(kl_jit(logp, ref, estimator="k1")), -d, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(kl_jit(logp, ref, estimator="k2")), 0.5 * d**2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(kl_jit(logp, ref, estimator="k3")), np.exp(d) - d - 1, rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(kl_jit(logp, ref, estimator="abs")), np.abs(d), rtol=1e-6)

    # Tiny d in float32: the naive exp(d) - d - 1 loses everything, ours keeps float32 accuracy and is >= 0.
    mags = np.logspace(-8, -0.5, 40)
    dd = np.concatenate([mags, -mags]).astype(np.float32)
    logp0 = np.zeros_like(dd)
    exact = np.where(np.abs(dd.astype(np.float64)) < 1e-3,
                     dd.astype(np.float64) ** 2 / 2 + dd.astype(np.float64) ** 3 / 6
                     + dd.astype(np.float64) ** 4 / 24,
                     np.expm1(dd.astype(np.float64)) - dd.astype(np.float64))
    ours = np.asarray(kl_jit(jnp.asarray(logp0), jnp.asarray(dd), estimator="k3"))
    assert (ours >= 0).all()
    np.testing.assert_allclose(ours, exact, rtol=2e-6)
    naive = np.asarray(jnp.exp(jnp.asarray(dd)) - jnp.asarray(dd) - 1.0)
    assert np.max(np.abs(naive - exact) / exact) > 0.5  # the naive form really is broken here
    # and the gradient d k3 / d logp = 1 - exp(d) = -expm1(d) is accurate too
    g = np.asarray(jax.jit(jax.grad(lambda lp: jnp.sum(kl.kl_k3(lp, jnp.asarray(dd)))))(jnp.asarray(logp0)))
    np.testing.assert_allclose(g, -np.expm1(dd.astype(np.float64)), rtol=2e-6)
    # large |d| (d = -200 ... 80): finite values and gradients from both branches
    big = jnp.array([200.0, 30.0, -30.0, -80.0])
    v, gb = jax.jit(jax.value_and_grad(lambda lp: jnp.sum(kl.kl_k3(lp, jnp.zeros(4)))))(big)
    assert np.isfinite(float(v)) and np.isfinite(np.asarray(gb)).all()
    # d = 200 overflows float32 in plain k3 (the true estimate is e^200); verl's clamped form stays bounded
    assert np.isinf(float(kl_jit(jnp.array(-200.0), jnp.array(0.0), estimator="k3")))
    v, gb = jax.jit(jax.value_and_grad(lambda lp: jnp.sum(kl.kl_low_var(lp, jnp.zeros(2)))))(
        jnp.array([-200.0, 200.0]))
    assert np.isfinite(float(v)) and np.isfinite(np.asarray(gb)).all()


def test_low_var_kl_and_k3_plus():
    logp = jnp.array([[0.0, -1.0, -50.0, 0.0]])
    ref = jnp.array([[-0.5, -1.0, 0.0, -30.0]])
    out = np.asarray(kl_jit(logp, ref, estimator="low_var_kl"))
    d = np.clip(np.array([-0.5, 0.0, 50.0, -30.0]), -20, 20)
    np.testing.assert_allclose(out[0], np.clip(np.exp(d) - d - 1, -10, 10), rtol=1e-6)
    assert out[0, 2] == 10.0  # verl's clamp
    # k3+: value of k3, gradient of k2
    lp = jnp.array([[-1.0, -2.0]])
    rf = jnp.array([[-1.5, -1.0]])
    np.testing.assert_allclose(np.asarray(kl_jit(lp, rf, estimator="k3+")),
                               np.asarray(kl_jit(lp, rf, estimator="k3")), rtol=1e-6)
    g_plus = jax.grad(lambda x: jnp.sum(kl_jit(x, rf, estimator="k3+")))(lp)
    g_k2 = jax.grad(lambda x: jnp.sum(kl_jit(x, rf, estimator="k2")))(lp)
    np.testing.assert_allclose(np.asarray(g_plus), np.asarray(g_k2), rtol=1e-6)


# --------------------------------------------------------------------------------------- surrogate and loss


def ragged_batch(seed=0, B=8, T=7):
    rng = np.random.default_rng(seed)
    lengths = np.array([7, 1, 4, 0, 6, 2, 7, 3])[:B]
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    old = (-2.0 + 0.8 * rng.standard_normal((B, T))).astype(np.float32)
    logp = (old + 0.25 * rng.standard_normal((B, T))).astype(np.float32)  # ratios ~ exp(+-0.25): some clipped
    ref = (logp + 0.3 * rng.standard_normal((B, T))).astype(np.float32)
    adv = rng.standard_normal(B).astype(np.float32)
    return logp, old, ref, adv, mask


def np_per_token(logp, old, ref, adv, mask, eps_low, eps_high, delta, beta, level):
    """docs/design/algorithms.md 2.2, per token (float64)."""
    lr = logp - old
    if level == "sequence":
        lr = ((lr * mask).sum(-1) / np.maximum(mask.sum(-1), 1))[:, None]
    rho = np.exp(lr)
    clipped = np.clip(rho, 1 - eps_low, 1 + eps_high)
    if delta is not None:
        rho = np.minimum(rho, delta)
    A = adv[:, None]
    loss = -np.minimum(rho * A, clipped * A)
    loss = np.broadcast_to(loss, logp.shape)
    if beta:
        d = ref - logp
        loss = loss + beta * (np.exp(d) - d - 1)
    return loss


def np_aggregate(l, mask, mode, L):
    if mode == "token_mean":
        return (l * mask).sum() / mask.sum()
    if mode == "sequence_mean":
        return ((l * mask).sum(-1) / np.maximum(mask.sum(-1), 1)).mean()
    return (l * mask).sum() / (l.shape[0] * L)


CASES = [
    # (trl loss_type, level, eps_low, eps_high, delta, beta)
    ("grpo", "token", 0.2, 0.2, None, 0.0),
    ("dapo", "token", 0.2, 0.28, None, 0.04),
    ("dr_grpo", "token", 0.1, 0.3, None, 0.0),
    ("dapo", "sequence", 3e-4, 4e-4, None, 0.0),  # GSPO
    ("grpo", "token", 0.2, 0.2, 1.1, 0.1),  # INTELLECT-2 two-sided clip + k3 KL
    ("grpo", "sequence", 0.2, 0.2, None, 0.04),
]
L_MAX = 10  # configured max_completion_length (larger than the padded width T=7)


@functools.partial(jax.jit, static_argnames=("trl_type", "level", "el", "eh", "delta", "beta"))
def _grpo_vg(logp, old, ref, adv, mask, norm, trl_type, level, el, eh, delta, beta):
    def f(lp):
        return grpo.grpo_loss(lp, old, adv, mask, norm, ref_logp=ref, beta=beta, epsilon_low=el, epsilon_high=eh,
                              delta=delta, importance_sampling_level=level,
                              aggregation=grpo.LOSS_TYPE_AGGREGATION[trl_type])

    return jax.value_and_grad(f, has_aux=True)(logp)


def ours_grpo(logp, old, ref, adv, mask, norm, trl_type, level, el, eh, delta, beta):
    (loss, metrics), g = _grpo_vg(*(jnp.asarray(x) for x in (logp, old, ref, adv, mask)), norm, trl_type=trl_type,
                                  level=level, el=el, eh=eh, delta=delta, beta=beta)
    return float(loss), np.asarray(g), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-d{c[4]}-b{c[5]}" for c in CASES])
def test_grpo_loss_matches_numpy(case):
    trl_type, level, el, eh, delta, beta = case
    logp, old, ref, adv, mask = ragged_batch(0)
    norm = grpo.global_normalizers(jnp.asarray(mask), L_MAX)
    val, _, metrics = ours_grpo(logp, old, ref, adv, mask, norm, *case)
    f64 = [a.astype(np.float64) for a in (logp, old, ref, adv, mask)]
    pt = np_per_token(*f64, el, eh, delta, beta, level)
    ref_val = np_aggregate(pt, f64[-1], grpo.LOSS_TYPE_AGGREGATION[trl_type], L_MAX)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    # metrics: token means over the batch
    lr = f64[0] - f64[1]
    if level == "sequence":
        lr = np.broadcast_to(((lr * mask).sum(-1) / np.maximum(mask.sum(-1), 1))[:, None], mask.shape)
    rho, A = np.exp(lr), f64[3][:, None]
    region = ((rho < 1 - el) & (A < 0)) | ((rho > 1 + eh) & (A > 0))
    np.testing.assert_allclose(metrics["clip_fraction/region"], (region * mask).sum() / mask.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio"], (rho * mask).sum() / mask.sum(), rtol=1e-5)
    if beta:
        d = f64[2] - f64[0]
        np.testing.assert_allclose(metrics["kl"], ((np.exp(d) - d - 1) * mask).sum() / mask.sum(), rtol=1e-5)


def trl_grpo_loss(logp, old, ref, adv, mask, trl_type, level, el, eh, delta, beta, L):
    """TRL 1.16 GRPOTrainer._compute_loss on a single batch (no accumulation); returns (loss, dloss/dlogp)."""
    B, T = logp.shape
    lp = torch.tensor(logp, requires_grad=True)
    same = lambda x: x  # noqa: E731
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1),
        loss_type=trl_type, epsilon_low=el, epsilon_high=eh, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=L,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=same),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": torch.tensor(mask),
        "advantages": torch.tensor(adv), "old_per_token_logps": torch.tensor(old),
        "ref_per_token_logps": torch.tensor(ref), "num_items_in_batch": torch.tensor(float(mask.sum())),
    }
    loss = trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs)
    loss.backward()
    return float(loss.detach()), lp.grad.numpy()


@needs_trl
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-d{c[4]}-b{c[5]}" for c in CASES])
def test_grpo_loss_matches_trl(case):
    logp, old, ref, adv, mask = ragged_batch(1)
    mask[3, :2] = 1.0  # TRL's metric code divides by each row's length; give every row a token
    norm = grpo.global_normalizers(jnp.asarray(mask), L_MAX)
    val, g, _ = ours_grpo(logp, old, ref, adv, mask, norm, *case)
    tval, tg = trl_grpo_loss(logp, old, ref, adv, mask, *case, L_MAX)
    np.testing.assert_allclose(val, tval, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g, tg, rtol=1e-4, atol=1e-7)
    assert np.abs(tg).max() > 1e-4


@jax.jit
def _all_mode_contributions(lp, o, r, a, m, norm):
    """(contribution, metrics) and d contribution / d logp of one micro-batch, for every aggregation mode
    (one compile per micro-batch shape)."""
    out = {}
    for mode in grpo.AGGREGATIONS:
        f = lambda x, mode=mode: grpo.grpo_loss(x, o, a, m, norm, ref_logp=r, beta=0.05, epsilon_low=0.2,  # noqa
                                                epsilon_high=0.28, aggregation=mode)
        out[mode] = jax.value_and_grad(f, has_aux=True)(lp)
    return out


def test_aggregation_is_exact_for_micro_batch_splits():
    """1x8, 2x4 and 8x1 splits of one ragged batch (one empty row) give the same total, gradient and metrics,
    equal to the full-batch formula, in every aggregation mode."""
    logp, old, ref, adv, mask = ragged_batch(2)
    B = logp.shape[0]
    norm = grpo.global_normalizers(jnp.asarray(mask), L_MAX)  # from the WHOLE batch, before splitting
    f64 = [x.astype(np.float64) for x in (logp, old, ref, adv, mask)]
    per_token = np_per_token(*f64, 0.2, 0.28, None, 0.05, "token")
    results = {}
    for n_micro in (1, 2, 8):
        size = B // n_micro
        total, grads, mets = defaultdict(float), defaultdict(list), defaultdict(lambda: defaultdict(float))
        for k in range(n_micro):
            s = slice(k * size, (k + 1) * size)
            out = _all_mode_contributions(*(jnp.asarray(x[s]) for x in (logp, old, ref, adv, mask)), norm)
            for mode, ((v, m), g) in out.items():
                total[mode] += float(v)
                grads[mode].append(np.asarray(g))
                for key, val in m.items():
                    mets[mode][key] += float(val)
        results[n_micro] = (total, {k: np.concatenate(v) for k, v in grads.items()}, mets)
    for mode in grpo.AGGREGATIONS:
        full = np_aggregate(per_token, f64[-1], mode, L_MAX)
        for n_micro in (1, 2, 8):
            total, grads, mets = results[n_micro]
            np.testing.assert_allclose(total[mode], full, rtol=2e-6, err_msg=f"{mode}: {n_micro} micro-batches")
            np.testing.assert_allclose(grads[mode], results[1][1][mode], rtol=1e-6, atol=1e-9, err_msg=mode)
            for key, val in mets[mode].items():
                np.testing.assert_allclose(val, results[1][2][mode][key], rtol=1e-5, atol=1e-8, err_msg=key)
    # The gradient is the one of the full-batch formula: check one entry by finite differences (float64).
    i, t, h = 0, 2, 1e-6
    for mode in grpo.AGGREGATIONS:
        up, dn = f64[0].copy(), f64[0].copy()
        up[i, t] += h
        dn[i, t] -= h
        agg = lambda lp: np_aggregate(np_per_token(lp, *f64[1:], 0.2, 0.28, None, 0.05, "token"),  # noqa: E731
                                      f64[-1], mode, L_MAX)
        fd = (agg(up) - agg(dn)) / (2 * h)
        np.testing.assert_allclose(results[8][1][mode][i, t], fd, rtol=1e-4)
    # The naive alternative -- normalising each micro-batch by its own token count and averaging -- is not
    # exact for token_mean with ragged lengths, so the test above really tests the global normalisers.
    halves = []
    for s in (slice(0, 4), slice(4, 8)):
        ln = grpo.global_normalizers(jnp.asarray(mask[s]), L_MAX)
        halves.append(float(_all_mode_contributions(*(jnp.asarray(x[s]) for x in (logp, old, ref, adv, mask)),
                                                    ln)["token_mean"][0][0]))
    assert abs(np.mean(halves) - np_aggregate(per_token, f64[-1], "token_mean", L_MAX)) > 1e-4


def test_reference_aggregate_equals_weighted_sum():
    logp, old, ref, adv, mask = ragged_batch(3)
    loss = jnp.asarray(np.random.default_rng(3).standard_normal(mask.shape).astype(np.float32))
    for mode in grpo.AGGREGATIONS:
        w = grpo.token_weights(jnp.asarray(mask), mode, grpo.global_normalizers(jnp.asarray(mask), L_MAX))
        np.testing.assert_allclose(float(grpo.aggregate_loss(loss, w)),
                                   float(grpo.reference_aggregate(loss, jnp.asarray(mask), mode, L_MAX)), rtol=1e-6)
    # padding rows excluded from num_sequences via sequence_mask
    n = grpo.global_normalizers(jnp.asarray(mask), None, sequence_mask=jnp.array([1, 1, 1, 0, 1, 1, 1, 1]))
    assert float(n.num_sequences) == 7.0 and float(n.num_tokens) == mask.sum() and float(n.max_completion_length) == 7


def test_on_policy_gradient_is_advantage_weighted_logp():
    # old_logp=None: ratio 1, d loss / d logp = -A * weight (nothing clipped)
    logp, _, _, adv, mask = ragged_batch(4)
    norm = grpo.global_normalizers(jnp.asarray(mask))
    g = jax.jit(jax.grad(lambda lp: grpo.grpo_loss(lp, None, jnp.asarray(adv), jnp.asarray(mask), norm, aggregation="token_mean")[0]))(
        jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g), -adv[:, None] * mask / mask.sum(), rtol=1e-6)
    # entropy bonus: minus coef * token-mean entropy, reported as a metric
    ent = np.abs(logp)
    loss, m = grpo.grpo_loss(jnp.asarray(logp), None, jnp.asarray(adv), jnp.asarray(mask), norm,
                             entropies=jnp.asarray(ent), entropy_coef=0.01, aggregation="token_mean")
    np.testing.assert_allclose(float(m["entropy"]), (ent * mask).sum() / mask.sum(), rtol=1e-6)
    pg = (-adv[:, None] * mask).sum() / mask.sum()  # ratio 1: the surrogate's value is -A
    np.testing.assert_allclose(float(loss), pg - 0.01 * (ent * mask).sum() / mask.sum(), rtol=1e-5)


@pytest.mark.parametrize("estimator", kl.ESTIMATORS)
def test_kl_penalty_at_padded_positions_leaves_the_gradient_finite(estimator):
    """Padding may hold any log-prob (the reference buffer is 0 there): with logp = -120 at a padded position,
    k3's exp(ref - logp) overflows unless the difference is masked before the estimator. The loss and the
    gradient must equal those of the same batch with a harmless value at that position."""
    logp, _, ref, adv, mask = ragged_batch(5)
    norm = grpo.global_normalizers(jnp.asarray(mask))
    extreme, harmless = logp.copy(), logp.copy()
    padded = np.argwhere(mask == 0)
    extreme[tuple(padded[:3].T)] = [-120.0, -1e4, 300.0]
    ref = np.where(mask > 0, ref, 0.0).astype(np.float32)
    loss_and_grad = jax.jit(jax.value_and_grad(
        lambda lp: grpo.grpo_loss(lp, None, jnp.asarray(adv), jnp.asarray(mask), norm, ref_logp=jnp.asarray(ref),
                                  beta=0.04, kl_estimator=estimator, aggregation="token_mean")[0]))
    loss, grad = loss_and_grad(jnp.asarray(extreme))
    want_loss, want_grad = loss_and_grad(jnp.asarray(harmless))
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-6, atol=1e-9)
    assert (np.asarray(grad)[mask == 0] == 0).all()
    # The per-token estimate itself is 0 at padding once the mask is given.
    per_token = kl.kl(jnp.asarray(extreme), jnp.asarray(ref), estimator, mask=jnp.asarray(mask))
    assert np.isfinite(np.asarray(per_token)).all() and (np.asarray(per_token)[mask == 0] == 0).all()


def test_dual_clip_and_clip_fraction():
    lr = jnp.log(jnp.array([[0.5, 1.0, 1.5, 5.0]]))
    neg = grpo.clipped_surrogate(lr, jnp.array([-1.0]), 0.2, 0.2, dual_clip=3.0)
    np.testing.assert_allclose(np.asarray(neg), [[0.8, 1.0, 1.5, 3.0]], rtol=1e-6)  # 5.0 capped at 3
    pos = grpo.clipped_surrogate(lr, jnp.array([2.0]), 0.2, 0.3)
    np.testing.assert_allclose(np.asarray(pos), [[-1.0, -2.0, -2.6, -2.6]], rtol=1e-6)
    cf = grpo.clip_fraction(lr, jnp.array([-1.0]), 0.2, 0.2)
    np.testing.assert_array_equal(np.asarray(cf["low"]), [[1, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(cf["high"]), [[0, 0, 0, 0]])


def test_rollout_importance_weights():
    old = jnp.array([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    samp = jnp.array([[-1.5, -1.0, np.nan], [-1.0, -3.0, -1.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    tok = np.asarray(correction.rollout_importance_weights(old, samp, mask, "token_truncate", None, 3.0))
    np.testing.assert_allclose(tok, [[np.exp(0.5), np.exp(-1.0), 1.0], [1.0, 3.0, 1.0]], rtol=1e-6)
    tm = np.asarray(correction.rollout_importance_weights(old, samp, mask, "token_mask", 0.5, 3.0))
    np.testing.assert_allclose(tm, [[np.exp(0.5), 0.0, 1.0], [1.0, 0.0, 1.0]], rtol=1e-6)
    # per sequence: the geometric mean of the token ratios (the NaN token counts as ratio 1)
    seq = np.asarray(correction.rollout_importance_weights(old, samp, mask, "sequence_mask", None, 2.5))
    np.testing.assert_allclose(seq, [[np.exp(-0.5 / 3)], [0.0]], rtol=1e-6)  # row 2: exp(2 / 2) > 2.5 -> masked


def test_overlong_penalty_and_truncation():
    lengths = jnp.array([10, 100, 101, 150, 200, 250])
    out = np.asarray(grpo.overlong_penalty(lengths, max_length=200, buffer=100, penalty_factor=0.5))
    np.testing.assert_allclose(out, [0.0, 0.0, -0.005, -0.25, -0.5, -0.5], atol=1e-7)
    ids = jnp.array([[5, 9, 2, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    trunc = grpo.truncated_completions(ids, mask, eos_token_ids=(2,))
    np.testing.assert_array_equal(np.asarray(trunc), [False, True, True])
    np.testing.assert_array_equal(np.asarray(grpo.mask_truncated_completions(mask, trunc)),
                                  [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
