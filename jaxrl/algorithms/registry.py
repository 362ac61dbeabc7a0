"""Named registries of objective pieces, and user plug-ins that are checked before training starts.

Kinds known here (more can be declared with :func:`register_kind`, e.g. by ``jaxrl.rewards``):

=============  ==========================================================  ==========================
kind           signature a function of this kind must have                 output
=============  ==========================================================  ==========================
``dpo_loss``   ``fn(p: jaxrl.algorithms.dpo.PairInputs) -> Array``          per-pair losses ``[B]``
``advantage``  ``fn(rewards: Array[N], num_generations: int) -> Array``     advantages ``[N]``
``kl``         ``fn(logp: Array[B, T], ref_logp: Array[B, T]) -> Array``    per-token KL ``[B, T]``
``reward``     declared by ``jaxrl.rewards`` (no check here)                -
=============  ==========================================================  ==========================

``register(kind, name)(fn)`` adds a function, ``get(kind, name)`` returns it, ``names(kind)`` lists them.
Built-in entries live in their algorithm modules and are imported on first use of a kind, so that importing this
module stays cheap (no jax import here; the checks import it lazily).

``load_plugin("path/to/file.py:fn" | "package.module:fn", kind=..., name=None)`` imports a user's function,
runs it once (eagerly, under ``jax.jit``, and, for losses, under ``jax.grad``) on small random inputs of the
kind's shapes, and only then registers it. Anything wrong -- an import error, a wrong signature, a scalar where
``[B]`` was due, NaN/inf, a Python ``if`` on a traced value -- raises :class:`PluginError` naming the plug-in, the
expected signature and what went wrong, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

__all__ = [
    "PluginError",
    "register_kind",
    "register",
    "get",
    "names",
    "unregister",
    "kinds",
    "load_plugin",
    "validate",
]


class PluginError(ValueError):
    """A plug-in could not be imported, or failed its check on example inputs."""


@dataclasses.dataclass
class _Kind:
    signature: str  # human-readable expected signature, quoted in errors
    validate: Callable[[str, Callable], None] | None  # raises PluginError
    builtins_module: str | None  # imported on first use so that built-ins are registered
    entries: dict[str, Callable] = dataclasses.field(default_factory=dict)
    origins: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> where it came from
    builtins_loaded: bool = False


_KINDS: dict[str, _Kind] = {}


def register_kind(
    kind: str,
    *,
    signature: str,
    validate: Callable[[str, Callable], None] | None = None,
    builtins_module: str | None = None,
) -> None:
    """Declare a registry kind (idempotent; a later call updates the signature / check / built-ins module).

    ``validate(label, fn)`` must raise :class:`PluginError` when ``fn`` is unfit; ``label`` names the plug-in.
    """
    if kind in _KINDS:
        k = _KINDS[kind]
        k.signature, k.validate = signature, validate or k.validate
        if builtins_module is not None and builtins_module != k.builtins_module:
            k.builtins_module, k.builtins_loaded = builtins_module, False
        return
    _KINDS[kind] = _Kind(signature=signature, validate=validate, builtins_module=builtins_module)


def kinds() -> tuple[str, ...]:
    return tuple(sorted(_KINDS))


def _kind(kind: str) -> _Kind:
    try:
        k = _KINDS[kind]
    except KeyError:
        raise KeyError(f"unknown registry kind {kind!r}; known kinds: {', '.join(kinds())}") from None
    if not k.builtins_loaded and k.builtins_module is not None:
        # Mark first: the module registers into this kind while being imported.
        k.builtins_loaded = True
        importlib.import_module(k.builtins_module)
    return k


def _origin_of(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def register(kind: str, name: str, *, overwrite: bool = False, origin: str | None = None):
    """Decorator: ``@register("dpo_loss", "my_loss")`` adds ``fn`` under ``name`` and returns it unchanged.

    Re-registering a name is an error unless ``overwrite=True`` or the function comes from the same place (a
    module imported twice, a plug-in loaded again on resume).
    """
    # Load the built-ins first, so a user's name cannot silently pre-empt one (the built-in would then fail).
    k = _kind(kind)

    def deco(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"{kind} {name!r}: {fn!r} is not callable")
        where = origin or _origin_of(fn)
        if name in k.entries and not overwrite and k.origins.get(name) != where:
            raise KeyError(
                f"{kind} {name!r} is already registered (from {k.origins[name]}); pick another name or pass "
                f"overwrite=True"
            )
        k.entries[name] = fn
        k.origins[name] = where
        return fn

    return deco


def get(kind: str, name: str) -> Callable:
    """The function registered as ``name`` for ``kind``; a KeyError lists what exists."""
    k = _kind(kind)
    try:
        return k.entries[name]
    except KeyError:
        raise KeyError(
            f"unknown {kind} {name!r}; registered: {', '.join(sorted(k.entries)) or '(none)'}. A function of your "
            f"own can be added with jaxrl.algorithms.registry.load_plugin('file.py:fn', kind={kind!r})"
        ) from None


def names(kind: str) -> tuple[str, ...]:
    return tuple(sorted(_kind(kind).entries))


def unregister(kind: str, name: str) -> None:
    """Remove ``name`` from ``kind`` (no error if absent); for tests and interactive sessions."""
    k = _kind(kind)
    k.entries.pop(name, None)
    k.origins.pop(name, None)


# ------------------------------------------------------------------------------------------------- plug-ins


def _import_plugin(spec: str) -> Callable:
    if ":" not in spec:
        raise PluginError(f"plug-in {spec!r}: expected 'path/to/file.py:function' or 'package.module:function'")
    target, attr = spec.rsplit(":", 1)
    if not attr.isidentifier():
        raise PluginError(f"plug-in {spec!r}: {attr!r} is not a function name")
    is_file = target.endswith(".py") or os.sep in target or "/" in target
    try:
        if is_file:
            path = os.path.abspath(os.path.expanduser(target))
            if not os.path.isfile(path):
                raise PluginError(f"plug-in {spec!r}: file {path} does not exist")
            # A stable, unique module name per file, kept in sys.modules so the plug-in's own dataclasses,
            # pickling and relative look-ups work, and a re-load (resume) replaces rather than duplicates it.
            digest = hashlib.sha1(path.encode()).hexdigest()[:10]
            modname = f"jaxrl_plugin_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
            mspec = importlib.util.spec_from_file_location(modname, path)
            if mspec is None or mspec.loader is None:
                raise PluginError(f"plug-in {spec!r}: cannot import {path}")
            module = importlib.util.module_from_spec(mspec)
            sys.modules[modname] = module
            try:
                mspec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(modname, None)
                raise
        else:
            module = importlib.import_module(target)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the plug-in named
        raise PluginError(f"plug-in {spec!r}: importing {target} failed: {type(e).__name__}: {e}") from e
    try:
        fn = getattr(module, attr)
    except AttributeError:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise PluginError(f"plug-in {spec!r}: {target} defines no {attr!r}; it has: {', '.join(public)}") from None
    if not callable(fn):
        raise PluginError(f"plug-in {spec!r}: {attr} is a {type(fn).__name__}, not a function")
    return fn


def validate(kind: str, fn: Callable, label: str | None = None) -> None:
    """Run ``kind``'s check on ``fn`` (raises :class:`PluginError`); kinds without a check pass."""
    k = _kind(kind)
    if k.validate is not None:
        k.validate(label or _origin_of(fn), fn)


