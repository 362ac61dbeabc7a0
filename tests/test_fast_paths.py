"""The fast paths against their references: fused-attention arguments, padding compaction, prefix reads of the
KV cache, the bf16 chunked delta rule, the one-pass decode update, bf16 state storage, prefill-mode caches,
prefilling each distinct prompt once, remat policies, and backward passes that stay in the compute dtype."""

import numpy as np
import pytest

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx

from conftest import jitted_forward
from jaxrl.models import lora, qwen35
from jaxrl.models.qwen35 import model as model_module
from jaxrl.models.qwen35.config import default_layer_types, tiny
from jaxrl.models.qwen35.layers import KVState
from jaxrl.models.qwen35.model import REMAT_POLICIES, activation_bytes, choose_remat
from jaxrl.ops import attention as attn
from jaxrl.ops.gated_delta import (apply_pending, gated_delta_decode_step, gated_delta_decode_step_deferred,
                                   no_pending_update)
from jaxrl.ops.matmul import project
from jaxrl.generation import Engine, Request
from jaxrl.generation.buckets import batch_buckets

from test_qwen35_cache import chunk_rule, random_inputs, recurrence


# The references and kernels run as jitted programs: called eagerly, every primitive is dispatched and
# compiled on its own, far slower than one compiled program (and the compiled programs are the ones users run).
causal_attention = jax.jit(attn.causal_attention, static_argnames=("scale", "implementation", "block_size"))
cache_attention = jax.jit(attn.cache_attention, static_argnames=("scale",))


def normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape).astype(dtype)


