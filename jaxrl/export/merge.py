"""LoRA merged into the language tower and written back into the full checkpoint (docs §4.5), with a measure of
what the merge kept of the adapter.

    info = export_merged(adapter, base_dir, out_dir)                        # adapted weights in the stored dtype
    info = export_merged(adapter, base_dir, out_dir, merge_dtype="float32")  # adapted weights kept in fp32
    info["merge_fidelity"]["update_rel_error"]                              # also in out_dir/jaxrl_export.json

Each adapted weight becomes `W + scale * B @ A`, computed in fp32 from the base's stored W and cast to the
stored dtype of that tensor (bf16 for real checkpoints), or kept in fp32 with `merge_dtype="float32"`. Everything
else is written by `qwen35.save_pretrained` from the base folder: same shard files and index, same dtype per
tensor, the vision tower, `mtp.*`, an untied `lm_head`, config.json, tokenizer and chat-template files
byte-identical.

**Rounding.** `bf16(W + s*B*A)` keeps little of an update that is small next to W: bf16 has 8 mantissa bits, so
an entry of the update below about 2^-9 of its weight entry rounds away. At an update of 0.1% of the weight norm
most of the update is lost (measured: `tests/test_merge_fidelity.py`). Serving the folder cannot undo that. So
every merged export measures it and records it as `merge_fidelity` in `jaxrl_export.json`:

    update_rel_error   ||(merged - W) - s*B*A|| / ||s*B*A|| over all adapted weights (0 = the update is kept)
    zeroed_fraction    share of the update's non-zero entries whose merged value equals the base weight
    modules            the same two per module, plus update_rel_norm = ||s*B*A|| / ||W||
    logits             a probe batch (PROBE_SHAPE random token ids, PROBE_SEED) through the base, the base with
                       the adapter attached unmerged (what the jax backend and vLLM LoRA serve) and the merged
                       folder as written, computed in fp32 (exact on the stored values, so only the merge's
                       rounding differs): rel_error = ||effect_merged - effect_adapter|| / ||effect_adapter||
                       (effect = logits - base logits), cosine of the two effects, max |logits_merged -
                       logits_adapter|

A warning is logged when update_rel_error exceeds FIDELITY_WARN. `merge_dtype="float32"` keeps the update (the
adapted tensors are stored in fp32, the rest as in the base); a server must then compute in fp32 (`vllm serve
--dtype float32`, `qwen35.from_pretrained(dtype=float32)`), since loading fp32 tensors into a bf16 model rounds
them again. Serving the PEFT adapter unmerged (`jaxrl.backends`, docs/guides/vllm.md) avoids the question.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxrl.export.audit import FolderSource, fingerprint as fingerprint_of
from jaxrl.models.peft import PROVENANCE
from jaxrl.models import qwen35
from jaxrl.models.adapters import Adapter, AdapterError, attach, check_against_model, merged_weight
from jaxrl.models.qwen35.checkpoint import read_weight_map
from jaxrl.models.qwen35.config import load_hf_config
from jaxrl.utils.io import atomic_folder

logger = logging.getLogger(__name__)

# safetensors dtype -> the jnp dtype that holds it exactly (for loading the base before writing it back).
_EXACT_LOAD = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
MERGE_DTYPES = (None, "float32")  # None: each adapted tensor keeps the base's stored dtype
FIDELITY_WARN = 0.1  # update_rel_error above which an export warns
PROBE_SHAPE, PROBE_SEED = (2, 16), 0


class UpdateFidelity:
    """Accumulates how much of each module's update `s*B*A` a merge kept (module docstring)."""

    def __init__(self):
        self.modules: dict[str, dict] = {}
        self._err2 = self._delta2 = 0.0
        self._zeroed = self._nonzero = 0

    def add(self, module: str, base_value: np.ndarray, merged_value: np.ndarray, delta: np.ndarray) -> None:
        base = base_value.astype(np.float64)
        kept = merged_value.astype(np.float64) - base
        delta = delta.astype(np.float64)
        err2, delta2 = float(np.sum((kept - delta) ** 2)), float(np.sum(delta ** 2))
        nonzero = delta != 0
        zeroed = int(np.count_nonzero((kept == 0) & nonzero))
        n_nonzero = int(np.count_nonzero(nonzero))
        base_norm = float(np.linalg.norm(base.ravel()))
        self.modules[module] = {
            "update_rel_error": (err2 ** 0.5) / (delta2 ** 0.5) if delta2 > 0 else 0.0,
            "zeroed_fraction": zeroed / n_nonzero if n_nonzero else 0.0,
            "update_rel_norm": (delta2 ** 0.5) / base_norm if base_norm > 0 else None}
        self._err2 += err2
        self._delta2 += delta2
        self._zeroed += zeroed
        self._nonzero += n_nonzero

    def summary(self) -> dict:
        worst = max(self.modules, key=lambda m: self.modules[m]["update_rel_error"], default=None)
        return {"update_rel_error": (self._err2 ** 0.5) / (self._delta2 ** 0.5) if self._delta2 > 0 else 0.0,
                "zeroed_fraction": self._zeroed / self._nonzero if self._nonzero else 0.0,
                "worst_module": worst, "modules": dict(self.modules)}