def load_plugin(
    spec: str, kind: str, name: str | None = None, *, overwrite: bool = False, check: bool = True
) -> Callable:
    """Import ``spec`` ("file.py:fn" or "pkg.mod:fn"), check it on example inputs, register it, return it.

    ``name`` defaults to the function's name. Loading the same spec again replaces the earlier entry; taking the
    name of a different function (e.g. a built-in) needs ``overwrite=True``.
    """
    k = _kind(kind)
    fn = _import_plugin(spec)
    name = name or getattr(fn, "__name__", None)
    if not name:
        raise PluginError(f"plug-in {spec!r}: give it a name (name=...)")
    label = f"{kind} plug-in {name!r} ({spec})"
    if name in k.entries and not overwrite and k.origins.get(name) != f"plugin:{spec}":
        raise PluginError(
            f"{label}: the name {name!r} is already taken by {k.origins[name]}; choose another name or pass "
            f"overwrite=True"
        )
    if check and k.validate is not None:
        k.validate(label, fn)
    register(kind, name, overwrite=True, origin=f"plugin:{spec}")(fn)
    return fn


# ------------------------------------------------------------------------------------------------- checks
# Shared helpers of the per-kind checks. jax and numpy are imported inside so this module stays light.


def _check_signature(label: str, fn: Callable, expected: str, n_args: int) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins / C functions: let the call decide
    try:
        sig.bind(*([None] * n_args))
    except TypeError as e:
        raise PluginError(f"{label}: wrong signature {sig}; expected {expected} ({e})") from None


