r"""CPU wall time of an online step's teacher-forced pass and train step, padded against packed rows and against
shared prefixes (jaxrl/algorithms/online/layout.py, shared_prefix.py, issue 51), side by side in one process on the
same rows.

    python -m benchmarks.bench_packed_online                          # prompt-heavy: prompts of 512, completions
                                                                      # of 64-256, groups of 8
    python -m benchmarks.bench_packed_online --prompt=128 --tail=0.45 # the users' long tail, scaled down

The model is the tiny Qwen3.5 widened to `--hidden` (both layer kinds, fp32, LoRA r8 on every projection); the rows
are `--groups` x 8, prompt-major (the 8 rows of a group share one prompt, as GRPO's do), with prompts of
`--prompt` tokens (left-padded to it) and completions drawn uniformly from
[`--min_new`, `--max_new`] (`--tail`: that share at the cap instead). One GRPO train step (forward + backward,
micro-batches of `--micro_batch` rows) and one reference pass (`--pass_batch` rows a call) are compiled in each
layout, then timed in `--repeats` interleaved rounds (median and min). Prints one JSON object: each layout's
seconds, the layout counters, what `auto` picks and why, and packed / padded and shared_prefix / padded ratios
(below 1: faster than padded). Packing alone only gains what
padding the rows hold; a prompt-heavy step of full rows gains little; the prompt once per group (shared_prefix,
issue 51 item 2) is what gains there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                                 os.environ.get("XLA_FLAGS", "")).strip()


def rows(args, vocab: int, rng):
    import numpy as np
    n, P, C = args.groups * 8, args.prompt, args.max_new
    ids = np.zeros((n, P + C), np.int32)
    attn = np.zeros_like(ids)
    mask = np.zeros((n, C), np.float32)
    for i in range(n):
        c = C if rng.random() < args.tail else int(rng.integers(args.min_new, C + 1))
        if i % 8 == 0:  # prompt-major: 8 samples of each prompt
            prompt = rng.integers(2, vocab, P)
        ids[i, :P] = prompt
        ids[i, P:P + c] = rng.integers(2, vocab, c)
        attn[i, :P + c] = 1
        mask[i, :c] = 1
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": mask,
            "advantages": rng.standard_normal(n).astype(np.float32), "sequence_mask": np.ones(n, np.float32)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--min_new", type=int, default=64)
    ap.add_argument("--max_new", type=int, default=256)
    ap.add_argument("--tail", type=float, default=0.0, help="share of completions at the cap")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--micro_batch", type=int, default=8)
    ap.add_argument("--pass_batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds after the compiles")
    ap.add_argument("--remat", default="none", help="the model's remat (none: the tiny model keeps everything; "
                    "full / attention: the shared-prefix step's checkpointed layers, as the 4B shape runs)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl.algorithms.grpo_task import GRPOObjective
    from jaxrl.algorithms.online.layout import OnlineLayout
    from jaxrl.algorithms.online.passes import teacher_forced
    from jaxrl.models import lora, qwen35
    from jaxrl.train.step import merge_micro, split_batch

    cfg = qwen35.tiny(num_hidden_layers=4, hidden_size=args.hidden,
                      layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"))
    model = qwen35.Qwen35(cfg, rngs=nnx.Rngs(0), remat=args.remat)
    lora.apply_lora(model, "all-linear", rank=8, alpha=16.0, seed=0)
    rng = np.random.default_rng(0)
    batch = rows(args, cfg.vocab_size, rng)
    C = args.max_new
    objective = GRPOObjective(max_new_tokens=C, aggregation="sequence_mean", beta=0.0, chunk_size=512)
    graphdef, params, rest = nnx.split(model, lora.LoRAParam, ...)

    @jax.jit
    def step(params, split):
        def total(params):
            m = nnx.merge(graphdef, params, rest)
            norm = objective.normalisers(merge_micro(split))

            def body(acc, micro):
                loss, _ = objective.loss(m, micro, norm, jax.random.key(0))
                return acc + loss, None
            return jax.lax.scan(body, jnp.zeros(()), split)[0]
        return jax.value_and_grad(total)(params)

    out = {"args": vars(args), "device": jax.devices()[0].device_kind}
    runs = {}
    for name in ("padded", "packed", "shared_prefix", "auto"):
        layout = OnlineLayout(name, width=C, name="bench")
        train, counters = layout.apply(batch, args.micro_batch)
        split = jax.tree.map(jnp.asarray, split_batch(train, len(train["input_ids"]) // args.micro_batch))
        arrays, pass_counters = layout.apply({k: batch[k] for k in ("input_ids", "attention_mask",
                                                                     "completion_mask")}, args.pass_batch, "pass")
        plan = layout.plan(batch["attention_mask"], args.micro_batch, batch["input_ids"])
        out[name] = {**counters, **pass_counters, "reason": plan.reason}
        if name == "auto":  # one of the three: its times are that layout's
            chosen = "packed" if plan.packed else "shared_prefix" if plan.shared else "padded"
            out["auto"]["chosen"] = chosen
            continue
        runs[name] = (lambda split=split: jax.block_until_ready(step(params, split)),
                      lambda arrays=arrays: teacher_forced(model, arrays, adapters=False, batch_size=args.pass_batch))
        for fn in runs[name]:
            fn()  # compile
    # interleaved rounds (each layout once per round) so that a change of the machine's load hits every layout alike
    times = {name: ([], []) for name in runs}
    for _ in range(args.repeats):
        for name, fns in runs.items():
            for fn, into in zip(fns, times[name]):
                t0 = time.perf_counter()
                fn()
                into.append(time.perf_counter() - t0)
    for name, (step_times, pass_times) in times.items():
        out[name].update(train_step_s=statistics.median(step_times), train_step_min_s=min(step_times),
                         reference_pass_s=statistics.median(pass_times), reference_pass_min_s=min(pass_times))
    for name, key in (("packed", ""), ("shared_prefix", "shared_")):
        for what in ("train_step", "reference_pass"):
            out[f"ratio_{key}{what}"] = out[name][f"{what}_s"] / out["padded"][f"{what}_s"]
            out[f"ratio_{key}{what}_min"] = out[name][f"{what}_min_s"] / out["padded"][f"{what}_min_s"]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
