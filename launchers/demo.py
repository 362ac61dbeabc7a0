r"""`make demo`: the whole pipeline on an embedded tiny Qwen3.5, no network, minutes on two CPU cores.

    python -m launchers.demo --workdir=demo_workdir            # resumes an interrupted demo
    python -m launchers.demo --workdir=demo_workdir --fresh    # starts over (only in a folder the demo made)
    python -m launchers.demo --workdir=/tmp/d --quick          # smaller stages (the tests use this)
    python -m launchers.demo --workdir=/tmp/d --until=warm_up  # only the model, the tasks and M0 (what
                                                               # configs/grpo_demo.py trains on)

Stages and outputs: `jaxrl/demo.py`. --fresh deletes --workdir only when the demo made it (its `.jaxrl-demo` mark
is in it); any other folder is refused, untouched. Ends by printing where report.html is. Ctrl-C: the stage
running stops at its next safe point (exit status 130); rerun the same command to resume.
"""

from __future__ import annotations

import os
import shutil

from absl import app, flags, logging

from jaxrl.demo_settings import MARKER, STAGES, DemoRunSettings
from jaxrl.utils import dataclass_flags
from launchers import _main

_F = dataclass_flags.define_flags(DemoRunSettings)  # a flag per DemoRunSettings field


def _quick_compiles() -> None:
    """The demo compiles dozens of programs of a 2-layer, hidden-64 model and runs each for milliseconds, so at
    -O0 its compiles save more time than its training steps (thousands of small operations each) lose (measured
    in benchmarks/RESULTS.md, section 'Idle machine, late on 2026-12-01'). XLA reads XLA_FLAGS when its first
    backend starts, which is after this point."""
    current = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in current:
        os.environ["XLA_FLAGS"] = f"{current} --xla_backend_optimization_level=0".strip()


def _clear(workdir: str, marker: str) -> None:
    """Deletes `workdir` for --fresh: only a folder the demo made (its mark in it) or an empty one; anything else is
    refused (FileExistsError naming it) with the folder untouched."""
    if not os.path.lexists(workdir):
        return
    if os.path.islink(workdir) or not os.path.isdir(workdir):
        raise FileExistsError(f"--workdir={workdir}: not a folder the demo made (a file or a link); --fresh deletes "
                              "only those: choose another --workdir")
    if os.listdir(workdir) and not os.path.isfile(os.path.join(workdir, marker)):
        raise FileExistsError(f"--workdir={workdir}: not a folder the demo made (no {marker} in it); --fresh deletes "
                              "only those: choose another --workdir, or delete this folder yourself")
    shutil.rmtree(workdir)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = dataclass_flags.config_from_flags(DemoRunSettings, _F)
    if run.until and run.until not in STAGES:
        raise app.UsageError(f"--until={run.until!r}: not a stage of the demo; stages: {', '.join(STAGES)}")
    if run.quick_compiles:
        _quick_compiles()
    if not flags.FLAGS.verbose:
        logging.set_verbosity(logging.WARNING)  # the demo prints its own one-line-per-stage progress
    if run.fresh:
        _clear(run.workdir, MARKER)
    from jaxrl.demo import Demo
    report = Demo(run.workdir, run.demo_settings(), log=lambda m: print(m, flush=True)).run(run.until)
    if report is None:
        print(f"\nstopped after the {run.until} stage; rerun without --until to go on: {run.workdir}")
    else:
        print(f"\nreport: {report}\nopen it in a browser (file://{os.path.abspath(report)})")
    return 0


if __name__ == "__main__":
    _main.run(main, interruptible=True)
