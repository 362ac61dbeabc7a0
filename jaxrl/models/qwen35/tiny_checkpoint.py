"""Write a tiny Qwen3.5 container checkpoint without torch (demo and CPU experiments).

The folder has the same shape as an official Qwen3.5 checkpoint at toy size: a `Qwen3_5ForConditionalGeneration`
config with `text_config` and `vision_config`, the language tower under `model.language_model.`, a small vision
tower under `model.visual.`, and `mtp.*` tensors (HF ignores them on load; export must keep them). transformers
loads it with no missing or unexpected keys (tested), so every export path is exercised as on a real model.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.qwen35.checkpoint import save_pretrained
from jaxrl.models.qwen35.config import Qwen35Config, tiny
from jaxrl.models.qwen35.model import Qwen35

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, in_channels=3, num_position_embeddings=64, hidden_act="gelu_pytorch_tanh",
              model_type="qwen3_5_vision", rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"})


def vision_tensors(vision: dict, out_hidden: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random tensors with the names and shapes of `Qwen3_5VisionModel` for `vision` (fp32)."""
    h, inter, merge = vision["hidden_size"], vision["intermediate_size"], vision["spatial_merge_size"]
    p, tp, c = vision["patch_size"], vision["temporal_patch_size"], vision["in_channels"]
    merged = h * merge * merge
    shapes = {"patch_embed.proj.weight": (h, c, tp, p, p), "patch_embed.proj.bias": (h,),
              "pos_embed.weight": (vision["num_position_embeddings"], h),
              "merger.norm.weight": (h,), "merger.norm.bias": (h,),
              "merger.linear_fc1.weight": (merged, merged), "merger.linear_fc1.bias": (merged,),
              "merger.linear_fc2.weight": (out_hidden, merged), "merger.linear_fc2.bias": (out_hidden,)}
    for i in range(vision["depth"]):
        b = f"blocks.{i}."
        shapes.update({b + "norm1.weight": (h,), b + "norm1.bias": (h,), b + "norm2.weight": (h,),
                       b + "norm2.bias": (h,), b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
                       b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
                       b + "mlp.linear_fc1.weight": (inter, h), b + "mlp.linear_fc1.bias": (inter,),
                       b + "mlp.linear_fc2.weight": (h, inter), b + "mlp.linear_fc2.bias": (h,)})
    return {"model.visual." + k: (rng.standard_normal(s) * 0.02).astype(np.float32) for k, s in shapes.items()}


def mtp_tensors(cfg: Qwen35Config, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A few stand-ins for the multi-token-prediction head official checkpoints carry (never loaded by HF)."""
    h = cfg.hidden_size
    return {"mtp.fc.weight": (rng.standard_normal((h, 2 * h)) * 0.02).astype(np.float32),
            "mtp.norm.weight": np.zeros((h,), np.float32),
            "mtp.pre_fc_norm_embedding.weight": np.zeros((h,), np.float32)}


def perturb_for_realism(model: Qwen35, seed: int) -> None:
    """Move norm weights, A_log and dt_bias off their init values so parity tests and demos cannot pass by a
    lucky `w = 0` (docs/design/qwen35-architecture.md §2.2)."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(map(str, path))
        shape, dtype = var[...].shape, var[...].dtype
        if name.endswith("linear_attn.norm.weight"):
            var[...] = jnp.asarray(1.0 + 0.3 * rng.standard_normal(shape), dtype)
        elif name.endswith("norm.weight"):
            var[...] = jnp.asarray(0.3 * rng.standard_normal(shape), dtype)
        elif name.endswith("dt_bias"):
            var[...] = jnp.asarray(0.5 * rng.standard_normal(shape), dtype)


def write_tiny_checkpoint(out_dir: str, cfg: Optional[Qwen35Config] = None, seed: int = 0,
                          layout: str = "container", with_mtp: bool = True, weight_scale: float = 1.0,
                          head_scale: float = 1.0) -> str:
    """Write a random tiny Qwen3.5 HF folder (container with vision + mtp tensors, or text-only) to `out_dir`.

    weight_scale multiplies every matrix (random init at std 0.02 gives nearly input-independent logits; demos
    that must learn a task in a few hundred steps start better from larger weights).
    head_scale multiplies the (untied) output head only: at std 0.02 the frozen head caps every logit near 1, so
    LoRA on the tower cannot make any token likely; a larger head lets adapters reach peaked distributions.
    """
    cfg = cfg or tiny()
    model = Qwen35(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    perturb_for_realism(model, seed)
    if weight_scale != 1.0:
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            if var[...].ndim == 2:
                var[...] = var[...] * weight_scale
    if head_scale != 1.0:
        if cfg.tie_word_embeddings:
            raise ValueError("head_scale needs an untied head (tie_word_embeddings=False)")
        model.lm_head.weight[...] = model.lm_head.weight[...] * head_scale
    rng = np.random.default_rng(seed + 1)
    extra_tensors: dict = {}
    extra_config: dict = {}
    if layout == "container":
        vision = dict(VISION, out_hidden_size=cfg.hidden_size)
        extra_tensors.update(vision_tensors(vision, cfg.hidden_size, rng))
        top = cfg.vocab_size  # special vision ids must exist in the vocabulary; park them at its end
        extra_config = {"vision_config": vision, "image_token_id": top - 4, "video_token_id": top - 3,
                        "vision_start_token_id": top - 2, "vision_end_token_id": top - 1}
    if with_mtp:
        extra_tensors.update(mtp_tensors(cfg, rng))
    save_pretrained(model, out_dir, layout=layout, extra_tensors=extra_tensors, extra_config=extra_config)
    generation = {"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    return out_dir
