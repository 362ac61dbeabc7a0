"""Distillation loss math (jaxrl/algorithms/distill_loss.py, the support ops of jaxrl/ops/logprobs.py) against TRL's
`GKDTrainer.generalized_jsd_loss` (trl 1.16, torch), and the reverse-KL advantages against a hand computation."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl.algorithms import distill_loss as dl
from jaxrl.ops.logprobs import support_logprobs, topk_support

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # trl.experimental.gkd warns on import

B, T, V = 2, 5, 37


def _trl_per_token(student_logits, teacher_logits, beta, temperature=1.0):
    """TRL's generalized JSD with reduction='none', summed over the vocabulary: one value per token."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer
    jsd = GKDTrainer.generalized_jsd_loss(torch.as_tensor(np.asarray(student_logits)),
                                          torch.as_tensor(np.asarray(teacher_logits)), beta=beta,
                                          temperature=temperature, reduction="none")
    return jsd.sum(-1).numpy()


def _problem(seed=0):
    """Student and teacher hidden states and heads, and sampled targets. The heads are the identity, so the ops'
    logits (h @ W.T) are the hidden states bit for bit and TRL sees the very same logits."""
    rng = np.random.default_rng(seed)
    hs, ht = (rng.normal(size=(B, T, V)).astype(np.float32) for _ in range(2))
    eye = np.eye(V, dtype=np.float32)
    targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
    return hs, eye, ht, eye.copy(), targets


def _ours(hs, ws, ht, wt, targets, k, loss, beta, temperature, chunk_size=3):
    _, t_top, t_ids, t_rest = topk_support(jnp.asarray(ht), jnp.asarray(wt), jnp.asarray(targets), k,
                                           chunk_size=chunk_size, temperature=temperature)
    _, s_on, s_rest, _ = support_logprobs(jnp.asarray(hs), jnp.asarray(ws), jnp.asarray(targets), t_ids,
                                          chunk_size=chunk_size, temperature=temperature)
    return np.asarray(dl.topk_divergence(loss, s_on, s_rest, t_top, t_rest, beta))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("loss,beta", [("jsd", 0.0), ("jsd", 0.5), ("jsd", 1.0), ("jsd", 0.2),
                                       ("forward_kl_topk", 0.0)])
def test_full_vocab_support_is_trl_generalized_jsd(loss, beta, temperature):
    """k = V: the top-k + remainder form is the exact full-distribution divergence (the remainder is empty)."""
    hs, ws, ht, wt, targets = _problem()
    want = _trl_per_token(hs @ ws.T, ht @ wt.T, beta, temperature)
    got = _ours(hs, ws, ht, wt, targets, V, loss, beta, temperature)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert np.all(want > 1e-3)  # a real divergence, not two zeros agreeing


@pytest.mark.parametrize("loss,beta", [("jsd", 0.0), ("jsd", 0.5), ("jsd", 1.0), ("forward_kl_topk", 0.0)])
def test_topk_support_is_trl_on_the_bucketed_distributions(loss, beta):
    """k < V: the same as TRL's formula applied to the (k + 1)-outcome distributions built in torch: the teacher's
    top-k tokens (torch.topk) and one bucket holding every other token's mass, for both models."""
    k, temperature = 5, 0.8
    hs, ws, ht, wt, targets = _problem(1)
    s_logp = torch.log_softmax(torch.as_tensor(hs @ ws.T) / temperature, -1)
    t_logp = torch.log_softmax(torch.as_tensor(ht @ wt.T) / temperature, -1)
    ids = torch.topk(t_logp, k, dim=-1).indices
    off = torch.ones_like(t_logp, dtype=torch.bool).scatter(-1, ids, False)

    def buckets(logp):
        rest = torch.logsumexp(logp.masked_fill(~off, -torch.inf), -1, keepdim=True)
        return torch.cat([logp.gather(-1, ids), rest], -1)

    want = _trl_per_token(buckets(s_logp).numpy(), buckets(t_logp).numpy(), beta)
    got = _ours(hs, ws, ht, wt, targets, k, loss, beta, temperature)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    full = _trl_per_token(hs @ ws.T, ht @ wt.T, beta, temperature)
    assert np.max(np.abs(full - want)) > 1e-3  # the bucketing is what was checked, not the full form again


