"""A rollout fleet losing a server (jaxrl.backends.fleet): the rows per second of three real `launchers.serve`
processes over loopback, then of the two left after one is SIGKILLed (its requests sent to the others), then of
the three after it is restarted and has rejoined; with the samples of every phase compared token for token (the
same keys: which server drew a row must not change it).

    python -m benchmarks.bench_fleet                    # 3 servers, 24 prompts x 4 samples, 3 rollouts a phase
    python -m benchmarks.bench_fleet --round_delay_s=0  # CPU-bound servers: they share this machine's cores

`--round_delay_s` (default 0.05) sleeps after every server round (`launchers.serve --debug_round_delay_s`): a decode
whose step time does not grow with its rows, as an accelerator's; without it the servers share two CPU cores,
so two of them decode about as fast as three and the ratio says nothing about a fleet. Each server decodes
`--slots` rows at once (8), fewer than its share, so its share takes several waves. Expected with the delay: two
servers give about two thirds of three's rows per second (the rows are split evenly). The restarted server starts
with --warmup=false; one untimed rollout after it rejoins compiles its programs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time

import numpy as np

from benchmarks.bench_overlap import start_server
from benchmarks.common import save_small_hf


def _rollout(pool, prompts, sampling) -> tuple[float, list]:
    t0 = time.perf_counter()
    gens = pool.generate(prompts, list(range(len(prompts))), sampling)
    return time.perf_counter() - t0, [(g.prompt_index, g.sample_index, tuple(g.tokens)) for g in gens]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--rollouts", type=int, default=3, help="timed rollouts per phase")
    parser.add_argument("--round_delay_s", type=float, default=0.05)
    parser.add_argument("--slots", type=int, default=8, help="rows each server decodes at once (fewer than its "
                        "share of a rollout, so a server's rows take several waves: a fleet's throughput)")
    parser.add_argument("--out", default="", help="also write the result as JSON here")
    args = parser.parse_args(argv)

    from jaxrl.backends.base import ModelSpec, SamplingParams
    from jaxrl.backends.options import ServerOptions
    from jaxrl.backends.settings import BackendContext, ServerRollout
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer

    root = os.path.realpath(tempfile.mkdtemp(prefix="bench_fleet_"))
    base = os.path.join(root, "base")
    save_small_hf(base)
    build_tiny_tokenizer(base, ["The quick brown fox jumps over the lazy dog. 0123456789"] * 4)  # the server's
    flags = (f"--debug_round_delay_s={args.round_delay_s}", "--warmup=false", "--max_model_len=128")
    servers = [start_server(base, root, f"serve{k}", 32, args.slots, flags) for k in range(args.servers)]
    try:
        urls = [url for _, url, _ in servers]
        pool = ServerRollout(tuple(urls), ServerOptions(progress_every_s=0)).build(BackendContext(
            base_dir=base, stop_ids=(), max_prompt_len=32, max_new_tokens=args.new_tokens, run_dir=root))
        pool.load(ModelSpec("base", "base", base))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(5, 200, size=int(rng.integers(4, 24))).tolist() for _ in range(args.prompts)]
        sampling = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, temperature=1.0, seed=3)
        _rollout(pool, prompts, sampling)  # compiles every server's programs
        rows = args.prompts * args.samples

        def phase(name: str) -> dict:
            times, samples = [], None
            for _ in range(args.rollouts):
                seconds, got = _rollout(pool, prompts, sampling)
                times.append(seconds)
                samples = got
            metrics = pool.fleet_metrics()
            return {"phase": name, "rows_per_s": rows / statistics.median(times),
                    "seconds": [round(t, 3) for t in times], **metrics, "samples": samples}

        up = phase("all up")
        proc, url, log = servers[-1]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.perf_counter()
        seconds, first_down = _rollout(pool, prompts, sampling)  # the loss found mid-rollout, its rows resent
        lost = {"phase": "the rollout that lost it", "seconds": round(seconds, 3), **pool.fleet_metrics()}
        down = phase("one down")
        servers[-1] = start_server(base, root, f"serve{args.servers - 1}b", 32, args.slots,
                                   flags + (f"--port={url.rsplit(':', 1)[1]}",))
        restart_s = time.perf_counter() - t0
        pool.fleet.try_rejoin()
        _rollout(pool, prompts, sampling)  # the restarted server compiles its programs (started with --warmup=false)
        back = phase("rejoined")
        same = up["samples"] == down["samples"] == back["samples"] == first_down
        result = {"servers": args.servers, "rows_per_rollout": rows, "round_delay_s": args.round_delay_s,
                  "phases": [{k: v for k, v in p.items() if k != "samples"} for p in (up, lost, down, back)],
                  "down_over_up": down["rows_per_s"] / up["rows_per_s"],
                  "rejoined_over_up": back["rows_per_s"] / up["rows_per_s"],
                  "samples_identical_across_phases": same, "restart_s": round(restart_s, 1),
                  "load_average": [round(x, 2) for x in os.getloadavg()]}
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        pool.close()
        return result
    finally:
        for proc, _, log in servers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
            log.close()


if __name__ == "__main__":
    main()
