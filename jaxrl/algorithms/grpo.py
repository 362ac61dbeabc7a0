"""GRPO objective math: group-relative advantages, the clipped surrogate, KL, and micro-batch-exact aggregation.

Pure and jit-compatible; the trainer loop lives elsewhere. Definitions follow TRL's ``GRPOTrainer``
(``_generate_and_score_completions`` and ``_compute_loss``, trl 1.16) and ``docs/design/algorithms.md`` section 2.2.

Shapes: ``N`` completions = prompts x ``num_generations``, laid out prompt-major (prompt j's samples are
``j*G ... j*G+G-1``, as ``jaxrl.generation.generate`` returns them). A micro-batch holds ``b`` completions padded
to ``T`` tokens; ``mask [b, T]`` is 1 on completion tokens that count in the loss.

Micro-batch contract (the trainer relies on it)
-----------------------------------------------
The trainer splits one optimizer step's global batch (all micro-batches of the gradient-accumulation window,
over all devices) into micro-batches and *sums* their losses / gradients -- it never divides by the number of
micro-batches. Each micro-batch's loss is

    contribution = sum_{i,t} per_token_loss[i, t] * weight[i, t],     weight = token_weights(mask, mode, norm)

where ``norm = global_normalizers(global_mask, ...)`` is computed ONCE from the masks of the whole global batch
before it is split, and passed unchanged to every micro-batch:

==================  ==================================================  ==========================================
mode                weight[i, t]                                        sum over micro-batches equals
==================  ==================================================  ==========================================
``sequence_mean``   mask / (max(len_i, 1) * num_sequences)              mean_i( sum_t l m / sum_t m )   (TRL grpo)
``token_mean``      mask / num_tokens                                   sum l m / sum m over the global batch
                                                                        (TRL dapo; verl/OpenRLHF token-mean)
``dr_grpo``         mask / (num_sequences * max_completion_length)      sum l m / (B * L_max)           (Dr. GRPO)
==================  ==================================================  ==========================================

``len_i`` is sequence i's own active-token count (a sequence never straddles micro-batches). Because every
weight is either local to a sequence or a global constant, the summed contributions -- and hence the summed
gradients -- equal the full-batch loss exactly, for any split (1x8, 2x4, 8x1, ragged lengths). Rows that are pure
padding (added to fill a micro-batch) have mask 0 and contribute nothing; exclude them from ``num_sequences`` by
passing ``sequence_mask`` to :func:`global_normalizers`. ``max_completion_length`` must be the configured cap, not
the padded width of a bucket. Metrics follow the same rule: :func:`token_metric_contributions` returns per-token
means as additive contributions (divide by ``num_tokens``), so summing them over micro-batches gives global
token means. Advantages must be computed on whole groups (before splitting), see :func:`compute_advantages`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.algorithms import kl as kl_lib
from jaxrl.algorithms.grpo_config import AGGREGATIONS, SCALE_REWARDS
# the loss terms' primitives live with the policy losses; GRPO's and PPO's callers reach them here too
from jaxrl.algorithms.policy_loss import (ClipOptions, PolicyLossInputs, clamp_log_ratio, clip_fraction,
                                          clipped_surrogate, importance_log_weights, masked_mean, masked_whiten,
                                          policy_loss_terms, token_log_ratio)
from jaxrl.utils.registry import Registry

__all__ = [
    "SCALE_REWARDS",
    "AGGREGATIONS",
    "LOSS_TYPE_AGGREGATION",
    "combine_rewards",
    "group_advantages",
    "zero_variance_groups",
    "compute_advantages",
    "rloo_advantages",
    "token_log_ratio",
    "importance_log_weights",
    "clamp_log_ratio",
    "clipped_surrogate",
    "Normalizers",
    "global_normalizers",
    "token_weights",
    "aggregate_loss",
    "reference_aggregate",
    "grpo_loss",
    "token_metric_contributions",
    "clip_fraction",
    "masked_mean",
    "overlong_penalty",
    "mask_truncated_completions",
    "truncated_completions",
]

# TRL loss_type -> our aggregation. TRL's bnpo normalises by the *local* batch's tokens; made micro-batch exact it
# is the same as dapo's global token mean.
LOSS_TYPE_AGGREGATION = {"grpo": "sequence_mean", "dapo": "token_mean", "bnpo": "token_mean", "dr_grpo": "dr_grpo"}

_STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)


def _f32(x):
    return jnp.asarray(x, jnp.float32)


# ------------------------------------------------------------------------------------------------- advantages


def combine_rewards(rewards_per_func: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """Weighted sum of several reward functions: ``[N, K] -> [N]`` (TRL sum_then_normalize).

    NaN (a reward function that returned None) counts as absent; a row with no reward at all is NaN, which the
    advantage functions turn into advantage 0 and leave out of the group statistics.
    """
    r = _f32(rewards_per_func)
    w = jnp.ones((r.shape[-1],), jnp.float32) if weights is None else _f32(weights)
    valid = ~jnp.isnan(r)
    total = jnp.sum(jnp.where(valid, r * w, 0.0), axis=-1)
    return jnp.where(jnp.any(valid, axis=-1), total, jnp.nan)


def _grouped(rewards, num_generations):
    r = _f32(rewards)
    if r.ndim != 1:
        raise ValueError(f"rewards must be [N]; got shape {r.shape}")
    if num_generations < 1 or r.shape[0] % num_generations:
        raise ValueError(f"N={r.shape[0]} rewards do not split into groups of num_generations={num_generations}")
    return r.reshape(-1, num_generations)


def _nan_mean_std(x, axis):
    """NaN-ignoring mean and Bessel-corrected std along ``axis`` (keepdims). Fewer than 2 values -> std NaN
    (TRL ``nanstd``); no values -> mean NaN."""
    valid = ~jnp.isnan(x)
    n = jnp.sum(valid, axis=axis, keepdims=True).astype(jnp.float32)
    xs = jnp.where(valid, x, 0.0)
    mean = jnp.sum(xs, axis=axis, keepdims=True) / jnp.where(n > 0, n, jnp.nan)
    sq = jnp.sum(jnp.where(valid, (x - mean) ** 2, 0.0), axis=axis, keepdims=True)
    std = jnp.sqrt(sq / jnp.where(n > 1, n - 1.0, jnp.nan))
    return mean, std


def group_advantages(
    rewards: jax.Array, num_generations: int, scale_rewards: str = "group", eps: float = _STD_EPS
) -> jax.Array:
    """GRPO advantages ``[N] -> [N]`` float32: ``(r - mean_group) / (std + eps)``.

    ``scale_rewards``: "group" (std of the group), "batch" (std of all N rewards; the mean is still the group's,
    as in TRL), "none" (no division: Dr. GRPO). std is Bessel-corrected; NaN rewards are ignored in the group
    statistics and get advantage 0, as does every member of a group whose std is undefined (fewer than two
    scored members).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}; got {scale_rewards!r}")
    g = _grouped(rewards, num_generations)
    mean, std = _nan_mean_std(g, axis=1)
    adv = g - mean
    if scale_rewards == "group":
        adv = adv / (std + eps)
    elif scale_rewards == "batch":
        _, bstd = _nan_mean_std(g.reshape(-1), axis=0)
        adv = adv / (bstd + eps)
    adv = adv.reshape(-1)
    return jnp.where(jnp.isnan(adv), 0.0, adv)


