"""The kinds of user plug-in, by name: each is a `jaxrl.utils.registry.Registry` living with its built-ins.

=============  ==========================================================  ==========================
kind           signature a function of this kind must have                 output
=============  ==========================================================  ==========================
``dpo_loss``   ``fn(p: jaxrl.algorithms.dpo.PairInputs) -> Array``          per-pair losses ``[B]``
``advantage``  ``fn(rewards: Array[N], num_generations: int) -> Array``     advantages ``[N]``
``kl``         ``fn(logp: Array[B, T], ref_logp: Array[B, T]) -> Array``    per-token KL ``[B, T]``
``reward``     ``fn(completion, problem, **kw) -> bool | float | Result``   a score in [0, 1]
=============  ==========================================================  ==========================

``register(kind, name)(fn)`` adds a function, ``get(kind, name)`` returns it, ``names(kind)`` lists them.
The registries are imported on first use of a kind, so importing this module stays cheap (no jax).

``load_plugin("path/to/file.py:fn" | "package.module:fn", kind=..., name=None)`` imports a user's function,
runs it once (eagerly, under ``jax.jit``, and, for losses, under ``jax.grad``) on small inputs of the kind's
shapes, and only then registers it. Anything wrong -- an import error, a wrong signature, a scalar where ``[B]``
was due, NaN/inf, a Python ``if`` on a traced value -- raises :class:`PluginError` naming the plug-in, the
expected signature and what went wrong, before any model is loaded.
"""

from __future__ import annotations

from typing import Callable, Optional

from jaxrl.utils.registry import PluginError, Registry, resolve

__all__ = ["PluginError", "get", "kinds", "load_plugin", "names", "register", "registry_of", "unregister",
           "validate"]

# kind -> where its Registry lives ("module:attr", imported on first use).
HOMES = {
    "dpo_loss": "jaxrl.algorithms.dpo:LOSSES",
    "advantage": "jaxrl.algorithms.grpo:ADVANTAGES",
    "kl": "jaxrl.algorithms.kl:KL_ESTIMATORS",
    "reward": "jaxrl.rewards.registry:REWARDS",
}


def kinds() -> tuple[str, ...]:
    return tuple(sorted(HOMES))


def registry_of(kind: str) -> Registry:
    """The registry of plug-in kind `kind`."""
    if kind not in HOMES:
        raise KeyError(f"unknown registry kind {kind!r}; known kinds: {', '.join(kinds())}")
    return resolve(HOMES[kind], callable_only=False)


def register(kind: str, name: str, *, overwrite: bool = False, origin: Optional[str] = None) -> Callable:
    """Decorator: ``@register("dpo_loss", "my_loss")`` adds ``fn`` under ``name`` and returns it unchanged."""
    return registry_of(kind).register(name, overwrite=overwrite, origin=origin)


def get(kind: str, name: str) -> Callable:
    return registry_of(kind).get(name)


def names(kind: str) -> tuple[str, ...]:
    return registry_of(kind).names()


def unregister(kind: str, name: str) -> None:
    registry_of(kind).unregister(name)


def validate(kind: str, fn: Callable, label: Optional[str] = None) -> None:
    """Run the kind's check on ``fn`` (raises :class:`PluginError`)."""
    registry_of(kind).validate(fn, label)


def load_plugin(spec: str, kind: str, name: Optional[str] = None, *, overwrite: bool = False,
                check: bool = True) -> Callable:
    """Import ``spec`` ("file.py:fn" or "pkg.mod:fn"), check it on example inputs, register it, return it.

    ``name`` defaults to the function's name. Loading the same spec again replaces the earlier entry; taking the
    name of a different function (e.g. a built-in) needs ``overwrite=True``.
    """
    return registry_of(kind).load(spec, name, overwrite=overwrite, check=check)
