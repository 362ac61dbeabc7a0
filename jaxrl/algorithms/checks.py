"""What the checks of objective plug-ins share (the DPO loss, advantage and KL validators in their modules).

A plug-in is run on small, well-behaved example inputs eagerly, under ``jax.jit`` and (for losses) under
``jax.grad``; a wrong signature, a wrong output shape or dtype, NaN/inf, or an exception raises PluginError
naming the plug-in, the expected signature and what went wrong, before any model is loaded.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.utils.registry import PluginError


def check_signature(label: str, fn: Callable, expected: str, n_args: int) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins / C functions: let the call decide
    try:
        sig.bind(*([None] * n_args))
    except TypeError as e:
        raise PluginError(f"{label}: wrong signature {sig}; expected {expected} ({e})") from None


def call(label: str, expected: str, how: str, fn: Callable, *args):
    try:
        return fn(*args)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001
        hint = ""
        if "jit" in how or "grad" in how:
            hint = (" Training runs it inside jax.jit and jax.grad: use jnp operations, no Python if/float() on "
                    "array values (jnp.where instead).")
        raise PluginError(
            f"{label}: raised {type(e).__name__} when called {how} on example inputs; expected {expected}.{hint} "
            f"Error: {e}"
        ) from e


def check_output(label: str, expected: str, how: str, out: Any, shape: tuple[int, ...]) -> None:
    try:
        arr = np.asarray(out)
    except Exception as e:  # noqa: BLE001
        raise PluginError(f"{label}: returned {type(out).__name__} {how}, not an array; expected {expected}") from e
    if arr.shape != tuple(shape):
        what = "a scalar" if arr.ndim == 0 else f"shape {arr.shape}"
        raise PluginError(f"{label}: returned {what} {how}; expected shape {tuple(shape)} from {expected}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise PluginError(f"{label}: returned dtype {arr.dtype} {how}; expected a floating array from {expected}")
    if not np.all(np.isfinite(arr)):
        bad = int(np.sum(~np.isfinite(arr)))
        raise PluginError(
            f"{label}: returned {bad} non-finite value(s) (NaN/inf) {how} on well-behaved example inputs: {arr}; "
            f"expected {expected}"
        )


def run_checks(label: str, expected: str, fn: Callable, args: tuple, shape: tuple[int, ...],
               grad_argnums: Optional[tuple[int, ...]] = None) -> None:
    """`fn(*args)` eagerly and under jax.jit must give a finite float array of `shape`; with `grad_argnums`
    the gradient of its sum with respect to those arguments must be finite too."""
    out = call(label, expected, "eagerly", fn, *args)
    check_output(label, expected, "eagerly", out, shape)
    out_jit = call(label, expected, "under jax.jit", jax.jit(lambda *a: fn(*a)), *args)
    check_output(label, expected, "under jax.jit", out_jit, shape)
    if grad_argnums is not None:
        g = call(label, expected, "under jax.grad", jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=grad_argnums),
                 *args)
        for leaf in jax.tree_util.tree_leaves(g):
            check_output(label, expected, "as a gradient (jax.grad of its sum)", leaf, leaf.shape)
