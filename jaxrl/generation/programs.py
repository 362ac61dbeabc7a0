"""The engine's device state and its compiled programs (jaxrl/generation/engine.py schedules them):

  * prepare: the decode weight copies of a set of weights (`Qwen35.decode_weights`), once per weight version;
  * prefill: the caches and last-position logits of U prompts (the training-style pass, fused attention over the
    prompt alone and the chunked delta rule), kept by the engine for every row of those prompts;
  * insert: K rows moved into free slots, each copying its prompt's prefill into its slot of the per-row cache
    and sampling its first token from the prompt's last logits;
  * round: a `lax.while_loop` of decode steps over every slot (free and finished slots ride along masked out,
    fixed shapes), stopping after a step budget, when no slot runs, or once enough slots are free;
  * extend: K held rows (a multi-turn episode's slot kept between turns) continued by up to C tokens each (what
    the environment appended), fed through their own caches in one pass; a row whose continuation ends in this
    chunk samples its next turn's first token from the last one's logits, as an insert does from a prefill;
  * shrink: the state of fewer slots (the running rows of a draining rollout).

The cache is *per row* (`Qwen35.init_cache(per_row=True)`): slot b's prompt fills cache slots [0, P) left-padded
and its n-th generated token goes to slot P + n, whatever the other slots do. Nothing happens in Python per
token. `TRACE_COUNTS` counts the traces of each program (a trace precedes each compilation), so tests and logs
can prove how many programs a workload compiles.
"""

from __future__ import annotations

import collections
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl.generation.placement import Structure, constrain_rows, replicate_rows
from jaxrl.generation.sampling import SamplingMode, row_keys, sample_tokens, token_keys
from jaxrl.generation.stopping import hits_stop, running_after
from jaxrl.models.qwen35.layers import KVState, LinearState, write_rows
from jaxrl.models.qwen35.model import Cache

# (program, static key) -> number of times it was traced.
TRACE_COUNTS: collections.Counter = collections.Counter()
PROGRAMS = ("engine_prepare", "engine_prefill", "engine_insert", "engine_extend", "engine_round", "engine_shrink")


def engine_programs() -> int:
    """How many engine programs this process has traced (each trace precedes one compilation)."""
    return sum(n for key, n in TRACE_COUNTS.items() if key[0] in PROGRAMS)


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


@partial(jax.jit, static_argnames=("graphdef", "slots", "cache_len", "max_new_tokens", "stop_width", "pad_id",
                                   "mesh"))