def numpy_attention(q, k, v, mask, scale):
    """float64 masked softmax attention: mask [B, T] (real tokens), causal among real tokens, GQA by h // G."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, seq_len, heads, _ = q.shape
    groups = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            s = q[b, :, h] @ k[b, :, h // groups].T * scale
            allowed = mask[b][None, :] & (np.arange(seq_len)[None, :] <= np.arange(seq_len)[:, None])
            s = np.where(allowed, s, -np.inf)
            with np.errstate(invalid="ignore"):  # padding queries before the first real token: no key, NaN
                w = np.exp(s - s.max(-1, keepdims=True))
                out[b, :, h] = (w / w.sum(-1, keepdims=True)) @ v[b, :, h // groups]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Attention

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_causal_attention_equals_the_fused_kernel_api_on_the_same_arguments(dtype):
    """What the cuDNN path is called with (BTNH layout, GQA, is_causal, q/kv sequence lengths), run through the
    same jax.nn.dot_product_attention by its XLA implementation, equals our head-major blocked form."""
    batch, seq_len, heads, kv_heads, dim = 3, 300, 8, 2, 32
    q, k, v = (normal(i, (batch, seq_len, n, dim), dtype) for i, n in enumerate((heads, kv_heads, kv_heads)))
    lengths = jnp.array([300, 173, 1], jnp.int32)
    ref = jax.jit(lambda q, k, v, lengths: jax.nn.dot_product_attention(
        q, k, v, scale=0.2, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        implementation="xla"))(q, k, v, lengths)
    real = np.arange(seq_len)[None, :] < np.asarray(lengths)[:, None]
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for block in (None, 64, 300):
        ours = causal_attention(q, k, v, lengths, scale=0.2, implementation="xla", block_size=block)
        assert ours.dtype == dtype
        diff = np.abs(np.asarray(ours, np.float32) - np.asarray(ref, np.float32))[real]
        assert diff.max() <= tol, (block, diff.max())
    assert attn.resolve_implementation("auto", jnp.float32, 256) == "xla"
    assert attn.resolve_implementation("auto", jnp.bfloat16, 256) == ("cudnn" if jax.default_backend() == "gpu"
                                                                      else "xla")


def test_compaction_reaches_the_kernel_for_any_padding():
    """Rows padded on the left, on both sides, with holes, or not at all: compacted to right padding, attended,
    and put back, every real token's output is float64 masked attention's."""
    rng = np.random.default_rng(0)
    seq_len = 90
    mask = np.zeros((4, seq_len), bool)
    mask[0, 30:] = True  # left-padded prompt
    mask[1, 20:70] = True  # left-padded prompt, right-padded completion (GRPO/PPO rows)
    mask[2] = rng.random(seq_len) < 0.6  # holes
    mask[3] = True
    order, dest, lengths = attn.compaction(jnp.asarray(mask))
    order, dest = np.asarray(order), np.asarray(dest)
    for b in range(4):
        assert np.array_equal(order[b][dest[b]], np.arange(seq_len))  # inverse permutations
        assert np.array_equal(order[b][:mask[b].sum()], np.flatnonzero(mask[b]))  # real tokens first, in order
    assert list(np.asarray(lengths)) == list(mask.sum(1))
    q, k, v = (normal(i, (4, seq_len, n, 16)) for i, n in enumerate((4, 2, 2)))
    attend = jax.jit(lambda q, k, v, order, dest, lengths: attn.uncompact(attn.causal_attention(
        *(attn.compact(x, order) for x in (q, k, v)), lengths, 0.25, block_size=32), dest))
    out = attend(q, k, v, jnp.asarray(order), jnp.asarray(dest), lengths)
    ref = numpy_attention(q, k, v, mask, 0.25)
    assert np.abs(np.asarray(out) - ref)[mask].max() <= 1e-5


def test_cache_attention_reads_only_the_filled_prefix_and_agrees():
    batch, slots, dim = 2, 200, 16
    k, v = normal(1, (batch, 2, slots, dim)), normal(2, (batch, 2, slots, dim))
    q = normal(3, (batch, 1, 4, dim))
    valid = np.zeros((batch, slots), bool)
    valid[0, 10:130] = True
    valid[1, 60:130] = True
    sizes = attn.prefix_lengths(slots)
    assert sizes[-1] == slots and len(sizes) <= 8 and all(s % 16 == 0 for s in sizes[:-1])
    full = cache_attention(q, k, v, jnp.asarray(valid), jnp.array([129]), scale=0.25)
    prefix = jax.jit(lambda f: attn.cache_attention(q, k, v, jnp.asarray(valid), jnp.array([129]), 0.25, filled=f))
    for filled in (130, 131, 199, 200):
        np.testing.assert_allclose(np.asarray(prefix(jnp.int32(filled))), np.asarray(full), atol=1e-6)
    # the branch taken reads fewer slots: slots beyond `filled` may hold anything
    garbage = jnp.asarray(v).at[:, :, 144:].set(1e6)
    cut = cache_attention(q, k, garbage, jnp.asarray(valid), jnp.array([129]), scale=0.25, filled=jnp.int32(130))
    np.testing.assert_allclose(np.asarray(cut), np.asarray(full), atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Gated DeltaNet

def delta_inputs(seed, seq_len=300, hv=4):
    """Gated DeltaNet inputs at the real head dim (64) and 2 key heads."""
    return random_inputs(seed, seq_len=seq_len, hv=hv, dk=64, dv=64)


def test_auto_chunk_size_follows_the_key_head_dim_and_gives_the_same_outputs():
    """gdn_chunk_size 0 (the default) picks the key head dim within [16, 64]: 64 for the 4B / 9B (d_k = 128),
    16 for the tiny model (d_k = 16); a set value wins; and the chunk size changes only rounding."""
    assert qwen35.PRESETS["qwen3.5-4b"]().gdn_chunk == 64 and qwen35.PRESETS["qwen3.5-9b"]().gdn_chunk == 64
    assert tiny().gdn_chunk == 16 and tiny(gdn_chunk_size=32).gdn_chunk == 32
    with pytest.raises(qwen35.config.ConfigError, match="gdn_chunk_size"):
        tiny(gdn_chunk_size=-1).validate()
    q, k, v, g, beta = random_inputs(5, seq_len=100, hv=4, dk=16, dv=16)
    by_chunk = {c: chunk_rule(q, k, v, g, beta, chunk_size=c) for c in (16, 64)}
    for a, b in zip(by_chunk[16], by_chunk[64]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hv", [2, 4, 6])
def test_bf16_chunked_delta_rule_within_its_documented_bound(hv):
    """bf16 operands with fp32 accumulation vs the fp32 path on the same (bf16-rounded) inputs: the output within
    1.5% of its scale at worst and 1% rms, the final state within 1.5% (measured 0.5-0.6%, 0.4%, 0.4-0.5%;
    rounding the fp32 output itself to bf16 is 0.2%)."""
    q, k, v, g, beta = delta_inputs(hv, hv=hv)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    q, k, v, beta = map(bf, (q, k, v, beta))
    fn = chunk_rule
    o32, s32 = fn(*(x.astype(jnp.float32) for x in (q, k, v)), g, beta.astype(jnp.float32))
    o16, s16 = fn(q, k, v, g, beta)
    assert o16.dtype == jnp.bfloat16 and s16.dtype == jnp.float32
    o16 = o16.astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(o32)))
    assert float(jnp.max(jnp.abs(o16 - o32))) <= 0.015 * scale
    assert float(jnp.sqrt(jnp.mean((o16 - o32) ** 2) / jnp.mean(o32 ** 2))) <= 0.01
    assert float(jnp.max(jnp.abs(s16 - s32))) <= 0.015 * float(jnp.max(jnp.abs(s32)))
    ref, _ = recurrence(*(x.astype(jnp.float32) for x in (q, k, v)), g, beta.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(o32), np.asarray(ref), atol=5e-5)  # the fp32 path is the recurrence


def test_one_pass_decode_update_equals_the_recurrence():
    """20 decode steps with value heads 2x the key heads equal the token recurrence (fp32), state and outputs."""
    q, k, v, g, beta = delta_inputs(7, seq_len=20)
    ref_out, ref_state = recurrence(q, k, v, g, beta)
    step = jax.jit(gated_delta_decode_step)
    state = jnp.zeros(ref_state.shape, jnp.float32)
    outs = []
    for t in range(20):
        o, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
    np.testing.assert_allclose(np.stack(outs, 1), np.asarray(ref_out), atol=2e-6)
    np.testing.assert_allclose(np.asarray(state), np.asarray(ref_state), atol=2e-6)
    # bf16 storage: the state comes back in bf16, the math in fp32
    o16, s16 = step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.astype(jnp.bfloat16))
    assert s16.dtype == jnp.bfloat16 and o16.dtype == jnp.float32


def test_deferred_decode_update_equals_the_recurrence_and_the_one_pass_update():
    """The decode update the model runs (each step's rank-1 update applied when the next step reads the state:
    one read and one write of it): 20 steps equal the token recurrence (fp32, outputs and state); with bf16
    storage every stored state is the one-pass update's, rounded at the same point (within one bf16 rounding)."""
    q, k, v, g, beta = delta_inputs(7, seq_len=20)
    ref_out, ref_state = recurrence(q, k, v, g, beta)
    deferred = jax.jit(gated_delta_decode_step_deferred)
    plain = jax.jit(gated_delta_decode_step)
    batch, _, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    for dtype in (jnp.float32, jnp.bfloat16):
        stored = jnp.zeros(ref_state.shape, dtype)
        pending = no_pending_update(batch, hk, hv, dk, dv)
        one_pass = jnp.zeros(ref_state.shape, dtype)
        outs = []
        for t in range(20):
            o, stored, pending = deferred(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], stored, pending)
            assert stored.dtype == dtype
            outs.append(o)
            # what the deferred step stored is the state entering token t: the one-pass state after t - 1
            np.testing.assert_allclose(np.asarray(stored, np.float32), np.asarray(one_pass, np.float32),
                                       atol=2e-6, rtol=2 ** -7 if dtype == jnp.bfloat16 else 1e-6)
            _, one_pass = plain(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], one_pass)
        if dtype == jnp.float32:
            np.testing.assert_allclose(np.stack(outs, 1), np.asarray(ref_out), atol=2e-6)
            np.testing.assert_allclose(np.asarray(apply_pending(stored, pending)), np.asarray(ref_state), atol=2e-6)


