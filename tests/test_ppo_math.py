"""PPO math against plain numpy loops transcribed from docs/design/algorithms.md 2.3 (TRL's PPO trainer is not in trl
1.16's package any more, so there is no TRL code to call) and torch autograd for the loss gradients."""

from __future__ import annotations

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import grpo, ppo
from jaxrl.train.step import is_max_metric

# --------------------------------------------------------------------------------------- GAE


def np_gae(rewards, values, mask, gamma, lam):
    """Straightforward loop: per sequence, keep only the unmasked positions, run textbook GAE on them
    (V = 0 after the last one), scatter back; 0 at masked positions."""
    B, T = rewards.shape
    adv = np.zeros((B, T))
    for b in range(B):
        idx = np.flatnonzero(mask[b])
        r, v = rewards[b, idx], values[b, idx]
        a = np.zeros(len(idx))
        last = 0.0
        for k in reversed(range(len(idx))):
            next_v = v[k + 1] if k + 1 < len(idx) else 0.0
            delta = r[k] + gamma * next_v - v[k]
            last = delta + gamma * lam * last
            a[k] = last
        adv[b, idx] = a
    return adv, np.where(mask > 0, adv + values, 0.0)


def gae_batch(seed=0):
    rng = np.random.default_rng(seed)
    B, T = 5, 9
    lengths = np.array([9, 4, 1, 0, 6])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    mask[0, [2, 5]] = 0.0  # holes (e.g. tool output inside a completion) are skipped
    rewards = rng.standard_normal((B, T)).astype(np.float32)
    values = rng.standard_normal((B, T)).astype(np.float32)
    return rewards, values, mask


gae_jit = jax.jit(ppo.gae)  # gamma / lam traced: one compile for all of them


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.5), (1.0, 0.0)])
def test_gae_matches_numpy_loop(gamma, lam):
    rewards, values, mask = gae_batch(0)
    adv, ret = gae_jit(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam)
    ref_adv, ref_ret = np_gae(rewards.astype(np.float64), values.astype(np.float64), mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-5, atol=1e-6)


