"""Chunked vs recurrent delta rule, and carried state: a prefix plus a continuation equals one pass."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import jitted_forward
from jaxrl.models import qwen35
from jaxrl.ops.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule


# The kernels as jitted programs (what the model runs): called eagerly, each primitive would be dispatched and
# compiled on its own, most of these tests' time.
chunk_rule = jax.jit(chunk_gated_delta_rule, static_argnames=("chunk_size", "solve_method"))
recurrence = jax.jit(recurrent_gated_delta_rule)


def random_inputs(seed, batch=2, seq_len=150, hk=2, hv=4, dk=16, dv=8):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (batch, seq_len, hk, dk))
    k = jax.random.normal(ks[1], (batch, seq_len, hk, dk))
    v = jax.random.normal(ks[2], (batch, seq_len, hv, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (batch, seq_len, hv)) + 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (batch, seq_len, hv)))
    return q, k, v, g, beta


def numpy_recurrence(q, k, v, g, beta):
    """Independent float64 transcription of docs/design/qwen35-architecture.md §3.1 (one loop per token)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    rep = v.shape[2] // k.shape[2]
    q, k = np.repeat(q, rep, 2), np.repeat(k, rep, 2)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(q.shape[-1])
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    batch, seq_len, heads, dv = v.shape
    state = np.zeros((batch, heads, k.shape[-1], dv))
    out = np.zeros_like(v)
    for t in range(seq_len):
        state = state * np.exp(g[:, t])[..., None, None]
        pred = np.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - pred) * beta[:, t][..., None]
        state = state + k[:, t][..., :, None] * delta[..., None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, state


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", [1, 63, 64, 150])
def test_chunked_and_recurrent_agree_with_float64_reference(seq_len):
    inputs = random_inputs(seq_len, seq_len=seq_len)
    ref_out, ref_state = numpy_recurrence(*inputs)
    for fn in (chunk_rule, recurrence):
        out, state = fn(*inputs)
        np.testing.assert_allclose(np.asarray(out), ref_out, atol=5e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(state), ref_state, atol=5e-5, rtol=1e-4)


@pytest.mark.slow
def test_matmul_inverse_solve_equals_triangular_solve():
    """The accelerator path ((I+N)^-1 by repeated squaring) agrees with XLA's triangular solve."""
    inputs = random_inputs(5, seq_len=130)
    a, sa = chunk_rule(*inputs, solve_method="triangular")
    b, sb = chunk_rule(*inputs, solve_method="matmul")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    np.testing.assert_allclose(np.asarray(sa), np.asarray(sb), atol=2e-5)
    ref, _ = numpy_recurrence(*inputs)
    np.testing.assert_allclose(np.asarray(b), ref, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("size", [1, 7, 16, 24, 64, 128])
def test_block_inverse_is_the_exact_unit_lower_inverse(size):
    """(I + N)^-1 from block recursion over 16 x 16 nilpotent series, against float64 numpy, batched."""
    from jaxrl.ops.gated_delta import _unit_lower_inverse
    rng = np.random.default_rng(size)
    strict = np.tril(rng.standard_normal((3, size, size)) * 0.3, -1)
    got = np.asarray(_unit_lower_inverse(jnp.asarray(strict, jnp.float32)))
    want = np.linalg.inv(np.eye(size) + strict)
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, np.abs(want).max()), rtol=1e-4)
    assert np.all(np.triu(got, 1) == 0) and np.allclose(np.diagonal(got, axis1=-2, axis2=-1), 1.0)


@pytest.mark.slow
def test_chunk_sizes_agree():
    inputs = random_inputs(3, seq_len=100)
    a, sa = chunk_rule(*inputs, chunk_size=64)
    b, sb = chunk_rule(*inputs, chunk_size=16)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    np.testing.assert_allclose(np.asarray(sa), np.asarray(sb), atol=2e-5)