def zero_variance_groups(rewards: jax.Array, num_generations: int, atol: float = 1e-6) -> jax.Array:
    """``[N]`` bool: True for every member of a group whose (NaN-ignoring) rewards are all equal (or that has
    fewer than two scored members). Such groups carry no GRPO signal; DAPO's dynamic sampling drops them."""
    g = _grouped(rewards, num_generations)
    _, std = _nan_mean_std(g, axis=1)
    flag = jnp.isnan(std) | (std <= atol)
    return jnp.broadcast_to(flag, g.shape).reshape(-1)


def rloo_advantages(rewards: jax.Array, num_generations: int) -> jax.Array:
    """REINFORCE leave-one-out: ``r_i - mean_{j != i} r_j`` within the group, ``[N] -> [N]`` (NaN-safe; a member
    with no scored peer gets 0)."""
    g = _grouped(rewards, num_generations)
    valid = ~jnp.isnan(g)
    n = jnp.sum(valid, axis=1, keepdims=True).astype(jnp.float32)
    s = jnp.sum(jnp.where(valid, g, 0.0), axis=1, keepdims=True)
    adv = g - (s - jnp.where(valid, g, 0.0)) / jnp.where(n > 1, n - 1.0, jnp.nan)
    adv = jnp.where(valid, adv, jnp.nan).reshape(-1)
    return jnp.where(jnp.isnan(adv), 0.0, adv)


