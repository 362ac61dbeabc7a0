"""The reasoning-gym recipe (`make demo-tasks`, jaxrl/demo_tasks.py) over several seeds: held-out accuracy of the SFT
start, of GRPO's and of distillation's selected checkpoint, each paired against the start, per seed.

    python -m benchmarks.bench_tasks_recipe                        # seeds 0, 1, 2 into bench_out/tasks_recipe/
    python -m benchmarks.bench_tasks_recipe --seeds=3 --out=/tmp/rg --quick

Each seed is one `launchers.demo_tasks` process (its own tiny model, generated problems, SFT, runs and splits),
resumed when its folder holds a finished one. Printed: a markdown table (benchmarks/RESULTS.md's section "CPU:
learning a reasoning-gym task") and the JSON of every seed's recipe.json, with the wall time of each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_seed(out: Path, seed: int, quick: bool) -> dict:
    workdir = out / f"seed_{seed}"
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "launchers.demo_tasks", f"--workdir={workdir}", f"--seed={seed}"]
    subprocess.run(cmd + (["--quick"] if quick else []), cwd=REPO, check=True,
                   env=dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"))
    summary = json.loads((workdir / "recipe.json").read_text())
    summary["wall_s"] = time.perf_counter() - t0
    timings = workdir / "demo_timings.json"
    summary["stage_s"] = json.loads(timings.read_text()) if timings.is_file() else None
    return summary


def table(summaries: list[dict]) -> str:
    """One row per seed: start, GRPO and distillation on held-out (strict rate = accuracy; partial = the task's
    score with its partial credit), each run's paired difference to the start with its 95% interval."""
    head = ("| seed | n | start acc / partial | GRPO (selected) acc / partial | GRPO - start, acc [95% CI] | "
            "distill (selected) acc / partial | distill - start, acc [95% CI] | wall |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        g, d = s["runs"]["grpo"], s["runs"]["distill"]
        start = g["heldout"]["start"]

        def cell(r):
            sel = r["heldout"]["selected"]
            return f"{sel['strict_rate']:.3f} / {sel['partial_reward_mean']:.3f} ({r['selected']})"

        def diff(r):
            row = r["heldout"]["vs_start"]["strict_rate"]
            return f"{100 * row['diff']:+.1f} pp [{100 * row['ci_low']:+.1f}, {100 * row['ci_high']:+.1f}]"

        lines.append(f"| {s['seed']} | {g['heldout']['n_prompts']} | {start['strict_rate']:.3f} / "
                     f"{start['partial_reward_mean']:.3f} | {cell(g)} | {diff(g)} | {cell(d)} | {diff(d)} | "
                     f"{s['wall_s'] / 60:.1f} min |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="bench_out/tasks_recipe")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    summaries = [run_seed(out, seed, args.quick) for seed in range(args.seeds)]
    print(table(summaries))
    print(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
