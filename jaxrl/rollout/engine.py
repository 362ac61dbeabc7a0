"""Continuous batching: a fixed number of decode slots kept busy, finished rows replaced by waiting ones.

    engine = Engine(model, slots=64, prompt_len=512, max_new_tokens=4096, eos_token_ids=(eos,))
    engine.set_params(params)                       # the weights of the rows admitted from now on (None: the model's)
    ticket = engine.submit(Request(prompt_ids, group_id=g, sample_index=i, seed=s, temperature=1.0))
    engine.run()                                    # or engine.step() per round, from a worker thread
    ticket.wait(); ticket.completion.tokens, .logprobs, .finish_reason

    sampler = ContinuousSampler(model, max_new_tokens=4096, max_prompt_len=2048, batch_size=64, eos_token_ids=...)
    out = sampler.sample(prompts, params=..., n=8, temperature=1.0, seed=step)   # a GenerationOutput, like Sampler's

How it runs (a few compiled programs per shape, nothing in Python per token):

  * insert: waiting rows are prefilled together, each distinct prompt once, in the training-style pass
    (`Qwen35.hidden_states(..., cache_length=P)`); every row samples its first token from its prompt's last
    logits and its caches are written into a free slot (a per-slot update; the other slots are untouched). An
    empty engine is filled in one insert of all its slots; after that K rows move in at a time (`insert_rows`,
    slots / INSERT_FRACTION). The cache is *per row* (`Qwen35.init_cache(per_row=True)`): slot b's prompt fills
    cache slots [0, P) left-padded, its n-th generated token goes to slot P + n, whatever the other slots do.
  * round: a `lax.while_loop` of decode steps over all slots (free and finished slots ride along masked out,
    fixed shapes) that stops after `round_steps` steps, when no slot runs, as soon as K slots are free while rows
    wait, or (nothing waiting) as soon as the running rows fit the next smaller slot count. Between rounds the
    host reads which slots finished (a few bytes), collects their tokens and refills them.
  * shrink: once nothing waits, the rows still running move to half the slots as soon as they fit (halvings down
    to slots / MAX_SHRINK, `shrink_ladder`), so the tail of a rollout (its longest rows) does not pay for empty
    slots: a decode step's bytes are the weights plus every slot's caches (Gated DeltaNet state, KV), which at
    rollout batch sizes are most of them. Only where the cap is long enough to pay for the extra programs
    (`ContinuousSampler`: SHRINK_MIN_CAP).
  * prepare: the decode weight copies, once per call (below).

Randomness: row r's key is fold_in(fold_in(key(seed), group id), sample index) and its n-th token is drawn with
fold_in(key, n) (`jaxrl.rollout.sampling`), exactly as the static sampler draws it: never the slot, round or
batch. With the same prompt length (prompt bucket) the computation of a row is the static path's as well, so the
samples are the same token for token; the few floating-point sums whose length differs between the two paths
(the decode attention reads a prefix of the cache sized by the longest row in flight) may differ in the last bit,
which can flip a choice only at a near-tie of two logits within that rounding (fp32: ~1e-6 relative; bf16: a
bf16 rounding of the logits). tests/test_rollout_engine.py holds tokens identical and log-probs within 1e-5.

Weights: `set_params` prepares the decode weight copies once per weight version (`Qwen35.decode_weights`: each
LoRA adapter's A stacked under its projection's weight, so one product gives both, and [in, out] copies on the
CPU) and every round uses them. The adapter is computed exactly as unfused (the policy the trainer holds), never
merged (a bf16 merge would erase small updates).

Compiled programs, per (model structure, sampling mode, cap, samples per prompt): per prompt length P and
starting slot count, a fill insert and a refill insert; per slot count the rows run at, a round and (shrinking) a
shrink; one weight preparation. `program_bound` states it; one call uses one P and one starting slot count, so a
rollout of online GRPO (one P chosen from its data, one slot count) compiles: prepare, fill, at most a refill,
and per shrink size a round and a shrink.

Server use (`launchers.serve`, jaxrl/rollout/serve_continuous.py): Engines held for the process, one per (prompt
bucket, generation bucket, stop-id width) in use (an Engine's prompt width and cap are static shapes), each with
`shrink_sizes=()` and a small `round_steps` (a new request joins free slots at the next round end), all stepped
by one worker thread (`step` per round; `serve_forever` runs a lone Engine the same way, its callers `submit`
from any thread and wait on their tickets). Requests carry their own key, cap, stop ids and sampling values; a
request of another sampling mode (greedy / top-k / top-p on or off: a static part of the programs) waits until
the rows in flight drain. The weights are the engine's: `set_params` only when `idle` (an adapter switch), the
other Engines taking the same weights and decode copies with `share_params`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from functools import partial
from typing import Hashable, Iterator, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from jaxrl.models.qwen35.layers import KVState, write_rows
from jaxrl.models.qwen35.model import Cache
from jaxrl.parallel.mesh import DATA, FSDP
from jaxrl.rollout.sampler import (TRACE_COUNTS, GenerationOutput, SamplerBase, constrain_rows, replicate_rows,
                                   pick_bucket, weights_of)
from jaxrl.rollout.sampling import SamplingMode, sample_tokens, sampling_mode, step_keys

__all__ = ["Completion", "ContinuousSampler", "Engine", "Request", "Ticket", "engine_programs", "program_bound"]

# Decode steps per round of a held Engine (a server): a request that arrives while every slot runs waits for the
# round to end. ContinuousSampler's calls know all their rows up front and let a round run to the cap.
DEFAULT_ROUND_STEPS = 16
# The insert size K (`insert_sizes`): a prefill pass and a round end (a host round trip) per K freed slots, and on
# average K / 2 slots waiting for their refill. K is slots / INSERT_FRACTION; at least MIN_INSERT_ROWS (or a
# quarter of fewer slots: with few slots a step costs about the same whatever its rows do, the weights read and
# fixed per-step work, so a bigger K saves rounds for free); and at least slots * TURNOVER_STEPS / cap: rows of at
# most `cap` tokens free a slot every cap / 2 steps or so, and a round costs about as much as a few decode steps,
# so short generations refill in bigger groups (a cap of 8 refills all slots at once, as a static batch would).
INSERT_FRACTION = 16
MIN_INSERT_ROWS = 4
TURNOVER_STEPS = 32
MAX_SHRINK = 16
# A sampler whose cap is below this never shrinks: the steps a shrink can save (at most the cap) do not pay for
# compiling the smaller slot counts' programs.
SHRINK_MIN_CAP = 128
ENGINE_PROGRAMS = ("engine_prepare", "engine_prefill", "engine_insert", "engine_round", "engine_shrink")


def engine_programs() -> int:
    """How many engine programs this process has traced (each trace precedes one compilation)."""
    return sum(n for key, n in TRACE_COUNTS.items() if key[0] in ENGINE_PROGRAMS)


def program_bound(start_sizes: Sequence[int], prompt_lengths: int, multiple: int = 1, shrink: bool = True) -> int:
    """The most engine programs one (model structure, sampling mode, cap, samples per prompt) can compile when
    calls start at the slot counts `start_sizes` (a sampler's batch buckets) with `prompt_lengths` prompt
    lengths: per prompt length and start size, a prefill and an insert (K rows), a round per slot count the rows
    can run at and, when they shrink, a shrink per slot count; and one weight preparation."""
    sizes = set(start_sizes)
    if shrink:
        for s in start_sizes:
            sizes.update(shrink_ladder(s, multiple))
    return prompt_lengths * (2 * len(start_sizes) + len(sizes) * (2 if shrink else 1)) + 1


# ---------------------------------------------------------------------------------------------------------------
# Device state and programs

class SlotState(NamedTuple):
    """Everything the slots hold on the device (B slots, N = the cap, S = P + N cache slots, W stop ids)."""

    cache: Cache  # per-row cache
    token: jax.Array  # [B] int32: the last sampled token, the next model input
    generated: jax.Array  # [B] int32: tokens generated so far (the index of the next one)
    running: jax.Array  # [B] bool: the slot's row still decodes
    stopped: jax.Array  # [B] bool: the row ended on a stop id
    tokens: jax.Array  # [B, N] int32 (pad after the row's end)
    logprobs: jax.Array  # [B, N] f32 (0 after the row's end)
    keys: jax.Array  # [B, 2] uint32: the row's key (seed, group id, sample index)
    cap: jax.Array  # [B] int32: the row's max_new_tokens
    temperature: jax.Array  # [B] f32
    top_p: jax.Array  # [B] f32
    stop_ids: jax.Array  # [B, W] int32, padded with -1


class Structure:
    """A model's graph and its weights' tree structure, as the engine's programs take them: one static argument
    hashed once (a GraphDef hashes its whole module tree on every call, a dispatch's largest cost on a small
    model), with the weights passed as a flat list of arrays (flattening an nnx.State on every call costs several
    times the rest of a dispatch)."""

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Structure) and self._hash == other._hash
                                 and self.graphdef == other.graphdef and self.treedef == other.treedef)

    def merge(self, leaves: list) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


@partial(jax.jit, static_argnames=("graphdef", "slots", "cache_len", "max_new_tokens", "stop_width", "pad_id",
                                   "mesh"))
def _init_state(graphdef: Structure, params: list, *, slots: int, cache_len: int, max_new_tokens: int,
                stop_width: int, pad_id: int, mesh: Optional[Mesh]) -> SlotState:
    model = graphdef.merge(params)
    f32, i32 = jnp.float32, jnp.int32
    state = SlotState(
        model.init_cache(slots, cache_len, per_row=True), jnp.full((slots,), pad_id, i32), jnp.zeros((slots,), i32),
        jnp.zeros((slots,), bool), jnp.zeros((slots,), bool), jnp.full((slots, max_new_tokens), pad_id, i32),
        jnp.zeros((slots, max_new_tokens), f32), jnp.zeros((slots, 2), jnp.uint32), jnp.ones((slots,), i32),
        jnp.ones((slots,), f32), jnp.ones((slots,), f32), jnp.full((slots, stop_width), -1, i32))
    return constrain_rows(state, mesh)


@partial(jax.jit, static_argnames=("graphdef", "fuse_adapters"))
def _prepare(graphdef: Structure, params: list, *, fuse_adapters: bool) -> dict:
    """The decode weight copies of these weights (`Qwen35.decode_weights`), made once per weight version."""
    TRACE_COUNTS[("engine_prepare", fuse_adapters)] += 1
    return graphdef.merge(params).decode_weights(fuse_adapters)


@partial(jax.jit, static_argnames=("graphdef", "mesh"))
def _prefill(graphdef: Structure, params: list, ids: jax.Array, mask: jax.Array, *, mesh: Optional[Mesh]
             ) -> tuple[Cache, jax.Array]:
    """The caches of the U prompts of ids / mask [U, P] (left-padded; P cache slots each) and the logits of their
    last position [U, V] f32: what an insert copies into the slots of the rows that sample from them."""
    TRACE_COUNTS[("engine_prefill", ids.shape)] += 1
    model = graphdef.merge(params)
    ids, mask = constrain_rows((ids, mask), mesh)
    hidden, fresh = model.hidden_states(ids, mask, cache_length=ids.shape[1])
    # Only the last position's logits are needed: never materialise [U, P, V].
    logits = model.logits_from_hidden(hidden[:, -1]).astype(jnp.float32)
    return constrain_rows((fresh, logits), mesh)


@partial(jax.jit, static_argnames=("mode", "pad_id", "mesh"), donate_argnames=("state",))
def _insert(state: SlotState, fresh: Cache, logits: jax.Array, source: jax.Array, slots: jax.Array,
            seeds: jax.Array, group_ids: jax.Array, sample_ids: jax.Array, caps: jax.Array, temperature: jax.Array,
            top_p: jax.Array, stop_ids: jax.Array, *, mode: SamplingMode, pad_id: int, mesh: Optional[Mesh]
            ) -> SlotState:
    """Moves K rows into the slots: row k takes the prefilled prompt source[k] (of `fresh` / `logits`, U prompts
    of `_prefill`) into slot slots[k] (slots[k] == B: padding, dropped) and samples its first token. seeds,
    group_ids, sample_ids, caps, temperature, top_p [K]; stop_ids [K, W]."""
    num_slots, max_new = state.tokens.shape
    prompt_len = fresh.valid.shape[1]
    TRACE_COUNTS[("engine_insert", num_slots, state.cache.max_length, logits.shape[0], source.shape[0],
                  stop_ids.shape[1], mode)] += 1
    take = lambda x: jnp.take(x, source, axis=0)  # noqa: E731  prompt rows -> the rows moving in
    base = jax.vmap(jax.random.PRNGKey)(seeds)
    keys = jax.vmap(lambda k, g, s: jax.random.fold_in(jax.random.fold_in(k, g), s))(
        base, group_ids.astype(jnp.uint32), sample_ids.astype(jnp.uint32))
    first, first_lp = sample_tokens(take(logits), step_keys(keys, 0), temperature[:, None], top_p[:, None], mode)
    stopped = _is_stop(first, stop_ids)
    put = lambda big, small: big.at[slots].set(small.astype(big.dtype), mode="drop")  # noqa: E731
    layers = []
    for big, small in zip(state.cache.layers, fresh.layers):
        if isinstance(big, KVState):  # the prompt's keys and values fill cache slots [0, P)
            layers.append(KVState(*(b.at[slots, :, :prompt_len].set(take(x).astype(b.dtype), mode="drop")
                                    for b, x in zip(big, small))))
        else:
            layers.append(jax.tree.map(lambda b, x: put(b, take(x)), big, small))
    valid = jnp.pad(take(fresh.valid), ((0, 0), (0, state.cache.max_length - prompt_len)))
    rows = len(first)
    cache = Cache(tuple(layers), put(state.cache.valid, valid), put(state.cache.length, jnp.full((rows,), prompt_len)),
                  put(state.cache.next_position, take(fresh.next_position)))
    new = SlotState(
        cache, put(state.token, first), put(state.generated, jnp.ones((rows,), jnp.int32)),
        put(state.running, ~stopped & (caps > 1)), put(state.stopped, stopped),
        put(state.tokens, jnp.full((rows, max_new), pad_id, jnp.int32).at[:, 0].set(first)),
        put(state.logprobs, jnp.zeros((rows, max_new), jnp.float32).at[:, 0].set(first_lp)), put(state.keys, keys),
        put(state.cap, caps), put(state.temperature, temperature), put(state.top_p, top_p),
        put(state.stop_ids, stop_ids))
    return constrain_rows(new, mesh)


@partial(jax.jit, static_argnames=("graphdef", "mode", "pad_id", "mesh"), donate_argnames=("state",))
def _round(graphdef: Structure, params: list, decode_weights: dict, state: SlotState, max_steps: jax.Array,
           want_free: jax.Array, *, mode: SamplingMode, pad_id: int, mesh: Optional[Mesh]
           ) -> tuple:
    """Up to max_steps decode steps over every slot; stops early when no slot runs or when at least want_free
    slots are free. Returns the state and what the host reads after a round: [4, B] int32 (rows running,
    generated, stopped, and the steps made in every column: one transfer) and, on a mesh, the token and log-prob
    buffers replicated (every process of a mesh over several processes reads every row; None without a mesh)."""
    num_slots, max_new = state.tokens.shape
    TRACE_COUNTS[("engine_round", num_slots, state.cache.max_length, max_new, state.stop_ids.shape[1], mode)] += 1
    model = graphdef.merge(params).use_decode_weights(decode_weights)

    def cond(carry):
        step, st = carry
        running = jnp.sum(st.running.astype(jnp.int32))
        return (step < max_steps) & (running > 0) & (num_slots - running < want_free)

    def body(carry):
        step, st = carry
        run = st.running
        # Free and finished slots run on a pad token, masked out (fixed shapes); nothing of theirs is kept.
        inputs = jnp.where(run, st.token, pad_id)[:, None]
        logits, cache = model(inputs, attention_mask=run[:, None].astype(jnp.int32), cache=st.cache)
        keys = jax.vmap(jax.random.fold_in)(st.keys, st.generated)  # token n of a row: fold_in(row key, n)
        new, lp = sample_tokens(logits[:, 0], keys, st.temperature[:, None], st.top_p[:, None], mode)
        # Idle slots write their old value back (at a column inside the buffer): nothing of theirs changes.
        column = jnp.minimum(st.generated, max_new - 1)
        old_token = jnp.take_along_axis(st.tokens, column[:, None], axis=1)[:, 0]
        old_lp = jnp.take_along_axis(st.logprobs, column[:, None], axis=1)[:, 0]
        hit = run & _is_stop(new, st.stop_ids)
        generated = st.generated + run.astype(jnp.int32)
        st = st._replace(
            cache=constrain_rows(cache, mesh), token=jnp.where(run, new, st.token), generated=generated,
            running=run & ~hit & (generated < st.cap), stopped=st.stopped | hit,
            tokens=write_rows(st.tokens, jnp.where(run, new, old_token)[:, None], column, axis=1),
            logprobs=write_rows(st.logprobs, jnp.where(run, lp, old_lp)[:, None], column, axis=1))
        return step + 1, st

    steps, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    status = jnp.stack([state.running.astype(jnp.int32), state.generated, state.stopped.astype(jnp.int32),
                        jnp.full((num_slots,), steps, jnp.int32)])
    if mesh is None:
        return state, status, None
    return state, replicate_rows(status, mesh), replicate_rows((state.tokens, state.logprobs), mesh)


@partial(jax.jit, static_argnames=("mesh",))
def _shrink(state: SlotState, keep: jax.Array, *, mesh: Optional[Mesh]) -> SlotState:
    """The slots `keep` [B'] of state, in that order: a state of B' slots."""
    TRACE_COUNTS[("engine_shrink", state.tokens.shape[0], keep.shape[0])] += 1
    return constrain_rows(jax.tree.map(lambda x: jnp.take(x, keep, axis=0), state), mesh)


# ---------------------------------------------------------------------------------------------------------------
# Host side: requests, tickets, the engine

@dataclasses.dataclass(frozen=True)
class Request:
    """One row to generate: `prompt` token ids, keyed by (seed, group_id, sample_index).

    max_new_tokens: this row's cap (<= the engine's; None = the engine's). temperature 0 = greedy; top_p in
    (0, 1]; top_k 0 = off. stop_ids: ids that end this row (None: the engine's EOS and stop ids). prompt_key:
    rows with equal keys share one prefill when they move in together (default: the prompt's tokens).
    """

    prompt: Sequence[int]
    group_id: int = 0
    sample_index: int = 0
    seed: int = 0
    max_new_tokens: Optional[int] = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: Optional[Sequence[int]] = None
    prompt_key: Optional[Hashable] = None


@dataclasses.dataclass
class Completion:
    """A finished row: generated ids (up to and including the stop token), their log-probabilities (temperature 1,
    unfiltered) and "stop" | "length"."""

    tokens: list[int]
    logprobs: np.ndarray
    finish_reason: str


class Ticket:
    """A submitted request: `wait()` blocks until its completion (or raises the engine's error)."""

    def __init__(self, request: Request):
        self.request = request
        self.completion: Optional[Completion] = None
        self.error: Optional[BaseException] = None
        self._event = threading.Event()

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Completion:
        if not self._event.wait(timeout):
            raise TimeoutError(f"request not finished after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.completion

    def _finish(self, completion: Optional[Completion] = None, error: Optional[BaseException] = None) -> None:
        self.completion, self.error = completion, error
        self._event.set()


@dataclasses.dataclass
class _Row:
    """A checked request, as the insert program takes it."""

    ticket: Ticket
    prompt: np.ndarray
    prompt_key: Hashable
    mode: SamplingMode
    cap: int
    stops: np.ndarray  # [W] int32, padded with -1
    temperature: float  # 1.0 for greedy rows (unused by the greedy program)


def shrink_ladder(slots: int, multiple: int = 1) -> tuple[int, ...]:
    """The smaller slot counts a drained rollout moves to: slots / 2, / 4, ... down to slots / MAX_SHRINK (and
    no smaller than `multiple`, the data-parallel size), each a multiple of `multiple`. Halvings: a step's cost
    grows with its slots (the per-row caches are most of the bytes it moves), and a row waits at most until the
    running ones fit half the slots; /MAX_SHRINK bounds the programs (one round and one shrink per size)."""
    out, size = [], slots
    while size % 2 == 0 and size // 2 >= max(multiple, slots // MAX_SHRINK) and (size // 2) % multiple == 0:
        size //= 2
        out.append(size)
    return tuple(out)


def prompts_per_rows(rows: int, samples_per_prompt: int, multiple: int = 1) -> int:
    """The prompts of an insert of `rows` rows whose prompts have n samples each, in a row: ceil(rows / n), the
    prompts such rows hold when they start at a prompt's first sample (a rollout's rows do: the fill takes whole
    prompts and each refill K rows), rounded up to a multiple of `multiple` (the data-parallel size), at most
    `rows`. An insert whose rows would need more stops at a prompt boundary; the next one takes the rest."""
    prompts = -(-rows // max(1, samples_per_prompt))
    return min(-(-rows // multiple) * multiple, -(-prompts // multiple) * multiple)


def insert_sizes(slots: int, samples_per_prompt: int, multiple: int = 1, cap: Optional[int] = None
                 ) -> tuple[int, int]:
    """(K, U): rows moved in per insert (INSERT_FRACTION, MIN_INSERT_ROWS, TURNOVER_STEPS with the rows' `cap`;
    a multiple of `multiple`, at most `slots`) and the prompts its prefill holds (`prompts_per_rows`)."""
    rows = max(1, slots // INSERT_FRACTION, min(MIN_INSERT_ROWS, slots // 4))
    if cap:
        rows = max(rows, -(-slots * TURNOVER_STEPS // cap))
    rows = min(slots, -(-rows // multiple) * multiple)
    return rows, prompts_per_rows(rows, samples_per_prompt, multiple)


class Engine:
    """The continuous-batching engine (module docstring) for one model structure and one prompt length.

    Args:
      model: the nnx model (its structure and, unless `set_params` gives others, its weights).
      slots: rows decoded at once (a multiple of the mesh's data x fsdp size).
      prompt_len: P, the static prompt width (longer prompts are refused, never cut).
      max_new_tokens: the cap (a static size: the token buffers and the cache hold P + cap slots).
      eos_token_ids, stop_token_ids: the default stop ids of a request; pad_token_id: the id of padding.
      insert_rows, prompts_per_insert: K rows per insert and the U prompts its prefill holds (default
        `insert_sizes(slots, 1, cap=max_new_tokens)`, every row its own prompt).
      round_steps: decode steps per round at most (requests join at round ends).
      shrink_sizes: smaller slot counts the rows may move to once nothing waits (() = never: a server).
      stop_width: stop ids a request may carry (default 8, or more for the default stop ids).
      fuse_adapters: stack LoRA adapters into their projections for decoding (`Qwen35.decode_weights`); False
        keeps them apart (the same numbers, more kernels; to measure the difference).
    """

    def __init__(self, model: nnx.Module, *, slots: int, prompt_len: int, max_new_tokens: int,
                 eos_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = (),
                 pad_token_id: Optional[int] = None, mesh: Optional[Mesh] = None, insert_rows: Optional[int] = None,
                 prompts_per_insert: Optional[int] = None, round_steps: int = DEFAULT_ROUND_STEPS,
                 shrink_sizes: Sequence[int] = (), stop_width: Optional[int] = None, fuse_adapters: bool = True):
        self.model, self.mesh, self.fuse_adapters = model, mesh, bool(fuse_adapters)
        self.vocab_size = int(model.config.vocab_size)
        dp = 1 if mesh is None else mesh.shape[DATA] * mesh.shape[FSDP]
        for name, value in (("slots", slots), ("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens),
                            ("round_steps", round_steps)):
            if int(value) < 1:
                raise ValueError(f"Engine: {name} must be >= 1, got {value}")
        if slots % dp:
            raise ValueError(f"Engine: slots={slots} is not a multiple of the data-parallel size {dp}")
        self.slots, self.prompt_len, self.max_new_tokens = int(slots), int(prompt_len), int(max_new_tokens)
        default_k, default_u = insert_sizes(self.slots, 1, dp, self.max_new_tokens)
        self.insert_rows = int(insert_rows or default_k)
        self.prompts_per_insert = int(prompts_per_insert or min(self.insert_rows, default_u))
        if not 1 <= self.prompts_per_insert <= self.insert_rows <= self.slots:
            raise ValueError(f"Engine: need 1 <= prompts_per_insert ({self.prompts_per_insert}) <= insert_rows "
                             f"({self.insert_rows}) <= slots ({self.slots})")
        if self.prompts_per_insert % dp:
            raise ValueError(f"Engine: prompts_per_insert ({self.prompts_per_insert}) must be a multiple of {dp}")
        self.round_steps = int(round_steps)
        self.shrink_sizes = tuple(sorted({int(s) for s in shrink_sizes if int(s) < self.slots}, reverse=True))
        if any(s % dp for s in self.shrink_sizes):
            raise ValueError(f"Engine: shrink_sizes {self.shrink_sizes} must be multiples of {dp}")
        stops = tuple(sorted({int(t) for t in tuple(eos_token_ids) + tuple(stop_token_ids)}))
        self.stop_width = int(stop_width or max(8, -(-len(stops) // 8) * 8))
        self.default_stops = self._stop_array(stops)
        if pad_token_id is None:
            pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.pad_id = int(pad_token_id)
        self.graphdef = self._params = self._decode_weights = None
        self._state: Optional[SlotState] = None
        self._size = self.slots  # the slot count of the state now (shrinks)
        self._occupant: list[Optional[_Row]] = [None] * self.slots
        self._queue: collections.deque[_Row] = collections.deque()
        self._lock = threading.Lock()
        self._submitted = threading.Condition(self._lock)
        self._mode: Optional[SamplingMode] = None
        # the last prefill of each prompt count: (prompt keys, caches, logits), for the next rows of those prompts
        self._prefilled: dict[int, tuple] = {}
        self.stats = {"rows": 0, "finished": 0, "generated_tokens": 0, "decode_steps": 0, "slot_steps": 0, "rounds": 0,
                      "inserts": 0, "prefilled_prompts": 0, "shrinks": 0}

    # ----------------------------------------------------------------------------------------------- requests
    def _stop_array(self, ids: Sequence[int]) -> np.ndarray:
        ids = sorted({int(t) for t in ids})
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop/eos token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) > self.stop_width:
            raise ValueError(f"{len(ids)} stop ids, over the engine's stop_width={self.stop_width}")
        out = np.full((self.stop_width,), -1, np.int32)
        out[:len(ids)] = ids
        return out

    def _check(self, request: Request, ticket: Ticket) -> _Row:
        prompt = np.asarray(request.prompt, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError("the prompt is empty")
        if prompt.size > self.prompt_len:
            raise ValueError(f"the prompt has {prompt.size} tokens, over the engine's prompt_len={self.prompt_len} "
                             "(prompts are never cut)")
        if prompt.min() < 0 or prompt.max() >= self.vocab_size:
            raise ValueError(f"the prompt has token ids outside [0, {self.vocab_size})")
        cap = self.max_new_tokens if request.max_new_tokens is None else int(request.max_new_tokens)
        if not 1 <= cap <= self.max_new_tokens:
            raise ValueError(f"max_new_tokens={cap} is outside [1, {self.max_new_tokens}] (the engine's cap)")
        if not 0 <= int(request.seed) < 2 ** 32:
            raise ValueError(f"seed must be in [0, 2**32), got {request.seed}")
        mode = sampling_mode(float(request.temperature), float(request.top_p), int(request.top_k), self.vocab_size)
        stops = self.default_stops if request.stop_ids is None else self._stop_array(request.stop_ids)
        key = request.prompt_key if request.prompt_key is not None else ("tokens", prompt.tobytes())
        return _Row(ticket, prompt.astype(np.int32), key, mode, cap, stops,
                    float(request.temperature) if request.temperature > 0 else 1.0)

    def submit(self, request: Request) -> Ticket:
        """Queues a request (thread safe); it joins free slots at the next round. ValueError for a bad request."""
        ticket = Ticket(request)
        row = self._check(request, ticket)
        with self._submitted:
            self._queue.append(row)
            self._submitted.notify_all()
        return ticket

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        with self._lock:
            return not self._queue and all(r is None for r in self._occupant)

    @property
    def queued(self) -> int:
        """Rows submitted and not yet in a slot."""
        with self._lock:
            return len(self._queue)

    # ------------------------------------------------------------------------------------------------ weights
    def set_params(self, params=None) -> None:
        """The weights of every row from now on (`jaxrl.rollout.sampler.weights_of`: None = the model's current
        ones); their decode copies are made here, once. Only between rows: refused while rows are in flight."""
        if any(r is not None for r in self._occupant):
            raise RuntimeError("Engine.set_params while rows are in flight would mix two policies in one row; "
                               "wait until the engine is idle")
        graphdef, (state,) = weights_of(self.model, params, self.mesh)
        self._params, treedef = jax.tree.flatten(state)
        self.graphdef = Structure(graphdef, treedef)
        self._prefilled = {}
        self._decode_weights = _prepare(self.graphdef, self._params, fuse_adapters=self.fuse_adapters)

    def share_params(self, other: "Engine") -> None:
        """The weights `other` holds (its last `set_params`) and their decode copies, shared rather than made
        again: a server's engines (one per prompt width and cap) hold one set of copies, not one each. Only
        between rows, as set_params."""
        if any(r is not None for r in self._occupant):
            raise RuntimeError("Engine.share_params while rows are in flight would mix two policies in one row; "
                               "wait until the engine is idle")
        if other._params is None:
            other.set_params(None)
        self.graphdef, self._params, self._decode_weights = other.graphdef, other._params, other._decode_weights
        self._prefilled = {}

    def release(self) -> None:
        """Frees the slots' device memory (the caches); the next row allocates them again."""
        if any(r is not None for r in self._occupant):
            raise RuntimeError("Engine.release while rows are in flight")
        self._state = None
        self._prefilled = {}
        self._size = self.slots
        self._occupant = [None] * self.slots

    # ------------------------------------------------------------------------------------------------- running
    def run(self) -> None:
        """Steps until nothing is queued or in flight."""
        while not self.idle:
            self.step()

    def serve_forever(self, stop: threading.Event, poll_s: float = 0.05) -> None:
        """A server's worker loop: steps while there is work, sleeps on new submissions otherwise, until `stop`.
        A failing step fails every ticket in flight or queued (each caller gets the error), and the loop goes on."""
        while not stop.is_set():
            with self._submitted:
                if not self._queue and all(r is None for r in self._occupant):
                    self._submitted.wait(poll_s)
                    continue
            try:
                self.step()
            except Exception as e:  # noqa: BLE001  every waiting caller must hear of it
                logging.exception("rollout engine step failed")
                self._fail_all(e)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            rows = [r for r in self._occupant if r is not None] + list(self._queue)
            self._queue.clear()
        self._state = None
        self._size = self.slots
        self._occupant = [None] * self.slots
        for row in rows:
            row.ticket._finish(error=error)

    def step(self) -> list[Ticket]:
        """Refills free slots from the queue, runs one round, collects the rows that finished; returns their
        tickets."""
        if self._params is None:
            self.set_params(None)
        self._admit()
        if all(r is None for r in self._occupant):
            return []
        self._state, status, outputs = _round(self.graphdef, self._params, self._decode_weights, self._state,
                                              np.int32(self.round_steps), np.int32(self._want_free()),
                                              mode=self._mode, pad_id=self.pad_id, mesh=self.mesh)
        if outputs is None:  # one device: the state's own buffers
            outputs = (self._state.tokens, self._state.logprobs)
        running, generated, stopped, steps = np.asarray(jax.device_get(status))
        steps = int(steps[0])
        self.stats["rounds"] += 1
        self.stats["decode_steps"] += steps
        self.stats["slot_steps"] += steps * self._size
        finished = [b for b, row in enumerate(self._occupant) if row is not None and not running[b]]
        done = []
        if finished:
            tokens, logprobs = jax.device_get(outputs)
            for b in finished:
                n = int(generated[b])
                row, self._occupant[b] = self._occupant[b], None
                self.stats["generated_tokens"] += n
                self.stats["finished"] += 1
                row.ticket._finish(Completion(tokens[b, :n].tolist(), np.asarray(logprobs[b, :n], np.float32),
                                              "stop" if stopped[b] else "length"))
                done.append(row.ticket)
        self._maybe_shrink()
        return done

    def _want_free(self) -> int:
        """Free slots at which the round hands back: enough for the next insert while rows wait; a smaller slot
        count's worth once nothing waits and the state can shrink; else never (the round runs its steps)."""
        with self._lock:
            waiting = len(self._queue)
            head_fits = waiting and self._queue[0].mode == self._mode
        if head_fits:
            return min(self._refill_at(), waiting)
        if not waiting:
            smaller = [s for s in self.shrink_sizes if s < self._size]
            if smaller:
                return self._size - smaller[0]
        return self._size + 1

    def _refill_at(self) -> int:
        """Free slots a round waits for before refilling them while rows wait: K (one insert's rows), or more when
        rows finish fast. A round end (a host round trip and an insert) costs about a decode step; waiting for F
        free slots leaves about F / 2 of them idle for F / r steps (r rows finish per step), so the cost per step
        is about F / (2 x slots) + r / F, least at F = sqrt(2 x slots x r). Short rows (several finishing every
        step) raise F past K, and a round end then moves several inserts' rows in; long rows keep F = K. r is
        counted, not timed, so the schedule (and every log-prob) stays a function of the inputs."""
        k = self.insert_rows
        rate = self.stats["finished"] / max(self.stats["decode_steps"], 1)
        best = math.sqrt(2 * self._size * rate)
        return max(k, min(self._size // 2, -(-int(best) // k) * k))

    def _maybe_shrink(self) -> None:
        with self._lock:
            if self._queue:
                return
        # One ladder step at a time (each step is one program: a program per ladder pair would be quadratic).
        while True:
            occupied = [b for b, r in enumerate(self._occupant) if r is not None]
            smaller = [s for s in self.shrink_sizes if s < self._size]
            if not occupied or not smaller or len(occupied) > smaller[0]:
                return
            size = smaller[0]
            free = [b for b, r in enumerate(self._occupant) if r is None]
            keep = occupied + free[:size - len(occupied)]
            self._state = _shrink(self._state, np.asarray(keep, np.int32), mesh=self.mesh)
            self._occupant = [self._occupant[b] for b in keep]
            self._size = size
            self.stats["shrinks"] += 1

    def _admit(self) -> None:
        """Moves waiting rows into free slots, K at a time (fewer when fewer wait), an empty engine's slots by
        as many inserts as they take: one insert program (and one prefill program) for every refill, and a
        prompt's rows copy its one prefill whichever insert they move in with."""
        while True:
            free = [b for b, r in enumerate(self._occupant) if r is None]
            with self._lock:
                if not self._queue or not free:
                    return
                empty = len(free) == self._size
                if empty:  # nothing in flight: the head's sampling mode runs next
                    self._mode = self._queue[0].mode
                if self._queue[0].mode != self._mode or len(free) < min(self.insert_rows, len(self._queue)):
                    return
                rows_at_most, prompts_at_most = self.insert_rows, self.prompts_per_insert
                rows, keys = [], set()
                while self._queue and len(rows) < min(rows_at_most, len(free)):
                    head = self._queue[0]
                    if head.mode != self._mode or (head.prompt_key not in keys and len(keys) == prompts_at_most):
                        break
                    keys.add(head.prompt_key)
                    rows.append(self._queue.popleft())
            self._insert(rows, free[:len(rows)], rows_at_most, prompts_at_most)

    def _insert(self, rows: list[_Row], slots: list[int], k: int, u: int) -> None:
        """One insert program moving `rows` into `slots`, padded to k rows, from u prefilled prompts (its static
        shape): the prompts of the last prefill of u prompts when they hold every row's prompt (the next rows of
        a prompt whose first rows moved in before: n samples of a prompt are prefilled once, not once per insert),
        else a prefill of the rows' prompts."""
        if self._state is None:
            self._state = _init_state(self.graphdef, self._params, slots=self._size,
                                      cache_len=self.prompt_len + self.max_new_tokens,
                                      max_new_tokens=self.max_new_tokens, stop_width=self.stop_width,
                                      pad_id=self.pad_id, mesh=self.mesh)
        keys, fresh, logits = self._prefilled.get(u, ((), None, None))
        if not all(row.prompt_key in keys for row in rows):
            keys, fresh, logits = self._prefill(rows, u)
            self._prefilled[u] = keys, fresh, logits
        position = {key: j for j, key in enumerate(keys)}
        source = np.zeros((k,), np.int32)
        where = np.full((k,), self._size, np.int32)  # out of range: a padding row, dropped
        seeds, groups, samples = (np.zeros((k,), np.uint32) for _ in range(3))
        caps = np.ones((k,), np.int32)
        temperature, top_p = np.ones((k,), np.float32), np.ones((k,), np.float32)
        stops = np.full((k, self.stop_width), -1, np.int32)
        for i, (row, slot) in enumerate(zip(rows, slots)):
            request = row.ticket.request
            source[i], where[i] = position[row.prompt_key], slot
            seeds[i], groups[i], samples[i] = (int(request.seed), int(request.group_id) % 2 ** 32,
                                               int(request.sample_index) % 2 ** 32)
            caps[i], temperature[i], top_p[i], stops[i] = row.cap, row.temperature, request.top_p, row.stops
            self._occupant[slot] = row
        self._state = _insert(self._state, fresh, logits, source, where, seeds, groups, samples, caps, temperature,
                              top_p, stops, mode=self._mode, pad_id=self.pad_id, mesh=self.mesh)
        self.stats["inserts"] += 1
        self.stats["rows"] += len(rows)

    def _prefill(self, rows: list[_Row], u: int) -> tuple:
        """(prompt keys, caches, last logits) of the distinct prompts of `rows`, padded to u prompts."""
        width = self.prompt_len
        ids = np.full((u, width), self.pad_id, np.int32)
        mask = np.zeros((u, width), np.int32)
        mask[:, -1] = 1  # padding prompts get one (pad) token so every prompt row has a real last position
        keys: list = []
        for row in rows:
            if row.prompt_key not in keys:
                j = len(keys)
                keys.append(row.prompt_key)
                ids[j, width - len(row.prompt):] = row.prompt
                mask[j] = 0
                mask[j, width - len(row.prompt):] = 1
        self.stats["prefilled_prompts"] += len(keys)
        return (tuple(keys), *_prefill(self.graphdef, self._params, ids, mask, mesh=self.mesh))


# ---------------------------------------------------------------------------------------------------------------
# The sampler every consumer uses

class ContinuousSampler(SamplerBase):
    """`Sampler`'s interface over the engine: `sample(prompts, n=..., ...)` returns the same `GenerationOutput`
    (the same samples, token for token), made with continuous batching.

    One call runs one Engine: its prompt length is the smallest prompt bucket that holds the call's longest
    prompt, its slot count the smallest batch bucket that holds all rows (at most `batch_size`), and its rows
    move to fewer slots as the rollout drains (`shrink_ladder`; shrink None: when the cap is at least
    SHRINK_MIN_CAP, True / False: always / never). `insert_rows` / `round_steps`: the Engine's.
    """

    def __init__(self, model: nnx.Module, *, insert_rows: Optional[int] = None,
                 round_steps: Optional[int] = None, shrink: Optional[bool] = None, fuse_adapters: bool = True,
                 **settings):
        super().__init__(model, **settings)
        self.insert_rows = insert_rows
        self.shrinks = self.max_new_tokens >= SHRINK_MIN_CAP if shrink is None else bool(shrink)
        # Every row of a call is known when it starts, so a round needs to end only when slots are to be refilled
        # or shrunk (the engine's own exits): by default it may run to the cap.
        self.round_steps = int(round_steps) if round_steps else None
        self.fuse_adapters = bool(fuse_adapters)

    def program_bound(self) -> int:
        """The most engine programs this sampler can compile per (model structure, sampling mode)."""
        return program_bound(self.batch_buckets, len(self.prompt_buckets), self._dp, self.shrinks)

    def _engine(self, arrays: list, n: int, slots: int, params, shrink: bool) -> Engine:
        """The Engine of one call: `slots` slots at the smallest prompt bucket holding the longest prompt."""
        prompt_len = pick_bucket(max(len(p) for p in arrays), self.prompt_buckets, "prompt length")
        rows, prompts_per_insert = insert_sizes(slots, n, self._dp, self.max_new_tokens)
        if self.insert_rows:
            rows, prompts_per_insert = self.insert_rows, prompts_per_rows(self.insert_rows, n, self._dp)
        engine = Engine(self.model, slots=slots, prompt_len=prompt_len, max_new_tokens=self.max_new_tokens,
                        eos_token_ids=self.stop_ids, pad_token_id=self.pad_id, mesh=self.mesh,
                        insert_rows=rows, prompts_per_insert=min(rows, prompts_per_insert),
                        round_steps=self.round_steps or self.max_new_tokens,
                        shrink_sizes=shrink_ladder(slots, self._dp) if shrink else (),
                        stop_width=len(self._stop_array), fuse_adapters=self.fuse_adapters)
        engine.set_params(params)
        self.graphdef = engine.graphdef
        return engine

    def sample(self, prompts: Sequence[Sequence[int]], *, params=None, n: int = 1, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0, group_ids: Optional[Sequence[int]] = None,
               row_caps: Optional[Sequence[int]] = None) -> GenerationOutput:
        """As `Sampler.sample`; row_caps: a cap per row (prompt-major, each <= max_new_tokens; default the cap)."""
        mode, arrays, group_ids = self._check_call(prompts, n, seed, temperature, top_p, top_k, group_ids)
        del mode  # each request is checked again by the engine
        num_rows = len(arrays) * n
        if row_caps is not None and len(row_caps) != num_rows:
            raise ValueError(f"{len(row_caps)} row_caps for {num_rows} rows")
        slots = next((b for b in self.batch_buckets if b >= num_rows), self.batch_size)
        engine = self._engine(arrays, n, slots, params, self.shrinks)
        tickets = [engine.submit(Request(arrays[j], group_id=group_ids[j], sample_index=s, seed=int(seed),
                                         max_new_tokens=None if row_caps is None else int(row_caps[j * n + s]),
                                         temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                                         prompt_key=j))
                   for j in range(len(arrays)) for s in range(n)]
        engine.run()
        engine.release()
        done = [t.wait() for t in tickets]
        stats = dict(engine.stats, slots=slots, prompt_len=engine.prompt_len, batches=engine.stats["rounds"],
                     padded_rows=slots)
        return GenerationOutput(tokens=[c.tokens for c in done], logprobs=[c.logprobs for c in done],
                                finish_reasons=[c.finish_reason for c in done],
                                prompt_indices=[r // n for r in range(num_rows)],
                                sample_indices=[r % n for r in range(num_rows)],
                                prompt_lengths=[len(arrays[r // n]) for r in range(num_rows)],
                                max_new_tokens=self.max_new_tokens, stats=stats)

    def stream(self, prompts: Sequence[Sequence[int]], *, params=None, n: int = 1, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0, group_ids: Optional[Sequence[int]] = None,
               lookahead: Optional[int] = None) -> Iterator[tuple[int, list[Completion]]]:
        """(prompt index, its n completions) for every prompt, in prompt order, from ONE engine fed as it goes.

        The rows of later prompts are queued while fewer than `lookahead` rows wait (default: twice the slots, so
        the queue outlasts a round's refills: a drained queue would let the engine shrink its slots), so
        a slot freed by a finished row is refilled from the next prompts instead of idling until the last rows of
        a batch end: a run pays for one tail, not one per batch of prompts. Everything happens between the
        caller's `next()` calls (no thread): the schedule, and so every log-probability, is a function of the
        inputs alone. `stats` (this object's attribute) holds the engine's counters once the stream is exhausted.
        """
        mode, arrays, group_ids = self._check_call(prompts, n, seed, temperature, top_p, top_k, group_ids)
        del mode
        num_rows = len(arrays) * n
        slots = next((b for b in self.batch_buckets if b >= num_rows), self.batch_size)
        # One tail per stream: the programs of a shrink ladder cost more to compile than they save on one tail.
        engine = self._engine(arrays, n, slots, params, shrink=False)
        lookahead = int(lookahead or 2 * slots)
        pending: dict[int, list[Ticket]] = {}
        queued = 0  # prompts whose rows are submitted
        for j in range(len(arrays)):
            while True:
                while queued < len(arrays) and engine.queued < lookahead:
                    pending[queued] = [engine.submit(Request(
                        arrays[queued], group_id=group_ids[queued], sample_index=s, seed=int(seed),
                        temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), prompt_key=queued))
                        for s in range(n)]
                    queued += 1
                if all(t.done for t in pending[j]):
                    break
                if engine.idle:
                    raise RuntimeError(f"the engine went idle with prompt {j}'s rows unfinished")
                engine.step()
            yield j, [t.wait() for t in pending.pop(j)]
        engine.release()
        self.stats = dict(engine.stats, slots=slots, prompt_len=engine.prompt_len)