def merge_transform(adapter: Adapter, tower_prefix: str, merge_dtype: Optional[str] = None,
                    fidelity: Optional[UpdateFidelity] = None
                    ) -> tuple[Callable[[str, np.ndarray], np.ndarray], dict]:
    """(tensor_transform for `save_pretrained`, {hf key: module} of the weights it must see).

    The transform records each key it merged in `transform.applied`, so the caller can prove every adapted
    weight was written (a key the base does not hold would otherwise be skipped silently), and what each merge
    kept of its update in `fidelity`.
    """
    targets = {f"{tower_prefix}{m}.weight": m for m in adapter.modules}
    applied: set[str] = set()

    def transform(key: str, value: np.ndarray) -> np.ndarray:
        module = targets.get(key)
        if module is None:
            return value
        applied.add(key)
        merged = merged_weight(value, adapter, module, merge_dtype)
        if fidelity is not None:
            fidelity.add(module, value, merged, adapter.delta(module))
        return merged

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


def probe_logits(base_dir: str, merged_dir: str, adapter: Adapter) -> dict:
    """The `logits` entry of merge_fidelity (module docstring): the probe batch through the base, the base with the
    adapter attached unmerged, and the merged folder as written, all computed in fp32 (which holds every stored
    value exactly), so the differences are the merge's rounding alone. One fp32 model in memory at a time."""

    def run(model):
        graphdef, state = nnx.split(model)
        return np.asarray(jax.jit(lambda s: nnx.merge(graphdef, s)(ids).astype(jnp.float32))(state), np.float64)

    model = qwen35.from_pretrained(base_dir, dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(PROBE_SEED).integers(0, model.config.vocab_size, PROBE_SHAPE),
                      jnp.int32)
    base = run(model)
    attach(model, adapter)
    unmerged = run(model)
    del model
    gc.collect()
    merged = run(qwen35.from_pretrained(merged_dir, dtype=jnp.float32))
    effect_adapter, effect_merged = unmerged - base, merged - base
    norm = float(np.linalg.norm(effect_adapter))
    cos_den = norm * float(np.linalg.norm(effect_merged))
    return {"rel_error": float(np.linalg.norm(effect_merged - effect_adapter)) / norm if norm > 0 else 0.0,
            "cosine": float(np.sum(effect_merged * effect_adapter)) / cos_den if cos_den > 0 else None,
            "max_abs_diff": float(np.max(np.abs(merged - unmerged))),
            "adapter_effect_max_abs": float(np.max(np.abs(effect_adapter))),
            "probe": {"shape": list(PROBE_SHAPE), "seed": PROBE_SEED, "compute_dtype": "float32"}}


