"""On-policy distillation math: the per-token losses of `algorithm = "distill"`, pure and jit-compatible.

Three losses (`distill.loss`), all per completion token t of a sequence x:

``reverse_kl`` (the on-policy distillation recipe: Agarwal et al. 2024 / Thinking Machines 2025): the sampled
token's log-ratio ``d_t = log pi_student(x_t) - log pi_teacher(x_t)`` is a one-sample estimate of the per-token
reverse KL(student || teacher). It enters as a per-token ADVANTAGE ``A_t = -d_t`` (a token the teacher finds more
likely than the student does gets A > 0 and is reinforced), with no discounting over later tokens, trained with
the policy-gradient surrogate (``-A_t * ratio_t``, ratio 1 on-policy), so the gradient is
``E[-A_t grad log pi_student(x_t)] = grad KL`` for the sampled tokens. Sign convention: ``reverse_kl_advantages``
returns A = teacher - student (>= 0 where the teacher is the more confident).

``jsd`` (GKD's generalized Jensen-Shannon divergence, TRL ``GKDTrainer.generalized_jsd_loss``): with
M = (1 - beta) S + beta T,  ``JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M)``; beta = 0 is taken as the forward
KL(T || S) and beta = 1 as the reverse KL(S || T), exactly as TRL special-cases them (the mixture form tends to 0
at both ends).

``forward_kl_topk``: KL(T || S), what ``jsd`` is at beta 0, computed directly (no mixture).

The support: the two distributions are compared over the teacher's top-k tokens at that position plus ONE
remainder bucket holding the mass of every other token (``rest = log(1 - sum_k p)``), so a teacher that reports
only k log-probs (a server's ``logprobs=k``) still defines a proper distribution, and the student's remainder
mass is pulled toward the teacher's. With k = V (every token) the remainder holds no mass on either side and the
divergences are the exact full-vocabulary ones (tests/test_distill_loss.py compares both with TRL's formula in
torch). Log-masses below ``LOG_FLOOR`` are taken as ``LOG_FLOOR`` (exp of it is 0 in float32), so an empty bucket
(-inf) or a token the teacher gives no probability keeps every loss and gradient finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.algorithms.distill_config import DISTILL_LOSSES

__all__ = ["DISTILL_LOSSES", "LOG_FLOOR", "bucketed", "forward_kl_topk", "generalized_jsd", "jsd_topk",
           "reverse_kl_advantages", "topk_divergence"]

# Far below any log-probability a float32 softmax produces for a finite logit that still matters (exp(-1e4) is 0),
# and far above -inf: an empty bucket then contributes 0 * finite instead of 0 * inf = NaN.
LOG_FLOOR = -1.0e4


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _kl(logp: jax.Array, logq: jax.Array) -> jax.Array:
    """``sum_i p_i (log p_i - log q_i)`` over the last axis, with ``0 log 0 = 0`` (a bucket p gives no mass
    contributes nothing, and no gradient)."""
    p = jnp.exp(logp)
    return jnp.sum(jnp.where(p > 0, p * (logp - logq), 0.0), axis=-1)


def generalized_jsd(student_logp: jax.Array, teacher_logp: jax.Array, beta: float) -> jax.Array:
    """GKD's generalized JSD ``[..., n] x [..., n] -> [...]`` between two log-distributions over the same n outcomes
    (module docstring; TRL's definition, including its beta 0 / 1 special cases). ``beta``: a Python float."""
    s = jnp.maximum(_f32(student_logp), LOG_FLOOR)
    t = jnp.maximum(_f32(teacher_logp), LOG_FLOOR)
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd_beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return _kl(t, s)
    if beta == 1.0:
        return _kl(s, t)
    m = jnp.logaddexp(s + jnp.log1p(-beta), t + jnp.log(beta))
    return beta * _kl(t, m) + (1.0 - beta) * _kl(s, m)


def bucketed(topk_logp: jax.Array, rest_logp: jax.Array) -> jax.Array:
    """``[..., k]`` log-probs of the top-k tokens and ``[...]`` log of the remaining mass -> ``[..., k + 1]``."""
    return jnp.concatenate([_f32(topk_logp), _f32(rest_logp)[..., None]], axis=-1)


def jsd_topk(student_topk: jax.Array, student_rest: jax.Array, teacher_topk: jax.Array, teacher_rest: jax.Array,
             beta: float) -> jax.Array:
    """Generalized JSD per token ``[...]`` over the teacher's top-k support plus the remainder bucket. The
    student's log-probs are taken at the teacher's top-k token ids (``student_topk [..., k]``)."""
    return generalized_jsd(bucketed(student_topk, student_rest), bucketed(teacher_topk, teacher_rest), beta)


def forward_kl_topk(student_topk: jax.Array, student_rest: jax.Array, teacher_topk: jax.Array,
                    teacher_rest: jax.Array) -> jax.Array:
    """KL(teacher || student) per token ``[...]`` over the top-k support plus the remainder bucket."""
    s = jnp.maximum(bucketed(student_topk, student_rest), LOG_FLOOR)
    t = jnp.maximum(bucketed(teacher_topk, teacher_rest), LOG_FLOOR)
    return _kl(t, s)


def topk_divergence(loss: str, student_topk, student_rest, teacher_topk, teacher_rest, jsd_beta: float = 0.5):
    """The per-token divergence of a top-k loss by name (``jsd`` | ``forward_kl_topk``)."""
    if loss == "jsd":
        return jsd_topk(student_topk, student_rest, teacher_topk, teacher_rest, jsd_beta)
    if loss == "forward_kl_topk":
        return forward_kl_topk(student_topk, student_rest, teacher_topk, teacher_rest)
    raise ValueError(f"topk_divergence: loss must be jsd | forward_kl_topk, got {loss!r}")


def reverse_kl_advantages(student_logp: jax.Array, teacher_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-token advantages ``[N, C]`` of the reverse_kl loss: ``A_t = log pi_teacher(x_t) - log pi_student(x_t)``
    on the completion mask, 0 elsewhere (module docstring). The teacher's log-prob is floored at ``LOG_FLOOR``
    (a token it gives no probability gets a large finite negative advantage, never -inf)."""
    adv = jnp.maximum(_f32(teacher_logp), LOG_FLOOR) - _f32(student_logp)
    return jnp.where(jnp.asarray(mask) > 0, adv, 0.0)
