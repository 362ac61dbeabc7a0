"""Hugging Face checkpoints <-> the JAX model, without torch.

`from_pretrained` streams tensors one at a time from `model.safetensors` or sharded files with
`model.safetensors.index.json`, so a 9B checkpoint never sits in host memory twice; with a mesh, each device
reads only its own slice of each tensor (`make_array_from_callback` over lazily sliced safetensors).

`save_pretrained` writes the language tower back in the layout, file split and dtypes of `base_dir` and carries
everything else over unchanged: vision tower (`model.visual.*`), `mtp.*`, an untied `lm_head` of a container,
config.json (copied verbatim: real checkpoints carry keys HF does not model), tokenizer, chat template and
generation config (docs/design/qwen35-architecture.md §4.1, §4.5).

Parameter names: our NNX paths joined with "." equal the HF names under the tower prefix, except
`embed_tokens` (HF `embed_tokens.weight`) and `conv1d` (HF `conv1d.weight`); `lm_head.weight` sits at the root.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Iterator, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl.models.qwen35.config import (CONTAINER, QUANTIZED_ADVICE, TEXT_ONLY, HFLayout, Qwen35Config,
                                        load_hf_config)
from jaxrl.models.qwen35.model import Qwen35
from jaxrl.parallel.sharding import named_sharding
from jaxrl.utils.io import atomic_copy, atomic_path, atomic_write_text, is_temp_name
from jaxrl.utils.tree import dotted

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


class CheckpointError(ValueError):
    """A checkpoint folder we cannot read or write faithfully; names the tensor and the file."""


# ----------------------------------------------------------------------------------------------------------------
# Names

def hf_key(name: str, layout: HFLayout) -> str:
    """Our parameter name -> the full HF state-dict key in `layout`."""
    if name == "lm_head.weight":
        return name
    if name == "embed_tokens" or name.endswith(".conv1d"):
        name = name + ".weight"
    return layout.tower_prefix + name


def is_base_param(path: tuple) -> bool:
    """Base-model weights (what HF checkpoints hold); excludes LoRA factors and any value head."""
    return "lora" not in path and (not path or path[0] != "value_head")


def base_params(model: nnx.Module) -> Iterator[tuple[str, nnx.Variable]]:
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if is_base_param(path):
            yield dotted(path), var


# ----------------------------------------------------------------------------------------------------------------
# Reading

def read_weight_map(model_dir: str) -> dict[str, str]:
    """key -> file name, from the index json or the single file."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                index = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index_path}: invalid JSON at line {e.lineno}: {e.msg}") from e
        if "weight_map" not in index:
            raise CheckpointError(f"{index_path}: no `weight_map`")
        weight_map = dict(index["weight_map"])
        for fname in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(model_dir, fname)):
                raise CheckpointError(f"{index_path}: lists shard {fname!r}, which is missing from {model_dir}")
        return weight_map
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="numpy") as f:
            return {k: SINGLE_FILE for k in f.keys()}
    raise CheckpointError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


# Tensor-name suffixes of quantized checkpoints (what each stores beside, or instead of, a dense weight).
_QUANTIZED_SUFFIXES = {".weight_scale_inv": "FP8 (block-wise)", ".weight_scale": "FP8", ".input_scale": "FP8",
                       ".qweight": "GPTQ / AWQ", ".qzeros": "GPTQ / AWQ", ".g_idx": "GPTQ", ".scales": "GPTQ / AWQ",
                       ".weight_packed": "compressed-tensors (int4 / int8)"}


def quantized_tensor(names) -> Optional[str]:
    """The first of `names` that is a quantization tensor (a scale, packed weight, zero point), or None."""
    return next((n for n in names if any(n.endswith(s) for s in _QUANTIZED_SUFFIXES)), None)


def quantization_of(names) -> Optional[str]:
    """The quantization format `names` (tensor names) belong to, or None when none is quantized."""
    name = quantized_tensor(names)
    return None if name is None else next(v for s, v in _QUANTIZED_SUFFIXES.items() if name.endswith(s))


