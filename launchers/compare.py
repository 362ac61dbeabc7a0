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

from absl import app

from jaxrl.sweep.flags import CompareSettings
from jaxrl.utils import dataclass_flags
from launchers import _main

_F = dataclass_flags.define_flags(CompareSettings)  # a flag per CompareSettings field


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    s = dataclass_flags.config_from_flags(CompareSettings, _F)  # --sweep_dir is required; --steps: integers
    if not Path(s.sweep_dir).is_dir():
        raise FileNotFoundError(f"{s.sweep_dir}: no such sweep folder (--sweep_dir)")
    if not 0 < s.confidence < 1 or s.n_resamples < 1 or s.last_k < 1:
        raise app.UsageError(f"--confidence must be in (0, 1), --n_resamples and --last_k >= 1; got "
                             f"{s.confidence}, {s.n_resamples}, {s.last_k}")
    from jaxrl.sweep.report import write_comparison
    # a bad column, operator or value fails in build_table, before the first write (launchers/_main.py prints it)
    paths = write_comparison(
        s.sweep_dir, s.out, plot_metric=s.plot_metric, baseline=s.baseline,
        metrics=list(s.metric) if s.metric is not None else None, steps=list(s.steps) if s.steps else None,
        last_k=s.last_k, sort=s.sort, filters=s.filter, n_resamples=s.n_resamples, confidence=s.confidence,
        seed=s.seed)
    print(paths["md"].read_text())
    print("compare: wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    _main.run(main)
