"""Causal depthwise 1-D convolution with a carried state (the short conv of Gated DeltaNet).

y[t, c] = sum_{j=0..K-1} w[c, j] * x[t - (K-1) + j, c]   (cross-correlation, no kernel flip; w[:, K-1] multiplies
the current token). The state is the last K-1 *pre-conv* inputs, so decoding one token, or continuing a prefix,
equals one pass over the whole sequence.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def causal_depthwise_conv(x: jax.Array, weight: jax.Array, state: Optional[jax.Array] = None
                          ) -> tuple[jax.Array, jax.Array]:
    """x [B, T, C]; weight [C, K]; state [B, K-1, C] (zeros when None).

    Returns (y [B, T, C] before activation, new state [B, K-1, C]). Computed as K shifted multiply-adds: K is 4,
    so this is cheaper and simpler than a general convolution and works for T = 1 unchanged.
    """
    kernel = weight.shape[-1]
    batch, seq_len, channels = x.shape
    if state is None:
        state = jnp.zeros((batch, kernel - 1, channels), x.dtype)
    window = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w = weight.astype(x.dtype)
    y = sum(window[:, j:j + seq_len, :] * w[:, j] for j in range(kernel))
    new_state = window[:, window.shape[1] - (kernel - 1):, :]
    return y, new_state
