"""Sampling ahead of training (`grpo.max_staleness` = k): trainer steps per minute of the demo's GRPO with its
rollouts on real `launchers.serve` processes over loopback, k = 0 (synchronous), 1 (`overlap`), 2 and 4, side by
side in one process, with the trainer's and the producer's idle time per step.

    python -m benchmarks.bench_async                       # 12 timed steps per run, 1 round, one server
    python -m benchmarks.bench_async --ks=0,1,2 --rounds=2 --servers=2
    python -m benchmarks.bench_async --learn_steps=30     # + the final reward at k = 0 and 2, three seeds each

The workload is `benchmarks.bench_overlap`'s (the demo's GRPO stage on its pretrained model: 8 prompts x 8 samples
of at most 8 tokens a step, one update per rollout, fp32, one device); each run is fresh, after a warm-up run per k
that compiles every program. A run's time is the sum of its steps' `step_time_s` after the first two (the trainer's
wall time per step, compilation excluded); steps/min = 60 x timed steps / that. Reported per k: the median over
rounds, `time/trainer_idle_s` (the trainer waiting for its rollout: the whole rollout when k = 0) and
`time/rollout_idle_s` (the producer waiting for the bound) summed over the timed steps, and the largest staleness
seen (in policy versions: never above k). The ratios are against k = 0 and k = 1. On a shared 2-core machine the
servers, the trainer and the producer share the cores, which bounds every gain; partial rollouts (rows continued
across an adapter update) are not built, so a long tail still holds its whole rollout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks.bench_overlap import WARMUP_STEPS, served_demo_grpo


def one_run(config, workdir: str, k: int) -> dict:
    from jaxrl.algorithms.run import run_training
    c = config.copy_and_resolve_references()
    c.grpo.max_staleness = k
    records = run_training(c, workdir).records
    timed = [r for r in records if r["step"] > WARMUP_STEPS]
    total = sum(r["step_time_s"] for r in timed)
    return {"k": k, "timed_steps": len(timed), "timed_s": total, "steps_per_min": 60.0 * len(timed) / total,
            "trainer_idle_s": sum(r.get("time/trainer_idle_s", 0.0) for r in timed),
            "rollout_idle_s": sum(r.get("time/rollout_idle_s", 0.0) for r in timed),
            "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in timed),
            "reward_mean_last": records[-1]["reward/mean"]}


def learning(config, root: str, ks=(0, 2), seeds=(0, 1, 2), last: int = 5) -> dict:
    """Reward after the same number of trained samples at each k, over `seeds`: the mean `reward/mean` of the last
    `last` steps of each run, and per k its mean and seed-to-seed range (the issue's check: k = 2 inside k = 0's
    spread)."""
    out = {}
    for k in ks:
        finals = []
        for seed in seeds:
            c = config.copy_and_resolve_references()
            c.seed = seed
            c.grpo.max_staleness = k
            from jaxrl.algorithms.run import run_training
            records = run_training(c, os.path.join(root, f"learn_k{k}_s{seed}")).records
            finals.append(statistics.mean(r["reward/mean"] for r in records[-last:]))
        out[str(k)] = {"final_reward_by_seed": finals, "mean": statistics.mean(finals),
                       "range": [min(finals), max(finals)]}
    return out


def run(ks=(0, 1, 2, 4), steps: int = 12, rounds: int = 1, servers: int = 1, workdir: str | None = None,
        learn_steps: int = 0) -> dict:
    def warm_up(warm, root):  # every program compiled (trainer and servers), every code path
        for k in ks:
            one_run(warm, os.path.join(root, f"warmup_{k}"), k)

    learned = None
    with served_demo_grpo(steps, servers, workdir, "bench_async_", warm_up) as (config, root, info):
        results = {k: [] for k in ks}
        for r in range(rounds):
            for k in ks:
                results[k].append(one_run(config, os.path.join(root, f"run{r}_{k}"), k))
        if learn_steps:
            long = config.copy_and_resolve_references()
            long.steps = learn_steps
            learned = learning(long, root)
    med = {k: statistics.median(x["steps_per_min"] for x in runs) for k, runs in results.items()}
    out = {**info, "rounds": rounds, "runs": {str(k): runs for k, runs in results.items()},
           "steps_per_min_median": {str(k): v for k, v in med.items()}}
    if learned is not None:
        out["learning"] = {"steps": learn_steps, **learned}
    for base_k in (0, 1):
        if base_k in med:
            out[f"ratio_over_k{base_k}"] = {str(k): v / med[base_k] for k, v in med.items()}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", default="0,1,2,4", help="max_staleness values, comma-separated")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--learn_steps", type=int, default=0, help="also train k = 0 and 2 for this many steps on "
                        "three seeds each and report the final reward (0 = skip)")
    args = parser.parse_args(argv)
    ks = tuple(int(k) for k in args.ks.split(","))
    print(json.dumps(run(ks, args.steps, args.rounds, args.servers, args.workdir, args.learn_steps), indent=1))


if __name__ == "__main__":
    main()
