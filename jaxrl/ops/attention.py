"""Grouped-query causal softmax attention: a fused kernel where the backend has one, head-major XLA elsewhere.

    o = causal_attention(q, k, v, lengths, scale)                    # training / prefill, right-padded rows
    order, dest, lengths = compaction(mask)                           # any padding -> right padding
    o = uncompact(causal_attention(*(compact(x, order) for x in (q, k, v)), lengths, scale), dest)
    o = cache_attention(q, k_cache, v_cache, valid, q_slots, scale, filled=n)   # over a KV cache
    o = continuation_attention(q, k_cache, v_cache, valid, start, scale)      # continuing a prefix, for training

Layouts: q [B, T, nH, hd], fresh k / v [B, T, nKV, hd], a KV cache [B, nKV, S, hd] (head-major). Query head h
reads KV head h // (nH / nKV); K/V are never repeated to nH heads.

`causal_attention` takes sequence lengths, never a mask: row b's real tokens are positions [0, lengths[b]).
  * "cudnn" (a GPU and bf16/fp16 operands): `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's
    flash attention with a causal + padding mask type: no T x S matrix in memory, the upper triangle skipped.
  * "xla" (the CPU, fp32, and the reference): the same function written head-major, so both einsums have their
    batch dimensions (B, nKV) leading. XLA:CPU runs dots with non-leading batch dimensions on a slow path
    (measured in benchmarks/RESULTS.md, section 'Figures formerly quoted in code comments'). Queries go in
    blocks, and block i multiplies only the keys up to its last query, so the upper triangle is mostly skipped
    here too.
Rows that are not right-padded (GRPO/PPO rows: a left-padded prompt, then a right-padded completion) reach the
same kernel through `compaction`: a stable permutation that moves each row's real tokens to the front, in
order. Attention among the real tokens is unchanged by it (RoPE is applied before, with positions that count
real tokens only), and `uncompact` puts every output back in its column.

`cache_attention` is the masked form over a KV cache (decode, and continuing a prefix): key slot s is visible
to the query in slot t when valid[b, s] and s <= t. With `filled` (how many leading slots may be in use), it
reads only a prefix of the cache: the smallest of a few static prefix lengths that covers `filled`, chosen by
`lax.switch`, so a decode step reads the slots written so far rather than the whole preallocated buffer.

`continuation_attention` is the training form of continuing a prefix held in a cache (the shared-prefix layout,
`Qwen35.branched_hidden_states`): the queries sit at the static slots start, start + 1, ...; it goes in query blocks,
block i reading only the keys up to its last query, and each block under its own `jax.checkpoint`, so a backward
holds one block's [t, s] scores at a time (as a flash attention would) rather than every block's.

Packed rows (`segment_ids` [B, T], training passes): several sequences end to end in one row; query t also needs
the key's sequence to be its own. The XLA form adds that to its block masks; cuDNN takes it as a [B, 1, T, T]
boolean mask (which it turns into an additive bias), probed like the plain kernel and replaced by the XLA form
where it does not compile.

Softmax statistics are fp32 whatever the operand dtype; a row with no visible key gives zeros, not NaN.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from absl import logging

IMPLEMENTATIONS = ("auto", "xla", "cudnn")
_NEG = -1e30  # masked scores: exp(_NEG - max) underflows to 0 for any finite max


def resolve_implementation(implementation: str, dtype, head_dim: int, masked: bool = False) -> str:
    """"auto" -> "cudnn" on a GPU with bf16/fp16 operands and a head dim this GPU's cuDNN compiles (forward and
    backward, `cudnn_supports`; `masked`: with a packed-sequence mask), else "xla"."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r}; choose one of {IMPLEMENTATIONS}")
    if implementation != "auto":
        return implementation
    fused_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if (jax.default_backend() == "gpu" and fused_dtype and head_dim <= 256 and head_dim % 8 == 0
            and cudnn_supports(dtype, head_dim, masked)):
        return "cudnn"
    return "xla"


