"""PEFT adapter folders, both ways: export our adapters, import adapters trained elsewhere.

    export_peft(adapter, out_dir, base_dir, layout=None)      # adapter_model.safetensors + adapter_config.json
    adapter, layout = read_peft_adapter(folder)                # -> our Adapter (+ the layout its keys use)
    load_peft_adapter(folder, model, layout="container")       # read + check the layout + attach to the model
    adapter = read_adapter(path, step=None)                    # a PEFT folder or a trainer adapter checkpoint

Layouts (docs/design/qwen35-architecture.md §6-7). PEFT saves the *module path* of the class the adapter was built on:

    container  base_model.model.model.language_model.layers.N....lora_A.weight   (Qwen3_5ForConditionalGeneration,
                                                                                   the official checkpoints, vLLM)
    text       base_model.model.model.layers.N....lora_A.weight                   (Qwen3_5ForCausalLM, including
                                                                                   AutoModelForCausalLM on a container)

PEFT does not remap them: an adapter in the wrong layout loads "successfully" and changes nothing (PEFT only warns
about missing keys). vLLM 0.33 remaps both ways (container-layout adapters on a text-only model,
vllm/model_executor/models/qwen3_5.py:327-329; text-layout adapters on the container,
vllm/lora/model_manager.py:1269-1287); vLLM 0.30 has no text-layout remap and serves such an adapter as the base.
So both directions here check the layout and refuse a mismatch with an error that names it, instead of producing
a silent no-op in PEFT. vLLM 0.33 packs every target list of ours but one (`jaxrl.models.lora.vllm_unpackable`:
in_proj_z without in_proj_qkv); `export_peft` warns about that one.

Export is a rename: our `A [r, in]` / `B [out, r]` are PEFT's tensors (fp32), no numeric rewrite.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxrl.models.adapters import (A_SUFFIX, B_SUFFIX, Adapter, AdapterError, CheckpointNotFound, adapter_root,
                                   adapter_steps, attach, check_against_model, module_names, read_trainer_adapter)
from jaxrl.models.lora import linears, vllm_unpackable
from jaxrl.models.qwen35.config import load_hf_config
from jaxrl.models.qwen35.model import Qwen35
from jaxrl.utils.io import CorruptCheckpointError, atomic_folder, damaged_file

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PROVENANCE = "jaxrl_export.json"
LAYOUT_PREFIXES = {"container": "base_model.model.model.language_model.", "text": "base_model.model.model."}
# Vision-tower LoRA of a container adapter (PEFT "all-linear" picks the ViT too): it cannot change text
# generation, and vLLM ignores it as well (§7).
VISION_PREFIX = "base_model.model.model.visual."
LAYOUTS = tuple(LAYOUT_PREFIXES)


class LayoutError(AdapterError):
    """An adapter whose key layout does not match the model / checkpoint it is meant for (§6-7)."""


def layout_of(base_dir: str) -> str:
    """"container" or "text": the layout of an HF folder, from its config.json."""
    return load_hf_config(base_dir)[1].kind


def _check_layout_name(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def mismatch_message(adapter_layout: str, model_layout: str, what: str) -> str:
    return (f"{what}: the adapter's keys are in the {adapter_layout} layout ({LAYOUT_PREFIXES[adapter_layout]}"
            f"layers...) but the model is a {model_layout} checkpoint ({LAYOUT_PREFIXES[model_layout]}layers...). "
            "PEFT does not remap these: the adapter would load without error and change nothing (vLLM 0.33 "
            "remaps them, vLLM 0.30 does not; docs/guides/vllm.md). Export with the model's layout "
            f"(launchers.export --layout={model_layout}) instead.")


# ---------------------------------------------------------------------------------------------------------------
# Export

def peft_state_dict(adapter: Adapter, layout: str) -> dict[str, np.ndarray]:
    """{PEFT key: fp32 array} of `adapter` in `layout` (a rename of our names)."""
    prefix = LAYOUT_PREFIXES[_check_layout_name(layout)]
    out = {}
    for module in adapter.modules:
        a, b = adapter.factors(module)
        out[f"{prefix}{module}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        out[f"{prefix}{module}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
    return out


def _all_modules_with_names(model_config, names) -> list[str]:
    """Every projection path of a model with `model_config` whose last component is in `names`."""
    abstract = nnx.eval_shape(lambda: Qwen35(model_config, rngs=nnx.Rngs(0)))
    return [p for p, _ in linears(abstract) if p != "lm_head" and p.rsplit(".", 1)[-1] in names]


def target_modules(adapter: Adapter, model_config, layout: str) -> list[str]:
    """`target_modules` for adapter_config.json: the module names (`q_proj`, ...) when the adapter covers every
    module of those names, else the full module paths in `layout` (PEFT's list rule matches a path by suffix,
    so a name list would create extra adapters on layers this one never trained)."""
    names = module_names(adapter.modules)
    if sorted(_all_modules_with_names(model_config, names)) == sorted(adapter.modules):
        return names
    tower = LAYOUT_PREFIXES[layout][len("base_model.model."):]
    return [tower + m for m in adapter.modules]


def adapter_config(adapter: Adapter, targets: list[str], base_model_name_or_path: str) -> dict:
    """adapter_config.json for peft 0.21 (the fields a loader reads; the rest take PEFT's defaults)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "revision": None, "inference_mode": True, "r": adapter.rank, "lora_alpha": adapter.alpha,
        "lora_dropout": adapter.dropout, "use_rslora": adapter.use_rslora, "target_modules": targets,
        "exclude_modules": None, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "use_dora": False, "lora_bias": False, "target_parameters": None,
    }


