"""Qwen3.5 text-tower layers in Flax NNX (docs/design/qwen35-architecture.md §2).

Weights keep the Hugging Face layout ([out, in] for linear layers, [C, 1, K] for the conv), so checkpoint
conversion and PEFT export are renames, never transposes. Every linear layer can carry a LoRA adapter
(`jaxrl.models.lora`), which `Linear.__call__` adds when it is attached and enabled.

Dtypes follow the reference: matmuls in the parameter/compute dtype, fp32 islands in every RMSNorm, in the decay
`g`, in the gated delta rule's decays, inverse and state, and in the attention softmax (§2.7).

Rematerialisation names (`jax.ad_checkpoint.checkpoint_name`, read by the model's remat policies): every
projection output is "proj", a LoRA adapter's rank-r hidden "lora_hidden", the attention core's output
"attention_core" and the gated delta rule's output "gdn_core".
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrl.models.qwen35.config import Qwen35Config
from jaxrl.ops.attention import (cache_attention, causal_attention, compact, compaction, continuation_attention,
                                 uncompact)
from jaxrl.ops.conv import causal_depthwise_conv
from jaxrl.ops.gated_delta import (PendingUpdate, apply_pending, chunk_gated_delta_rule,
                                   gated_delta_decode_step_deferred, no_pending_update)
from jaxrl.ops.matmul import project
from jaxrl.ops.rotary import apply_partial_rotary


def normal_init(rngs: nnx.Rngs, shape, dtype, std=0.02):
    """N(0, std^2) drawn in fp32 and cast: the random init of the weight matrices."""
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


class Linear(nnx.Module):
    """y = x W^T (+ b), W stored [out, in] like torch.nn.Linear; optional LoRA adapter in `self.lora`."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs, use_bias: bool = False):
        self.in_features, self.out_features = in_features, out_features
        self.weight = nnx.Param(normal_init(rngs, (out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else nnx.data(None)
        self.lora = nnx.data(None)  # a jaxrl.models.lora.LoRA once attached
        # The weights a decode program multiplies with (`decode_weights`): set only inside one, by
        # `use_decode_weights`.
        self.decode = nnx.data(None)

    def decode_weights(self, transpose: bool, fuse_adapter: bool = True) -> Optional[dict]:
        """The weights of a decode program, made once per program (or once per rollout, passed in) rather than per
        step; None when the stored weights serve as they are.

        "weight": the weight with an enabled adapter's A stacked under it, [out + r, in], so one product gives the
        base output and the adapter's rank-r hidden (one kernel and one read of x instead of two); "lora_b": the
        adapter's s * B [out, r]. Both in the product's operand dtype, exactly as `LoRA.__call__` rounds them, so
        the result is the unfused layer's (the policy the trainer holds; no merge, nothing lost to rounding).
        transpose: the stacked weight as [in, out + r] instead; XLA:CPU's dot of a few rows (decode: one token per
        row) reads that layout faster (measured in benchmarks/RESULTS.md, section 'A Zen 5 VM, 2026-12-02').
        fuse_adapter: False keeps the adapter apart (its two products after the base one; measurements)."""
        w = self.weight[...]
        out = {}
        adapter = self.lora if self.lora is not None and self.lora.enabled and fuse_adapter else None
        if adapter is not None and adapter.compute_dtype(w.dtype) == w.dtype:
            w = jnp.concatenate([w, adapter.lora_A[...].astype(w.dtype)], axis=0)
            out["lora_b"] = (adapter.lora_B[...] * adapter.scale).astype(w.dtype)
        elif not transpose:
            return None
        out["weight_in_out" if transpose else "weight_out_in"] = w.T if transpose else w
        return out

    def use_decode_weights(self, weights: Optional[dict]) -> None:
        """Multiply with `weights` (from `decode_weights`) for the rest of this trace."""
        self.decode = weights

    def _decode_call(self, x: jax.Array) -> jax.Array:
        d = self.decode
        dtype = jnp.result_type(x.dtype, self.weight.dtype)
        if "lora_b" in d and d["lora_b"].dtype != x.dtype:
            raise ValueError(f"decode weights stacked for {d['lora_b'].dtype} inputs, got {x.dtype} (the adapter "
                             "would compute in another dtype than it does unfused)")
        if "weight_in_out" in d:
            y = jnp.einsum("...i,io->...o", x, d["weight_in_out"], preferred_element_type=jnp.float32)
        else:
            y = jnp.einsum("...i,oi->...o", x, d["weight_out_in"], preferred_element_type=jnp.float32)
        base = y[..., :self.out_features].astype(dtype)
        if self.bias is not None:
            base = base + self.bias[...]
        if "lora_b" in d:  # the adapter's hidden, rounded as `low_rank_product` rounds it, then its B
            hidden = y[..., self.out_features:].astype(x.dtype)
            base = base + jnp.einsum("...r,or->...o", hidden, d["lora_b"],
                                     preferred_element_type=jnp.float32).astype(dtype)
        elif self.lora is not None and self.lora.enabled:
            base = base + self.lora(x).astype(dtype)
        return base

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        if self.decode is not None:
            return checkpoint_name(self._decode_call(x), "proj")
        if x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
            # XLA:CPU runs a bf16 -> bf16 product (and its gradient) on an fp32 copy of the weight; `project`
            # takes its native bf16 x bf16 -> fp32 kernel both ways. Same numbers: fp32 accumulation, one rounding.
            y = project(x, w, x.dtype)
        else:
            y = jnp.einsum("...i,oi->...o", x, w)
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora is not None and self.lora.enabled:
            y = y + self.lora(x).astype(y.dtype)
        return checkpoint_name(y, "proj")


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: x / rms(x) * (1 + w), in fp32, cast back (weight initialised to 0)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """GDN output norm: w * x / rms(x) * silu(z); a plain weight (initialised to 1), the norm before the gate."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        dtype = x.dtype
        xf = x.astype(jnp.float32)
        normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(dtype)
        y = self.weight[...] * normed
        return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)


class MLP(nnx.Module):
    def __init__(self, cfg: Qwen35Config, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------------------------------------------
# Per-layer decode state. NamedTuples are pytrees, so caches pass through jit, scan and while_loop unchanged.

def write_rows(buffer: jax.Array, values: jax.Array, index: jax.Array, axis: int) -> jax.Array:
    """buffer [B, ...] with row b's `values[b]` written at position index[b] of `axis` (values have size 1 there):
    one in-place update per row (a batched dynamic_update_slice, which XLA:CPU runs faster than the equivalent
    scatter)."""
    def one(row, value, i):
        start = [0] * row.ndim
        start[axis - 1] = i
        return jax.lax.dynamic_update_slice(row, value, tuple(start))
    return jax.vmap(one)(buffer, values, index)


class KVState(NamedTuple):
    """Keys (after k_norm and RoPE) and values of a full-attention layer: [B, nKV, S_max, hd] each (head-major,
    like HF's cache: decode attention then reads the cache in place instead of transposing all of it per step)."""
    k: jax.Array
    v: jax.Array


class LinearState(NamedTuple):
    """Gated DeltaNet state: the last K-1 pre-conv q|k|v inputs [B, K-1, conv_dim], the stored S [B, Hv, dk, dv]
    (fp32, or bf16 storage with the config's `gdn_state_dtype`; the update's math is fp32 either way) and the last
    decode step's rank-1 update, applied when the next step reads S (`jaxrl.ops.gated_delta`: one read and one
    write of S per step). `current()` is the state after every token so far."""
    conv: jax.Array
    recurrent: jax.Array
    pending: PendingUpdate

    def current(self) -> jax.Array:
        """The state after the last token, fp32 [B, Hv, dk, dv]."""
        return apply_pending(self.recurrent, self.pending)


class StepContext(NamedTuple):
    """What every layer needs to know about the current call (built once per forward by the model)."""
    cos: jax.Array  # [B, T, rot]
    sin: jax.Array  # [B, T, rot]
    token_mask: jax.Array  # [B, T] bool: real (non-padding) tokens
    # Without a cache: the padding compaction of `jaxrl.ops.attention.compaction` (None: no padding at all).
    order: Optional[jax.Array]  # [B, T] int32
    dest: Optional[jax.Array]  # [B, T] int32
    lengths: Optional[jax.Array]  # [B] int32
    # With a cache: the slots visible after this call's write, and where this call writes.
    key_valid: Optional[jax.Array]  # [B, S] bool
    q_slots: Optional[jax.Array]  # [T] int32: the cache slot of each position of this call
    # int32 scalar: first cache slot written by this call (every row); or [B] (a per-row cache, one token per
    # call: row b writes its slot write_index[b])
    write_index: Optional[jax.Array]
    filled: Optional[jax.Array]  # int32 scalar: slots [filled, S) are unused by every row after this call
    # Packed rows (training passes): [B, T] int32 sequence number of each token (`Qwen35.hidden_states`), None
    # for one sequence per row.
    segment_ids: Optional[jax.Array] = None
    # A cache of one shared length continued by this call from this static slot (`Qwen35.branched_hidden_states`):
    # attention reads it in causal query blocks (`continuation_attention`). A Python int: closed over, never
    # passed through a jax transformation as an argument.
    continues_at: Optional[int] = None


class GatedAttention(nnx.Module):
    """Full softmax attention with an output gate, q/k norms, partial RoPE and GQA (§2.3)."""

    def __init__(self, cfg: Qwen35Config, *, dtype, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.head_dim)
        h = cfg.hidden_size
        bias = cfg.attention_bias
        # q_proj rows are interleaved per head: [q_h (hd) | gate_h (hd)] for h = 0..nH-1.
        self.q_proj = Linear(h, self.num_heads * self.head_dim * 2, dtype=dtype, rngs=rngs, use_bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, dtype=dtype, rngs=rngs, use_bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, dtype=dtype, rngs=rngs, use_bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, dtype=dtype, rngs=rngs, use_bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.implementation = cfg.attention_implementation

    def __call__(self, x: jax.Array, ctx: StepContext, state: Optional[KVState],
                 cache_length: Optional[int] = None):
        """state: the layer's KV cache (None without one); cache_length (without a cache): also return a fresh
        KVState of that many slots holding this call's keys and values (prefill)."""
        batch, seq_len, _ = x.shape
        qg = self.q_proj(x).reshape(batch, seq_len, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., :self.head_dim], qg[..., self.head_dim:]
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).reshape(batch, seq_len, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(batch, seq_len, self.num_kv_heads, self.head_dim)
        q = apply_partial_rotary(q, ctx.cos, ctx.sin)
        k = apply_partial_rotary(k, ctx.cos, ctx.sin)
        scale = self.head_dim ** -0.5
        head_major = lambda t: jnp.swapaxes(t, 1, 2)  # noqa: E731  [B, T, nKV, hd] -> [B, nKV, T, hd]
        if state is not None:
            if ctx.write_index.ndim:  # a per-row cache: row b writes its one token at slot write_index[b]
                k_all = write_rows(state.k, head_major(k).astype(state.k.dtype), ctx.write_index, axis=2)
                v_all = write_rows(state.v, head_major(v).astype(state.v.dtype), ctx.write_index, axis=2)
            else:
                start = (0, 0, ctx.write_index, 0)
                k_all = jax.lax.dynamic_update_slice(state.k, head_major(k).astype(state.k.dtype), start)
                v_all = jax.lax.dynamic_update_slice(state.v, head_major(v).astype(state.v.dtype), start)
            state = KVState(k_all, v_all)
            if ctx.continues_at is not None:
                o = continuation_attention(q, k_all, v_all, ctx.key_valid, ctx.continues_at, scale)
            else:
                o = cache_attention(q, k_all, v_all, ctx.key_valid, ctx.q_slots, scale, filled=ctx.filled)
        elif ctx.order is None:
            o = causal_attention(q, k, v, None, scale, self.implementation, segment_ids=ctx.segment_ids)
        else:  # any padding layout -> right padding, the fused kernel, and back
            segments = None if ctx.segment_ids is None else compact(ctx.segment_ids, ctx.order)
            o = uncompact(causal_attention(compact(q, ctx.order), compact(k, ctx.order), compact(v, ctx.order),
                                           ctx.lengths, scale, self.implementation, segment_ids=segments), ctx.dest)
        o = checkpoint_name(o, "attention_core")
        if state is None and cache_length is not None:
            slots = ((0, 0), (0, 0), (0, cache_length - seq_len), (0, 0))
            state = KVState(jnp.pad(head_major(k), slots), jnp.pad(head_major(v), slots))
        o = o.reshape(batch, seq_len, self.num_heads * self.head_dim)
        o = o * jax.nn.sigmoid(gate.reshape(batch, seq_len, -1))
        return self.o_proj(o), state


def last_real(window: jax.Array, valid: jax.Array, count: int) -> jax.Array:
    """The last `count` real entries of each row of window [B, W, C] (valid [B, W], at least `count` real per
    row), in order: [B, count, C]."""
    order, _, lengths = compaction(valid)
    packed = compact(window, order)  # real entries first, in order
    return jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n - count, count, axis=0))(packed, lengths)


class GatedDeltaNet(nnx.Module):
    """Linear attention with the gated delta rule, a causal depthwise conv and a gated output norm (§2.5)."""

    def __init__(self, cfg: Qwen35Config, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        h = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.in_proj_qkv = Linear(h, cfg.linear_conv_dim, dtype=dtype, rngs=rngs)  # rows [q | k | v], head-major
        self.in_proj_z = Linear(h, self.value_dim, dtype=dtype, rngs=rngs)
        self.in_proj_b = Linear(h, self.num_v_heads, dtype=dtype, rngs=rngs)
        self.in_proj_a = Linear(h, self.num_v_heads, dtype=dtype, rngs=rngs)
        kernel = cfg.linear_conv_kernel_dim
        self.conv1d = nnx.Param(normal_init(rngs, (cfg.linear_conv_dim, 1, kernel), dtype, std=0.2))  # HF [C, 1, K]
        a_init = jax.random.uniform(rngs.params(), (self.num_v_heads,), jnp.float32, 0.01, 16.0)
        self.A_log = nnx.Param(jnp.log(a_init).astype(dtype))
        self.dt_bias = nnx.Param(jnp.ones((self.num_v_heads,), dtype))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(self.value_dim, h, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: StepContext, state: Optional[LinearState],
                 cache_length: Optional[int] = None):
        """state: the layer's conv window and recurrent state (None without a cache); cache_length (without a
        cache): also return the LinearState after this call (prefill)."""
        batch, seq_len, _ = x.shape
        # Padding positions must not touch the conv window or the recurrent state.
        x = x * ctx.token_mask[..., None].astype(x.dtype)
        mixed = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(batch, seq_len, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(x)
        a = self.in_proj_a(x)

        weight = self.conv1d[...][:, 0, :]
        pre_conv = mixed.astype(weight.dtype)
        conv_out, conv_state = causal_depthwise_conv(pre_conv, weight, None if state is None else state.conv,
                                                     ctx.segment_ids)
        mixed = jax.nn.silu(conv_out).astype(x.dtype)
        q, k, v = jnp.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(batch, seq_len, self.num_k_heads, self.head_k_dim)
        k = k.reshape(batch, seq_len, self.num_k_heads, self.head_k_dim)
        v = v.reshape(batch, seq_len, self.num_v_heads, self.head_v_dim)

        beta = jax.nn.sigmoid(b)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        if state is not None and seq_len > 1 and ctx.write_index.ndim:
            # A per-row cache continued by several tokens (the engine extending live rows, padded at the end): a
            # padding position must leave the state as it was: no decay (g = 0) and no write (beta = 0), and the
            # conv window carried on is the last K-1 *real* inputs, not the padding's zeros. (A shared-length
            # cache is continued left-padded, where the zero state before the first real token makes both moot.)
            real = ctx.token_mask[..., None]
            g, beta = jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0).astype(beta.dtype)
            tail = weight.shape[-1] - 1
            window = jnp.concatenate([state.conv.astype(weight.dtype), pre_conv], axis=1)
            conv_state = last_real(window, jnp.pad(ctx.token_mask, ((0, 0), (tail, 0)), constant_values=True), tail)

        pending = None
        if state is not None and seq_len == 1:  # decode: the update deferred to the next step's read
            o, final, pending = gated_delta_decode_step_deferred(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                                                 state.recurrent, state.pending)
            o = o[:, None]
        else:
            initial = None if state is None else state.current()
            o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial, chunk_size=self.cfg.gdn_chunk,
                                              segment_ids=ctx.segment_ids)
        o = checkpoint_name(o, "gdn_core")
        o = self.norm(o, z).reshape(batch, seq_len, self.value_dim)
        if state is not None or cache_length is not None:
            if pending is None:
                pending = no_pending_update(batch, self.num_k_heads, self.num_v_heads, self.head_k_dim,
                                            self.head_v_dim)
            conv_dtype = x.dtype if state is None else state.conv.dtype
            state_dtype = jnp.dtype(self.cfg.gdn_state_dtype) if state is None else state.recurrent.dtype
            state = LinearState(conv_state.astype(conv_dtype), final.astype(state_dtype), pending)
        return self.out_proj(o), state


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen35Config, layer_type: str, *, dtype, rngs: nnx.Rngs):
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
        else:
            self.self_attn = GatedAttention(cfg, dtype=dtype, rngs=rngs)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, h: jax.Array, ctx: StepContext, state, cache_length: Optional[int] = None):
        mixer = self.linear_attn if self.layer_type == "linear_attention" else self.self_attn
        mixed, state = mixer(self.input_layernorm(h), ctx, state, cache_length)
        h = h + mixed
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, state
