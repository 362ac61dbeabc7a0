"""How the next token is chosen: the sampling settings of a request, their static part (the compiled program's
mode), the choice itself (greedy, temperature, top-k, top-p, one PRNG stream per row), and the one way a row's
randomness is keyed.

    params = SamplingParams(n=8, max_new_tokens=4096, temperature=1.0, top_p=0.95, seed=3)   # ValueError if bad
    mode = sampling_mode(1.0, 0.95, 0, vocab_size)                     # SamplingMode(greedy, top_k, use_top_p)
    tokens, logprobs = sample_tokens(logits, keys, temperature, top_p, mode)          # [R, V] -> [R], [R]
    request_seed(seed, group_id, sample_index)  /  split_request_seed(value)   # one int64 a server request carries

What is static (changes the compiled program) and what is traced: static are `greedy`, `top_k` (an int; 0 = off;
`lax.top_k` needs it static) and `use_top_p` (whether the sort for nucleus filtering is in the program); traced
are the temperature, top_p and the keys. Filtering follows transformers' warper order: temperature, then top-k,
then top-p, all on the tempered logits. The log-probability returned is always that of the *raw* distribution,
`log_softmax(logits)` at temperature 1 without filtering (vLLM's raw_logprobs): what the trainers use as the
behaviour policy, and what a teacher-forced pass over the same tokens gives.

Keys: row r's key is fold_in(fold_in(key(seed), group id), sample index) and its n-th token is drawn with
fold_in(key, n): never the slot, round, batch or process, so a sample is the same whichever batch, schedule or
server drew it. A server request packs (seed, group id, sample index) into its one integer `seed`
(`request_seed`): vLLM seeds choice i of a request with seed + i, which is the packed seed of (seed, group id, i),
and the JAX server unpacks it to the very key the in-process engine uses.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.utils.seeds import seed_problem

# A request's packed seed: group id (32 bits) | seed (SEED_BITS) | sample index (SAMPLE_BITS), 63 bits: always a
# non-negative int64 (vLLM reads seed -1 as "no seed", vllm/sampling_params.py:570-571).
SEED_BITS, SAMPLE_BITS = 19, 12


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample: `n` completions per prompt of at most `max_new_tokens` tokens.

    temperature 0 = greedy; top_p in (0, 1]; top_k 0 = off. `seed` with the group id and sample index keys every
    sample. Invalid values raise ValueError naming the field (checked at construction, before any work).
    """

    n: int = 1
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        problems = []
        if int(self.n) < 1:
            problems.append(f"n (samples per prompt) must be >= 1, got {self.n}")
        if int(self.max_new_tokens) < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(float(self.temperature)) and float(self.temperature) >= 0.0):
            problems.append(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        seed = seed_problem(self.seed, "seed")
        if seed:
            problems.append(seed)
        if problems:
            raise ValueError("; ".join(problems))

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


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


def row_keys(seeds: jax.Array, group_ids: jax.Array, sample_ids: jax.Array) -> jax.Array:
    """One PRNG key per row from (seed, group id, sample index): [R] ints -> [R, 2] uint32 (module docstring)."""
    base = jax.vmap(jax.random.PRNGKey)(seeds)
    return jax.vmap(lambda k, g, s: jax.random.fold_in(jax.random.fold_in(k, g), s))(
        base, group_ids.astype(jnp.uint32), sample_ids.astype(jnp.uint32))


def token_keys(keys: jax.Array, index: jax.Array) -> jax.Array:
    """[R, 2] row keys -> the keys of each row's token number index[r] ([R] or a scalar)."""
    index = jnp.broadcast_to(jnp.asarray(index, jnp.uint32), keys.shape[:1])
    return jax.vmap(jax.random.fold_in)(keys, index)


# ---------------------------------------------------------------------------------------------------------------
# Request seeds


def request_seed(seed: int, group_id: int, sample_index: int = 0) -> int:
    """The int64 `seed` of a request whose sample 0 is sample `sample_index` of (seed, group id): bits
    group id (32) | seed (SEED_BITS) | sample index (SAMPLE_BITS), in [0, 2**63)."""
    seed, group_id, sample_index = int(seed), int(group_id) % 2 ** 32, int(sample_index)
    if not 0 <= seed < 2 ** SEED_BITS:
        raise ValueError(f"seed {seed}: server backends pack the seed into {SEED_BITS} bits of the request seed "
                         f"(with the problem key and the sample index), so it must be in [0, {2 ** SEED_BITS})")
    if not 0 <= sample_index < 2 ** SAMPLE_BITS:
        raise ValueError(f"sample index {sample_index}: server backends draw at most {2 ** SAMPLE_BITS} samples "
                         "per prompt (SAMPLE_BITS of the request seed)")
    return (group_id << (SEED_BITS + SAMPLE_BITS)) | (seed << SAMPLE_BITS) | sample_index


def split_request_seed(value: int) -> tuple[int, int, int]:
    """(seed, group id, sample index) of a request seed (`request_seed` inverted; any integer maps to one)."""
    value = int(value) % 2 ** 63
    return ((value >> SAMPLE_BITS) & (2 ** SEED_BITS - 1), value >> (SEED_BITS + SAMPLE_BITS),
            value & (2 ** SAMPLE_BITS - 1))
