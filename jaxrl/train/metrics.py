"""Per-step metrics: `metrics.jsonl` and TensorBoard event files in the workdir, a console progress bar.

    writer = MetricsWriter(workdir, tensorboard=True)
    writer.write({"step": 3, "loss": 0.69, ...})       # one JSON line per step; numbers also to TensorBoard
    writer.truncate_after(step)                          # on resume: drop lines of steps that will be redone
    bar = Progress(total=steps, initial=start)          # tqdm with ETA on a terminal, log lines otherwise

`metrics.jsonl` lines hold `step` (train steps completed, 1-based: the line of step k describes the k-th step)
and every metric; non-finite floats are written as null (the `nonfinite_reason` field says what happened),
so every line is strict JSON. A line is written whole or not at all (a full disk cuts the file back to its last
complete line before the error is raised). Only process 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from absl import logging
from tqdm import tqdm

from jaxrl.data.formats import METRICS_FILE
from jaxrl.utils.io import append_whole, atomic_write_text, iter_json_lines, read_jsonl

TB_DIR = "tensorboard"
CONFIG_HISTORY = "config_history.jsonl"  # the settings of earlier step ranges of a run (jaxrl.train.loop)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """mirror: an object whose `log(record)` also gets every line and whose `close()` ends it with the writer
    (jaxrl.train.wandb_log.WandbMirror); None: the files only."""

    def __init__(self, workdir: str, tensorboard: bool = True, enabled: bool = True, mirror=None):
        self.enabled = enabled
        self.mirror = mirror
        self.path = os.path.join(workdir, METRICS_FILE)
        self._tb = None
        self._tb_dir = os.path.join(workdir, TB_DIR)
        self._want_tb = tensorboard
        self._file = None
        if enabled:
            os.makedirs(workdir, exist_ok=True)

    def _open(self):
        if self._file is None:
            self._file = open(self.path, "ab", buffering=0)  # unbuffered: append_whole writes whole lines
        if self._want_tb and self._tb is None:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(self._tb_dir)

    def truncate_after(self, step: int) -> None:
        """Keep only the lines of steps <= `step` (a resumed run redoes the later ones); atomic rewrite."""
        if not self.enabled or not os.path.exists(self.path):
            return
        self._close_files()
        kept = [line.text.strip() for line in iter_json_lines(self.path)  # a line torn by a kill is dropped
                if line.error is None and int(line.value.get("step", 0)) <= step]
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._open()
        record = _clean(record)
        append_whole(self._file.fileno(), (json.dumps(record, sort_keys=False) + "\n").encode("utf-8"), self.path)
        step = int(record["step"])
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
        if self.mirror is not None:
            self.mirror.log(record)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self._close_files()
        if self.mirror is not None:
            self.mirror.close()
            self.mirror = None

    def _close_files(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(workdir: str) -> list[dict]:
    """Every record of `<workdir>/metrics.jsonl`, in order."""
    return read_jsonl(os.path.join(workdir, METRICS_FILE))


class Progress:
    """A tqdm bar (steps, ETA, loss, learning rate) when stderr is a terminal; otherwise a log line every
    `log_every` steps with the same numbers and the ETA."""

    def __init__(self, total: int, initial: int = 0, log_every: int = 1, enabled: bool = True):
        self.total, self.log_every, self.enabled = total, max(1, int(log_every)), enabled
        self._bar = None
        self._start_time = time.time()
        self._start_step = initial
        if enabled and sys.stderr.isatty():
            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, step: int, record: dict) -> None:
        if not self.enabled:
            return
        loss = record.get("loss")
        lr = record.get("learning_rate")
        text = {"loss": f"{loss:.4g}" if isinstance(loss, float) else str(loss),
                "lr": f"{lr:.3g}" if isinstance(lr, float) else str(lr),
                "skipped": record.get("nonfinite_total", 0)}
        if self._bar is not None:
            self._bar.set_postfix(text, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        if step % self.log_every == 0 or step == self.total:
            done = step - self._start_step
            elapsed = time.time() - self._start_time
            eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
            logging.info("step %d/%d  loss %s  lr %s  skipped %s  tokens/s %.1f  ETA %.0f s", step, self.total,
                         text["loss"], text["lr"], text["skipped"], record.get("tokens_per_s") or 0.0, eta)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
