"""Partial rotary position embedding (NeoX "rotate_half" style) as Qwen3.5 uses it for text.

For text-only inputs the interleaved M-RoPE of Qwen3.5 reduces exactly to 1-D RoPE on the first
`rotary_dim = head_dim * partial_rotary_factor` dims of each head (docs/design/qwen35-architecture.md §2.4); the remaining
dims pass through unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rotary_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """positions [B, T] int -> cos, sin [B, T, rotary_dim] in `dtype` (computed in fp32, then cast like HF)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rot/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_partial_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, hd]; cos/sin [B, T, rot]. Rotates x[..., :rot] and keeps x[..., rot:]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
