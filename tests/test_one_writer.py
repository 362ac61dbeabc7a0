"""One writer per workdir and per output (jaxrl.utils.io.writer_lock): the lock is held by a real process, a second
writer is refused naming its pid, the kernel releases it when the holder dies however it dies (no stale lock), and
two concurrent `train` runs on one workdir leave the first one's run whole (every step once, in order).
Processes are real and paused with SIGSTOP, so "concurrent" is a fact, not a race the test hopes to win."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher_env import ROOT, error_lines, launch, launch_env, snapshot

# A process that takes the lock of argv[1] and says so, then waits to be killed.
HOLDER = ("import sys, time\n"
          "from jaxrl.utils.io import folder_lock_file, writer_lock\n"
          "with writer_lock(folder_lock_file(sys.argv[1]), sys.argv[1], hint='wait'):\n"
          "    print('holding', flush=True)\n"
          "    time.sleep(600)\n")


def holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], cwd=ROOT, env=launch_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def wait_for_lock(lock_file: Path, pid: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until `pid` wrote itself into `lock_file` (it holds the lock)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lock_file.is_file() and lock_file.read_text().startswith(f"{pid} "):
            return
        assert proc.poll() is None, f"the first writer ended (status {proc.returncode}) before taking the lock"
        time.sleep(0.05)
    raise AssertionError(f"{lock_file} was never taken by process {pid}")


def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_holder_leaves_no_stale_lock(tmp_path):
    from jaxrl.utils.io import OutputInUseError, check_not_locked, folder_lock_file, writer_lock
    folder = tmp_path / "out"
    first = holder(folder)
    try:
        with pytest.raises(OutputInUseError, match=rf"^{folder}: in use by process {first.pid} \(.*\); wait$"):
            with writer_lock(folder_lock_file(folder), folder, hint="wait"):
                pass
        with pytest.raises(OutputInUseError, match=f"process {first.pid} "):
            check_not_locked(folder_lock_file(folder), folder, hint="wait")  # the early probe, which writes nothing
    finally:
        first.kill()  # SIGKILL: no clean-up runs in it
        first.wait()
    check_not_locked(folder_lock_file(folder), folder, hint="wait")
    with writer_lock(folder_lock_file(folder), folder, hint="wait"):  # the kernel released it
        assert folder_lock_file(folder).read_text().startswith(f"{os.getpid()} ")
        with writer_lock(folder_lock_file(folder), folder, hint="wait"):  # re-entrant within one process
            pass


@pytest.mark.slow  # one training of the tiny model, a second refused before it loads one
def test_a_second_trainer_on_a_workdir_is_refused_and_the_first_run_is_whole(tmp_path):
    workdir = tmp_path / "run"
    cache = tmp_path / "xla"
    args = ("--config=configs/sft_tiny.py", f"--workdir={workdir}", "--config.data.seq_len=16",
            "--config.checkpoint_every=4", "--config.tensorboard=False")
    first = subprocess.Popen([sys.executable, "-m", "launchers.train", *args], cwd=ROOT, env=launch_env(cache),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_lock(workdir / ".jaxrl.lock", first.pid, first)
        first.send_signal(signal.SIGSTOP)  # the first run holds the workdir, mid-run
        try:
            second = launch("train", *args, cache=cache, timeout=300)
        finally:
            first.send_signal(signal.SIGCONT)
        assert second.returncode == 1, second.stderr[-3000:]
        [line] = error_lines(second)
        assert line.startswith(f"train: {workdir}: in use by process {first.pid} (")
        assert line.endswith("; wait for it to finish (it resumes from its own checkpoints), or use another "
                             "--workdir")
        out, err = first.communicate(timeout=600)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # every step once, in order: nothing of the refused run


@pytest.mark.slow  # three rollout processes of the tiny model
@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_a_second_rollout_into_one_output_is_refused_and_a_killed_first_leaves_no_stale_lock(tmp_path):
    import launcher_env
    env = launcher_env.build(tmp_path / "env")
    out = tmp_path / "rollouts.jsonl"
    cache = tmp_path / "xla"
    args = (f"--problems={env['problems']}", f"--model={env['model']}", f"--out={out}", "--reward=exact_match",
            *launcher_env.SAMPLING)
    lock = out.parent / f".{out.name}.lock"
    first = subprocess.Popen([sys.executable, "-m", "launchers.rollout", *args], cwd=ROOT, env=launch_env(cache),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_lock(lock, first.pid, first)
        first.send_signal(signal.SIGSTOP)
        before = snapshot(tmp_path / "rollouts.jsonl")
        second = launch("rollout", *args, cache=cache)
        assert second.returncode == 1, second.stderr[-3000:]
        [line] = error_lines(second)
        assert line.startswith(f"rollout: {out}: in use by process {first.pid} (")
        assert snapshot(tmp_path / "rollouts.jsonl") == before  # the refused run wrote nothing
    finally:
        first.kill()  # dies holding the lock
        first.wait()
    third = launch("rollout", *args, cache=cache)  # the same command: resumes what the first wrote
    assert third.returncode == 0, third.stderr[-3000:]
    keys = [(r["problem_id"], r["sample_index"]) for r in map(json.loads, out.read_text().splitlines())]
    assert sorted(keys) == sorted({(pid, i) for pid in env["ids"] for i in range(2)})  # each sample once
    assert json.loads(Path(f"{out}.meta.json").read_text())["status"] == "complete"
    # printed once: one summary line, no JSON dump beside an INFO copy of it
    assert third.stdout.strip().splitlines() == [third.stdout.strip()]
    assert third.stdout.startswith(f"rollout: 8 samples of 4 problems in {out} (")
