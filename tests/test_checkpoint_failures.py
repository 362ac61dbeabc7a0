"""A checkpoint folder that cannot be written ends `launchers.train` in one line naming the folder and the cause,
within seconds, and leaves the checkpoints written before it as they were (jaxrl/train/checkpoints.py).

The failure is a real read-only folder: `chmod -R a-w` on checkpoints/. Root ignores file modes, so when the tests
run as root the training process starts without the capabilities that let root write anyway
(CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, dropped from its bounding set before exec): it meets the folder exactly
as any other user does.
"""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher_env import ROOT, error_lines, launch_env, snapshot

TRAIN = ("--config=configs/sft_tiny.py", "--config.data.seq_len=16", "--config.checkpoint_every=4",
         "--config.tensorboard=False")

# `launchers.train` as a user runs it, with one addition: right after step 4's checkpoint has landed, the run's
# checkpoints/ folder turns read-only (`chmod -R a-w`), so the save of step 8 is the first one refused.
FREEZE_AFTER_FIRST_SAVE = """
import subprocess, sys
import jaxrl.algorithms.run as run
from launchers import _main, train

real_run_training = run.run_training

def freeze_checkpoints(done, trainer):
    if done == 4:
        trainer.ckpt.wait()
        subprocess.run(["chmod", "-R", "a-w", trainer.ckpt.state_dir + "/.."], check=True)

run.run_training = lambda config, workdir, on_step_end=None: real_run_training(config, workdir,
                                                                               on_step_end=freeze_checkpoints)
sys.argv = ["train", *sys.argv[1:]]
_main.run(train.main, interruptible=True)
"""

_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def _without_root_overrides() -> None:
    """(preexec_fn) Root keeps its uid but loses the capabilities that ignore file modes, in the child only."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def train(workdir: Path, *args: str, cache: Path, script: str | None = None, timeout: float = 240):
    """(CompletedProcess, seconds) of one training process that honours file modes, root or not."""
    command = [sys.executable, "-c", script] if script else [sys.executable, "-m", "launchers.train"]
    t0 = time.monotonic()
    proc = subprocess.run([*command, *TRAIN, f"--workdir={workdir}", *args], cwd=ROOT, env=launch_env(cache),
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_without_root_overrides if os.geteuid() == 0 else None)
    return proc, time.monotonic() - t0


def make_writable(folder: Path) -> None:
    for path in [folder, *folder.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)


def assert_one_line_refusal(proc: subprocess.CompletedProcess, expected_start: str) -> None:
    lines = error_lines(proc)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith(expected_start), lines[-1]
    assert not [line for line in lines if line.startswith(("E", "W")) and "orbax" in line.lower()], lines


@pytest.mark.slow  # three trainings of the tiny model (one compiled program, shared through the cache)
def test_a_read_only_checkpoint_folder_ends_the_run_in_one_line_within_seconds_and_loses_nothing(tmp_path):
    """Reproduction on 2e1e1a6: checkpoints/ turns read-only after the first save; the save of step 8 fails in
    Orbax's background threads (17 tracebacks: each thread logs its own), training goes on to step 12, the one-line
    error comes at the last save, and the process exits 301 s later: the threads that waited for the step's
    folder, which was never made, wait out Orbax's 300 s coordination timeout before the interpreter can end.
    Here: the save of step 8 raises at once (Orbax makes the step's folder in the caller's thread), one line names
    the folder and the cause, the process ends within seconds, step 4 is untouched; a rerun on the read-only folder
    is refused before it trains; made writable again, the same command resumes from step 4 and finishes."""
    workdir, cache = tmp_path / "run", tmp_path / "xla"
    checkpoints = workdir / "checkpoints"
    try:
        proc, seconds = train(workdir, "--config.steps=12", cache=cache, script=FREEZE_AFTER_FIRST_SAVE)
        assert_one_line_refusal(proc, f"train: cannot write the checkpoint of step 8 to {checkpoints / 'state'}: "
                                      "Permission denied; make it writable")
        assert "it resumes from the newest complete checkpoint, step 4" in proc.stderr
        # compilation and the steps take a few seconds; 2e1e1a6 took over 300
        assert seconds < 60, f"the run took {seconds:.0f} s to end"
        written = snapshot(checkpoints)
        assert sorted({p.split("/")[1] for p in written if p.startswith("state/")}) == ["4"]

        again, _ = train(workdir, "--config.steps=12", cache=cache)  # still read-only: refused before training
        assert_one_line_refusal(again, f"train: cannot write checkpoints to {checkpoints / 'state'}: "
                                       "Permission denied")
        assert "step 5/" not in again.stderr
        assert snapshot(checkpoints) == written
    finally:
        make_writable(workdir)
    resumed, _ = train(workdir, "--config.steps=12", cache=cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "(step 4)" in resumed.stderr
    assert sorted(int(p.name) for p in (checkpoints / "state").iterdir() if p.name.isdigit()) == [8, 12]
    assert sorted(int(p.name) for p in (checkpoints / "adapters").iterdir() if p.name.isdigit()) == [4, 8, 12]
