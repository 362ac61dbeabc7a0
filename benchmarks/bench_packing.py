"""Packed vs padded DPO (issue 31): the fill ratio (real tokens / row tokens) and the real tokens per second of a
DPO epoch over pairs with the pair builder's length spread, both layouts in one run, as a ratio.

    python -m benchmarks.bench_packing                    # small model, 64 pairs, lengths / 16
    python -m benchmarks.bench_packing --pairs=32 --scale=32 --mb=2 --grad_accum=2

Lengths: rollouts of K=8 samples per prompt with the users' generation cap (4,096 tokens) go through the real pair
builder (`jaxrl.data.pairs.build_pairs`, its default filters: truncated samples, a length difference over 512,
a reward margin under 0.5), and the kept pairs' prompt and completion lengths are the data set. The rollouts'
lengths are drawn as a code-generation run gives them: prompts log-normal around 350 tokens (64-2,048),
completions log-normal around 900 tokens with a long tail that reaches the cap (those are truncated, and the
builder drops them); rewards are the verifier's partial scores, drawn at random per sample. The data set is a
cohort of `cohort` kept pairs (the users' 1,000); the run trains on `pairs` of them taken at evenly spaced
quantiles of the sequence length (the longest included, so the padded length T is the cohort's), with every
length divided by `scale` (16: T = 4,416 becomes 276) so an epoch runs in minutes on two CPU cores; the spread,
which is what packing is about, is kept. Token ids are random (the numbers of a step do not depend on them).
`full_scale` also reports the fill ratios of one epoch over the whole cohort at full scale, as the packer plans
them (no model run): what the users' data set gets.

Each layout runs the real trainer (`run_training`, `algorithm = "dpo"`, the small model in fp32, precomputed
reference log-probs, so a step is one forward and backward over its rows) for `epochs` epochs of pairs / global
batch steps. A step's time is the gap between consecutive step ends (batch building and packing included);
the first step, every step that compiled (the packed run compiles once per row length it meets) and the last
(the run's final checkpoint) are left out. Reported per layout: the mean fill ratio the trainer logged
(`fill_ratio`), real tokens per second and per process-CPU-second over the timed steps (sum of tokens / sum of
gaps), the compiles; and the ratios packed / padded, and the gap between the two runs' final losses (the same
pairs and steps: fp32 rounding only). The layouts run back to back in one process, padded first, on the same
pairs; on a shared machine the CPU-second ratio is the one other processes disturb least, and the load before
and after each is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from benchmarks.bench_grpo import SMALL

CAP = 4096  # the users' generation cap (jaxrl.data.pairs module docstring: K=8, 4096 cap)


def rollout_lengths(prompts: int, k: int = 8, seed: int = 0) -> list:
    """Scored samples (`jaxrl.data.pairs.Sample`) of `prompts` prompts x `k` with code-generation lengths
    (module docstring); the completion text is empty (only the token counts matter here)."""
    from jaxrl.data.pairs import Sample
    rng = np.random.default_rng([seed, 31])
    out = []
    for p in range(prompts):
        prompt_len = int(np.clip(rng.lognormal(np.log(350), 0.6), 64, 2048))
        scale = rng.lognormal(0.0, 0.4)  # some prompts ask for longer programs than others
        for i in range(k):
            n = int(np.clip(rng.lognormal(np.log(900 * scale), 0.7), 16, CAP))
            out.append(Sample(problem_id=f"p{p}", sample_index=i, completion="", completion_tokens=n,
                              finish_reason="length" if n >= CAP else "stop",
                              partial=float(rng.choice([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])), strict=False,
                              messages=[{"role": "user", "content": "x" * prompt_len}], max_new_tokens=CAP))
    return out


def pair_lengths(pairs: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """(prompt, chosen, rejected) token counts of `pairs` pairs the pair builder keeps from simulated rollouts
    (full scale). Chosen / rejected include the turn-end token a stopped completion gets."""
    from jaxrl.data.pairs import PairConfig, build_pairs
    out: list[tuple[int, int, int]] = []
    prompts = pairs
    while len(out) < pairs:
        kept, _ = build_pairs(rollout_lengths(prompts, seed=seed), PairConfig(max_new_tokens=CAP))
        out = [(len(p["messages"][0]["content"]), p["chosen_tokens"] + 1, p["rejected_tokens"] + 1) for p in kept]
        prompts *= 2
    return out[:pairs]


def quantile_subset(lengths: list, n: int) -> list:
    """`n` of `lengths` at evenly spaced quantiles of the sequence length (prompt + longer completion), the
    shortest and the longest included, in the cohort's order."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i][0] + max(lengths[i][1:]))
    picked = sorted({order[int(round(q))] for q in np.linspace(0, len(order) - 1, n)})
    return [lengths[i] for i in picked]


