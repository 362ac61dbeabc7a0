"""Base-model parameters as an Orbax checkpoint (for clusters that restore sharded params faster than they parse
safetensors), and back to an HF folder.

Layout of an Orbax params folder:
    params/            Orbax StandardCheckpointer tree of every base weight, keyed by parameter name
    jaxrl_model.json   {"config": Qwen35Config dict, "dtype": "bfloat16", "hf_source": path or null}
"""

from __future__ import annotations

import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from jaxrl.models.qwen35.checkpoint import CheckpointError, base_params
from jaxrl.models.qwen35.config import Qwen35Config
from jaxrl.models.qwen35.model import Qwen35
from jaxrl.parallel.sharding import named_sharding
from jaxrl.utils.io import atomic_write_text

META_FILE = "jaxrl_model.json"


def save_orbax_params(model: Qwen35, out_dir: str, hf_source: Optional[str] = None) -> str:
    out_dir = os.path.abspath(out_dir)
    params_dir = os.path.join(out_dir, "params")
    if os.path.exists(params_dir):
        raise CheckpointError(f"{params_dir} already exists; choose an empty --out")
    os.makedirs(out_dir, exist_ok=True)
    tree = {name: var[...] for name, var in base_params(model)}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(params_dir, tree)  # Orbax writes to a temp folder and renames: atomic
    checkpointer.wait_until_finished()
    meta = {"config": model.config.to_dict(), "dtype": jnp.dtype(model.dtype).name, "hf_source": hf_source}
    atomic_write_text(os.path.join(out_dir, META_FILE), json.dumps(meta, indent=2))
    return out_dir


def load_orbax_params(folder: str, dtype=None, mesh: Optional[jax.sharding.Mesh] = None) -> Qwen35:
    folder = os.path.abspath(folder)
    meta_path = os.path.join(folder, META_FILE)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{folder}: no {META_FILE}; not a jaxrl Orbax params folder")
    with open(meta_path) as f:
        meta = json.load(f)
    cfg = Qwen35Config.from_dict(meta["config"])
    dtype = dtype or jnp.dtype(meta["dtype"])
    abstract_model = nnx.eval_shape(lambda: Qwen35(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract_model)
    targets = {}
    for name, var in base_params(abstract_model):
        sharding = None
        if mesh is not None:
            sharding = named_sharding(name, var.shape, mesh)
        targets[name] = jax.ShapeDtypeStruct(var.shape, dtype, sharding=sharding)
    restored = ocp.StandardCheckpointer().restore(os.path.join(folder, "params"), targets)
    flat = dict(nnx.to_flat_state(state))
    for name, value in restored.items():
        flat[tuple(int(p) if p.isdigit() else p for p in name.split("."))].set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
