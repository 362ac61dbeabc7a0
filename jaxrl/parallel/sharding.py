"""Partition rules for every Qwen3.5 weight on a (data, fsdp, tensor) mesh.

Rules are regexes over HF-style parameter names (the NNX path joined with "."), matched in order; the first
match gives a PartitionSpec per dimension. The scheme:
  * tensor parallel over heads and the MLP inner dim: column-parallel for projections that produce heads /
    inner features (q/k/v, in_proj_*, gate/up), row-parallel for the projections that consume them
    (o_proj, out_proj, down_proj);
  * FSDP over the other (hidden) dimension of each matrix;
  * vectors (norms, A_log, dt_bias) are replicated; the conv is split over its channels like in_proj_qkv.
A dimension is only sharded when the mesh axis size divides it; otherwise that dimension falls back to
replication, so tiny test models and odd head counts still run on any mesh.

Training (jaxrl.train): the trainable LoRA factors follow the rules above, the optimizer state mirrors the
parameter it belongs to (`train_state_shardings`), scalars are replicated, and a global batch split into
micro-batches `[n_micro, micro_batch_size, ...]` is sharded over data x fsdp on its second dimension
(`micro_batch_sharding`).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl.utils.tree import dotted

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)

# (pattern, spec for the weight's dims). Linear weights are [out, in].
PARAM_RULES: Sequence[tuple[str, tuple]] = (
    (r"embed_tokens$", (TENSOR, FSDP)),  # [V, H]: vocab over tensor, hidden over fsdp
    (r"lm_head\.weight$", (TENSOR, FSDP)),  # [V, H]
    (r"(q_proj|k_proj|v_proj|in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|gate_proj|up_proj)\.weight$",
     (TENSOR, FSDP)),  # column parallel
    (r"(o_proj|out_proj|down_proj)\.weight$", (FSDP, TENSOR)),  # row parallel
    (r"(q_proj|k_proj|v_proj|o_proj)\.bias$", (TENSOR,)),
    (r"conv1d$", (TENSOR, None, None)),  # [C, 1, K]
    # LoRA factors, PEFT layout: A [r, in], B [out, r]. Tiny; shard the big side like its base weight.
    (r"(o_proj|out_proj|down_proj)\.lora\.lora_A$", (None, TENSOR)),
    (r"(o_proj|out_proj|down_proj)\.lora\.lora_B$", (FSDP, None)),
    (r"\.lora\.lora_A$", (None, FSDP)),
    (r"\.lora\.lora_B$", (TENSOR, None)),
    (r".*", ()),  # everything else (norms, A_log, dt_bias, value head) replicated
)


def make_mesh(shape: Sequence[int], devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A (data, fsdp, tensor) mesh; -1 in one position takes the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    shape = list(shape)
    if len(shape) != 3:
        raise ValueError(f"mesh shape must have 3 entries (data, fsdp, tensor), got {shape}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one -1")
    if -1 in shape:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        shape[shape.index(-1)] = len(devices) // known
    total = shape[0] * shape[1] * shape[2]
    if total != len(devices):
        raise ValueError(f"mesh shape {tuple(shape)} needs {total} devices; {len(devices)} are available")
    import numpy as np
    return Mesh(np.array(devices).reshape(shape), MESH_AXES)


def partition_spec(name: str, shape: Sequence[int], mesh: Optional[Mesh] = None) -> P:
    """PartitionSpec for the parameter `name` of `shape`, dropping axes that do not divide the dimension."""
    for pattern, spec in PARAM_RULES:
        if re.search(pattern, name):
            break
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    spec = spec[:len(shape)]
    if mesh is not None:
        spec = tuple(axis if axis is None or shape[d] % mesh.shape[axis] == 0 else None
                     for d, axis in enumerate(spec))
    return P(*spec)


def named_sharding(name: str, shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(name, shape, mesh))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Batches are split over data x fsdp on their first dimension."""
    return NamedSharding(mesh, P((DATA, FSDP), *([None] * (ndim - 1))))


# ----------------------------------------------------------------------------------------------------------------
# Training: whole pytrees of shardings.

def batch_shards(mesh: Mesh) -> int:
    """How many ways a batch dimension is split (data x fsdp)."""
    return mesh.shape[DATA] * mesh.shape[FSDP]


def micro_batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """[n_micro, micro_batch_size, ...]: micro-batches are scanned in sequence, each split over data x fsdp."""
    if ndim < 2:
        raise ValueError(f"a split batch leaf needs >= 2 dims [n_micro, micro_batch_size, ...], got ndim={ndim}")
    return NamedSharding(mesh, P(None, (DATA, FSDP), *([None] * (ndim - 2))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def nnx_state_shardings(state, mesh: Mesh):
    """The same pytree as `state` (an nnx.State or a {name: array} dict), every leaf a NamedSharding from the
    rules, by the leaf's dotted name."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: named_sharding(dotted(path), getattr(x, "shape", ()), mesh), state)


def train_state_shardings(state, mesh: Mesh):
    """Shardings for a `jaxrl.train.state.TrainState`: `params[name]` by the rules; every optimizer-state leaf
    that sits under a parameter name (Adam's mu/nu) like that parameter; everything else replicated."""
    names = set(state.params)

    def leaf(path, x):
        shape = getattr(x, "shape", ())
        for entry in path:
            key = getattr(entry, "key", None)
            if isinstance(key, str) and key in names:
                return named_sharding(key, shape, mesh)
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(leaf, state)
