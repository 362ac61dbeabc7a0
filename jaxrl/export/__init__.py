"""Adapter export (PEFT folders, merged full checkpoints) and the weight audit.

    from jaxrl.export import export_checkpoint
    export_checkpoint("run", base="Qwen3.5-4B", out="run/export/peft_28", step=28)              # PEFT folder
    export_checkpoint("run", base="Qwen3.5-4B", out="run/export/merged_28", step=28, merge=True)  # full folder

    # the exact weighted mean of several checkpoints (rank k r), or its rank-r truncated SVD; default out:
    # <run>/averages/avg_20-24-28 (where launchers.evaluate --checkpoints=run finds it)
    export_average("run", base=None, out=None, average="last:3")
    export_average("run", base=None, out=None, average=[20, 24, 28], weights=[1, 1, 2], rank=16)
    run_export(settings)    # an ExportSettings (the flags of launchers.export): whichever of the two it asks for

Modules: `audit` (fingerprints and tensor-level comparisons of any set of checkpoints), `merge` (LoRA merged into
the full container), `average` (averaged checkpoints as one adapter). The adapter formats live with the model:
the in-memory Adapter (trainer checkpoints, attach / detach on the JAX model) is `jaxrl.models.adapters`, the PEFT
folder layout (export and import, layout checks; `read_adapter` of any adapter folder) `jaxrl.models.peft`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

from jaxrl.export.average import average_checkpoints, average_name, average_steps
from jaxrl.export.merge import export_merged
from jaxrl.models.peft import export_peft, read_adapter
from jaxrl.models.adapters import AVERAGES, Adapter, run_folder
from jaxrl.utils.dataclass_flags import flag_field

LAYOUTS = ("auto", "container", "text")  # PEFT key layouts (jaxrl.models.peft); auto: the base's
MERGE_DTYPES = ("stored", "float32")  # merged weights: the base's stored dtype (merge_dtype None), or fp32


@dataclasses.dataclass(frozen=True)
class ExportSettings:
    """One export (launchers.export; its fields are the launcher's flags, jaxrl.utils.dataclass_flags): a step of
    `checkpoint`, or with `average` the weighted mean of several. `checkpoint` is required, and `out` without
    `average` (the launcher checks both)."""

    checkpoint: Optional[str] = flag_field(None, help="Adapter checkpoint (workdir, checkpoints/, adapters/, "
                                           "adapters/<step>) or a PEFT adapter folder.")
    step: Optional[int] = flag_field(None, help="Adapter step to export (default: the newest).")
    base: Optional[str] = flag_field(None, help="The base HF folder the adapter was trained on (default: the "
                                     "model_path recorded in the adapter checkpoint).")
    out: Optional[str] = flag_field(None, help="Output folder.")
    merge: bool = flag_field(False, help="Write the merged full checkpoint instead of a PEFT adapter.")
    layout: str = flag_field("auto", choices=LAYOUTS, help="PEFT key layout (auto: the base's).")
    allow_layout_mismatch: bool = flag_field(False, help="Allow a PEFT layout other than the base's.")
    overwrite: bool = flag_field(False, help="Replace an existing --out.")
    average: tuple[str, ...] = flag_field((), help="Export the weighted mean of these adapter steps (STEP,STEP,... "
                                          "or last:N) instead of one step.")
    average_weights: tuple[float, ...] = flag_field((), help="--average: one weight per step (normalised to sum 1; "
                                                    "default equal).")
    average_rank: Optional[int] = flag_field(None, help="--average: truncate the exact average (rank k*r) to this "
                                             "rank by SVD; its residual per module goes to jaxrl_export.json.")
    merge_dtype: str = flag_field("stored", choices=MERGE_DTYPES, help="--merge only: the dtype of the merged "
                                  "weights (stored: the base's, usually bf16, which rounds small updates away; "
                                  "float32: kept, serve in fp32).")



def run_export(settings: ExportSettings) -> dict:
    """The export `settings` asks for (`export_average` with `average`, else `export_checkpoint`); returns its
    provenance record."""
    common = dict(merge=settings.merge, layout=settings.layout, allow_layout_mismatch=settings.allow_layout_mismatch,
                  overwrite=settings.overwrite, merge_dtype=None if settings.merge_dtype == "stored" else
                  settings.merge_dtype)
    if settings.average:
        return export_average(settings.checkpoint, settings.base, settings.out, average=list(settings.average),
                              weights=list(settings.average_weights), rank=settings.average_rank, **common)
    return export_checkpoint(settings.checkpoint, settings.base, settings.out, step=settings.step, **common)


def export_checkpoint(checkpoint: str, base: Optional[str], out: str, *, step: Optional[int] = ExportSettings.step,
                      merge: bool = ExportSettings.merge, layout: str = ExportSettings.layout,
                      allow_layout_mismatch: bool = ExportSettings.allow_layout_mismatch,
                      overwrite: bool = ExportSettings.overwrite, merge_dtype: Optional[str] = None) -> dict:
    """What `python -m launchers.export` does; returns the provenance record written to `out/jaxrl_export.json`.

    checkpoint: a run workdir, its checkpoints/ or adapters/ folder, one adapters/<step> folder, or a PEFT folder.
    base: the base HF folder; None = the model_path recorded in the adapter checkpoint.
    layout: PEFT key layout, "auto" (the base's), "container" or "text" (see `jaxrl.models.peft`).
    merge_dtype: merged exports only: None (the base's stored dtype) or "float32" (`jaxrl.export.merge`).
    """
    return export_adapter(read_adapter(checkpoint, step), checkpoint, base, out, merge=merge, layout=layout,
                          allow_layout_mismatch=allow_layout_mismatch, overwrite=overwrite, merge_dtype=merge_dtype)


def export_average(checkpoint: str, base: Optional[str], out: Optional[str], *, average: Sequence[str] | str,
                   weights: Optional[Sequence[float]] = None, rank: Optional[int] = ExportSettings.average_rank,
                   merge: bool = ExportSettings.merge, layout: str = ExportSettings.layout,
                   allow_layout_mismatch: bool = ExportSettings.allow_layout_mismatch,
                   overwrite: bool = ExportSettings.overwrite, merge_dtype: Optional[str] = None) -> dict:
    """What `launchers.export --average` does: the weighted mean of the adapter checkpoints `average` names (step
    numbers or `last:N`) of the run at `checkpoint`, exact or truncated to `rank` (`jaxrl.export.average`),
    exported like one checkpoint; returns the provenance record (with `average`, and `out`).

    out: None = `<run>/averages/<name>` (`average_name`), where `launchers.evaluate --checkpoints=<run>` finds it;
      a merged export needs an explicit `out` (averages/ holds adapters).
    """
    steps = average_steps(checkpoint, average)
    if out is None:
        if merge:
            raise ValueError("--merge with --average needs --out (the run's averages/ folder holds PEFT adapters)")
        out = os.path.join(run_folder(checkpoint), AVERAGES, average_name(steps, weights, rank))
    adapter = average_checkpoints(checkpoint, steps, weights, rank)
    info = export_adapter(adapter, checkpoint, base, out, merge=merge, layout=layout,
                          allow_layout_mismatch=allow_layout_mismatch, overwrite=overwrite, merge_dtype=merge_dtype)
    return {**info, "out": os.path.abspath(out)}


def export_adapter(adapter: Adapter, checkpoint: str, base: Optional[str], out: str, *,
                   merge: bool = ExportSettings.merge, layout: str = ExportSettings.layout,
                   allow_layout_mismatch: bool = ExportSettings.allow_layout_mismatch,
                   overwrite: bool = ExportSettings.overwrite, merge_dtype: Optional[str] = None) -> dict:
    """`adapter` (read from `checkpoint`) written as a PEFT folder or merged into `base` at `out`."""
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
