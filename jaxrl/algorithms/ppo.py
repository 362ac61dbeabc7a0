"""PPO objective math (RLHF-style, token-level rewards with a KL penalty): pure and jit-compatible.

Definitions follow TRL's PPO trainer (``docs/design/algorithms.md`` section 2.3) and, for the adaptive KL controller,
Ziegler et al. 2019 as in verl / OpenRLHF. Shapes: ``[B, T]`` completion tokens, ``mask`` 1 on completion tokens
(right padding, or holes such as tool output: masked positions are skipped by GAE as if absent).

Order of operations in a PPO step (the trainer's job): rewards = :func:`kl_penalty_rewards` -> (optionally
``masked_whiten(rewards, mask, shift_mean=False)``) -> :func:`gae` -> ``masked_whiten(advantages, mask)``, all on
the WHOLE batch before it is split into micro-batches (whitening uses batch statistics); then per micro-batch
:func:`ppo_loss`. The loss follows the micro-batch contract of :mod:`jaxrl.algorithms.grpo`: pass
``grpo.global_normalizers(global_mask)``; each micro-batch returns ``sum(per_token_loss * mask / num_tokens)``
(token_mean, TRL's ``masked_mean`` over the batch), and summing micro-batch contributions equals the full-batch
loss exactly. Metrics are returned as additive contributions the same way.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxrl.algorithms import grpo
from jaxrl.algorithms import kl as kl_lib
from jaxrl.algorithms.grpo import Normalizers, global_normalizers, masked_mean, token_weights  # noqa: F401
from jaxrl.algorithms.policy_loss import ClipOptions, PolicyLossInputs, masked_var, masked_whiten, policy_loss_terms

__all__ = [
    "gae",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "kl_penalty_rewards",
    "AdaptiveKLController",
    "FixedKLController",
    "adaptive_kl_update",
    "policy_loss",
    "value_loss",
    "ppo_loss",
    "explained_variance",
    "clip_fraction",
    "approx_kl",
    "entropy_from_logits",
    "global_normalizers",
    "Normalizers",
]


def _f32(x):
    return jnp.asarray(x, jnp.float32)


# ------------------------------------------------------------------------------------------------- GAE


def gae(
    rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float = 1.0, lam: float = 0.95
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over masked token sequences; returns (advantages, returns), ``[B, T]``.

    delta_t = r_t + gamma V_{t'} - V_t and A_t = delta_t + gamma lam A_{t'}, where t' is the next *unmasked*
    position (V and A are 0 past the last one); R_t = A_t + V_t. Both outputs are 0 at masked positions, and
    masked positions' rewards/values are never read (they may hold garbage). A reverse ``lax.scan`` over T.
    """
    r, v = _f32(rewards), _f32(values)
    m = jnp.asarray(mask) > 0
    if not (r.shape == v.shape == m.shape) or r.ndim != 2:
        raise ValueError(f"rewards, values, mask must all be [B, T]; got {r.shape}, {v.shape}, {m.shape}")

    def step(carry, x):
        next_value, next_adv = carry
        r_t, v_t, m_t = x
        adv_t = r_t + gamma * next_value - v_t + gamma * lam * next_adv
        # A masked position passes the carry through unchanged: it is skipped, not treated as a zero step.
        carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv_t, next_adv))
        return carry, jnp.where(m_t, adv_t, 0.0)

    zeros = jnp.zeros(r.shape[0], jnp.float32)
    _, adv_t = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, m.T), reverse=True)
    adv = adv_t.T
    return adv, jnp.where(m, adv + v, 0.0)


# ------------------------------------------------------------------------------------------------- whitening


# ------------------------------------------------------------------------------------------------- rewards, KL


def kl_penalty_rewards(
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    scores: jax.Array,
    kl_coef: float | jax.Array,
    estimator: str = "k1",
) -> tuple[jax.Array, jax.Array]:
    """Token rewards ``r_t = -kl_coef * KL_t`` plus the sequence score at the last completion token.

    ``logp``/``ref_logp``/``mask`` ``[B, T]``, ``scores`` ``[B]``; returns (rewards ``[B, T]``, KL ``[B, T]``),
    both 0 at masked positions. ``estimator``: k1 (TRL default) or k3 (or any registered ``kl``). A row with no
    completion token gets no score.
    """
    m = jnp.asarray(mask) > 0
    kl = kl_lib.kl(logp, ref_logp, estimator, mask=m)
    rewards = -kl_coef * kl
    T = m.shape[-1]
    # Index of the last masked-in position (right padding or holes alike).
    last = T - 1 - jnp.argmax(m[:, ::-1], axis=-1)
    at_last = (jnp.arange(T)[None, :] == last[:, None]) & jnp.any(m, axis=-1, keepdims=True)
    rewards = rewards + jnp.where(at_last, _f32(scores)[:, None], 0.0)
    return rewards, kl


