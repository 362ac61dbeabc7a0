"""The static sampler: batched prefill + a jitted decode loop over preallocated caches, each batch decoded until
its longest row stops. Every consumer samples with the continuous-batching engine built on it
(`jaxrl.rollout.engine.ContinuousSampler`: the same samples, finished rows replaced by waiting ones); this module is
its reference (tests, benchmarks) and holds what both share (`SamplerBase`, `weights_of`, `GenerationOutput`).

    sampler = Sampler(model, max_new_tokens=512, max_prompt_len=1024, batch_size=64,
                      eos_token_ids=(eos,), mesh=None)
    out = sampler.sample(prompts, n=8, temperature=1.0, top_p=0.95, seed=step)     # the held model's weights
    out = sampler.sample(prompts, params=nnx.state(model), ...)                     # or explicit (new) weights

    # In a trainer (GRPO/PPO): build once, then pass the current states each step; nothing recompiles.
    graphdef, trainable, frozen = lora.split_lora(model)
    for step in range(steps):
        out = sampler.sample(prompt_ids, params=(trainable, frozen), n=8, temperature=1.0, seed=step)
        out.tokens, out.logprobs (behaviour log-probs), out.finish_reasons ("length" = truncated)
        trainable = train_step(trainable, ...)

How a batch runs (one compiled program each, per bucket; nothing in Python per token):

  1. prefill(graphdef, params, ids [B, P], mask [B, P], source [B]): each *distinct* prompt of the batch once
     (rows [0, U) of ids hold the U distinct prompts, left-padded), in the training-style pass (fused attention
     over the prompt alone, chunked delta rule); the caches of P + max_new_tokens slots and the last-token
     logits are then copied to the rows that sample from each prompt (row r copies prompt source[r]). The pass
     runs on the first U' rows only, U' the smallest of a few static sizes (B/8, B/2, B) that holds the U
     prompts: n samples of a prompt cost one prefill, not n. U' is static (chosen on the host), so each size
     that occurs compiles one model pass; a trainer or evaluator, whose batches hold one number of distinct
     prompts, compiles one pass per bucket instead of the three a `lax.switch` over the sizes would compile
     (compile times measured in benchmarks/RESULTS.md, section 'Where the tiny model's time goes on CPU').
  2. decode(graphdef, params, cache, logits, ...): a `lax.while_loop`; each iteration samples one token per row
     from the current logits (sampling.py), writes it into a [B, max_new_tokens] buffer together with its
     log-probability, marks rows that produced a stop token as done, and runs the model on the new tokens
     (T = 1: recurrent delta rule, conv-state shift, KV append). It stops when every row is done or the cap is
     reached.

Compilation is keyed by (graph structure, batch bucket, prompt bucket, prefill size, max_new_tokens, sampling
mode, mesh). Batch buckets are B, B/4, B/16, ...: a run's last, partial batch is padded by at most 4x of its
rows, and a run whose batch counts vary (an evaluation's resampling of the truncated samples) meets a few
programs, not one per power of two.
The weights are an *argument*: a trainer holds one Sampler across steps and passes its current LoRA
parameters without recompiling. Temperature, top-p, seed, stop ids and prompts are traced values too.

Rows and keys: `n` samples per prompt are rows prompt-major (prompt j's samples are j*n ... j*n+n-1). Row r's
randomness comes from fold_in(fold_in(key(seed), group_id), sample_index), never from its batch, so a sample does
not depend on which batch (or bucket, or padding) it landed in. Rows are grouped by prompt bucket before
batching, so short prompts are not padded to the longest one.
"""

from __future__ import annotations

import collections
import dataclasses
from functools import partial
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl.models.qwen35.model import Cache
from jaxrl.parallel.mesh import DATA, FSDP
from jaxrl.parallel.sharding import partition_spec
from jaxrl.rollout.sampling import SamplingMode, row_keys, sample_tokens, sampling_mode, step_keys
from jaxrl.utils.tree import dotted

# (program, static key) -> number of times it was traced. A trace is what precedes a compilation, so tests use
# this to prove that a bucket compiles once (Python side effects run only while tracing).
TRACE_COUNTS: collections.Counter = collections.Counter()

MIN_PROMPT_BUCKET = 32


# ---------------------------------------------------------------------------------------------------------------
# Buckets

