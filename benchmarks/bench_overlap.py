"""Overlap of generation with training (`grpo.overlap`): wall time of the demo's GRPO with its rollouts on a server,
overlap on against off, in one process.

    python -m benchmarks.bench_overlap                    # 12 timed steps per run, 2 rounds, one server
    python -m benchmarks.bench_overlap --steps=6 --rounds=1 --servers=2

The demo's GRPO stage (`jaxrl.demo.Demo.grpo`: the tiny Qwen3.5 of the demo, its `charset` task, 8 prompts x 8
samples of at most 8 tokens a step, one update per rollout, fp32, one device) from the demo's pretrained model
(stage 1; the SFT warm-up is skipped: it changes the weights, not the work), with `rollout_backend='server'` on
`servers` real `launchers.serve` processes over loopback. Without overlap each step samples its rollout on the
server, then scores it, runs the reference / mismatch passes and the update; with it, the next rollout's sampling,
scoring and passes run in a background thread during the update (one rollout off-policy). First a short warm-up
run compiles every program (trainer and servers); then the two settings alternate `rounds` times, each a fresh
run of `steps` steps; the time of a run is the sum of its steps' `step_time_s` after the first two (the trainer's
per-step wall time, compilation excluded), and the reported ratio is off / on of the medians (> 1: overlap is
faster). The machine's load average is recorded before and after: on a shared 2-core machine the server, the
trainer and the background rollout share the same cores, which bounds the gain.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP_STEPS = 2  # steps of each run left out of its time (the first background rollout starts at step 1)


def _config_only_demo(workdir: str):
    """A `jaxrl.demo.Demo` whose training stages keep their config (`.config`) instead of training."""
    from jaxrl.demo import Demo

    class Result:
        records: list = []

    class ConfigOnly(Demo):
        config = None

        def _train(self, config, workdir):
            self.config = config
            return Result()

    return ConfigOnly(workdir, log=lambda _: None)


def demo_grpo_config(folder: str, steps: int):
    """(config of the demo's GRPO stage on the demo's pretrained model, that model's folder)."""
    demo = _config_only_demo(folder)
    demo.claim_folder()
    demo.model()
    demo.tasks()
    demo.p["base"] = demo.p["pretrained"]  # the warm-up (SFT + merge) is skipped
    demo.grpo()
    c = demo.config
    c.steps = steps
    c.checkpoint_every = 10 ** 6  # the run's end still checkpoints once, outside the timed steps
    c.tensorboard = False
    c.checkpoint_async = False
    return c, os.fspath(demo.p["pretrained"])


def start_server(base: str, root: str, name: str, max_prompt_len: int, batch_size: int, flags=()) -> tuple:
    """(process, url, log file) of `launchers.serve` on a free loopback port (`flags`: more of its flags)."""
    ready = os.path.join(root, f"{name}.ready")
    log = open(os.path.join(root, f"{name}.log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "launchers.serve", f"--base={base}", "--port=0", f"--ready_file={ready}",
         "--dtype=float32", f"--max_prompt_len={max_prompt_len}", f"--batch_size={batch_size}",
         f"--allowed_lora_roots={root}", *flags],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ROOT})
    deadline = time.monotonic() + 600
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            with open(os.path.join(root, f"{name}.log")) as f:
                raise RuntimeError(f"launchers.serve did not start:\n{f.read()[-3000:]}")
        time.sleep(0.2)
    with open(ready) as f:
        return proc, f.read().strip(), log


def serve_rollouts(config, base: str, root: str, count: int, procs: list, slots: int = 0, flags=()) -> int:
    """Starts `count` servers of `base` (appended to `procs`, for `stop_servers`) and points the config's GRPO
    rollouts at them; returns the rows of a rollout (each server's batch size unless `slots`)."""
    rows = config.grpo.prompts_per_step * config.grpo.num_generations
    for k in range(count):
        procs.append(start_server(base, root, f"serve{k}", config.data.max_prompt_len, slots or rows, flags))
    config.grpo.rollout_backend = "server"
    config.grpo.rollout_servers = tuple(url for _, url, _ in procs)
    return rows


