"""A projection whose backward stays in the operands' dtype: y = x W^T with fp32 accumulation.

    y = project(x, w, out_dtype)        # x [..., in], w [out, in] -> [..., out] in out_dtype

JAX's own gradient of `einsum(x, w, preferred_element_type=f32)` multiplies the fp32 cotangent with the bf16
weight: an fp32 x bf16 product, which a GPU runs in TF32 and XLA:CPU runs on an fp32 copy of the whole weight.
Here the cotangent is rounded to the operands' dtype first and both products (dx = dy W, dW = dy^T x) take
operands of that dtype with fp32 accumulation, as Liger's and cut-cross-entropy's fused losses do for the LM
head. With fp32 operands this is the plain fp32 gradient.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def project(x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _project_fwd(x, w, out_dtype):
    return project(x, w, out_dtype), (x, w)


def _project_bwd(out_dtype, residuals, d_y):
    x, w = residuals
    d_y = d_y.astype(jnp.result_type(x.dtype, w.dtype))
    d_x = jnp.einsum("...o,oi->...i", d_y, w, preferred_element_type=jnp.float32)
    d_w = jnp.einsum("...o,...i->oi", d_y, x, preferred_element_type=jnp.float32)
    return d_x.astype(x.dtype), d_w.astype(w.dtype)


project.defvjp(_project_fwd, _project_bwd)
