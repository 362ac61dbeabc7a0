"""The Qwen3.5 causal language model (text tower + head) in Flax NNX.

    model = Qwen35(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), remat="auto")
    logits = model(input_ids, attention_mask=mask)                  # [B, T] -> [B, T, V]
    hidden, cache = model.hidden_states(ids, mask, cache_length=S)   # prefill: a fresh cache of S slots
    hidden, cache = model.hidden_states(ids, mask, cache=cache)      # decode / continue a preallocated cache
    h_prompts, h_branches = model.branched_hidden_states(prompt_ids, prompt_mask, ids, mask, group=n)
                                                                     # training: G prompts once, n branches each

Padding: rows may be padded anywhere (left-padded prompts, right-padded completions, both); `attention_mask`
(1 = real token) keeps padding out of attention, out of the conv window and out of the recurrent state, and
RoPE positions count real tokens only, so every real token sees exactly what it would see unpadded. Without a
cache, attention runs on the rows compacted to right padding (`jaxrl.ops.attention.compaction`), which is what
the fused kernels take.

Caches: `init_cache` preallocates one (attention layers write keys/values at slot `cache.length`, linear layers
carry their conv window and recurrent state); `hidden_states(..., cache_length=S)` builds one from a prompt in
the training-style pass (fused attention over the prompt alone, no cache buffer read). A prefix followed by a
continuation equals one pass. A *per-row* cache (`cache.length` of shape [B], `init_cache(per_row=True)`: the
continuous-batching engine's slots, each at its own position) takes one token per row and call (decode; row b
writes slot length[b], and a row whose token is masked out keeps its length: a free or held slot), or several
(the engine extending live rows: real tokens first, padding at the end of each row).

Rematerialisation (`remat`, training passes only: no cache, or `branched_hidden_states`, whose layers each run a
prefill and a continuation inside one checkpoint): per-layer `jax.checkpoint` with a named policy.
  none       keep every activation
  matmuls    keep the projection outputs, the LoRA hidden and the attention / delta-rule core outputs (the
             `checkpoint_name` tags of layers.py); the backward recomputes norms, gates, activations, the conv
  attention  keep only the attention / delta-rule core outputs (the costly recomputations)
  full       keep only each layer's input
  auto       the least recomputation whose estimated activation memory (`activation_bytes`) fits half of the
             device's memory after the weights, decided per call from the batch shape
  dots, dots_no_batch   JAX's dots_saveable / dots_with_no_batch_dims_saveable

Scanned layers (`scan_layers`, training passes only, `branched_hidden_states` included): when the layer pattern repeats (Qwen3.5: three Gated
DeltaNet layers then one attention layer, 8 times for the 4B and 9B) the layers run as one `jax.lax.scan` over
the repeats of that block, so XLA compiles one block instead of every layer; remat stays per layer inside the
block. The weights stay one module per layer (stacked only inside the traced program). By default
(`scan_layers=None`) a pass scans when it rematerialises its layers (a remat policy other than "none", as "auto"
picks at the 4B and 9B training shapes) and runs unrolled when it keeps every activation
(`Qwen35Config.scan_decision` says why); True / False force it. A pattern that does not repeat, or layers of one
block position built differently (LoRA on some layers only), run unrolled, said once in the log (`layer_cycle`
says which and why).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.qwen35.config import COMPUTE_FIELDS, LINEAR, Qwen35Config
from jaxrl.models.qwen35.layers import (DecoderLayer, KVState, Linear, LinearState, RMSNorm, StepContext, normal_init,
                                        write_rows)
from jaxrl.ops.attention import compaction, resolve_implementation
from jaxrl.ops.gated_delta import no_pending_update
from jaxrl.ops.matmul import project
from jaxrl.ops.rotary import rotary_cos_sin

logger = logging.getLogger(__name__)

_cp = jax.checkpoint_policies
REMAT_POLICIES = {
    "none": None,
    "matmuls": _cp.save_only_these_names("proj", "lora_hidden", "attention_core", "gdn_core"),
    "attention": _cp.save_only_these_names("attention_core", "gdn_core"),
    "full": _cp.nothing_saveable,
    "dots": _cp.dots_saveable,
    "dots_no_batch": _cp.dots_with_no_batch_dims_saveable,
}
REMAT_CHOICES = tuple(REMAT_POLICIES) + ("auto",)
# "auto" tries these in order, least recomputation first.
_AUTO_ORDER = ("none", "matmuls", "attention", "full")
# Fraction of the device memory (after the weights) that activations may take under "auto".
AUTO_ACTIVATION_FRACTION = 0.5
# `decode_weights` copies the weights only when they take at most this fraction of the host's memory.
DECODE_COPY_FRACTION = 0.125
# Reasons a training forward fell back to unrolled layers that this process has logged (`Qwen35._scan_cycle`).
_FALLBACKS_LOGGED: set = set()


class Cache(NamedTuple):
    layers: tuple  # one KVState (attention) or LinearState (Gated DeltaNet) per layer
    valid: jax.Array  # [B, S_max] bool: slots that hold a real token
    # int32: slots written so far; a scalar (the same for every row; rows are left-padded) or [B] (a per-row
    # cache: each row's next slot)
    length: jax.Array
    next_position: jax.Array  # [B] int32: RoPE position of each row's next real token

    @property
    def max_length(self) -> int:
        return self.valid.shape[1]


class Qwen35(nnx.Module):
    def __init__(self, cfg: Qwen35Config, *, dtype=jnp.float32, rngs: nnx.Rngs, remat: str = "none"):
        if remat not in REMAT_CHOICES:
            raise ValueError(f"remat={remat!r}; choose one of {list(REMAT_CHOICES)}")
        self.config = cfg
        self.dtype = dtype
        self.remat = remat
        self.embed_tokens = nnx.Param(normal_init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, t, dtype=dtype, rngs=rngs) for t in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (nnx.data(None) if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs))
        self.head_in_out = nnx.data(None)  # the head as [H, V]: set only by `use_decode_weights`

    # ------------------------------------------------------------------------------------------------------------
    def head_weight(self) -> jax.Array:
        """The [V, H] output projection (the embedding when tied)."""
        return self.embed_tokens[...] if self.lm_head is None else self.lm_head.weight[...]

    def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., H] -> logits [..., V] in hidden's dtype, accumulated in fp32 (`project`: no fp32 copy of
        the [V, H] head on XLA:CPU, no fp32 x bf16 product in the backward)."""
        if self.head_in_out is not None:
            return jnp.einsum("...h,hv->...v", hidden, self.head_in_out,
                              preferred_element_type=jnp.float32).astype(hidden.dtype)
        return project(hidden, self.head_weight(), hidden.dtype)

    def decode_weights(self, fuse_adapters: bool = True) -> dict:
        """The weight copies a decode program multiplies with, {module path: arrays} ("head" for the output
        head): made once per weight version by the generation engine, which passes them to its decode rounds
        (`use_decode_weights`). Per projection (`Linear.decode_weights`):
          * an enabled LoRA adapter's A stacked under the base weight (one product for both) and its s * B, in
            the operand dtype the unfused adapter rounds them to: the same numbers as the unfused layer;
          * on the CPU, every projection and the head transposed to [in, out]: a decode step's dots (a few rows
            against each weight) are bound by reading the weights, and XLA:CPU reads that layout faster, with the
            same greedy tokens (measured in benchmarks/RESULTS.md, section 'A Zen 5 VM, 2026-12-02'); a GPU's
            GEMM takes either layout at one speed.
        Empty when nothing needs a copy (an accelerator without adapters), and when the weights take more than
        DECODE_COPY_FRACTION of a device's memory: the copies double the weights' memory while they live; then
        every layer runs unfused. The copies hold the weights of the moment they were made: made again when weights change.
        fuse_adapters: False leaves adapters unfused (to measure what fusing saves)."""
        if self.weight_bytes() > DECODE_COPY_FRACTION * _device_memory_bytes():
            return {}
        transpose = jax.default_backend() == "cpu"
        out = {}
        for path, module in nnx.iter_modules(self.layers):
            if isinstance(module, Linear):
                weights = module.decode_weights(transpose, fuse_adapters)
                if weights is not None:
                    out[_layer_path(path)] = weights
        if transpose:  # the head is `head_in_out` (tied or not)
            out["head"] = jnp.transpose(self.head_weight())
        return out

    def use_decode_weights(self, weights: dict) -> "Qwen35":
        """Multiply with `weights` (from `decode_weights`) for the rest of this trace. Returns self."""
        for path, module in nnx.iter_modules(self.layers):
            if isinstance(module, Linear):
                module.use_decode_weights(weights.get(_layer_path(path)))
        self.head_in_out = weights.get("head")
        return self

    def __call__(self, input_ids: jax.Array, attention_mask: Optional[jax.Array] = None,
                 positions: Optional[jax.Array] = None, cache: Optional[Cache] = None, *,
                 segment_ids: Optional[jax.Array] = None):
        """[B, T] ids -> logits [B, T, V]; with a cache, returns (logits, new_cache)."""
        hidden, new_cache = self.hidden_states(input_ids, attention_mask, positions, cache, segment_ids=segment_ids)
        logits = self.logits_from_hidden(hidden)
        return logits if cache is None else (logits, new_cache)

    def hidden_states(self, input_ids: jax.Array, attention_mask: Optional[jax.Array] = None,
                      positions: Optional[jax.Array] = None, cache: Optional[Cache] = None, *,
                      cache_length: Optional[int] = None,
                      segment_ids: Optional[jax.Array] = None) -> tuple[jax.Array, Optional[Cache]]:
        """Final-norm hidden states [B, T, H] (what the head and a value head read), and the updated cache.

        cache: continue this cache (decode, or a multi-token continuation). cache_length (without a cache):
        prefill, returning a fresh cache of `cache_length` >= T slots that holds this call.
        segment_ids [B, T] int (training passes only; None: one sequence per row): packed rows, several sequences
        end to end, a new one starting wherever the id changes from the previous token's. Each sequence is
        computed as if it were alone in its row: RoPE positions restart at 0 (counting its real tokens), attention
        stays inside it (causal), and the Gated DeltaNet conv window and recurrent state start from zero at its
        first token (`jaxrl.ops.conv`, `jaxrl.ops.gated_delta._segment_decays`). Padding (attention_mask 0)
        belongs at the end of a row, as in an unpacked row.
        """
        cfg = self.config
        batch, seq_len = input_ids.shape
        if cache is not None and cache_length is not None:
            raise ValueError("give either a cache to continue or cache_length for a fresh one, not both")
        if cache_length is not None and cache_length < seq_len:
            raise ValueError(f"cache_length={cache_length} is shorter than the {seq_len} tokens of this call")
        ctx, start_pos, counts = self._context(input_ids, attention_mask, positions, cache, segment_ids,
                                               cache_length is not None)
        token_mask = ctx.token_mask
        per_row = cache is not None and cache.length.ndim == 1
        training = cache is None and cache_length is None
        policy = self.remat_policy(batch, seq_len) if training else "none"
        h = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        new_states = []
        # Only the training pass scans. Prefill and decode stay unrolled: their caches are one state per layer
        # (KVState / LinearState) that the engine and the decode loops index by layer; a scanned decode would
        # need them stacked per cycle position (a new cache layout for every cache user) or stacked and unstacked
        # around every call (a copy of every KV buffer per token).
        cycle = self._scan_cycle(policy) if training else None
        if cycle is not None:
            h = _scan_layers(list(self.layers), cycle, h, ctx, policy)
        else:
            for i, layer in enumerate(self.layers):
                state = None if cache is None else cache.layers[i]
                if policy != "none":
                    h = _remat_layer(layer, h, ctx, REMAT_POLICIES[policy])
                else:
                    h, state = layer(h, ctx, state, cache_length)
                new_states.append(state)
        h = self.norm(h)
        if training:
            return h, None
        if cache is None:
            valid = jnp.pad(token_mask, ((0, 0), (0, cache_length - seq_len)))
            return h, Cache(tuple(new_states), valid, jnp.int32(seq_len), start_pos + counts[:, -1])
        length = cache.length + (counts[:, -1] if per_row else seq_len)
        return h, Cache(tuple(new_states), ctx.key_valid, length, start_pos + counts[:, -1])

    def _context(self, input_ids: jax.Array, attention_mask: Optional[jax.Array], positions: Optional[jax.Array],
                 cache: Optional[Cache], segment_ids: Optional[jax.Array], prefill: bool = False,
                 continues_at: Optional[int] = None) -> tuple[StepContext, jax.Array, jax.Array]:
        """(the StepContext every layer of this call reads, each row's first RoPE position [B], the running count
        of real tokens [B, T]) of a call of `hidden_states`. continues_at (a cache of one shared length, continued
        from that static slot: `branched_hidden_states`) lets attention read the cache in causal query blocks."""
        cfg = self.config
        batch, seq_len = input_ids.shape
        token_mask = (jnp.ones((batch, seq_len), bool) if attention_mask is None
                      else attention_mask.astype(bool))
        counts = jnp.cumsum(token_mask.astype(jnp.int32), axis=1)
        order = dest = lengths = key_valid = q_slots = write_index = filled = None
        per_row = cache is not None and cache.length.ndim == 1
        if cache is None:
            start_pos = jnp.zeros((batch,), jnp.int32)
            if attention_mask is not None:
                order, dest, lengths = compaction(token_mask)
        elif per_row:
            start_pos = cache.next_position
            write_index = cache.length.astype(jnp.int32)
            key_valid = write_rows(cache.valid, token_mask, write_index, axis=1)
            if seq_len == 1:
                # Slots after a row's own are never valid for it (a slot's valid flags are reset when a row moves
                # in), so `valid` alone is the causal mask: every query may look up to the last slot.
                q_slots = jnp.full((1,), cache.max_length - 1, jnp.int32)
            else:
                # A continuation of several tokens per row (the engine extending a live row by an observation):
                # row b's tokens fill slots length[b] .. length[b] + T - 1 (real tokens first, padding after;
                # the caller leaves room for all T), each query seeing up to its own slot.
                q_slots = write_index[:, None] + jnp.arange(seq_len, dtype=jnp.int32)[None, :]
            filled = jnp.max(write_index) + seq_len
        else:
            start_pos = cache.next_position
            write_index = cache.length.astype(jnp.int32)
            q_slots = write_index + jnp.arange(seq_len, dtype=jnp.int32)
            key_valid = jax.lax.dynamic_update_slice(cache.valid, token_mask, (0, write_index))
            filled = write_index + seq_len
        if segment_ids is not None:
            if cache is not None or prefill:
                raise ValueError("segment_ids (packed rows) are for training passes, without a cache")
            segment_ids = sequence_numbers(segment_ids)
        if positions is None and segment_ids is not None:
            positions = segment_positions(counts, token_mask, segment_ids)
        elif positions is None:
            positions = start_pos[:, None] + jnp.maximum(counts - 1, 0)
        cos, sin = rotary_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, self.dtype)
        ctx = StepContext(cos, sin, token_mask, order, dest, lengths, key_valid, q_slots, write_index, filled,
                          segment_ids, continues_at)
        return ctx, start_pos, counts

    def branched_hidden_states(self, prompt_ids: jax.Array, prompt_mask: jax.Array, branch_ids: jax.Array,
                               branch_mask: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
        """Prompts computed once, each continued by `group` branches: (hidden states of the G prompts [G, P, H],
        of the G * group branches [G * group, C, H]), the branch rows g * group .. g * group + group - 1 continuing
        prompt g. Equal to `hidden_states` of each branch row with its prompt in front (prompts left-padded,
        branches right-padded), within float rounding; the training pass of the shared-prefix layout
        (jaxrl/algorithms/online/shared_prefix.py), differentiable, the prompt's activations taking the summed
        gradient of its branches through the repeats.

        Each layer computes the prompts as a prefill would (the fused causal attention; the keys / values, the
        conv window and the delta rule's state after each prompt's real tokens), repeats those states `group`
        times, and continues them with the branches as the engine's prefill -> extend does (attention over the
        prompt's keys and the branch's own, in causal query blocks; the chunked delta rule from the prompt's
        state). The layers run as the training forward does: one `jax.checkpoint` per layer with the remat policy
        of a padded pass over the same rows (the backward keeps each layer's two inputs and recomputes the rest,
        the caches included), scanned over the repeats of the layer pattern when the training forward would."""
        num_prompts, prompt_len = prompt_ids.shape
        batch, width = branch_ids.shape
        if group < 1 or batch != num_prompts * group:
            raise ValueError(f"branched_hidden_states: {batch} branch rows are not {group} per each of {num_prompts} "
                             f"prompts")
        total = prompt_len + width
        ctx_p, start_pos, counts = self._context(prompt_ids, prompt_mask, None, None, None, prefill=True)
        valid = jnp.pad(ctx_p.token_mask, ((0, 0), (0, width)))
        prefix = Cache((), valid, jnp.int32(prompt_len), start_pos + counts[:, -1])
        ctx_b, _, _ = self._context(branch_ids, branch_mask, None, repeat_rows(prefix, group), None,
                                    continues_at=prompt_len)
        policy = self.remat_policy(batch, total)

        def layer_step(graphdef):
            def run(state, carry):
                layer = nnx.merge(graphdef, state)
                h_prompt, h_branch = carry
                h_prompt, cached = layer(h_prompt, ctx_p, None, total)
                h_branch, _ = layer(h_branch, ctx_b, repeat_rows(cached, group))
                return h_prompt, h_branch
            # ctx_p / ctx_b are closed over, not arguments: `continues_at` must stay a Python int
            return run if policy == "none" else jax.checkpoint(run, policy=REMAT_POLICIES[policy])

        embed = self.embed_tokens[...]
        carry = (jnp.take(embed, prompt_ids, axis=0), jnp.take(embed, branch_ids, axis=0))
        cycle = self._scan_cycle(policy)
        carry = _run_layers(list(self.layers), carry, layer_step, cycle)
        return self.norm(carry[0]), self.norm(carry[1])

    def remat_policy(self, batch: int, seq_len: int) -> str:
        """The remat policy a training pass over [batch, seq_len] runs with ("auto" resolved)."""
        if self.remat != "auto":
            return self.remat
        tokens = batch * seq_len / max(1, jax.device_count())  # rows are split over the devices
        return choose_remat(self.config, tokens, seq_len, jnp.dtype(self.dtype).itemsize,
                            self.activation_budget(_device_memory_bytes()))

    def activation_budget(self, device_bytes: float) -> float:
        """Bytes "auto" lets a training pass keep for its backward on a device of `device_bytes`: a fraction of
        what the weights leave, and with scanned layers also what their stack takes. Scanning feeds the layers'
        weights to the scan as stacked arrays, a copy of every layer weight in the step's temporaries (at the 9B
        shapes enough to change auto's choice: benchmarks/RESULTS.md, the AOT section). The stack is reserved whenever a pass that
        recomputes would scan (`layer_cycle()`, no policy given): "auto" is choosing among such passes, and
        when it picks "none" (it fits even so) the pass runs unrolled by default and holds no stack."""
        reserved = self.weight_bytes()
        if self._scan_cycle() is not None:
            reserved += sum(int(x.size) * jnp.dtype(x.dtype).itemsize
                            for x in jax.tree.leaves(nnx.state(self.layers, nnx.Param)))
        return AUTO_ACTIVATION_FRACTION * (device_bytes - reserved)

    def layer_cycle(self, policy: Optional[str] = None) -> tuple[Optional[int], str]:
        """(cycle, "") when a training pass under remat `policy` (resolved; None: any that recomputes) scans its
        layers in blocks of `cycle` (Qwen3.5: 4, three Gated DeltaNet layers then one attention layer), else
        (None, why they run unrolled). Scanning needs what the config decides (`Qwen35Config.scan_decision`: the
        `scan_layers` setting, a layer pattern that repeats, and by default a policy other than "none") and every
        layer built like the layer at its position in the first cycle (the same graphdef: not so with LoRA on
        some layers only)."""
        cycle, why = self.config.scan_decision(policy)
        if cycle is None:
            return None, why
        graphdefs = [nnx.graphdef(layer) for layer in self.layers]
        for i in range(cycle, len(graphdefs)):
            if graphdefs[i] != graphdefs[i % cycle]:
                return None, (f"layer {i} is built unlike layer {i % cycle} (different submodules or settings, e.g. "
                              "LoRA on some layers only)")
        return cycle, ""

    def _scan_cycle(self, policy: Optional[str] = None) -> Optional[int]:
        """`layer_cycle`'s cycle; a fallback to unrolled layers is logged once per reason and process."""
        cycle, why = self.layer_cycle(policy)
        if cycle is None and self.config.scan_layers is not False and why not in _FALLBACKS_LOGGED:
            _FALLBACKS_LOGGED.add(why)
            logger.info("scan_layers: the training forward runs its layers unrolled: %s", why)
        return cycle

    def weight_bytes(self) -> int:
        return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(nnx.state(self, nnx.Param)))

    def set_compute(self, **settings) -> "Qwen35":
        """Change computation settings in place (before jitting): `remat`, and the config's COMPUTE_FIELDS
        (gdn_chunk_size, gdn_state_dtype, attention_implementation, scan_layers). Weights are untouched. Returns
        the model."""
        remat = settings.pop("remat", None)
        unknown = sorted(set(settings) - set(COMPUTE_FIELDS))
        if unknown:
            raise ValueError(f"set_compute: unknown settings {unknown}; valid: {['remat', *COMPUTE_FIELDS]}")
        if remat is not None:
            if remat not in REMAT_CHOICES:
                raise ValueError(f"remat={remat!r}; choose one of {list(REMAT_CHOICES)}")
            self.remat = remat
        if settings:
            cfg = dataclasses.replace(self.config, **settings)
            self.config = cfg
            for layer in self.layers:
                if layer.layer_type == LINEAR:
                    layer.linear_attn.cfg = cfg
                else:
                    layer.self_attn.implementation = cfg.attention_implementation
        return self

    # ------------------------------------------------------------------------------------------------------------
    def init_cache(self, batch: int, max_length: int, kv_dtype=None, per_row: bool = False) -> Cache:
        """Zeroed cache for `batch` rows and `max_length` slots (prompt + generated tokens); per_row: a per-row
        cache (module docstring)."""
        cfg = self.config
        kv_dtype = kv_dtype or self.dtype
        layers = []
        for t in cfg.layer_types:
            if t == LINEAR:
                layers.append(LinearState(
                    jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim), self.dtype),
                    jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                               cfg.linear_value_head_dim), jnp.dtype(cfg.gdn_state_dtype)),
                    no_pending_update(batch, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                      cfg.linear_key_head_dim, cfg.linear_value_head_dim)))
            else:
                shape = (batch, cfg.num_key_value_heads, max_length, cfg.head_dim)  # head-major (KVState)
                layers.append(KVState(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype)))
        length = jnp.zeros((batch,) if per_row else (), jnp.int32)
        return Cache(tuple(layers), jnp.zeros((batch, max_length), bool), length, jnp.zeros((batch,), jnp.int32))


