"""LoRA merged into the language tower and written back into the full checkpoint (docs §4.5): what vLLM serves.

    info = export_merged(adapter, base_dir, out_dir)

Each adapted weight becomes `W + scale * B @ A`, computed in fp32 from the base's stored W and cast back to that
tensor's stored dtype (bf16 for real checkpoints). Everything else is written by `qwen35.save_pretrained`
from the base folder: same shard files and index, same dtype per tensor, the vision tower, `mtp.*`, an untied
`lm_head`, config.json, tokenizer and chat-template files byte-identical. So vLLM never touches a LoRA code path
(§7 lists the ones that broke or silently did nothing for Qwen3.5).

The merged folder also holds `jaxrl_export.json` (source adapter, its digest, and the fingerprint of the merged
language tower, `jaxrl.export.audit.fingerprint`), so an evaluation of the folder can be traced back.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxrl.export.audit import FolderSource, fingerprint as fingerprint_of
from jaxrl.export.peft import PROVENANCE
from jaxrl.models import qwen35
from jaxrl.models.adapters import Adapter, AdapterError, check_against_model, merged_weight
from jaxrl.models.qwen35.checkpoint import read_weight_map
from jaxrl.models.qwen35.config import load_hf_config
from jaxrl.utils.io import atomic_folder

# safetensors dtype -> the jnp dtype that holds it exactly (for loading the base before writing it back).
_EXACT_LOAD = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def merge_transform(adapter: Adapter, tower_prefix: str) -> tuple[Callable[[str, np.ndarray], np.ndarray], dict]:
    """(tensor_transform for `save_pretrained`, {hf key: module} of the weights it must see).

    The transform records each key it merged in `transform.applied`, so the caller can prove every adapted
    weight was written (a key the base does not hold would otherwise be skipped silently).
    """
    targets = {f"{tower_prefix}{m}.weight": m for m in adapter.modules}
    applied: set[str] = set()

    def transform(key: str, value: np.ndarray) -> np.ndarray:
        module = targets.get(key)
        if module is None:
            return value
        applied.add(key)
        return merged_weight(value, adapter, module)

    transform.applied = applied  # type: ignore[attr-defined]
    return transform, targets


def exact_load_dtype(base_dir: str, tower_prefix: str) -> str:
    """The narrowest jnp dtype that holds every language-tower tensor of `base_dir` exactly (bf16 for an all-bf16
    checkpoint: half the memory of fp32, and still a bit-exact round trip)."""
    weight_map = read_weight_map(base_dir)
    dtypes = set()
    for fname in sorted(set(weight_map.values())):
        with safe_open(os.path.join(base_dir, fname), framework="numpy") as f:
            for key in f.keys():
                if key.startswith(tower_prefix) or key == "lm_head.weight":
                    dtypes.add(f.get_slice(key).get_dtype())
    if len(dtypes) == 1 and next(iter(dtypes)) in _EXACT_LOAD:
        return _EXACT_LOAD[dtypes.pop()]
    return "float32"  # mixed (or fp32) tensors: fp32 holds bf16, fp16 and fp32 values exactly


def export_merged(adapter: Adapter, base_dir: str, out_dir: str, *, overwrite: bool = False,
                  fingerprint: bool = True) -> dict:
    """Writes base + merged adapter as a full HF folder at `out_dir` (atomically); returns the provenance record
    (also written to `out_dir/jaxrl_export.json`)."""
    _, layout, _ = load_hf_config(base_dir)
    dtype = exact_load_dtype(base_dir, layout.tower_prefix)
    model = qwen35.from_pretrained(base_dir, dtype=getattr(jnp, dtype))
    check_against_model(adapter, model)
    transform, targets = merge_transform(adapter, layout.tower_prefix)
    info = {"format": "merged", "layout": layout.kind, "base": os.path.abspath(base_dir), "source": adapter.source,
            "step": adapter.step, "adapter_digest": adapter.digest(), "modules": len(adapter.modules),
            "rank": adapter.rank, "alpha": adapter.alpha, "use_rslora": adapter.use_rslora,
            "scale": adapter.scale, "load_dtype": dtype}
    with atomic_folder(out_dir, overwrite) as tmp:
        qwen35.save_pretrained(model, tmp, base_dir=base_dir, tensor_transform=transform)
        missing = sorted(set(targets) - transform.applied)
        if missing:
            raise AdapterError(f"{base_dir}: the merge never wrote {len(missing)} adapted weight(s), first "
                               f"{missing[0]!r}; nothing was exported")
        if fingerprint:
            info["fingerprint"] = fingerprint_of(FolderSource(tmp))
        with open(os.path.join(tmp, PROVENANCE), "w") as f:
            json.dump(info, f, indent=2)
    return info


def read_provenance(folder: str) -> Optional[dict]:
    """`jaxrl_export.json` of an exported folder, None when absent."""
    path = os.path.join(folder, PROVENANCE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
