"""Tiny random Qwen3.5 checkpoints built with `transformers` at test time (offline; docs/design/qwen35-architecture.md §5).

The reference side of every parity test. Norm weights, A_log and dt_bias are perturbed away from their init so a
`1 + w` mistake or a swapped norm cannot hide behind w = 0 / w = 1.
"""

from __future__ import annotations

import os

import torch

TEXT_KWARGS = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    pad_token_id=0, eos_token_id=1)

VISION_KWARGS = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                     temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64)


def text_kwargs(**overrides):
    kw = dict(TEXT_KWARGS)
    kw.update(overrides)
    if "hidden_size" in overrides and "out_hidden_size" not in overrides:
        pass
    return kw


@torch.no_grad()
def perturb(model, seed: int = 0) -> None:
    """Move every norm weight, A_log and dt_bias away from its init (and scale matrices up a little so the logits
    are not flat: at init std 0.02 the tiny model's logits barely depend on the input)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "visual" in name:
            continue
        if name.endswith("norm.weight") and "linear_attn.norm" not in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)  # zero-centred RMSNorm: weights around 0
        elif "linear_attn.norm.weight" in name:
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)  # gated norm: plain weight around 1
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 4 + 0.5))
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif p.ndim == 2:
            p.mul_(5.0)
        elif "conv1d" in name:
            p.mul_(2.0)


def build_text(out_dir: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A `Qwen3_5ForCausalLM` folder; returns (out_dir, model)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_kwargs(**overrides))).eval()
    perturb(model, seed)
    model = model.to(dtype)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir, model


def build_container(out_dir: str, seed: int = 0, dtype=torch.float32, tie: bool = False, **overrides):
    """A `Qwen3_5ForConditionalGeneration` folder (vision tower included); returns (out_dir, model)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    torch.manual_seed(seed)
    text = text_kwargs(tie_word_embeddings=tie, **overrides)
    vision = dict(VISION_KWARGS, out_hidden_size=text["hidden_size"])
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
                        vision_start_token_id=252, vision_end_token_id=253, tie_word_embeddings=tie)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    perturb(model, seed)
    if tie:
        model.tie_weights()
    model = model.to(dtype)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir, model


def hf_logits(model, input_ids, attention_mask=None):
    """Reference logits as numpy float64-free fp32 [B, T, V]."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    mask = None if attention_mask is None else torch.as_tensor(attention_mask, dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float().numpy()