def sequence_numbers(segment_ids: jax.Array) -> jax.Array:
    """[B, T] ids -> [B, T] int32 running sequence numbers (0, 1, 2, ... along each row, +1 wherever the id
    changes): the ops compare ids for equality, and an id that came back later in a row ("1 1 2 2 1") must not
    join the earlier sequence."""
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    starts = jnp.concatenate([jnp.zeros_like(changed[:, :1]), changed], axis=1)
    return jnp.cumsum(starts.astype(jnp.int32), axis=1)


def segment_positions(counts: jax.Array, token_mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """RoPE positions of packed rows: real tokens of each sequence before this one (so 0 at its first real
    token, as the sequence alone would have). counts [B, T]: real tokens up to and including t."""
    before = counts - token_mask.astype(jnp.int32)  # real tokens of the row before t
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], dtype=bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    base = jax.lax.cummax(jnp.where(starts, before, 0), axis=1)  # real tokens before the sequence's start
    return jnp.maximum(counts - 1 - base, 0)


def _layer_path(path) -> str:
    return "layers." + ".".join(str(p) for p in path)


def _scan_layers(layers: list, cycle: int, h: jax.Array, ctx: StepContext, policy: str) -> jax.Array:
    """The training forward's layers as one `jax.lax.scan` over the len(layers) // cycle repeats of the block
    (`Qwen35.layer_cycle`): XLA compiles one block instead of every layer (`_run_layers`)."""
    def make_step(graphdef):
        run = _layer_step(graphdef, policy)
        return lambda state, x: run(state, x, ctx)

    return _run_layers(layers, h, make_step, cycle)