# ---------------------------------------------------------------------------------------------------------------
# Model: prefill mode, bf16 state storage, remat

@pytest.fixture(scope="module")
def model(hf_container):
    return qwen35.from_pretrained(hf_container[0], dtype=jnp.float32)


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_prefill_mode_cache_equals_the_preallocated_cache_path(model):
    rng = np.random.default_rng(3)
    ids = rng.integers(2, 250, size=(3, 90)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :25] = 0
    mask[2, :89] = 0  # one real token
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    h_new, new = jitted_forward(model, lambda m, ids, mask: m.hidden_states(ids, mask, cache_length=100))(ids, mask)
    h_old, old = jitted_forward(model, lambda m, ids, mask, cache: m.hidden_states(ids, mask, cache=cache))(
        ids, mask, model.init_cache(3, 100))
    real = np.asarray(mask).astype(bool)  # outputs at padding positions are meaningless
    np.testing.assert_allclose(np.asarray(h_new)[real], np.asarray(h_old)[real], atol=1e-5)
    assert int(new.length) == int(old.length) == 90
    np.testing.assert_array_equal(np.asarray(new.valid), np.asarray(old.valid))
    np.testing.assert_array_equal(np.asarray(new.next_position), np.asarray(old.next_position))
    slots = np.asarray(new.valid)[:, None, :, None]  # keys and values of padding slots are never read
    for new_state, old_state in zip(new.layers, old.layers):
        for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(old_state)):  # KV, or conv + state + pending
            assert a.shape == b.shape and a.dtype == b.dtype
            a, b = np.asarray(a), np.asarray(b)
            if isinstance(new_state, KVState):
                a, b = a * slots, b * slots
            np.testing.assert_allclose(a, b, atol=1e-5)
    step = jnp.asarray([[5], [6], [7]])
    decode = jitted_forward(model)
    np.testing.assert_allclose(np.asarray(decode(step, cache=new)[0]), np.asarray(decode(step, cache=old)[0]),
                               atol=1e-4)


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_bf16_decode_state_drift_is_small_and_does_not_grow(model):
    """Teacher-forced decode of 256 tokens with the Gated DeltaNet state stored in bf16 vs fp32 (fp32 model,
    perturbed tiny checkpoint, logits of scale ~10): every step's log-probabilities within 0.05 (measured max
    0.028, median step 0.004), no growth over the steps, and the state within 1% (one bf16 rounding is 0.4%)."""
    prompt, steps = 64, 256
    ids = np.random.default_rng(1).integers(2, 250, size=(2, prompt + steps)).astype(np.int32)
    graphdef, state = nnx.split(model)

    def run(state_dtype):
        m = nnx.merge(graphdef, state)
        m.set_compute(gdn_state_dtype=state_dtype)
        g2, s2 = nnx.split(m)

        @jax.jit
        def go(s2):
            m = nnx.merge(g2, s2)
            _, cache = m.hidden_states(jnp.asarray(ids[:, :prompt]), cache_length=prompt + steps)

            def body(cache, tok):
                logits, cache = m(tok[:, None], cache=cache)
                return cache, jax.nn.log_softmax(logits[:, 0].astype(jnp.float32))

            cache, logps = jax.lax.scan(body, cache, jnp.asarray(ids[:, prompt:].T))
            return logps, cache.layers[0].recurrent

        return go(s2)

    lp32, s32 = run("float32")
    lp16, s16 = run("bfloat16")
    assert s32.dtype == jnp.float32 and s16.dtype == jnp.bfloat16
    diff = np.abs(np.asarray(lp32) - np.asarray(lp16)).max(axis=(1, 2))  # per step
    assert diff.max() <= 0.05, diff.max()
    assert diff[-64:].max() <= 2 * diff[:64].max() + 1e-3  # no accumulation over the steps
    s16 = s16.astype(jnp.float32)
    assert float(jnp.max(jnp.abs(s16 - s32))) <= 0.01 * float(jnp.max(jnp.abs(s32)))