def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def default_prompt_buckets(max_prompt_len: int) -> tuple[int, ...]:
    """32, 64, 128, ... below max_prompt_len, and max_prompt_len itself."""
    return tuple(_powers_of_two(min(MIN_PROMPT_BUCKET, max_prompt_len), max_prompt_len))


def default_batch_buckets(batch_size: int, multiple: int = 1) -> tuple[int, ...]:
    """batch_size, batch_size / 4, batch_size / 16, ... while they are whole multiples of `multiple` (the
    data-parallel size). Every bucket is a compiled prefill and decode (seconds each for the demo's tiny model
    on two CPU cores, far more at real widths; benchmarks/RESULTS.md, section 'Figures formerly quoted in code
    comments'), while a padded row costs little where decode is bound by reading the weights (accelerators), so
    the ladder is coarse: a partial batch runs padded by at most 4x (or up to the smallest bucket)."""
    if batch_size % multiple:
        raise ValueError(f"batch_size {batch_size} must be a multiple of the data-parallel size {multiple}")
    out, b = [batch_size], batch_size
    while b % 4 == 0 and (b // 4) % multiple == 0:
        b //= 4
        out.append(b)
    return tuple(sorted(out))


def pick_bucket(value: int, buckets: Sequence[int], what: str) -> int:
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"{what} {value} exceeds the largest bucket {max(buckets)}")


# ---------------------------------------------------------------------------------------------------------------
# Sharding helpers (batch rows over data x fsdp; parameters by jaxrl.parallel.sharding rules)

def _batch_spec(ndim: int) -> P:
    return P((DATA, FSDP), *([None] * (ndim - 1)))


def constrain_rows(tree, mesh: Optional[Mesh]):
    """Puts the leading (row) dimension of every array leaf on data x fsdp; scalars stay replicated."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, _batch_spec(x.ndim) if x.ndim else P())), tree)


def replicate_rows(tree, mesh: Optional[Mesh]):
    """Every leaf on every device of the mesh: what the host reads back. Rows were computed where they were
    sharded; gathering the few [B, max_new_tokens] outputs lets every process read all of them (a mesh over
    several processes has devices no single process can fetch from)."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())), tree)


def shard_params(params, mesh: Mesh):
    """Places every parameter leaf by the partition rules (a no-op for leaves already placed that way)."""
    def put(path, x):
        return jax.device_put(x, NamedSharding(mesh, partition_spec(dotted(path), x.shape, mesh)))
    return jax.tree_util.tree_map_with_path(put, params)


def weights_of(model: nnx.Module, params, mesh: Optional[Mesh]) -> tuple:
    """(graphdef, weights) of one call, as the programs take them: the model's *current* structure (`with
    lora.adapters_disabled(model): sampler.sample(...)` samples the base policy, a different graph compiled once;
    adapters attached after construction work) and a 1-tuple holding one nnx.State, placed on the mesh when there
    is one. params: None (the model's current weights), a State, or a tuple of States from a filtered nnx.split."""
    graphdef = nnx.graphdef(model)
    if params is None:
        params = nnx.state(model)
    elif isinstance(params, tuple):
        # (params, rest) from a filtered nnx.split -> one State, so every caller has the same pytree structure
        # and shares one compiled program.
        params = nnx.merge_state(*params)
    params = (params,)
    if mesh is not None:
        params = shard_params(params, mesh)
    return graphdef, params


# ---------------------------------------------------------------------------------------------------------------
# The two compiled programs

def prefill_sizes(batch: int, multiple: int = 1) -> tuple[int, ...]:
    """The static row counts the prefill program chooses among for a batch bucket of `batch` rows: B/8, B/2
    and B where they are whole multiples of `multiple` (the data-parallel size)."""
    sizes = {batch}
    for div in (8, 2):
        if batch % div == 0 and (batch // div) % multiple == 0:
            sizes.add(batch // div)
    return tuple(sorted(sizes))


@partial(jax.jit, static_argnames=("graphdef", "cache_len", "rows", "mesh"))
def _prefill(graphdef, params: tuple, ids: jax.Array, mask: jax.Array, source: jax.Array,
             *, cache_len: int, rows: int, mesh: Optional[Mesh]) -> tuple[Cache, jax.Array]:
    """ids, mask [B, P] (left-padded; rows [0, U) the distinct prompts), source [B] (the prompt row each row
    samples from), rows (static: the pass runs on the first `rows` >= U rows) -> (cache with P + max_new
    slots, logits of the last position [B, V] f32), for every row."""
    TRACE_COUNTS[("prefill", ids.shape, cache_len, rows)] += 1
    model = nnx.merge(graphdef, *params)
    rows_ids, rows_mask = constrain_rows((ids[:rows], mask[:rows]), mesh)
    hidden, cache = model.hidden_states(rows_ids, rows_mask, cache_length=cache_len)
    # Only the last position's logits are needed: never materialise [B, P, V] (P x 248k floats per row).
    logits = model.logits_from_hidden(hidden[:, -1]).astype(jnp.float32)
    copy = lambda x: jnp.take(x, source, axis=0)  # noqa: E731  prompt rows -> sampling rows
    cache = Cache(jax.tree.map(copy, cache.layers), copy(cache.valid), cache.length, copy(cache.next_position))
    return constrain_rows((cache, copy(logits)), mesh)


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "mode", "pad_id", "mesh"),
         donate_argnames=("cache",))
