r"""Run a sweep: every point of a sweep config, one folder each, one after the other on this machine.

    python -m launchers.sweep --sweep=configs/sweeps/dpo_tiny_losses.py --out=runs/tiny_sweep
    python -m launchers.sweep --sweep=configs/sweeps/dpo_tiny_losses.py --out=runs/tiny_sweep --dry_run
    # a cluster: one command per unfinished point (each does the same bookkeeping as a local run)
    python -m launchers.sweep --sweep=configs/sweeps/dpo_4b_lr_beta.py:pairs=PAIRS --out=runs/lr_beta \
        --print_commands | while read -r cmd; do sbatch --wrap="$cmd"; done
    python -m launchers.sweep --sweep=... --out=... --only=beta=0.05     # only points whose name contains it

The sweep config format, the folder layout and the resume rules: jaxrl/sweep/spec.py and jaxrl/sweep/runner.py.
Rerun the same command after an interruption: finished points are skipped, an interrupted point resumes from
its newest checkpoint, failed points are retried (--noretry_failed skips them). When the points are done the
comparison table is written (OUT/comparison.{md,csv,json}, OUT/report.html; see launchers/compare.py) and its
summary printed (OUT/comparison_summary.md: each recipe's evaluation and its difference to the baseline, with
intervals that survive the choice among them).
Exit status: 0 all selected points done, 1 some failed or still running elsewhere, 2 the sweep config is invalid
(a bad key, a type error, a malformed plug-in: nothing was trained), 130 / 143 on SIGINT / SIGTERM (passed on
to the running point, which checkpoints and stops; rerun the same command to resume).
"""

from __future__ import annotations

import sys

from absl import app

from jaxrl.sweep.flags import SweepSettings
from jaxrl.utils import dataclass_flags
from launchers import _main

_F = dataclass_flags.define_flags(SweepSettings)  # a flag per SweepSettings field


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    s = dataclass_flags.config_from_flags(SweepSettings, _F)
    if not s.sweep or not s.out:
        raise app.UsageError("--sweep and --out are required")
    if s.only and s.point:
        raise app.UsageError("give --only or --point, not both")
    if s.jobs < 1:
        raise app.UsageError(f"--jobs must be >= 1, got {s.jobs}")
    from jaxrl.sweep.runner import SweepRunner
    from jaxrl.sweep.spec import SweepError, load_sweep
    try:
        spec = load_sweep(s.sweep)
        # --print_commands: stdout is the list of commands (a scheduler reads it), so progress goes to stderr
        runner = SweepRunner(spec, s.out, jobs=s.jobs, compilation_cache=s.compilation_cache,
                             retry_failed=s.retry_failed, force=s.force,
                             echo=lambda m: print(m, flush=True, file=sys.stderr if s.print_commands else sys.stdout))
        if s.point and not any(p.slug == s.point for p in runner.select(s.point)):
            raise SweepError(f"--point={s.point!r} is not the exact slug of a point")
        only = s.point or s.only
        if s.dry_run:
            planned = runner.plan(only)
            print(f"{spec.where}: {len(planned)} point(s), base {spec.base}, axes "
                  + ", ".join(f"{a.name} ({len(a.labels)})" for a in spec.axes))
            for i, pp in enumerate(planned):
                state = "CONFIG CHANGED: " + "; ".join(pp.conflict[:4]) if pp.conflict else pp.state
                print(f"{i + 1:4d}  {state:8s}  {pp.point.slug}\n      {pp.point.name}")
            return 0
        if s.print_commands:
            planned = runner.plan(only)
            runner.prepare(planned)
            runner.run_prepare()  # the points' commands read what it makes
            runner.check_plugins([pp for pp in planned if pp.status["state"] != "done"])
            for pp in planned:
                if pp.status["state"] == "done":
                    print(f"# done: {pp.point.slug}", file=sys.stderr)
                else:
                    print(runner.point_command(pp.point.slug))
            return 0
        summary = runner.run(only)
    except SweepError as e:
        _main.fail("sweep", str(e), _main.EXIT_USAGE)
    print(f"sweep: {len(summary['done'])} done, {len(summary['failed'])} failed, "
          f"{len(summary['skipped'])} running elsewhere; folder {runner.out}", flush=True)
    if s.compare and summary["done"]:
        from jaxrl.sweep.report import write_comparison
        try:
            paths = write_comparison(runner.out)
            print("\n" + paths["summary"].read_text(encoding="utf-8"), flush=True)  # the verdict, in a few columns
            print("comparison: " + ", ".join(str(p) for p in paths.values()), flush=True)
        except (ValueError, KeyError, OSError) as e:  # the training results stand; say why the table is missing
            print(f"sweep: the comparison could not be written: {e}", file=sys.stderr, flush=True)
    return 0 if not summary["failed"] and not summary["skipped"] else 1


if __name__ == "__main__":
    _main.run(main, interruptible=True)
