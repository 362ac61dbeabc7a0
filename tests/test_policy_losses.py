"""The policy losses (jaxrl/algorithms/policy_loss.py) against the peer's formulas: verl's
`verl/trainer/ppo/core_algos.py` at commit b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29): `vanilla` (line
1160), `gspo` (1254), `sapo` (1330), `clip_cov` (1451), `kl_cov` (1556), `geo_mean` (1636), `cispo` (1722) and
`agg_loss` (1025). Each reference below is the published formula written out in float64 torch from that file
(not imported: verl is not a dependency); the loss value after aggregation and its gradient with respect to the
policy log-probs must agree within 1e-6 (relative), on random rows with one fully masked, and with behaviour
weights. Two regimes: moderate ratios with verl's own clamps (which then do not bind), and extreme ratios (log-ratios
up to +-80), where the reference takes jaxrl's two-sided clamp at 20 (verl clamps gspo at 10 above only and leaves
geo_mean, kl_cov and clip_cov unclamped, where such ratios give inf) and ours must stay finite, value and gradient.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl.algorithms import grpo
from jaxrl.algorithms import policy_loss as pl

B, T = 5, 7


def batch(seed: int, extreme: bool, token_advantages: bool = False):
    rng = np.random.default_rng(seed)
    logp = -1.5 + 0.8 * rng.standard_normal((B, T))
    scale = 0.3 if not extreme else 1.0
    lr = scale * rng.standard_normal((B, T))
    if extreme:
        lr[0, :3] = [80.0, -80.0, 30.0]
        lr[2, 1:4] = [-35.0, 25.0, 60.0]
        lr[3] = 40.0  # a whole sequence far off: the sequence-level ratios leave the window too
    old = logp - lr
    mask = (rng.random((B, T)) > 0.2).astype(np.float64)
    mask[1] = 0.0  # a fully masked row
    mask[0, :3] = 1.0
    mask[3, :] = 1.0
    adv = rng.standard_normal((B, T) if token_advantages else (B,))
    weights = np.exp(0.2 * rng.standard_normal((B, T)))
    return logp, old, adv, mask, weights


# ----------------------------------------------------------------------------------------- verl's formulas (torch)


def masked_mean(x, m):
    return (x * m).sum() / m.sum()


def agg(loss, m, mode):
    """verl agg_loss: token-mean | seq-mean-token-mean (rows with no token left out) | mean (geo_mean's)."""
    if mode == "token-mean":
        return (loss * m).sum() / m.sum()
    if mode == "seq-mean-token-mean":
        n = m.sum(-1)
        per_seq = (loss * m).sum(-1) / (n + 1e-8)
        seq = (n > 0).double()
        return (per_seq * seq).sum() / seq.sum()
    assert mode == "mean"
    return loss.mean()


def per_token_adv(adv, like):
    return adv[:, None].expand_as(like) if adv.dim() == 1 else adv


def verl_vanilla(logp, old, adv, m, w, o, clamp):
    adv = per_token_adv(adv, logp)
    ratio = torch.exp(torch.clamp(logp - old, -clamp, clamp))
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - o["epsilon_low"], 1 + o["epsilon_high"])
    clipped = torch.maximum(l1, l2)
    if o.get("dual_clip"):
        clipped = torch.where(adv < 0, torch.minimum(-adv * o["dual_clip"], clipped), clipped)
    return agg(clipped * w, m, "token-mean")


def verl_gspo(logp, old, adv, m, w, o, clamp):
    adv = per_token_adv(adv, logp)
    seq = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = logp - logp.detach() + seq.detach()[:, None]
    log_s = torch.clamp(log_s, max=10.0) if clamp is None else torch.clamp(log_s, -clamp, clamp)
    s = torch.exp(log_s)
    loss = torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - o["epsilon_low"], 1 + o["epsilon_high"]))
    return agg(loss * w, m, "seq-mean-token-mean")


def verl_sapo(logp, old, adv, m, w, o, clamp):
    adv = per_token_adv(adv, logp)
    ratio = torch.exp(torch.clamp(logp - old, -clamp, clamp))
    tau = torch.where(adv > 0, torch.tensor(o["tau_pos"], dtype=adv.dtype), torch.tensor(o["tau_neg"],
                                                                                          dtype=adv.dtype))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return agg(-gate * adv * w, m, "seq-mean-token-mean")


def verl_cispo(logp, old, adv, m, w, o, clamp):
    adv = per_token_adv(adv, logp)
    ratio = torch.exp(torch.clamp(logp - old, -clamp, clamp))
    c = torch.clamp(ratio, 1 - o["epsilon_low"], 1 + o["epsilon_high"]).detach()
    return agg(-c * adv * logp * w, m, "token-mean")


