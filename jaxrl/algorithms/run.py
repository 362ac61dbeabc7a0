"""A training run from a config: model + LoRA + the algorithm's task -> the Trainer (what launchers.train runs).

    result = run_training(config, workdir)       # resumes from workdir by itself
    resolve_config(config)                       # in place: every missing key at its default, typos refused
    model = build_model(config, mesh)            # the base model of `model_path` / `model_preset`, LoRA attached

Order: the config is resolved first (jaxrl.utils.schema: a config not built on configs/base.py gets the same
defaults; an unknown key in any block is an error naming it and the nearest valid one), then the plug-ins (a
broken user objective fails before any model or data work), the mesh, the micro-batch fitted to it, the model,
the task (`config.algorithm`, jaxrl.algorithms.tasks), the Trainer. The resolved config is the run's
config.json.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import jax.numpy as jnp
from absl import logging

from jaxrl.algorithms.plugins import load_config_plugins
from jaxrl.algorithms.tasks import get_trainer
from jaxrl.models import qwen35
from jaxrl.models.lora import apply_lora_from_config
from jaxrl.models.qwen35.init import init_model_jit
from jaxrl.parallel.mesh import mesh_from_config
from jaxrl.rewards import REWARDS
from jaxrl.train.loop import RunResult, Trainer, check_run_config, check_same_run
from jaxrl.utils import schema
from jaxrl.utils.config import to_plain, unknown_key_error


def resolve_config(config, factory=None):
    """Fill `config` in place from the schema of its algorithm (the blocks `factory.config_blocks` declares for
    a trainer of your own) and check every key, the reward's constructor arguments and the model overrides;
    returns it. ConfigKeyError naming the key (and the nearest valid one) otherwise."""
    schema.resolve(config, getattr(factory, "config_blocks", None))
    _check_reward_arguments(config)
    _check_model_overrides(config)
    return config


def _check_reward_arguments(config) -> None:
    """The keys of `reward` beyond name / score are the reward's constructor arguments: each must be one."""
    block = config.get("reward", None)
    if block is None or block.get("name", None) is None or ":" in block["name"]:
        return  # user code named by module:attr: its constructor decides
    extras = schema.REWARD.extras(block)
    if not extras or block["name"] not in REWARDS:
        return  # an unknown name is reported where the reward is made (with the registered names)
    try:
        params = inspect.signature(REWARDS.get(block["name"])).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key in extras:
        if key not in params:
            raise unknown_key_error("reward", key, list(schema.REWARD.keys) + list(params))


def _check_model_overrides(config) -> None:
    fields = [f.name for f in dataclasses.fields(qwen35.Qwen35Config)]
    for key in to_plain(config.get("model_overrides", None)) or {}:
        if key not in fields:
            raise unknown_key_error("model_overrides", key, fields)


def build_model(config, mesh=None):
    """The base model from `model_path` (HF folder) or `model_preset` (+ `model_overrides`, random init with
    `model_seed`), in `dtype`, with `remat` and the compute settings (qwen35.COMPUTE_FIELDS); then LoRA from `config.lora` (A drawn with `seed`)."""
    schema.CORE.resolve(config, strict=False)
    dtype = jnp.dtype(config.dtype)
    remat = config.remat
    path = config.model_path
    if path:
        model = qwen35.from_pretrained(path, dtype=dtype, mesh=mesh, remat=remat)
    else:
        preset = config.model_preset
        if preset not in qwen35.PRESETS:
            raise ValueError(f"model_path is empty and model_preset={preset!r}; set model_path to an HF folder or "
                             f"model_preset to one of {sorted(qwen35.PRESETS)}")
        overrides = to_plain(config.model_overrides) or {}
        if "layer_types" in overrides:
            overrides["layer_types"] = tuple(overrides["layer_types"])
        try:
            model_cfg = dataclasses.replace(qwen35.PRESETS[preset](), **overrides)
        except TypeError as e:
            raise ValueError(f"model_overrides={overrides}: {e}") from e
        model = init_model_jit(model_cfg, dtype, int(config.model_seed), remat, mesh)
    model.set_compute(**{k: config[k] for k in qwen35.COMPUTE_FIELDS})
    report = apply_lora_from_config(model, config.lora, seed=int(config.seed))
    logging.info("LoRA on %d modules (%s): %d trainable of %d parameters", len(report["modules"]),
                 ", ".join(f"{k} x{v}" for k, v in report["by_name"].items()), report["trainable_params"],
                 report["total_params"])
    return model


def fit_micro_batch_to_mesh(config, mesh) -> bool:
    """Make batch.micro_batch_size a multiple of the data-parallel size (data x fsdp), keeping the global batch.

    The users' runs use micro-batch 1 with accumulation 8 (a memory setting on their machine); on 8 devices a
    micro-batch of 1 cannot be split. The update does not depend on the split (token-weighted accumulation,
    tested) for every loss except those that couple the pairs of a micro-batch (dpo aot / aot_unpaired: their
    check runs on the fitted sizes and warns), so the smallest micro-batch that divides over the mesh and the global batch is taken instead, with
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
                    "accumulation %d (the same %d rows per update)", mb, dp,
                    fitted, total // fitted, total)
    config.batch.micro_batch_size, config.batch.grad_accum = fitted, total // fitted
    return True


def run_training(config, workdir: str, *, mesh=None, **trainer_kwargs) -> RunResult:
    """Build the model and the algorithm's task from the config and run (resuming from the workdir)."""
    factory = get_trainer(config.get("algorithm", None) or schema.TOP["algorithm"].default)
    resolve_config(config, factory)
    check_run_config(config)  # step counts, batch split, optimizer: a bad value fails before any model is built
    check_same_run(config, workdir)  # a workdir holding a run of another shape: refused before any work too
    load_config_plugins(config)  # `plugins`: user objectives checked before any model or data work (fail fast)
    mesh = mesh if mesh is not None else mesh_from_config(config)
    fit_micro_batch_to_mesh(config, mesh)
    model = build_model(config, mesh)
    task = factory(config, model, mesh)
    return Trainer(config, model, task, workdir, mesh=mesh, **trainer_kwargs).run()