def adaptive_kl_update(coef, current_kl, n_steps, target: float, horizon: float):
    """Ziegler et al.: ``e = clip(KL / target - 1, -0.2, 0.2)``; ``coef * (1 + e * n_steps / horizon)``."""
    e = jnp.clip(_f32(current_kl) / target - 1.0, -0.2, 0.2)
    return _f32(coef) * (1.0 + e * _f32(n_steps) / horizon)


class AdaptiveKLController(NamedTuple):
    """Adaptive KL coefficient as a pure state update: ``coef = ctl.init()``, then after each rollout batch
    ``coef = ctl.update(coef, mean_kl, n_steps)`` (``n_steps`` = samples in the batch, as verl/OpenRLHF).
    Works inside ``jax.jit`` and from a host loop (``float(coef)``). Defaults: verl's (target 0.1, horizon 1e4)."""

    init_kl_coef: float = 0.05
    target: float = 0.1
    horizon: float = 10000.0

    def init(self) -> jax.Array:
        return _f32(self.init_kl_coef)

    def update(self, coef, current_kl, n_steps) -> jax.Array:
        return adaptive_kl_update(coef, current_kl, n_steps, self.target, self.horizon)


class FixedKLController(NamedTuple):
    """Constant KL coefficient with the same interface (TRL PPO's only mode; ``kl_coef`` default 0.05)."""

    kl_coef: float = 0.05

    def init(self) -> jax.Array:
        return _f32(self.kl_coef)

    def update(self, coef, current_kl, n_steps) -> jax.Array:
        del current_kl, n_steps
        return _f32(coef)


# ------------------------------------------------------------------------------------------------- losses


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    cliprange: float = 0.2,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
) -> jax.Array:
    """Clipped PPO policy loss per token, ``max(-A rho, -A clip(rho, 1-c, 1+c_high))``, ``[B, T]`` (unmasked);
    ``dual_clip`` and ``log_ratio_clamp`` as in :func:`grpo.clipped_surrogate`."""
    return grpo.clipped_surrogate(
        grpo.token_log_ratio(logp, old_logp), advantages, cliprange, cliprange_high, dual_clip=dual_clip,
        log_ratio_clamp=log_ratio_clamp,
    )


def value_loss(
    values: jax.Array, old_values: jax.Array, returns: jax.Array, cliprange_value: float | None = 0.2
) -> jax.Array:
    """Clipped value loss per token, ``0.5 * max((V-R)^2, (clip(V, V_old-c, V_old+c)-R)^2)``, ``[B, T]``.
    ``cliprange_value=None`` disables clipping (``0.5 (V-R)^2``)."""
    v, r = _f32(values), _f32(returns)
    unclipped = (v - r) ** 2
    if cliprange_value is None:
        return 0.5 * unclipped
    vo = _f32(old_values)
    clipped = (jnp.clip(v, vo - cliprange_value, vo + cliprange_value) - r) ** 2
    return 0.5 * jnp.maximum(unclipped, clipped)


def clip_fraction(
    logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, cliprange: float = 0.2,
    cliprange_high: float | None = None,
) -> jax.Array:
    """Per-token 0/1 float: 1 where the clipped term is the active one (TRL ``pg_clipfrac``); average with
    ``masked_mean`` or :func:`grpo.token_metric_contributions`."""
    return grpo.clip_fraction(grpo.token_log_ratio(logp, old_logp), advantages, cliprange, cliprange_high)["region"]


def approx_kl(logp: jax.Array, old_logp: jax.Array, estimator: str = "k2") -> jax.Array:
    """Per-token KL(old || new) estimate between the behaviour and current policy (TRL: k2 = 0.5 * logr^2)."""
    return kl_lib.kl(logp, old_logp, estimator)


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
    """``1 - Var(R - V) / Var(R)`` over masked tokens (scalar); 0.0 when Var(R) is 0 (nothing to explain)."""
    var_r = masked_var(returns, mask)
    var_d = masked_var(_f32(returns) - _f32(values), mask)
    return jnp.where(var_r > 0, 1.0 - var_d / jnp.where(var_r > 0, var_r, 1.0), 0.0)


def entropy_from_logits(logits: jax.Array, chunk_size: int | None = None) -> jax.Array:
    """Per-position entropy of softmax(logits), ``[..., V] -> [...]``, in float32.

    ``logsumexp(z) - sum(softmax(z) * z)``. With ``chunk_size`` the leading positions are processed
    ``chunk_size`` rows at a time (``lax.map``) so the float32 copy of a [B*T, V] block never exists at once;
    equally, call it on the chunks a chunked LM head produces and keep only the ``[B, T]`` result.
    """

    def ent(z):
        z = _f32(z)
        lse = jax.nn.logsumexp(z, axis=-1)
        return lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)

    if chunk_size is None:
        return ent(logits)
    lead, V = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, V)
    n = flat.shape[0]
    pad = (-n) % chunk_size
    flat = jnp.pad(flat, ((0, pad), (0, 0)))
    out = jax.lax.map(ent, flat.reshape(-1, chunk_size, V)).reshape(-1)[:n]
    return out.reshape(lead)


