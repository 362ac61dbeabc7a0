r"""The comparison table of a sweep: every point's training summary and evaluation at each checkpoint, each
difference to the baseline point with its paired interval; Markdown, CSV, JSON and an HTML report with plots.

    python -m launchers.compare --sweep_dir=runs/tiny_sweep
    python -m launchers.compare --sweep_dir=runs/lr_beta --baseline="optimizer.learning_rate=1e-06,dpo.beta=0.1" \
        --metric=partial_reward_mean,strict_rate --steps=28,125 --sort=-diff:partial_reward_mean@28 \
        --filter="strict_rate@28>0.1" --filter="state==done"
    python -m launchers.compare --sweep_dir=runs/tiny_sweep --baseline=loss_type=sigmoid__beta=0.1__seed=0__4bca68b9

Writes (into --out, default the sweep folder) comparison.md, comparison.csv, comparison.json
(+ comparison_seeds.csv with a seed axis) and report.html, and prints the Markdown. Columns, the baseline rule
and the intervals: jaxrl/sweep/compare.py. --sort takes a column name (prefix '-' for descending); --filter
takes COLUMN OP VALUE with OP one of >= <= != == > < ~ (contains), and may be repeated.
Every option (columns, operators, values, the baseline) is checked before anything is written; filters that keep
no point are refused, so a typo never replaces the tables with an empty one. Exit status 1 for a missing or
malformed sweep folder, 2 for usage errors (launchers/_main.py).
"""

from __future__ import annotations

from pathlib import Path

from absl import app, flags

from launchers import _main

_SWEEP_DIR = flags.DEFINE_string("sweep_dir", None, "Sweep folder (launchers.sweep --out).")
_OUT = flags.DEFINE_string("out", None, "Output folder (default: the sweep folder).")
_BASELINE = flags.DEFINE_string("baseline", None, "Baseline point: a slug, or axis=value[,axis=value] (axes left "
                                "open pair each point with the baseline of its own seed / other labels).")
_METRIC = flags.DEFINE_list("metric", None, "Evaluation metrics with per-checkpoint columns (default: "
                            "partial_reward_mean, strict_rate, eval_preference_accuracy, eval_reward_margin, as "
                            "present).")
_STEPS = flags.DEFINE_list("steps", None, "Only these checkpoint steps (default: every evaluated one).")
_SORT = flags.DEFINE_string("sort", None, "Sort by this column; '-col' for descending.")
_FILTER = flags.DEFINE_multi_string("filter", [], "Keep rows where COLUMN OP VALUE holds (repeatable).")
_PLOT = flags.DEFINE_string("plot_metric", None, "Column plotted against each axis (default: the first metric at "
                            "the last evaluated step).")
_LAST_K = flags.DEFINE_integer("last_k", 5, "Training summary: mean of the last k steps.")
_N_RESAMPLES = flags.DEFINE_integer("n_resamples", 10000, "Bootstrap resamples of the paired intervals.")
_CONFIDENCE = flags.DEFINE_float("confidence", 0.95, "Interval confidence level.")
_SEED = flags.DEFINE_integer("seed", 0, "Bootstrap seed.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _SWEEP_DIR.value:
        raise app.UsageError("--sweep_dir is required")
    if not Path(_SWEEP_DIR.value).is_dir():
        raise FileNotFoundError(f"{_SWEEP_DIR.value}: no such sweep folder (--sweep_dir)")
    if not 0 < _CONFIDENCE.value < 1 or _N_RESAMPLES.value < 1 or _LAST_K.value < 1:
        raise app.UsageError(f"--confidence must be in (0, 1), --n_resamples and --last_k >= 1; got "
                             f"{_CONFIDENCE.value}, {_N_RESAMPLES.value}, {_LAST_K.value}")
    try:
        steps = [int(s) for s in _STEPS.value] if _STEPS.value else None
    except ValueError:
        raise app.UsageError(f"--steps: expected integers, got {','.join(_STEPS.value)}") from None
    from jaxrl.sweep.report import write_comparison
    # a bad column, operator or value fails in build_table, before the first write (launchers/_main.py prints it)
    paths = write_comparison(
        _SWEEP_DIR.value, _OUT.value, plot_metric=_PLOT.value, baseline=_BASELINE.value,
        metrics=_METRIC.value, steps=steps, last_k=_LAST_K.value, sort=_SORT.value, filters=_FILTER.value,
        n_resamples=_N_RESAMPLES.value, confidence=_CONFIDENCE.value, seed=_SEED.value)
    print(paths["md"].read_text())
    print("compare: wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    _main.run(main)
