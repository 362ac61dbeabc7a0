"""Weights & Biases mirror of a training run (the optional `wandb` extra: `pip install 'jaxrl[wandb]'`).

    python -m launchers.train --config=configs/dpo.py:... --workdir=runs/dpo28 \
        --config.logging.wandb_project=jaxrl-dpo [--config.logging.wandb_mode=offline]

    mirror = open_mirror(config, workdir, enabled=is_process_0)   # None when logging.wandb_project is empty
    mirror.log(record)                                             # what MetricsWriter.write writes, at its step
    mirror.close()

What is mirrored (process 0 only; metrics.jsonl stays the record of the run, W&B a view of it):
  * every metrics line, at its `step`: the numbers and booleans of the line (null, a non-finite value written as
    null, and text or list fields are left out; a checkpoint's extra line logs at the same step);
  * the resolved config (config.json's dict) as the run's config;
  * the run's artefact paths, as config `paths`: workdir, metrics.jsonl, config.json, checkpoints, TensorBoard.

The W&B run lives under `<logging.wandb_dir or workdir>/wandb/`. Its id is kept in `<workdir>/wandb_run_id`, so
a resumed run continues the same W&B run (resume="allow"); W&B keeps the first logging of a step, so the steps a
resume redoes (metrics.jsonl drops and rewrites them) keep their first values there. Offline mode
(`logging.wandb_mode=offline` or WANDB_MODE=offline) writes only local files; `wandb sync` uploads them later.
"""

from __future__ import annotations

import importlib
import math
import os
import secrets
from typing import Optional

from jaxrl.data.formats import CONFIG_FILE, METRICS_FILE
from jaxrl.models.adapters import CHECKPOINTS
from jaxrl.train.metrics import TB_DIR
from jaxrl.train.settings import TrainerConfig
from jaxrl.utils.io import atomic_write_text

RUN_ID_FILE = "wandb_run_id"
MODES = ("", "online", "offline", "disabled")


def loggable(record: dict) -> dict:
    """The fields of a metrics line W&B takes as scalars: finite numbers and booleans, `step` left out."""
    out = {}
    for key, value in record.items():
        if key == "step" or value is None or isinstance(value, (str, list, tuple, dict)):
            continue
        if isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, (int, float)) and math.isfinite(float(value)):
            out[key] = value
    return out


class WandbMirror:
    """One W&B run fed with a training run's metrics lines (module docstring)."""

    def __init__(self, run):
        self.run = run

    def log(self, record: dict) -> None:
        values = loggable(record)
        if values:
            self.run.log(values, step=int(record["step"]))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _wandb():
    """The wandb module, or ImportError saying how to install it (an optional dependency, imported on use)."""
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise ImportError("logging.wandb_project is set but wandb is not installed: pip install 'jaxrl[wandb]' "
                          "(or leave logging.wandb_project empty)") from None


def artefact_paths(workdir: str) -> dict:
    return {"workdir": os.path.abspath(workdir), "metrics": os.path.abspath(os.path.join(workdir, METRICS_FILE)),
            "config": os.path.abspath(os.path.join(workdir, CONFIG_FILE)),
            "checkpoints": os.path.abspath(os.path.join(workdir, CHECKPOINTS)),
            "tensorboard": os.path.abspath(os.path.join(workdir, TB_DIR))}


def open_mirror(config: TrainerConfig, workdir: str, enabled: bool = True) -> Optional[WandbMirror]:
    """A WandbMirror of the run in `workdir` when `config.logging.wandb_project` is set and `enabled` (process
    0), else None."""
    settings = config.logging
    if not enabled or not settings.wandb_project:
        return None
    wandb = _wandb()
    id_path = os.path.join(workdir, RUN_ID_FILE)
    if os.path.exists(id_path):
        with open(id_path) as f:
            run_id = f.read().strip()
    else:
        run_id = secrets.token_hex(6)
        os.makedirs(workdir, exist_ok=True)
        atomic_write_text(id_path, run_id + "\n")
    folder = settings.wandb_dir or workdir
    os.makedirs(folder, exist_ok=True)
    run = wandb.init(project=settings.wandb_project, entity=settings.wandb_entity or None,
                     name=settings.wandb_run_name or os.path.basename(os.path.abspath(workdir)),
                     group=settings.wandb_group or None, tags=list(settings.wandb_tags) or None,
                     mode=settings.wandb_mode or None, dir=folder, id=run_id, resume="allow",
                     config={**config.to_json(), "paths": artefact_paths(workdir)})
    return WandbMirror(run)
