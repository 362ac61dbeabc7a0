"""Dotted parameter names of pytree paths: the one naming shared by sharding rules, checkpoints, LoRA and export.

    dotted(path)      # ("layers", 0, "mlp") or a jax key path -> "layers.0.mlp"

A path is either a tuple of plain keys (what `nnx.to_flat_state` and `nnx.iter_modules` give) or a jax key path
(`jax.tree_util.tree_flatten_with_path`); inside an nnx.State the latter ends in the Variable's `.value`
attribute, which is not part of the name.
"""

from __future__ import annotations

from typing import Any, Iterable

from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

__all__ = ["dotted"]


def _part(entry: Any) -> str | None:
    if isinstance(entry, (DictKey, FlattenedIndexKey)):
        return str(entry.key)
    if isinstance(entry, SequenceKey):
        return str(entry.idx)
    if isinstance(entry, GetAttrKey):
        return None if entry.name == "value" else entry.name
    return str(entry)


def dotted(path: Iterable[Any]) -> str:
    """The dotted name of a pytree path (see the module docstring)."""
    return ".".join(p for p in (_part(e) for e in path) if p is not None)