def export_peft(adapter: Adapter, out_dir: str, base_dir: str, layout: Optional[str] = None, *,
                allow_layout_mismatch: bool = False, overwrite: bool = False,
                base_model_name_or_path: Optional[str] = None) -> dict:
    """Writes `adapter` as a PEFT folder for the checkpoint at `base_dir`; returns the provenance record.

    layout: None = the base's own layout (the only one that loads onto it). Requesting the other one is refused
      unless `allow_layout_mismatch` (legitimate only for `text` on a container that will be loaded with
      AutoModelForCausalLM, which builds Qwen3_5ForCausalLM and its `model.layers` paths).
    The factors are checked against the base's projection shapes first (an adapter of another model is refused).
    """
    cfg, base_layout, _ = load_hf_config(base_dir)
    layout = base_layout.kind if layout is None else _check_layout_name(layout)
    if layout != base_layout.kind and not allow_layout_mismatch:
        raise LayoutError(mismatch_message(layout, base_layout.kind, f"export to {out_dir}") +
                          (" (Only if you will load this container with AutoModelForCausalLM, whose module paths "
                           "are model.layers..., pass allow_layout_mismatch / --allow_layout_mismatch.)"
                           if layout == "text" else ""))
    check_against_model(adapter, nnx.eval_shape(lambda: Qwen35(cfg, rngs=nnx.Rngs(0))))
    unpackable = vllm_unpackable(adapter.modules)
    if unpackable:  # still a valid PEFT adapter (PEFT and jaxrl load it), so a warning, not a refusal
        logger.warning("%s: vLLM 0.33 cannot serve this adapter (it raises when the adapter is activated): %d "
                       "module(s), e.g. %s; it packs in_proj_z only together with in_proj_qkv", out_dir,
                       len(unpackable), unpackable[0])
    tensors = peft_state_dict(adapter, layout)
    targets = target_modules(adapter, cfg, layout)
    config = adapter_config(adapter, targets, base_model_name_or_path or os.path.abspath(base_dir))
    provenance = {"format": "peft", "layout": layout, "base": os.path.abspath(base_dir),
                  "source": adapter.source, "step": adapter.step, "adapter_digest": adapter.digest(),
                  "modules": len(adapter.modules), "rank": adapter.rank, "alpha": adapter.alpha,
                  "use_rslora": adapter.use_rslora, "scale": adapter.scale}
    if adapter.average is not None:  # what it averages (jaxrl.export.average); read back by read_peft_adapter
        provenance["average"] = adapter.average
    with atomic_folder(out_dir, overwrite) as tmp:
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, PROVENANCE), "w") as f:
            json.dump(provenance, f, indent=2)
    return provenance


