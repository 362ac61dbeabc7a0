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

from absl import app, flags, logging

from jaxrl.data import pairs as pairs_lib
from launchers import _main

_ROLLOUTS = flags.DEFINE_string("rollouts", None, "rollouts.jsonl to build pairs from.")
_PAIRS_IN = flags.DEFINE_string("pairs_in", None, "Existing pairs.jsonl to filter (instead of --rollouts).")
_PROBLEMS = flags.DEFINE_string("problems", None, "problems.jsonl giving the prompt messages when the rollouts "
                                "carry no 'messages'.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Output folder for pairs.jsonl, audit.json and cohort/.")
_MIN_MARGIN = flags.DEFINE_float("min_margin", 0.5, "Minimum chosen - rejected partial reward.")
_TRUNCATION_BUFFER = flags.DEFINE_integer("truncation_buffer", 24, "A completion with more than "
                                          "max_new_tokens - truncation_buffer tokens counts as truncated.")
_MAX_LENGTH_DIFF = flags.DEFINE_integer("max_length_diff", 512, "Maximum |chosen_tokens - rejected_tokens|.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", None, "Generation cap, used for records that do not "
                                       "carry their own max_new_tokens.")
_PAIRING = flags.DEFINE_enum("pairing", "single", list(pairs_lib.PAIRINGS),
                             "single: one pair a prompt; all: every admissible pair.")
_SELECTION = flags.DEFINE_enum("selection", "best_worst", list(pairs_lib.SELECTIONS),
                               "best_worst: best vs worst or drop the prompt; best_admissible: fall back to the "
                               "admissible pair with the largest margin.")
_COHORT_SIZE = flags.DEFINE_integer("cohort_size", 0, "If > 0, freeze this many pairs into out_dir/cohort/.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the cohort selection.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace what --out_dir holds (pairs.jsonl, audit.json, "
                                "cohort/) when this build gives other pairs or another cohort.")
_SKIP_MALFORMED = flags.DEFINE_bool("skip_malformed", False, "Skip (and count) malformed input lines instead "
                                    "of failing.")


def run() -> dict:
    """Does the work for the parsed flags; returns the audit."""
    if bool(_ROLLOUTS.value) == bool(_PAIRS_IN.value):
        raise app.UsageError("pass exactly one of --rollouts and --pairs_in")
    if not _OUT_DIR.value:
        raise app.UsageError("--out_dir is required")
    out_dir = Path(_OUT_DIR.value)
    config = pairs_lib.PairConfig(
        min_margin=_MIN_MARGIN.value, truncation_buffer=_TRUNCATION_BUFFER.value,
        max_length_diff=_MAX_LENGTH_DIFF.value, max_new_tokens=_MAX_NEW_TOKENS.value,
        pairing=_PAIRING.value, selection=_SELECTION.value)
    if _COHORT_SIZE.value < 0:
        raise app.UsageError(f"--cohort_size must be >= 0, got {_COHORT_SIZE.value}")

    skipped: list[str] = []
    if _ROLLOUTS.value:
        src = _ROLLOUTS.value
        samples = pairs_lib.read_rollouts(src, skip_malformed=_SKIP_MALFORMED.value, skipped=skipped)
        messages = pairs_lib.read_problem_messages(_PROBLEMS.value) if _PROBLEMS.value else None
        warning = pairs_lib.truncation_buffer_warning(samples, config, src)
        if warning:
            logging.warning("%s", warning)
        pairs, audit = pairs_lib.build_pairs(samples, config, messages)
        n_records = len(samples)
        reward = pairs_lib.rollouts_reward(src)
    else:
        src = _PAIRS_IN.value
        if Path(src).resolve() == (out_dir / "pairs.jsonl").resolve():
            raise app.UsageError(f"--pairs_in {src} is the output file; choose another --out_dir")
        records = pairs_lib.read_pairs(src, skip_malformed=_SKIP_MALFORMED.value, skipped=skipped)
        pairs, audit = pairs_lib.filter_pairs(records, config)
        n_records = len(records)
        reward = pairs_lib.recorded_reward(src)
    audit["input"] = {"path": os.fspath(src), "records": n_records, "skipped_malformed": len(skipped),
                      "skipped_examples": skipped[:10]}
    audit["reward"] = reward  # None when the input does not say (the pair audit then cannot re-score)
    if not pairs:
        raise pairs_lib.NoPairsError(pairs_lib.no_pairs_message(audit, os.fspath(src)))
    cohort = (_COHORT_SIZE.value, _SEED.value) if _COHORT_SIZE.value > 0 else None
    if cohort and cohort[0] > len(pairs):
        raise ValueError(f"--cohort_size={cohort[0]} exceeds the {len(pairs)} pairs this build keeps")
    # refused here, before anything is written, when out_dir holds other pairs / another cohort
    action = pairs_lib.check_build_output(out_dir, pairs, overwrite=_OVERWRITE.value, cohort=cohort)
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
