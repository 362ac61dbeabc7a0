"""Qwen3.5 (dense) in Flax NNX: config, model, Hugging Face checkpoint io.

    from jaxrl.models import qwen35
    model = qwen35.from_pretrained(path, dtype=jnp.float32)
    logits = model(input_ids, attention_mask=mask)
    qwen35.save_pretrained(model, out_dir, base_dir=path)
"""

from jaxrl.models.qwen35.config import (COMPUTE_FIELDS, ConfigError, Qwen35Config, load_hf_config, parse_hf_config,
                                        qwen35_4b, qwen35_9b, tiny, PRESETS)
from jaxrl.models.qwen35.model import Cache, Qwen35, REMAT_CHOICES, REMAT_POLICIES, init_model
from jaxrl.models.qwen35.init import init_model_jit
from jaxrl.models.qwen35.checkpoint import CheckpointError, from_pretrained, save_pretrained

__all__ = ["COMPUTE_FIELDS", "Cache", "CheckpointError", "ConfigError", "PRESETS", "Qwen35", "Qwen35Config",
           "REMAT_CHOICES", "REMAT_POLICIES", "from_pretrained", "init_model", "init_model_jit", "load_hf_config", "parse_hf_config", "qwen35_4b",
           "qwen35_9b", "save_pretrained", "tiny"]