def pass_at_k_advantages(rewards: jax.Array, num_generations: int, k: int = 0, eps: float = 1e-6) -> jax.Array:
    """Pass@k advantages: PKPO's k - 1 leave-one-out transform (Walder & Karkhanis 2025, "Pass@K Policy
    Optimization", Eq. 33), scaled by the group's reward std as verl's ``grpo_passk`` is, so that k = the group size
    (``k=0``, the default) IS verl's ``grpo_passk`` (Chen et al. 2025, arXiv 2503.19595): only the group's best
    member gets ``(r_max - r_second) / (std + eps)``. For 2 <= k < G every member i gets

        s_i = 1 / C(n, k) * sum over the k-subsets I that hold i of (max_I r - max_{I without i} r)

    (its average gain to the best of k samples; an unbiased max@k gradient weight with a baseline that does not
    depend on i), computed from the others sorted: the (k-1)-subsets of the others whose best is the j-th smallest
    number C(j-1, k-2). std is Bessel-corrected (verl's norm_adv_by_std_in_grpo default). NaN rewards are absent
    (n counts the scored members; a group with fewer than k of them uses k = n); a group with fewer than two scored
    members gets 0. ``[N] -> [N]``."""
    g = _grouped(rewards, num_generations)
    G = num_generations
    k = G if not k else int(k)
    if not 2 <= k <= G:
        raise ValueError(f"pass_at_k: k={k} must be 0 (the group size) or in 2..{G}")
    valid = ~jnp.isnan(g)
    r = jnp.where(valid, g, 0.0)
    n = jnp.sum(valid, axis=1)  # [P]
    kk = jnp.minimum(k, n)  # [P]
    idx = jnp.arange(G)
    other = valid[:, None, :] & (idx[None, :, None] != idx[None, None, :])  # [P, i, j]: j is another scored member
    # rank of j among i's others: those below it (ties broken by index, which leaves every sum unchanged)
    below = (r[:, None, :] < r[:, :, None]) | ((r[:, None, :] == r[:, :, None]) & (idx[None, :] < idx[:, None])[None])
    # below[p, j, l]: l comes before j; rank[p, i, j] = #{l : l another of i, l != j, l before j}
    rank = jnp.einsum("pil,pjl->pij", other.astype(jnp.float32), below.astype(jnp.float32)).astype(jnp.int32)
    comb_m = np.array([[math.comb(m, c - 2) if c >= 2 else 0 for m in range(G)] for c in range(G + 1)], np.float32)
    comb_n = np.array([[math.comb(m, c) for m in range(G + 1)] for c in range(G + 1)], np.float32)
    weight = jnp.asarray(comb_m)[kk[:, None, None], jnp.clip(rank, 0, G - 1)]  # [P, i, j]
    gain = jnp.maximum(r[:, :, None] - r[:, None, :], 0.0)
    s = jnp.sum(jnp.where(other, weight * gain, 0.0), axis=2) / jnp.asarray(comb_n)[kk, n][:, None]
    _, std = _nan_mean_std(g, axis=1)
    adv = jnp.where(valid & (n >= 2)[:, None], s / (std + eps), 0.0)
    return jnp.where(jnp.isnan(adv), 0.0, adv).reshape(-1)