@pytest.mark.slow  # one gradient per remat policy
@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_remat_policies_give_the_same_gradients():
    """none / matmuls / attention / full: the same LoRA gradients (a remat policy changes what is kept, never the
    result); auto, at a size that fits anywhere, traces exactly the program of none. Two layers, one of each
    kind: each policy's gradient program compiles in half the time of the 4-layer model's."""
    model = qwen35.init_model(tiny(num_hidden_layers=2, layer_types=default_layer_types(2, 2)), seed=5)
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(2).integers(2, 250, size=(2, 70)))
    mask = jnp.asarray(np.r_[np.ones((1, 70)), np.c_[np.zeros((1, 11)), np.ones((1, 59))]].astype(np.int32))

    def gradient(policy):
        """(the gradient function of the LoRA factors under `policy`, its trainable and frozen arguments)"""
        m = nnx.merge(graphdef, state)
        m.set_compute(remat=policy)
        lora.apply_lora(m, "all-linear", rank=4, alpha=8.0, seed=1)
        for _, a in lora.iter_lora(m):  # B = 0 would give zero A-gradients; make every factor matter
            a.lora_B.set_value(jnp.full(a.lora_B.shape, 0.01, jnp.float32))
        g, trainable, frozen = lora.split_lora(m)

        def loss(trainable, frozen):
            hidden, _ = nnx.merge(g, trainable, frozen).hidden_states(ids, mask)
            return jnp.sum(jnp.sin(hidden) * mask[..., None])

        return jax.grad(loss), trainable, frozen

    grads = {}
    for policy in ("none", "matmuls", "attention", "full"):
        fn, trainable, frozen = gradient(policy)
        grads[policy] = jax.jit(fn)(trainable, frozen)
    traced = {p: str(jax.make_jaxpr(fn)(trainable, frozen)) for p in ("auto", "none")
              for fn, trainable, frozen in [gradient(p)]}
    assert traced["auto"] == traced["none"]  # tracing only: no fifth compile
    for policy, g in grads.items():
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads["none"])):
            scale = float(np.max(np.abs(np.asarray(b))))
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * scale, err_msg=policy)