def ppo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    normalizers: Normalizers,
    *,
    cliprange: float = 0.2,
    cliprange_high: float | None = None,
    cliprange_value: float | None = 0.2,
    vf_coef: float = 0.1,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
    sampling_weights: jax.Array | None = None,
    entropies: jax.Array | None = None,
    entropy_coef: float = 0.0,
    aggregation: str = "token_mean",
    policy_loss: str = "ppo_clip",
    policy_loss_options=None,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One micro-batch's PPO loss contribution: ``agg(w_is pg) + vf_coef * agg(vf) - entropy_coef * agg(entropy)``.

    All inputs ``[b, T]`` (``advantages`` whitened on the whole batch beforehand); ``agg`` is the weighted sum of
    :func:`grpo.token_weights` (default token_mean, TRL's masked mean). Summed over micro-batches it equals the
    full-batch loss. ``sampling_weights`` ``[b, T]`` (the rollout correction, :func:`grpo.rollout_correction`)
    weight the policy term only. ``policy_loss`` names the policy term (jaxrl.algorithms.policy_loss; default
    the clipped surrogate, ``ppo_clip``), called with ``policy_loss_options`` (``policy_loss.resolve_options``;
    None: ``ppo_clip``'s from ``cliprange``, ``cliprange_high``, ``dual_clip`` and ``log_ratio_clamp``, which
    bounds the log-ratio before ``exp``: the ratio metrics use the clamped ratio too, so they stay finite).
    Metrics (additive contributions): ``pg_loss``, ``vf_loss``, ``clip_fraction`` (where the loss has a clip),
    ``vf_clip_fraction``, ``approx_kl``, ``ratio``, the loss's others, and ``entropy`` when ``entropies`` is
    given; and two maxima over the micro-batch's tokens, which the train step reduces with ``max`` across
    micro-batches (names ending in ``max``, :mod:`jaxrl.train.step`): ``ratio/max``, ``value/abs_max``.
    """
    chex.assert_rank(mask, 2)
    chex.assert_equal_shape([logp, old_logp, advantages, values, old_values, returns, mask])
    w = token_weights(mask, aggregation, normalizers)
    if policy_loss_options is None:
        policy_loss_options = ClipOptions(
            epsilon_low=cliprange, epsilon_high=cliprange if cliprange_high is None else cliprange_high,
            log_ratio_clamp=log_ratio_clamp, dual_clip=dual_clip)
    terms = policy_loss_terms(policy_loss, PolicyLossInputs(logp, old_logp, advantages, mask, sampling_weights,
                                                            rng), policy_loss_options)
    pg = jnp.broadcast_to(terms.loss, w.shape)
    vf = value_loss(values, old_values, returns, cliprange_value)
    loss = grpo.aggregate_loss(pg, w) + vf_coef * grpo.aggregate_loss(vf, w)
    sg = jax.lax.stop_gradient
    ratio = jnp.broadcast_to(terms.metrics["ratio"], w.shape)
    on = jnp.asarray(mask) > 0
    per_token = {"pg_loss": sg(pg), "vf_loss": sg(vf)}
    if "clip_fraction/region" in terms.metrics:  # PPO's one clip fraction: where the clip binds, either side
        per_token["clip_fraction"] = terms.metrics["clip_fraction/region"]
    per_token.update({"approx_kl": sg(approx_kl(logp, old_logp)), "ratio": ratio})
    per_token.update({k: v for k, v in terms.metrics.items() if k != "ratio" and not k.startswith("clip_fraction/")})
    maxima = {"ratio/max": jnp.max(jnp.where(on, ratio, 0.0)),
              "value/abs_max": jnp.max(jnp.where(on, jnp.abs(sg(_f32(values))), 0.0))}
    if cliprange_value is not None:
        v, vo, r = _f32(values), _f32(old_values), _f32(returns)
        per_token["vf_clip_fraction"] = sg(
            ((jnp.clip(v, vo - cliprange_value, vo + cliprange_value) - r) ** 2 > (v - r) ** 2).astype(jnp.float32)
        )
    if entropies is not None:
        per_token["entropy"] = sg(_f32(entropies))
        if entropy_coef:
            loss = loss - entropy_coef * grpo.aggregate_loss(entropies, w)
    return loss, {**grpo.token_metric_contributions(per_token, mask, normalizers), **maxima}
