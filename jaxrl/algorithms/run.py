"""A training run from a config: model + LoRA + the algorithm's task -> the Trainer (what launchers.train runs).

    result = run_training(config, workdir)       # resumes from workdir by itself
    run_config = resolve_config(config)          # -> TrainConfig: every missing key at its default, typos refused
    model = build_model(run_config, mesh)        # the base model of `model_path` / `model_preset`, LoRA attached

Order: the config is resolved once, into a `TrainConfig` that everything below reads (jaxrl.algorithms.config:
a config not built on configs/base.py gets the same defaults; an unknown key in any block is an error naming it
and the nearest valid one; values are validated), then checked against the run already in the workdir, then the
plug-ins are loaded (a broken user objective fails before any model or data work), then the mesh, the micro-batch
fitted to it, the model, the task (`config.algorithm`, jaxrl.algorithms.tasks), the Trainer. The resolved config
is the run's config.json.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Mapping, Sequence

import jax.numpy as jnp
from absl import logging

from jaxrl.algorithms import plugins
from jaxrl.algorithms import config as run_config
from jaxrl.algorithms.config import TrainConfig
from jaxrl.algorithms.online.settings import AsyncSettings, OnlineDataConfig, PolicyLossSettings
from jaxrl.environments.registry import ENVIRONMENTS
from jaxrl.environments.settings import EpisodeSettings
from jaxrl.algorithms.policy_loss import resolve_options
from jaxrl.algorithms.tasks import Algorithm, algorithm_of, get_algorithm
from jaxrl.models import qwen35
from jaxrl.models.lora import apply_lora_from_config
from jaxrl.models.qwen35.init import init_model_jit
from jaxrl.parallel.mesh import mesh_from_config
from jaxrl.rewards import REWARDS
from jaxrl.train.loop import RunResult, Trainer, check_same_run
from jaxrl.rewards.settings import RewardConfig
from jaxrl.utils.typed_config import keys_of, plain_mapping, unknown_key_error


def resolve_config(config, algorithm=None) -> TrainConfig:
    """The TrainConfig of `config` (a ConfigDict, a mapping, or a TrainConfig): every key checked against the
    schema of its algorithm (`algorithm`: an Algorithm, or a user's task factory with the blocks it declares in
    `config_blocks`; default: the one `config.algorithm` names), the reward's constructor arguments and the model
    overrides included. ConfigKeyError naming the key (and the nearest valid one) otherwise."""
    if isinstance(config, TrainConfig):
        return config
    name = _algorithm_of(config)
    algorithm = get_algorithm(name) if algorithm is None else algorithm_of(name, algorithm)
    resolved = run_config.resolve(config, algorithm)
    _check_reward_arguments(resolved.block("reward"))
    _check_curriculum(resolved)
    _check_model_overrides(resolved.model_overrides)
    return resolved


def _algorithm_of(config) -> str:
    items = plain_mapping(config)
    value = items.get("algorithm") if isinstance(items, Mapping) else None
    return value or TrainConfig.algorithm


def _check_reward_arguments(reward) -> None:
    """The keys of `reward` beyond name / score are the reward's constructor arguments: each must be one."""
    if reward is None or ":" in reward.name or not reward.options or reward.name not in REWARDS:
        return  # user code named by module:attr decides; an unknown name is reported where the reward is made
    try:
        params = inspect.signature(REWARDS.get(reward.name)).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key in reward.options:
        if key not in params:
            raise unknown_key_error("reward", key, list(keys_of(RewardConfig)) + list(params))


def _check_curriculum(config: TrainConfig) -> None:
    """The curriculum draws a rollout's prompts from the record of the rollouts before it: none may be sampled
    ahead of them."""
    data, block = config.block("data"), config.block(config.algorithm)
    if (isinstance(data, OnlineDataConfig) and data.sampler == "curriculum" and isinstance(block, AsyncSettings)
            and block.max_staleness):
        raise ValueError(f"data.sampler='curriculum' draws each rollout's prompts from the rewards of the rollouts "
                         f"before it: it needs {config.algorithm}.max_staleness=0 (got {block.max_staleness})")


def _check_model_overrides(overrides: dict) -> None:
    fields = [f.name for f in dataclasses.fields(qwen35.Qwen35Config)]
    for key in overrides:
        if key not in fields:
            raise unknown_key_error("model_overrides", key, fields)


def load_run_plugins(config: TrainConfig) -> list[dict]:
    """Import, check and register the run's plug-ins: `plugins`, then the deprecated `dpo.plugin` alias (with a
    warning). Returns what was registered ({"kind", "name", "path"})."""
    entries = plugins.parse_plugins(config.plugins)
    dpo = config.block("dpo")
    if dpo is not None and dpo.plugin:
        logging.warning("dpo.plugin is deprecated: write it as plugins=('dpo_loss:%s',) (one entry per function)",
                        dpo.plugin)
        entries += plugins.dpo_plugin_entries(dpo.plugin)
    loaded = plugins.load_plugins(entries)
    for entry in loaded:
        logging.info("plug-in %s %r loaded from %s", entry["kind"], entry["name"], entry["path"])
    return loaded


def check_policy_losses(config: TrainConfig) -> None:
    """Each online block's policy loss exists (a built-in or a loaded plug-in) and takes its options: refused in
    one line naming the key before any model loads."""
    for name, block in config.blocks.items():
        if isinstance(block, PolicyLossSettings):
            try:
                resolve_options(block.policy_loss, block.policy_loss_common(), block.policy_loss_options, name)
            except KeyError as e:
                raise ValueError(f"{name}.policy_loss: {e.args[0]}") from None