def _last_token(mask: jax.Array) -> jax.Array:
    """``[N, C]`` 0/1: each row's last loss token."""
    m = jnp.asarray(mask) > 0
    last = m.shape[-1] - 1 - jnp.argmax(jnp.flip(m, -1), axis=-1)
    return (jnp.arange(m.shape[-1])[None, :] == last[:, None]) & jnp.any(m, axis=-1, keepdims=True)


def reinforce_plus_plus_advantages(rewards: jax.Array, num_generations: int, mask: jax.Array,
                                   kl_penalty: jax.Array | None = None) -> jax.Array:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262; verl ``reinforce_plus_plus``, OpenRLHF): each loss token's
    reward is ``-kl_penalty`` (the KL to the reference in the reward, ``grpo.kl_in_reward``), plus the row's
    reward on its last loss token; the return of a token is the sum of the rewards from it on (gamma = 1, verl's
    default), and the advantages are the returns whitened over every loss token of the rollout (the global batch).
    A masked position (an observation inside an episode) carries the return through instead of resetting it
    (verl resets at mask 0, which only a right-padded single turn makes equivalent). ``[N] -> [N, C]``; rows
    with a NaN reward are left out (mask them first)."""
    m = (jnp.asarray(mask) > 0) & ~jnp.isnan(_f32(rewards))[:, None]
    token_rewards = jnp.where(_last_token(m), jnp.nan_to_num(_f32(rewards))[:, None], 0.0)
    if kl_penalty is not None:
        token_rewards = token_rewards - jnp.where(m, _f32(kl_penalty), 0.0)
    returns = jnp.flip(jnp.cumsum(jnp.flip(token_rewards, -1), axis=-1), -1)
    return masked_whiten(returns, m)


def reinforce_plus_plus_baseline_advantages(rewards: jax.Array, num_generations: int, mask: jax.Array,
                                            kl_penalty: jax.Array | None = None) -> jax.Array:
    """REINFORCE++ with a baseline (verl ``reinforce_plus_plus_baseline``): the row's score (its reward minus its
    summed ``kl_penalty``) less its group's mean (a group of one: 0, as verl), on every loss token, whitened over
    every loss token of the rollout. ``[N] -> [N, C]`` (constant along a row)."""
    m = (jnp.asarray(mask) > 0) & ~jnp.isnan(_f32(rewards))[:, None]
    score = _f32(rewards)
    if kl_penalty is not None:
        score = score - jnp.sum(jnp.where(m, _f32(kl_penalty), 0.0), axis=-1)
    g = _grouped(score, num_generations)
    mean, _ = _nan_mean_std(g, axis=1)
    centred = (g - (mean if num_generations > 1 else 0.0)).reshape(-1)
    return masked_whiten(jnp.broadcast_to(jnp.nan_to_num(centred)[:, None], m.shape), m)


# Advantage estimators by name: fn(rewards [N], num_generations) -> [N]; the ones added with info TOKEN_LEVEL take
# (rewards, num_generations, loss mask [N, C], KL penalty [N, C] or None) and return [N, C]. The built-ins are added
# here; a user's own comes in through jaxrl.algorithms.plugins, which checks it first.
ADVANTAGES = Registry("advantage",
                      hint="An estimator of your own: a `plugins` entry of kind advantage (jaxrl.algorithms.plugins)")
TOKEN_LEVEL = "token_level"
ADVANTAGES.add("grpo", lambda r, g: group_advantages(r, g, "group"))
ADVANTAGES.add("grpo_batch_std", lambda r, g: group_advantages(r, g, "batch"))
ADVANTAGES.add("dr_grpo", lambda r, g: group_advantages(r, g, "none"))
ADVANTAGES.add("rloo", rloo_advantages)
ADVANTAGES.add("pass_at_k", pass_at_k_advantages)
ADVANTAGES.add("reinforce_plus_plus", reinforce_plus_plus_advantages, info=TOKEN_LEVEL)
ADVANTAGES.add("reinforce_plus_plus_baseline", reinforce_plus_plus_baseline_advantages, info=TOKEN_LEVEL)


def token_level(estimator: str) -> bool:
    """Whether `estimator` gives per-token advantages from the loss mask (and the KL in the reward)."""
    return ADVANTAGES.info(estimator) == TOKEN_LEVEL


def compute_advantages(rewards: jax.Array, num_generations: int, estimator: str = "grpo", *,
                       mask: jax.Array | None = None, kl_penalty: jax.Array | None = None,
                       options: dict | None = None) -> jax.Array:
    """Advantages by registry name: ``[N]`` (grpo, grpo_batch_std, dr_grpo, rloo, pass_at_k, a loaded plug-in)
    or ``[N, C]`` (the token-level reinforce_plus_plus and reinforce_plus_plus_baseline, which read the loss
    ``mask [N, C]`` and the per-token ``kl_penalty``). ``options``: the estimator's keyword options (pass_at_k:
    ``k``; GRPOConfig.advantage_options)."""
    fn = ADVANTAGES.get(estimator)
    if options:
        fn = functools.partial(fn, **options)
    if token_level(estimator):
        if mask is None:
            raise ValueError(f"advantage estimator {estimator!r} is token-level: it needs the loss mask")
        adv, want = jnp.asarray(fn(rewards, num_generations, mask, kl_penalty), jnp.float32), jnp.shape(mask)
    else:
        adv, want = jnp.asarray(fn(rewards, num_generations), jnp.float32), jnp.shape(rewards)
    if adv.shape != want:
        raise ValueError(f"advantage estimator {estimator!r} returned {adv.shape}; expected {want}")
    return adv


# ------------------------------------------------------------------------------------------------- aggregation


class Normalizers(NamedTuple):
    """Global-batch constants of the aggregation (see the module docstring). Scalars, float32."""

    num_sequences: jax.Array  # sequences in the whole accumulated batch
    num_tokens: jax.Array  # active completion tokens in the whole accumulated batch
    max_completion_length: jax.Array  # the configured completion cap (dr_grpo)


def global_normalizers(
    mask: jax.Array, max_completion_length: int | None = None, sequence_mask: jax.Array | None = None
) -> Normalizers:
    """Normalisers from the masks ``[B_global, T]`` of the whole batch of one optimizer step.

    ``max_completion_length`` defaults to ``T``; ``sequence_mask [B_global]`` (1 = real sequence) excludes
    padding rows from ``num_sequences``. Counts are clamped to >= 1 so an all-masked batch yields loss 0.
    """
    m = jnp.asarray(mask) > 0
    n_seq = m.shape[0] if sequence_mask is None else jnp.sum(jnp.asarray(sequence_mask) > 0)
    L = m.shape[-1] if max_completion_length is None else max_completion_length
    return Normalizers(
        num_sequences=jnp.maximum(_f32(n_seq), 1.0),
        num_tokens=jnp.maximum(jnp.sum(m).astype(jnp.float32), 1.0),
        max_completion_length=_f32(L),
    )


def token_weights(mask: jax.Array, aggregation: str, normalizers: Normalizers) -> jax.Array:
    """Per-token loss weights ``[b, T]`` float32 of one micro-batch (table in the module docstring)."""
    m = (jnp.asarray(mask) > 0).astype(jnp.float32)
    if aggregation == "token_mean":
        return m / normalizers.num_tokens
    if aggregation == "sequence_mean":
        length = jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1.0)
        return m / (length * normalizers.num_sequences)
    if aggregation == "dr_grpo":
        return m / (normalizers.num_sequences * normalizers.max_completion_length)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}; got {aggregation!r}")


def aggregate_loss(per_token_loss: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum(per_token_loss * weights)``: one micro-batch's additive contribution (zero-weight entries never
    leak, even NaN/inf)."""
    w = _f32(weights)
    return jnp.sum(jnp.where(w != 0, _f32(per_token_loss) * w, 0.0))


