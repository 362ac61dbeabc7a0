r"""Export an adapter checkpoint as a PEFT adapter folder, or merged into a full checkpoint.

    # PEFT folder (adapter_model.safetensors + adapter_config.json), keys in the base's layout: what vLLM 0.33
    # serves as a LoRA adapter (vllm serve BASE --enable-lora --lora-modules NAME=DIR; docs/guides/vllm.md)
    python -m launchers.export --checkpoint=RUN_DIR --step=28 --base=/models/Qwen3.5-4B --out=RUN_DIR/export/peft_28
    # merged: the full container with the LoRA merged into the language tower (vision, mtp.*, configs and
    # tokenizer byte-identical to the base), for tools that cannot apply an adapter
    python -m launchers.export --checkpoint=RUN_DIR --step=28 --base=/models/Qwen3.5-4B --merge \
        --out=RUN_DIR/export/merged_28 [--merge_dtype=float32]

    # the exact average of checkpoints, one adapter (rank: the sum of theirs), or its rank-16 truncated SVD;
    # written to RUN_DIR/averages/avg_20-24-28[_r16] (where launchers.evaluate --checkpoints=RUN_DIR finds it)
    python -m launchers.export --checkpoint=RUN_DIR --average=20,24,28 [--average_weights=1,1,2]
    python -m launchers.export --checkpoint=RUN_DIR --average=last:3 --average_rank=16

--checkpoint: a run workdir, its checkpoints/ or checkpoints/adapters/ folder (checkpoints/ema/: the EMA adapters of
a run with ema.decay set), one adapters/<step> folder, or a PEFT adapter folder (to merge an adapter trained
elsewhere). --step picks a step (default: the newest).
--average: instead of one step, the weighted mean of several (STEP,STEP,... or last:N; jaxrl.export.average):
its merged update is exactly the mean of theirs (the mean of the products B A, not of the factors), an adapter of
rank k*r; --average_rank=r writes its best rank-r approximation instead, with each module's relative residual in
jaxrl_export.json (a warning names the worst one above 0.1). --out defaults to RUN_DIR/averages/<name>; --merge
merges the average like any adapter (with --out).
--layout: the PEFT key layout; default the base's own (container: base_model.model.model.language_model.layers...,
text-only: base_model.model.model.layers...). The other layout is refused: PEFT would load it as a silent no-op
(vLLM 0.33 remaps it, vLLM 0.30 does not; docs/guides/vllm.md), unless --allow_layout_mismatch (only for a container you
will load with AutoModelForCausalLM).
--merge rounds each merged weight to the base's stored dtype (bf16): a small update is mostly rounded away. The
export measures it (merge_fidelity in jaxrl_export.json: update_rel_error, zeroed entries, probe logits) and warns
above 0.1; --merge_dtype=float32 keeps the merged weights in fp32 (serve them in fp32).
The output appears atomically (written to a temporary sibling, then renamed), readable by others (0644 under the
usual umask); an existing --out is replaced only with --overwrite (a symlink --out: the link is replaced, never
its target). One export per --out at a time (a lock beside it); what a killed export left there (its temporary
`.NAME.tmp-*` folder, a `.NAME.old-*` previous version) is cleaned by the next one. Prints one summary line; the
whole record is in OUT/jaxrl_export.json. Both exports write jaxrl_export.json (source,
step, adapter digest; merged: the fingerprint of the merged language tower, see `python -m jaxrl.export.audit`).
"""

from __future__ import annotations

import os

from absl import app

from jaxrl.export import ExportSettings, run_export
from jaxrl.utils import dataclass_flags
from launchers import _main

_F = dataclass_flags.define_flags(ExportSettings)  # a flag per ExportSettings field


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    s = dataclass_flags.config_from_flags(ExportSettings, _F)  # --average_weights: numbers
    for name in ("checkpoint",) if s.average else ("checkpoint", "out"):
        if not getattr(s, name):
            raise app.UsageError(f"--{name} is required")
    if not s.average:
        for name in ("average_weights", "average_rank"):
            if _F[name].present:
                raise app.UsageError(f"--{name} goes with --average")
    elif s.step is not None:
        raise app.UsageError("--step and --average exclude each other (--average=STEP,STEP,... names the steps)")
    # a refused export (wrong layout, foreign shapes, existing output...) is one line: launchers/_main.py
    info = run_export(s)
    print(summary_line(info.get("out") or s.out, info))


def summary_line(out: str, info: dict) -> str:
    """One line saying what was written (the full record: OUT/jaxrl_export.json)."""
    what = "merged checkpoint" if info["format"] == "merged" else "PEFT adapter"
    average = info.get("average")
    if average:
        steps = ", ".join(map(str, average["steps"]))
        step = (f"the exact average of steps {steps}" if "residual" not in average else
                f"the rank-{average['rank']} average of steps {steps} (max residual "
                f"{average['residual']['max']:.3g})")
    else:
        step = f"step {info['step']}" if info.get("step") is not None else "the adapter"
    line = (f"export: wrote the {what} of {step} to {os.path.abspath(out)} ({info['modules']} modules, rank "
            f"{info['rank']}, adapter digest {info['adapter_digest'][:12]}")
    fidelity = info.get("merge_fidelity")
    if fidelity:
        line += (f"; merged in {info.get('merge_dtype')}, update_rel_error {fidelity['update_rel_error']:.3g}"
                 + (f", fingerprint {info['fingerprint'][:12]}" if info.get("fingerprint") else ""))
    return line + "); details in jaxrl_export.json"


if __name__ == "__main__":
    _main.run(main)
