"""The settings the model owns: which weights a run starts from, how the model computes (`ModelSettings`, top-level
keys of every run's config: jaxrl.algorithms.config.TrainConfig) and its LoRA (`LoRAConfig`, the `lora.*` block).

    ModelSettings.gdn_chunk_size         # the one default; jaxrl.models.qwen35.config's compute fields share it
    apply_lora_from_config(model, config.lora, seed=...)     # jaxrl.models.lora acts on the block

No jax here: configs import this module (through jaxrl.algorithms.config).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jaxrl.utils.seeds import seed_problem
from jaxrl.utils.typed_config import Block, keys_of, setting

__all__ = ["LoRAConfig", "ModelSettings", "model_default"]


@dataclasses.dataclass(frozen=True)
class LoRAConfig(Block):
    rank: int = setting(16)
    alpha: float = setting(32.0)
    targets: Any = setting("all-linear", (str, list, tuple), "'all-linear' | 'q_proj,v_proj,...' | a regex over "
                           "module paths")
    use_rslora: bool = setting(False)
    dropout: float = setting(0.0)
    allow_vllm_unpackable: bool = setting(False, doc="allow targets vLLM 0.33 cannot serve (in_proj_z without "
                                          "in_proj_qkv); refused by default (docs/guides/vllm.md)")


@dataclasses.dataclass(frozen=True)
class ModelSettings(Block):
    """The model a run trains: its weights (an HF folder, or a random preset) and its compute settings (the last
    four are `jaxrl.models.qwen35.COMPUTE_FIELDS`, set on the built model)."""

    model_path: str = setting("", doc="HF folder (container or text-only); empty: random init of `model_preset`")
    model_preset: str = setting("tiny", doc="qwen35.PRESETS key used when model_path is empty")
    model_overrides: dict = setting({}, dict, "Qwen35Config fields replacing the preset's (random init only)")
    model_seed: int = setting(0, doc="init seed of a preset model")
    dtype: str = setting("bfloat16", doc="base weights and compute; LoRA factors are always fp32")
    remat: str = setting("auto", doc="activation rematerialisation of the training forward: auto (the least "
                         "recomputation whose estimated activations fit half the device memory after the weights) | "
                         "none | matmuls (keep projection outputs) | attention (keep attention / GDN outputs) | full "
                         "| dots | dots_no_batch")
    scan_layers: Optional[bool] = setting(None, (bool, type(None)), "training forward: jax.lax.scan over the "
                                          "repeating block of layers (Qwen3.5: three Gated DeltaNet, one attention), "
                                          "one compiled body instead of every layer unrolled. None: scan when the "
                                          "pass rematerialises its layers (the remat policy, after auto's choice, is "
                                          "not none: the 4B and 9B at their training shapes), unrolled when it keeps "
                                          "every activation (remat none: the tiny and benchmark models); True | "
                                          "False: always | never. Layers that do not repeat (or LoRA on some layers "
                                          "only) run unrolled, with one log line; decode is always unrolled")
    gdn_chunk_size: int = setting(0, doc="tokens per chunk of the chunked Gated DeltaNet form (training, prefill); "
                                  "0: auto, the key head dim within 16..64 (64 for the 4B and 9B; 16 for a tiny "
                                  "model)")
    gdn_state_dtype: str = setting("float32", doc="storage dtype of the Gated DeltaNet state in decode caches: "
                                   "float32 | bfloat16 (half the bytes a decode step moves; fp32 math either way; "
                                   "drift in docs/guides/benchmarks.md)")
    attention_implementation: str = setting("auto", doc="full-attention kernel: auto (cudnn on a GPU with "
                                            "bf16/fp16, else xla) | cudnn | xla")

    def model_problems(self) -> list[str]:
        """What is wrong with these keys, one message each (the composed config raises them with the others)."""
        return [m for m in (seed_problem(self.model_seed, "model_seed"),) if m]


def model_default(key: str) -> Any:
    """The default of a model setting (the compute fields of jaxrl.models.qwen35.config share them)."""
    return keys_of(ModelSettings)[key].default