def reference_aggregate(
    per_token_loss: jax.Array, mask: jax.Array, aggregation: str, max_completion_length: int | None = None
) -> jax.Array:
    """The one-batch definitions (TRL's formulas), for tests and single-batch use; equals
    ``aggregate_loss(l, token_weights(mask, agg, global_normalizers(mask, L)))``."""
    m = (jnp.asarray(mask) > 0).astype(jnp.float32)
    lm = jnp.where(m > 0, _f32(per_token_loss), 0.0)
    if aggregation == "token_mean":
        return jnp.sum(lm) / jnp.maximum(jnp.sum(m), 1.0)
    if aggregation == "sequence_mean":
        return jnp.mean(jnp.sum(lm, -1) / jnp.maximum(jnp.sum(m, -1), 1.0))
    if aggregation == "dr_grpo":
        L = m.shape[-1] if max_completion_length is None else max_completion_length
        return jnp.sum(lm) / (m.shape[0] * L)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}; got {aggregation!r}")


def token_metric_contributions(
    per_token: dict[str, jax.Array], mask: jax.Array, normalizers: Normalizers
) -> dict[str, jax.Array]:
    """``{name: sum(x * mask) / num_tokens}`` per metric: additive over micro-batches, summing to the global
    token mean. ``[b, 1]`` (sequence-level) entries are broadcast over the sequence's tokens."""
    w = token_weights(mask, "token_mean", normalizers)
    return {k: aggregate_loss(jnp.broadcast_to(_f32(v), w.shape), w) for k, v in per_token.items()}


