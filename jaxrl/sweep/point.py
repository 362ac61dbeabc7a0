"""The subprocess of one sweep point (started by jaxrl.sweep.runner; not meant to be run by hand).

    python -m jaxrl.sweep.point train POINT_DIR                 # run_training(POINT_DIR/config.json, POINT_DIR)
    python -m jaxrl.sweep.point evaluate POINT_DIR -- FLAGS...  # launchers.evaluate with FLAGS

Both first start a watchdog thread that kills this process as soon as the sweep process that started it is gone
(its parent pid changes): a killed sweep must not leave a training running that the resumed sweep would race
with in the same folder. A process killed this way is resumable like any killed `launchers.train` run.
SIGINT / SIGTERM (passed on by the sweep): the step finishes, its checkpoint is written, exit status 130 / 143
(jaxrl.utils.interrupt), as launchers.train.
Exit status of `train`: 0 done, 3 too many non-finite updates (as launchers.train), 2 a PluginError, 1 other.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading
import time

import ml_collections
from absl import app

from jaxrl.algorithms.run import run_training
from jaxrl.train.loop import NonFiniteError
from jaxrl.utils import interrupt
from jaxrl.utils.logs import install_log_filters, quiet_libraries
from jaxrl.utils.registry import PluginError


def start_watchdog(interval_s: float = 0.5) -> None:
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                print(f"sweep process {parent} is gone: stopping this point (it resumes on the next run)",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="sweep-watchdog", daemon=True).start()


def _debug_pause_hook():
    """TESTS ONLY: JAXRL_SWEEP_DEBUG_PAUSE="SUBSTRING@STEP" makes the point whose slug contains SUBSTRING stop
    after the checkpoint of STEP is on disk and wait there, so a test can kill the sweep mid-point
    deterministically (the steps of the toy task take milliseconds)."""
    spec = os.environ.get("JAXRL_SWEEP_DEBUG_PAUSE", "")
    substring, _, step = spec.rpartition("@")
    if not spec or substring not in os.environ.get("JAXRL_SWEEP_POINT", ""):
        return None

    def hook(done: int, trainer) -> None:
        if done == int(step):
            trainer.ckpt.wait()
            print(f"PAUSED after step {done}", flush=True)
            time.sleep(3600)

    return hook


def train(point_dir: str) -> int:
    """run_training on the point's resolved config; runs under absl's app.run (logging set up as launchers.train)."""
    code = []

    def run(argv):
        del argv
        install_log_filters()
        quiet_libraries(os.environ.get("JAXRL_VERBOSE") == "1")
        interrupt.install()
        with open(os.path.join(point_dir, "config.json"), encoding="utf-8") as f:
            config = ml_collections.ConfigDict(json.load(f))
        try:
            result = run_training(config, point_dir, on_step_end=_debug_pause_hook())
        except PluginError as e:
            print(f"PluginError: {e}", file=sys.stderr, flush=True)
            code.append(2)
            return
        except NonFiniteError as e:
            print(f"ERROR: {e}", file=sys.stderr, flush=True)
            code.append(3)
            return
        except interrupt.Interrupted as e:
            print(f"{interrupt.signal_name(e.signum)}: {e}", file=sys.stderr, flush=True)
            code.append(e.exit_status)
            return
        print(f"done: {result.final_step} steps", flush=True)
        code.append(0)

    try:
        app.run(run, argv=[sys.argv[0]])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    return code[0] if code else 1


def evaluate(point_dir: str, flags: list[str]) -> int:
    sys.argv = ["launchers.evaluate"] + flags
    try:
        runpy.run_module("launchers.evaluate", run_name="__main__", alter_sys=True)
    except SystemExit as e:  # absl's app.run exits; keep its status
        code = e.code
        if isinstance(code, str):
            print(code, file=sys.stderr, flush=True)
            return 1
        return int(code or 0)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("train", "evaluate"):
        print(__doc__, file=sys.stderr)
        return 1
    start_watchdog()
    what, point_dir, rest = argv[0], argv[1], argv[2:]
    if what == "train":
        return train(point_dir)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    return evaluate(point_dir, rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
