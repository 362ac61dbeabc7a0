"""A run killed without any clean-up (SIGKILL) -- once between checkpoints, once in the middle of a checkpoint
write, once between a state's save and its adapter's -- and resumed by the launcher ends bit-identical to an
uninterrupted run."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxrl.models.adapters import load_adapter
from jaxrl.train.checkpoints import RunCheckpoints
from jaxrl.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config=configs/sft_tiny.py", "--config.steps=12", "--config.checkpoint_every=4",
        "--config.keep_checkpoints=2", "--config.data.seq_len=16",
        "--config.lora.targets=q_proj,in_proj_qkv,out_proj,down_proj"]


def launch(workdir, cache_dir, *extra, args=ARGS):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               # every run compiled alike; a low LLVM optimisation level just compiles quicker
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0")
    cmd = [sys.executable, "-m", "launchers.train", f"--workdir={workdir}", *args, *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.heavy
@pytest.mark.slow
def test_killed_runs_resume_bit_identical(tmp_path):
    cache = str(tmp_path / "jax_cache")  # compile once for all four processes
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")

    done = launch(straight, cache)
    assert done.returncode == 0, done.stderr[-3000:]

    # 1. killed after step 5: the newest complete state is step 4; step 5 is lost and must be redone
    first = launch(broken, cache, "--debug_kill_after_step=5")
    assert first.returncode == -9, first.stderr[-3000:]
    ckpt = RunCheckpoints(broken, async_save=False)
    assert ckpt.latest_step() == 4 and ckpt.adapter_steps() == [4]
    ckpt.close()
    assert [r["step"] for r in read_metrics(broken)] == [1, 2, 3, 4, 5]
    # as a kill between a state's save and its adapter's leaves it (the state is saved first): the resume writes
    # the adapter of step 4 from the restored state (compared with the uninterrupted run's below)
    shutil.rmtree(os.path.join(broken, "checkpoints", "adapters", "4"))

    # 2. resumed, then killed right after the write of step 8 started: 8 may or may not have landed
    second = launch(broken, cache, "--debug_kill_during_save=8")
    assert second.returncode == -9, second.stderr[-3000:]
    assert "resumed from" in second.stderr and "(step 4)" in second.stderr
    assert "the adapter of step 4 was never written" in second.stderr

    # 3. an unfinished write as a crash leaves it (Orbax's temporary folder): never taken for a checkpoint
    ckpt = RunCheckpoints(broken, async_save=False)
    newest = ckpt.latest_step()
    assert newest in (4, 8)
    ckpt.close()
    fake = os.path.join(broken, "checkpoints", "state", "11.orbax-checkpoint-tmp")
    shutil.copytree(os.path.join(broken, "checkpoints", "state", str(newest)), fake)

    third = launch(broken, cache)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"(step {newest})" in third.stderr
    assert not os.path.exists(fake)

    a_params, a_meta = load_adapter(straight, step=12)
    b_params, b_meta = load_adapter(broken, step=12)
    assert a_meta["step"] == b_meta["step"] == 12 and sorted(a_params) == sorted(b_params)
    for name in a_params:
        np.testing.assert_array_equal(b_params[name], a_params[name], err_msg=name)
    assert any(np.abs(a_params[n]).max() > 0 for n in a_params if n.endswith("lora_B"))  # it trained
    for step in (4, 8):  # every shared adapter artifact is identical too
        for name, value in load_adapter(straight, step=step)[0].items():
            np.testing.assert_array_equal(load_adapter(broken, step=step)[0][name], value)

    # metrics: each step exactly once, and the same numbers as the uninterrupted run
    a_metrics, b_metrics = read_metrics(straight), read_metrics(broken)
    assert [r["step"] for r in b_metrics] == list(range(1, 13))
    assert [r["loss"] for r in b_metrics] == [r["loss"] for r in a_metrics]
    assert [r["lora_norm"] for r in b_metrics] == [r["lora_norm"] for r in a_metrics]
    # the resolved config beside them, and the full training state keeps only the newest two
    with open(os.path.join(broken, "config.json")) as f:
        assert json.load(f)["steps"] == 12
    assert sorted(os.listdir(os.path.join(broken, "checkpoints", "state"))) == ["12", "8"]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(straight, "tensorboard")))