# ------------------------------------------------------------------------------------------------- objective


def grpo_loss(
    logp: jax.Array,
    old_logp: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    normalizers: Normalizers,
    *,
    ref_logp: jax.Array | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    aggregation: str,
    sampling_weights: jax.Array | None = None,
    entropies: jax.Array | None = None,
    entropy_coef: float = 0.0,
    log_ratio_clamp: float | None = None,
    policy_loss: str = "ppo_clip",
    policy_loss_options=None,
    rng: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One micro-batch's GRPO loss contribution and metric contributions.

    ``logp``, ``old_logp``, ``ref_logp``, ``mask``: ``[b, T]``; ``advantages``: ``[b]`` (or ``[b, T]``);
    ``old_logp=None`` means on-policy (``stop_gradient(logp)``: ratio 1, gradient of ``A * logp``).
    Per token: ``l = policy_loss term (sampling_weights applied) + beta * KL_estimator(logp, ref_logp)``, then
    ``contribution = sum(l * token_weights(mask, aggregation, normalizers))``. ``aggregation`` has no default: a
    run's is its config's (``grpo.aggregation``); TRL's loss_type maps through ``LOSS_TYPE_AGGREGATION``.

    ``policy_loss``: a name of jaxrl.algorithms.policy_loss.POLICY_LOSSES (default the clipped surrogate,
    ``ppo_clip``), called with ``policy_loss_options`` (``policy_loss.resolve_options``); when those are None,
    ``ppo_clip``'s are made from ``epsilon_low``, ``epsilon_high``, ``delta``, ``importance_sampling_level`` and
    ``log_ratio_clamp`` (the log-ratio is clamped before ``exp``; the ``ratio`` metric alike). ``rng``: the
    micro-batch's key, for a loss that draws.

    ``beta`` must be a Python number (``beta == 0`` skips the reference entirely). ``entropies`` ``[b, T]``
    (per-token entropies of the policy) adds an ``entropy`` metric and, with ``entropy_coef``, the bonus
    ``- entropy_coef * token_mean(entropy)`` (a token mean whatever the aggregation, as TRL).

    Metrics (each additive over micro-batches, see :func:`token_metric_contributions`): ``policy_loss`` (token
    mean of the policy term), the loss's own (``ppo_clip``: ``ratio``, ``clip_fraction/low``,
    ``clip_fraction/high``, ``clip_fraction/region``), ``kl`` when ``beta != 0``, ``entropy`` when given.
    """
    chex.assert_rank(mask, 2)
    chex.assert_equal_shape([logp, mask] + ([] if old_logp is None else [old_logp]))
    chex.assert_axis_dimension(jnp.asarray(advantages), 0, mask.shape[0])
    old = jax.lax.stop_gradient(_f32(logp)) if old_logp is None else _f32(old_logp)
    if policy_loss_options is None:
        policy_loss_options = ClipOptions(
            epsilon_low=epsilon_low, epsilon_high=epsilon_low if epsilon_high is None else epsilon_high,
            log_ratio_clamp=log_ratio_clamp, delta=delta, importance_sampling_level=importance_sampling_level)
    terms = policy_loss_terms(policy_loss, PolicyLossInputs(logp, old, advantages, mask, sampling_weights, rng),
                              policy_loss_options)
    pg = terms.loss
    per_token = pg
    sg = jax.lax.stop_gradient
    per_token_metrics = {"policy_loss": sg(pg), **terms.metrics}
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta != 0 needs ref_logp")
        kl = kl_lib.kl(logp, ref_logp, kl_estimator, mask=mask)
        per_token = per_token + beta * kl
        per_token_metrics["kl"] = sg(kl)
    w = token_weights(mask, aggregation, normalizers)
    loss = aggregate_loss(jnp.broadcast_to(per_token, w.shape), w)
    if entropies is not None:
        per_token_metrics["entropy"] = sg(_f32(entropies))
        if entropy_coef:
            loss = loss - entropy_coef * aggregate_loss(entropies, token_weights(mask, "token_mean", normalizers))
    return loss, token_metric_contributions(per_token_metrics, mask, normalizers)


# ------------------------------------------------------------------------------------------------- shaping


def overlong_penalty(lengths: jax.Array, max_length: int, buffer: int, penalty_factor: float = 1.0) -> jax.Array:
    """DAPO soft overlong punishment ``[N] -> [N]`` (<= 0), added to the reward: 0 up to
    ``max_length - buffer`` tokens, then linear down to ``-penalty_factor`` at ``max_length`` (and beyond)."""
    if buffer <= 0:
        raise ValueError("buffer must be > 0")
    exceed = _f32(lengths) - (max_length - buffer)
    return -penalty_factor * jnp.clip(exceed / buffer, 0.0, 1.0)


def truncated_completions(completion_ids: jax.Array, mask: jax.Array, eos_token_ids) -> jax.Array:
    """``[B]`` bool: True when no completion token is a stop token (the completion hit the length cap)."""
    ids = jnp.asarray(completion_ids)
    is_eos = jnp.isin(ids, jnp.asarray(tuple(eos_token_ids), ids.dtype)) & (jnp.asarray(mask) > 0)
    return ~jnp.any(is_eos, axis=-1)


def mask_truncated_completions(mask: jax.Array, truncated: jax.Array) -> jax.Array:
    """Zero the loss mask ``[B, T]`` of truncated completions (``truncated [B]`` bool, e.g. finish_reason ==
    "length"), so they give no gradient (TRL ``mask_truncated_completions``). Keep the original mask for the
    normalisers only if truncated tokens should still count in the denominators (TRL does not)."""
    return jnp.asarray(mask) * (~jnp.asarray(truncated, bool))[:, None].astype(jnp.asarray(mask).dtype)