def from_pretrained(model_dir: str, dtype=jnp.float32, mesh: Optional[jax.sharding.Mesh] = None,
                    remat: str = "none") -> Qwen35:
    """Load an HF Qwen3.5 folder (container or text-only, one file or sharded) into a `Qwen35`.

    dtype: parameter and compute dtype (weights are cast tensor by tensor while streaming).
    mesh: place each weight directly onto its shards (rules in `jaxrl.parallel.sharding`).
    """
    cfg, layout, _ = load_hf_config(model_dir)
    abstract = nnx.eval_shape(lambda: Qwen35(cfg, dtype=dtype, rngs=nnx.Rngs(0), remat=remat))
    graphdef, state = nnx.split(abstract)
    weight_map = read_weight_map(model_dir)

    expected = {}  # hf key -> (our name, variable)
    for name, var in base_params(abstract):
        expected[hf_key(name, layout)] = (name, var)
    missing = [k for k in expected if k not in weight_map]
    if missing:
        hint = ""
        other = TEXT_ONLY if layout is CONTAINER else CONTAINER
        if any(k.replace(layout.tower_prefix, other.tower_prefix, 1) in weight_map for k in missing):
            hint = (f" (the tensors are stored under {other.tower_prefix!r}: config.json describes a {layout.kind}"
                    f" checkpoint but the weights are in the {other.kind} layout)")
        raise CheckpointError(f"{model_dir}: missing {len(missing)} tensor(s), first {missing[0]!r}{hint}")
    unknown = [k for k in weight_map if k.startswith(layout.tower_prefix) and k not in expected
               and not k.endswith("rotary_emb.inv_freq")]
    quantized = quantization_of(unknown)
    if quantized:
        raise CheckpointError(f"{model_dir}: a {quantized}-quantized checkpoint (tensor {quantized_tensor(unknown)!r} "
                              f"in {weight_map[quantized_tensor(unknown)]}) without a quantization_config; "
                              f"{QUANTIZED_ADVICE}")
    if unknown:
        raise CheckpointError(f"{model_dir}: unknown language-tower tensor {unknown[0]!r} in "
                              f"{weight_map[unknown[0]]} ({len(unknown)} unknown in all); is this a Qwen3.5 "
                              "dense checkpoint matching its config.json?")

    flat = dict(nnx.to_flat_state(state))
    by_file: dict[str, list[str]] = {}
    for key in expected:
        by_file.setdefault(weight_map[key], []).append(key)
    for fname, keys in sorted(by_file.items()):
        path = os.path.join(model_dir, fname)
        with safe_open(path, framework="numpy") as f:
            for key in keys:
                name, var = expected[key]
                tensor = f.get_slice(key)
                shape = tuple(tensor.get_shape())
                if shape != tuple(var.shape):
                    raise CheckpointError(f"{path}: tensor {key!r} has shape {shape}; the config implies "
                                          f"{tuple(var.shape)}")
                value = _load_tensor(tensor, name, shape, dtype, mesh)
                flat_path = tuple(int(p) if p.isdigit() else p for p in name.split("."))
                flat[flat_path].set_value(value)
    state = nnx.from_flat_state(flat)
    return nnx.merge(graphdef, state)


def _load_tensor(tensor, name: str, shape: tuple, dtype, mesh) -> jax.Array:
    if mesh is None:
        return jnp.asarray(np.asarray(tensor[:]), dtype=dtype)
    sharding = named_sharding(name, shape, mesh)
    np_dtype = jnp.dtype(dtype)
    # Each device asks only for its own slice, which safetensors reads lazily from the file.
    return jax.make_array_from_callback(shape, sharding,
                                        lambda idx: np.asarray(tensor[idx]).astype(np_dtype))


# ----------------------------------------------------------------------------------------------------------------
# Writing

def _to_numpy(x, np_dtype) -> np.ndarray:
    host = np.asarray(jax.device_get(x))
    return host.astype(np_dtype) if host.dtype != np_dtype else host


def _atomic_save_safetensors(tensors: dict, path: str, metadata: Optional[dict]) -> None:
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)


