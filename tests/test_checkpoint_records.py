"""What a checkpoint leaves behind survives any kill and any change of settings: the held-out evaluation due at a
checkpoint is on disk once its training state is (a real SIGKILL right after the state commits, then the resume);
a sweep compares only points whose records are complete and says which are not; a run resumed with other
settings keeps the settings of the steps already trained (config_history.jsonl) instead of overwriting them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_env import ROOT, launch, launch_env

# launchers.train, with one change: right after the training state of step $KILL_AFTER_COMMIT is committed on disk,
# the process SIGKILLs itself (nothing after the commit runs: no clean-up, no later write).
KILL_AFTER_COMMIT = """
import os, runpy, signal, sys
from jaxrl.train import checkpoints
save = checkpoints.RunCheckpoints.save
def save_then_die(self, step, *args, **kwargs):
    save(self, step, *args, **kwargs)
    if step == int(os.environ["KILL_AFTER_COMMIT"]):
        self.wait()
        os.kill(os.getpid(), signal.SIGKILL)
checkpoints.RunCheckpoints.save = save_then_die
sys.argv = ["launchers.train"] + sys.argv[1:]
runpy.run_module("launchers.train", run_name="__main__", alter_sys=True)
"""

DPO = ("--config=configs/dpo_tiny.py", "--config.steps=8", "--config.checkpoint_every=4",
       "--config.tensorboard=False", "--config.checkpoint_async=False")


def held_out_steps(workdir: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
            if "eval_preference_accuracy" in r]


@pytest.mark.slow  # a DPO run of the tiny model killed at its first checkpoint, then resumed
@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_a_sigkill_right_after_a_state_commit_loses_no_held_out_record(tmp_path):
    workdir = tmp_path / "dpo"
    cache = tmp_path / "xla"
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_COMMIT, *DPO, f"--workdir={workdir}"], cwd=ROOT,
                            env=launch_env(cache, {"KILL_AFTER_COMMIT": "4"}), capture_output=True, text=True,
                            timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (workdir / "checkpoints" / "state" / "4").is_dir()  # the state of step 4 landed before the kill
    resumed = launch("train", *DPO, f"--workdir={workdir}", cache=cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert held_out_steps(workdir) == [4, 8]  # the record due at step 4 too, each once


def point(slug: str, seed: int, records: list[dict]):
    from jaxrl.sweep.compare import PointData
    return PointData(slug, slug, {"beta": "0.1", "seed": str(seed)}, {}, "done", {}, {}, records, None, Path(slug))


def test_a_sweep_averages_only_complete_records_and_says_which_are_not():
    from jaxrl.sweep.compare import build_table, over_seeds
    meta = {"axes": [{"name": "beta", "labels": ["0.1"]}, {"name": "seed", "labels": ["0", "1"]}], "points": [],
            "baseline": None}
    train = [{"step": s, "loss": 0.5} for s in (4, 8)]
    full = train + [{"step": 4, "eval_preference_accuracy": 0.6}, {"step": 8, "eval_preference_accuracy": 0.8}]
    lost = train + [{"step": 8, "eval_preference_accuracy": 0.9}]  # the record of step 4 never written
    table = build_table(meta, [point("s0", 0, full), point("s1", 1, lost)], metrics=["eval_preference_accuracy"])
    rows = {r["point"]: r for r in table.rows}
    assert rows["s1"]["incomplete"] == "eval_preference_accuracy@4" and rows["s0"]["incomplete"] is None
    assert any(n.startswith("s1 lacks eval_preference_accuracy@4") for n in table.notes)
    recipe = over_seeds(table)
    [row] = recipe.rows
    assert row["eval_preference_accuracy@4"] is None  # not the one seed that has it, passed off as the mean of two
    assert row["eval_preference_accuracy@8"] == pytest.approx(0.85)
    assert any("eval_preference_accuracy@4 of beta=0.1: not averaged, s1 lack(s) it" in n for n in recipe.notes)


@pytest.mark.slow  # three short trainings of the tiny model in this process
@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_a_resume_with_other_settings_keeps_the_settings_of_the_steps_already_trained(tmp_path):
    from configs import sft_tiny
    from jaxrl.algorithms.run import run_training
    workdir = tmp_path / "run"

    def train(steps: int, learning_rate: float) -> dict:
        cfg = sft_tiny.get_config()
        cfg.tensorboard, cfg.checkpoint_async = False, False
        cfg.compile_options = {"xla_backend_optimization_level": 0}
        cfg.steps, cfg.checkpoint_every, cfg.data.seq_len = steps, 2, 16
        cfg.optimizer.learning_rate = learning_rate
        run_training(cfg, str(workdir))
        return json.loads((workdir / "config.json").read_text())

    assert train(2, 1e-3)["optimizer"]["learning_rate"] == 1e-3
    assert not (workdir / "config_history.jsonl").exists()
    now = train(4, 5e-4)  # steps 3-4 at the new rate
    [earlier] = map(json.loads, (workdir / "config_history.jsonl").read_text().splitlines())
    assert (earlier["first_step"], earlier["last_step"]) == (1, 2)
    assert earlier["config"]["optimizer"]["learning_rate"] == 1e-3 and now["optimizer"]["learning_rate"] == 5e-4
    before = {p: (workdir / p).read_bytes() for p in ("config.json", "config_history.jsonl")}
    train(4, 1e-2)  # finished: nothing is trained at this rate, so nothing about the settings changes
    assert {p: (workdir / p).read_bytes() for p in before} == before
