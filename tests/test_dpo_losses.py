"""DPO-family losses against (a) float64 numpy transcriptions of docs/design/algorithms.md 2.1 with finite-difference
gradients, and (b) TRL 1.16's own code (DPOTrainer._compute_loss, CPOTrainer.cpo_loss) run through torch autograd.

TRL's loss code is a trainer method; it only reads a handful of attributes of ``self`` and the model's fused-head
outputs, so a SimpleNamespace standing in for the trainer and a callable returning per-token log-probs exercise the
real TRL lines without building a model or a dataset.

f-divergence scores: TRL 1.16 uses the f(0)=0 normalisation (forward_kl 1-exp(-r), js log2+log sig(r), alpha
(exp((a-1)r)-1)/(a-1)); docs/design/algorithms.md lists the same functions without the constants. The constants cancel in
delta = s_w - s_l but not in the length-normalised losses (ipo, sigmoid_norm), so we follow TRL 1.16 and the
references below do too.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algorithms import dpo

# --------------------------------------------------------------------------------------- numpy references (float64)


def logsig(x):
    return -np.logaddexp(0.0, -x)


def sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_scores(r, f="reverse_kl", alpha=0.5):
    if f == "reverse_kl":
        return r
    if f == "forward_kl":
        return 1.0 - np.exp(-r)
    if f == "js_divergence":
        return math.log(2.0) + logsig(r)
    if f == "alpha_divergence":
        return (np.exp(np.minimum((alpha - 1) * r, 80.0)) - 1.0) / (alpha - 1)
    raise ValueError(f)


def np_loss(name, cl, rl, rcl, rrl, lw, ll, beta, eps, gamma=0.5, tau=0.05, f="reverse_kl", alpha=0.5):
    """docs/design/algorithms.md 2.1, one line per loss_type."""
    rw, rr = cl - rcl, rl - rrl
    sw, sl = np_scores(rw, f, alpha), np_scores(rr, f, alpha)
    D = sw - sl
    z = beta * D
    lw, ll = np.maximum(lw, 1.0), np.maximum(ll, 1.0)
    if name == "sigmoid":
        return -logsig(z)
    if name == "hinge":
        return np.maximum(0.0, 1.0 - z)
    if name == "ipo":
        return (sw / lw - sl / ll - 1.0 / (2 * beta)) ** 2
    if name == "exo_pair":
        return sig(z) * (logsig(z) - np.log(1 - eps)) + sig(-z) * (logsig(-z) - np.log(eps))
    if name == "nca_pair":
        return -logsig(beta * rw) - 0.5 * logsig(-beta * rw) - 0.5 * logsig(-beta * rr)
    if name == "robust":
        return (-(1 - eps) * logsig(z) + eps * logsig(-z)) / (1 - 2 * eps)
    if name == "bco_pair":
        return -logsig(beta * rw) - logsig(-beta * rr)
    if name == "sppo_hard":
        return (rw - 1 / (2 * beta)) ** 2 + (rr + 1 / (2 * beta)) ** 2
    if name == "aot":
        d = np.sort(cl - rl) - np.sort(rcl - rrl)
        return -(1 - eps) * logsig(beta * d) - eps * logsig(-beta * d)
    if name == "aot_unpaired":
        d = np.sort(rw) - np.sort(rr)
        return -(1 - eps) * logsig(beta * d) - eps * logsig(-beta * d)
    if name == "apo_zero":
        return (1 - sig(beta * rw)) + sig(beta * rr)
    if name == "apo_down":
        return sig(beta * rw) + (1 - sig(beta * (rw - rr)))
    if name == "discopop":
        g = sig(z / tau)
        return (1 - g) * (-logsig(z)) + g * np.exp(-z)
    if name == "sigmoid_norm":
        return -logsig(beta * (sw / lw - sl / ll))
    if name == "simpo":
        u = cl / lw - rl / ll - gamma / beta
        return -(1 - eps) * logsig(beta * u) - eps * logsig(-beta * u)
    raise ValueError(name)


ALL = [
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sigmoid_norm", "simpo",
]
SMOOTHED = {"exo_pair", "robust", "aot", "aot_unpaired", "simpo"}
B = 6
BETA = 0.3


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    cl = -20.0 + 5.0 * rng.standard_normal(B)
    rl = -22.0 + 5.0 * rng.standard_normal(B)
    rcl = cl + 3.0 * rng.standard_normal(B)
    rrl = rl + 3.0 * rng.standard_normal(B)
    lw = rng.integers(1, 20, B).astype(np.float64)
    ll = rng.integers(1, 20, B).astype(np.float64)
    # float32-representable, so numpy and jax see identical inputs
    return [np.float32(a).astype(np.float64) for a in (cl, rl, rcl, rrl, lw, ll)]


def interface_eps(name):
    return 0.1 if name in SMOOTHED else 0.0


def test_sigmoid_identical_policy_and_reference_is_log2():
    x = jnp.array([-3.0, -40.0, -7.5, 0.0])
    y = jnp.array([-5.0, -2.0, -11.0, -1.0])
    out = dpo.dpo_loss(x, y, x, y, loss_type="sigmoid", beta=0.1)
    np.testing.assert_allclose(np.asarray(out), np.full(4, math.log(2.0)), rtol=1e-7)
    assert out.shape == (4,) and out.dtype == jnp.float32


@pytest.mark.parametrize("name", ALL)
def test_values_and_gradients_match_numpy_reference(name):
    cl, rl, rcl, rrl, lw, ll = make_batch(1)
    eps = interface_eps(name)
    kw = dict(loss_type=name, beta=BETA, label_smoothing=eps, chosen_lengths=lw, rejected_lengths=ll, gamma=0.7)
    # Eager on purpose: every case has the same shapes, so after the first one the primitives are compiled.
    fn = lambda c, r: dpo.dpo_loss(c, r, jnp.asarray(rcl), jnp.asarray(rrl), **kw)  # noqa: E731
    out = np.asarray(fn(jnp.asarray(cl, jnp.float32), jnp.asarray(rl, jnp.float32)))
    ref = np_loss(name, cl, rl, rcl, rrl, lw, ll, BETA, eps, gamma=0.7)
    assert out.shape == (B,)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)

    # Gradient of the summed loss w.r.t. the policy log-probs, vs central differences of the numpy reference.
    gc, gr = jax.grad(lambda c, r: jnp.sum(fn(c, r)), argnums=(0, 1))(
        jnp.asarray(cl, jnp.float32), jnp.asarray(rl, jnp.float32)
    )
    h = 1e-5
    for which, g in (("c", gc), ("r", gr)):
        fd = np.zeros(B)
        for i in range(B):
            e = np.zeros(B)
            e[i] = h
            a = (cl + e, rl) if which == "c" else (cl, rl + e)
            b = (cl - e, rl) if which == "c" else (cl, rl - e)
            fd[i] = (np_loss(name, *a, rcl, rrl, lw, ll, BETA, eps, 0.7).sum()
                     - np_loss(name, *b, rcl, rrl, lw, ll, BETA, eps, 0.7).sum()) / (2 * h)
        np.testing.assert_allclose(np.asarray(g), fd, rtol=2e-4, atol=2e-5, err_msg=f"{name} d/d{which}")
    assert np.abs(np.asarray(gc)).max() > 1e-4  # the loss does depend on the policy


@pytest.mark.parametrize("name", ["sigmoid", "ipo", "aot", "simpo"])
def test_jit_equals_eager(name):
    cl, rl, rcl, rrl, lw, ll = make_batch(11)
    args = (cl, rl, rcl, rrl)
    kw = dict(loss_type=name, beta=BETA, label_smoothing=interface_eps(name), chosen_lengths=lw, rejected_lengths=ll)
    eager = dpo.dpo_loss(*args, **kw)
    jitted = jax.jit(lambda *a: dpo.dpo_loss(*a, **kw))(*args)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6)


F_CASES = [
    (f, n)
    for f in ("forward_kl", "js_divergence", "alpha_divergence")
    for n in ("sigmoid", "hinge", "ipo", "exo_pair", "robust", "discopop", "sigmoid_norm")
]


@pytest.mark.parametrize("f,name", F_CASES)
def test_f_divergence_values_match_numpy(f, name):
    cl, rl, rcl, rrl, lw, ll = make_batch(2)
    eps = interface_eps(name)
    out = dpo.dpo_loss(cl, rl, rcl, rrl, name, BETA, eps, lw, ll, f_divergence=f, f_alpha=0.3)
    ref = np_loss(name, cl, rl, rcl, rrl, lw, ll, BETA, eps, f=f, alpha=0.3)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=3e-5, atol=3e-6)
    # and it is a different loss from reverse KL
    plain = np_loss(name, cl, rl, rcl, rrl, lw, ll, BETA, eps)
    assert np.abs(ref - plain).max() > 1e-3


def test_alpha_divergence_at_one_is_reverse_kl():
    cl, rl, rcl, rrl, lw, ll = make_batch(3)
    a = dpo.dpo_loss(cl, rl, rcl, rrl, "sigmoid", f_divergence="alpha_divergence", f_alpha=1.0)
    b = dpo.dpo_loss(cl, rl, rcl, rrl, "sigmoid")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-7)


def test_argument_checks():
    x = jnp.zeros(3)
    with pytest.raises(ValueError, match="exo_pair needs 0 < label_smoothing"):
        dpo.dpo_loss(x, x, x, x, "exo_pair", label_smoothing=0.0)
    with pytest.raises(ValueError, match="robust needs"):
        dpo.dpo_loss(x, x, x, x, "robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="not valid for loss_type='nca_pair'"):
        dpo.dpo_loss(x, x, x, x, "nca_pair", f_divergence="forward_kl")
    with pytest.raises(ValueError, match="pass chosen_lengths"):
        dpo.dpo_loss(x, x, x, x, "ipo")
    with pytest.raises(ValueError, match="needs ref_chosen_logps"):
        dpo.dpo_loss(x, x, None, None, "sigmoid")
    with pytest.raises(ValueError, match="combined_dpo_loss"):
        dpo.dpo_loss(x, x, x, x, "sft")
    with pytest.raises(KeyError, match="unknown dpo_loss 'nope'"):
        dpo.dpo_loss(x, x, x, x, "nope")
    with pytest.warns(UserWarning, match="ignored by loss_type='sigmoid'"):
        dpo.dpo_loss(x, x, x, x, "sigmoid", label_smoothing=0.1)
    # simpo is reference-free: the refs are ignored, None is fine.
    a = dpo.dpo_loss(x - 1, x - 2, None, None, "simpo", chosen_lengths=x + 2, rejected_lengths=x + 2)
    b = dpo.dpo_loss(x - 1, x - 2, x + 5, x - 9, "simpo", chosen_lengths=x + 2, rejected_lengths=x + 2)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_builtin_losses_register_what_they_read():
    """Each built-in registers with the LossSpec that the argument checks and the DPO trainer read: f-divergences
    only where the log Z term cancels in delta, reference-free only simpo, lengths for the length-normalised ones,
    pair coupling for aot*."""
    def having(field):
        return sorted(n for n in dpo.LOSS_TYPES if getattr(dpo.loss_spec(n), field))

    assert having("f_divergence") == ["discopop", "exo_pair", "hinge", "ipo", "robust", "sigmoid", "sigmoid_norm"]
    assert having("reference_free") == ["simpo"]
    assert having("needs_lengths") == ["ipo", "sigmoid_norm", "simpo"]
    assert having("across_pairs") == ["aot", "aot_unpaired"]
    assert having("label_smoothing") == ["aot", "aot_unpaired", "exo_pair", "robust", "simpo"]
    assert not hasattr(dpo, "register_loss")  # a user's loss goes through jaxrl.algorithms.plugins


def test_metric_helpers():
    c, r = jnp.array([-10.0, -10.0, -4.0]), jnp.array([-12.0, -9.0, -4.0])
    rc, rr = jnp.array([-11.0, -10.0, -4.0]), jnp.array([-11.0, -10.0, -4.0])
    np.testing.assert_allclose(np.asarray(dpo.chosen_rewards(c, rc, 0.5)), [0.5, 0.0, 0.0])
    np.testing.assert_allclose(np.asarray(dpo.rejected_rewards(r, rr, 0.5)), [-0.5, 0.5, 0.0])
    np.testing.assert_allclose(np.asarray(dpo.reward_margin(c, r, rc, rr, 0.5)), [1.0, -0.5, 0.0])
    # a tie is not a correct preference
    np.testing.assert_array_equal(np.asarray(dpo.preference_accuracy(c, r, rc, rr, 0.5)), [1.0, 0.0, 0.0])


# --------------------------------------------------------------------------------------- per-token batches


def token_batch(seed=0, Bp=4, T=9):
    rng = np.random.default_rng(seed)
    lc = rng.integers(2, T + 1, Bp)
    lr = rng.integers(1, T + 1, Bp)
    cm = (np.arange(T)[None] < lc[:, None]).astype(np.float32)
    rm = (np.arange(T)[None] < lr[:, None]).astype(np.float32)
    ct = (-2.0 + 0.7 * rng.standard_normal((Bp, T))).astype(np.float32)
    rt = (-2.3 + 0.7 * rng.standard_normal((Bp, T))).astype(np.float32)
    ref_c = ((ct * cm).sum(1) + 2.0 * rng.standard_normal(Bp)).astype(np.float32)
    ref_r = ((rt * rm).sum(1) + 2.0 * rng.standard_normal(Bp)).astype(np.float32)
    return ct, cm, rt, rm, ref_c, ref_r


def jax_combined(ct, cm, rt, rm, ref_c, ref_r, loss_types, weights, **kw):
    """(loss, dloss/dchosen_token_logps, dloss/drejected_token_logps). Eager: the tests calling it share shapes,
    so eager dispatch reuses compiled primitives instead of compiling one program per loss type."""

    def f(ct_, rt_, cm_, rm_, ref_c_, ref_r_):
        inp = dpo.DPOInputs(ct_, cm_, rt_, rm_, ref_c_, ref_r_)
        return dpo.combined_dpo_loss(inp, loss_types, weights, **kw)[0]

    vg = jax.value_and_grad(f, argnums=(0, 1))
    val, (gc, gr) = vg(*(jnp.asarray(a) for a in (ct, rt, cm, rm, ref_c, ref_r)))
    return float(val), np.asarray(gc), np.asarray(gr)



# --------------------------------------------------------------------------------------- TRL's own code

# The test extra installs torch + trl; without them only the TRL comparisons are skipped. With both present a
# failing import is an error, never a silent skip.
if importlib.util.find_spec("torch") and importlib.util.find_spec("trl"):
    import torch
    from trl.experimental.cpo import cpo_trainer as cpo_mod
    from trl.trainer import dpo_trainer as trl_dpo
else:
    trl_dpo = None
needs_trl = pytest.mark.skipif(trl_dpo is None, reason="torch/trl not installed")


def trl_combined(ct, cm, rt, rm, ref_c, ref_r, loss_types, weights, beta, eps, f="reverse_kl", alpha=0.5, tau=0.05):
    """Runs TRL's DPOTrainer._compute_loss on the given per-token log-probs; returns (loss, dL/dct, dL/drt)."""
    Bp, T = ct.shape
    lp = torch.tensor(np.concatenate([ct, rt]), requires_grad=True)  # [2B, T] (batch is [chosen, rejected])
    comp = np.concatenate([cm, rm])
    # TRL shifts the completion mask by one (labels are next tokens): put a prompt token in front.
    completion_mask = torch.tensor(np.concatenate([np.zeros((2 * Bp, 1), np.float32), comp], 1)).long()
    tmask = torch.tensor(comp)

    class FakeModel:
        training = True

        def __call__(self, **kw):
            # TRL's fused head returns log-prob 0 where labels are -100 (not completion).
            return SimpleNamespace(
                log_probs=lp * tmask, entropy=torch.zeros(2 * Bp, T), mean_logits=torch.zeros(2 * Bp, T),
                is_top1=torch.zeros(2 * Bp, T, dtype=torch.bool),
            )

    model = FakeModel()
    same = lambda x: x  # noqa: E731
    fake = SimpleNamespace(
        model=model, accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=same, gather=same),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type=f,
        f_alpha_divergence_coef=alpha, loss_types=list(loss_types), loss_weights=list(weights), beta=beta,
        label_smoothing=eps, args=SimpleNamespace(discopop_tau=tau), use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(2 * Bp, T + 1, dtype=torch.long),
        "attention_mask": torch.ones(2 * Bp, T + 1, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": torch.tensor(ref_c),
        "ref_rejected_logps": torch.tensor(ref_r),
    }
    loss = trl_dpo.DPOTrainer._compute_loss(fake, model, inputs, return_outputs=False)
    loss.backward()
    g = lp.grad.numpy()
    return float(loss.detach()), g[:Bp], g[Bp:]


