"""Masked grouped-query softmax attention over a key/value buffer (fresh keys or a KV cache)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                  kv_head_major: bool = False) -> jax.Array:
    """q [B, T, nH, hd]; k, v [B, S, nKV, hd] (or [B, nKV, S, hd] with kv_head_major, the KV-cache layout);
    mask [B, T, S] bool (True = may attend).

    Query head h reads KV head h // (nH / nKV). Scores and softmax are fp32; rows with no allowed key (left
    padding) produce zeros instead of NaN. Returns [B, T, nH, hd] in q's dtype.
    """
    batch, seq_len, num_heads, head_dim = q.shape
    num_kv = k.shape[1] if kv_head_major else k.shape[2]
    groups = num_heads // num_kv
    qg = q.reshape(batch, seq_len, num_kv, groups, head_dim)
    kv = "bksd" if kv_head_major else "bskd"  # head-major: batch dims lead, so the cache is read without a transpose
    scores = jnp.einsum(f"btkgd,{kv}->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    allowed = mask[:, None, None, :, :]
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = (weights / jnp.where(denom > 0, denom, 1.0)).astype(q.dtype)
    out = jnp.einsum(f"bkgts,{kv}->btkgd", probs, v)
    return out.reshape(batch, seq_len, num_heads, head_dim)
