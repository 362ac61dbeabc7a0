"""One self-contained HTML report for a run: flags, training curves, evaluation, diagnostics.

    python -m launchers.report --workdir=runs/dpo                      # -> runs/dpo/report.html
    python -m launchers.report --workdir=runs/dpo --out=/tmp/r.html --pairs=pairs/pairs.jsonl

Reads DIR/metrics.jsonl, DIR/config.json, DIR/eval/ and DIR/diagnostics/*.json (``launchers.diagnose``); see
``jaxrl/diagnostics/report.py``. The page has no scripts and no external resources: it opens offline.
A --workdir that does not exist or holds no run is refused (nothing is created); exit status 1 for a missing or
malformed input, 2 for usage errors (launchers/_main.py).
"""

from __future__ import annotations

from absl import app, flags

from jaxrl.diagnostics.report import build_report
from launchers import _main

_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder.")
_OUT = flags.DEFINE_string("out", None, "Output HTML (default WORKDIR/report.html).")
_EVAL_DIR = flags.DEFINE_string("eval_dir", None, "Evaluation folder (default WORKDIR/eval).")
_PAIRS = flags.DEFINE_string("pairs", None, "pairs.jsonl to audit in the report (else diagnostics/pairs.json).")
_PROBLEMS = flags.DEFINE_string("problems", None, "problems.jsonl for the semantic pair audit (with --pairs).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the bootstrap and of the semantic-audit sample.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required")
    if _PROBLEMS.value and not _PAIRS.value:
        raise app.UsageError("--problems is used by the pair audit: it needs --pairs")
    path = build_report(_WORKDIR.value, _OUT.value, eval_dir=_EVAL_DIR.value, pairs=_PAIRS.value,
                        problems=_PROBLEMS.value, seed=_SEED.value)
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    _main.run(main)