def planned_fill(lengths: list, mb: int, grad_accum: int, seed: int = 0) -> dict:
    """Fill ratios of one epoch over `lengths` (full scale) in global batches of mb x grad_accum pairs, padded
    (every sequence to the cohort's longest, rounded up to 64) and packed (`pack_pairs`' plan), and the packed
    row lengths used: the packer alone, no model."""
    from jaxrl.data import packing
    seqs = np.asarray([(p + c, p + r) for p, c, r in lengths])
    width = -(-int(seqs.max()) // 64) * 64
    ladder = packing.row_lengths(2 * width, 64)
    order = np.random.default_rng([seed, 41]).permutation(len(seqs))
    batch = mb * grad_accum
    real = padded = packed = 0
    used = set()
    for start in range(0, len(order) - batch + 1, batch):
        index = order[start:start + batch]
        groups = [[int(x) for i in index[m * mb:(m + 1) * mb] for x in seqs[i]] for m in range(grad_accum)]
        row_len, _ = packing.plan(groups, mb, ladder)
        used.add(row_len)
        real += int(seqs[index].sum())
        padded += 2 * batch * width
        packed += batch * row_len
    return {"padded_length": width, "padded": real / padded, "packed": real / packed,
            "row_lengths": list(ladder), "row_lengths_used": sorted(used)}


def token_pairs(lengths, scale: int, vocab: int, seed: int = 0) -> list[dict]:
    """Pre-tokenised pairs of the given lengths divided by `scale` (at least one token each), random ids."""
    rng = np.random.default_rng([seed, 37])
    ids = lambda n: rng.integers(2, vocab, size=max(1, round(n / scale))).tolist()  # noqa: E731
    return [{"pair_id": f"b{i}", "prompt_ids": ids(p), "chosen_ids": ids(c), "rejected_ids": ids(r)}
            for i, (p, c, r) in enumerate(lengths)]


def make_config(pairs_path: str, seq_len: int, steps: int, mb: int, grad_accum: int, pack: bool):
    from configs import dpo_tiny
    c = dpo_tiny.get_config()
    c.model_overrides = dict(SMALL)
    c.dtype, c.remat = "float32", "none"
    c.steps = steps
    c.checkpoint_every = 10 ** 6  # the run's end still checkpoints once
    c.tensorboard, c.checkpoint_async = False, False
    c.lora.rank, c.lora.alpha = 16, 32.0
    c.batch.micro_batch_size, c.batch.grad_accum = mb, grad_accum
    c.logprob_chunk_size = 512
    c.dpo.precompute_ref_logps = True
    c.dpo.ref_batch_size = mb
    c.data = dict(source="pairs", pairs=pairs_path, max_length=seq_len, pad_multiple=16, min_prompt_tokens=1,
                  eval_fraction=0.0, pack=pack)
    return c


def run_layout(pairs_path: str, seq_len: int, steps: int, mb: int, grad_accum: int, pack: bool) -> dict:
    from jaxrl.algorithms.run import run_training
    load_before = [round(x, 2) for x in os.getloadavg()]
    ticks: dict[int, tuple[float, float]] = {}  # step -> (wall, process CPU) when it ended

    def tick(done, _trainer):
        ticks[done] = (time.perf_counter(), time.process_time())

    with tempfile.TemporaryDirectory() as workdir:
        t0 = time.perf_counter()
        result = run_training(make_config(pairs_path, seq_len, steps, mb, grad_accum, pack), workdir,
                              on_step_end=tick)
        total_s = time.perf_counter() - t0
        with open(os.path.join(workdir, "data_stats.json")) as f:
            stats = json.load(f)
    recs = result.records
    # A step's time is the gap to the previous step's end (batch building, packing, the step, metrics). Left out:
    # the first step, every step that compiled (a new row length), and the last (the run's final checkpoint).
    timed = [r for r in recs if "compile_time_s" not in r and r["step"] - 1 in ticks and r["step"] < len(recs)]
    tokens = sum(r["tokens"] for r in timed)
    wall = sum(ticks[r["step"]][0] - ticks[r["step"] - 1][0] for r in timed)
    cpu = sum(ticks[r["step"]][1] - ticks[r["step"] - 1][1] for r in timed)
    return {
        "pack": pack, "steps": len(recs), "timed_steps": len(timed),
        "fill_ratio": float(np.mean([r["fill_ratio"] for r in recs])),
        "fill_ratio_min": float(min(r["fill_ratio"] for r in recs)),
        "tokens_per_s": tokens / wall if wall else 0.0, "tokens_per_cpu_s": tokens / cpu if cpu else 0.0,
        "tokens_timed": tokens, "seconds_timed": wall, "cpu_seconds_timed": cpu,
        "compiles": sum(1 for r in recs if "compile_time_s" in r),
        "compile_s": sum(r.get("compile_time_s", 0.0) for r in recs), "total_s": total_s,
        "seq_len": stats["train"]["seq_len"], "row_lengths": stats.get("pack_row_lengths"),
        "final_loss": recs[-1]["loss"], "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def run(pairs: int = 64, scale: int = 16, mb: int = 2, grad_accum: int = 2, epochs: int = 1, cohort: int = 1000,
        seed: int = 0) -> dict:
    lengths = pair_lengths(cohort, seed)
    full = quantile_subset(lengths, pairs)
    records = token_pairs(full, scale, SMALL["vocab_size"], seed)
    longest = max(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in records)
    seq_len = -(-longest // 16) * 16
    global_batch = mb * grad_accum
    steps = epochs * (pairs // global_batch)
    out = {"pairs": pairs, "scale": scale, "mb": mb, "grad_accum": grad_accum, "steps": steps, "cohort": cohort,
           "cohort_lengths": {
               "prompt": _summary([p for p, _, _ in lengths]), "chosen": _summary([c for _, c, _ in lengths]),
               "rejected": _summary([r for _, _, r in lengths]),
               "sequence": _summary([p + max(c, r) for p, c, r in lengths])},
           "full_scale": planned_fill(lengths, mb, grad_accum, seed)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pairs.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        for name, pack in (("padded", False), ("packed", True)):
            out[name] = run_layout(path, seq_len, steps, mb, grad_accum, pack)
    out["fill_ratio_ratio"] = out["packed"]["fill_ratio"] / out["padded"]["fill_ratio"]
    out["tokens_per_s_ratio"] = out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"]
    out["tokens_per_cpu_s_ratio"] = out["packed"]["tokens_per_cpu_s"] / out["padded"]["tokens_per_cpu_s"]
    out["loss_gap"] = abs(out["packed"]["final_loss"] - out["padded"]["final_loss"])
    return out


def _summary(values) -> dict:
    v = np.asarray(values, np.float64)
    return {"mean": float(v.mean()), "p50": float(np.median(v)), "p95": float(np.percentile(v, 95)),
            "max": int(v.max()), "min": int(v.min())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=64)
    ap.add_argument("--scale", type=int, default=16)
    ap.add_argument("--mb", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--cohort", type=int, default=1000)
    args = ap.parse_args()
    r = run(args.pairs, args.scale, args.mb, args.grad_accum, args.epochs, args.cohort)
    for name in ("padded", "packed"):
        x = r[name]
        print(f"{name:7s} fill {x['fill_ratio']:.3f}  {x['tokens_per_s']:.0f} real tokens/s  ({x['timed_steps']} timed "
              f"steps, {x['compiles']} compiles, row lengths {x['row_lengths'] or x['seq_len']})")
    f = r["full_scale"]
    print(f"full scale, the {r['cohort']}-pair cohort (planned): fill padded {f['padded']:.3f} (T "
          f"{f['padded_length']}), packed {f['packed']:.3f}, rows {f['row_lengths_used']}")
    print(f"packed / padded: fill x{r['fill_ratio_ratio']:.2f}, tokens/s x{r['tokens_per_s_ratio']:.2f}, tokens per "
          f"CPU-second x{r['tokens_per_cpu_s_ratio']:.2f}; final loss gap {r['loss_gap']:.2g}")
    print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
