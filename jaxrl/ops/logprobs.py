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

Distillation (jaxrl/algorithms/distill_loss.py) compares two distributions over a support of k token ids plus a
remainder bucket: `topk_support` gives a teacher's top k, and `support_logprobs` a student's log-probs at given
ids (differentiable, chunked like `token_logprobs`); both give the remainder's log-mass as the logsumexp of the
logits OFF the support (exact, no 1 - sum cancellation: with k = V it is -inf, not rounding noise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.ops.matmul import project


def _chunked(hidden, targets, extra, chunk_size: int):
    """Rows of [B, T, ...] inputs as [n_chunks, chunk, ...] (padded with zeros) and a function cutting [n_chunks,
    chunk, ...] results back to [B, T, ...]."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    batch, seq_len, width = hidden.shape
    rows = batch * seq_len
    chunk = min(chunk_size, rows)
    n_chunks = -(-rows // chunk)
    pad = n_chunks * chunk - rows

    def rows_of(x):
        x = x.reshape(rows, *x.shape[2:])
        if pad:
            x = jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)])
        return x.reshape(n_chunks, chunk, *x.shape[1:])

    def cut(x):
        return x.reshape(n_chunks * chunk, *x.shape[2:])[:rows].reshape(batch, seq_len, *x.shape[2:])

    return rows_of(hidden), rows_of(targets.astype(jnp.int32)), (None if extra is None else rows_of(extra)), cut


def token_logprobs(hidden: jax.Array, head_weight: jax.Array, targets: jax.Array, *, chunk_size: int = 512,
                   temperature: float = 1.0, return_entropy: bool = False, top_k: int = 0):
    """log softmax(hidden @ head_weight.T / temperature)[targets].

    hidden: [B, T, H] (final-norm hidden states, `model.hidden_states`); head_weight: [V, H]
    (`model.head_weight()`); targets: [B, T] int (the token whose probability is wanted at each position).
    Returns logp [B, T] fp32; with `return_entropy` also the entropy of each position's distribution [B, T]; with
    `top_k` > 0 (and no entropy) (logp, top log-probs [B, T, k] fp32, top ids [B, T, k] int32, the target's rank
    [B, T] int32), most likely first; the rank is vLLM's: the tokens whose logit is >= the target's, itself included
    (vllm/v1/sample/ops/logprobs.py:11-40), so 1 is the most likely.
    """
    if top_k:
        if return_entropy:
            raise ValueError("token_logprobs: top_k and return_entropy are not offered together")
        return _with_top_k(hidden, head_weight, targets, chunk_size, temperature, int(top_k))
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"token_logprobs: hidden must be [B, T, H] and targets [B, T]; got {hidden.shape} and "
                         f"{targets.shape}")
    h, t, _, cut = _chunked(hidden, targets, None, chunk_size)
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
    if not return_entropy:
        return cut(logp)
    return cut(logp), cut(entropy)


def _with_top_k(hidden, head_weight, targets, chunk_size: int, temperature: float, k: int):
    """token_logprobs with the top k of every position, one chunk of logits at a time (no gradient)."""
    h, t, _, cut = _chunked(hidden, targets, None, chunk_size)
    inv_temp = 1.0 / float(temperature)

    def one_chunk(args):
        h_c, t_c = args
        logits = project(h_c, head_weight, jnp.float32) * inv_temp
        lse = jax.nn.logsumexp(logits, axis=-1)
        values, ids = jax.lax.top_k(logits, k)
        target = jnp.take_along_axis(logits, t_c[:, None], axis=-1)
        rank = jnp.sum(logits >= target, axis=-1, dtype=jnp.int32)
        return target[:, 0] - lse, values - lse[:, None], ids.astype(jnp.int32), rank

    logp, values, ids, rank = jax.lax.map(one_chunk, (h, t))
    return cut(logp), cut(values), cut(ids), cut(rank)


_OFF_SUPPORT = -1.0e30  # a logit excluded from the remainder's logsumexp (finite: no inf - inf in its gradient)


def _log_softmax_parts(logits):
    """(logits - max, log sum exp(logits - max)): log-probs are their difference. Subtracting the max first (as
    torch's log_softmax does) rounds once less than `logits - logsumexp(logits)`: with k = V the divergences then
    match TRL's float32 values to ~2 ulp instead of ~6."""
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    return shifted, jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))


def _rest_logp(shifted, ids, lse):
    """log of the probability mass off `ids` ([c, V] max-shifted logits, [c, k] ids, [c] their logsumexp) ->
    [c]."""
    off = shifted.at[jnp.arange(shifted.shape[0])[:, None], ids].set(_OFF_SUPPORT)
    return jax.nn.logsumexp(off, axis=-1) - lse


def topk_support(hidden: jax.Array, head_weight: jax.Array, targets: jax.Array, k: int, *, chunk_size: int = 512,
                 temperature: float = 1.0):
    """A teacher's side of a distillation support (no gradient): (logp of `targets` [B, T], top-k log-probs
    [B, T, k] most likely first, their ids [B, T, k] int32, log-mass of every other token [B, T])."""
    h, t, _, cut = _chunked(hidden, targets, None, chunk_size)
    inv_temp = 1.0 / float(temperature)

    def one_chunk(args):
        h_c, t_c = args
        shifted, lse = _log_softmax_parts(project(h_c, head_weight, jnp.float32) * inv_temp)
        values, ids = jax.lax.top_k(shifted, int(k))
        return (jnp.take_along_axis(shifted, t_c[:, None], axis=-1)[:, 0] - lse, values - lse[:, None],
                ids.astype(jnp.int32), _rest_logp(shifted, ids, lse))

    out = jax.lax.map(one_chunk, (h, t))
    return tuple(cut(x) for x in jax.lax.stop_gradient(out))


def support_logprobs(hidden: jax.Array, head_weight: jax.Array, targets: jax.Array, support_ids: jax.Array, *,
                     chunk_size: int = 512, temperature: float = 1.0):
    """A student's side of a distillation support, differentiable (each chunk under `jax.checkpoint`, as
    `token_logprobs`): (logp of `targets` [B, T], log-probs at `support_ids` [B, T, k], log-mass of every other
    token [B, T], the argmax token [B, T] int32, no gradient)."""
    h, t, ids, cut = _chunked(hidden, targets, support_ids.astype(jnp.int32), chunk_size)
    inv_temp = 1.0 / float(temperature)

    @jax.checkpoint
    def one_chunk(h_c, t_c, ids_c):
        logits = project(h_c, head_weight, jnp.float32)
        if inv_temp != 1.0:
            logits = logits * inv_temp
        shifted, lse = _log_softmax_parts(logits)
        logp = jnp.take_along_axis(shifted, t_c[:, None], axis=-1)[:, 0] - lse
        on = jnp.take_along_axis(shifted, ids_c, axis=-1) - lse[:, None]
        top1 = jax.lax.stop_gradient(jnp.argmax(logits, axis=-1).astype(jnp.int32))
        return logp, on, _rest_logp(shifted, ids_c, lse), top1

    out = jax.lax.map(lambda args: one_chunk(*args), (h, t, ids))
    return tuple(cut(x) for x in out)
