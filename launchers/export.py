r"""Export an adapter checkpoint as a PEFT adapter folder, or merged into a full checkpoint.

    # PEFT folder (adapter_model.safetensors + adapter_config.json), keys in the base's layout: what vLLM 0.33
    # serves as a LoRA adapter (vllm serve BASE --enable-lora --lora-modules NAME=DIR; docs/guides/vllm.md)
    python -m launchers.export --checkpoint=RUN_DIR --step=28 --base=/models/Qwen3.5-4B --out=RUN_DIR/export/peft_28
    # merged: the full container with the LoRA merged into the language tower (vision, mtp.*, configs and
    # tokenizer byte-identical to the base), for tools that cannot apply an adapter
    python -m launchers.export --checkpoint=RUN_DIR --step=28 --base=/models/Qwen3.5-4B --merge \
        --out=RUN_DIR/export/merged_28 [--merge_dtype=float32]

--checkpoint: a run workdir, its checkpoints/ or checkpoints/adapters/ folder, one adapters/<step> folder, or a
PEFT adapter folder (to merge an adapter trained elsewhere). --step picks a step (default: the newest).
--layout: the PEFT key layout; default the base's own (container: base_model.model.model.language_model.layers...,
text-only: base_model.model.model.layers...). The other layout is refused: PEFT would load it as a silent no-op
(vLLM 0.33 remaps it, vLLM 0.30 does not; docs/guides/vllm.md), unless --allow_layout_mismatch (only for a container you
will load with AutoModelForCausalLM).
--merge rounds each merged weight to the base's stored dtype (bf16): a small update is mostly rounded away. The
export measures it (merge_fidelity in jaxrl_export.json: update_rel_error, zeroed entries, probe logits) and warns
above 0.1; --merge_dtype=float32 keeps the merged weights in fp32 (serve them in fp32).
The output appears atomically (written to a temporary sibling, then renamed), readable by others (0644 under the
usual umask); an existing --out is replaced only with --overwrite. Both exports write jaxrl_export.json (source,
step, adapter digest; merged: the fingerprint of the merged language tower, see `python -m jaxrl.export.audit`).
"""

from __future__ import annotations

import json

from absl import app, flags

from launchers import _main

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Adapter checkpoint (workdir, checkpoints/, adapters/, "
                                  "adapters/<step>) or a PEFT adapter folder.")
_STEP = flags.DEFINE_integer("step", None, "Adapter step to export (default: the newest).")
_BASE = flags.DEFINE_string("base", None, "The base HF folder the adapter was trained on (default: the model_path "
                            "recorded in the adapter checkpoint).")
_OUT = flags.DEFINE_string("out", None, "Output folder.")
_MERGE = flags.DEFINE_bool("merge", False, "Write the merged full checkpoint instead of a PEFT adapter.")
_LAYOUT = flags.DEFINE_enum("layout", "auto", ["auto", "container", "text"], "PEFT key layout (auto: the base's).")
_ALLOW = flags.DEFINE_bool("allow_layout_mismatch", False, "Allow a PEFT layout other than the base's.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --out.")
_MERGE_DTYPE = flags.DEFINE_enum("merge_dtype", "stored", ["stored", "float32"], "--merge only: the dtype of the "
                                 "merged weights (stored: the base's, usually bf16, which rounds small updates "
                                 "away; float32: kept, serve in fp32).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for flag in (_CHECKPOINT, _OUT):
        if not flag.value:
            raise app.UsageError(f"--{flag.name} is required")
    from jaxrl.export import export_checkpoint
    # a refused export (wrong layout, foreign shapes, existing output...) is one line: launchers/_main.py
    info = export_checkpoint(_CHECKPOINT.value, _BASE.value, _OUT.value, step=_STEP.value,
                             merge=_MERGE.value, layout=_LAYOUT.value, allow_layout_mismatch=_ALLOW.value,
                             overwrite=_OVERWRITE.value,
                             merge_dtype=None if _MERGE_DTYPE.value == "stored" else _MERGE_DTYPE.value)
    print(json.dumps({"out": _OUT.value, **info}, indent=1))


if __name__ == "__main__":
    _main.run(main)
