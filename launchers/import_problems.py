"""Convert local LiveCodeBench / Nemotron-RL / HumanEval files to a canonical problems.jsonl; optionally freeze
dev / held-out splits with a manifest (ids + sha256) that proves a held-out set unchanged later.

    python -m launchers.import_problems --format=lcb --input=test5.jsonl,test6.jsonl --output=data/lcb.jsonl
    python -m launchers.import_problems --format=nemotron --input=train.parquet --output=data/nemo.jsonl \\
        --split --split_dir=data/nemo_splits --dev_fraction=0.5 --seed=0
    python -m launchers.import_problems --format=humaneval --input=HumanEval.jsonl.gz --output=data/he.jsonl

Nothing is downloaded: every input is a local file (JSONL, JSONL.gz or parquet).

Everything is checked before anything is written: an existing --output with other problems, or frozen splits that
would change, is refused (exit status 1) unless --overwrite; rerunning the same import writes nothing new.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from absl import app, flags

from jaxrl.data.importers import IMPORTERS, ImportResult, import_file
from jaxrl.data.problems import problems_file_bytes
from jaxrl.data.splits import check_splits, plan_splits, write_splits
from jaxrl.utils.io import OutputExistsError, atomic_write_bytes
from launchers import _main

FLAGS = flags.FLAGS
flags.DEFINE_enum("format", None, sorted(IMPORTERS), "Record format of the input files.")
flags.DEFINE_list("input", None, "Local input files (comma-separated): .jsonl, .jsonl.gz or .parquet.")
flags.DEFINE_string("output", None, "Where to write the canonical problems (.jsonl or .parquet).")
flags.DEFINE_boolean("skip_malformed", False, "Skip and count malformed records instead of stopping at the first.")
flags.DEFINE_integer("limit", None, "Keep at most this many problems (in input order).")
flags.DEFINE_boolean("split", False, "Also freeze dev / held-out splits of the imported problems.")
flags.DEFINE_string("split_dir", None, "Folder for the splits and manifest.json (default: next to --output).")
flags.DEFINE_float("dev_fraction", 0.5, "Fraction of problems in the dev split; the rest is held out.")
flags.DEFINE_integer("seed", 0, "Seed of the split assignment.")
flags.DEFINE_boolean("overwrite", False, "Allow replacing an --output that holds other problems and frozen splits "
                     "that would change.")
flags.mark_flags_as_required(["format", "input", "output"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.split and not 0.0 <= FLAGS.dev_fraction <= 1.0:
        raise app.UsageError(f"--dev_fraction must be in [0, 1], got {FLAGS.dev_fraction}")
    if FLAGS.limit is not None and FLAGS.limit < 1:
        raise app.UsageError(f"--limit must be >= 1, got {FLAGS.limit}")
    result = ImportResult()
    for path in FLAGS.input:
        import_file(path, FLAGS.format, skip_malformed=FLAGS.skip_malformed, limit=FLAGS.limit, result=result)
    if not result.problems:
        raise app.UsageError("no problems imported")
    output = Path(FLAGS.output)
    data = problems_file_bytes(result.problems, output)
    sha = hashlib.sha256(data).hexdigest()
    unchanged = output.is_file() and output.read_bytes() == data
    # every refusal before the first write: the output, then the splits (frozen from the output's bytes)
    if output.exists() and not unchanged and not FLAGS.overwrite:
        raise OutputExistsError(f"{output}: holds other problems than this import gives ({len(result.problems)} "
                                "problems); choose another --output, or pass --overwrite to replace it")
    if FLAGS.split:
        split_dir = Path(FLAGS.split_dir or output.with_suffix("").as_posix() + "_splits")
        manifest, payloads = plan_splits(result.problems,
                                         {"dev": FLAGS.dev_fraction, "heldout": 1.0 - FLAGS.dev_fraction},
                                         seed=FLAGS.seed, source_path=FLAGS.output, source_sha256=sha)
        check_splits(split_dir, manifest, overwrite=FLAGS.overwrite)
    if not unchanged:
        atomic_write_bytes(output, data)
    tests = sum(len(p.tests) for p in result.problems)
    print(f"{FLAGS.output}: {len(result.problems)} problems, {tests} tests, sha256 {sha} "
          + ("(unchanged: it already held them; nothing written)" if unchanged else "(written)"))
    if result.skipped:
        print(f"skipped {len(result.skipped)} malformed record(s); first: {result.skipped[0]}")
    if FLAGS.split:
        write_splits(split_dir, manifest, payloads)
        for entry in manifest["splits"].values():
            print(f"{split_dir / entry['file']}: {entry['count']} problems, sha256 {entry['sha256']}")


if __name__ == "__main__":
    _main.run(main)