def test_auto_remat_follows_the_memory_estimate():
    cfg = qwen35.qwen35_4b()
    tokens, seq_len = 2 * 4096, 4096
    need = {p: activation_bytes(cfg, p, tokens, seq_len, 2) for p in ("none", "matmuls", "attention", "full")}
    assert need["none"] > need["matmuls"] > need["attention"] > need["full"] > 0
    assert choose_remat(cfg, tokens, seq_len, 2, budget=1e15) == "none"
    assert choose_remat(cfg, tokens, seq_len, 2, budget=need["matmuls"]) == "matmuls"
    assert choose_remat(cfg, tokens, seq_len, 2, budget=need["attention"] * 1.01) == "attention"
    assert choose_remat(cfg, tokens, seq_len, 2, budget=1.0) == "full"
    assert set(REMAT_POLICIES) >= {"none", "matmuls", "attention", "full"}
    with pytest.raises(ValueError, match="remat='fast'"):
        qwen35.init_model(tiny(), remat="fast")


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_auto_remat_budgets_the_weight_stack_of_scanned_layers():
    """A scanned training pass holds a stacked copy of the layer weights (the AOT benchmark at the 9B shape: the
    kept activations of remat "matmuls" came to 49.1 GiB against a 43.7 GiB budget), so "auto" reserves it."""
    import dataclasses

    cfg = qwen35.qwen35_9b()

    def abstract(scan_layers):  # shapes only: nothing of the 9B model is allocated
        c = dataclasses.replace(cfg, scan_layers=scan_layers)
        return nnx.eval_shape(lambda: qwen35.Qwen35(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))

    scanned, unrolled = abstract(True), abstract(False)
    assert scanned.layer_cycle()[0] == 4 and unrolled.layer_cycle()[0] is None
    layer_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(scanned.layers, nnx.Param)))
    assert 12 * 2**30 < layer_bytes < 14 * 2**30  # the 9B's layer weights in bf16 (embeddings and head aside)
    device = 104.25 * 2**30  # an H200's default allocator limit (75% of 139 GiB)
    gap = unrolled.activation_budget(device) - scanned.activation_budget(device)
    assert gap == pytest.approx(model_module.AUTO_ACTIVATION_FRACTION * layer_bytes)
    # A device on which the unrolled pass just affords "matmuls": the scanned one falls back to "attention".
    tokens, seq_len = 2 * 6144, 6144
    need = activation_bytes(cfg, "matmuls", tokens, seq_len, 2)
    device = need / model_module.AUTO_ACTIVATION_FRACTION + unrolled.weight_bytes()
    assert choose_remat(cfg, tokens, seq_len, 2, unrolled.activation_budget(device)) == "matmuls"
    assert choose_remat(cfg, tokens, seq_len, 2, scanned.activation_budget(device)) == "attention"


