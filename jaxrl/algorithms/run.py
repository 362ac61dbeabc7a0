"""A training run from a config: model + LoRA + the algorithm's task -> the Trainer (what launchers.train runs).

    result = run_training(config, workdir)       # resumes from workdir by itself
    model = build_model(config, mesh)            # the base model of `model_path` / `model_preset`, LoRA attached

Order: plug-ins first (a broken user objective fails before any model or data work), then the mesh, the
micro-batch fitted to it, the model, the task (`config.algorithm`, jaxrl.algorithms.trainers), the Trainer.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from absl import logging

from jaxrl.algorithms.plugins import load_config_plugins
from jaxrl.algorithms.trainers import get_trainer
from jaxrl.models import qwen35
from jaxrl.models.lora import apply_lora_from_config
from jaxrl.models.qwen35.init import init_model_jit
from jaxrl.parallel.mesh import mesh_from_config
from jaxrl.train.loop import RunResult, Trainer


def build_model(config, mesh=None):
    """The base model from `model_path` (HF folder) or `model_preset` (+ `model_overrides`, random init with
    `model_seed`), in `dtype`, with `remat`; then LoRA from `config.lora` (A drawn with `seed`)."""
    dtype = jnp.dtype(config.get("dtype", "float32"))
    remat = config.get("remat", "none")
    path = config.get("model_path", "")
    if path:
        model = qwen35.from_pretrained(path, dtype=dtype, mesh=mesh, remat=remat)
    else:
        preset = config.get("model_preset", "")
        if preset not in qwen35.PRESETS:
            raise ValueError(f"model_path is empty and model_preset={preset!r}; set model_path to an HF folder or "
                             f"model_preset to one of {sorted(qwen35.PRESETS)}")
        overrides = config.get("model_overrides", None) or {}
        overrides = overrides.to_dict() if hasattr(overrides, "to_dict") else dict(overrides)
        if "layer_types" in overrides:
            overrides["layer_types"] = tuple(overrides["layer_types"])
        try:
            model_cfg = dataclasses.replace(qwen35.PRESETS[preset](), **overrides)
        except TypeError as e:
            raise ValueError(f"model_overrides={overrides}: {e}") from e
        model = init_model_jit(model_cfg, dtype, int(config.get("model_seed", 0)), remat, mesh)
    report = apply_lora_from_config(model, config.lora, seed=int(config.seed))
    logging.info("LoRA on %d modules (%s): %d trainable of %d parameters", len(report["modules"]),
                 ", ".join(f"{k} x{v}" for k, v in report["by_name"].items()), report["trainable_params"],
                 report["total_params"])
    return model


def fit_micro_batch_to_mesh(config, mesh) -> bool:
    """Make batch.micro_batch_size a multiple of the data-parallel size (data x fsdp), keeping the global batch.

    The users' runs use micro-batch 1 with accumulation 8 (a memory setting on their machine); on 8 devices a
    micro-batch of 1 cannot be split. The update does not depend on the split (token-weighted accumulation,
    tested), so the smallest micro-batch that divides over the mesh and the global batch is taken instead, with
    a warning; the resolved config.json records it. Returns whether it changed anything; raises when no split
    fits (the global batch is not a multiple of data x fsdp).
    """
    dp = int(mesh.shape.get("data", 1)) * int(mesh.shape.get("fsdp", 1))
    mb, accum = int(config.batch.micro_batch_size), int(config.batch.grad_accum)
    if mb <= 0 or accum <= 0 or mb % dp == 0:
        return False
    total = mb * accum
    fitted = math.lcm(mb, dp)
    if total % fitted:
        raise ValueError(f"batch.micro_batch_size={mb} x batch.grad_accum={accum} = {total} rows per step cannot be "
                         f"split over data x fsdp = {dp} devices (mesh {dict(mesh.shape)}); make the global batch a "
                         f"multiple of {dp}, or change mesh.shape")
    logging.warning("batch.micro_batch_size=%d does not divide over data x fsdp = %d devices: using micro-batch %d x "
                    "accumulation %d (the same %d rows per update; the update does not depend on the split)", mb, dp,
                    fitted, total // fitted, total)
    config.batch.micro_batch_size, config.batch.grad_accum = fitted, total // fitted
    return True


def run_training(config, workdir: str, *, mesh=None, **trainer_kwargs) -> RunResult:
    """Build the model and the algorithm's task from the config and run (resuming from the workdir)."""
    load_config_plugins(config)  # `plugins`: user objectives checked before any model or data work (fail fast)
    mesh = mesh if mesh is not None else mesh_from_config(config)
    fit_micro_batch_to_mesh(config, mesh)
    model = build_model(config, mesh)
    task = get_trainer(config.algorithm)(config, model, mesh)
    return Trainer(config, model, task, workdir, mesh=mesh, **trainer_kwargs).run()