def init_state(graphdef: Structure, params: list, *, slots: int, cache_len: int, max_new_tokens: int,
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
def prepare(graphdef: Structure, params: list, *, fuse_adapters: bool) -> dict:
    """The decode weight copies of these weights (`Qwen35.decode_weights`), made once per weight version."""
    TRACE_COUNTS[("engine_prepare", fuse_adapters)] += 1
    return graphdef.merge(params).decode_weights(fuse_adapters)


@partial(jax.jit, static_argnames=("graphdef", "mesh"))
def prefill(graphdef: Structure, params: list, ids: jax.Array, mask: jax.Array, *, mesh: Optional[Mesh]
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
def insert(state: SlotState, fresh: Cache, logits: jax.Array, source: jax.Array, slots: jax.Array,
           seeds: jax.Array, group_ids: jax.Array, sample_ids: jax.Array, caps: jax.Array, temperature: jax.Array,
           top_p: jax.Array, stop_ids: jax.Array, *, mode: SamplingMode, pad_id: int, mesh: Optional[Mesh]
           ) -> SlotState:
    """Moves K rows into the slots: row k takes the prefilled prompt source[k] (of `fresh` / `logits`, U prompts
    of `prefill`) into slot slots[k] (slots[k] == B: padding, dropped) and samples its first token. seeds,
    group_ids, sample_ids, caps, temperature, top_p [K]; stop_ids [K, W]."""
    num_slots = state.tokens.shape[0]
    prompt_len = fresh.valid.shape[1]
    TRACE_COUNTS[("engine_insert", num_slots, state.cache.max_length, logits.shape[0], source.shape[0],
                  stop_ids.shape[1], mode)] += 1
    take = lambda x: jnp.take(x, source, axis=0)  # noqa: E731  prompt rows -> the rows moving in
    keys = row_keys(seeds, group_ids, sample_ids)
    first, first_lp = sample_tokens(take(logits), token_keys(keys, 0), temperature[:, None], top_p[:, None], mode)
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
    new = _row_state(state._replace(cache=cache), slots, first, first_lp, keys, caps, temperature, top_p, stop_ids,
                     pad_id)
    return constrain_rows(new, mesh)


def _row_state(state: SlotState, rows: jax.Array, first: jax.Array, first_lp: jax.Array, keys: jax.Array,
               caps: jax.Array, temperature: jax.Array, top_p: jax.Array, stop_ids: jax.Array, pad_id: int
               ) -> SlotState:
    """`state` with slots `rows` [K] (== B: none, dropped) starting a completion whose first token is `first`: the
    per-row sampling state an insert and an extension both set (the caches are theirs to write)."""
    max_new = state.tokens.shape[1]
    put = lambda big, small: big.at[rows].set(small.astype(big.dtype), mode="drop")  # noqa: E731
    stopped = hits_stop(first, stop_ids)
    k = len(first)
    return state._replace(
        token=put(state.token, first), generated=put(state.generated, jnp.ones((k,), jnp.int32)),
        running=put(state.running, ~stopped & (caps > 1)), stopped=put(state.stopped, stopped),
        tokens=put(state.tokens, jnp.full((k, max_new), pad_id, jnp.int32).at[:, 0].set(first)),
        logprobs=put(state.logprobs, jnp.zeros((k, max_new), jnp.float32).at[:, 0].set(first_lp)),
        keys=put(state.keys, keys), cap=put(state.cap, caps), temperature=put(state.temperature, temperature),
        top_p=put(state.top_p, top_p), stop_ids=put(state.stop_ids, stop_ids))


@partial(jax.jit, static_argnames=("graphdef", "mode", "pad_id", "mesh"), donate_argnames=("state",))
def extend(graphdef: Structure, params: list, state: SlotState, slots: jax.Array, ids: jax.Array, mask: jax.Array,
           final: jax.Array, seeds: jax.Array, group_ids: jax.Array, sample_ids: jax.Array, caps: jax.Array,
           temperature: jax.Array, top_p: jax.Array, stop_ids: jax.Array, *, mode: SamplingMode, pad_id: int,
           mesh: Optional[Mesh]) -> SlotState:
    """Continues the held rows in slots[k] (== B: padding, dropped) by ids [K, C] (mask [K, C]: each row's tokens
    first, padding after), through their own caches (the per-row multi-token continuation of
    `Qwen35.hidden_states`: the attention cache, the conv window and the delta-rule state carried on exactly). A
    row with final[k] starts its next completion: its first token sampled from its last token's logits with key
    (seeds, group_ids, sample_ids)[k] at index 0, as `insert` samples a fresh row's. The others stay held (their
    continuation goes on in the next chunk)."""
    num_slots = state.tokens.shape[0]
    TRACE_COUNTS[("engine_extend", num_slots, state.cache.max_length, ids.shape, stop_ids.shape[1], mode)] += 1
    model = graphdef.merge(params)
    rows = lambda x: jnp.take(x, slots, axis=0, mode="clip")  # noqa: E731  (padding rows read a copy, dropped)
    hidden, cache = model.hidden_states(ids, mask, cache=jax.tree.map(rows, state.cache))
    last = jnp.maximum(jnp.sum(mask.astype(jnp.int32), axis=1) - 1, 0)
    logits = model.logits_from_hidden(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])
    keys = row_keys(seeds, group_ids, sample_ids)
    first, first_lp = sample_tokens(logits.astype(jnp.float32), token_keys(keys, 0), temperature[:, None],
                                    top_p[:, None], mode)
    state = state._replace(cache=jax.tree.map(lambda big, small: big.at[slots].set(small.astype(big.dtype),
                                                                                 mode="drop"), state.cache, cache))
    starting = jnp.where(final, slots, num_slots)
    return constrain_rows(_row_state(state, starting, first, first_lp, keys, caps, temperature, top_p, stop_ids,
                                     pad_id), mesh)


def _keep_idle(run: jax.Array, new, old):
    """The cache after a decode step with the Gated DeltaNet states of slots that did not run (`run` False) as
    they were: a held row (between an episode's turns) keeps its conv window and recurrent state while the other
    rows decode (a masked step would shift a zero into the window). Attention layers need nothing: a masked row
    writes an invalid key at its next slot, which its continuation overwrites."""
    def keep(n, o):
        return jnp.where(run.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)
    layers = tuple(jax.tree.map(keep, n, o) if isinstance(n, LinearState) else n
                   for n, o in zip(new.layers, old.layers))
    return new._replace(layers=layers)


@partial(jax.jit, static_argnames=("graphdef", "mode", "pad_id", "mesh", "holds"), donate_argnames=("state",))
def decode_round(graphdef: Structure, params: list, decode_weights: dict, state: SlotState, live: jax.Array,
                 max_steps: jax.Array, want_free: jax.Array, *, mode: SamplingMode, pad_id: int,
                 mesh: Optional[Mesh], holds: bool = False) -> tuple:
    """Up to max_steps decode steps over every slot; stops early when no slot runs or when at least want_free
    slots are free. live [B] bool: the slots the host holds a row for (a cancelled row's slot is not: it stops
    running here, without a program of its own). holds (static): a session pool, whose held rows' Gated DeltaNet
    states the masked steps must leave as they were (`_keep_idle`; other pools' steps carry no such select).
    Returns the state and what the host reads after a round: [4, B] int32 (rows running, generated, stopped, and
    the steps made in every column: one transfer) and, on a mesh, the token and log-prob
    buffers replicated (every process of a mesh over several processes reads every row; None without a mesh)."""
    num_slots, max_new = state.tokens.shape
    TRACE_COUNTS[("engine_round", num_slots, state.cache.max_length, max_new, state.stop_ids.shape[1], mode,
                  holds)] += 1
    model = graphdef.merge(params).use_decode_weights(decode_weights)
    state = state._replace(running=state.running & constrain_rows(jnp.asarray(live, bool), mesh))

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
        if holds:  # a session pool: its held rows keep their state (no select in other pools' steps)
            cache = _keep_idle(run, cache, st.cache)
        new, lp = sample_tokens(logits[:, 0], token_keys(st.keys, st.generated), st.temperature[:, None],
                                st.top_p[:, None], mode)
        # Idle slots write their old value back (at a column inside the buffer): nothing of theirs changes.
        column = jnp.minimum(st.generated, max_new - 1)
        old_token = jnp.take_along_axis(st.tokens, column[:, None], axis=1)[:, 0]
        old_lp = jnp.take_along_axis(st.logprobs, column[:, None], axis=1)[:, 0]
        generated = st.generated + run.astype(jnp.int32)
        running, hit = running_after(run, new, st.stop_ids, generated, st.cap)
        st = st._replace(
            cache=cache, token=jnp.where(run, new, st.token), generated=generated, running=running,
            stopped=st.stopped | hit,
            tokens=write_rows(st.tokens, jnp.where(run, new, old_token)[:, None], column, axis=1),
            logprobs=write_rows(st.logprobs, jnp.where(run, lp, old_lp)[:, None], column, axis=1))
        return step + 1, constrain_rows(st, mesh)  # every slot's arrays stay on the devices of its rows

    steps, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    state = constrain_rows(state, mesh)  # the state stays split by rows; what the host reads is gathered below
    status = jnp.stack([state.running.astype(jnp.int32), state.generated, state.stopped.astype(jnp.int32),
                        jnp.full((num_slots,), steps, jnp.int32)])
    if mesh is None:
        return state, status, None
    return state, replicate_rows(status, mesh), replicate_rows((state.tokens, state.logprobs), mesh)


@partial(jax.jit, static_argnames=("mesh",))
def shrink(state: SlotState, keep: jax.Array, *, mesh: Optional[Mesh]) -> SlotState:
    """The slots `keep` [B'] of state, in that order: a state of B' slots."""
    TRACE_COUNTS[("engine_shrink", state.tokens.shape[0], keep.shape[0])] += 1
    return constrain_rows(jax.tree.map(lambda x: jnp.take(x, keep, axis=0), state), mesh)