# ---------------------------------------------------------------------------------------------------------------
# Rollouts: each distinct prompt prefilled once

def test_each_distinct_prompt_is_prefilled_once_and_copied_to_its_samples(model):
    """Two prompts x 8 samples move into 16 slots in one insert: two prompts prefilled, and every slot's cache is
    what prefilling its prompt alone gives."""
    engine = Engine(model, slots=16, prompt_buckets=(64,), generation_buckets=(4,), insert_rows=16,
                    prompts_per_insert=2)
    engine.set_params(None)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, 250, size=n).astype(np.int32) for n in (40, 9)]
    for j, prompt in enumerate(prompts):
        for i in range(8):
            engine.submit(Request(prompt, group_id=j, sample_index=i, prompt_key=j))
    (pool,) = engine.pools.values()
    engine._admit(pool)
    assert (engine.stats["inserts"], engine.stats["prefilled_prompts"]) == (1, 2)
    assert batch_buckets(128) == (2, 8, 32, 128) and batch_buckets(128, multiple=8) == (8, 32, 128)
    cache = pool.state.cache
    # every row's cache is what prefilling that row's prompt alone gives
    prefill_alone = jitted_forward(model, lambda m, ids, mask: m.hidden_states(ids, mask, cache_length=68))
    for j, prompt in enumerate(prompts):
        ids = np.zeros((1, 64), np.int32)
        mask = np.zeros((1, 64), np.int32)
        ids[0, 64 - len(prompt):] = prompt
        mask[0, 64 - len(prompt):] = 1
        _, alone = prefill_alone(jnp.asarray(ids), jnp.asarray(mask))
        valid = np.asarray(alone.valid[0])[None, :, None]
        for row in range(8 * j, 8 * j + 8):
            assert (np.asarray(cache.valid[row]) == np.asarray(alone.valid[0])).all()
            for copied, own in zip(cache.layers, alone.layers):
                for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(own)):
                    a, b = np.asarray(a[row]), np.asarray(b[0])
                    if isinstance(own, KVState):
                        a, b = a * valid, b * valid
                    # a 2-prompt and a 1-prompt prefill sum in other orders: fp32 rounding, relative to values ~1
                    np.testing.assert_allclose(a, b, atol=1e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------------------------
# Decode: the weights transposed to [in, out] once per weight version (CPU), adapters fused

@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.heavy)])
def test_decode_with_transposed_weights_equals_the_plain_step(dtype):
    """Two decode steps with the decode weight copies (`decode_weights`: LoRA attached and fused into its
    projection, untied head) give the logits and caches of the plain model; the copies are really used (every
    projection's weight, each adapter's B, the head) and only inside the trace."""
    m = qwen35.init_model(tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                               tie_word_embeddings=False), dtype=dtype)
    lora.apply_lora(m, ["q_proj", "in_proj_qkv", "down_proj"], rank=4, alpha=8.0)
    for _, linear in lora.linears(m):
        if linear.lora is not None:
            linear.lora.lora_B.set_value(normal(5, linear.lora.lora_B.shape, dtype))
    ids = jnp.asarray(np.random.default_rng(8).integers(2, 250, size=(3, 12)), jnp.int32)
    _, cache = jitted_forward(m, lambda m, ids: m.hidden_states(ids, cache_length=16))(ids)

    copies = jitted_forward(m, lambda m: m.decode_weights())()

    def two_steps(model, cache, weights):
        if weights is not None:
            model.use_decode_weights(weights)
        first, cache = model(ids[:, :1], cache=cache)
        second, cache = model(ids[:, 1:2], cache=cache)
        return jnp.concatenate([first, second], 1), cache

    plain = jitted_forward(m, lambda m, c: two_steps(m, c, None))(cache)
    fast = jitted_forward(m, lambda m, c, w: two_steps(m, c, w))(cache, copies)
    tol = 1e-5 if dtype == jnp.float32 else 0.05  # bf16: a different summation order, then one bf16 rounding
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(plain)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol)
    graphdef, state = nnx.split(m)
    jaxpr = jax.make_jaxpr(lambda s, c, w: two_steps(nnx.merge(graphdef, s), c, w))(state, cache, copies).jaxpr
    linears = [mod for path, mod in lora.linears(m) if path != "lm_head"]
    adapted = [mod for mod in linears if mod.lora is not None]
    # on the CPU a copy per projection (A stacked under the weight where adapted) and the head
    assert len(copies) == len(linears) + 1 and all(mod.decode is None for mod in linears) and m.head_in_out is None
    # one product per projection and one per adapter's B, instead of three per adapted projection
    two_step_dots = len(_dot_eqns(jaxpr))
    plain = jax.make_jaxpr(lambda s, c: two_steps(nnx.merge(graphdef, s), c, None))(state, cache).jaxpr
    assert len(_dot_eqns(plain)) - two_step_dots == 2 * len(adapted)


