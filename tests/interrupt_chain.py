"""One process that runs `launchers.train` again and again in the same workdir, each time stopped by a real SIGINT
at a random moment of a training step, as a user's Ctrl-C would: the test of an interrupt chain runs this once
(one interpreter, one jax import, the compiled programs from the persistent cache) instead of paying a process
start per interrupt.

    python tests/interrupt_chain.py --interrupts=20 --seed=0 -- --workdir=W --config=configs/sft_tiny.py ...

Each run goes through launchers/_main.call, the launchers' own entry, with the signal handlers of
jaxrl.utils.interrupt; the signal is sent by a helper thread to this process (os.kill), and Python runs the
handler in the main thread, exactly where a terminal's Ctrl-C lands. The helper waits until the run has done a
step (a new line in metrics.jsonl: the program is compiled and the loop is stepping), then sleeps a random
fraction of up to two step durations. Prints one JSON line per run: exit status, the last stderr line, the
steps recorded in metrics.jsonl and the newest training state on disk.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import sys
import threading
import time
from contextlib import redirect_stderr

from absl import flags

from jaxrl.train.checkpoints import RunCheckpoints
from jaxrl.utils import interrupt
from launchers import _main
from launchers import train as train_launcher


def metric_lines(workdir: str) -> int:
    try:
        with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
            return sum(1 for line in f if line.endswith(b"\n"))
    except FileNotFoundError:
        return 0


def sigint_after_a_step(workdir: str, rng: random.Random, done: threading.Event) -> threading.Thread:
    start = metric_lines(workdir)

    def watch():
        t0, seen = None, start
        while not done.is_set():
            n = metric_lines(workdir)
            if n > seen:
                now = time.perf_counter()
                if t0 is None:  # the first step of this run is done: time the next one
                    t0, seen = now, n
                    continue
                step_s = (now - t0) / (n - seen)
                time.sleep(rng.uniform(0.0, 2.0 * step_s))
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.002)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def run_once(argv: list[str]) -> tuple[int, str]:
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:  # ml_collections defines them per parse
        delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
    rest = flags.FLAGS(argv)
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            status = _main.call(train_launcher.main, rest, "train", interruptible=True)
    except SystemExit as e:
        status = e.code
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    return int(status or 0), lines[-1] if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--interrupts", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("train_args", nargs="+")
    args = parser.parse_args()
    argv = ["train", *args.train_args]
    workdir = next(a.split("=", 1)[1] for a in argv if a.startswith("--workdir="))
    rng = random.Random(args.seed)
    for i in range(args.interrupts + 1):
        done = threading.Event()
        watcher = sigint_after_a_step(workdir, rng, done) if i < args.interrupts else None
        status, last = run_once(argv)
        done.set()
        if watcher is not None:
            watcher.join()
        interrupt.reset()
        ckpt = RunCheckpoints(workdir, async_save=False)
        latest = ckpt.latest_step()
        ckpt.close()
        print(json.dumps({"run": i, "status": status, "last_line": last, "metric_steps": metric_lines(workdir),
                          "latest_state": latest}), flush=True)
        if status != 130:
            break


if __name__ == "__main__":
    main()
