"""Asynchronous GRPO (`grpo.max_staleness` = k, `grpo.partial_rollouts`): trainer steps per minute of the demo's
GRPO with its rollouts on real `launchers.serve` processes over loopback, under a long-tail length distribution,
at k = 0 (synchronous), 1 (today's `overlap`), 2 and 4, each with and without partial rollouts, side by side in
one process; with the trainer's idle time per step and the per-token staleness each run trained on.

    python -m benchmarks.bench_async                           # every setting, 16 steps a run, 1 round
    python -m benchmarks.bench_async --settings=0,1,2p --rounds=2 --servers=2
    python -m benchmarks.bench_async --learn_steps=30          # + the final reward at k = 0 and 2p, three seeds each

Settings: "k" (max_staleness k, every rollout sampled whole by one version, the clip against the behaviour
policy: today's) and "kp" (k with partial rollouts: up to k rollouts on the servers at once, each new version
reloaded in place under the rows in flight, the decoupled objective, which the setting needs and which adds a
proximal pass per rollout on the trainer).

Workload: `benchmarks.bench_overlap`'s (the demo's GRPO stage on its pretrained model: 8 prompts x 8 samples a
step, one update per rollout, fp32, one device) with the cap raised to `max_new_tokens` (16): the pretrained
model stops at a roughly constant rate per token, so about half its completions run to the cap and the rest are
spread below it (the measured truncation rate and mean length are reported per run); under the demo's learning
rate the policy learns to answer sooner, the faster the less stale its samples, so the synchronous run's rollouts
shorten first: `--learning_rate=1e-5` keeps the distribution of the start in every run (the versions still differ,
so every publish still reloads the adapter under the rows in flight). Each server decodes
`slots` rows at once (default 128: two rollouts). `--round_delay_s` adds a sleep to every server round
(`launchers.serve --debug_round_delay_s`): a decode whose step time does not grow with its rows, as an accelerator's
memory-bound decode (on these CPUs a step's time grows with its rows, which bounds what packing rollouts can gain).

Each run is fresh, after a warm-up run per setting that compiles every program. A run's time is the sum of its
steps' `step_time_s` after the first two (the trainer's wall time per step: waiting for its rollout, publishing
its adapter and the update; compilation excluded; no checkpoint inside the window); steps/min = 60 x timed steps /
that. Reported per setting: the median steps/min over rounds, the ratios to k = 0 and to k = 1 (overlap),
`time/trainer_idle_s` per timed step, the token-weighted staleness and the largest one (never above k), the
fraction of samples continued across a version (`rollout/partial_fraction`), and the load average. The window
starts with up to k rollouts already sampled (the producer's head start during the two untimed steps), which
flatters large k in a short window; `--steps` lengthens it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks.bench_overlap import WARMUP_STEPS, served_demo_grpo

SETTINGS = ("0", "1", "1p", "2", "2p", "4", "4p")


def parse_setting(setting: str) -> tuple[int, bool]:
    """"2p" -> (2, True): max_staleness and partial rollouts."""
    partial = setting.endswith("p")
    k = int(setting[:-1] if partial else setting)
    if partial and k < 1:
        raise ValueError(f"setting {setting!r}: partial rollouts need max_staleness >= 1")
    return k, partial


def configure_run(config, setting: str):
    c = config.copy_and_resolve_references()
    k, partial = parse_setting(setting)
    c.grpo.max_staleness = k
    c.grpo.partial_rollouts = partial
    c.grpo.off_policy_loss = "decoupled" if partial else "behaviour"
    return c


def one_run(config, workdir: str, setting: str) -> dict:
    from jaxrl.algorithms.run import run_training
    records = run_training(configure_run(config, setting), workdir).records
    timed = [r for r in records if r["step"] > WARMUP_STEPS]
    total = sum(r["step_time_s"] for r in timed)
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in timed)  # noqa: E731
    return {"setting": setting, "timed_steps": len(timed), "timed_s": total,
            "steps_per_min": 60.0 * len(timed) / total,
            "trainer_idle_s_per_step": mean("time/trainer_idle_s"),
            "rollout_idle_s_per_step": mean("time/rollout_idle_s"),
            "staleness_mean": mean("rollout/staleness_mean"),
            "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in timed),
            "partial_fraction": mean("rollout/partial_fraction"),
            "truncation_rate": mean("completion/truncation_rate"),
            "length_mean": mean("completion/length_mean"),
            "reward_mean_last": records[-1]["reward/mean"]}


def learning(config, root: str, settings=("0", "2p"), seeds=(0, 1, 2), last: int = 5) -> dict:
    """Reward after the same number of trained samples per setting, over `seeds`: the mean `reward/mean` of the
    last `last` steps of each run, and per setting its mean and seed-to-seed range (the issue's check: k = 2 with
    partial rollouts inside k = 0's spread)."""
    from jaxrl.algorithms.run import run_training
    out = {}
    for setting in settings:
        finals = []
        for seed in seeds:
            c = configure_run(config, setting)
            c.seed = seed
            records = run_training(c, os.path.join(root, f"learn_{setting}_s{seed}")).records
            finals.append(statistics.mean(r["reward/mean"] for r in records[-last:]))
        out[setting] = {"final_reward_by_seed": finals, "mean": statistics.mean(finals),
                        "range": [min(finals), max(finals)]}
    return out


def run(settings=SETTINGS, steps: int = 16, rounds: int = 1, servers: int = 1, workdir: str | None = None,
        learn_steps: int = 0, max_new_tokens: int = 16, slots: int = 128, round_delay_s: float = 0.0,
        round_steps: int = 0, learning_rate: float = 0.0) -> dict:
    for s in settings:
        parse_setting(s)

    demo = {}

    def configure(c):
        c.grpo.max_new_tokens = max_new_tokens
        demo["learning_rate"] = c.optimizer.learning_rate  # what the learning check trains with
        if learning_rate:
            c.optimizer.learning_rate = learning_rate

    def warm_up(warm, root):  # every program compiled (trainer and servers), every code path
        for s in settings:
            one_run(warm, os.path.join(root, f"warmup_{s}"), s)

    flags = ((f"--debug_round_delay_s={round_delay_s}",) if round_delay_s else ()) + (
        (f"--round_steps={round_steps}",) if round_steps else ())
    learned = None
    with served_demo_grpo(steps, servers, workdir, "bench_async_", warm_up, configure, slots, flags) as (
            config, root, info):
        results = {s: [] for s in settings}
        for r in range(rounds):
            for s in settings:
                results[s].append(one_run(config, os.path.join(root, f"run{r}_{s}"), s))
        if learn_steps:
            long = config.copy_and_resolve_references()
            long.steps = learn_steps
            long.optimizer.learning_rate = demo["learning_rate"]
            learned = learning(long, root)
    med = {s: statistics.median(x["steps_per_min"] for x in runs) for s, runs in results.items()}
    out = {**info, "rounds": rounds, "max_new_tokens": max_new_tokens, "slots": slots,
           "round_delay_s": round_delay_s, "round_steps": round_steps, "learning_rate": learning_rate or "the demo's",
           "runs": results, "steps_per_min_median": med}
    if learned is not None:
        out["learning"] = {"steps": learn_steps, **learned}
    for base in ("0", "1"):
        if base in med:
            out[f"ratio_over_{base}"] = {s: v / med[base] for s, v in med.items()}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help="k or kp (partial rollouts), comma-separated")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--max_new_tokens", type=int, default=16, help="the cap (about half the completions)")
    parser.add_argument("--slots", type=int, default=128, help="rows each server decodes at once")
    parser.add_argument("--round_delay_s", type=float, default=0.0, help="a sleep after every server round: a "
                        "decode step whose time does not grow with its rows (0 = the CPU as it is)")
    parser.add_argument("--round_steps", type=int, default=0, help="the servers' decode steps per round (0: their "
                        "default)")
    parser.add_argument("--learning_rate", type=float, default=0.0, help="the timed runs' learning rate (0: the "
                        "demo's, under which the completions shorten as the policy learns; a small one keeps the "
                        "length distribution of the start for every setting)")
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--learn_steps", type=int, default=0, help="also train settings 0 and 2p for this many "
                        "steps on three seeds each and report the final reward (0 = skip)")
    args = parser.parse_args(argv)
    print(json.dumps(run(tuple(args.settings.split(",")), args.steps, args.rounds, args.servers, args.workdir,
                         args.learn_steps, args.max_new_tokens, args.slots, args.round_delay_s, args.round_steps,
                         args.learning_rate), indent=1))


if __name__ == "__main__":
    main()
