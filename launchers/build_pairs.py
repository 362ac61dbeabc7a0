"""Build DPO preference pairs from scored rollouts, or filter an existing pairs file; optionally freeze a cohort.

    python -m launchers.build_pairs --rollouts=rollouts.jsonl --out_dir=pairs/ --max_new_tokens=4096
    python -m launchers.build_pairs --pairs_in=old/pairs.jsonl --out_dir=clean/ --max_new_tokens=4096
    python -m launchers.build_pairs --rollouts=... --out_dir=... --cohort_size=1000 --seed=0

Writes ``out_dir/pairs.jsonl`` and ``out_dir/audit.json`` (and ``out_dir/cohort/`` with --cohort_size), all
atomically, and prints the audit summary. Filters and selection rules: ``jaxrl/data/pairs.py``.

A build that keeps no pair is refused (exit status 1, the counts per filter in the message, nothing written); a
--truncation_buffer at or above the rollouts' cap (every completion then counts as truncated) is warned about.
The reward the rollouts were scored with (their .meta.json) is recorded in audit.json: the pair audit
(launchers.diagnose --what=pairs) re-scores with it.
An --out_dir that already holds other pairs (or a cohort frozen from them) is refused before anything is written;
rerunning the same build is a no-op for pairs.jsonl (and adds a cohort asked for), --overwrite replaces
pairs.jsonl, audit.json and cohort/ together (a cohort frozen from the old pairs never stays beside new ones).
Exit status 1 for refused work or a malformed input line (its file:line named), 2 for usage errors.
"""

from __future__ import annotations

import os
from pathlib import Path

from absl import app, logging

from jaxrl.data import pairs as pairs_lib
from jaxrl.utils import dataclass_flags
from launchers import _main

_FILTERS = dataclass_flags.define_flags(pairs_lib.PairConfig)  # --min_margin, --pairing, ...
_BUILD = dataclass_flags.define_flags(pairs_lib.BuildPairsSettings)  # --rollouts, --out_dir, --cohort_size, ...


def run() -> dict:
    """Does the work for the parsed flags; returns the audit."""
    build = dataclass_flags.config_from_flags(pairs_lib.BuildPairsSettings, _BUILD)
    if bool(build.rollouts) == bool(build.pairs_in):
        raise app.UsageError("pass exactly one of --rollouts and --pairs_in")
    if not build.out_dir:
        raise app.UsageError("--out_dir is required")
    out_dir = Path(build.out_dir)
    config = dataclass_flags.config_from_flags(pairs_lib.PairConfig, _FILTERS)
    if build.cohort_size < 0:
        raise app.UsageError(f"--cohort_size must be >= 0, got {build.cohort_size}")

    skipped: list[str] = []
    if build.rollouts:
        src = build.rollouts
        samples = pairs_lib.read_rollouts(src, skip_malformed=build.skip_malformed, skipped=skipped)
        messages = pairs_lib.read_problem_messages(build.problems) if build.problems else None
        warning = pairs_lib.truncation_buffer_warning(samples, config, src)
        if warning:
            logging.warning("%s", warning)
        pairs, audit = pairs_lib.build_pairs(samples, config, messages)
        n_records = len(samples)
        reward = pairs_lib.rollouts_reward(src)
    else:
        src = build.pairs_in
        if Path(src).resolve() == (out_dir / "pairs.jsonl").resolve():
            raise app.UsageError(f"--pairs_in {src} is the output file; choose another --out_dir")
        records = pairs_lib.read_pairs(src, skip_malformed=build.skip_malformed, skipped=skipped)
        pairs, audit = pairs_lib.filter_pairs(records, config)
        n_records = len(records)
        reward = pairs_lib.recorded_reward(src)
    audit["input"] = {"path": os.fspath(src), "records": n_records, "skipped_malformed": len(skipped),
                      "skipped_examples": skipped[:10]}
    audit["reward"] = reward  # None when the input does not say (the pair audit then cannot re-score)
    if not pairs:
        raise pairs_lib.NoPairsError(pairs_lib.no_pairs_message(audit, os.fspath(src)))
    cohort = (build.cohort_size, build.seed) if build.cohort_size > 0 else None
    if cohort and cohort[0] > len(pairs):
        raise ValueError(f"--cohort_size={cohort[0]} exceeds the {len(pairs)} pairs this build keeps")
    # refused here, before anything is written, when out_dir holds other pairs / another cohort
    action = pairs_lib.check_build_output(out_dir, pairs, overwrite=build.overwrite, cohort=cohort)
    if action == "replace":
        removed = pairs_lib.remove_cohort(out_dir)
        if removed:
            print(f"removed {removed} (frozen from the pairs this build replaces)")
    frozen = (out_dir / "cohort" / "manifest.json").exists()
    if action == "same" and (not cohort or frozen) and (out_dir / "audit.json").exists():
        print(pairs_lib.format_audit(audit))
        print(f"{out_dir} already holds these pairs{' and this cohort' if cohort else ''}: nothing written")
        return audit
    if cohort:
        manifest = pairs_lib.freeze_cohort(pairs, out_dir, cohort[0], seed=cohort[1], overwrite=True,
                                           source=os.fspath(src))
        audit["cohort"] = {"dir": os.fspath(out_dir / "cohort"), "size": manifest["size"],
                           "seed": manifest["seed"], "sha256": manifest["sha256"]}
    pairs_path, audit_path = pairs_lib.write_pairs(out_dir, pairs, audit)
    print(pairs_lib.format_audit(audit))
    print(f"wrote {pairs_path} and {audit_path}")
    return audit


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    run()  # a malformed input line, a refused output, ...: one line (launchers/_main.py)


if __name__ == "__main__":
    _main.run(main)
