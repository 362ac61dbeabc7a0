"""Per-step metrics: `metrics.jsonl` and TensorBoard event files in the workdir, a console progress bar.

    writer = MetricsWriter(workdir, tensorboard=True)
    writer.write({"step": 3, "loss": 0.69, ...})       # one JSON line per step; numbers also to TensorBoard
    writer.truncate_after(step)                          # on resume: drop lines of steps that will be redone
    bar = Progress(total=steps, initial=start)          # tqdm with ETA on a terminal, log lines otherwise

`metrics.jsonl` lines hold `step` (train steps completed, 1-based: the line of step k describes the k-th step)
and every metric; non-finite floats are written as null (the `nonfinite_reason` field says what happened),
so every line is strict JSON. A line is written whole or not at all (a full disk cuts the file back to its last
complete line before the error is raised). TensorBoard's events go through tensorboardX's writer thread: a thread
that died (a full disk) is an error at the next write, never a wait. Only process 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time

from absl import logging
from tqdm import tqdm

from jaxrl.data.formats import METRICS_FILE
from jaxrl.utils.io import append_whole, atomic_write_text, iter_json_lines, read_jsonl

TB_DIR = "tensorboard"
TB_QUEUE = 100_000  # the bound of tensorboardX's event queue: never reached (TB_BACKLOG)
TB_BACKLOG = 10_000  # events waiting for the writer thread before a write waits for them (a step logs ~100)
TB_STALL_S = 300.0  # how long a backlog may not drain before the writer is taken for hung
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
        self._tb_error = None  # what stopped TensorBoard's writer thread, if it stopped
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
            # a deep queue: with the writer thread checked before each event (`_tb_alive`), a put never waits on a
            # thread that died with a full queue
            self._tb = SummaryWriter(self._tb_dir, max_queue=TB_QUEUE)
            self._keep_tb_errors()

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
            self._check_tb(step)
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
        if self.mirror is not None:
            self.mirror.log(record)

    def _keep_tb_errors(self) -> None:
        """Keeps the error that stops tensorboardX's writer thread for the main thread, whose next write raises it
        (a full disk told as one, in one line); the thread itself then ends quietly instead of printing a
        traceback."""
        file_events = getattr(getattr(self._tb, "file_writer", None), "event_writer", None)
        events = getattr(file_events, "_ev_writer", None)
        for name in ("write_event", "flush"):
            method = getattr(events, name, None)
            if method is None:
                continue

            def kept(*args, _method=method, **kwargs):
                try:
                    return _method(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - kept for the main thread
                    self._tb_error = e
                    if threading.current_thread() is getattr(file_events, "_worker", None):
                        raise SystemExit from e  # ends the writer thread without a traceback (threading's rule)
                    raise

            setattr(events, name, kept)

    def _tb_alive(self) -> bool:
        """Whether TensorBoard's writer thread still runs (tensorboardX writes events on a thread of its own: one
        that died, of a full disk or a removed folder, would leave the run waiting on its queue for good)."""
        writer = getattr(getattr(self._tb, "file_writer", None), "event_writer", None)
        worker = getattr(writer, "_worker", None)
        return worker is None or worker.is_alive()

    def _abandon_tb(self) -> None:
        """Lets go of a TensorBoard writer that cannot write: closing it would wait on its dead thread, its
        multiprocessing queue's feeder thread (blocked on a pipe nobody reads) would hold the process at exit, and
        tensorboardX's own exit hook would flush into the full disk again and print the traceback."""
        events = getattr(getattr(self._tb, "file_writer", None), "event_writer", None)
        queue = getattr(events, "_event_queue", None)
        if queue is not None:
            queue.cancel_join_thread()
        if events is not None:
            events._closed = True  # its close() (the exit hook's) does nothing
        self._tb = None

    def _check_tb(self, step: int) -> None:
        """Before a record's events: the writer thread runs, and its backlog is under TB_BACKLOG (waited for while
        it drains), so no event waits on a full queue (tensorboardX's put blocks; a thread that died meanwhile
        would never free it). A dead thread, or a backlog that does not drain in TB_STALL_S, is an OSError."""
        queue = getattr(getattr(getattr(self._tb, "file_writer", None), "event_writer", None), "_event_queue", None)
        waited = time.monotonic()
        while True:
            if not self._tb_alive():
                self._abandon_tb()
                error = self._tb_error
                if isinstance(error, OSError) and error.errno:  # a full disk is told as one, naming the folder
                    raise OSError(error.errno, os.strerror(error.errno), self._tb_dir)
                raise OSError(f"{self._tb_dir}: TensorBoard's event writer stopped (a full disk or a removed "
                              f"folder?); {self.path} holds every step to {step}. Free the space and resume, or set "
                              "tensorboard=False")
            if queue is None or queue.qsize() < TB_BACKLOG:
                return
            if time.monotonic() - waited > TB_STALL_S:
                self._abandon_tb()
                raise OSError(f"{self._tb_dir}: TensorBoard's event writer has not written for {TB_STALL_S:.0f} s "
                              f"(a hung file system?); {self.path} holds every step to {step}")
            time.sleep(0.005)

    def flush(self) -> None:
        if self._tb is not None and self._tb_alive():
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
            try:
                if self._tb_alive():
                    self._tb.close()
                    self._tb = None
            except OSError as e:  # its last flush on a full disk: the error that stopped the run is already told
                logging.info("%s: TensorBoard's last events were not written: %s", self._tb_dir, e)
            if self._tb is not None:
                self._abandon_tb()


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