def test_gae_ignores_padding_contents_and_has_known_values():
    rewards, values, mask = gae_batch(1)
    r2, v2 = rewards.copy(), values.copy()
    r2[mask == 0] = 1e6
    v2[mask == 0] = np.nan
    a1, _ = gae_jit(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=1.0, lam=0.95)
    a2, ret2 = gae_jit(jnp.asarray(r2), jnp.asarray(v2), jnp.asarray(mask), gamma=1.0, lam=0.95)
    np.testing.assert_array_equal(np.asarray(a1), np.asarray(a2))
    assert np.isfinite(np.asarray(ret2)).all()
    # gamma = lam = 1: A_t = sum_{k >= t} r_k - V_t (Monte-Carlo return minus baseline)
    r = jnp.array([[1.0, 2.0, 3.0, 0.0]])
    v = jnp.array([[0.5, 0.5, 0.5, 9.0]])
    m = jnp.array([[1, 1, 1, 0]])
    a, ret = gae_jit(r, v, m, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(np.asarray(a), [[5.5, 4.5, 2.5, 0.0]])
    np.testing.assert_allclose(np.asarray(ret), [[6.0, 5.0, 3.0, 0.0]])


# --------------------------------------------------------------------------------------- whitening, rewards


def np_masked_whiten(x, m, shift_mean=True):
    v = x[m > 0]
    mean, var = v.mean(), v.var(ddof=1)
    out = (x - mean) / np.sqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return np.where(m > 0, out, 0.0)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten(shift_mean):
    _, values, mask = gae_batch(2)
    x = 3.0 + 2.0 * values
    out = np.asarray(ppo.masked_whiten(jnp.asarray(x), jnp.asarray(mask), shift_mean=shift_mean))
    np.testing.assert_allclose(out, np_masked_whiten(x.astype(np.float64), mask, shift_mean), rtol=1e-5, atol=1e-6)
    sel = out[mask > 0]
    if shift_mean:
        assert abs(sel.mean()) < 1e-5 and abs(sel.std(ddof=1) - 1.0) < 1e-4
    else:  # TRL's reward whitening: unit scale, mean kept
        assert abs(sel.mean() - x[mask > 0].mean()) < 1e-4 and abs(sel.std(ddof=1) - 1.0) < 1e-4


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_rewards(estimator):
    rng = np.random.default_rng(3)
    logp = (-2 + rng.standard_normal((3, 5))).astype(np.float32)
    ref = (logp + 0.5 * rng.standard_normal((3, 5))).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], np.float32)
    scores = np.array([2.0, -1.0, 7.0], np.float32)
    rewards, kl = ppo.kl_penalty_rewards(jnp.asarray(logp), jnp.asarray(ref), jnp.asarray(mask),
                                         jnp.asarray(scores), 0.05, estimator)
    logr = ref.astype(np.float64) - logp
    ref_kl = -logr if estimator == "k1" else np.expm1(logr) - logr
    ref_kl = np.where(mask > 0, ref_kl, 0.0)
    exp = -0.05 * ref_kl
    exp[0, 2] += 2.0  # the score lands on the last completion token
    exp[1, 4] += -1.0  # (an empty completion gets none)
    np.testing.assert_allclose(np.asarray(kl), ref_kl, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(rewards), exp, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_follows_formula():
    ctl = ppo.AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    kls = [2.0, 8.0, 6.0, 30.0, 0.0, 6.6]
    n = 256
    coef, expected = ctl.init(), 0.2
    for k in kls:
        coef = ctl.update(coef, k, n)
        e = min(max(k / 6.0 - 1.0, -0.2), 0.2)
        expected *= 1 + e * n / 10000
        np.testing.assert_allclose(float(coef), expected, rtol=1e-6)
    assert float(coef) != 0.2
    # the same inside a jitted scan
    def body(c, k):
        c = ctl.update(c, k, n)
        return c, c

    final, trace = jax.jit(lambda ks: jax.lax.scan(body, ctl.init(), ks))(jnp.asarray(kls))
    np.testing.assert_allclose(float(final), expected, rtol=1e-6)
    fixed = ppo.FixedKLController(0.05)
    c = fixed.init()
    for k in kls:
        c = fixed.update(c, k, n)
    assert float(c) == pytest.approx(0.05)


# --------------------------------------------------------------------------------------- losses

try:
    import torch
except Exception:  # noqa: BLE001
    torch = None


def loss_batch(seed=0, B=8, T=6):
    rng = np.random.default_rng(seed)
    lengths = np.array([6, 2, 5, 1, 3, 6, 4, 2])[:B]
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    old = (-2 + rng.standard_normal((B, T))).astype(np.float32)
    logp = (old + 0.3 * rng.standard_normal((B, T))).astype(np.float32)
    adv = rng.standard_normal((B, T)).astype(np.float32)
    old_v = rng.standard_normal((B, T)).astype(np.float32)
    values = (old_v + 0.4 * rng.standard_normal((B, T))).astype(np.float32)
    returns = rng.standard_normal((B, T)).astype(np.float32)
    return logp, old, adv, values, old_v, returns, mask


def np_ppo(logp, old, adv, values, old_v, returns, mask, c=0.2, cv=0.2, vf_coef=0.1):
    """docs/design/algorithms.md 2.3: pg = mean_t max(-A rho, -A clip(rho)); vf = 1/2 mean_t max((V-R)^2,
    (clip(V, V_old +- c_v) - R)^2); loss = pg + vf_coef vf (masked means over the batch)."""
    rho = np.exp(logp - old)
    pg = np.maximum(-adv * rho, -adv * np.clip(rho, 1 - c, 1 + c))
    vf = 0.5 * np.maximum((values - returns) ** 2, (np.clip(values, old_v - cv, old_v + cv) - returns) ** 2)
    mm = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    return mm(pg) + vf_coef * mm(vf), mm(pg), mm(vf), pg, vf


@jax.jit
def _ppo_vg(logp, old, adv, values, old_v, returns, mask, norm):
    f = lambda lp, v: ppo.ppo_loss(lp, old, adv, v, old_v, returns, mask, norm, cliprange=0.2,  # noqa: E731
                                   cliprange_value=0.2, vf_coef=0.1)
    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(logp, values)


def test_ppo_loss_matches_numpy_and_torch_autograd():
    b = loss_batch(0)
    norm = grpo.global_normalizers(jnp.asarray(b[-1]))
    (loss, metrics), (g_lp, g_v) = _ppo_vg(*(jnp.asarray(x) for x in b), norm)
    total, pg, vf, pg_tok, vf_tok = np_ppo(*(x.astype(np.float64) for x in b))
    np.testing.assert_allclose(float(loss), total, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["pg_loss"]), pg, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["vf_loss"]), vf, rtol=1e-5)
    logp, old, adv, values, old_v, returns, mask = (x.astype(np.float64) for x in b)
    rho = np.exp(logp - old)
    mm = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    np.testing.assert_allclose(float(metrics["approx_kl"]), mm(0.5 * (logp - old) ** 2), rtol=1e-5)
    clipped_active = -adv * np.clip(rho, 0.8, 1.2) > -adv * rho
    np.testing.assert_allclose(float(metrics["clip_fraction"]), mm(clipped_active), rtol=1e-6)
    vf_clip = (np.clip(values, old_v - 0.2, old_v + 0.2) - returns) ** 2 > (values - returns) ** 2
    np.testing.assert_allclose(float(metrics["vf_clip_fraction"]), mm(vf_clip), rtol=1e-6)
    assert 0 < float(metrics["clip_fraction"]) < 1 and 0 < float(metrics["vf_clip_fraction"]) < 1

    if torch is None:
        pytest.skip("torch not installed")
    t = {k: torch.tensor(x, dtype=torch.float64) for k, x in zip(
        ("logp", "old", "adv", "values", "old_v", "returns", "mask"), b)}
    tlp = t["logp"].clone().requires_grad_(True)
    tv = t["values"].clone().requires_grad_(True)
    ratio = torch.exp(tlp - t["old"])
    pg_t = torch.max(-t["adv"] * ratio, -t["adv"] * torch.clamp(ratio, 0.8, 1.2))
    vclip = torch.clamp(tv, t["old_v"] - 0.2, t["old_v"] + 0.2)
    vf_t = 0.5 * torch.max((tv - t["returns"]) ** 2, (vclip - t["returns"]) ** 2)
    m = t["mask"]
    tl = (pg_t * m).sum() / m.sum() + 0.1 * (vf_t * m).sum() / m.sum()
    tl.backward()
    np.testing.assert_allclose(np.asarray(g_lp), tlp.grad.numpy(), rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(np.asarray(g_v), tv.grad.numpy(), rtol=1e-4, atol=1e-8)


def test_ppo_loss_is_exact_for_micro_batch_splits():
    b = loss_batch(1)
    B = b[0].shape[0]
    norm = grpo.global_normalizers(jnp.asarray(b[-1]))
    full = np_ppo(*(x.astype(np.float64) for x in b))[0]
    grads, mets = {}, {}
    for n_micro in (1, 2, 8):
        size = B // n_micro
        total, gs, ms = 0.0, [], defaultdict(float)
        for k in range(n_micro):
            s = slice(k * size, (k + 1) * size)
            (v, m), (g, _) = _ppo_vg(*(jnp.asarray(x[s]) for x in b), norm)
            total += float(v)
            gs.append(np.asarray(g))
            for key, val in m.items():  # reduced as the train step does: sums, and maxima for `.../max`
                ms[key] = max(ms[key], float(val)) if is_max_metric(key) else ms[key] + float(val)
        np.testing.assert_allclose(total, full, rtol=2e-6, err_msg=f"{n_micro} micro-batches")
        grads[n_micro], mets[n_micro] = np.concatenate(gs), ms
    np.testing.assert_allclose(grads[2], grads[1], rtol=1e-6, atol=1e-10)
    np.testing.assert_allclose(grads[8], grads[1], rtol=1e-6, atol=1e-10)
    for key in mets[1]:
        np.testing.assert_allclose(mets[8][key], mets[1][key], rtol=1e-5, atol=1e-8)


def test_value_loss_and_dual_clip():
    v, vo, r = jnp.array([1.0, 1.0, 0.0]), jnp.array([0.0, 0.9, 0.0]), jnp.array([2.0, 0.0, 1.0])
    # clip(1, -0.2, 0.2) = 0.2: max((1-2)^2, (0.2-2)^2) = 3.24; clip(1, .7, 1.1) = 1: 1; no change: 1
    np.testing.assert_allclose(np.asarray(ppo.value_loss(v, vo, r, 0.2)), [1.62, 0.5, 0.5], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ppo.value_loss(v, vo, r, None)), [0.5, 0.5, 0.5], rtol=1e-6)
    lp = jnp.log(jnp.array([[4.0, 0.5]]))
    pl = ppo.policy_loss(lp, jnp.zeros((1, 2)), jnp.array([[-1.0, 1.0]]), 0.2, dual_clip=3.0)
    np.testing.assert_allclose(np.asarray(pl), [[3.0, -0.5]], rtol=1e-6)


