"""Every launcher refuses, as a user runs it (a fresh interpreter), an output that already holds other results, a
bad value, a malformed input file and a corrupted checkpoint: one line naming the file or the value, exit status 1
(refused) or 2 (usage), and every file on disk byte for byte as it was. All are refused before a model is loaded,
so no test here compiles anything (the corrupted training state, which resumes, is in the slow tier)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import launcher_env
from launcher_env import error_lines, launch, snapshot

TRAIN = ("--config=configs/sft_tiny.py", "--config.checkpoint_every=4", "--config.data.seq_len=16")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The tiny model folder, problems and adapter run of tests/launcher_env.py, plus rollouts scored by hand and
    malformed copies of the problems and rollouts files (line 2 broken)."""
    env = launcher_env.build(tmp_path_factory.mktemp("env"))
    root = env["root"]
    records = [{"problem_id": pid, "sample_index": i, "completion": f"c{i}", "completion_tokens": 5 + i,
                "finish_reason": "stop", "reward": {"partial": p, "strict": float(p == 1.0)}, "model": "m"}
               for pid in env["ids"][:2] for i, p in enumerate((1.0, 0.0, 0.5, 0.0))]
    (root / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = (root / "rollouts.jsonl").read_text().splitlines(True)
    (root / "bad_rollouts.jsonl").write_text(lines[0] + '{"problem_id": "x", "sample_index": 1,\n' + "".join(lines[2:]))
    problems = Path(env["problems"]).read_text().splitlines(True)
    (root / "bad_problems.jsonl").write_text(problems[0] + "{oops\n" + "".join(problems[2:]))
    return env


def refused(proc, status: int) -> str:
    assert proc.returncode == status, proc.stderr[-3000:]
    [line] = error_lines(proc)
    return line


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# ------------------------------------------------------------------------------------------- existing outputs


def test_build_pairs_refuses_to_replace_other_pairs(env, tmp_path):
    args = (f"--rollouts={env['root'] / 'rollouts.jsonl'}", f"--problems={env['problems']}",
            f"--out_dir={tmp_path / 'pairs'}", "--max_new_tokens=64")
    assert launch("build_pairs", *args).returncode == 0
    before = snapshot(tmp_path)
    assert json.loads(before["pairs/audit.json"])  # something to lose
    same = launch("build_pairs", *args)  # the same build again: a no-op
    assert same.returncode == 0, same.stderr[-3000:]
    line = refused(launch("build_pairs", *args, "--pairing=all"), 1)  # every admissible pair: other pairs
    assert line.startswith(f"build_pairs: {tmp_path / 'pairs' / 'pairs.jsonl'}: holds 2 pairs; this build gives "
                           "10 other pairs and would replace them: choose another --out_dir, or pass --overwrite")
    assert snapshot(tmp_path) == before


def test_import_problems_refuses_to_replace_other_problems(env, tmp_path):
    out = tmp_path / "imp" / "problems.jsonl"
    args = ("--format=problems", f"--input={env['problems']}", f"--output={out}", "--split")
    assert launch("import_problems", *args).returncode == 0
    before = snapshot(tmp_path)
    line = refused(launch("import_problems", *args, "--limit=2"), 1)
    assert line == (f"import_problems: {out}: holds other problems than this import gives (2 problems); choose "
                    "another --output, or pass --overwrite to replace it")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("launcher", ["convert", "export"])
def test_convert_and_export_refuse_an_existing_model_folder(env, tmp_path, launcher):
    out = tmp_path / "model"
    shutil.copytree(env["model"], out)
    before = snapshot(tmp_path)
    if launcher == "convert":
        args = ("--to=hf", f"--src={env['model']}", f"--base={env['model']}", f"--out={out}")
        message = f"convert: {out}: already exists; choose another --out, or pass --overwrite to replace it"
    else:
        args = (f"--checkpoint={env['run']}", "--step=2", f"--base={env['model']}", f"--out={out}")
        message = f"export: {out} exists; pass overwrite=True (--overwrite) to replace it"
    assert refused(launch(launcher, *args), 1) == message
    assert snapshot(tmp_path) == before


def test_report_of_a_mistyped_workdir_creates_nothing(tmp_path):
    line = refused(launch("report", f"--workdir={tmp_path / 'rnu'}"), 1)
    assert line == f"report: {tmp_path / 'rnu'}: no such run folder (--workdir)"
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------- bad values, before any work


@pytest.mark.parametrize("launcher, flag, message", [
    ("rollout", "--batch_size=0", "rollout: batch_size must be >= 1, got 0"),
    ("rollout", "--temperature=-1", "rollout: temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    ("evaluate", "--temperature=-1", "evaluate: temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    ("evaluate", "--temperature=inf", "evaluate: temperature must be a finite number >= 0 (0 = greedy), got inf"),
    # seeds outside [0, 2**32) would alias others (jax keeps a seed's low 32 bits): refused while flags parse
    ("rollout", "--seed=-1", "rollout: flag --seed=-1: -1 is not an integer in the range [0, 4294967295]; see "
                             "--helpshort"),
    ("evaluate", f"--seed={2 ** 63}", f"evaluate: flag --seed={2 ** 63}: {2 ** 63} is not an integer in the range "
                                      "[0, 4294967295]; see --helpshort"),
    ("evaluate", "--confidence=95", "evaluate: confidence must be in (0, 1) (0.95 for 95%), got 95.0"),
])
def test_a_bad_sampling_value_is_refused_before_the_model_is_loaded(env, tmp_path, launcher, flag, message):
    out = "--out=" + str(tmp_path / ("rollouts.jsonl" if launcher == "rollout" else "eval"))
    model = f"--model={env['model']}" if launcher == "rollout" else f"--base={env['model']}"
    proc = launch(launcher, f"--problems={env['problems']}", model, out, flag)
    assert refused(proc, 2) == message
    assert list(tmp_path.iterdir()) == []  # no cache metadata left to block the corrected rerun


# ------------------------------------------------------------------------------------------- malformed files


@pytest.mark.parametrize("launcher", ["rollout", "evaluate", "import_problems", "build_pairs"])
def test_a_malformed_input_line_is_named_and_nothing_is_written(env, tmp_path, launcher):
    root = env["root"]
    bad = root / ("bad_rollouts.jsonl" if launcher == "build_pairs" else "bad_problems.jsonl")
    args = {"rollout": (f"--problems={bad}", f"--model={env['model']}", f"--out={tmp_path / 'r.jsonl'}"),
            "evaluate": (f"--problems={bad}", f"--base={env['model']}", f"--out={tmp_path / 'eval'}"),
            "import_problems": ("--format=problems", f"--input={bad}", f"--output={tmp_path / 'p.jsonl'}"),
            "build_pairs": (f"--rollouts={bad}", f"--problems={env['problems']}", f"--out_dir={tmp_path / 'pairs'}",
                            "--max_new_tokens=64")}[launcher]
    line = refused(launch(launcher, *args), 1)
    assert line.startswith(f"{launcher}: {bad}:2: invalid JSON")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------- corrupted checkpoints


def damaged_adapter_run(env, tmp_path) -> tuple[Path, Path]:
    """A copy of the run whose newest adapter checkpoint (step 5) has its array data file cut in half."""
    run = tmp_path / "run"
    shutil.copytree(env["run"], run)
    [data] = (run / "checkpoints" / "adapters" / "5" / "adapter" / "d").iterdir()
    truncate(data)
    return run, data


@pytest.mark.parametrize("launcher", ["export", pytest.param("evaluate", marks=pytest.mark.slow)])  # 12 s
def test_a_corrupted_adapter_checkpoint_is_named(env, tmp_path, launcher):
    run, data = damaged_adapter_run(env, tmp_path)
    before = snapshot(tmp_path)
    if launcher == "export":
        args = (f"--checkpoint={run}", "--step=5", f"--base={env['model']}", f"--out={tmp_path / 'peft'}")
    else:
        args = (f"--problems={env['problems']}", f"--base={env['model']}", f"--checkpoints={run}",
                f"--out={tmp_path / 'eval'}", *launcher_env.SAMPLING)
    line = refused(launch(launcher, *args), 1)
    assert line.startswith(f"{launcher}: {data}: corrupted checkpoint (")
    assert line.endswith("); restore it from a copy, or use another checkpoint (step)")
    assert snapshot(tmp_path) == before


@pytest.mark.heavy
@pytest.mark.slow  # two trainings of the tiny model
def test_train_resumes_from_the_newest_intact_state_and_keeps_the_damaged_one(tmp_path):
    workdir = tmp_path / "run"
    cache = tmp_path / "xla"
    first = launch("train", f"--workdir={workdir}", *TRAIN, "--config.steps=8", cache=cache)
    assert first.returncode == 0, first.stderr[-3000:]
    state = workdir / "checkpoints" / "state"
    [data] = (state / "8" / "state" / "d").iterdir()
    truncate(data)
    damaged = snapshot(state / "8")

    resumed = launch("train", f"--workdir={workdir}", *TRAIN, "--config.steps=12", cache=cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    kept = workdir / "checkpoints" / "corrupt" / "state_8"
    assert f"{data}: corrupted checkpoint (" in resumed.stderr
    assert f"moved it to {kept} and resumed from the newest intact step, 4" in resumed.stderr
    assert "resumed from" in resumed.stderr and "(step 4)" in resumed.stderr
    assert snapshot(kept) == damaged  # set aside, byte for byte, never deleted
    assert sorted(p.name for p in state.iterdir()) == ["12", "8"]  # step 8 redone

    # every state damaged: refused with one line, nothing moved or written
    for step in ("8", "12"):
        [data] = (state / step / "state" / "d").iterdir()
        truncate(data)
    before = snapshot(workdir)
    proc = launch("train", f"--workdir={workdir}", *TRAIN, "--config.steps=16", cache=cache)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = error_lines(proc)[-1]  # after the run's own INFO lines (the model built), and nothing of the libraries
    assert "Traceback" not in proc.stderr and "never retrieved" not in proc.stderr and "Event loop" not in proc.stderr
    assert line.startswith("train: ") and ": corrupted checkpoint (" in line
    assert line.split(": corrupted checkpoint")[0].removeprefix("train: ").startswith(str(state / "12"))
    assert f"no older intact training state in {state} to resume from" in line
    assert snapshot(workdir) == before
