"""Every user error of issue 33 is one line naming the file, key or step and what to do, as a user meets it (a fresh
interpreter, no --verbose): a mistyped model folder, a missing .jsonl.gz, a truncated adapter_model.safetensors, a
damaged Orbax adapter, a typo in a family-file override, an unknown reward or reward option, and a full disk --
which also never leaves a half-written JSONL line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys

import pytest

import launcher_env
from launcher_env import ROOT, error_lines, launch, launch_env


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The tiny env, a PEFT export of its step 5 with adapter_model.safetensors cut in half, and a copy of its run
    whose step 5 lost the Orbax metadata of its adapter item."""
    import shutil

    from jaxrl.export import export_checkpoint
    env = launcher_env.build(tmp_path_factory.mktemp("env"), n_problems=2)
    root = env["root"]
    export_checkpoint(env["run"], env["model"], str(root / "peft"), step=5)
    weights = root / "peft" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.copytree(env["run"], root / "damaged_run")
    (root / "damaged_run" / "checkpoints" / "adapters" / "5" / "adapter" / "_METADATA").unlink()
    return env


def one_line(proc, status: int) -> str:
    assert proc.returncode == status, proc.stderr[-3000:]
    [line] = error_lines(proc)
    return line


@pytest.mark.slow
@pytest.mark.parametrize("case", ["rollout --model", "evaluate --base", "rollout --reward", "evaluate option"])
def test_a_mistyped_model_folder_or_reward_is_one_line(env, tmp_path, case):
    typo = f"{env['model']}_typo"
    problems, out = f"--problems={env['problems']}", f"--out={tmp_path / 'out'}"
    launcher, args, status, expected = {
        "rollout --model": ("rollout", (f"--model={typo}", "--reward=exact_match"), 1,
                            f"rollout: --model={typo}: no such folder (an HF model folder with config.json)"),
        "evaluate --base": ("evaluate", (f"--base={typo}", "--reward=exact_match"), 1,
                            f"evaluate: --base={typo}: no such folder (an HF model folder with config.json)"),
        "rollout --reward": ("rollout", (f"--model={env['model']}", "--reward=exact_mtach"), 2,
                             "rollout: --reward=exact_mtach: unknown reward; registered: arithmetic, charset, code, "
                             "exact_match, pattern, reasoning_gym, token_block (or name your own as module:function)"),
        "evaluate option": ("evaluate", (f"--base={env['model']}", "--reward=charset",
                                         '--reward_kwargs={"chars": "0"}'), 2, "evaluate: --reward_kwargs: reward 'charset' takes no option 'chars'; its options: "
                               "charset, truncation"),
    }[case]
    assert one_line(launch(launcher, problems, out, *args), status) == expected
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_missing_gzipped_input_is_one_line(tmp_path):
    missing = tmp_path / "lcb.jsonl.gz"
    proc = launch("import_problems", "--format=problems", f"--input={missing}", f"--output={tmp_path / 'p.jsonl'}")
    assert one_line(proc, 1) == f"import_problems: {missing}: no such file"


@pytest.mark.slow  # the evaluate launcher reads every adapter before it loads a model
def test_a_truncated_peft_adapter_is_one_line_naming_the_file(env, tmp_path):
    weights = env["root"] / "peft" / "adapter_model.safetensors"
    proc = launch("evaluate", f"--problems={env['problems']}", f"--base={env['model']}", f"--out={tmp_path / 'eval'}",
                  f"--adapters=dpo={env['root'] / 'peft'}", "--reward=exact_match")
    line = one_line(proc, 1)
    assert line.startswith(f"evaluate: {weights}: damaged safetensors file (")
    assert line.endswith("); export the adapter again, or restore the file from a copy")


@pytest.mark.slow
def test_a_damaged_orbax_adapter_names_its_file_and_step(env, tmp_path):
    damaged = env["root"] / "damaged_run" / "checkpoints" / "adapters" / "5"
    proc = launch("export", f"--checkpoint={env['root'] / 'damaged_run'}", f"--base={env['model']}",
                  f"--out={tmp_path / 'peft'}")
    assert one_line(proc, 1) == (f"export: {damaged / 'adapter' / '_METADATA'}: corrupted checkpoint (step 5: the "
                                 "file is missing); restore it from a copy, or use another checkpoint (step)")


@pytest.mark.slow
def test_a_typo_in_a_family_file_override_names_the_key(tmp_path):
    proc = launch("train", "--config=configs/dpo.py:pair=pairs/cohort", f"--workdir={tmp_path / 'run'}")
    line = one_line(proc, 2)
    assert line.startswith("train: flag --config=configs/dpo.py:pair=pairs/cohort: configs/dpo.py: unknown override "
                           "key 'pair'; keys: run, model, start, lr, beta, lora, max_length, steps, mb, schedule, "
                           "loss, pairs, ")
    assert line.endswith("; see --helpshort") and not (tmp_path / "run").exists()