def _run_layers(layers: list, carry, make_step, cycle: Optional[int]):
    """carry through every layer: `make_step(graphdef)` gives (layer state, carry) -> carry for a layer of that
    graphdef. cycle None: unrolled, one step per layer. Otherwise one `jax.lax.scan` over the len(layers) // cycle
    repeats of the block (`Qwen35.layer_cycle`): XLA compiles one block instead of every layer.

    The weights stay one module per layer (Hugging Face's layout, what LoRA, the sharding rules, export and the
    decode caches address); here, at trace time, the states of the layers at each block position are stacked
    on a new leading axis. That stack is a copy inside the compiled program: XLA hoists it out of the train
    step's micro-batch loop but does not elide it, so the step's temporaries hold one more copy of the layer
    weights (benchmarks/RESULTS.md, section 'CPU: scanned vs unrolled layers (issue 31)'). Each layer keeps its own
    `jax.checkpoint` with the remat policy inside the scanned body (the steps' own), so the backward recomputes
    what the unrolled layers would; gradients flow back through the stack to each layer's own parameters.
    """
    splits = [nnx.split(layer) for layer in layers]
    if cycle is None:
        for graphdef, state in splits:
            carry = make_step(graphdef)(state, carry)
        return carry
    graphdefs = [graphdef for graphdef, _ in splits[:cycle]]
    stacked = tuple(jax.tree.map(lambda *xs: jnp.stack(xs), *(state for _, state in splits[j::cycle]))
                    for j in range(cycle))
    steps = [make_step(graphdef) for graphdef in graphdefs]

    def block(x, states):
        for step, state in zip(steps, states):
            x = step(state, x)
        return x, None

    carry, _ = jax.lax.scan(block, carry, stacked)
    return carry