def save_pretrained(model: Qwen35, out_dir: str, base_dir: Optional[str] = None,
                    tensor_transform: Optional[Callable[[str, np.ndarray], np.ndarray]] = None,
                    layout: str = "container", extra_tensors: Optional[dict] = None,
                    extra_config: Optional[dict] = None, keep_transform_dtype: bool = False) -> str:
    """Write `model`'s language tower as an HF folder.

    With `base_dir` (the usual case): same layout, same shard files and index, same dtype per tensor as the base;
    every tensor that is not part of the language tower, and every non-weight file, is copied unchanged.
    Without `base_dir`: a fresh folder (`layout` "container" or "text") with a generated config.json, plus
    `extra_tensors` (e.g. a vision tower) and `extra_config` keys merged into config.json; used to create test and
    demo checkpoints without torch (see `jaxrl.models.qwen35.tiny_checkpoint`).
    `tensor_transform(hf_key, array)` may replace a tower tensor just before it is written (merged LoRA export);
    its result is cast to the base tensor's dtype unless `keep_transform_dtype` (an fp32 merge into a bf16 base).
    """
    os.makedirs(out_dir, exist_ok=True)
    if base_dir is None:
        return _save_fresh(model, out_dir, layout, tensor_transform, extra_tensors or {}, extra_config or {})
    if os.path.abspath(base_dir) == os.path.abspath(out_dir):
        raise CheckpointError(f"save_pretrained: out_dir and base_dir are the same folder ({out_dir}); refusing "
                              "to overwrite the base checkpoint")
    cfg, base_layout, _ = load_hf_config(base_dir)
    _check_same_shape(model.config, cfg, base_dir)
    weight_map = read_weight_map(base_dir)
    ours = {hf_key(name, base_layout): var for name, var in base_params(model)}
    missing = [k for k in ours if k not in weight_map]
    if missing:
        raise CheckpointError(f"{base_dir}: has no tensor {missing[0]!r} to receive the model's weight "
                              f"({len(missing)} missing in all)")

    shard_files = sorted(set(weight_map.values()))
    for fname in shard_files:
        src = os.path.join(base_dir, fname)
        keys_here = [k for k, f in weight_map.items() if f == fname]
        if not any(k in ours for k in keys_here):  # nothing of the tower: byte-identical copy
            atomic_copy(src, os.path.join(out_dir, fname))
            continue
        tensors = {}
        with safe_open(src, framework="numpy") as f:
            file_meta = f.metadata()
            for key in f.keys():
                original = f.get_slice(key)
                if key in ours:
                    np_dtype = _NP_DTYPES.get(original.get_dtype())
                    if np_dtype is None:
                        raise CheckpointError(f"{src}: tensor {key!r} has unsupported dtype {original.get_dtype()}")
                    value = _to_numpy(ours[key][...], np.dtype(np_dtype))
                    if tensor_transform is not None:
                        value = np.asarray(tensor_transform(key, value))
                        value = value if keep_transform_dtype else value.astype(np_dtype)
                    if tuple(value.shape) != tuple(original.get_shape()):
                        raise CheckpointError(f"{src}: tensor {key!r} is {tuple(original.get_shape())} in the base "
                                              f"but {tuple(value.shape)} in the model")
                    tensors[key] = value
                else:
                    tensors[key] = f.get_tensor(key)
        _atomic_save_safetensors(tensors, os.path.join(out_dir, fname), file_meta)
        del tensors

    for entry in sorted(os.listdir(base_dir)):
        src = os.path.join(base_dir, entry)
        dst = os.path.join(out_dir, entry)
        if entry in shard_files or is_temp_name(entry):
            continue
        if os.path.isdir(src):
            if os.path.exists(dst):
                shutil.rmtree(dst)
            shutil.copytree(src, dst)
        else:
            atomic_copy(src, dst)
    return out_dir


def _check_same_shape(ours: Qwen35Config, base: Qwen35Config, base_dir: str) -> None:
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "layer_types",
                  "tie_word_embeddings"):
        if getattr(ours, field) != getattr(base, field):
            raise CheckpointError(f"{base_dir}/config.json: `{field}` is {getattr(base, field)!r} but the model has "
                                  f"{getattr(ours, field)!r}; save into a base checkpoint of the same shape")


def hf_text_config_dict(cfg: Qwen35Config) -> dict:
    """An HF `Qwen3_5TextConfig`-compatible dict (for fresh folders only; real folders keep their config.json)."""
    rot_half = cfg.rotary_dim // 2
    section = [rot_half - 2 * (rot_half // 3), rot_half // 3, rot_half // 3]
    return {
        "model_type": "qwen3_5_text", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor, "mrope_section": section,
                            "mrope_interleaved": True},
        "attention_bias": cfg.attention_bias, "attention_dropout": 0.0,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim, "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_head_dim": cfg.linear_value_head_dim, "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads, "layer_types": list(cfg.layer_types),
        "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
        "dtype": "float32",
    }


def _save_fresh(model: Qwen35, out_dir: str, layout_kind: str, tensor_transform, extra_tensors: dict,
                extra_config: dict) -> str:
    if layout_kind not in ("container", "text"):
        raise CheckpointError(f"layout must be 'container' or 'text', got {layout_kind!r}")
    layout = CONTAINER if layout_kind == "container" else TEXT_ONLY
    tensors = dict(extra_tensors)
    for name, var in base_params(model):
        key = hf_key(name, layout)
        value = np.asarray(jax.device_get(var[...]))
        tensors[key] = tensor_transform(key, value) if tensor_transform else value
    _atomic_save_safetensors(tensors, os.path.join(out_dir, SINGLE_FILE), {"format": "pt"})
    text = hf_text_config_dict(model.config)
    if layout_kind == "text":
        config = dict(text, architectures=list(TEXT_ONLY.architectures))
    else:
        config = {"model_type": "qwen3_5", "architectures": list(CONTAINER.architectures),
                  "tie_word_embeddings": model.config.tie_word_embeddings, "text_config": text}
    config.update(extra_config)
    atomic_write_text(os.path.join(out_dir, "config.json"), json.dumps(config, indent=2))
    return out_dir
