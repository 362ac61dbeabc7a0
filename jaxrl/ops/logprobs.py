"""Per-token log-probabilities (and entropies) without materialising the [B, T, V] logits.

    logp = token_logprobs(hidden, model.head_weight(), targets, chunk_size=512)          # [B, T] fp32
    logp, entropy = token_logprobs(hidden, w, targets, return_entropy=True)

The B*T rows are processed `chunk_size` at a time under `jax.checkpoint`: the forward keeps only the [B, T]
results, and the backward recomputes each chunk's [chunk, V] logits instead of storing them, so peak memory is
one chunk of fp32 logits (chunk_size * V * 4 bytes: 512 rows of the 248k vocab = 0.5 GB) instead of B*T*V.
Logits are accumulated in fp32 whatever the dtype of `hidden` and the head (`preferred_element_type`). The
backward of the head product runs in the operands' dtype (`jaxrl.ops.matmul.project`): the fp32 logit
cotangent is rounded to bf16 in a bf16 model before its products with the head weight and the hidden states
(fp32 accumulation), instead of an fp32 x bf16 product (TF32 on a GPU, an fp32 copy of the [V, H] head on the
CPU). In an fp32 model it is the plain fp32 gradient.

`temperature` divides the logits first (what sampling at that temperature used; GRPO/PPO importance ratios).
`top_k` also returns each position's k most likely tokens and their log-probabilities, from the same chunk of
logits (a server's `logprobs=k`; never differentiated).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.ops.matmul import project


def token_logprobs(hidden: jax.Array, head_weight: jax.Array, targets: jax.Array, *, chunk_size: int = 512,
                   temperature: float = 1.0, return_entropy: bool = False, top_k: int = 0):
    """log softmax(hidden @ head_weight.T / temperature)[targets].

    hidden: [B, T, H] (final-norm hidden states, `model.hidden_states`); head_weight: [V, H]
    (`model.head_weight()`); targets: [B, T] int (the token whose probability is wanted at each position).
    Returns logp [B, T] fp32; with `return_entropy` also the entropy of each position's distribution [B, T]; with
    `top_k` > 0 (and no entropy) (logp, top log-probs [B, T, k] fp32, top ids [B, T, k] int32), most likely first.
    """
    if top_k:
        if return_entropy:
            raise ValueError("token_logprobs: top_k and return_entropy are not offered together")
        return _with_top_k(hidden, head_weight, targets, chunk_size, temperature, int(top_k))
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"token_logprobs: hidden must be [B, T, H] and targets [B, T]; got {hidden.shape} and "
                         f"{targets.shape}")
    if chunk_size <= 0:
        raise ValueError(f"token_logprobs: chunk_size must be positive, got {chunk_size}")
    batch, seq_len, width = hidden.shape
    rows = batch * seq_len
    chunk = min(chunk_size, rows)
    n_chunks = -(-rows // chunk)
    pad = n_chunks * chunk - rows
    h = hidden.reshape(rows, width)
    t = targets.reshape(rows).astype(jnp.int32)
    if pad:
        h = jnp.concatenate([h, jnp.zeros((pad, width), h.dtype)])
        t = jnp.concatenate([t, jnp.zeros((pad,), t.dtype)])
    h = h.reshape(n_chunks, chunk, width)
    t = t.reshape(n_chunks, chunk)
    inv_temp = 1.0 / float(temperature)

    @jax.checkpoint
    def one_chunk(h_c, t_c):
        logits = project(h_c, head_weight, jnp.float32)
        if inv_temp != 1.0:
            logits = logits * inv_temp
        lse = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, t_c[:, None], axis=-1)[:, 0] - lse
        if not return_entropy:
            return logp, jnp.zeros_like(logp)
        probs = jnp.exp(logits - lse[:, None])
        entropy = lse - jnp.sum(probs * logits, axis=-1)
        return logp, entropy

    logp, entropy = jax.lax.map(lambda args: one_chunk(*args), (h, t))
    logp = logp.reshape(-1)[:rows].reshape(batch, seq_len)
    if not return_entropy:
        return logp
    return logp, entropy.reshape(-1)[:rows].reshape(batch, seq_len)


def _with_top_k(hidden, head_weight, targets, chunk_size: int, temperature: float, k: int):
    """token_logprobs with the top k of every position, one chunk of logits at a time (no gradient)."""
    batch, seq_len, width = hidden.shape
    rows = batch * seq_len
    chunk = min(chunk_size, rows)
    n_chunks = -(-rows // chunk)
    pad = n_chunks * chunk - rows
    h = jnp.concatenate([hidden.reshape(rows, width), jnp.zeros((pad, width), hidden.dtype)])
    t = jnp.concatenate([targets.reshape(rows).astype(jnp.int32), jnp.zeros((pad,), jnp.int32)])
    inv_temp = 1.0 / float(temperature)

    def one_chunk(args):
        h_c, t_c = args
        logits = project(h_c, head_weight, jnp.float32) * inv_temp
        lse = jax.nn.logsumexp(logits, axis=-1)
        values, ids = jax.lax.top_k(logits, k)
        return (jnp.take_along_axis(logits, t_c[:, None], axis=-1)[:, 0] - lse, values - lse[:, None],
                ids.astype(jnp.int32))

    logp, values, ids = jax.lax.map(one_chunk, (h.reshape(n_chunks, chunk, width), t.reshape(n_chunks, chunk)))
    cut = lambda x: x.reshape(n_chunks * chunk, *x.shape[2:])[:rows].reshape(batch, seq_len, *x.shape[2:])  # noqa
    return cut(logp), cut(values), cut(ids)
