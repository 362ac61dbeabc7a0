r"""`make demo-tasks`: a tiny Qwen3.5 learns a reasoning-gym task (one this project did not write) on a CPU: SFT
until partly right, then GRPO and on-policy distillation from that start, each run's checkpoints selected on dev
and the choice confirmed once on held-out.

    python -m launchers.demo_tasks --workdir=demo_tasks_workdir               # resumes an interrupted run
    python -m launchers.demo_tasks --workdir=/tmp/rg --seed=1                 # another seed (model, problems, sampling)
    python -m launchers.demo_tasks --workdir=/tmp/rg --task=basic_arithmetic \
        --task_config='{"min_terms": 2, "max_terms": 2, "max_digits": 1}'     # another task and its own config
    python -m launchers.demo_tasks --workdir=/tmp/rg --quick                  # fewer problems and steps (the test)

Stages and outputs: `jaxrl/demo_tasks.py`; the numbers: `<workdir>/results.md` and `recipe.json`; the curves and
the confirmed claims: `<workdir>/grpo/report.html`, `<workdir>/distill/report.html`. Needs the optional package
reasoning-gym (`pip install -e '.[tasks]'`; refused in one line without it).
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from jaxrl.demo_tasks_settings import STAGES, TasksDemoRunSettings
from jaxrl.utils import dataclass_flags
from launchers import _main

_F = dataclass_flags.define_flags(TasksDemoRunSettings)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = dataclass_flags.config_from_flags(TasksDemoRunSettings, _F)
    if run.until and run.until not in STAGES:
        raise app.UsageError(f"--until={run.until!r}: not a stage of the recipe; stages: {', '.join(STAGES)}")
    if run.quick_compiles and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        # as launchers.demo: dozens of tiny programs, each compiled once and run for milliseconds
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    if not flags.FLAGS.verbose:
        logging.set_verbosity(logging.WARNING)  # the recipe prints its own line per stage
    from jaxrl.data.reasoning_gym import require
    require()  # the missing extra, in one line, before anything is built
    from jaxrl.demo_tasks import TasksDemo
    summary = TasksDemo(run.workdir, run.demo_settings(), log=lambda m: print(m, flush=True)).run(run.until)
    if summary is None:
        print(f"\nstopped after the {run.until} stage; rerun without --until to go on: {run.workdir}")
    else:
        print("\n" + open(os.path.join(run.workdir, "results.md")).read())
        for name in ("grpo", "distill"):
            print(f"report: {os.path.join(run.workdir, name, 'report.html')}")
    return 0


if __name__ == "__main__":
    _main.run(main, interruptible=True)