def _call(label: str, expected: str, how: str, fn: Callable, *args):
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


def _check_output(label: str, expected: str, how: str, out: Any, shape: tuple[int, ...]) -> None:
    import numpy as np

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


def _run_checks(label, expected, fn, args, shape, grad_argnums=None):
    import jax
    import jax.numpy as jnp

    out = _call(label, expected, "eagerly", fn, *args)
    _check_output(label, expected, "eagerly", out, shape)
    out_jit = _call(label, expected, "under jax.jit", jax.jit(lambda *a: fn(*a)), *args)
    _check_output(label, expected, "under jax.jit", out_jit, shape)
    if grad_argnums is not None:
        g = _call(
            label, expected, "under jax.grad", jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=grad_argnums), *args
        )
        for leaf in jax.tree_util.tree_leaves(g):
            _check_output(label, expected, "as a gradient (jax.grad of its sum)", leaf, leaf.shape)


DPO_SIGNATURE = "fn(p: jaxrl.algorithms.dpo.PairInputs) -> per-pair losses, float array of shape [B]"
ADVANTAGE_SIGNATURE = "fn(rewards: float array [N], num_generations: int) -> advantages, float array [N]"
KL_SIGNATURE = "fn(logp: float array [B, T], ref_logp: float array [B, T]) -> per-token KL, float array [B, T]"


def _validate_dpo_loss(label: str, fn: Callable) -> None:
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.algorithms import dpo

    _check_signature(label, fn, DPO_SIGNATURE, 1)
    B = 3
    # Fixed, well-behaved example inputs (numpy: no jax.random compile on the start-up path).
    rng = np.random.default_rng(0)
    logps = [jnp.asarray(-20.0 + 5.0 * rng.standard_normal(B), jnp.float32) for _ in range(4)]
    lengths = jnp.array([3.0, 7.0, 12.0])
    p = dpo.make_pair_inputs(
        *logps, beta=0.1, label_smoothing=0.1, chosen_lengths=lengths, rejected_lengths=lengths + 2.0
    )

    # Differentiate through the log-probs, the way training does.
    def via_logps(cl, rl):
        q = dpo.make_pair_inputs(
            cl, rl, logps[2], logps[3], beta=0.1, label_smoothing=0.1, chosen_lengths=lengths,
            rejected_lengths=lengths + 2.0,
        )
        return fn(q)

    _run_checks(label, DPO_SIGNATURE, fn, (p,), (B,))
    _run_checks(label, DPO_SIGNATURE, via_logps, (logps[0], logps[1]), (B,), grad_argnums=(0, 1))


def _validate_advantage(label: str, fn: Callable) -> None:
    import jax.numpy as jnp

    _check_signature(label, fn, ADVANTAGE_SIGNATURE, 2)
    G, n_groups = 4, 3
    rewards = jnp.array([0.0, 1.0, 0.5, 1.0, 0.2, 0.2, 0.9, 0.0, 1.0, 0.0, 0.0, 0.25], jnp.float32)
    _run_checks(label, ADVANTAGE_SIGNATURE, lambda r: fn(r, G), (rewards,), (G * n_groups,))


def _validate_kl(label: str, fn: Callable) -> None:
    import jax.numpy as jnp
    import numpy as np

    _check_signature(label, fn, KL_SIGNATURE, 2)
    rng = np.random.default_rng(1)
    logp = -3.0 + rng.standard_normal((2, 5))
    ref = jnp.asarray(logp + 0.3 * rng.standard_normal((2, 5)), jnp.float32)
    logp = jnp.asarray(logp, jnp.float32)
    _run_checks(label, KL_SIGNATURE, fn, (logp, ref), (2, 5), grad_argnums=(0,))


register_kind("dpo_loss", signature=DPO_SIGNATURE, validate=_validate_dpo_loss,
              builtins_module="jaxrl.algorithms.dpo")
register_kind("advantage", signature=ADVANTAGE_SIGNATURE, validate=_validate_advantage,
              builtins_module="jaxrl.algorithms.grpo")
register_kind("kl", signature=KL_SIGNATURE, validate=_validate_kl, builtins_module="jaxrl.algorithms.kl")
# The reward registry's contents and check belong to jaxrl.rewards; it re-declares the kind with its own
# signature / validate / builtins_module.
register_kind("reward", signature="declared by jaxrl.rewards")
