"""SIGINT / SIGTERM in the middle of a training step: exit status 130 / 143, one line saying how to resume, the
checkpoint of the step reached on disk, and the resumed run bit-identical to an uninterrupted one.

The chain of 20 interrupts runs in one process (tests/interrupt_chain.py: each run through launchers/_main.call,
the signal sent to the process itself at a random moment of a step); the fast test sends the signals from
outside to `python -m launchers.train`, as a terminal or a scheduler does (no segmentation fault, no swallowed
signal, nothing printed but the line)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from launcher_env import ROOT, launch_env

from jaxrl.models.adapters import load_adapter
from jaxrl.train.checkpoints import RunCheckpoints
from jaxrl.train.metrics import read_metrics

pytestmark = pytest.mark.heavy  # 20 SIGINTs at random moments; signals from outside

TRAIN = ("--config=configs/sft_tiny.py", "--config.checkpoint_every=1000", "--config.data.seq_len=16",
         "--config.log_every=1")


def chain(workdir, cache, interrupts: int, steps: int, seed: int = 0) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "tests" / "interrupt_chain.py"), f"--interrupts={interrupts}", f"--seed={seed}",
           "--", f"--workdir={workdir}", *TRAIN, f"--config.steps={steps}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(cache), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def assert_same_run(a: str, b: str, steps: int) -> None:
    a_params, a_meta = load_adapter(a, step=steps)
    b_params, b_meta = load_adapter(b, step=steps)
    assert a_meta["step"] == b_meta["step"] == steps and sorted(a_params) == sorted(b_params)
    for name in a_params:
        np.testing.assert_array_equal(b_params[name], a_params[name], err_msg=name)
    a_metrics, b_metrics = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in b_metrics] == list(range(1, steps + 1))  # every step once
    for key in ("loss", "lora_norm", "grad_norm"):
        assert [r[key] for r in b_metrics] == [r[key] for r in a_metrics], key


@pytest.mark.slow
def test_twenty_sigints_at_random_moments_resume_bit_identical(tmp_path):
    steps, interrupts = 100, 20
    cache = tmp_path / "xla"
    [straight] = chain(tmp_path / "straight", cache, 0, steps)
    assert straight["status"] == 0
    runs = chain(tmp_path / "broken", cache, interrupts, steps, seed=19)
    assert len(runs) == interrupts + 1
    previous = 0
    for run in runs[:-1]:
        reached = run["latest_state"]
        assert run["status"] == 130, run
        assert previous < reached < steps and run["metric_steps"] == reached, run  # the step reached, saved
        assert run["last_line"] == (f"train: interrupted (SIGINT): training stopped after step {reached} of {steps} "
                                    f"(checkpoint of step {reached} in {tmp_path / 'broken'}/checkpoints/state/"
                                    f"{reached}); rerun the same command to resume")
        previous = reached
    assert runs[-1]["status"] == 0 and runs[-1]["latest_state"] == steps
    assert_same_run(str(tmp_path / "straight"), str(tmp_path / "broken"), steps)


def signal_mid_step(workdir, cache, signum: int, rng: random.Random) -> subprocess.CompletedProcess:
    """`launchers.train` in its own process, sent `signum` at a random moment after it has done two steps."""
    metrics = os.path.join(workdir, "metrics.jsonl")

    def lines() -> int:
        return open(metrics, "rb").read().count(b"\n") if os.path.exists(metrics) else 0

    start = lines()
    proc = subprocess.Popen([sys.executable, "-m", "launchers.train", f"--workdir={workdir}", *TRAIN,
                             "--config.steps=200"], cwd=ROOT, env=launch_env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while lines() < start + 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.1))
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow  # two processes, each compiling the tiny model
def test_sigint_then_sigterm_from_outside_stop_after_the_step_with_its_checkpoint(tmp_path):
    workdir, cache, rng = str(tmp_path / "run"), tmp_path / "xla", random.Random(7)
    previous = 0
    for signum, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        proc = signal_mid_step(workdir, cache, signum, rng)
        assert proc.returncode == status, proc.stderr[-3000:]
        name = signal.Signals(signum).name
        m = re.fullmatch(rf"train: interrupted \({name}\): training stopped after step (\d+) of 200 \(checkpoint of "
                         rf"step \1 in {re.escape(workdir)}/checkpoints/state/\1\); rerun the same command to resume",
                         proc.stderr.strip().splitlines()[-1])
        assert m, proc.stderr[-3000:]
        reached = int(m.group(1))
        ckpt = RunCheckpoints(workdir, async_save=False)
        assert ckpt.latest_step() == reached > previous + 1
        ckpt.close()
        assert [r["step"] for r in read_metrics(workdir)] == list(range(1, reached + 1))
        assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
        assert f"{name}: stopping after the current step" in proc.stderr
        previous = reached


@pytest.mark.slow  # three rollout processes of the tiny model
def test_sigint_during_rollouts_keeps_the_batches_written_and_the_rerun_completes_them(tmp_path):
    """A SIGINT after the first batch landed: exit 130, one line with the count, only whole batches on disk; the
    rerun adds the rest, and the file then holds the same samples as an uninterrupted run."""
    import launcher_env

    # 9 problems x 4 samples in written batches of 4 rows: 9 batches, so the SIGINT sent when the first lands
    # finds batches still to run even on a loaded machine (with 2 batches, CI once saw the second finish first)
    env, cache = launcher_env.build(tmp_path / "env", n_problems=9), tmp_path / "xla"
    sampling = [a for a in launcher_env.SAMPLING
                if not a.startswith(("--batch_size", "--max_new_tokens", "--num_samples"))]
    args = [f"--problems={env['problems']}", f"--model={env['model']}", *sampling, "--batch_size=1",
            "--num_samples=4", "--max_new_tokens=64", "--mesh_shape=1,1,1"]
    # one device, one engine slot: a call (a written batch) takes 4 slots' worth of rows (JaxBackend's
    # collect_factor), so the 36 samples land in 9 batches of one problem

    def rollout(out, stop=False):
        cmd = [sys.executable, "-m", "launchers.rollout", *args, f"--out={out}"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(cache), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        if stop:
            deadline = time.monotonic() + 600
            while not (os.path.exists(out) and os.path.getsize(out)) and proc.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.005)
            proc.send_signal(signal.SIGINT)
        out_, err = proc.communicate(timeout=600)
        return proc.returncode, err

    def records(path):
        return sorted((r["problem_id"], r["sample_index"], r["completion"], json.dumps(r["reward"]))
                      for r in map(json.loads, open(path)))

    straight, broken = str(tmp_path / "straight.jsonl"), str(tmp_path / "broken.jsonl")
    rc, err = rollout(straight)
    assert rc == 0, err[-3000:]
    rc, err = rollout(broken, stop=True)
    assert rc == 130, err[-3000:]
    kept = records(broken)
    assert err.strip().splitlines()[-1] == (f"rollout: interrupted (SIGINT): rollouts stopped with {len(kept)} of 36 "
                                            f"samples in {broken}; rerun the same command to resume")
    assert 0 < len(kept) < 36 and len(kept) % 4 == 0 and set(kept) <= set(records(straight))
    rc, err = rollout(broken)
    assert rc == 0, err[-3000:]
    assert records(broken) == records(straight)