# ---------------------------------------------------------------------------------------------------------------
# Import

_UNSUPPORTED = {  # adapter_config key -> value that means "plain LoRA"; anything else changes the math
    "use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False,
}


def _check_config(config: dict, path: str) -> None:
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type is {config.get('peft_type')!r}; only LORA adapters are supported")
    for key, plain in _UNSUPPORTED.items():
        if config.get(key, plain) not in (plain, None):
            raise AdapterError(f"{path}: {key} = {config[key]!r} is not supported (plain LoRA needs {plain!r})")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterError(f"{path}: {key} {config[key]!r} (per-module rank/alpha) is not supported")
    for key in ("modules_to_save", "target_parameters", "trainable_token_indices"):
        if config.get(key):
            raise AdapterError(f"{path}: {key} = {config[key]!r}: fully trained modules / parameter targets "
                               "are not LoRA factors and are not supported")
    if "r" not in config or "lora_alpha" not in config:
        raise AdapterError(f"{path}: missing 'r' or 'lora_alpha'")


def read_peft_adapter(folder: str) -> tuple[Adapter, str]:
    """(Adapter with our names, layout of its keys) of a PEFT LoRA folder.

    Vision-tower factors (`...model.visual.`) are dropped with a warning (they cannot change text generation);
    any other key that is not a language-tower LoRA factor is an error naming it.
    """
    cfg_path = os.path.join(folder, ADAPTER_CONFIG)
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise AdapterError(f"{folder}: no {ADAPTER_CONFIG} (not a PEFT adapter folder)") from None
    except json.JSONDecodeError as e:
        raise AdapterError(f"{cfg_path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    _check_config(config, cfg_path)
    weights = os.path.join(folder, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise AdapterError(f"{folder}: no {ADAPTER_WEIGHTS} (only safetensors adapters are read)")
    try:
        tensors = load_file(weights)
    except Exception as e:  # noqa: BLE001 (safetensors' errors have no common type; any failure here is the file)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AdapterError(f"{weights}: damaged safetensors file ({reason}); export the adapter again, or restore the "
                           "file from a copy") from e
    layouts, params, vision = set(), {}, []
    for key, value in tensors.items():
        if key.startswith(VISION_PREFIX):
            vision.append(key)
            continue
        # The container prefix is the longer one: try it first.
        layout = next((name for name in ("container", "text") if key.startswith(LAYOUT_PREFIXES[name])), None)
        rest = key[len(LAYOUT_PREFIXES[layout]):] if layout else ""
        for peft_suffix, ours in ((".lora_A.weight", A_SUFFIX), (".lora_B.weight", B_SUFFIX)):
            if layout and rest.startswith("layers.") and rest.endswith(peft_suffix):
                params[rest[: -len(peft_suffix)] + ours] = value
                layouts.add(layout)
                break
        else:
            raise AdapterError(f"{weights}: key {key!r} is not a LoRA factor of the Qwen3.5 language tower "
                               f"(expected {LAYOUT_PREFIXES['container']}layers.N.<module>.lora_A.weight or the "
                               f"text-only {LAYOUT_PREFIXES['text']}layers...)")
    if len(layouts) > 1:
        raise LayoutError(f"{weights}: mixes container and text-layout keys")
    if not params:
        raise AdapterError(f"{weights}: no language-tower LoRA factors" + (" (only vision-tower ones)" if vision
                                                                            else ""))
    if vision:
        logger.warning("%s: ignoring %d vision-tower LoRA tensors (e.g. %s): they do not affect text generation",
                       weights, len(vision), vision[0])
    adapter = Adapter(params=params, rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                      use_rslora=bool(config.get("use_rslora", False)),
                      dropout=float(config.get("lora_dropout") or 0.0), step=None, source=os.path.abspath(folder),
                      model_path=str(config.get("base_model_name_or_path") or ""), kind="peft",
                      average=_average_record(folder))
    return adapter, layouts.pop()


def _average_record(folder: str) -> Optional[dict]:
    """The `average` record of an averaged adapter's jaxrl_export.json (None for any other folder)."""
    path = os.path.join(folder, PROVENANCE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: unreadable ({e}); export the adapter again") from None
    average = record.get("average") if isinstance(record, dict) else None
    return average if isinstance(average, dict) else None


def load_peft_adapter(folder: str, model, layout: str) -> Adapter:
    """Reads a PEFT folder and attaches it to `model` (our JAX model) in place; returns the Adapter.

    layout: the layout of the checkpoint `model` was loaded from: "container", "text", or that HF folder itself.
    An adapter whose keys are in the other layout is refused (LayoutError): in PEFT it would be a silent no-op
    on that checkpoint, so evaluating it here would report numbers no user of the folder would get.
    """
    if layout not in LAYOUTS:
        layout = layout_of(layout)
    adapter, found = read_peft_adapter(folder)
    if found != layout:
        raise LayoutError(mismatch_message(found, layout, folder))
    attach(model, adapter)
    return adapter


def is_peft_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def read_adapter(path: str, step: Optional[int] = None) -> Adapter:
    """A trainer adapter checkpoint or a PEFT adapter folder (detected by its adapter_config.json). A trainer
    checkpoint whose files are damaged or missing is a CorruptCheckpointError naming the file (or the step's
    folder), not the reader's error."""
    if is_peft_folder(path):
        if step is not None:
            raise AdapterError(f"{path}: a PEFT folder holds one adapter; --step does not apply")
        return read_peft_adapter(path)[0]
    folder, chosen = _step_folder(path, step)
    missing = [f for f in _STEP_FILES if folder is not None and not os.path.isfile(os.path.join(folder, f))]
    if missing:  # checked first: the reader's error would name no file (and Orbax warns about the item)
        raise CorruptCheckpointError(os.path.join(folder, missing[0]), f"step {chosen}: the file is missing")
    try:
        return read_trainer_adapter(path, step)
    except (AdapterError, CorruptCheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 (damage is told apart from every other failure below)
        damage = _damage(e, folder, chosen)
        if damage is None:
            raise
        raise damage from e


# What a step folder of an adapter checkpoint must hold (Orbax's metadata of its two items): missing, the reader
# fails with errors that name no file.
_STEP_FILES = (os.path.join("adapter", "_METADATA"), os.path.join("meta", "metadata"))


def _step_folder(path: str, step: Optional[int]) -> tuple[Optional[str], Optional[int]]:
    """(the step folder an adapter checkpoint `path` resolves to for `step` (None: the newest), that step); (None,
    None) when `path` is no adapter checkpoint (the reader then says why)."""
    try:
        steps = adapter_steps(path)
    except (CheckpointNotFound, OSError):
        return None, None
    chosen = step if step is not None else (steps[-1] if steps else None)
    if chosen is None:
        return None, None
    if os.path.basename(os.path.abspath(path)).isdigit():
        return os.path.abspath(path), chosen
    root = adapter_root(path)
    if root is not None and os.path.isdir(os.path.join(root, str(chosen))):
        return os.path.join(root, str(chosen)), chosen
    return None, chosen


def _damage(exc: BaseException, folder: Optional[str], step: Optional[int]) -> Optional[CorruptCheckpointError]:
    """The CorruptCheckpointError of a failed read of the adapter checkpoint in `folder` (of `step`): a damaged file
    named by the error or found unreadable in the folder, or a file missing from it; None when not damage."""
    if folder is None:
        return None
    damage = damaged_file(exc, folder)
    if damage is not None and damage.path == folder:  # no file named: say which step
        damage = CorruptCheckpointError(folder, f"step {step}: {damage.reason}")
    if damage is None and any("NOT_FOUND" in str(e) or isinstance(e, FileNotFoundError) for e in _causes(exc)):
        damage = CorruptCheckpointError(folder, f"step {step}: a file of it is missing")
    return damage


def _causes(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
