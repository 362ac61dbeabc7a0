r"""Convert local LiveCodeBench / Nemotron-RL / HumanEval files to a canonical problems.jsonl; optionally freeze
dev / held-out splits with a manifest (ids + sha256) that proves a held-out set unchanged later.

    python -m launchers.import_problems --format=lcb --input=test5.jsonl,test6.jsonl --output=data/lcb.jsonl
    python -m launchers.import_problems --format=nemotron --input=train.parquet --output=data/nemo.jsonl \\
        --split --split_dir=data/nemo_splits --dev_fraction=0.5 --seed=0
    python -m launchers.import_problems --format=humaneval --input=HumanEval.jsonl.gz --output=data/he.jsonl

Or generate reasoning-gym tasks (the optional extra: pip install -e '.[tasks]'; jaxrl.data.reasoning_gym,
docs/guides/tasks.md): the training draw goes to --output, a disjoint eval draw is frozen into dev / held-out splits
whose manifest records the package version, the task configs, the seed and the hash of the generated problems;
--sft_output also writes supervised rows of the training answers (tokenized with --tokenizer):

    python -m launchers.import_problems --tasks=spell_backward,basic_arithmetic \
        --task_configs='{"basic_arithmetic": {"max_terms": 2, "max_digits": 1}}' --size=2000 --eval_size=400 \
        --output=data/rg/train.jsonl --split_dir=data/rg/splits

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
from jaxrl.data.reasoning_gym import TaskSettings
from jaxrl.data.splits import SplitSettings, check_splits, plan_splits, write_splits
from jaxrl.utils import dataclass_flags
from jaxrl.utils.io import OutputExistsError, atomic_write_bytes, write_jsonl
from launchers import _main

# --format, --input, --output, ...: required unless --tasks generates the problems (checked in main)
_IMPORT = dataclass_flags.define_flags(ImportSettings)
_SPLIT = dataclass_flags.define_flags(SplitSettings)  # --split, --split_dir, --dev_fraction, --seed
_TASKS = dataclass_flags.define_flags(TaskSettings)  # --tasks, --task_configs, --size, --eval_size, ...
_SFT = dataclass_flags.define_table((
    ("sft_output", "string", None, "With --tasks: also write supervised rows of the training answers here "
                                   "(JSONL of input_ids / loss_mask: algorithm=sft, data.source=jsonl)."),
    ("tokenizer", "string", None, "The HF tokenizer folder of --sft_output (the model's)."),
))


def _generate(s: ImportSettings, sp: SplitSettings, t: TaskSettings) -> None:
    """--tasks: the training draw to --output, the eval draw frozen into splits (jaxrl.data.reasoning_gym)."""
    from jaxrl.data import reasoning_gym
    if _SFT["sft_output"].value and not _SFT["tokenizer"].value:
        raise app.UsageError("--sft_output needs --tokenizer (the model's tokenizer folder)")
    generated = reasoning_gym.generate(t)  # every task, config and size checked before anything is written
    output = Path(s.output)
    data = problems_file_bytes(generated.train, output)
    sha = hashlib.sha256(data).hexdigest()
    unchanged = output.is_file() and output.read_bytes() == data
    if output.exists() and not unchanged and not s.overwrite:
        raise OutputExistsError(f"{output}: holds other problems than this generation gives; choose another "
                                "--output, or pass --overwrite to replace it")
    split_dir = Path(sp.split_dir or output.with_suffix("").as_posix() + "_splits")
    manifest = None
    if generated.eval:
        manifest, payloads = plan_splits(generated.eval, sp.fractions(), seed=sp.seed)
        manifest["generator"] = reasoning_gym.generator_record(t, generated, s.output, sha)
        check_splits(split_dir, manifest, overwrite=s.overwrite)
    rows = None
    if _SFT["sft_output"].value:
        from jaxrl.data.chat import load_tokenizer
        rows = reasoning_gym.sft_rows(load_tokenizer(_SFT["tokenizer"].value), generated.train)
    if not unchanged:
        atomic_write_bytes(output, data)
    print(f"{s.output}: {len(generated.train)} training problems of {', '.join(t.tasks)}, sha256 {sha} "
          + ("(unchanged: it already held them; nothing written)" if unchanged else "(written)"))
    if manifest is not None:
        write_splits(split_dir, manifest, payloads)
        for entry in manifest["splits"].values():
            print(f"{split_dir / entry['file']}: {entry['count']} problems, sha256 {entry['sha256']}")
        print(f"{split_dir / 'manifest.json'}: reasoning-gym {manifest['generator']['version']}, problems sha256 "
              f"{manifest['generator']['problems_sha256']}")
    if rows is not None:
        write_jsonl(_SFT["sft_output"].value, rows)
        print(f"{_SFT['sft_output'].value}: {len(rows)} supervised rows")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    t = dataclass_flags.config_from_flags(TaskSettings, _TASKS)
    sp = dataclass_flags.config_from_flags(SplitSettings, _SPLIT)
    if (sp.split or t.tasks) and not 0.0 <= sp.dev_fraction <= 1.0:
        raise app.UsageError(f"--dev_fraction must be in [0, 1], got {sp.dev_fraction}")
    if t.tasks:
        given = [f"--{n}" for n in ("format", "input") if _IMPORT[n].value]
        if given:
            raise app.UsageError(f"--tasks generates the problems: drop {' and '.join(given)}")
        return _generate(dataclass_flags.config_from_flags(ImportSettings, _IMPORT, format="", input=()), sp, t)
    if _SFT["sft_output"].value:
        raise app.UsageError("--sft_output writes the answers of generated tasks: it needs --tasks")
    s = dataclass_flags.config_from_flags(ImportSettings, _IMPORT)
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
