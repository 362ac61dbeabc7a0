r"""Convert local LiveCodeBench / Nemotron-RL / HumanEval files to a canonical problems.jsonl; optionally freeze
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

from absl import app

from jaxrl.data.importers import ImportResult, ImportSettings, import_file
from jaxrl.data.problems import problems_file_bytes
from jaxrl.data.splits import SplitSettings, check_splits, plan_splits, write_splits
from jaxrl.utils import dataclass_flags
from jaxrl.utils.io import OutputExistsError, atomic_write_bytes
from launchers import _main

_IMPORT = dataclass_flags.define_flags(ImportSettings, mark_required=True)  # --format, --input, --output, ...
_SPLIT = dataclass_flags.define_flags(SplitSettings)  # --split, --split_dir, --dev_fraction, --seed


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    s = dataclass_flags.config_from_flags(ImportSettings, _IMPORT)
    sp = dataclass_flags.config_from_flags(SplitSettings, _SPLIT)
    if sp.split and not 0.0 <= sp.dev_fraction <= 1.0:
        raise app.UsageError(f"--dev_fraction must be in [0, 1], got {sp.dev_fraction}")
    if s.limit is not None and s.limit < 1:
        raise app.UsageError(f"--limit must be >= 1, got {s.limit}")
    result = ImportResult()
    for path in s.input:
        import_file(path, s.format, skip_malformed=s.skip_malformed, limit=s.limit, result=result)
    if not result.problems:
        raise app.UsageError("no problems imported")
    output = Path(s.output)
    data = problems_file_bytes(result.problems, output)
    sha = hashlib.sha256(data).hexdigest()
    unchanged = output.is_file() and output.read_bytes() == data
    # every refusal before the first write: the output, then the splits (frozen from the output's bytes)
    if output.exists() and not unchanged and not s.overwrite:
        raise OutputExistsError(f"{output}: holds other problems than this import gives ({len(result.problems)} "
                                "problems); choose another --output, or pass --overwrite to replace it")
    if sp.split:
        split_dir = Path(sp.split_dir or output.with_suffix("").as_posix() + "_splits")
        manifest, payloads = plan_splits(result.problems, sp.fractions(), seed=sp.seed, source_path=s.output,
                                         source_sha256=sha)
        check_splits(split_dir, manifest, overwrite=s.overwrite)
    if not unchanged:
        atomic_write_bytes(output, data)
    tests = sum(len(p.tests) for p in result.problems)
    print(f"{s.output}: {len(result.problems)} problems, {tests} tests, sha256 {sha} "
          + ("(unchanged: it already held them; nothing written)" if unchanged else "(written)"))
    if result.skipped:
        print(f"skipped {len(result.skipped)} malformed record(s); first: {result.skipped[0]}")
    if sp.split:
        write_splits(split_dir, manifest, payloads)
        for entry in manifest["splits"].values():
            print(f"{split_dir / entry['file']}: {entry['count']} problems, sha256 {entry['sha256']}")


if __name__ == "__main__":
    _main.run(main)