_CUDNN_SUPPORT: dict = {}  # (dtype name, head dim, masked) -> whether cuDNN's fused attention compiled


def cudnn_supports(dtype, head_dim: int, masked: bool = False) -> bool:
    """Whether cuDNN's fused causal attention compiles here for `dtype` and `head_dim`, forward and backward (a
    head dim of 256 needs a recent cuDNN and GPU generation). Probed once per (dtype, head dim) by compiling a
    one-row program; a failure logs one warning and "auto" uses the XLA attention instead."""
    key = (jnp.dtype(dtype).name, int(head_dim), bool(masked))
    if key not in _CUDNN_SUPPORT:
        try:
            _compile_cudnn_probe(jnp.dtype(dtype), int(head_dim), bool(masked))
            _CUDNN_SUPPORT[key] = True
        except Exception as e:  # noqa: BLE001 - any failure to build the kernel means: do not use it
            _CUDNN_SUPPORT[key] = False
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            logging.warning("cuDNN fused attention does not compile for %s, head dim %d%s on this machine (%s); "
                            "attention_implementation='auto' uses the XLA attention", key[0], head_dim,
                            " with a packed-sequence mask" if masked else "", reason)
    return _CUDNN_SUPPORT[key]


def _compile_cudnn_probe(dtype, head_dim: int, masked: bool = False) -> None:
    qkv = jax.ShapeDtypeStruct((1, 128, 1, head_dim), dtype)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)

    def attend(q, k, v, n):
        mask = jnp.ones((1, 1, 128, 128), bool) if masked else None
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, query_seq_lengths=n,
                                            key_value_seq_lengths=n, implementation="cudnn")

    grad = jax.grad(lambda q, k, v, n: jnp.sum(attend(q, k, v, n).astype(jnp.float32)), argnums=(0, 1, 2))
    for fn in (attend, grad):
        jax.jit(fn).lower(qkv, qkv, qkv, lengths).compile()