def export_merged(adapter: Adapter, base_dir: str, out_dir: str, *, overwrite: bool = False,
                  fingerprint: bool = True, merge_dtype: Optional[str] = None, probe: bool = True,
                  warn_above: float = FIDELITY_WARN) -> dict:
    """Writes base + merged adapter as a full HF folder at `out_dir` (atomically); returns the provenance record
    (also written to `out_dir/jaxrl_export.json`), with `merge_fidelity` (module docstring).

    merge_dtype: None (the adapted tensors keep the base's stored dtype) or "float32".
    probe: also run the probe batch (three fp32 forward passes; needs 4 bytes per parameter of memory, one model at a
      time; off = no `logits` entry).
    """

    if merge_dtype not in MERGE_DTYPES:
        raise ValueError(f"merge_dtype must be one of {MERGE_DTYPES} (None: the base's stored dtype), got "
                         f"{merge_dtype!r}")
    _, layout, _ = load_hf_config(base_dir)
    dtype = exact_load_dtype(base_dir, layout.tower_prefix)
    model = qwen35.from_pretrained(base_dir, dtype=getattr(jnp, dtype))
    check_against_model(adapter, model)
    fidelity = UpdateFidelity()
    transform, targets = merge_transform(adapter, layout.tower_prefix, merge_dtype, fidelity)
    info = {"format": "merged", "layout": layout.kind, "base": os.path.abspath(base_dir), "source": adapter.source,
            "step": adapter.step, "adapter_digest": adapter.digest(), "modules": len(adapter.modules),
            "rank": adapter.rank, "alpha": adapter.alpha, "use_rslora": adapter.use_rslora,
            "scale": adapter.scale, "load_dtype": dtype, "merge_dtype": merge_dtype or "stored"}
    if adapter.average is not None:  # an averaged adapter (jaxrl.export.average): what it averages
        info["average"] = adapter.average
    with atomic_folder(out_dir, overwrite) as tmp:
        qwen35.save_pretrained(model, tmp, base_dir=base_dir, tensor_transform=transform,
                               keep_transform_dtype=merge_dtype is not None)
        missing = sorted(set(targets) - transform.applied)
        if missing:
            raise AdapterError(f"{base_dir}: the merge never wrote {len(missing)} adapted weight(s), first "
                               f"{missing[0]!r}; nothing was exported")
        info["merge_fidelity"] = fidelity.summary()
        if probe:
            del model  # the probe holds one fp32 model at a time
            info["merge_fidelity"]["logits"] = probe_logits(base_dir, tmp, adapter)
        if fingerprint:
            info["fingerprint"] = fingerprint_of(FolderSource(tmp))
        with open(os.path.join(tmp, PROVENANCE), "w") as f:
            json.dump(info, f, indent=2)
    error = info["merge_fidelity"]["update_rel_error"]
    if error > warn_above:
        logger.warning("%s: the merge into %s kept the adapter's update only approximately: update_rel_error %.3g "
                       "(%.0f%% of its entries rounded to zero; worst module %s). The merged model is not the "
                       "checkpoint; serve the PEFT adapter unmerged, or export with merge_dtype=float32 "
                       "(--merge_dtype=float32) and serve in fp32", out_dir, merge_dtype or "the stored dtype",
                       error, 100 * info["merge_fidelity"]["zeroed_fraction"],
                       info["merge_fidelity"]["worst_module"])
    return info


def is_lossy(info: Optional[dict], threshold: float = FIDELITY_WARN) -> bool:
    """Whether a provenance record (`read_provenance`) describes a merged export whose merge lost more than
    `threshold` of its adapter's update."""
    fidelity = (info or {}).get("merge_fidelity") or {}
    return (info or {}).get("format") == "merged" and float(fidelity.get("update_rel_error", 0.0)) > threshold


def read_provenance(folder: str) -> Optional[dict]:
    """`jaxrl_export.json` of an exported folder, None when absent."""
    path = os.path.join(folder, PROVENANCE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
