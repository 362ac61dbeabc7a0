"""The gated delta rule (Gated DeltaNet core): a chunked form for sequences, a one-pass update for decode, and the
token-by-token recurrence as the reference.

Recurrence per value head h (docs/design/qwen35-architecture.md §3.1), with state S [dk, dv] in fp32:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,        o_t = S_t^T q_t

after q and k are L2-normalised and q is scaled by dk^-0.5. Value head h reads key head h // (Hv / Hk): the
value heads are grouped [Hk, Hv / Hk] and every product with q or k broadcasts the key head over its group, so
q and k are never repeated to Hv heads.

`chunk_gated_delta_rule` (§3.2) processes C tokens at a time (C = `chunk_size`, the model's `gdn_chunk_size`).
Everything inside a chunk is computed for all chunks at once; one `lax.scan` over the T / C chunks carries the
[dk, dv] state and does only the two state products (v_new = U - W S and S <- decay S + k'^T v_new); the
outputs o = q' S + intra v_new are computed after the scan for every chunk at once, as large batched matmuls.

Dtypes: the decays, their cumulative sums, the triangular inverse and the carried state are fp32. With bf16
inputs the matmul operands (q, k, v, W, the state as read by a product, the intra-chunk weights) are bf16 and
every product accumulates in fp32 (`preferred_element_type`), like fla's kernels; with fp32 inputs everything
is fp32. Every product with fp32 operands (the triangular inverse's always; all of them with fp32 inputs) runs at
`FP32_PRECISION`, HIGHEST: at its default precision XLA:GPU may round fp32 operands to TF32 (a 10-bit mantissa)
on tensor cores, and the inverse chains products (the squarings of N, then the block products) whose roundings
compound. With bf16 inputs only the inverse's C x C products are fp32, a small share of the step's flops, so
full fp32 costs little there; the all-fp32 path pays fp32 throughput everywhere, for the exactness it exists
for. bf16 operands keep the default (a bf16 x bf16 product is exact in fp32 accumulation). XLA:CPU computes
fp32 dots in full precision either way (tests/test_gdn_precision.py: the same output at DEFAULT and HIGHEST).
Measured against the fp32 path on random unit-scale inputs (B=2, T=300, Hk=2, Hv=4, d=64,
tests/test_gated_delta_fast.py): the bf16 path's output error is about 1% of the output scale (bound asserted:
3%), of the same order as rounding the fp32 output itself to bf16 several times over.

`gated_delta_decode_step` is the T = 1 update:
    o = a S^T q + (k . q) delta,   S' = a S + k delta^T,   delta = beta (v - a S^T k),   a = exp(g)
which equals the recurrence exactly in exact arithmetic. Written plainly it moves the [dk, dv] state three
times (S^T [k; q] reads it, S' = a S + k delta^T reads it again and writes it): delta needs the whole column sum
S^T k before any entry of S' can be written, which no single elementwise pass can wait for.
`gated_delta_decode_step_deferred`, what the model's decode runs, moves it twice: the rank-1 update of step t
(its decay a_t, key k_t and delta_t, a few hundred floats per head) is kept *pending* beside the stored state and
applied when step t + 1 reads it. Step t + 1 then computes S_t = a_t S_{t-1} + k_t delta_t^T entry by entry while
reading S_{t-1}, writes S_t (the new stored state) and reduces it against [k; q] in the same pass: one read and
one write, in one fused loop where the compiler fuses a reduction with a side output of its input (XLA:GPU
does). The numbers are those of the plain update: the same formula, applied one step later. The state may be
stored in bf16 (the model's `gdn_state_dtype`): it is read into fp32, updated in fp32 and rounded once per step
when written back (the deferred form rounds S_t exactly where the plain one does, before reading it).

Both forms take and return the state, so a prefix plus a continuation equals one pass.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

_L2_EPS = 1e-6
# The precision of every dot with fp32 operands (module docstring, Dtypes). A module constant so a test can trace
# the op at DEFAULT and compare.
FP32_PRECISION = jax.lax.Precision.HIGHEST


def _precision(*operands: jax.Array) -> Optional[jax.lax.Precision]:
    """FP32_PRECISION when any operand is fp32 (an fp32 x bf16 product is promoted to fp32), else the default."""
    return FP32_PRECISION if any(x.dtype == jnp.float32 for x in operands) else None


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=_precision(a, b))


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)


def compute_dtype(dtype) -> jnp.dtype:
    """The matmul operand dtype of the chunked form: bf16 for bf16 inputs, fp32 otherwise."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else jnp.dtype(jnp.float32)


