"""The gated delta rule (Gated DeltaNet core), in a chunked form for sequences and a recurrent form for decode.

Recurrence per value head h (docs/qwen35-architecture.md §3.1), with state S [dk, dv] in fp32:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,        o_t = S_t^T q_t

after q and k are L2-normalised and q is scaled by dk^-0.5. Value head h reads key head h // (Hv / Hk).

The chunked form (§3.2) processes C tokens at a time: everything inside a chunk is a handful of [C, C] and
[C, d] matmuls computed for all chunks at once; only the [dk, dv] state is carried by one `lax.scan` over the
T / C chunks. Cost is linear in T. The recurrent form is a scan over tokens and is what decode uses (T = 1).
Both take and return the state, so a prefix plus a continuation equals one pass.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

_L2_EPS = 1e-6


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)


def _prepare(q, k, v, g, beta):
    """GQA repeat, fp32, L2 norm, q scaling; move heads before time: [B, H, T, d] and [B, H, T]."""
    num_k_heads, num_v_heads = k.shape[2], v.shape[2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    rep = num_v_heads // num_k_heads
    if rep > 1:  # value head h uses key head h // rep (repeat-interleave, as HF/PEFT/vLLM do)
        q = jnp.repeat(q, rep, axis=2)
        k = jnp.repeat(k, rep, axis=2)
    f32 = jnp.float32
    q = _l2norm(q.astype(f32)) * (q.shape[-1] ** -0.5)
    k = _l2norm(k.astype(f32))
    to_bhtd = lambda x: jnp.swapaxes(x, 1, 2)
    return (to_bhtd(q), to_bhtd(k), to_bhtd(v.astype(f32)), jnp.swapaxes(g.astype(f32), 1, 2),
            jnp.swapaxes(beta.astype(f32), 1, 2))


def _unit_lower_inverse(strict: jax.Array) -> jax.Array:
    """(I + N)^-1 for strictly lower-triangular N [..., n, n], with matmuls only.

    Blocks: inv([[A, 0], [C, D]]) = [[A^-1, 0], [-D^-1 C A^-1, D^-1]], recursively down to 16 x 16, where
    (I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8) exactly (N is nilpotent). At n = 64 this is about 15x fewer
    flops than squaring the whole 64 x 64 matrix (log2(64) squarings), which dominated the chunked kernel's time.
    """
    size = strict.shape[-1]
    eye = jnp.eye(size, dtype=strict.dtype)
    if size <= 16 or size % 2:
        inverse, power, reach = eye - strict, strict, 1
        while 2 * reach < size:  # after this loop `inverse` holds sum_{k < 2*reach} (-N)^k >= n terms
            power = power @ power
            inverse = inverse @ (eye + power)
            reach *= 2
        return inverse
    h = size // 2
    a_inv = _unit_lower_inverse(strict[..., :h, :h])
    d_inv = _unit_lower_inverse(strict[..., h:, h:])
    lower_left = -(d_inv @ strict[..., h:, :h] @ a_inv)
    top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([lower_left, d_inv], axis=-1)], axis=-2)


def solve_unit_lower(strict: jax.Array, rhs: jax.Array, method: str = "auto") -> jax.Array:
    """X with (I + strict) X = rhs, for strictly lower-triangular `strict` [..., C, C] and rhs [..., C, n].

    "matmul" (the default, "auto"): the exact inverse from matmuls only (`_unit_lower_inverse`: block
    recursion over nilpotent-series 16 x 16 blocks), which every backend runs fast. "triangular": XLA's batched
    triangular solve; kept as a cross-check, it is erratic on CPU (measured 20-50x slower than the matmul form at
    batch >= 128 chunks) and slow on accelerators.
    """
    if method == "auto":
        method = "matmul"
    if method == "triangular":
        eye = jnp.eye(strict.shape[-1], dtype=strict.dtype)
        return solve_triangular(strict + eye, rhs, lower=True, unit_diagonal=True)
    if method != "matmul":
        raise ValueError(f"method must be 'auto', 'triangular' or 'matmul', got {method!r}")
    return _unit_lower_inverse(strict) @ rhs


def chunk_gated_delta_rule(
    q: jax.Array,  # [B, T, Hk, dk]
    k: jax.Array,  # [B, T, Hk, dk]
    v: jax.Array,  # [B, T, Hv, dv]
    g: jax.Array,  # [B, T, Hv] log-decay (<= 0)
    beta: jax.Array,  # [B, T, Hv]
    initial_state: Optional[jax.Array] = None,  # [B, Hv, dk, dv] fp32
    chunk_size: int = 64,
    solve_method: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Returns (o [B, T, Hv, dv] in v's dtype, final state [B, Hv, dk, dv] fp32)."""
    out_dtype = v.dtype
    batch, seq_len = q.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    num_heads, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    C = chunk_size
    pad = (-seq_len) % C
    if pad:  # padded steps have g = 0 and beta = 0, so they leave the state untouched
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    n_chunks = (seq_len + pad) // C
    chunked = lambda x: x.reshape(batch, num_heads, n_chunks, C, *x.shape[3:])
    q, k, v, g, beta = map(chunked, (q, k, v, g, beta))

    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C] log of the decay from the chunk start to position i
    lower = jnp.tril(jnp.ones((C, C), dtype=bool))
    # exp(cum_i - cum_j) for j <= i; the upper triangle is masked *before* exp so it cannot overflow.
    log_decay = jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf)
    decay = jnp.exp(log_decay)  # [B, H, N, C, C]

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    # WY/UT representation of the C delta-rule updates of a chunk: solve (I + strictly_lower(A)) X = RHS.
    a_mat = jnp.einsum("...id,...jd->...ij", k_beta, k) * decay
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = solve_unit_lower(jnp.tril(a_mat, -1), rhs, solve_method)
    new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]  # [B,H,N,C,dv], [B,H,N,C,dk]

    intra = jnp.einsum("...id,...jd->...ij", q, k) * decay  # causal attention inside the chunk, diagonal kept
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [B, H, N]

    state0 = (jnp.zeros((batch, num_heads, dk, dv), jnp.float32) if initial_state is None
              else initial_state.astype(jnp.float32))

    def step(state, xs):
        u, w, qd, kd, att, dec = xs  # one chunk: [B,H,C,dv], [B,H,C,dk], [B,H,C,dk], [B,H,C,dk], [B,H,C,C], [B,H]
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, state)
        out = jnp.einsum("bhck,bhkv->bhcv", qd, state) + jnp.einsum("bhcs,bhsv->bhcv", att, v_new)
        state = state * dec[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kd, v_new)
        return state, out

    chunk_first = lambda x: jnp.moveaxis(x, 2, 0)
    final_state, outs = jax.lax.scan(
        step, state0, tuple(map(chunk_first, (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay))))
    o = jnp.moveaxis(outs, 0, 2).reshape(batch, num_heads, n_chunks * C, dv)[:, :, :seq_len]
    return jnp.swapaxes(o, 1, 2).astype(out_dtype), final_state


def recurrent_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
    initial_state: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token form; same arguments and results as `chunk_gated_delta_rule`."""
    out_dtype = v.dtype
    batch = q.shape[0]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    num_heads, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    state0 = (jnp.zeros((batch, num_heads, dk, dv), jnp.float32) if initial_state is None
              else initial_state.astype(jnp.float32))

    def step(state, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B,H,dk], [B,H,dk], [B,H,dv], [B,H], [B,H]
        state = state * jnp.exp(g_t)[..., None, None]
        predicted = jnp.einsum("bhkv,bhk->bhv", state, k_t)
        delta = (v_t - predicted) * b_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

    time_first = lambda x: jnp.moveaxis(x, 2, 0)
    final_state, outs = jax.lax.scan(step, state0, tuple(map(time_first, (q, k, v, g, beta))))
    o = jnp.moveaxis(outs, 0, 1)  # [B, T, H, dv]
    return o.astype(out_dtype), final_state