ev_jit = jax.jit(ppo.explained_variance)
entropy_jit = jax.jit(ppo.entropy_from_logits, static_argnames="chunk_size")


def test_explained_variance_and_entropy():
    rng = np.random.default_rng(4)
    ret = rng.standard_normal((4, 5)).astype(np.float32)
    val = (ret + 0.3 * rng.standard_normal((4, 5))).astype(np.float32)
    mask = (rng.random((4, 5)) > 0.3).astype(np.float32)
    ev = float(ev_jit(jnp.asarray(val), jnp.asarray(ret), jnp.asarray(mask)))
    sel = mask > 0
    np.testing.assert_allclose(ev, 1 - np.var(ret[sel] - val[sel], ddof=1) / np.var(ret[sel], ddof=1), rtol=1e-5)
    assert float(ev_jit(jnp.asarray(ret), jnp.asarray(ret), jnp.asarray(mask))) == pytest.approx(1)
    assert float(ev_jit(jnp.zeros((2, 3)), jnp.ones((2, 3)), jnp.ones((2, 3)))) == 0.0

    logits = (3 * rng.standard_normal((2, 3, 11))).astype(np.float32)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ent = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(np.asarray(entropy_jit(jnp.asarray(logits))), ent, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy_jit(jnp.asarray(logits), chunk_size=4)), ent,
                               rtol=1e-5)
    uniform = entropy_jit(jnp.zeros((1, 7)))
    np.testing.assert_allclose(np.asarray(uniform), [np.log(7)], rtol=1e-6)