def _check_heads(num_k_heads: int, num_v_heads: int) -> int:
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
    return num_v_heads // num_k_heads


def _unit_lower_inverse(strict: jax.Array) -> jax.Array:
    """(I + N)^-1 for strictly lower-triangular N [..., n, n], with matmuls only.

    Blocks: inv([[A, 0], [C, D]]) = [[A^-1, 0], [-D^-1 C A^-1, D^-1]], recursively down to 16 x 16, where
    (I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8) exactly (N is nilpotent). At n = 64 this is about 15x fewer
    flops than squaring the whole 64 x 64 matrix (log2(64) squarings), which would dominate the chunked kernel's
    time (measured in benchmarks/RESULTS.md, section 'Idle machine (the numbers to quote)').
    """
    size = strict.shape[-1]
    eye = jnp.eye(size, dtype=strict.dtype)
    if size <= 16 or size % 2:
        inverse, power, reach = eye - strict, strict, 1
        while 2 * reach < size:  # after this loop `inverse` holds sum_{k < 2*reach} (-N)^k >= n terms
            power = _matmul(power, power)
            inverse = _matmul(inverse, eye + power)
            reach *= 2
        return inverse
    h = size // 2
    a_inv = _unit_lower_inverse(strict[..., :h, :h])
    d_inv = _unit_lower_inverse(strict[..., h:, h:])
    lower_left = -_matmul(_matmul(d_inv, strict[..., h:, :h]), a_inv)
    top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([lower_left, d_inv], axis=-1)], axis=-2)


def unit_lower_inverse(strict: jax.Array, method: str = "auto") -> jax.Array:
    """(I + strict)^-1 for strictly lower-triangular `strict` [..., C, C].

    "matmul" (the default, "auto"): the exact inverse from matmuls only (`_unit_lower_inverse`: block recursion
    over nilpotent-series 16 x 16 blocks), which every backend runs fast. "triangular": XLA's batched triangular
    solve against the identity; kept as a cross-check, it is erratic and far slower on CPU (measured in
    benchmarks/RESULTS.md, section 'Figures formerly quoted in code comments') and slow on accelerators.
    """
    if method == "auto":
        method = "matmul"
    if method == "triangular":
        eye = jnp.broadcast_to(jnp.eye(strict.shape[-1], dtype=strict.dtype), strict.shape)
        return solve_triangular(strict + eye, eye, lower=True, unit_diagonal=True)
    if method != "matmul":
        raise ValueError(f"method must be 'auto', 'triangular' or 'matmul', got {method!r}")
    return _unit_lower_inverse(strict)


