"""Partition rules for every Qwen3.5 weight on a (data, fsdp, tensor) mesh.

Rules are regexes over HF-style parameter names (the NNX path joined with "."), matched in order; the first
match gives a PartitionSpec per dimension. The scheme:
  * tensor parallel over heads and the MLP inner dim: column-parallel for projections that produce heads /
    inner features (q/k/v, in_proj_*, gate/up), row-parallel for the projections that consume them
    (o_proj, out_proj, down_proj);
  * FSDP over the other (hidden) dimension of each matrix;
  * vectors (norms, A_log, dt_bias) are replicated; the conv is split over its channels like in_proj_qkv.
A dimension is only sharded when the mesh axis size divides it; otherwise that dimension falls back to
replication, so tiny test models and odd head counts still run on any mesh. Every placement helper takes
the rules table as `rules=` (default: `PARAM_RULES`, the table of the one model family here).

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

from jaxrl.parallel.mesh import DATA, FSDP, TENSOR
from jaxrl.utils.tree import dotted

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


Rules = Sequence[tuple[str, tuple]]


def partition_spec(name: str, shape: Sequence[int], mesh: Optional[Mesh] = None, rules: Rules = PARAM_RULES) -> P:
    """PartitionSpec for the parameter `name` of `shape`, dropping axes that do not divide the dimension."""
    spec = ()
    for pattern, spec in rules:
        if re.search(pattern, name):
            break
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    spec = spec[:len(shape)]
    if mesh is not None:
        spec = tuple(axis if axis is None or shape[d] % mesh.shape[axis] == 0 else None
                     for d, axis in enumerate(spec))
    return P(*spec)


def named_sharding(name: str, shape: Sequence[int], mesh: Mesh, rules: Rules = PARAM_RULES) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(name, shape, mesh, rules))


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


def nnx_state_shardings(state, mesh: Mesh, rules: Rules = PARAM_RULES):
    """The same pytree as `state` (an nnx.State or a {name: array} dict), every leaf a NamedSharding from the
    rules, by the leaf's dotted name."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: named_sharding(dotted(path), getattr(x, "shape", ()), mesh, rules), state)


def train_state_shardings(state, mesh: Mesh, rules: Rules = PARAM_RULES):
    """Shardings for a `jaxrl.train.state.TrainState`: `params[name]` by the rules; every optimizer-state leaf
    that sits under a parameter name (Adam's mu/nu) like that parameter; everything else replicated."""
    names = set(state.params)

    def leaf(path, x):
        shape = getattr(x, "shape", ())
        for entry in path:
            key = getattr(entry, "key", None)
            if isinstance(key, str) and key in names:
                return named_sharding(key, shape, mesh, rules)
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(leaf, state)
