"""A new weight version arriving while a rollout's long tail runs: drained first (what a server does without partial
rollouts) against swapped under the running rows (`Engine.set_params(in_flight=True)`), one engine, one process.

    python -m benchmarks.bench_inflight_swap [--rows=32 --slots=16 --cap=192 --publish_round=4 --repeats=3]

Workload: rollout A (`rows` rows) decodes; after `publish_round` rounds a new version is published and rollout B
(`rows` more rows) is submitted. Lengths are the users' long tail: half of each rollout's rows run to the cap, the
rest stop uniformly in [8, cap / 4] (each row's own cap, no stop ids: the lengths are the same on both sides).
  * drain: A runs to its end on the old weights; then the new weights are set and B starts (one version per row);
  * in_flight: the new weights are set at once under A's running rows, and B is queued behind them.
On benchmarks/common.py's "small" shape (hidden 256, 4 layers, vocab 2048; a decode step's time grows with its
rows), fp32, temperature 1, `round_steps`=16, shrink on; the new weights are the old ones perturbed (same structure).

Counters (do not move with the machine's load): decode steps and slot-steps to finish both rollouts, slot
utilisation (tokens from decode steps / slot-steps), tokens sampled with the old weights after the publish (the
staleness a drain adds), programs compiled by the swap and prompts prefilled. Timed (median of `repeats`, the sides
interleaved): seconds for both rollouts, tokens/s, and the swap's pause: the wall time of `set_params(in_flight=True)`
plus the round after it, against the median round before it. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def workload(rows: int, cap: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, its own cap) per row: half at `cap`, the rest uniform in [8, cap // 4]."""
    rng = np.random.default_rng(seed)
    caps = [cap if i % 2 == 0 else int(rng.integers(8, cap // 4 + 1)) for i in range(rows)]
    return [(rng.integers(2, 2000, size=int(rng.integers(8, 32))).tolist(), c) for c in caps]


def one_run(model, old, new, mode: str, a, b, *, slots: int, cap: int, publish_round: int) -> dict:
    from jaxrl.generation import TRACE_COUNTS, Engine, Request

    engine = Engine(model, slots=slots, prompt_buckets=(32,), generation_buckets=(cap,), round_steps=16,
                    shrink=True)
    engine.set_params(old)

    def submit(rows, group):
        return [engine.submit(Request(p, group_id=group + j, seed=1, temperature=1.0, max_new_tokens=c,
                                      stop_ids=())) for j, (p, c) in enumerate(rows)]

    t0 = time.perf_counter()
    first = submit(a, 0)
    rounds = []
    for _ in range(publish_round):
        r0 = time.perf_counter()
        engine.step()
        rounds.append(time.perf_counter() - r0)
    tokens_at_publish = engine.stats["generated_tokens"] + sum(
        row.generated for pool in engine.pools.values() for row in pool.occupant if row is not None)
    traces = sum(TRACE_COUNTS.values())
    pause = None
    if mode == "drain":
        engine.run()
        engine.set_params(new)
        second = submit(b, 10_000)
        engine.run()
    else:
        s0 = time.perf_counter()
        engine.set_params(new, in_flight=True)
        second = submit(b, 10_000)
        engine.step()
        pause = time.perf_counter() - s0
        engine.run()
    seconds = time.perf_counter() - t0
    done = [t.wait() for t in first + second]
    tokens = sum(len(c.tokens) for c in done)
    old_version = sum(int((c.token_versions == 0).sum()) for c in done)
    stats = engine.stats
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "decode_steps": stats["decode_steps"], "slot_steps": stats["slot_steps"],
            # a row's first token comes from its prefill, not a decode step
            "slot_utilisation": (tokens - len(done)) / stats["slot_steps"],
            "old_tokens_after_publish": old_version - min(old_version, tokens_at_publish),
            "programs_compiled_after_publish": sum(TRACE_COUNTS.values()) - traces,
            "prefilled_prompts": stats["prefilled_prompts"], "rounds": stats["rounds"],
            "round_before_s": statistics.median(rounds), "swap_pause_s": pause,
            "partial_rows": sum(len(set(c.token_versions.tolist())) > 1 for c in done)}


def run(rows: int = 32, slots: int = 16, cap: int = 192, publish_round: int = 4, repeats: int = 3) -> dict:
    import jax
    from flax import nnx

    from benchmarks.bench_rollout_engine import small_model

    model = small_model()
    old = nnx.state(model)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), len(jax.tree.leaves(old))))
    new = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(next(keys), x.shape, x.dtype) if x.ndim > 1 else x, old)
    a, b = workload(rows, cap, 0), workload(rows, cap, 1)
    kw = dict(slots=slots, cap=cap, publish_round=publish_round)
    for mode in ("drain", "in_flight"):  # compile every program once
        one_run(model, old, new, mode, a, b, **kw)
    runs: dict = {"drain": [], "in_flight": []}
    for _ in range(repeats):
        for mode in runs:
            runs[mode].append(one_run(model, old, new, mode, a, b, **kw))
    out = {"settings": {"rows_per_rollout": rows, "slots": slots, "cap": cap, "publish_round": publish_round,
                        "repeats": repeats, "shape": "small (benchmarks/common.py)", "dtype": "float32"}}
    for mode, results in runs.items():
        last = results[-1]  # counters are the same every repeat
        out[mode] = {**{k: v for k, v in last.items() if k not in ("seconds", "tokens_per_s", "swap_pause_s",
                                                                    "round_before_s")},
                     "seconds_median": statistics.median(r["seconds"] for r in results),
                     "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in results),
                     "round_before_s_median": statistics.median(r["round_before_s"] for r in results)}
        if mode == "in_flight":
            out[mode]["swap_pause_s_median"] = statistics.median(r["swap_pause_s"] for r in results)
    out["in_flight_vs_drain"] = {
        "speed": out["drain"]["seconds_median"] / out["in_flight"]["seconds_median"],
        "decode_steps": out["in_flight"]["decode_steps"] / out["drain"]["decode_steps"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--cap", type=int, default=192)
    parser.add_argument("--publish_round", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(args.rows, args.slots, args.cap, args.publish_round, args.repeats), indent=1))


if __name__ == "__main__":
    main()