TRL_TYPES = [n for n in ALL if n != "simpo"] + ["sft"]


@needs_trl
@pytest.mark.parametrize("name", TRL_TYPES)
def test_matches_trl_dpo_trainer_value_and_per_token_grad(name):
    ct, cm, rt, rm, ref_c, ref_r = token_batch(4)
    eps = interface_eps(name)
    ours = jax_combined(ct, cm, rt, rm, ref_c, ref_r, (name,), (1.0,), beta=BETA, label_smoothing=eps)
    theirs = trl_combined(ct, cm, rt, rm, ref_c, ref_r, (name,), (1.0,), BETA, eps)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ours[2], theirs[2], rtol=1e-4, atol=1e-6)
    assert np.abs(theirs[1]).max() > 1e-5


@needs_trl
@pytest.mark.parametrize("f", ["forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("name", ["sigmoid", "ipo", "robust", "discopop", "sigmoid_norm"])
def test_f_divergence_matches_trl(f, name):
    ct, cm, rt, rm, ref_c, ref_r = token_batch(5)
    eps = interface_eps(name)
    ours = jax_combined(ct, cm, rt, rm, ref_c, ref_r, (name,), (1.0,), beta=BETA, label_smoothing=eps,
                        f_divergence=f, f_alpha=0.3)
    theirs = trl_combined(ct, cm, rt, rm, ref_c, ref_r, (name,), (1.0,), BETA, eps, f=f, alpha=0.3)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ours[2], theirs[2], rtol=1e-4, atol=1e-6)


@needs_trl
@pytest.mark.parametrize(
    "types,weights",
    [(("sigmoid", "sft"), (1.0, 0.3)),  # RPO
     (("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0))],  # MPO example of the TRL docs
)
def test_combined_objectives_match_trl(types, weights):
    ct, cm, rt, rm, ref_c, ref_r = token_batch(6)
    ours = jax_combined(ct, cm, rt, rm, ref_c, ref_r, types, weights, beta=BETA)
    theirs = trl_combined(ct, cm, rt, rm, ref_c, ref_r, types, weights, BETA, 0.0)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=2e-5)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(ours[2], theirs[2], rtol=1e-4, atol=1e-7)
    # and by hand: sum_k w_k mean(loss_k), sft = token-mean NLL of chosen
    cl, rl = (ct * cm).sum(1).astype(np.float64), (rt * rm).sum(1).astype(np.float64)
    manual = -(ct * cm).sum() / cm.sum() * weights[-1]
    for n, w in zip(types[:-1], weights[:-1]):
        manual += w * np_loss(n, cl, rl, ref_c.astype(np.float64), ref_r.astype(np.float64), 1, 1, BETA, 0).mean()
    np.testing.assert_allclose(ours[0], manual, rtol=2e-5)


@needs_trl
@pytest.mark.parametrize("eps", [0.0, 0.15])
def test_simpo_matches_trl_cpo_trainer(eps):
    cl, rl, _, _, lw, ll = make_batch(7)
    gamma, beta = 0.8, 2.0
    c = torch.tensor(cl, dtype=torch.float32, requires_grad=True)
    r = torch.tensor(rl, dtype=torch.float32, requires_grad=True)
    fake = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=eps,
                           accelerator=SimpleNamespace(device="cpu"))
    # CPOTrainer works on length-averaged log-probs for simpo (average_log_prob=True)
    losses, _, _ = cpo_mod.CPOTrainer.cpo_loss(fake, c / torch.tensor(lw), r / torch.tensor(ll))
    losses.sum().backward()

    def ours(c_, r_):
        return dpo.dpo_loss(c_, r_, None, None, "simpo", beta, eps, lw, ll, gamma=gamma)

    out = ours(jnp.asarray(cl), jnp.asarray(rl))
    gc, gr = jax.grad(lambda a, b: jnp.sum(ours(a, b)), argnums=(0, 1))(jnp.asarray(cl, jnp.float32),
                                                                          jnp.asarray(rl, jnp.float32))
    np.testing.assert_allclose(np.asarray(out), losses.detach().numpy(), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gc), c.grad.numpy(), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(gr), r.grad.numpy(), rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------------------- micro-batching, metrics


@functools.lru_cache(maxsize=None)
def _combined_vg_jit(loss_types, weights, beta):
    """Jitted (loss, grads) with the global normalisers as traced arguments: one compile per shape."""

    def f(ct_, rt_, cm_, rm_, ref_c_, ref_r_, num_pairs, num_tokens):
        inp = dpo.DPOInputs(ct_, cm_, rt_, rm_, ref_c_, ref_r_)
        return dpo.combined_dpo_loss(inp, loss_types, weights, beta=beta, num_pairs=num_pairs,
                                     num_chosen_tokens=num_tokens)[0]

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


def test_combined_loss_is_exact_under_micro_batching():
    Bp, T = 8, 7
    ct, cm, rt, rm, ref_c, ref_r = token_batch(8, Bp, T)
    types, weights = ("sigmoid", "ipo", "sft"), (1.0, 0.05, 0.5)
    vg = _combined_vg_jit(types, weights, BETA)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    cl, rl, lc, lr = f64((ct * cm).sum(1)), f64((rt * rm).sum(1)), f64(cm.sum(1)), f64(rm.sum(1))
    full = (np_loss("sigmoid", cl, rl, f64(ref_c), f64(ref_r), lc, lr, BETA, 0).mean()
            + 0.05 * np_loss("ipo", cl, rl, f64(ref_c), f64(ref_r), lc, lr, BETA, 0).mean()
            - 0.5 * f64(ct * cm).sum() / cm.sum())
    n_tok = float(cm.sum())
    grads = {}
    for n_micro in (1, 2, 8):
        size = Bp // n_micro
        total, gcs, grs = 0.0, [], []
        for k in range(n_micro):
            s = slice(k * size, (k + 1) * size)
            v, (gc, gr) = vg(*(jnp.asarray(a[s]) for a in (ct, rt, cm, rm, ref_c, ref_r)), Bp, n_tok)
            total += float(v)
            gcs.append(np.asarray(gc))
            grs.append(np.asarray(gr))
        np.testing.assert_allclose(total, full, rtol=1e-5, err_msg=f"{n_micro} micro-batches")
        grads[n_micro] = (np.concatenate(gcs), np.concatenate(grs))
    for n_micro in (2, 8):
        np.testing.assert_allclose(grads[n_micro][0], grads[1][0], rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(grads[n_micro][1], grads[1][1], rtol=1e-5, atol=1e-8)
    # padding positions get no gradient
    assert np.abs(grads[1][0][cm == 0]).max() == 0.0
    # Without the global normalisers, averaging per-micro-batch losses is NOT the full-batch loss (ragged sft).
    parts = [float(vg(*(jnp.asarray(a[s]) for a in (ct, rt, cm, rm, ref_c, ref_r)), 4, float(cm[s].sum()))[0])
             for s in (slice(0, 4), slice(4, 8))]
    assert abs(np.mean(parts) - full) > 1e-4


def test_combined_metrics():
    ct, cm, rt, rm, ref_c, ref_r = token_batch(9)
    inp = dpo.DPOInputs(jnp.asarray(ct), jnp.asarray(cm), jnp.asarray(rt), jnp.asarray(rm), jnp.asarray(ref_c),
                        jnp.asarray(ref_r))
    loss, m = dpo.combined_dpo_loss(inp, ("sigmoid", "sft"), (1.0, 0.2), beta=BETA)
    cl, rl = (ct * cm).sum(1), (rt * rm).sum(1)
    cr, rr = BETA * (cl - ref_c), BETA * (rl - ref_r)
    np.testing.assert_allclose(float(m["chosen_rewards"]), cr.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["rejected_rewards"]), rr.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["reward_margin"]), (cr - rr).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["preference_accuracy"]), (cr > rr).mean())
    np.testing.assert_allclose(float(m["logps/chosen"]), cl.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["loss/sft"]), -(ct * cm).sum() / cm.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(m["loss"]), float(m["loss/sigmoid"]) + 0.2 * float(m["loss/sft"]), rtol=1e-6)
    np.testing.assert_allclose(float(loss), float(m["loss"]))


def test_padding_garbage_does_not_leak():
    ct, cm, rt, rm, ref_c, ref_r = token_batch(10)
    ct2, rt2 = ct.copy(), rt.copy()
    ct2[cm == 0] = np.nan
    rt2[rm == 0] = -1e30
    a = jax_combined(ct, cm, rt, rm, ref_c, ref_r, ("sigmoid", "sft"), (1.0, 1.0), beta=BETA)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = jax_combined(ct2, cm, rt2, rm, ref_c, ref_r, ("sigmoid", "sft"), (1.0, 1.0), beta=BETA)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-7)
    assert np.isfinite(b[1]).all() and np.isfinite(b[2]).all()
