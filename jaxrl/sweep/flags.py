"""The settings of `python -m launchers.sweep` and `python -m launchers.compare`: one dataclass each, whose fields
are the launcher's flags (their names, types, defaults and help; jaxrl.utils.dataclass_flags makes the flags).
The runner (`SweepRunner`) and the comparison table (`build_table`, `write_comparison`) take their defaults from
these fields. A module of its own, light to import: a launcher defines its flags (and answers --help) before it
imports the runner or the statistics.

    holders = dataclass_flags.define_flags(CompareSettings)
    settings = dataclass_flags.config_from_flags(CompareSettings, holders)   # after absl parsed them
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxrl.utils.dataclass_flags import flag_field
from jaxrl.utils.seeds import seed_field

__all__ = ["CompareSettings", "DEFAULT_METRICS", "SweepSettings"]

# the metrics of the comparison's per-checkpoint columns when none are named (those the points have)
DEFAULT_METRICS = ("partial_reward_mean", "strict_rate", "eval_preference_accuracy", "eval_reward_margin")


@dataclasses.dataclass(frozen=True)
class SweepSettings:
    """launchers.sweep: which sweep, where, and how its points run (`sweep` and `out` are required; the launcher
    says so with both names)."""

    sweep: Optional[str] = flag_field(None, help="Sweep config: path/to/sweep.py[:arg] (get_sweep()).")
    out: Optional[str] = flag_field(None, help="Sweep folder: one subfolder per point, sweep.json, the comparison.")
    dry_run: bool = flag_field(False, help="List the points (name, folder, state) and exit; writes nothing.")
    print_commands: bool = flag_field(False, help="Print one shell command per unfinished point (for a cluster "
                                      "scheduler) and exit.")
    only: Optional[str] = flag_field(None, help="Only the points whose slug or name contains this string.")
    point: Optional[str] = flag_field(None, help="Only the point with this exact slug (what --print_commands "
                                      "emits).")
    jobs: int = flag_field(1, help="Points run at the same time on this machine (1 on an accelerator).")
    # None: OUT/.jax_cache (jaxrl.sweep.runner.CACHE_DIR)
    compilation_cache: Optional[str] = flag_field(None, help="JAX persistent compilation cache shared by the "
                                                  "points (default OUT/.jax_cache; '' = off).")
    retry_failed: bool = flag_field(True, help="Rerun points whose last attempt failed.")
    force: bool = flag_field(False, help="Also run points marked running by a process on another host.")
    compare: bool = flag_field(True, help="Write the comparison table and report after running.")


@dataclasses.dataclass(frozen=True)
class CompareSettings:
    """launchers.compare: the sweep folder, where the tables go, and the table's options (jaxrl.sweep.compare:
    columns, the baseline rule, the intervals). `sweep_dir` is required."""

    sweep_dir: str = flag_field(help="Sweep folder (launchers.sweep --out).")
    out: Optional[str] = flag_field(None, help="Output folder (default: the sweep folder).")
    baseline: Optional[str] = flag_field(None, help="Baseline point: a slug, or axis=value[,axis=value] (axes left "
                                         "open pair each point with the baseline of its own seed / other labels).")
    metric: Optional[tuple[str, ...]] = flag_field(None, help="Evaluation metrics with per-checkpoint columns "
                                                   f"(default: {', '.join(DEFAULT_METRICS)}, as present).")
    steps: Optional[tuple[int, ...]] = flag_field(None, help="Only these checkpoint steps (default: every evaluated "
                                                  "one).")
    sort: Optional[str] = flag_field(None, help="Sort by this column; '-col' for descending.")
    filter: list[str] = flag_field(default_factory=list, help="Keep rows where COLUMN OP VALUE holds (repeatable).")
    plot_metric: Optional[str] = flag_field(None, help="Column plotted against each axis (default: the first metric "
                                            "at the last evaluated step).")
    last_k: int = flag_field(5, help="Training summary: mean of the last k steps.")
    n_resamples: int = flag_field(10000, help="Bootstrap resamples of the paired intervals.")
    confidence: float = flag_field(0.95, help="Interval confidence level.")
    seed: int = seed_field(0, help="Bootstrap seed.")
