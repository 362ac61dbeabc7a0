"""Where the engine's arrays live and how its programs take the weights: rows split over the mesh's data x fsdp
axes, parameters placed by the sharding rules, and the weights of a call as one hashed structure plus a flat list
of arrays.

    weights = Weights.of(model, params, mesh)     # params: None (the model's current weights), a State, a tuple
    model = weights.structure.merge(weights.leaves)   # inside a program
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl.parallel.mesh import DATA, FSDP
from jaxrl.parallel.sharding import partition_spec
from jaxrl.utils.tree import dotted


def data_parallel_size(mesh: Optional[Mesh]) -> int:
    """Rows a program's batch is split into: data x fsdp of the mesh (1 without one)."""
    return 1 if mesh is None else mesh.shape[DATA] * mesh.shape[FSDP]


def _row_spec(ndim: int) -> P:
    return P((DATA, FSDP), *([None] * (ndim - 1)))


def constrain_rows(tree, mesh: Optional[Mesh]):
    """Puts the leading (row) dimension of every array leaf on data x fsdp; scalars stay replicated."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, _row_spec(x.ndim) if x.ndim else P())), tree)


def replicate_rows(tree, mesh: Optional[Mesh]):
    """Every leaf on every device of the mesh: what the host reads back. Rows were computed where they were
    sharded; gathering the few outputs lets every process read all of them (a mesh over several processes has
    devices no single process can fetch from)."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())), tree)


def shard_params(params, mesh: Mesh):
    """Places every parameter leaf by the partition rules (a no-op for leaves already placed that way)."""
    def put(path, x):
        return jax.device_put(x, NamedSharding(mesh, partition_spec(dotted(path), x.shape, mesh)))
    return jax.tree_util.tree_map_with_path(put, params)


class Structure:
    """A model's graph and its weights' tree structure, as the engine's programs take them: one static argument
    hashed once (a GraphDef hashes its whole module tree on every call, a dispatch's largest cost on a small
    model), with the weights passed as a flat list of arrays (flattening an nnx.State on every call costs several
    times the rest of a dispatch). Interned (`of`): equal structures are one object, so the programs' caches
    find their key by identity instead of comparing two module trees on every call."""

    _interned: dict = {}

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    @classmethod
    def of(cls, graphdef, treedef) -> "Structure":
        new = cls(graphdef, treedef)
        for old in cls._interned.setdefault(new._hash, []):
            if old == new:
                return old
        cls._interned[new._hash].append(new)
        return new

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Structure) and self._hash == other._hash
                                 and self.graphdef == other.graphdef and self.treedef == other.treedef)

    def merge(self, leaves: list) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


@dataclasses.dataclass(frozen=True)
class Weights:
    """The weights one engine generates with: the model's *current* structure (`with lora.adapters_disabled(model)`
    samples the base policy, a different graph compiled once; adapters attached after construction work) and its
    parameters, placed on the mesh when there is one."""

    structure: Structure
    leaves: list

    @classmethod
    def of(cls, model: nnx.Module, params=None, mesh: Optional[Mesh] = None) -> "Weights":
        """params: None (the model's current weights), an nnx.State, or a tuple of States from a filtered
        nnx.split (merged into one State, so every caller has the same pytree structure and one program)."""
        graphdef = nnx.graphdef(model)
        if params is None:
            params = nnx.state(model)
        elif isinstance(params, tuple):
            params = nnx.merge_state(*params)
        if mesh is not None:
            params = shard_params(params, mesh)
        leaves, treedef = jax.tree.flatten(params)
        return cls(Structure.of(graphdef, treedef), leaves)
