"""Convert Qwen3.5 weights between a Hugging Face folder and an Orbax params folder.

    # HF -> Orbax (e.g. once per cluster, so every host restores its shards directly)
    python -m launchers.convert --to=orbax --src=/models/Qwen3.5-4B --out=/ckpt/qwen35_4b_orbax --dtype=bfloat16
    # Orbax -> HF (language tower written into the layout of --base; vision tower, mtp, tokenizer kept)
    python -m launchers.convert --to=hf --src=/ckpt/qwen35_4b_orbax --base=/models/Qwen3.5-4B --out=/models/out
    # HF -> HF round trip (a check that load + save is lossless for this folder)
    python -m launchers.convert --to=hf --src=/models/Qwen3.5-4B --base=/models/Qwen3.5-4B --out=/tmp/copy

The output appears atomically (written into a temporary sibling folder, then renamed); an existing --out is
refused before anything is loaded, unless --overwrite (then it is replaced only once the new one is complete).
Exit status 1 for refused work, 2 for usage errors (launchers/_main.py).
"""

from __future__ import annotations

import os

from absl import app

from jaxrl.models.qwen35.flags import ConvertSettings
from jaxrl.utils import dataclass_flags
from jaxrl.utils.io import OutputExistsError, atomic_folder
from launchers import _main

_F = dataclass_flags.define_flags(ConvertSettings, mark_required=True)  # --to, --src and --out: absl-required


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    s = dataclass_flags.config_from_flags(ConvertSettings, _F)
    if s.to == "hf" and not s.base:
        raise app.UsageError("--to=hf needs --base: the HF folder to take layout, dtypes and other files from")
    if not os.path.isdir(s.src):
        raise FileNotFoundError(f"{s.src}: no such folder (--src)")
    out = os.path.abspath(s.out)
    if os.path.abspath(s.src) == out or (s.base and os.path.abspath(s.base) == out):
        raise app.UsageError(f"--out={s.out} is the source; choose another folder")
    if os.path.exists(out) and not s.overwrite:  # before anything is loaded
        raise OutputExistsError(f"{out}: already exists; choose another --out, or pass --overwrite to replace it")
    import jax.numpy as jnp

    from jaxrl.models import qwen35
    from jaxrl.models.qwen35.orbax_io import META_FILE, load_orbax_params, save_orbax_params

    dtype = jnp.bfloat16 if s.dtype == "bfloat16" else jnp.float32
    src_is_orbax = os.path.isfile(os.path.join(s.src, META_FILE))
    if s.to == "hf":
        qwen35.config.load_hf_config(s.base)  # a --base that is no HF folder fails before the model loads
    model = (load_orbax_params(s.src, dtype=dtype) if src_is_orbax
             else qwen35.from_pretrained(s.src, dtype=dtype))
    with atomic_folder(out, overwrite=s.overwrite) as tmp:
        if s.to == "orbax":
            save_orbax_params(model, tmp, hf_source=None if src_is_orbax else os.path.abspath(s.src))
        else:
            qwen35.save_pretrained(model, tmp, base_dir=s.base)
    print(f"convert: wrote {s.to} to {s.out} ({sum(1 for _ in qwen35.checkpoint.base_params(model))} "
          f"tensors, dtype {s.dtype})")


if __name__ == "__main__":
    _main.run(main)