def stop_servers(procs: list) -> None:
    for proc, _, log in procs:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def one_run(config, workdir: str, overlap: bool) -> dict:
    from jaxrl.algorithms.run import run_training
    c = config.copy_and_resolve_references()
    c.grpo.overlap = overlap
    t0 = time.perf_counter()
    records = run_training(c, workdir).records
    wall = time.perf_counter() - t0
    timed = [r for r in records if r["step"] > WARMUP_STEPS]
    return {"overlap": overlap, "wall_s": wall, "timed_steps": len(timed),
            "timed_s": sum(r["step_time_s"] for r in timed),
            "step_s_median": statistics.median(r["step_time_s"] for r in timed),
            "rollout_wait_s": sum(r.get("time/rollout_wait_s", r.get("time/rollout_s", 0.0)) for r in timed),
            "staleness_mean": statistics.mean(r["rollout/staleness"] for r in timed),
            "reward_mean_last": records[-1]["reward/mean"]}


@contextlib.contextmanager
def served_demo_grpo(steps: int, servers: int, workdir: str | None, prefix: str, warm_up, configure=None,
                     slots: int = 0, server_flags=()):
    """The setting both benchmarks time in: the demo's GRPO config (`steps` steps; `configure(config)` may change
    it) on `servers` real servers (`slots` rows each, default a rollout's; `server_flags`), in `workdir` (default: a
    temporary folder, removed after), `warm_up(config of WARMUP_STEPS + 1 steps, root)` run first to compile every
    program. Yields (config, root, info: rows, load average before, ...)."""
    if steps <= WARMUP_STEPS:
        raise ValueError(f"steps must exceed the {WARMUP_STEPS} untimed steps of each run")
    own = workdir is None
    root = os.path.realpath(tempfile.mkdtemp(prefix=prefix) if own else workdir)
    os.makedirs(root, exist_ok=True)
    info = {"steps": steps, "timed_steps": steps - WARMUP_STEPS, "servers": servers,
            "load_average_before": [round(x, 2) for x in os.getloadavg()], "cores": len(os.sched_getaffinity(0))}
    config, base = demo_grpo_config(os.path.join(root, "demo"), steps)
    if configure is not None:
        configure(config)
    procs = []
    try:
        info["rows"] = serve_rollouts(config, base, root, servers, procs, slots, server_flags)
        warm = config.copy_and_resolve_references()
        warm.steps = WARMUP_STEPS + 1
        warm_up(warm, root)
        yield config, root, info
    finally:
        stop_servers(procs)
        if own:
            shutil.rmtree(root, ignore_errors=True)
    info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]


def run(steps: int = 12, rounds: int = 2, servers: int = 1, workdir: str | None = None) -> dict:
    def warm_up(warm, root):  # every program compiled (trainer and servers), both code paths
        for overlap in (False, True):
            one_run(warm, os.path.join(root, f"warmup_{int(overlap)}"), overlap)

    with served_demo_grpo(steps, servers, workdir, "bench_overlap_", warm_up) as (config, root, info):
        results = {"off": [], "on": []}
        for k in range(rounds):
            for overlap in (False, True):
                results["on" if overlap else "off"].append(
                    one_run(config, os.path.join(root, f"run{k}_{int(overlap)}"), overlap))
    med = {mode: statistics.median(r["timed_s"] for r in runs) for mode, runs in results.items()}
    return {
        **info, "rounds": rounds, "prompts": config.grpo.prompts_per_step, "k": config.grpo.num_generations,
        "max_new_tokens": config.grpo.max_new_tokens, "dtype": config.dtype,
        "off": results["off"], "on": results["on"],
        "off_timed_s": med["off"], "on_timed_s": med["on"],
        "off_step_s": med["off"] / (steps - WARMUP_STEPS), "on_step_s": med["on"] / (steps - WARMUP_STEPS),
        "ratio_off_over_on": med["off"] / med["on"],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.steps, args.rounds, args.servers, args.workdir), indent=1))


if __name__ == "__main__":
    main()
