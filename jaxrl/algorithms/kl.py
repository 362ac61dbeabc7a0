"""Per-token KL estimators between the policy and a reference policy, shared by GRPO and PPO.

All take ``logp`` and ``ref_logp`` of the sampled tokens, shape ``[B, T]`` (any shape works, elementwise), and
return the per-token estimate of KL(pi_theta || pi_ref) with the same shape, in float32. The samples come from the
policy (or the rollout policy), which is what makes these unbiased/low-variance estimators (Schulman, "Approximating
KL divergence"). With ``d = ref_logp - logp`` (log of the ratio pi_ref / pi_theta):

========================  ==========================================  ===================================
name                      value                                       notes
========================  ==========================================  ===================================
``k1``                    ``-d = logp - ref_logp``                    unbiased, can be negative
``k2``                    ``d**2 / 2``                                biased, >= 0 (verl "mse")
``k3``                    ``exp(d) - 1 - d`` computed stably          unbiased, >= 0 (TRL GRPO, OpenRLHF)
``low_var_kl``            k3 with d clamped to [-20, 20] and the      verl's default ``kl_loss_type``
                          result clamped to [-10, 10]
``abs``                   ``|d|``                                     verl "abs"
``k3+``                   value of k3, gradient of k2                 verl's straight-through variant
========================  ==========================================  ===================================

Why k3 is computed the way it is: ``exp(d) - d - 1`` subtracts numbers near 1, so in float32 it returns 0 or
garbage (and can go slightly negative: a reported Tunix bug) once |d| < ~1e-3, exactly the regime of a policy
close to its reference. We use ``expm1(d) - d`` and, for |d| < 0.5, the Taylor series d^2 (1/2 + d/6 + d^2/24 +
...) which is accurate to float32 rounding and non-negative by construction. Inputs are upcast to float32 first,
so bf16 log-probs give float32 KL.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxrl.utils.registry import Registry

__all__ = ["kl", "kl_k1", "kl_k2", "kl_k3", "kl_low_var", "kl_abs", "kl_k3_plus", "expm1_minus_x", "ESTIMATORS",
           "KL_ESTIMATORS"]

# Below this |d| the series (through d^9) is used: its truncation error is < 2e-9 relative there, while the
# direct form's rounding error, ~1.2e-7 / |d| relative, is already small above it.
_SERIES_CUTOFF = 0.5
_COEFS = tuple(1.0 / math.factorial(k) for k in range(2, 10))  # 1/2!, ..., 1/9!


def expm1_minus_x(d: jax.Array) -> jax.Array:
    """``exp(d) - 1 - d`` accurate in float32 for all d (>= 0 everywhere). Shape preserved."""
    d = jnp.asarray(d, jnp.float32)
    small = jnp.abs(d) < _SERIES_CUTOFF
    # Double-where: feed each branch only values it is valid for, so the unused branch cannot create inf/NaN
    # gradients (e.g. d**6 overflowing for huge d).
    ds = jnp.where(small, d, 0.0)
    poly = jnp.full_like(ds, _COEFS[-1])
    for c in reversed(_COEFS[:-1]):  # Horner
        poly = poly * ds + c
    series = ds * ds * poly
    dl = jnp.where(small, 1.0, d)
    direct = jnp.expm1(dl) - dl
    return jnp.where(small, series, direct)


# Estimators by name: fn(logp [B, T], ref_logp [B, T]) -> [B, T]. The built-ins register themselves below; a
# user's own comes in through jaxrl.algorithms.plugins, which checks it first.
KL_ESTIMATORS = Registry("kl", hint="An estimator of your own: a `plugins` entry of kind kl (jaxrl.algorithms.plugins)")


def _d(logp, ref_logp):
    return jnp.asarray(ref_logp, jnp.float32) - jnp.asarray(logp, jnp.float32)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """``logp - ref_logp``  [B, T] -> [B, T]."""
    return -_d(logp, ref_logp)


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """``0.5 * (logp - ref_logp)**2``  [B, T] -> [B, T]."""
    d = _d(logp, ref_logp)
    return 0.5 * d * d


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """``exp(d) - 1 - d`` with ``d = ref_logp - logp``, stable in float32, >= 0  [B, T] -> [B, T]."""
    return expm1_minus_x(_d(logp, ref_logp))


@KL_ESTIMATORS.register("low_var_kl")
def kl_low_var(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """verl's ``low_var_kl``: k3 on d clamped to [-20, 20], result clamped to [-10, 10]  [B, T] -> [B, T].

    The clamps bound the loss (and zero its gradient) for tokens whose probability collapsed under one policy.
    """
    d = jnp.clip(_d(logp, ref_logp), -20.0, 20.0)
    return jnp.clip(expm1_minus_x(d), -10.0, 10.0)


@KL_ESTIMATORS.register("abs")
def kl_abs(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """``|logp - ref_logp|``  [B, T] -> [B, T]."""
    return jnp.abs(_d(logp, ref_logp))


@KL_ESTIMATORS.register("k3+")
def kl_k3_plus(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Value of k3, gradient of k2 (unbiased gradient of KL in expectation)  [B, T] -> [B, T]."""
    k2 = kl_k2(logp, ref_logp)
    return k2 + jax.lax.stop_gradient(kl_k3(logp, ref_logp) - k2)


ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs", "k3+")


def kl(logp: jax.Array, ref_logp: jax.Array, estimator: str = "k3", mask: jax.Array | None = None) -> jax.Array:
    """Per-token KL estimate by registry name (built-ins above, or a loaded ``kl`` plug-in)  -> [B, T] float32.

    ``mask`` (same shape, 0 = padding): the estimator sees ``logp == ref_logp == 0`` at padded positions, so the
    result is 0 there and so is its gradient. Masking only the result is not enough: padding may hold any
    log-prob (k3's ``exp(ref_logp - logp)`` overflows once ``logp`` < ~-88), and an inf there turns the zero
    cotangent of the masked loss into a NaN gradient.
    """
    if mask is not None:
        keep = jnp.asarray(mask) != 0
        logp = jnp.where(keep, jnp.asarray(logp, jnp.float32), 0.0)
        ref_logp = jnp.where(keep, jnp.asarray(ref_logp, jnp.float32), 0.0)
    out = KL_ESTIMATORS.get(estimator)(logp, ref_logp)
    if mask is not None:
        out = jnp.where(keep, out, 0.0)
    return jnp.asarray(out, jnp.float32)