# A MetricsWriter in a process whose files may not grow past 300 bytes (RLIMIT_FSIZE; SIGXFSZ ignored, so a write
# past it fails with EFBIG, as one on a full disk fails with ENOSPC): it writes lines until the kernel refuses one.
CAPPED_WRITER = """
import json, resource, signal, sys
from jaxrl.train.metrics import MetricsWriter
from jaxrl.utils.io import disk_full
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))
writer = MetricsWriter(sys.argv[1], tensorboard=False)
try:
    for step in range(1, 100):
        writer.write({"step": step, "loss": 0.123456789, "note": "x" * 40})
except OSError as e:
    print(disk_full(e))
"""


def test_a_write_refused_half_way_leaves_no_half_written_line(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CAPPED_WRITER, str(tmp_path)], cwd=ROOT, env=launch_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = tmp_path / "metrics.jsonl"
    assert proc.stdout.strip() == f"{metrics}: file too large"
    data = metrics.read_bytes()
    assert data.endswith(b"\n") and len(data) <= 300
    assert [json.loads(line)["step"] for line in data.splitlines()] == list(range(1, len(data.splitlines()) + 1))


# TensorBoard's events file refuses its 200th record with ENOSPC, as on a full disk (metrics.jsonl, on the same disk
# in life, is left to write here: its own full-disk error is the test above), so tensorboardX's writer thread dies.
FULL_TENSORBOARD = """
import errno, sys
import tensorboardX.record_writer as record_writer
from jaxrl.train.metrics import MetricsWriter
original, records = record_writer.RecordWriter.write, [0]
def write(self, data):
    records[0] += 1
    if records[0] >= 200:
        raise OSError(errno.ENOSPC, "No space left on device")
    return original(self, data)
record_writer.RecordWriter.write = write
from jaxrl.utils.io import disk_full
writer = MetricsWriter(sys.argv[1], tensorboard=True)
try:
    for step in range(1, 10 ** 6):
        writer.write({"step": step, **{f"m{i}": 0.5 for i in range(60)}})
except OSError as e:
    print(disk_full(e))
writer.close()
print("closed")
"""


def test_a_dead_tensorboard_writer_is_an_error_at_the_next_write_not_a_hang(tmp_path):
    """Reproduction (2e1e1a6): on a full disk TensorBoard's writer thread died and the main thread waited on its
    queue for good, without a message (and the first Ctrl-C was ignored). Now the next write raises the thread's
    own error (a full disk, naming the folder: what the launchers print as one line), every line of metrics.jsonl
    is whole, and closing the writer does not wait either."""
    proc = subprocess.run([sys.executable, "-c", FULL_TENSORBOARD, str(tmp_path)], cwd=ROOT, env=launch_env(),
                          capture_output=True, text=True, timeout=120)  # a hang would end here, as a failure
    assert proc.returncode == 0, proc.stderr[-3000:]
    error, closed = proc.stdout.strip().splitlines()
    assert error == f"{tmp_path / 'tensorboard'}: no space left on device" and closed == "closed"
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, len(lines) + 1))


@pytest.mark.slow  # a training of the tiny model on a 600 KiB file system
def test_a_full_disk_is_one_line_naming_the_file(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (the full-disk case; the half-written line is tested above)")
    try:
        workdir = disk / "run"
        proc = launch("train", "--config=configs/sft_tiny.py", f"--workdir={workdir}", "--config.data.seq_len=16",
                      "--config.checkpoint_every=2", cache=tmp_path / "xla")
        assert proc.returncode == 1, proc.stderr[-3000:]
        # the project's own progress lines (INFO) stay; everything else is the one line
        lines = [text for text in error_lines(proc) if not re.match(r"I\d{4} ", text)]
        assert len(lines) == 1, lines
        [line] = lines
        assert line.startswith(f"train: {workdir}/")
        assert line.endswith(": no space left on device; free space (or write elsewhere) and rerun the same command: "
                             "it resumes from what was written (--verbose: the libraries' tracebacks)")
        for text in (workdir / "metrics.jsonl").read_text().splitlines(keepends=True):
            assert text.endswith("\n") and json.loads(text)["step"] >= 1
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@contextlib.contextmanager
def read_only(folder):
    """`folder`, created read-only: its mode for a user, a read-only tmpfs for root (whom modes do not stop)."""
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("root without mount: no read-only folder to write under")
    try:
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.slow  # each launcher gets as far as creating its output folder
@pytest.mark.parametrize("launcher", ["train", "evaluate"])
def test_an_output_folder_under_a_read_only_parent_is_one_line_naming_it(env, tmp_path, launcher):
    parent = tmp_path / "ro"
    missing = parent / "sub"
    args = {"train": ("--config=configs/sft_tiny.py", "--config.data.seq_len=16", f"--workdir={missing / 'run'}"),
            "evaluate": (f"--problems={env['problems']}", f"--base={env['model']}", f"--out={missing / 'eval'}",
                         "--reward=exact_match")}[launcher]
    with read_only(parent):
        proc = launch(launcher, *args)
    assert proc.returncode == 1, proc.stderr[-3000:]
    [line] = [text for text in error_lines(proc) if not re.match(r"I\d{4} ", text)]  # INFO progress lines stay
    assert re.fullmatch(rf"{launcher}: {re.escape(str(missing))}: (read-only file system|permission denied); make "
                        r"it writable \(or choose another path\) and rerun \(--verbose: the traceback\)", line), line