def test_the_engine_decodes_with_the_weight_copies(model):
    """The engine prepares the copies once per weight version (one program) and its decode rounds read them: an
    [in, out] copy of every projection and of the head on the CPU."""
    engine = Engine(model, slots=2, prompt_buckets=(16,), generation_buckets=(3,))
    engine.set_params(None)
    linears = [path for path, _ in lora.linears(model) if path != "lm_head"]
    assert len(engine._decode_weights) == len(linears) + 1 and "head" in engine._decode_weights
    out = engine.submit(Request(list(range(2, 9)), max_new_tokens=3))
    engine.run()
    assert len(out.wait().tokens) == 3


def test_weights_too_large_for_the_host_are_not_copied_for_decode(monkeypatch):
    """The [in, out] copies double the weights' memory: skipped when the weights exceed DECODE_COPY_FRACTION of
    the host's memory."""
    m = qwen35.init_model(tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention")))
    graphdef, state = nnx.split(m)

    def copies():
        return jax.eval_shape(lambda s: nnx.merge(graphdef, s).decode_weights(), state)

    assert len(copies()) > 0
    monkeypatch.setattr(model_module, "_device_memory_bytes",
                        lambda: m.weight_bytes() / model_module.DECODE_COPY_FRACTION - 1)
    assert copies() == {}


# ---------------------------------------------------------------------------------------------------------------
# Backward passes in the compute dtype

def _dot_eqns(jaxpr) -> list:
    """Every dot_general in a jaxpr, inside sub-jaxprs (custom_vjp, remat, scan) too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _dot_eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _dot_eqns(sub)
    return found


def _dot_operand_dtypes(jaxpr) -> set:
    return {tuple(str(v.aval.dtype) for v in eqn.invars) for eqn in _dot_eqns(jaxpr)}


def test_projection_backward_stays_in_the_compute_dtype():
    """project(): fp32 gradients equal plain autodiff; bf16 gradients come from bf16 x bf16 products only (no
    fp32 x bf16 dot anywhere in the backward), within bf16 rounding of the fp32 gradients."""
    x, w = normal(0, (6, 40, 32)), normal(1, (300, 32))
    target = normal(2, (6, 40, 300))
    loss = lambda fn: (lambda x, w: jnp.sum(jnp.tanh(fn(x, w)) * target))  # noqa: E731
    plain = lambda x, w: jnp.einsum("...i,oi->...o", x, w)  # noqa: E731
    ours32 = jax.jit(jax.grad(loss(lambda x, w: project(x, w, jnp.float32)), argnums=(0, 1)))(x, w)
    ref32 = jax.jit(jax.grad(loss(plain), argnums=(0, 1)))(x, w)
    for a, b in zip(ours32, ref32):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    fn16 = jax.grad(loss(lambda x, w: project(x, w, jnp.float32)), argnums=(0, 1))
    dtypes = _dot_operand_dtypes(jax.make_jaxpr(fn16)(xb, wb).jaxpr)
    assert dtypes == {("bfloat16", "bfloat16")}, dtypes
    for a, b in zip(jax.jit(fn16)(xb, wb), ref32):
        scale = float(jnp.max(jnp.abs(b)))
        assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) <= 0.03 * scale


def test_lora_in_a_bf16_model_multiplies_in_bf16_with_fp32_accumulation():
    m = qwen35.init_model(tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention")),
                          dtype=jnp.bfloat16)
    lora.apply_lora(m, ["q_proj"], rank=4, alpha=8.0)
    adapter = m.layers[1].self_attn.q_proj.lora
    adapter.lora_B.set_value(normal(5, adapter.lora_B.shape))
    x = normal(6, (3, 64), jnp.bfloat16)
    dots = _dot_eqns(jax.make_jaxpr(adapter)(x).jaxpr)
    assert len(dots) == 2
    backward = _dot_eqns(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(adapter(x) ** 2)))(x).jaxpr)
    assert len(backward) == 2 + 4  # the forward, then dh, dB, dA, dx
    for e in dots + backward:
        assert [str(v.aval.dtype) for v in e.invars] == ["bfloat16", "bfloat16"]
        assert e.params["preferred_element_type"] == jnp.float32
    ours = adapter(x)
    ref = adapter.scale * (x.astype(jnp.float32) @ adapter.lora_A[...].T) @ adapter.lora_B[...].T
    assert float(jnp.max(jnp.abs(ours - ref))) <= 0.02 * float(jnp.max(jnp.abs(ref)))


@pytest.mark.parametrize("batch_shape", [(37,), (3, 29)])
def test_low_rank_product_gradients_equal_plain_autodiff(batch_shape):
    """The hand-written LoRA backward (thin operands transposed) against autodiff of the two einsums: equal in
    fp32 to float rounding, within bf16 rounding in bf16."""
    x, a, b = normal(0, batch_shape + (48,)), 0.1 * normal(1, (4, 48)), 0.1 * normal(2, (40, 4))
    target = normal(3, batch_shape + (40,))

    def plain(x, a, b):
        h = jnp.einsum("...i,ri->...r", x, a, preferred_element_type=jnp.float32).astype(x.dtype)
        return jnp.einsum("...r,or->...o", h, b, preferred_element_type=jnp.float32)

    loss = lambda fn: (lambda *args: jnp.sum(jnp.tanh(fn(*args)) * target))  # noqa: E731
    ref = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, a, b)
    grad = jax.jit(jax.grad(loss(lora.low_rank_product), argnums=(0, 1, 2)))
    ours = grad(x, a, b)
    for g, r in zip(ours, ref):
        # Float rounding is relative to the gradient's scale: the two programs sum each entry's 87 products in
        # other orders, and on AVX-512 (Zen 5) an entry of 0.32 beside entries of 10.5 differed by 2e-6 (1.6
        # ulps of the scale), over a flat atol of 1e-6.
        scale = float(np.max(np.abs(np.asarray(r))))
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6 * scale)
    low = [v.astype(jnp.bfloat16) for v in (x, a, b)]
    for g, r in zip(grad(*low), ref):
        assert g.dtype == jnp.bfloat16
        assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - r))) <= 0.03 * float(jnp.max(jnp.abs(r)))