@pytest.mark.slow
def test_kernel_continuation_with_initial_state():
    q, k, v, g, beta = random_inputs(4, seq_len=150)
    whole, whole_state = chunk_rule(q, k, v, g, beta)
    split = lambda x, a, b: x[:, a:b]
    first, state = chunk_rule(*(split(x, 0, 100) for x in (q, k, v, g, beta)))
    second, state = chunk_rule(*(split(x, 100, 149) for x in (q, k, v, g, beta)), initial_state=state)
    last, state = recurrence(*(split(x, 149, 150) for x in (q, k, v, g, beta)), initial_state=state)
    np.testing.assert_allclose(np.concatenate([first, second, last], 1), np.asarray(whole), atol=3e-5)
    np.testing.assert_allclose(np.asarray(state), np.asarray(whole_state), atol=3e-5)


@pytest.fixture(scope="module")
def model(hf_container):
    return qwen35.from_pretrained(hf_container[0])


@pytest.mark.slow
def test_model_prefix_plus_continuation_equals_one_pass(model):
    forward = jitted_forward(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(2, 250, size=(2, 150)))
    whole = np.asarray(forward(ids))
    cache = model.init_cache(2, 160)
    parts = []
    for a, b in [(0, 100), (100, 149), (149, 150)]:  # chunked prefill, chunked continuation, one decode step
        logits, cache = forward(ids[:, a:b], cache=cache)
        parts.append(np.asarray(logits))
    assert int(cache.length) == 150 and list(np.asarray(cache.next_position)) == [150, 150]
    np.testing.assert_allclose(np.concatenate(parts, 1), whole, atol=1e-4 * np.abs(whole).max())


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_left_padded_prefill_then_decode_matches_unpadded(model):
    rng = np.random.default_rng(1)
    lengths = [70, 33]
    width, steps = 70, 6
    rows = [rng.integers(2, 250, size=n + steps) for n in lengths]
    ids = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), np.int64)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = rows[i][:n]
        mask[i, width - n:] = 1
    forward = jitted_forward(model)
    cache = model.init_cache(2, width + steps)
    logits, cache = forward(jnp.asarray(ids), attention_mask=jnp.asarray(mask), cache=cache)
    decoded = [np.asarray(logits[:, -1])]
    for t in range(steps):
        step_ids = np.array([[rows[0][lengths[0] + t]], [rows[1][lengths[1] + t]]])
        logits, cache = forward(jnp.asarray(step_ids), cache=cache)
        decoded.append(np.asarray(logits[:, -1]))
    decoded = np.stack(decoded, 1)  # [2, steps+1, V]: logits after the prompt and after each decoded token
    for i, n in enumerate(lengths):
        ref = np.asarray(forward(jnp.asarray(rows[i][None])))[0, n - 1:n + steps]
        np.testing.assert_allclose(decoded[i], ref, atol=1e-4 * np.abs(ref).max())


@pytest.mark.slow
def test_per_row_cache_continued_by_right_padded_chunks_equals_one_pass(model):
    """The engine's live-row extension: a per-row cache continued by chunks of several tokens per row, each row
    with its own count of real tokens (padding at the end), then one decode step, equals one pass over each row's
    sequence. Padding must leave the attention cache, the conv window and the recurrent state as they were."""
    rng = np.random.default_rng(2)
    chunks = [(40, [30, 12]), (16, [5, 16]), (8, [1, 3])]  # (width, real tokens of each row)
    rows = [rng.integers(2, 250, size=sum(c[1][i] for c in chunks) + 1) for i in range(2)]
    forward = jitted_forward(model)
    cache = model.init_cache(2, 96, per_row=True)
    got = [[], []]
    done = [0, 0]
    for width, real in chunks:
        ids = np.zeros((2, width), np.int64)
        mask = np.zeros((2, width), np.int64)
        for i, n in enumerate(real):
            ids[i, :n] = rows[i][done[i]:done[i] + n]
            mask[i, :n] = 1
        logits, cache = forward(jnp.asarray(ids), attention_mask=jnp.asarray(mask), cache=cache)
        for i, n in enumerate(real):
            got[i].append(np.asarray(logits[i, :n]))
            done[i] += n
    assert list(np.asarray(cache.length)) == done
    step = np.array([[rows[0][-1]], [rows[1][-1]]])
    logits, cache = forward(jnp.asarray(step), cache=cache)
    for i in range(2):
        ref = np.asarray(forward(jnp.asarray(rows[i][None])))[0]
        mine = np.concatenate(got[i] + [np.asarray(logits[i])], 0)
        np.testing.assert_allclose(mine, ref, atol=1e-4 * np.abs(ref).max())
