"""The settings of `python -m launchers.convert` (Qwen3.5 weights between a Hugging Face folder and an Orbax params
folder: jaxrl.models.qwen35.checkpoint, jaxrl.models.qwen35.orbax_io): one dataclass whose fields are the
launcher's flags (jaxrl.utils.dataclass_flags makes them; `to`, `src` and `out` are required while absl parses).
Nothing here imports the model: the launcher defines its flags, and checks them, before it loads one."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxrl.utils.dataclass_flags import flag_field

__all__ = ["ConvertSettings"]


@dataclasses.dataclass(frozen=True)
class ConvertSettings:
    to: str = flag_field(help="Target format.", choices=("orbax", "hf"))
    src: str = flag_field(help="Source: an HF folder, or a jaxrl Orbax params folder (has jaxrl_model.json).")
    out: str = flag_field(help="Output folder.")
    base: Optional[str] = flag_field(None, help="For --to=hf: the HF folder whose layout, dtypes and non-language "
                                     "files to keep.")
    dtype: str = flag_field("float32", help="In-memory dtype while converting.", choices=("float32", "bfloat16"))
    overwrite: bool = flag_field(False, help="Replace an existing --out (once the new one is complete).")
