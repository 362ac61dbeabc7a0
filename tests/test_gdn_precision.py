"""The Gated DeltaNet kernels' fp32 dots carry precision HIGHEST (jaxrl/ops/gated_delta.py, Dtypes: at its default
XLA:GPU may run fp32 dots in TF32), seen in the lowered program; on the CPU the output is the same as at DEFAULT
and still the float64 recurrence."""

import re
from collections import Counter

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxrl.ops import gated_delta
from test_qwen35_cache import numpy_recurrence, random_inputs

CHUNK = 64  # the model's chunk: the inverse recurses 64 -> 32 -> 16 x 16 nilpotent blocks
_DOT = re.compile(r"stablehlo\.dot_general .*?(?:precision = \[(\w+), (\w+)\] )?: "
                  r"\(tensor<(?:[\dx]*x)?(\w+)>, tensor<(?:[\dx]*x)?(\w+)>\)")  # dtypes after the dimensions


def dots(lowered_text: str) -> Counter:
    """Counter of (precision, lhs dtype, rhs dtype) over every dot_general of a lowered program's StableHLO text."""
    found = Counter()
    for line in lowered_text.splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        m = _DOT.search(line)
        assert m is not None, line
        lhs_precision, rhs_precision, lhs, rhs = m.groups()
        assert lhs_precision == rhs_precision, line
        found[(lhs_precision or "DEFAULT", lhs, rhs)] += 1
    return found


def fp32_dots_at(found: Counter, precision: str) -> int:
    return sum(n for (p, lhs, rhs), n in found.items() if "f32" in (lhs, rhs) and p == precision)


def chunk_rule():
    """A fresh jitted function: jit caches traces by function, and the tests below change FP32_PRECISION."""
    return jax.jit(lambda *xs: gated_delta.chunk_gated_delta_rule(*xs, chunk_size=CHUNK))


def loss(q, k, v, g, beta):
    out, state = gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK)
    return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.shape[-1]))) + jnp.sum(state)


def bf16_inputs(inputs):
    q, k, v, g, beta = inputs
    return q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), g, beta.astype(jnp.bfloat16)


def test_every_fp32_dot_of_the_chunked_rule_is_highest_forward_and_backward():
    inputs = random_inputs(0, seq_len=100, dk=32, dv=16)
    forward = dots(chunk_rule().lower(*inputs).as_text())
    backward = dots(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*inputs).as_text())
    for found in (forward, backward):
        assert fp32_dots_at(found, "HIGHEST") > 0 and fp32_dots_at(found, "DEFAULT") == 0, found
    assert fp32_dots_at(forward, "HIGHEST") >= 20  # the inverse's squarings and block products are among them


def test_bf16_inputs_run_the_inverse_at_highest_and_the_bf16_products_at_default():
    """With bf16 inputs the fp32 dots are the inverse's; the products of bf16 operands keep the default. Their
    transposes in the backward pass (jax meets the fp32 cotangent with the upcast bf16 operand) stay at the
    default too: each result is rounded to its bf16 operand's dtype, coarser than TF32."""
    inputs = bf16_inputs(random_inputs(1, seq_len=100, dk=32, dv=16))
    forward = dots(chunk_rule().lower(*inputs).as_text())
    assert fp32_dots_at(forward, "DEFAULT") == 0 and fp32_dots_at(forward, "HIGHEST") >= 20, forward
    assert forward[("DEFAULT", "bf16", "bf16")] >= 6 and not forward[("HIGHEST", "bf16", "bf16")], forward
    backward = dots(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*inputs).as_text())
    # the inverse's dots and their transposes
    assert fp32_dots_at(backward, "HIGHEST") >= 2 * fp32_dots_at(forward, "HIGHEST"), backward


def test_decode_update_and_reference_recurrence_dots_are_highest():
    q, k, v, g, beta = random_inputs(2, seq_len=3, dk=32, dv=16)
    state = jnp.zeros((q.shape[0], v.shape[2], q.shape[3], v.shape[3]), jnp.float32)
    step = dots(jax.jit(gated_delta.gated_delta_decode_step).lower(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                                                   state).as_text())
    recurrence = dots(jax.jit(gated_delta.recurrent_gated_delta_rule).lower(q, k, v, g, beta).as_text())
    for found in (step, recurrence):
        assert fp32_dots_at(found, "HIGHEST") > 0 and fp32_dots_at(found, "DEFAULT") == 0, found


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU ignores the precision of fp32 dots; a GPU "
                    "may not (that is the point of HIGHEST)")
def test_fp32_output_is_unchanged_on_cpu_and_still_the_float64_recurrence(monkeypatch):
    inputs = random_inputs(3, seq_len=150, dk=32, dv=16)
    highest = chunk_rule()(*inputs)
    highest_grad = jax.jit(jax.grad(loss))(*inputs)
    monkeypatch.setattr(gated_delta, "FP32_PRECISION", jax.lax.Precision.DEFAULT)
    default_fn = chunk_rule()
    assert fp32_dots_at(dots(default_fn.lower(*inputs).as_text()), "HIGHEST") == 0  # the patch took effect
    default = default_fn(*inputs)
    for a, b in zip(highest, default):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(highest_grad), np.asarray(jax.jit(jax.grad(loss))(*inputs)))
    ref_out, ref_state = numpy_recurrence(*inputs)  # the bound of tests/test_qwen35_cache.py
    np.testing.assert_allclose(np.asarray(highest[0]), ref_out, atol=5e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(highest[1]), ref_state, atol=5e-5, rtol=1e-4)
