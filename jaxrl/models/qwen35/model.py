"""The Qwen3.5 causal language model (text tower + head) in Flax NNX.

    model = Qwen35(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    logits = model(input_ids, attention_mask=mask)               # [B, T] -> [B, T, V]
    hidden, cache = model.hidden_states(ids, mask, cache=cache)   # prefill / decode with a preallocated cache

Padding: batches may be left-padded; `attention_mask` (1 = real token) keeps padding out of attention, out of the
conv window and out of the recurrent state, and RoPE positions count real tokens only, so every real token sees
exactly what it would see unpadded.

Caches are preallocated (`init_cache`): attention layers write keys/values at slot `cache.length`, linear layers
carry their conv window and recurrent state. A prefix followed by a continuation equals one pass.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.qwen35.config import LINEAR, Qwen35Config
from jaxrl.models.qwen35.layers import (DecoderLayer, KVState, Linear, LinearState, RMSNorm, StepContext, _normal)
from jaxrl.ops.rotary import rotary_cos_sin

# Rematerialisation policies by name (activation memory vs recompute). "none" keeps every activation.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Cache(NamedTuple):
    layers: tuple  # one KVState (attention) or LinearState (Gated DeltaNet) per layer
    valid: jax.Array  # [B, S_max] bool: slots that hold a real token
    length: jax.Array  # int32 scalar: slots written so far (same for every row; rows are left-padded)
    next_position: jax.Array  # [B] int32: RoPE position of each row's next real token

    @property
    def max_length(self) -> int:
        return self.valid.shape[1]


class Qwen35(nnx.Module):
    def __init__(self, cfg: Qwen35Config, *, dtype=jnp.float32, rngs: nnx.Rngs, remat: str = "none"):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat={remat!r}; choose one of {sorted(REMAT_POLICIES)}")
        self.config = cfg
        self.dtype = dtype
        self.remat = remat
        self.embed_tokens = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, t, dtype=dtype, rngs=rngs) for t in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (nnx.data(None) if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs))

    # ------------------------------------------------------------------------------------------------------------
    def head_weight(self) -> jax.Array:
        """The [V, H] output projection (the embedding when tied)."""
        return self.embed_tokens[...] if self.lm_head is None else self.lm_head.weight[...]

    def logits_from_hidden(self, hidden: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return jnp.einsum("...h,vh->...v", hidden, self.embed_tokens[...])
        return self.lm_head(hidden)

    def __call__(self, input_ids: jax.Array, attention_mask: Optional[jax.Array] = None,
                 positions: Optional[jax.Array] = None, cache: Optional[Cache] = None):
        """[B, T] ids -> logits [B, T, V]; with a cache, returns (logits, new_cache)."""
        hidden, new_cache = self.hidden_states(input_ids, attention_mask, positions, cache)
        logits = self.logits_from_hidden(hidden)
        return logits if cache is None else (logits, new_cache)

    def hidden_states(self, input_ids: jax.Array, attention_mask: Optional[jax.Array] = None,
                      positions: Optional[jax.Array] = None, cache: Optional[Cache] = None
                      ) -> tuple[jax.Array, Optional[Cache]]:
        """Final-norm hidden states [B, T, H] (what the head and a value head read), and the updated cache."""
        cfg = self.config
        batch, seq_len = input_ids.shape
        token_mask = (jnp.ones((batch, seq_len), bool) if attention_mask is None
                      else attention_mask.astype(bool))
        counts = jnp.cumsum(token_mask.astype(jnp.int32), axis=1)
        if cache is None:
            start_pos = jnp.zeros((batch,), jnp.int32)
            q_slots = jnp.arange(seq_len)
            key_valid = token_mask
            write_index = None
        else:
            start_pos = cache.next_position
            write_index = cache.length.astype(jnp.int32)
            q_slots = write_index + jnp.arange(seq_len)
            key_valid = jax.lax.dynamic_update_slice(cache.valid, token_mask, (0, write_index))
        if positions is None:
            positions = start_pos[:, None] + jnp.maximum(counts - 1, 0)
        key_slots = jnp.arange(key_valid.shape[1])
        attn_mask = key_valid[:, None, :] & (key_slots[None, None, :] <= q_slots[None, :, None])
        cos, sin = rotary_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, self.dtype)
        ctx = StepContext(cos, sin, token_mask, attn_mask, write_index)

        h = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        new_states = []
        for i, layer in enumerate(self.layers):
            state = None if cache is None else cache.layers[i]
            if cache is None and self.remat != "none":
                h = _remat_layer(layer, h, ctx, REMAT_POLICIES[self.remat])
            else:
                h, state = layer(h, ctx, state)
            new_states.append(state)
        h = self.norm(h)
        if cache is None:
            return h, None
        new_cache = Cache(tuple(new_states), key_valid, cache.length + seq_len,
                          start_pos + counts[:, -1])
        return h, new_cache

    # ------------------------------------------------------------------------------------------------------------
    def init_cache(self, batch: int, max_length: int, kv_dtype=None) -> Cache:
        """Zeroed cache for `batch` rows and `max_length` slots (prompt + generated tokens)."""
        cfg = self.config
        kv_dtype = kv_dtype or self.dtype
        layers = []
        for t in cfg.layer_types:
            if t == LINEAR:
                layers.append(LinearState(
                    jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim), self.dtype),
                    jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                               cfg.linear_value_head_dim), jnp.float32)))
            else:
                shape = (batch, cfg.num_key_value_heads, max_length, cfg.head_dim)  # head-major (KVState)
                layers.append(KVState(jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype)))
        return Cache(tuple(layers), jnp.zeros((batch, max_length), bool), jnp.zeros((), jnp.int32),
                     jnp.zeros((batch,), jnp.int32))


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


def init_model(cfg: Qwen35Config, dtype=jnp.float32, seed: int = 0, remat: str = "none") -> Qwen35:
    """A randomly initialised model (HF-like init: normal(0.02) matrices, zero-centred norms at 0)."""
    return Qwen35(cfg, dtype=dtype, rngs=nnx.Rngs(seed), remat=remat)