def repeat_rows(tree, n: int):
    """A cache (`Cache`) or one layer's state (KVState, LinearState) of G rows as G * n rows, row g repeated n
    times (rows g * n .. g * n + n - 1); a cache's shared length stays one scalar. Under autodiff the transpose of
    the repeat sums the n rows' cotangents back into their row's."""
    rep = lambda x: jnp.repeat(x, n, axis=0)  # noqa: E731
    if isinstance(tree, Cache):
        return tree._replace(layers=jax.tree.map(rep, tree.layers), valid=rep(tree.valid),
                             next_position=rep(tree.next_position))
    return jax.tree.map(rep, tree)


def _layer_step(graphdef, policy: str):
    """(layer state, h, ctx) -> h: one decoder layer of the training forward, under `jax.checkpoint` with the
    named remat policy unless it is "none"."""
    def run(state, x, c):
        return nnx.merge(graphdef, state)(x, c, None)[0]

    return run if policy == "none" else jax.checkpoint(run, policy=REMAT_POLICIES[policy])


def _remat_layer(layer: DecoderLayer, h: jax.Array, ctx: StepContext, policy) -> jax.Array:
    """One decoder layer under `jax.checkpoint` (training forward, no cache).

    The layer is split into (graphdef, state) and merged again inside the checkpointed function, so the
    checkpoint sees its weights as explicit inputs; this works under plain `jax.grad`/`jax.jit` of a merged
    model (`nnx.remat` would try to write the inner trace's values back into the outer Variables).
    """
    graphdef, state = nnx.split(layer)

    def run(state, x, c):
        return nnx.merge(graphdef, state)(x, c, None)[0]

    return jax.checkpoint(run, policy=policy)(state, h, ctx)


