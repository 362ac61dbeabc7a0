"""Adapter export (PEFT folders, merged full checkpoints) and the weight audit.

    from jaxrl.export import export_checkpoint
    export_checkpoint("run", base="Qwen3.5-4B", out="run/export/peft_28", step=28)              # PEFT folder
    export_checkpoint("run", base="Qwen3.5-4B", out="run/export/merged_28", step=28, merge=True)  # full folder

Modules: `peft` (PEFT layout, export and import, layout checks; `read_adapter` of any adapter folder), `audit`
(fingerprints and tensor-level comparisons of any set of checkpoints), `merge` (LoRA merged into the full
container). The in-memory Adapter (trainer checkpoints, attach / detach on the JAX model) is
`jaxrl.models.adapters`.
"""

from __future__ import annotations

import os
from typing import Optional

from jaxrl.export.merge import export_merged
from jaxrl.export.peft import export_peft, read_adapter


def export_checkpoint(checkpoint: str, base: Optional[str], out: str, *, step: Optional[int] = None,
                      merge: bool = False, layout: str = "auto", allow_layout_mismatch: bool = False,
                      overwrite: bool = False, merge_dtype: Optional[str] = None) -> dict:
    """What `python -m launchers.export` does; returns the provenance record written to `out/jaxrl_export.json`.

    checkpoint: a run workdir, its checkpoints/ or adapters/ folder, one adapters/<step> folder, or a PEFT folder.
    base: the base HF folder; None = the model_path recorded in the adapter checkpoint.
    layout: PEFT key layout, "auto" (the base's), "container" or "text" (see `jaxrl.export.peft`).
    merge_dtype: merged exports only: None (the base's stored dtype) or "float32" (`jaxrl.export.merge`).
    """
    adapter = read_adapter(checkpoint, step)
    base = base or adapter.model_path  # the trainer records the base it trained on
    if not base or not os.path.isfile(os.path.join(base, "config.json")):
        raise ValueError(f"base {base!r} is not an HF model folder (the adapter at {checkpoint} names "
                         f"{adapter.model_path!r} as its base); pass --base=HF_DIR")
    if merge:
        if layout != "auto":
            raise ValueError("--layout applies to PEFT exports; a merged export keeps the base's layout")
        return export_merged(adapter, base, out, overwrite=overwrite, merge_dtype=merge_dtype)
    if merge_dtype is not None:
        raise ValueError("--merge_dtype applies to merged exports (--merge); a PEFT export keeps the fp32 factors")
    return export_peft(adapter, out, base, None if layout == "auto" else layout,
                       allow_layout_mismatch=allow_layout_mismatch, overwrite=overwrite)
