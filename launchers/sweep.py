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
comparison table is written (OUT/comparison.{md,csv,json}, OUT/report.html; see launchers/compare.py).
Exit status: 0 all selected points done, 1 some failed or still running elsewhere, 2 the sweep config is invalid
(a bad key, a type error, a malformed plug-in: nothing was trained), 130 / 143 on SIGINT / SIGTERM (passed on
to the running point, which checkpoints and stops; rerun the same command to resume).
"""

from __future__ import annotations

import sys

from absl import app, flags

from launchers import _main

_SWEEP = flags.DEFINE_string("sweep", None, "Sweep config: path/to/sweep.py[:arg] (get_sweep()).")
_OUT = flags.DEFINE_string("out", None, "Sweep folder: one subfolder per point, sweep.json, the comparison.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "List the points (name, folder, state) and exit; writes nothing.")
_PRINT = flags.DEFINE_bool("print_commands", False, "Print one shell command per unfinished point (for a cluster "
                           "scheduler) and exit.")
_ONLY = flags.DEFINE_string("only", None, "Only the points whose slug or name contains this string.")
_POINT = flags.DEFINE_string("point", None, "Only the point with this exact slug (what --print_commands emits).")
_JOBS = flags.DEFINE_integer("jobs", 1, "Points run at the same time on this machine (1 on an accelerator).")
_CACHE = flags.DEFINE_string("compilation_cache", None, "JAX persistent compilation cache shared by the points "
                             "(default OUT/.jax_cache; '' = off).")
_RETRY = flags.DEFINE_bool("retry_failed", True, "Rerun points whose last attempt failed.")
_FORCE = flags.DEFINE_bool("force", False, "Also run points marked running by a process on another host.")
_COMPARE = flags.DEFINE_bool("compare", True, "Write the comparison table and report after running.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _SWEEP.value or not _OUT.value:
        raise app.UsageError("--sweep and --out are required")
    if _ONLY.value and _POINT.value:
        raise app.UsageError("give --only or --point, not both")
    if _JOBS.value < 1:
        raise app.UsageError(f"--jobs must be >= 1, got {_JOBS.value}")
    from jaxrl.sweep.runner import SweepRunner
    from jaxrl.sweep.spec import SweepError, load_sweep
    try:
        spec = load_sweep(_SWEEP.value)
        runner = SweepRunner(spec, _OUT.value, jobs=_JOBS.value, compilation_cache=_CACHE.value,
                             retry_failed=_RETRY.value, force=_FORCE.value)
        if _POINT.value and not any(p.slug == _POINT.value for p in runner.select(_POINT.value)):
            raise SweepError(f"--point={_POINT.value!r} is not the exact slug of a point")
        only = _POINT.value or _ONLY.value
        if _DRY_RUN.value:
            planned = runner.plan(only)
            print(f"{spec.where}: {len(planned)} point(s), base {spec.base}, axes "
                  + ", ".join(f"{a.name} ({len(a.labels)})" for a in spec.axes))
            for i, pp in enumerate(planned):
                state = "CONFIG CHANGED: " + "; ".join(pp.conflict[:4]) if pp.conflict else pp.state
                print(f"{i + 1:4d}  {state:8s}  {pp.point.slug}\n      {pp.point.name}")
            return 0
        if _PRINT.value:
            planned = runner.plan(only)
            runner.prepare(planned)
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
    if _COMPARE.value and summary["done"]:
        from jaxrl.sweep.report import write_comparison
        try:
            paths = write_comparison(runner.out)
            print("comparison: " + ", ".join(str(p) for p in paths.values()), flush=True)
        except (ValueError, KeyError, OSError) as e:  # the training results stand; say why the table is missing
            print(f"sweep: the comparison could not be written: {e}", file=sys.stderr, flush=True)
    return 0 if not summary["failed"] and not summary["skipped"] else 1


if __name__ == "__main__":
    _main.run(main, interruptible=True)