def query_block_size(seq_len: int) -> int:
    """Query rows per block of the XLA causal form: 128 (the fastest fwd+bwd on two CPU cores at T = 1024,
    measured in benchmarks/RESULTS.md, section 'Figures formerly quoted in code comments'), at most 32 blocks.
    Smaller blocks skip more of the upper triangle but make more dots."""
    if seq_len <= 128:
        return seq_len
    return max(128, -(-seq_len // 32))


# ---------------------------------------------------------------------------------------------------------------
# Training / prefill: right-padded rows, causal

def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: Optional[jax.Array], scale: float,
                     implementation: str = "auto", block_size: Optional[int] = None,
                     segment_ids: Optional[jax.Array] = None) -> jax.Array:
    """q [B, T, nH, hd]; k, v [B, T, nKV, hd]; lengths [B] int (None: every position is real); segment_ids [B, T]
    int (None: one sequence per row): each sequence's id, distinct within its row.

    Query t of row b attends keys s <= t with s < lengths[b] (and segment_ids[b, s] == segment_ids[b, t]).
    Returns [B, T, nH, hd] in q's dtype; outputs at padded query positions are finite and meaningless.
    """
    batch, seq_len, num_heads, head_dim = q.shape
    if num_heads % k.shape[2]:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({k.shape[2]})")
    if lengths is not None:
        # A row without real tokens would leave every key masked; one visible (padding) key keeps it finite.
        lengths = jnp.clip(lengths.astype(jnp.int32), 1, seq_len)
    impl = resolve_implementation(implementation, q.dtype, head_dim, masked=segment_ids is not None)
    if impl == "cudnn":
        mask = None if segment_ids is None else (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                            query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                            implementation="cudnn")
    return _xla_causal(q, k, v, lengths, scale, block_size or query_block_size(seq_len), segment_ids)


def _to_head_major_queries(q: jax.Array, num_kv: int) -> jax.Array:
    """[B, T, nH, hd] -> [B, nKV, G, T, hd] (query head h = kv head h // G, group member h % G)."""
    batch, seq_len, num_heads, head_dim = q.shape
    return jnp.transpose(q.reshape(batch, seq_len, num_kv, num_heads // num_kv, head_dim), (0, 2, 3, 1, 4))


def _from_head_major_queries(o: jax.Array) -> jax.Array:
    """[B, nKV, G, T, hd] -> [B, T, nH, hd]."""
    batch, num_kv, groups, seq_len, head_dim = o.shape
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(batch, seq_len, num_kv * groups, head_dim)


def _softmax_attend(qh: jax.Array, kh: jax.Array, vh: jax.Array, allowed: jax.Array, scale: float) -> jax.Array:
    """qh [B, nKV, G, t, hd], kh / vh [B, nKV, s, hd], allowed broadcastable to [B, 1, 1, t, s] -> [B, nKV, G, t,
    hd] in qh's dtype. The normalisation divides the [t, hd] output instead of the [t, s] weights."""
    scores = jnp.einsum("bkgtd,bksd->bkgts", qh, kh, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(allowed, scores, _NEG)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("bkgts,bksd->bkgtd", weights.astype(vh.dtype), vh, preferred_element_type=jnp.float32)
    return (out / jnp.where(denom > 0, denom, 1.0)).astype(qh.dtype)


def _xla_causal(q, k, v, lengths, scale, block, segment_ids=None):
    num_kv, seq_len = k.shape[2], q.shape[1]
    qh = _to_head_major_queries(q, num_kv)
    kh = jnp.transpose(k, (0, 2, 1, 3))
    vh = jnp.transpose(v, (0, 2, 1, 3))
    outs = []
    for start in range(0, seq_len, block):
        stop = min(seq_len, start + block)
        q_pos = jnp.arange(start, stop)[:, None]
        k_pos = jnp.arange(stop)[None, :]
        allowed = k_pos <= q_pos  # [t, s]
        if lengths is not None:
            allowed = allowed[None] & (k_pos[None] < lengths[:, None, None])  # [B, t, s]
            allowed = allowed[:, None, None]
        if segment_ids is not None:
            same = segment_ids[:, start:stop, None] == segment_ids[:, None, :stop]  # [B, t, s]
            allowed = allowed & same[:, None, None]
        outs.append(_softmax_attend(qh[:, :, :, start:stop], kh[:, :, :stop], vh[:, :, :stop], allowed, scale))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    return _from_head_major_queries(o)


# ---------------------------------------------------------------------------------------------------------------
# Padding layouts

def compaction(mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """mask [B, T] (True / 1 = real token) -> (order, dest, lengths).

    order [B, T]: the source column of compacted position j (real tokens first, in order, then the padding);
    dest [B, T]: the compacted position of column t (the inverse permutation); lengths [B]: real tokens per row.
    """
    mask = mask.astype(bool)
    batch, seq_len = mask.shape
    real = mask.astype(jnp.int32)
    lengths = jnp.sum(real, axis=1)
    dest = jnp.where(mask, jnp.cumsum(real, axis=1) - 1, lengths[:, None] + jnp.cumsum(1 - real, axis=1) - 1)
    rows = jnp.arange(batch)[:, None]
    order = jnp.zeros((batch, seq_len), jnp.int32).at[rows, dest].set(jnp.arange(seq_len, dtype=jnp.int32)[None])
    return order, dest.astype(jnp.int32), lengths.astype(jnp.int32)


def compact(x: jax.Array, order: jax.Array) -> jax.Array:
    """x [B, T, ...] -> x[b, order[b, j]] (the compacted layout)."""
    return jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)


def uncompact(x: jax.Array, dest: jax.Array) -> jax.Array:
    """Inverse of `compact`: x [B, T, ...] in the compacted layout -> the original columns."""
    return jnp.take_along_axis(x, dest.reshape(dest.shape + (1,) * (x.ndim - 2)), axis=1)


# ---------------------------------------------------------------------------------------------------------------
# Over a KV cache

def prefix_lengths(max_length: int, max_branches: int = 8, multiple: int = 16) -> tuple[int, ...]:
    """The static prefix sizes `cache_attention` chooses among: about max_length / max_branches apart, rounded up
    to `multiple`, the last one max_length."""
    step = -(-max_length // max_branches)
    step = -(-step // multiple) * multiple
    sizes = sorted({min(max_length, step * (i + 1)) for i in range(max_branches)})
    return tuple(sizes)


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, q_slots: jax.Array,
                    scale: float, filled: Optional[jax.Array] = None) -> jax.Array:
    """q [B, T, nH, hd]; k, v [B, nKV, S, hd] (the cache, this call's keys already written); valid [B, S] bool;
    q_slots [T] int: the cache slot of each query, or [B, T] (a per-row cache continued by several tokens: each
    row's queries sit at its own slots). Key s is visible to query t when valid[b, s] and s <= q_slots[t].
    filled (int scalar, optional): slots [filled, S) are known to be unused, so only a prefix of the cache
    covering `filled` is read. Returns [B, T, nH, hd] in q's dtype."""
    max_length = k.shape[2]
    qh = _to_head_major_queries(q, k.shape[1])

    def attend(size: int) -> jax.Array:
        if q_slots.ndim == 2:
            causal = (jnp.arange(size)[None, None, :] <= q_slots[:, :, None])[:, None, None]
        else:
            causal = jnp.arange(size)[None, :] <= q_slots[:, None]
        allowed = valid[:, None, None, None, :size] & causal
        return _softmax_attend(qh, k[:, :, :size].astype(q.dtype), v[:, :, :size].astype(q.dtype), allowed, scale)

    if filled is None:
        return _from_head_major_queries(attend(max_length))
    sizes = prefix_lengths(max_length)
    if len(sizes) == 1:
        return _from_head_major_queries(attend(sizes[0]))
    index = jnp.sum(jnp.asarray(sizes[:-1]) < filled).astype(jnp.int32)
    return _from_head_major_queries(jax.lax.switch(index, [lambda s=s: attend(s) for s in sizes]))


def continuation_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, start: int, scale: float,
                           block_size: Optional[int] = None) -> jax.Array:
    """q [B, T, nH, hd], the queries of cache slots start .. start + T - 1 (`start` a Python int); k, v [B, nKV, S,
    hd] (the cache, this call's keys already written at those slots); valid [B, S] bool. Key s is visible to query
    t when valid[b, s] and s <= start + t. Query blocks of `block_size` (default `query_block_size(T)`): block
    [t0, t1) reads keys [0, start + t1) only, under its own `jax.checkpoint` that keeps nothing but its inputs, so
    the backward recomputes one block's scores at a time. Returns [B, T, nH, hd] in q's dtype."""
    seq_len = q.shape[1]
    if start + seq_len > k.shape[2]:
        raise ValueError(f"continuation_attention: queries at slots {start}..{start + seq_len - 1} past the "
                         f"cache's {k.shape[2]}")
    qh = _to_head_major_queries(q, k.shape[1])
    block = block_size or query_block_size(seq_len)

    def attend_block(t0: int, t1: int):
        size = start + t1

        def attend(qb, kc, vc, visible):
            causal = jnp.arange(size)[None, :] <= start + jnp.arange(t0, t1)[:, None]  # [t, s]
            allowed = visible[:, None, None, None, :size] & causal
            return _softmax_attend(qb, kc[:, :, :size].astype(q.dtype), vc[:, :, :size].astype(q.dtype), allowed,
                                   scale)

        return jax.checkpoint(attend, policy=jax.checkpoint_policies.nothing_saveable)(qh[:, :, :, t0:t1], k, v,
                                                                                       valid)

    outs = [attend_block(t0, min(seq_len, t0 + block)) for t0 in range(0, seq_len, block)]
    return _from_head_major_queries(outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3))
