"""Rollout correction: importance weights for the sampler's numerics differing from the trainer's, and the
sampler-trainer mismatch metrics of every rollout (`grpo.rollout_correction` / `ppo.rollout_correction`).

    weights, metrics = rollout_correction(trainer_logp, sampler_logp, mask, "sequence_mask", 0.5, 2.0)  # host
    weights, contributions = in_step(logp, behaviour_logp, mask, normalisers, mode, lo, hi)           # jitted

The trainer side is a teacher-forced pass of the behaviour policy at temperature 1 (jaxrl/algorithms/online/
passes.py, role MISMATCH); where a step's own forward is that pass (an on-policy GRPO step at temperature 1: one
update from the very parameters that sampled), `in_step` computes the same weights and metrics from it inside the
jitted step instead of a second pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.algorithms import kl as kl_lib
from jaxrl.algorithms.online.settings import ROLLOUT_CORRECTIONS


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def rollout_importance_weights(
    old_logp: jax.Array,
    sampling_logp: jax.Array,
    mask: jax.Array,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> jax.Array:
    """Correction for the rollout engine's numerics differing from the trainer's (TRL's vLLM IS correction).

    w = exp(old_logp - sampling_logp) per token (``token_*``, ``[B, T]``) or, per sequence (``sequence_*``,
    ``[B, 1]``), exp of the masked MEAN of the token log-ratios: the geometric mean of the token ratios. TRL and
    verl's ``rollout_is=sequence`` take the product (exp of the sum), which a per-token gap of a few 1e-3 already
    pulls far from 1 on long completions (TRL issues 5814 / 5815: mean weight 0.57 where 0.99 was expected), and
    whose threshold would have to depend on the length; the geometric mean is the per-token gap of the sequence,
    one threshold for every length (verl's ``rollout_rs=geometric``, OpenRLHF's seq-mask-tis). ``*_truncate``
    clamps w to [clip_min, clip_max]; ``*_mask`` zeroes w outside it. NaN sampling log-probs count as ratio 1
    (and in a sequence's mean). The result is a constant (no gradient); multiply the per-token policy loss by it
    before adding KL.
    """
    m = jnp.asarray(mask) > 0
    diff = jnp.where(m, _f32(old_logp) - _f32(sampling_logp), 0.0)
    diff = jnp.where(jnp.isnan(diff), 0.0, diff)
    if mode.startswith("sequence_"):
        diff = jnp.sum(diff, axis=-1, keepdims=True) / jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1)
    elif not mode.startswith("token_"):
        raise ValueError(f"unknown mode {mode!r}: token_truncate, token_mask, sequence_truncate, sequence_mask")
    w = jnp.exp(diff)
    lo = -jnp.inf if clip_min is None else clip_min
    hi = jnp.inf if clip_max is None else clip_max
    if mode.endswith("_truncate"):
        w = jnp.clip(w, lo, hi)
    elif mode.endswith("_mask"):
        w = jnp.where((w < lo) | (w > hi), 0.0, w)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return jax.lax.stop_gradient(w)


def rollout_correction(
    trainer_logp, sampling_logp, mask, mode: str = "none", clip_min: float | None = None,
    clip_max: float | None = 3.0,
):
    """The rollout correction of one rollout and its mismatch metrics, on the host: ``(weights, metrics)``.

    ``trainer_logp`` (a teacher-forced pass of the behaviour policy), ``sampling_logp`` (what the sampler
    reported for the tokens it drew) and ``mask`` (1 on generated tokens) are ``[N, C]``. ``weights`` is None for
    ``mode="none"``, else `rollout_importance_weights` broadcast to ``[N, C]`` float32 (0 off the mask).
    ``metrics`` (always; NaN sampler log-probs are left out of the gap):

    - ``mismatch/logp_abs_mean``, ``mismatch/logp_abs_max``: token mean and max of |trainer - sampler|;
    - ``mismatch/kl_k3``: token mean of the k3 estimate of KL(sampler || trainer) (the samples are the sampler's);
    - ``mismatch/is_weight_mean|min|max``: the raw weights (before truncation / masking) at the mode's level: per
      token, or per sequence for ``sequence_*`` (over sequences with a generated token);
    - ``mismatch/clipped_fraction`` (``*_truncate``) or ``mismatch/masked_fraction`` (``*_mask``): the share of
      those weights outside [clip_min, clip_max].
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout_correction={mode!r}; choose one of {ROLLOUT_CORRECTIONS}")
    m = np.asarray(mask) > 0
    t, s = np.asarray(trainer_logp, np.float64), np.asarray(sampling_logp, np.float64)
    known = m & ~np.isnan(s)
    d = np.where(known, t - s, 0.0)  # log(pi_trainer / pi_sampler) per token
    n = max(int(known.sum()), 1)
    k3 = np.asarray(kl_lib.kl(np.where(known, s, 0.0), np.where(known, t, 0.0), "k3"), np.float64)
    metrics = {"mismatch/logp_abs_mean": float(np.abs(d).sum() / n),
               "mismatch/logp_abs_max": float(np.abs(d).max()) if known.any() else 0.0,
               "mismatch/kl_k3": float(np.where(known, k3, 0.0).sum() / n)}
    level = "sequence" if mode.startswith("sequence_") else "token"
    if level == "token":
        raw = np.exp(d)[m]
    else:
        rows = m.any(-1)
        raw = np.exp(d.sum(-1) / np.maximum(m.sum(-1), 1))[rows]
    if raw.size:
        metrics.update({"mismatch/is_weight_mean": float(raw.mean()), "mismatch/is_weight_min": float(raw.min()),
                        "mismatch/is_weight_max": float(raw.max())})
    if mode == "none":
        return None, metrics
    lo = -np.inf if clip_min is None else clip_min
    hi = np.inf if clip_max is None else clip_max
    outside = float(((raw < lo) | (raw > hi)).mean()) if raw.size else 0.0
    metrics["mismatch/clipped_fraction" if mode.endswith("_truncate") else "mismatch/masked_fraction"] = outside
    w = np.asarray(rollout_importance_weights(trainer_logp, sampling_logp, mask, mode, clip_min, clip_max),
                   np.float32)
    return np.where(m, np.broadcast_to(w, m.shape), 0.0).astype(np.float32), metrics


def in_step(logp: jax.Array, sampling_logp: jax.Array, mask: jax.Array, num_tokens: jax.Array, mode: str,
            clip_min: float | None, clip_max: float | None):
    """`rollout_correction` inside a jitted step, from the step's own log-probs `logp` [b, C] (stop-gradient;
    temperature 1) of a micro-batch: (weights [b, C] or None, metric contributions). Token means are shares of the
    global batch's `num_tokens` (additive over micro-batches); maxima and minima are named `_max` / `_min` (the
    step reduces them so); sequence-level weight statistics are token-weighted here."""
    m = jnp.asarray(mask) > 0
    t = jax.lax.stop_gradient(_f32(logp))
    s = _f32(sampling_logp)
    known = m & ~jnp.isnan(s)
    d = jnp.where(known, t - s, 0.0)
    k3 = kl_lib.kl(jnp.where(known, s, 0.0), jnp.where(known, t, 0.0), "k3")
    share = lambda x: jnp.sum(jnp.where(known, x, 0.0)) / jnp.maximum(num_tokens, 1.0)  # noqa: E731
    level = d if mode in ("none",) or mode.startswith("token_") else (
        jnp.sum(d, -1, keepdims=True) / jnp.maximum(jnp.sum(m, -1, keepdims=True), 1))
    raw = jnp.broadcast_to(jnp.exp(level), d.shape)
    metrics = {"mismatch/logp_abs_mean": share(jnp.abs(d)),
               "mismatch/logp_abs_max": jnp.max(jnp.where(known, jnp.abs(d), 0.0)),
               "mismatch/kl_k3": share(k3),
               "mismatch/is_weight_mean": share(raw),
               "mismatch/is_weight_max": jnp.max(jnp.where(m, raw, 0.0)),
               "mismatch/is_weight_min": jnp.min(jnp.where(m, raw, jnp.inf))}
    if mode == "none":
        return None, metrics
    lo = -jnp.inf if clip_min is None else clip_min
    hi = jnp.inf if clip_max is None else clip_max
    outside = (raw < lo) | (raw > hi)
    metrics["mismatch/clipped_fraction" if mode.endswith("_truncate") else "mismatch/masked_fraction"] = \
        share(outside.astype(jnp.float32))
    w = rollout_importance_weights(t, s, mask, mode, clip_min, clip_max)
    return jnp.where(m, jnp.broadcast_to(w, m.shape), 0.0), metrics
