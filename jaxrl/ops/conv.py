"""Causal depthwise 1-D convolution with a carried state (the short conv of Gated DeltaNet).

y[t, c] = sum_{j=0..K-1} w[c, j] * x[t - (K-1) + j, c]   (cross-correlation, no kernel flip; w[:, K-1] multiplies
the current token). The state is the last K-1 *pre-conv* inputs, so decoding one token, or continuing a prefix,
equals one pass over the whole sequence.

Packed rows (`segment_ids`, training passes only): several sequences laid end to end in one row. A token sees only
the earlier tokens of its own sequence, so the window of a sequence's first K-1 tokens holds zeros where it would
reach into the previous sequence, exactly as that sequence alone would see its zero initial state.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def causal_depthwise_conv(x: jax.Array, weight: jax.Array, state: Optional[jax.Array] = None,
                          segment_ids: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
    """x [B, T, C]; weight [C, K]; state [B, K-1, C] (zeros when None); segment_ids [B, T] int (None: one
    sequence per row): each sequence's id, distinct within its row (the model numbers them,
    `jaxrl.models.qwen35.model.sequence_numbers`); no window crosses a sequence start (module docstring; only
    without a state).

    Returns (y [B, T, C] before activation, new state [B, K-1, C]). Computed as K shifted multiply-adds: K is 4,
    so this is cheaper and simpler than a general convolution and works for T = 1 unchanged.
    """
    kernel = weight.shape[-1]
    batch, seq_len, channels = x.shape
    if segment_ids is not None and state is not None:
        raise ValueError("causal_depthwise_conv: segment_ids are for passes without a carried state")
    if state is None:
        state = jnp.zeros((batch, kernel - 1, channels), x.dtype)
    window = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w = weight.astype(x.dtype)
    if segment_ids is not None:
        # Tap j reads the token (K-1-j) positions back; it counts only when that token is of the same sequence.
        # Before the row's start the window holds the zero state, whatever the mask says.
        seg = jnp.pad(segment_ids, ((0, 0), (kernel - 1, 0)), mode="edge")
        same = [(seg[:, j:j + seq_len] == segment_ids)[..., None].astype(x.dtype) for j in range(kernel)]
        y = sum(window[:, j:j + seq_len, :] * same[j] * w[:, j] for j in range(kernel))
    else:
        y = sum(window[:, j:j + seq_len, :] * w[:, j] for j in range(kernel))
    new_state = window[:, window.shape[1] - (kernel - 1):, :]
    return y, new_state
