"""Choosing the next token from logits: greedy, temperature, top-k, top-p, with per-row PRNG keys.

All functions are pure and jit-friendly. What is *static* (changes the compiled program) and what is *traced*
(a runtime value, no recompilation):

  * static: `greedy`, `top_k` (an int; 0 = off; `lax.top_k` needs it static), `use_top_p` (whether the sort
    for nucleus filtering is in the program at all);
  * traced: `temperature`, `top_p`, the keys.

Filtering follows transformers' warper order: temperature, then top-k, then top-p, all on the tempered logits.
The returned log-probability is always that of the *raw* distribution, `log_softmax(logits)` at temperature 1
and without filtering: it is what the trainers use as the behaviour policy, and what a teacher-forced forward
pass over the same tokens gives.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingMode(NamedTuple):
    """The static part of the sampling controls (one compiled decode program per distinct mode)."""

    greedy: bool
    top_k: int  # 0 = no top-k filtering
    use_top_p: bool


def sampling_mode(temperature: float, top_p: float, top_k: int, vocab_size: int) -> SamplingMode:
    """Validates the controls and derives the static mode. temperature == 0 means greedy."""
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if temperature == 0.0:
        return SamplingMode(True, 0, False)
    top_k = 0 if top_k >= vocab_size else int(top_k)
    return SamplingMode(False, top_k, top_p < 1.0)


def _nucleus_threshold(sorted_desc: jax.Array, top_p: jax.Array) -> jax.Array:
    """[R, K] logits sorted in descending order -> [R, 1] smallest logit kept by top-p.

    Keeps the smallest prefix whose probability mass reaches top_p: token j is kept when the mass strictly
    before it is < top_p, so the most likely token is always kept.
    """
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = mass_before < top_p
    return jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)


def filter_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, mode: SamplingMode) -> jax.Array:
    """[R, V] raw logits -> tempered logits with filtered-out entries at -inf (not used when greedy)."""
    x = logits.astype(jnp.float32) / temperature
    if mode.top_k:
        top_vals = jax.lax.top_k(x, mode.top_k)[0]  # [R, k], descending
        x = jnp.where(x < top_vals[:, -1:], -jnp.inf, x)
        if mode.use_top_p:  # top-p after top-k only needs the k survivors, already sorted
            x = jnp.where(x < _nucleus_threshold(top_vals, top_p), -jnp.inf, x)
    elif mode.use_top_p:
        sorted_desc = -jnp.sort(-x, axis=-1)
        x = jnp.where(x < _nucleus_threshold(sorted_desc, top_p), -jnp.inf, x)
    return x


def sample_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  mode: SamplingMode) -> tuple[jax.Array, jax.Array]:
    """logits [R, V] (any float dtype), keys [R, 2] uint32 (one per row) -> (tokens [R] int32, logprobs [R] f32).

    Row r's choice depends only on its logits and keys[r], never on the other rows (so a sample does not depend
    on the batch it landed in). Sampling is Gumbel-max over the filtered, tempered logits.
    """
    logits = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    if mode.greedy:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        filtered = filter_logits(logits, temperature, top_p, mode)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
        tokens = jnp.argmax(filtered + gumbel, axis=-1)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]


def row_keys(seed: jax.Array, group_ids: jax.Array, sample_ids: jax.Array) -> jax.Array:
    """One PRNG key per row from (seed, group id, sample id): [R] ints -> [R, 2] uint32.

    generate() uses (prompt index, sample index); the rollout launcher uses (hash of problem id, sample index),
    so a resumed run redraws a missing sample exactly as the interrupted run would have.
    """
    base = jax.random.PRNGKey(seed)
    return jax.vmap(lambda g, s: jax.random.fold_in(jax.random.fold_in(base, g), s))(
        group_ids.astype(jnp.uint32), sample_ids.astype(jnp.uint32))


def step_keys(keys: jax.Array, step: jax.Array) -> jax.Array:
    """[R, 2] row keys -> the keys of decode step `step` (a fresh, independent stream per step)."""
    return jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
