"""Samples of two checkpoints never share a file: `rollout --adapter=RUN_DIR` records the step the run folder
resolved to and the adapter's digest in <out>.meta.json, and a resume after the run trained on (the folder now
resolves to a newer checkpoint) is refused with every file as it was; the same step named explicitly resumes."""

from __future__ import annotations

import json

import numpy as np
import pytest

import launcher_env
from launcher_env import error_lines, launch, snapshot


@pytest.mark.slow  # one rollout of the tiny model in this process, two refused or no-op runs as a user runs them
def test_a_resume_that_resolves_to_another_checkpoint_is_refused(tmp_path):
    from jaxrl.models.adapters import Adapter, read_trainer_adapter, write_adapter_checkpoint
    from jaxrl.rollout.runner import RolloutConfig, run_rollouts
    env = launcher_env.build(tmp_path / "env", n_problems=2)
    out = tmp_path / "rollouts.jsonl"
    settings = dict(problems=env["problems"], model=env["model"], out=str(out), adapter=env["run"], num_samples=2,
                    temperature=1.0, max_new_tokens=8, max_prompt_len=192, prompt_buckets=(192,), batch_size=4,
                    dtype="float32", seed=3, reward="exact_match", progress=False)
    run_rollouts(RolloutConfig(**settings))
    meta = json.loads((tmp_path / "rollouts.jsonl.meta.json").read_text())["settings"]
    newest = read_trainer_adapter(env["run"])
    assert (meta["adapter_step"], meta["adapter_digest"]) == (5, newest.digest())

    # the run trains on: a step 7 checkpoint (other weights) appears in the same folder
    params = {k: (v + np.float32(0.5)) for k, v in newest.params.items()}
    write_adapter_checkpoint(env["run"], 7, Adapter(params=params, rank=newest.rank, alpha=newest.alpha))
    before = snapshot(tmp_path / "rollouts.jsonl") | snapshot(tmp_path / "rollouts.jsonl.meta.json")
    flags = [f"--{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in settings.items()
             if k != "progress"] + ["--noprogress"]
    refused = launch("rollout", *flags)
    assert refused.returncode == 1, refused.stderr[-3000:]
    [line] = error_lines(refused)
    assert line.startswith(f"rollout: {out} holds rollouts drawn with other settings (adapter_step: 5 -> 7; "
                           "adapter_digest: ")
    assert line.endswith("or pin the checkpoint the file was started with (--adapter=<run>/checkpoints/adapters/"
                         "<step>)")
    assert snapshot(tmp_path / "rollouts.jsonl") | snapshot(tmp_path / "rollouts.jsonl.meta.json") == before
    pinned = [f for f in flags if not f.startswith("--adapter=")] + [f"--adapter={env['run']}/checkpoints/adapters/5"]
    resumed = launch("rollout", *pinned)  # the step the file was started with: it resumes (nothing left to draw)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert snapshot(tmp_path / "rollouts.jsonl") == {k: v for k, v in before.items() if k == "rollouts.jsonl"}