def _decode(graphdef, params: tuple, cache: Cache, logits: jax.Array, row_valid: jax.Array,
            group_ids: jax.Array, sample_ids: jax.Array, seed: jax.Array, temperature: jax.Array,
            top_p: jax.Array, stop_ids: jax.Array, *, max_new_tokens: int, mode: SamplingMode, pad_id: int,
            mesh: Optional[Mesh]) -> tuple[dict, Cache]:
    """Samples up to max_new_tokens per row.

    logits [B, V] (of the last prompt token), row_valid [B] bool (False: batch padding), group_ids /
    sample_ids [B] int (key derivation), stop_ids [S] int32 (EOS and stop ids, padded with -1).
    Returns tokens [B, N] int32 (pad after each row's end), logprobs [B, N] f32 (0 after the end), lengths [B]
    int32 (stop token included), stopped [B] bool (ended on a stop token), steps (int32: model calls made,
    <= N - 1); and the final cache.
    """
    TRACE_COUNTS[("decode", logits.shape[0], cache.max_length, max_new_tokens, stop_ids.shape, mode)] += 1
    model = nnx.merge(graphdef, *params).transpose_for_decode()
    batch = logits.shape[0]
    keys = row_keys(seed, group_ids, sample_ids)

    def is_stop(tok):
        return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)

    tok, lp = sample_tokens(logits, step_keys(keys, 0), temperature, top_p, mode)
    tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(tok)
    logprobs = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(lp)
    stopped = is_stop(tok)
    done = stopped | ~row_valid
    lengths = jnp.ones((batch,), jnp.int32)
    ones = jnp.ones((batch, 1), jnp.int32)

    def cond(carry):
        step, _, _, _, _, done, _, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, cache, tok, tokens, logprobs, done, stopped, lengths = carry
        # Finished rows keep running on a pad token (fixed shapes); their outputs are masked out below.
        inputs = jnp.where(done, pad_id, tok)[:, None]
        step_logits, cache = model(inputs, attention_mask=ones, cache=cache)
        new, lp = sample_tokens(step_logits[:, 0], step_keys(keys, step), temperature, top_p, mode)
        active = ~done
        new = jnp.where(active, new, pad_id)
        tokens = jax.lax.dynamic_update_slice(tokens, new[:, None], (0, step))
        logprobs = jax.lax.dynamic_update_slice(logprobs, jnp.where(active, lp, 0.0)[:, None], (0, step))
        hit = active & is_stop(new)
        carry = (step + 1, constrain_rows(cache, mesh), new, tokens, logprobs, done | hit, stopped | hit,
                 lengths + active.astype(jnp.int32))
        return carry

    carry = (jnp.int32(1), cache, tok, tokens, logprobs, done, stopped, lengths)
    step, cache, _, tokens, logprobs, _, stopped, lengths = jax.lax.while_loop(cond, body, carry)
    # The cache is returned (and dropped by the caller) so that its donated input buffers alias the loop state:
    # the loop then updates the KV cache in place instead of first copying it.
    out = {"tokens": tokens, "logprobs": logprobs, "lengths": lengths, "stopped": stopped & row_valid,
           "steps": step - 1}
    return replicate_rows(out, mesh), cache


# ---------------------------------------------------------------------------------------------------------------
# Host side

