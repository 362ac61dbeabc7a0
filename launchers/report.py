"""One self-contained HTML report for a run: flags, training curves, evaluation, diagnostics.

    python -m launchers.report --workdir=runs/dpo                      # -> runs/dpo/report.html
    python -m launchers.report --workdir=runs/dpo --out=/tmp/r.html --pairs=pairs/pairs.jsonl

Reads DIR/metrics.jsonl, DIR/config.json, DIR/eval/ and DIR/diagnostics/*.json (``launchers.diagnose``); see
``jaxrl/diagnostics/report.py``. The page has no scripts and no external resources: it opens offline.
A --workdir that does not exist or holds no run is refused (nothing is created); exit status 1 for a missing or
malformed input, 2 for usage errors (launchers/_main.py).
"""

from __future__ import annotations

from absl import app

from jaxrl.diagnostics.report import ReportSettings, build_report
from jaxrl.utils import dataclass_flags
from launchers import _main

_F = dataclass_flags.define_flags(ReportSettings)  # a flag per ReportSettings field


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    s = dataclass_flags.config_from_flags(ReportSettings, _F)  # --workdir is required
    if s.problems and not s.pairs:
        raise app.UsageError("--problems is used by the pair audit: it needs --pairs")
    path = build_report(s.workdir, s.out, eval_dir=s.eval_dir, pairs=s.pairs, problems=s.problems, seed=s.seed)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    _main.run(main)