def test_support_ops_agree_with_full_log_softmax():
    hs, ws, ht, wt, targets = _problem(2)
    logp = jax.nn.log_softmax(jnp.asarray(ht @ wt.T) / 0.9, -1)
    t_logp, t_top, t_ids, t_rest = topk_support(jnp.asarray(ht), jnp.asarray(wt), jnp.asarray(targets), 4,
                                                chunk_size=4, temperature=0.9)
    np.testing.assert_allclose(t_logp, np.take_along_axis(logp, targets[..., None], -1)[..., 0], atol=1e-6)
    np.testing.assert_allclose(t_top, jax.lax.top_k(logp, 4)[0], atol=1e-6)
    np.testing.assert_allclose(np.exp(t_rest) + np.exp(t_top).sum(-1), 1.0, atol=1e-6)
    s_logp, s_on, s_rest, top1 = support_logprobs(jnp.asarray(ht), jnp.asarray(wt), jnp.asarray(targets), t_ids,
                                                  chunk_size=7, temperature=0.9)
    np.testing.assert_allclose(s_on, t_top, atol=1e-6)  # the same model at the teacher's ids
    np.testing.assert_allclose(s_rest, t_rest, atol=1e-5)
    np.testing.assert_array_equal(top1, np.asarray(t_ids[..., 0]))


def test_reverse_kl_advantages_hand_computed():
    """A = log p_teacher(x_t) - log p_student(x_t) on the mask: a token the teacher likes more is reinforced."""
    student = np.log(np.array([[0.5, 0.25, 0.1]], np.float32))
    teacher = np.log(np.array([[0.25, 0.5, 1e-3]], np.float32))
    mask = np.array([[1, 1, 0]], np.float32)
    got = np.asarray(dl.reverse_kl_advantages(student, teacher, mask))
    # log(0.25/0.5) = -log 2, log(0.5/0.25) = +log 2, masked -> 0
    np.testing.assert_allclose(got, [[-np.log(2.0), np.log(2.0), 0.0]], atol=1e-7)
    # a teacher with no probability at all: large, finite
    inf = np.asarray(dl.reverse_kl_advantages(student, np.full_like(teacher, -np.inf), np.ones_like(mask)))
    assert np.all(np.isfinite(inf)) and np.all(inf < 0.9 * dl.LOG_FLOOR)


@pytest.mark.parametrize("loss,beta", [("jsd", 0.0), ("jsd", 0.5), ("jsd", 1.0), ("forward_kl_topk", 0.0),
                                       ("reverse_kl", 0.0)])
@pytest.mark.parametrize("k", [3, V])
def test_gradients_finite_when_teacher_gives_a_sampled_token_no_probability(loss, beta, k):
    """The teacher's logit of each sampled token is -1e9 (probability exactly 0 in float32), and one of the
    teacher's top-k entries has no probability either; with k = V the remainder buckets are empty on both sides."""
    hs, ws, ht, wt, targets = _problem(3)
    t_logits = jnp.asarray(ht @ wt.T)
    t_logits = jnp.where(jax.nn.one_hot(targets, V) > 0, -1e9, t_logits)
    t_logp = jax.nn.log_softmax(t_logits, -1)
    t_top, t_ids = jax.lax.top_k(t_logp, k)
    t_rest = jnp.log(jnp.clip(1.0 - jnp.exp(t_top).sum(-1), 0.0, 1.0))  # -inf where nothing is left
    sampled_logp_t = jnp.take_along_axis(t_logp, targets[..., None], -1)[..., 0]
    assert np.all(np.exp(np.asarray(sampled_logp_t)) == 0.0)

    def objective(ws_):
        s_logp, s_on, s_rest, _ = support_logprobs(jnp.asarray(hs), ws_, jnp.asarray(targets), t_ids, chunk_size=4)
        if loss == "reverse_kl":
            adv = jax.lax.stop_gradient(dl.reverse_kl_advantages(s_logp, sampled_logp_t, jnp.ones((B, T))))
            return -jnp.sum(adv * s_logp)
        return jnp.sum(dl.topk_divergence(loss, s_on, s_rest, t_top, t_rest, beta))

    value, grad = jax.value_and_grad(objective)(jnp.asarray(ws))
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    assert np.any(np.asarray(grad) != 0.0)