@dataclasses.dataclass
class GenerationOutput:
    """Samples in prompt-major order: row i is sample sample_indices[i] of prompt prompt_indices[i].

    tokens[i]: generated ids, up to and including the stop token. logprobs[i]: [len] f32, log-probability of each
    generated token under the model at temperature 1 without filtering. finish_reasons[i]: "stop" (ended on an
    EOS or stop id) or "length" (hit max_new_tokens: the completion is truncated).
    """

    tokens: list[list[int]]
    logprobs: list[np.ndarray]
    finish_reasons: list[str]
    prompt_indices: list[int]
    sample_indices: list[int]
    prompt_lengths: list[int]
    max_new_tokens: int
    texts: Optional[list[str]] = None
    stats: dict = dataclasses.field(default_factory=dict)

    @property
    def truncated(self) -> list[bool]:
        return [r == "length" for r in self.finish_reasons]

    @property
    def num_tokens(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def __len__(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass
class PlannedBatch:
    """One program call's inputs, built on the host by `Sampler.plan`."""

    rows: np.ndarray  # [b] indices into the flat row list (b <= B: the rest is padding)
    ids: np.ndarray  # [B, P] int32, left-padded: rows [0, U) the batch's distinct prompts, the rest padding
    mask: np.ndarray  # [B, P] int32
    source: np.ndarray  # [B] int32: the prompt row (of ids) that row k samples from
    num_prompts: int  # U
    row_valid: np.ndarray  # [B] bool
    group_ids: np.ndarray  # [B] uint32
    sample_ids: np.ndarray  # [B] uint32


class SamplerBase:
    """What every sampler of one model structure holds (the static `Sampler` here, the continuous-batching
    `jaxrl.rollout.engine.ContinuousSampler`): the settings below, checked once, and the weights of a call.

    Args:
      model: the nnx model to sample from; each `sample()` reads its current structure (adapters attached,
        enabled or disabled) and, unless `params` is given, its current weights.
      max_new_tokens: the generation cap (a static size of the token buffer and the KV cache).
      max_prompt_len: the longest prompt accepted (a longer one is an error naming it). Default: the largest
        prompt bucket.
      prompt_buckets: prompt lengths that get their own program; default 32, 64, ... up to max_prompt_len.
      batch_size: rows per program call (the largest batch bucket); smaller batches use power-of-two buckets.
      eos_token_ids, stop_token_ids: ids that end a row (finish_reason "stop"; the id is kept in the tokens).
      pad_token_id: the id written into padding (never attended to).
      mesh: a (data, fsdp, tensor) mesh: rows are split over data x fsdp, parameters placed by the sharding rules.
    """

    def __init__(self, model: nnx.Module, *, max_new_tokens: int, max_prompt_len: Optional[int] = None,
                 prompt_buckets: Optional[Sequence[int]] = None, batch_size: int = 32,
                 batch_buckets: Optional[Sequence[int]] = None, eos_token_ids: Sequence[int] = (),
                 stop_token_ids: Sequence[int] = (), pad_token_id: Optional[int] = None,
                 mesh: Optional[Mesh] = None):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model = model
        self.graphdef = nnx.graphdef(model)
        self.vocab_size = int(model.config.vocab_size)
        self.max_new_tokens = int(max_new_tokens)
        if prompt_buckets is None:
            if max_prompt_len is None:
                raise ValueError("give max_prompt_len or prompt_buckets")
            prompt_buckets = default_prompt_buckets(int(max_prompt_len))
        self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets))
        self.max_prompt_len = int(max_prompt_len) if max_prompt_len is not None else self.prompt_buckets[-1]
        if self.max_prompt_len > self.prompt_buckets[-1]:
            raise ValueError(f"max_prompt_len {self.max_prompt_len} exceeds the largest prompt bucket "
                             f"{self.prompt_buckets[-1]}")
        self.mesh = mesh
        dp = 1 if mesh is None else mesh.shape[DATA] * mesh.shape[FSDP]
        self._dp = dp
        if batch_size % dp:
            batch_size += dp - batch_size % dp  # every program's rows must split evenly over the devices
        self.batch_buckets = tuple(sorted(batch_buckets)) if batch_buckets else default_batch_buckets(batch_size,
                                                                                                         dp)
        bad = [b for b in self.batch_buckets if b % dp]
        if bad:
            raise ValueError(f"batch buckets {bad} are not multiples of the data-parallel size {dp}")
        self.batch_size = self.batch_buckets[-1]
        ids = tuple(int(t) for t in eos_token_ids) + tuple(int(t) for t in stop_token_ids)
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"stop/eos token id {t} is outside the vocabulary [0, {self.vocab_size})")
        self.stop_ids = tuple(sorted(set(ids)))
        # A traced operand, padded with -1 to a multiple of 8: changing the stop ids does not recompile.
        width = max(8, -(-len(self.stop_ids) // 8) * 8)
        self._stop_array = np.full((width,), -1, np.int32)
        self._stop_array[:len(self.stop_ids)] = self.stop_ids
        if pad_token_id is None:
            pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.pad_id = int(pad_token_id)

    # -----------------------------------------------------------------------------------------------------------
    def resolve_params(self, params=None) -> tuple:
        """The weights one call runs with (`weights_of`), and the held model's current structure in `graphdef`."""
        self.graphdef, params = weights_of(self.model, params, self.mesh)
        return params

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        out = []
        for j, p in enumerate(prompts):
            arr = np.asarray(p, dtype=np.int64).reshape(-1)
            if arr.size == 0:
                raise ValueError(f"prompt {j} is empty")
            if arr.size > self.max_prompt_len:
                raise ValueError(f"prompt {j} has {arr.size} tokens, over max_prompt_len={self.max_prompt_len}; "
                                 "shorten it or raise max_prompt_len (prompts are never cut silently)")
            if arr.min() < 0 or arr.max() >= self.vocab_size:
                raise ValueError(f"prompt {j} has token ids outside [0, {self.vocab_size})")
            out.append(arr.astype(np.int32))
        return out

    def _check_call(self, prompts, n: int, seed: int, temperature: float, top_p: float, top_k: int,
                    group_ids) -> tuple[SamplingMode, list[np.ndarray], list[int]]:
        """The checks every `sample` call starts with: (sampling mode, prompts as arrays, group ids mod 2^32)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not 0 <= int(seed) < 2 ** 32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        mode = sampling_mode(float(temperature), float(top_p), int(top_k), self.vocab_size)
        arrays = self._check_prompts(prompts)
        if group_ids is None:
            group_ids = range(len(arrays))
        group_ids = [int(g) % 2 ** 32 for g in group_ids]
        if len(group_ids) != len(arrays):
            raise ValueError(f"{len(group_ids)} group_ids for {len(arrays)} prompts")
        return mode, arrays, group_ids


class Sampler(SamplerBase):
    """The static sampler: rows grouped by prompt bucket into batches, each batch prefilled and then decoded until
    its longest row stops (module docstring). The reference of the continuous-batching engine
    (`jaxrl.rollout.engine.ContinuousSampler`, which every consumer samples with), token for token."""

    def plan(self, prompts: Sequence[np.ndarray], n: int, group_ids: Sequence[int]) -> list[PlannedBatch]:
        """Rows (prompt-major) grouped by prompt bucket, chunked into batches padded to batch buckets."""
        by_bucket: dict[int, list[int]] = collections.defaultdict(list)
        for j, p in enumerate(prompts):
            bucket = pick_bucket(len(p), self.prompt_buckets, f"prompt {j} length")
            by_bucket[bucket].extend(j * n + s for s in range(n))
        batches = []
        for bucket in sorted(by_bucket):
            rows = by_bucket[bucket]
            for start in range(0, len(rows), self.batch_size):
                chunk = np.asarray(rows[start:start + self.batch_size])
                size = pick_bucket(len(chunk), self.batch_buckets, "batch")
                ids = np.full((size, bucket), self.pad_id, np.int32)
                mask = np.zeros((size, bucket), np.int32)
                mask[:, -1] = 1  # padding rows get one (pad) token so every row has a real last position
                source = np.zeros((size,), np.int32)
                gids = np.zeros((size,), np.uint32)
                sids = np.zeros((size,), np.uint32)
                prompt_row: dict[int, int] = {}  # prompt index -> its row in ids
                for k, r in enumerate(chunk):
                    j = int(r) // n
                    if j not in prompt_row:
                        u = prompt_row[j] = len(prompt_row)
                        p = prompts[j]
                        ids[u, bucket - len(p):] = p
                        mask[u, :] = 0
                        mask[u, bucket - len(p):] = 1
                    source[k] = prompt_row[j]
                    gids[k] = group_ids[j]
                    sids[k] = r % n
                valid = np.zeros((size,), bool)
                valid[:len(chunk)] = True
                batches.append(PlannedBatch(chunk, ids, mask, source, len(prompt_row), valid, gids, sids))
        return batches

    def run_batch(self, params: tuple, batch: PlannedBatch, mode: SamplingMode, seed: int, temperature: float,
                  top_p: float) -> dict:
        """Prefill + decode of one planned batch; returns the device arrays of `_decode` (not yet fetched)."""
        valid, gids, sids = batch.row_valid, batch.group_ids, batch.sample_ids
        if self.mesh is not None:
            put = lambda x: jax.device_put(x, NamedSharding(self.mesh, _batch_spec(x.ndim)))  # noqa: E731
            valid, gids, sids = map(put, (valid, gids, sids))
        cache, logits = self.prefill(params, batch)
        return self.decode(params, cache, logits, valid, gids, sids, mode, seed, temperature, top_p)

    def prefill(self, params: tuple, batch: PlannedBatch) -> tuple[Cache, jax.Array]:
        """The caches and last-token logits of every row of `batch` (each distinct prompt prefilled once)."""
        ids, mask, source = batch.ids, batch.mask, batch.source
        if self.mesh is not None:
            put = lambda x: jax.device_put(x, NamedSharding(self.mesh, _batch_spec(x.ndim)))  # noqa: E731
            ids, mask, source = map(put, (ids, mask, source))
        rows = next(size for size in prefill_sizes(ids.shape[0], self._dp) if size >= batch.num_prompts)
        return _prefill(self.graphdef, params, ids, mask, source, cache_len=ids.shape[1] + self.max_new_tokens,
                        rows=rows, mesh=self.mesh)

    def decode(self, params: tuple, cache: Cache, logits, row_valid, group_ids, sample_ids, mode: SamplingMode,
               seed: int, temperature: float, top_p: float) -> dict:
        out, _ = _decode(self.graphdef, params, cache, logits, row_valid, group_ids, sample_ids,
                         np.uint32(seed), np.float32(temperature if temperature > 0 else 1.0), np.float32(top_p),
                         self._stop_array, max_new_tokens=self.max_new_tokens, mode=mode,
                         pad_id=self.pad_id, mesh=self.mesh)
        return out

    # -----------------------------------------------------------------------------------------------------------
    def sample(self, prompts: Sequence[Sequence[int]], *, params=None, n: int = 1, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0,
               group_ids: Optional[Sequence[int]] = None) -> GenerationOutput:
        """Generates `n` samples for each prompt (token-id lists of any lengths up to max_prompt_len).

        params: the weights to sample with: an nnx.State (or a tuple of States from a filtered nnx.split) of a
          model with this sampler's structure; default the held model's current weights.
        group_ids: per prompt, the id its samples' keys derive from (default: the prompt's index).
        """
        mode, arrays, group_ids = self._check_call(prompts, n, seed, temperature, top_p, top_k, group_ids)
        params = self.resolve_params(params)
        batches = self.plan(arrays, n, group_ids)
        # Dispatch every batch before fetching any result, so host work overlaps device work.
        pending = [(b, self.run_batch(params, b, mode, seed, temperature, top_p)) for b in batches]
        num_rows = len(arrays) * n
        tokens: list = [None] * num_rows
        logprobs: list = [None] * num_rows
        reasons: list = [None] * num_rows
        steps = slot_steps = 0
        for batch, result in pending:
            res = jax.device_get(result)
            steps += int(res["steps"])
            slot_steps += int(res["steps"]) * len(batch.row_valid)
            for k, r in enumerate(batch.rows):
                length = int(res["lengths"][k])
                tokens[r] = res["tokens"][k, :length].tolist()
                logprobs[r] = np.asarray(res["logprobs"][k, :length], np.float32)
                reasons[r] = "stop" if res["stopped"][k] else "length"
        stats = {"batches": len(batches), "rows": num_rows,
                 "padded_rows": sum(len(b.row_valid) for b in batches),
                 "generated_tokens": sum(len(t) for t in tokens), "decode_steps": steps, "slot_steps": slot_steps}
        return GenerationOutput(tokens=tokens, logprobs=logprobs, finish_reasons=reasons,
                                prompt_indices=[r // n for r in range(num_rows)],
                                sample_indices=[r % n for r in range(num_rows)],
                                prompt_lengths=[len(arrays[r // n]) for r in range(num_rows)],
                                max_new_tokens=self.max_new_tokens, stats=stats)
