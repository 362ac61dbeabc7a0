"""The loss ablation is one command: `launchers.sweep` on configs/sweeps/grpo_demo_policy_losses.py makes the demo's
model, tasks and M0 (its prepare command), trains each loss x seed, evaluates each on the held-out prompts, and
prints the table: each variant's held-out reward against ppo_clip, with the recipe-level interval over seeds and
the simultaneous one across the variants. Short runs here (8 steps): the learning itself is measured in
benchmarks/RESULTS.md ("Policy losses on the demo task")."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # four GRPO runs, their evaluations and the demo's warm-up: about three minutes

ROOT = Path(__file__).resolve().parents[1]


def test_the_ablation_command_prints_its_table_with_intervals(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    sweep = (f"configs/sweeps/grpo_demo_policy_losses.py:losses=ppo_clip+cispo,seeds=0+1,steps=8,"
             f"demo={tmp_path / 'demo'}")
    r = subprocess.run([sys.executable, "-m", "launchers.sweep", f"--sweep={sweep}", f"--out={tmp_path / 'out'}"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=1500)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    assert out.startswith("prepare: ") and "--until=warm_up" in out.splitlines()[0]
    assert (tmp_path / "demo" / "base_model" / "config.json").is_file()
    assert "sweep: 4 done, 0 failed" in out
    table = out[out.index("## Mean ± std over seeds"):]
    assert "partial_reward_mean@8" in table and "diff:partial_reward_mean@8" in table
    cispo = next(line for line in table.splitlines() if line.startswith("| cispo | 0,1 |"))
    assert "(n_seeds=2)" in cispo and " [" in cispo  # the recipe-level interval beside the mean difference
    assert "recipe-level differences" in table and "hold for all" in table
    with open(tmp_path / "out" / "comparison_seeds.csv") as f:
        rows = {row["grpo.policy_loss"]: row for row in csv.DictReader(f)}
    c = rows["cispo"]
    lo, hi = float(c["ci_low:partial_reward_mean@8"]), float(c["ci_high:partial_reward_mean@8"])
    slo, shi = float(c["sim_low:partial_reward_mean@8"]), float(c["sim_high:partial_reward_mean@8"])
    assert slo <= lo <= float(c["diff:partial_reward_mean@8"]) <= hi <= shi
    assert 0.0 < float(rows["ppo_clip"]["partial_reward_mean@8"]) < 1.0