def verl_geo_mean(logp, old, adv, m, w, o, clamp):
    adv = per_token_adv(adv, logp)
    nkl = logp - old
    if clamp is not None:
        nkl = torch.clamp(nkl, -clamp, clamp)
    sgn = torch.sign(adv)
    nkl_clamp = torch.clamp(nkl, -o["epsilon_low"], o["epsilon_high"])
    nkl_min = sgn * torch.minimum(sgn * nkl, sgn * nkl_clamp)
    n = m.sum(-1)
    ratio = torch.exp((nkl_min * m).sum(-1) / (n + 1e-8))
    a = (adv * m).sum(-1) / (n + 1e-8)
    loss = -a * ratio
    loss = loss * torch.exp((torch.log(w + 1e-10) * m).sum(-1) / (n + 1e-8))
    return agg(loss, m, "mean")


def verl_kl_cov(logp, old, adv, m, w, o, clamp):
    adv = per_token_adv(adv, logp)
    nkl = logp - old
    if clamp is not None:
        nkl = torch.clamp(nkl, -clamp, clamp)
    ratio = torch.exp(nkl)
    loss = -adv * ratio
    loss_kl = -adv * ratio + o["kl_cov_coef"] * nkl.abs()
    valid = m > 0
    idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv[valid].detach(), logp[valid].detach()
    cov = (a - a.mean()) * (lp - lp.mean())
    k = max(1, int(len(cov) * o["kl_cov_ratio"]))
    top = idx[torch.topk(cov, k).indices]
    flat = loss.reshape(-1).clone()
    flat[top] = loss_kl.reshape(-1)[top]
    return agg(flat.reshape(loss.shape) * w, m, "token-mean")


def verl_clip_cov_candidates(logp, old, adv, m, o, clamp):
    """The tokens verl's clip_cov may detach (it then draws min(k, n) of them with torch.randperm), and k."""
    adv = per_token_adv(adv, logp)
    nkl = logp - old
    if clamp is not None:
        nkl = torch.clamp(nkl, -clamp, clamp)
    ratio = torch.exp(nkl)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - o["epsilon_low"], 1 + o["epsilon_high"])
    by_clip = (l2 > l1) & (m > 0)
    cov = (adv - masked_mean(adv, m)) * (logp.detach() - masked_mean(logp.detach(), m))
    eligible = (cov < o["clip_cov_ub"]) & (cov > o["clip_cov_lb"]) & (m > 0) & ~by_clip
    return eligible, max(int(o["clip_cov_ratio"] * m.sum().item()), 1)


def verl_clip_cov(logp, old, adv, m, w, o, clamp, corr):
    adv = per_token_adv(adv, logp)
    nkl = logp - old
    if clamp is not None:
        nkl = torch.clamp(nkl, -clamp, clamp)
    ratio = torch.exp(nkl)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - o["epsilon_low"], 1 + o["epsilon_high"])
    return agg(torch.maximum(l1, l2) * corr * w, m, "token-mean")


# ----------------------------------------------------------------------------------------- ours


AGGREGATION = {"ppo_clip": "token_mean", "gspo": "sequence_mean", "sapo": "sequence_mean", "cispo": "token_mean",
               "gmpo": "sequence_mean", "kl_cov": "token_mean", "clip_cov": "token_mean"}


@functools.lru_cache(maxsize=None)
def _program(name, options, rows_counted: bool):
    """One jitted (value, grad, terms) program per loss and options (the inputs are arguments: every seed and
    regime of a case shares it)."""

    def f(lp, old, adv, m, weights, rng):
        x = pl.PolicyLossInputs(lp, old, adv, m, weights, rng)
        terms = pl.policy_loss_terms(name, x, options if not isinstance(options, tuple) else dict(options))
        norm = grpo.global_normalizers(m, sequence_mask=m.max(-1) if rows_counted else None)
        w = grpo.token_weights(m, AGGREGATION.get(name, "token_mean"), norm)
        return grpo.aggregate_loss(jnp.broadcast_to(terms.loss, w.shape), w), terms

    return jax.jit(jax.value_and_grad(f, has_aux=True))