def check_environments(config: TrainConfig, loaded: Sequence[Mapping] = ()) -> None:
    """Each online block's environment exists and takes its `environment_options`: a plug-in runs one example
    episode with them (jaxrl.algorithms.plugins.check_environment), a built-in is constructed with them. Refused
    in one line naming the key before any model loads."""
    plugged = {e["name"] for e in loaded if e["kind"] == "environment"}
    for name, block in config.blocks.items():
        if not (isinstance(block, EpisodeSettings) and block.environment):
            continue
        try:
            cls = ENVIRONMENTS.get(block.environment)
        except KeyError as e:
            raise ValueError(f"{name}.environment: {e.args[0]}") from None
        options = dict(block.environment_options)
        if block.environment in plugged:
            plugins.check_environment(f"{name}.environment {block.environment!r} with {name}.environment_options="
                                      f"{options}", cls, options)
            continue
        try:
            cls(**options)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}.environment_options={options} for {block.environment!r}: {e}") from None


def build_model(config: TrainConfig, mesh=None):
    """The base model from `model_path` (HF folder) or `model_preset` (+ `model_overrides`, random init with
    `model_seed`), in `dtype`, with `remat` and the compute settings (qwen35.COMPUTE_FIELDS); then LoRA from
    `config.lora` (A drawn with `seed`)."""
    dtype = jnp.dtype(config.dtype)
    if config.model_path:
        model = qwen35.from_pretrained(config.model_path, dtype=dtype, mesh=mesh, remat=config.remat)
    else:
        preset = config.model_preset
        if preset not in qwen35.PRESETS:
            raise ValueError(f"model_path is empty and model_preset={preset!r}; set model_path to an HF folder or "
                             f"model_preset to one of {sorted(qwen35.PRESETS)}")
        overrides = dict(config.model_overrides)
        if "layer_types" in overrides:
            overrides["layer_types"] = tuple(overrides["layer_types"])
        try:
            model_cfg = dataclasses.replace(qwen35.PRESETS[preset](), **overrides)
        except TypeError as e:
            raise ValueError(f"model_overrides={overrides}: {e}") from e
        model = init_model_jit(model_cfg, dtype, config.model_seed, config.remat, mesh)
    model.set_compute(**{k: getattr(config, k) for k in qwen35.COMPUTE_FIELDS})
    report = apply_lora_from_config(model, config.lora, seed=config.seed)
    logging.info("LoRA on %d modules (%s): %d trainable of %d parameters", len(report["modules"]),
                 ", ".join(f"{k} x{v}" for k, v in report["by_name"].items()), report["trainable_params"],
                 report["total_params"])
    return model


def fit_micro_batch_to_mesh(config: TrainConfig, mesh) -> TrainConfig:
    """The config with batch.micro_batch_size a multiple of the data-parallel size (data x fsdp), keeping the
    global batch (the same config when it already is).

    The users' runs use micro-batch 1 with accumulation 8 (a memory setting on their machine); on 8 devices a
    micro-batch of 1 cannot be split. The update does not depend on the split (token-weighted accumulation,
    tested) for every loss except those that couple the pairs of a micro-batch (dpo aot / aot_unpaired: their
    check runs on the fitted sizes and warns), so the smallest micro-batch that divides over the mesh and the
    global batch is taken instead, with a warning; the resolved config.json records it. Raises when no split
    fits (the global batch is not a multiple of data x fsdp).
    """
    dp = int(mesh.shape.get("data", 1)) * int(mesh.shape.get("fsdp", 1))
    mb, accum = config.batch.micro_batch_size, config.batch.grad_accum
    if mb % dp == 0:
        return config
    total = mb * accum
    fitted = math.lcm(mb, dp)
    if total % fitted:
        raise ValueError(f"batch.micro_batch_size={mb} x batch.grad_accum={accum} = {total} rows per step cannot be "
                         f"split over data x fsdp = {dp} devices (mesh {dict(mesh.shape)}); make the global batch a "
                         f"multiple of {dp}, or change mesh.shape")
    logging.warning("batch.micro_batch_size=%d does not divide over data x fsdp = %d devices: using micro-batch %d x "
                    "accumulation %d (the same %d rows per update)", mb, dp, fitted, total // fitted, total)
    return config.replace(batch=dataclasses.replace(config.batch, micro_batch_size=fitted,
                                                    grad_accum=total // fitted))


def run_training(config, workdir: str, *, mesh=None, **trainer_kwargs) -> RunResult:
    """Build the model and the algorithm's task from the config and run (resuming from the workdir). `config`: a
    ConfigDict (a family file), a config.json's dict, or a TrainConfig."""
    algorithm: Algorithm = get_algorithm(config.algorithm if isinstance(config, TrainConfig) else
                                         _algorithm_of(config))
    config = resolve_config(config, algorithm)
    check_same_run(config, workdir)  # a workdir holding a run of another shape: refused before any work
    loaded = load_run_plugins(config)  # user objectives checked before any model or data work
    check_policy_losses(config)
    check_environments(config, loaded)
    mesh = mesh if mesh is not None else mesh_from_config(config.mesh)
    config = fit_micro_batch_to_mesh(config, mesh)
    model = build_model(config, mesh)
    task = algorithm(config, model, mesh)
    return Trainer(config, model, task, workdir, mesh=mesh, **trainer_kwargs).run()