def activation_bytes(cfg: Qwen35Config, policy: str, tokens: float, seq_len: int, dtype_bytes: int) -> float:
    """Estimated bytes of the activations a training pass keeps for the backward under `policy`: the kept
    tensors of every layer, plus the working set of the one layer being recomputed. An estimate for choosing a
    policy (elementwise temporaries are counted as three per projection output), not an allocator's figure."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hv, dk, dv, C = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                     cfg.gdn_chunk)
    attn_q, attn_kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    fused = resolve_implementation(cfg.attention_implementation, jnp.bfloat16 if dtype_bytes == 2 else jnp.float32, cfg.head_dim)
    per_layer = []  # (projection outputs, core output, core internals) in bytes per token
    for layer_type in cfg.layer_types:
        mlp = 2 * inter + h
        if layer_type == LINEAR:
            proj = cfg.linear_conv_dim + cfg.linear_value_dim + 2 * hv + h + mlp
            core = cfg.linear_value_dim
            # fp32 decays, C x C products and inverse, U / W, and the chunk-start states
            internals = 4 * hv * (4 * C + 2 * (dk + dv) + dk * dv / C)
        else:
            proj = 2 * attn_q + 2 * attn_kv + h + mlp
            core = attn_q
            internals = 4 * cfg.num_attention_heads * (2 if fused == "cudnn" else 3 * seq_len)
        per_layer.append((proj * dtype_bytes, core * dtype_bytes, internals))
    full_layer = max(3 * p + c + i for p, c, i in per_layer)  # everything one layer keeps without remat
    layer_input = h * dtype_bytes
    kept = {
        "none": sum(3 * p + c + i for p, c, i in per_layer),
        "matmuls": sum(layer_input + p + c for p, c, _ in per_layer) + full_layer,
        "attention": sum(layer_input + c for _, c, _ in per_layer) + full_layer,
        "full": len(per_layer) * layer_input + full_layer,
    }
    return tokens * kept.get(policy, kept["full"])


def choose_remat(cfg: Qwen35Config, tokens: float, seq_len: int, dtype_bytes: int, budget: float) -> str:
    """"auto": the first of none, matmuls, attention whose `activation_bytes` fit `budget`, else full."""
    for policy in _AUTO_ORDER:
        if activation_bytes(cfg, policy, tokens, seq_len, dtype_bytes) <= budget:
            return policy
    return "full"


def _device_memory_bytes() -> float:
    """Memory of one device: the allocator's limit on accelerators, physical memory on the CPU."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # some backends do not implement it
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def init_model(cfg: Qwen35Config, dtype=jnp.float32, seed: int = 0, remat: str = "none") -> Qwen35:
    """A randomly initialised model (HF-like init: normal(0.02) matrices, zero-centred norms at 0)."""
    return Qwen35(cfg, dtype=dtype, rngs=nnx.Rngs(seed), remat=remat)