def _segment_decays(segment_ids: jax.Array, g: jax.Array, lower: jax.Array, pad: int):
    """The chunked form's decays for packed rows: several sequences end to end, the state reset to zero at each
    sequence start (flash-linear-attention's `cu_seqlens`). segment_ids [B, T]: each sequence's id, distinct
    within its row (`jaxrl.models.qwen35.model.sequence_numbers`); g [B, Hk, N, r, C] (chunked, padded);
    lower [C, C]. Returns (decay [.., C, C], state_decay [.., C], to_end [.., C], chunk_decay [..]) as
    `chunk_gated_delta_rule` uses them:
      * decay_ij = 0 across sequences, so the WY inverse and the intra-chunk attention never mix two of them;
      * state_decay_i = 0 from the first start inside the chunk on: the entering state reaches only the tokens of
        the sequence that was running when the chunk began;
      * to_end_i = 0 outside the chunk's last sequence, chunk_decay = 0 when a sequence starts inside the chunk:
        the state leaving the chunk is that of its last sequence alone.
    The log-decays are summed per sequence (restarting at each start), not as one running sum whose differences
    are taken: after a strongly decaying sequence the running sum is large, and the difference of two large fp32
    numbers would lose the precision of the next sequence's decays. A zero decay is a -inf exponent, not a very
    negative log-decay: exactly 0, and no difference of huge values anywhere."""
    batch, _, n_chunks, _, size = g.shape
    seg = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge") if pad else segment_ids  # padding continues
    starts = jnp.concatenate([jnp.zeros_like(seg[:, :1], dtype=bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    seg = seg.reshape(batch, 1, n_chunks, 1, size)
    starts = starts.reshape(batch, 1, n_chunks, 1, size)
    same = lower & (seg[..., :, None] == seg[..., None, :])  # [B, 1, N, 1, C, C]: j <= i, the same sequence
    cum = jnp.sum(jnp.where(same, g[..., None, :], 0.0), axis=-1)  # log-decay from the sequence's start (or chunk's)
    decay = jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    running = jnp.cumsum(starts.astype(jnp.int32), axis=-1) == 0  # no start at or before i in this chunk
    # Masked before exp, like `decay`: an unselected exp(cum_last - cum_i) of an earlier sequence can overflow,
    # and its inf would turn the where's zero cotangent into NaN.
    masked_exp = lambda keep, x: jnp.exp(jnp.where(keep, x, -jnp.inf))  # noqa: E731
    state_decay = masked_exp(running, cum)
    to_end = masked_exp(seg == seg[..., -1:], cum[..., -1:] - cum)
    chunk_decay = masked_exp(running[..., -1], cum[..., -1])
    return decay, state_decay, to_end, chunk_decay


def chunk_gated_delta_rule(
    q: jax.Array,  # [B, T, Hk, dk]
    k: jax.Array,  # [B, T, Hk, dk]
    v: jax.Array,  # [B, T, Hv, dv]
    g: jax.Array,  # [B, T, Hv] log-decay (<= 0)
    beta: jax.Array,  # [B, T, Hv]
    initial_state: Optional[jax.Array] = None,  # [B, Hv, dk, dv], fp32 (or bf16 storage)
    chunk_size: int = 64,
    solve_method: str = "auto",
    segment_ids: Optional[jax.Array] = None,  # [B, T] int: packed sequences (`_segment_decays`); None: one a row
) -> tuple[jax.Array, jax.Array]:
    """Returns (o [B, T, Hv, dv] in v's dtype, final state [B, Hv, dk, dv] fp32)."""
    f32 = jnp.float32
    out_dtype = v.dtype
    cd = compute_dtype(v.dtype)
    batch, seq_len, num_k_heads, dk = q.shape
    num_v_heads, dv = v.shape[2], v.shape[3]
    rep = _check_heads(num_k_heads, num_v_heads)
    C = chunk_size
    pad = (-seq_len) % C
    n_chunks = (seq_len + pad) // C

    # Key heads [B, Hk, N, C, dk]; value heads grouped by their key head [B, Hk, N, r, C, *] (batch dimensions of
    # every product leading, which XLA:CPU needs for bf16 x bf16 -> fp32 dots).
    def key_heads(x):
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else x
        x = x.reshape(batch, n_chunks, C, num_k_heads, x.shape[-1])
        return jnp.transpose(x, (0, 3, 1, 2, 4)).astype(cd)

    def value_heads(x):
        tail = x.shape[3:]
        if pad:  # padded steps have g = 0 and beta = 0: they leave the state untouched
            x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        x = x.reshape(batch, n_chunks, C, num_k_heads, rep, *tail)
        return jnp.transpose(x, (0, 3, 1, 4, 2) + tuple(range(5, x.ndim)))

    q = key_heads(_l2norm(q.astype(f32)) * (dk ** -0.5))
    k = key_heads(_l2norm(k.astype(f32)))
    v = value_heads(v).astype(cd)
    g = value_heads(g.astype(f32))
    beta = value_heads(beta.astype(f32))

    cum = jnp.cumsum(g, axis=-1)  # [B, Hk, N, r, C]: log of the decay from the chunk start to position i
    lower = jnp.tril(jnp.ones((C, C), dtype=bool))
    # exp(cum_i - cum_j) for j <= i; the upper triangle is masked *before* exp so it cannot overflow.
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [B, Hk, N, r, C, C]
    state_decay = jnp.exp(cum)  # decay from the state entering the chunk to position i
    to_end = jnp.exp(cum[..., -1:] - cum)  # decay from position i to the chunk's end
    chunk_decay = jnp.exp(cum[..., -1])  # [B, Hk, N, r]
    if segment_ids is not None:
        decay, state_decay, to_end, chunk_decay = _segment_decays(segment_ids, g, lower, pad)

    dot = lambda spec, a, b: jnp.einsum(spec, a, b, preferred_element_type=f32,  # noqa: E731
                                        precision=_precision(a, b))
    kk = dot("bhncd,bhnsd->bhncs", k, k)[:, :, :, None]  # [B, Hk, N, 1, C, C], shared by the key head's group
    qk = dot("bhncd,bhnsd->bhncs", q, k)[:, :, :, None]
    # WY/UT representation of the C delta-rule updates of a chunk: with A_ij = beta_i (k_i . k_j) L_ij (i > j),
    # U = (I + A)^-1 diag(beta) V and W = (I + A)^-1 diag(beta exp(cum)) K.
    inverse = unit_lower_inverse(jnp.tril(kk * beta[..., :, None] * decay, -1), solve_method)
    inverse = inverse * beta[..., None, :]
    new_values = dot("bhnrcs,bhnrsv->bhnrcv", inverse.astype(cd), v)  # U [B, Hk, N, r, C, dv] fp32
    k_cumdecay = dot("bhnrcs,bhnsd->bhnrcd", (inverse * state_decay[..., None, :]).astype(cd), k)  # W
    intra = (qk * decay).astype(cd)  # causal attention inside the chunk, diagonal kept
    state0 = (jnp.zeros((batch, num_k_heads, rep, dk, dv), f32) if initial_state is None
              else initial_state.astype(f32).reshape(batch, num_k_heads, rep, dk, dv))

    def step(state, xs):
        u, w, k_c, end, dec = xs  # [B,Hk,r,C,dv] f32, [B,Hk,r,C,dk], [B,Hk,C,dk], [B,Hk,r,C], [B,Hk,r]
        read = state.astype(cd)
        v_new = u - dot("bhrcd,bhrdv->bhrcv", w, read)
        update = dot("bhcd,bhrcv->bhrdv", k_c, (v_new * end[..., None]).astype(cd))
        return state * dec[..., None, None] + update, (read, v_new.astype(cd))

    chunk_first = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731
    final_state, (states, v_new) = jax.lax.scan(
        step, state0, tuple(map(chunk_first, (new_values, k_cumdecay.astype(cd), k, to_end, chunk_decay))))
    states = jnp.moveaxis(states, 0, 2)  # [B, Hk, N, r, dk, dv]: the state entering each chunk
    v_new = jnp.moveaxis(v_new, 0, 2)  # [B, Hk, N, r, C, dv]
    o = (dot("bhncd,bhnrdv->bhnrcv", q, states) * state_decay[..., None]
         + dot("bhnrcs,bhnrsv->bhnrcv", intra, v_new))
    o = jnp.transpose(o, (0, 2, 4, 1, 3, 5)).reshape(batch, n_chunks * C, num_v_heads, dv)[:, :seq_len]
    return o.astype(out_dtype), final_state.reshape(batch, num_v_heads, dk, dv)


def gated_delta_decode_step(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                            state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token for every row: q, k [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv]; state [B, Hv, dk, dv] (fp32,
    or bf16 storage). Returns (o [B, Hv, dv] in v's dtype, new state in state's dtype); math in fp32."""
    f32 = jnp.float32
    batch, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    rep = _check_heads(num_k_heads, num_v_heads)
    q = _l2norm(q.astype(f32)) * (dk ** -0.5)
    k = _l2norm(k.astype(f32))
    s = state.astype(f32).reshape(batch, num_k_heads, rep, dk, dv)
    a = jnp.exp(g.astype(f32)).reshape(batch, num_k_heads, rep, 1)
    b = beta.astype(f32).reshape(batch, num_k_heads, rep, 1)
    # S^T k and S^T q in one pass
    read = jnp.einsum("bhrkv,bhik->bhriv", s, jnp.stack([k, q], axis=2), precision=FP32_PRECISION)
    delta = b * (v.astype(f32).reshape(batch, num_k_heads, rep, dv) - a * read[:, :, :, 0])
    k_dot_q = jnp.sum(k * q, axis=-1)[:, :, None, None]
    o = a * read[:, :, :, 1] + k_dot_q * delta
    new_state = a[..., None] * s + k[:, :, None, :, None] * delta[:, :, :, None, :]
    return (o.reshape(batch, num_v_heads, dv).astype(v.dtype),
            new_state.reshape(batch, num_v_heads, dk, dv).astype(state.dtype))


class PendingUpdate(NamedTuple):
    """The rank-1 update of the last decode step, not yet applied to the stored state (fp32):
    S = decay * stored + key delta^T per value head. decay [B, Hv], key [B, Hk, dk] (L2-normalised; value head h
    uses key head h // (Hv / Hk)), delta [B, Hv, dv]. `no_pending_update` is the identity (decay 1, zeros)."""
    decay: jax.Array
    key: jax.Array
    delta: jax.Array


def no_pending_update(batch: int, num_k_heads: int, num_v_heads: int, dk: int, dv: int) -> PendingUpdate:
    f32 = jnp.float32
    return PendingUpdate(jnp.ones((batch, num_v_heads), f32), jnp.zeros((batch, num_k_heads, dk), f32),
                         jnp.zeros((batch, num_v_heads, dv), f32))


def apply_pending(stored: jax.Array, pending: PendingUpdate) -> jax.Array:
    """stored [B, Hv, dk, dv] (any float dtype) -> the current state, fp32 [B, Hv, dk, dv]."""
    batch, num_v_heads, dk, dv = stored.shape
    num_k_heads = pending.key.shape[1]
    rep = _check_heads(num_k_heads, num_v_heads)
    s = stored.astype(jnp.float32).reshape(batch, num_k_heads, rep, dk, dv)
    decay = pending.decay.reshape(batch, num_k_heads, rep, 1, 1)
    delta = pending.delta.reshape(batch, num_k_heads, rep, 1, dv)
    s = decay * s + pending.key[:, :, None, :, None] * delta
    return s.reshape(batch, num_v_heads, dk, dv)


def gated_delta_decode_step_deferred(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                                     stored: jax.Array, pending: PendingUpdate
                                     ) -> tuple[jax.Array, jax.Array, PendingUpdate]:
    """One token for every row with the update deferred (module docstring): q, k [B, Hk, dk]; v [B, Hv, dv];
    g, beta [B, Hv]; stored [B, Hv, dk, dv] (fp32 or bf16 storage) and the pending update of the previous step.
    Returns (o [B, Hv, dv] in v's dtype, the new stored state (the state before this token, in stored's dtype),
    this token's pending update). `apply_pending(new_stored, new_pending)` is the state after this token."""
    f32 = jnp.float32
    batch, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    rep = _check_heads(num_k_heads, num_v_heads)
    q = _l2norm(q.astype(f32)) * (dk ** -0.5)
    k = _l2norm(k.astype(f32))
    # The state entering this token, rounded as it is stored (a no-op for fp32): the plain update reads exactly
    # this value back from its bf16 storage.
    current = apply_pending(stored, pending).astype(stored.dtype)
    s = current.astype(f32).reshape(batch, num_k_heads, rep, dk, dv)
    # S^T k and S^T q as multiply-and-reduce over dk (not a dot), so they fuse with the elementwise pass that
    # produces `current` instead of reading it back from memory.
    read_k = jnp.sum(s * k[:, :, None, :, None], axis=3)  # [B, Hk, r, dv]
    read_q = jnp.sum(s * q[:, :, None, :, None], axis=3)
    a = jnp.exp(g.astype(f32)).reshape(batch, num_k_heads, rep, 1)
    b = beta.astype(f32).reshape(batch, num_k_heads, rep, 1)
    delta = b * (v.astype(f32).reshape(batch, num_k_heads, rep, dv) - a * read_k)
    k_dot_q = jnp.sum(k * q, axis=-1)[:, :, None, None]
    o = a * read_q + k_dot_q * delta
    new_pending = PendingUpdate(a.reshape(batch, num_v_heads), k, delta.reshape(batch, num_v_heads, dv))
    return o.reshape(batch, num_v_heads, dv).astype(v.dtype), current, new_pending


def recurrent_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
    initial_state: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
    """The reference recurrence token by token (§3.1, written as HF writes it, key heads repeated to the value
    heads); same arguments and results as `chunk_gated_delta_rule`."""
    f32 = jnp.float32
    out_dtype = v.dtype
    batch = q.shape[0]
    rep = _check_heads(k.shape[2], v.shape[2])
    if rep > 1:  # value head h uses key head h // rep (repeat-interleave, as HF/PEFT/vLLM do)
        q = jnp.repeat(q, rep, axis=2)
        k = jnp.repeat(k, rep, axis=2)
    q = _l2norm(q.astype(f32)) * (q.shape[-1] ** -0.5)
    k = _l2norm(k.astype(f32))
    num_heads, dk, dv = v.shape[2], k.shape[-1], v.shape[-1]
    state0 = (jnp.zeros((batch, num_heads, dk, dv), f32) if initial_state is None
              else initial_state.astype(f32))

    def step(state, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B,H,dk], [B,H,dk], [B,H,dv], [B,H], [B,H]
        state = state * jnp.exp(g_t)[..., None, None]
        predicted = jnp.einsum("bhkv,bhk->bhv", state, k_t, precision=FP32_PRECISION)
        delta = (v_t - predicted) * b_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t, precision=FP32_PRECISION)

    time_first = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    final_state, outs = jax.lax.scan(step, state0, tuple(map(time_first, (q, k, v.astype(f32), g.astype(f32),
                                                                           beta.astype(f32)))))
    o = jnp.moveaxis(outs, 0, 1)  # [B, T, H, dv]
    return o.astype(out_dtype), final_state