def ours(name, options, logp, old, adv, mask, weights, rng=None):
    """(loss, d loss / d logp, the terms) of jaxrl's loss aggregated as verl's (gmpo: every row counts; the other
    sequence means leave rows with no token out)."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    key = tuple(sorted(options.items())) if isinstance(options, dict) else options  # a plug-in's dict: hashable
    program = _program(name, key, name != "gmpo")
    (value, terms), g = program(f32(logp), f32(old), f32(adv), f32(mask), f32(weights),
                                jax.random.PRNGKey(0) if rng is None else rng)
    return float(value), np.asarray(g), terms


def reference(fn, logp, old, adv, mask, weights, o, clamp, **kw):
    t = lambda a: torch.tensor(np.asarray(a, np.float64))  # noqa: E731
    # the float32 inputs ours sees, widened: the comparison is of the formulas, not of the input rounding
    lp = t(np.float32(logp)).requires_grad_(True)
    value = fn(lp, t(np.float32(old)), t(np.float32(adv)), t(mask), t(np.float32(weights)), o, clamp, **kw)
    value.backward()
    return float(value.detach()), lp.grad.numpy()


COMMON = {"epsilon_low": 0.2, "epsilon_high": 0.28, "delta": None, "dual_clip": None, "log_ratio_clamp": 20.0,
          "importance_sampling_level": "token"}

CASES = [  # (our name, its options, verl's formula, verl's own clamp in the moderate regime)
    ("ppo_clip", {}, verl_vanilla, 20.0),
    ("ppo_clip", {"dual_clip": 3.0}, verl_vanilla, 20.0),
    ("gspo", {}, verl_gspo, None),
    ("cispo", {}, verl_cispo, 20.0),
    ("sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, verl_sapo, 20.0),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 0.5}, verl_sapo, 20.0),
    ("gmpo", {}, verl_geo_mean, None),
    ("kl_cov", {"kl_cov_ratio": 0.2, "kl_cov_coef": 0.1}, verl_kl_cov, None),
    ("kl_cov", {}, verl_kl_cov, None),
]


def close(a, b, what):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * max(1.0, float(np.max(np.abs(b)))), err_msg=what)


@pytest.mark.parametrize("extreme", [False, True], ids=["moderate", "extreme"])
@pytest.mark.parametrize("token_advantages", [False, True], ids=["seq_adv", "token_adv"])
@pytest.mark.parametrize("name,own,fn,verl_clamp", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_loss_equals_verls_formula_value_and_gradient(name, own, fn, verl_clamp, extreme, token_advantages):
    options = pl.resolve_options(name, {**COMMON, **{k: v for k, v in own.items() if k in pl.COMMON_KEYS}},
                                 {k: v for k, v in own.items() if k not in pl.COMMON_KEYS}, "grpo")
    o = {**COMMON, **dataclasses.asdict(options)}  # the options' defaults are verl's actor defaults
    for seed in range(3):
        logp, old, adv, mask, weights = batch(seed, extreme, token_advantages)
        value, grad, _ = ours(name, options, logp, old, adv, mask, weights)
        assert np.isfinite(value) and np.all(np.isfinite(grad)), (name, seed)
        ref_value, ref_grad = reference(fn, logp, old, adv, mask, weights, o, 20.0 if extreme else verl_clamp)
        close(value, ref_value, f"{name} value, seed {seed}")
        close(grad, ref_grad * (mask > 0), f"{name} gradient, seed {seed}")


@pytest.mark.parametrize("extreme", [False, True], ids=["moderate", "extreme"])
def test_clip_cov_detaches_a_random_draw_of_verls_candidates_and_equals_its_formula(extreme):
    o = {**COMMON, "clip_cov_ratio": 0.1, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0}
    options = pl.resolve_options("clip_cov", COMMON, {k: o[k] for k in ("clip_cov_ratio", "clip_cov_lb",
                                                                           "clip_cov_ub")}, "grpo")
    draws = set()
    for seed in range(4):
        logp, old, adv, mask, weights = batch(seed, extreme)
        t = lambda a: torch.tensor(np.asarray(np.float32(a), np.float64))  # noqa: E731
        eligible, k = verl_clip_cov_candidates(t(logp), t(old), t(adv), torch.tensor(mask), o, 20.0)
        for key in range(3):
            value, grad, terms = ours("clip_cov", options, logp, old, adv, mask, weights, jax.random.PRNGKey(key))
            detached = np.asarray(terms.metrics["clip_cov/detached"]) > 0
            assert not np.any(detached & ~eligible.numpy()), "detached a token verl would not"
            assert detached.sum() == min(k, int(eligible.sum())), (detached.sum(), k, int(eligible.sum()))
            draws.add(tuple(np.flatnonzero(detached)))
            corr = torch.tensor((~detached).astype(np.float64))
            ref_value, ref_grad = reference(verl_clip_cov, logp, old, adv, mask, weights, o, 20.0, corr=corr)
            assert np.isfinite(value) and np.all(np.isfinite(grad))
            close(value, ref_value, f"clip_cov value, seed {seed}")
            close(grad, ref_grad * (mask > 0), f"clip_cov gradient, seed {seed}")
    assert len(draws) > 2  # the draw follows the key


def test_ppo_clip_is_todays_surrogate_bit_for_bit():
    """The default loss is the clipped surrogate GRPO and PPO computed before the registry, op for op."""
    logp, old, adv, mask, weights = batch(0, True)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    for level in ("token", "sequence"):
        options = pl.resolve_options("ppo_clip", {**COMMON, "delta": 4.0, "importance_sampling_level": level}, {},
                                     "grpo")
        terms = pl.ppo_clip(pl.PolicyLossInputs(f32(logp), f32(old), f32(adv), f32(mask), f32(weights)), options)
        log_w = pl.importance_log_weights(f32(logp), f32(old), f32(mask), level)
        want = pl.clipped_surrogate(log_w, f32(adv), 0.2, 0.28, 4.0, log_ratio_clamp=20.0) * f32(weights)
        assert np.array_equal(np.asarray(terms.loss), np.asarray(want))


@pytest.mark.parametrize("name", sorted(AGGREGATION))
def test_every_loss_is_finite_at_any_ratio_and_on_all_masked_rows(name):
    """Log-ratios from -1e4 to 1e4 (and a micro-batch with no loss token at all): value, gradient and metrics are
    finite."""
    options = pl.resolve_options(name, COMMON, {}, "grpo")
    lr = np.linspace(-1e4, 1e4, B * T).reshape(B, T)
    logp = np.full((B, T), -2.0)
    adv = np.array([1.0, -1.0, 0.0, 3.0, -2.0])
    for mask in (np.ones((B, T)), np.zeros((B, T))):
        value, grad, terms = ours(name, options, logp, logp - lr, adv, mask, np.ones((B, T)),
                                  jax.random.PRNGKey(0))
        assert np.isfinite(value) and np.all(np.isfinite(grad)), name
        for k, v in terms.metrics.items():
            assert np.all(np.isfinite(np.asarray(v))), (name, k)
        if not mask.any():
            assert value == 0.0 and not np.any(grad)


def test_options_are_checked_naming_the_key():
    with pytest.raises(ValueError, match=r"grpo.policy_loss_options: sapo takes no 'tau'; its options: tau_neg, "
                                         r"tau_pos"):
        pl.resolve_options("sapo", COMMON, {"tau": 1.0}, "grpo")
    with pytest.raises(ValueError, match=r"grpo.policy_loss_options sets \['epsilon_high'\]: set grpo.epsilon_high"):
        pl.resolve_options("cispo", COMMON, {"epsilon_high": 0.3}, "grpo")
    with pytest.raises(ValueError, match=r"grpo.policy_loss='cispo' does not read grpo.delta"):
        pl.resolve_options("cispo", {**COMMON, "delta": 4.0}, {}, "grpo")
    with pytest.raises(ValueError, match=r"ppo.policy_loss='sapo' does not read ppo.importance_sampling_level"):
        pl.resolve_options("sapo", {**COMMON, "importance_sampling_level": "sequence"}, {}, "ppo")
    with pytest.raises(ValueError, match=r"tau_pos=-1.0 and tau_neg=1.05 must be > 0"):
        pl.resolve_options("sapo", COMMON, {"tau_pos": -1.0}, "grpo")
    with pytest.raises(ValueError, match=r"grpo.policy_loss_options.kl_cov_coef='0.1': kl_cov's options are finite "
                                         r"numbers"):
        pl.resolve_options("kl_cov", COMMON, {"kl_cov_coef": "0.1"}, "grpo")
    with pytest.raises(ValueError, match=r"grpo.policy_loss_options.tau_neg=nan"):
        pl.resolve_options("sapo", COMMON, {"tau_neg": float("nan")}, "grpo")
    with pytest.raises(KeyError, match=r"unknown policy_loss 'cipso' \(did you mean 'cispo'\?\)"):
        pl.resolve_options("cipso", COMMON, {}, "grpo")


# ----------------------------------------------------------------------------------------- PPO, plug-ins, configs


@pytest.mark.parametrize("name", sorted(AGGREGATION))
def test_ppo_trains_its_value_head_beside_any_policy_loss(name):
    """ppo_loss with each policy term: finite loss, gradients into the log-probs and the values, PPO's metrics
    (clip_fraction only where the loss has a clip)."""
    from jaxrl.algorithms import ppo

    logp, old, adv, mask, weights = batch(1, False, token_advantages=True)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    values = f32(np.linspace(-1, 1, B * T).reshape(B, T))
    options = pl.resolve_options(name, {**COMMON, "epsilon_high": 0.2}, {}, "ppo")

    def f(lp, v):
        return ppo.ppo_loss(lp, f32(old), f32(adv), v, values + 0.1, values - 0.5, f32(mask),
                            grpo.global_normalizers(f32(mask)),
                            sampling_weights=f32(weights), policy_loss=name, policy_loss_options=options,
                            rng=jax.random.PRNGKey(0))

    (loss, metrics), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(f32(logp), values)
    assert np.isfinite(float(loss)) and all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    assert np.any(np.asarray(grads[0])) and np.any(np.asarray(grads[1]))
    assert {"pg_loss", "vf_loss", "approx_kl", "ratio", "ratio/max"} <= set(metrics)
    assert ("clip_fraction" in metrics) == (name in ("ppo_clip", "gspo", "cispo", "clip_cov"))


PLUGIN = '''
import jax.numpy as jnp


def reinforce(x, options):
    """plain REINFORCE on the behaviour weights: -A w logp"""
    a = x.advantages[:, None] if x.advantages.ndim == 1 else x.advantages
    w = 1.0 if x.weights is None else x.weights
    return -a * w * x.logp, {"ratio": jnp.exp(x.logp - x.old_logp)}


def wrong_shape(x, options):
    return jnp.sum(x.logp), {}
'''


def test_a_policy_loss_plugin_is_checked_and_used_by_name_and_a_malformed_one_is_refused(tmp_path):
    from jaxrl.algorithms import plugins

    path = tmp_path / "my_losses.py"
    path.write_text(PLUGIN)
    try:
        plugins.load("policy_loss", f"{path}:reinforce")
        options = pl.resolve_options("reinforce", COMMON, {"scale": 2.0}, "grpo")
        assert options == {**COMMON, "scale": 2.0}  # a plug-in gets the clip keys and its own, as a dict
        logp, old, adv, mask, weights = batch(0, False)
        value, grad, terms = ours("reinforce", options, logp, old, adv, mask, weights)
        assert np.isfinite(value) and set(terms.metrics) == {"ratio"}
        with pytest.raises(plugins.PluginError, match=r"policy_loss plug-in 'wrong_shape' .*: returned a loss of "
                                                       r"shape \(\); expected \(3, 5\) or \(3, 1\)"):
            plugins.load("policy_loss", f"{path}:wrong_shape")
        assert "wrong_shape" not in plugins.names("policy_loss")
    finally:
        plugins.unregister("policy_loss", "reinforce")


def test_an_unknown_policy_loss_or_option_is_refused_before_any_model_loads(tmp_path):
    from conftest import tiny_config
    from jaxrl.algorithms.run import run_training

    cfg = tiny_config("grpo", policy_loss="cipso")
    with pytest.raises(ValueError, match=r"^grpo.policy_loss: unknown policy_loss 'cipso' \(did you mean "
                                         r"'cispo'\?\)"):
        run_training(cfg, str(tmp_path / "a"))
    cfg = tiny_config("ppo", policy_loss="sapo", policy_loss_options={"tau_pos": 1.0, "tua_neg": 2.0})
    with pytest.raises(ValueError, match=r"^ppo.policy_loss_options: sapo takes no 'tua_neg'"):
        run_training(cfg, str(tmp_path / "b"))
    assert not (tmp_path / "a" / "checkpoints").exists() and not (tmp_path / "b" / "checkpoints").exists()


@pytest.mark.heavy  # two short GRPO runs on the tiny model
def test_a_users_policy_loss_file_and_one_config_line_train(tmp_path):
    from conftest import tiny_config
    from jaxrl.algorithms.run import run_training

    path = tmp_path / "my_losses.py"
    path.write_text(PLUGIN)
    cfg = tiny_config("grpo", policy_loss="reinforce", num_iterations=2)
    cfg.plugins = ({"kind": "policy_loss", "name": "reinforce", "path": f"{path}:reinforce"},)
    cfg.steps = 4
    from jaxrl.algorithms import plugins
    try:
        records = run_training(cfg, str(tmp_path / "run")).records
    finally:
        plugins.unregister("policy_loss", "reinforce")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["update_skipped"] == 0 and np.isfinite(r["loss"]) for r in records)
    assert all("clip_fraction/region" not in r for r in records) and all("ratio" in r for r in records)
