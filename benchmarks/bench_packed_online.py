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
layout, then timed (median of `--repeats`). Prints one JSON object: each layout's seconds, the layout counters, and
packed / padded and shared_prefix / padded ratios (below 1: faster than padded). Packing alone only gains what
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


def timed(fn, repeats: int) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    ap.add_argument("--repeats", type=int, default=3)
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
    model = qwen35.Qwen35(cfg, rngs=nnx.Rngs(0))
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
    for name in ("padded", "packed", "shared_prefix"):
        layout = OnlineLayout(name, width=C, name="bench")
        train, counters = layout.apply(batch, args.micro_batch)
        split = jax.tree.map(jnp.asarray, split_batch(train, len(train["input_ids"]) // args.micro_batch))
        step_s = timed(lambda: jax.block_until_ready(step(params, split)), args.repeats)
        arrays, pass_counters = layout.apply({k: batch[k] for k in ("input_ids", "attention_mask",
                                                                     "completion_mask")}, args.pass_batch, "pass")
        pass_s = timed(lambda: teacher_forced(model, arrays, adapters=False, batch_size=args.pass_batch),
                       args.repeats)
        out[name] = {"train_step_s": step_s, "reference_pass_s": pass_s, **counters, **pass_counters}
    out["ratio_train_step"] = out["packed"]["train_step_s"] / out["padded"]["train_step_s"]
    out["ratio_reference_pass"] = out["packed"]["reference_pass_s"] / out["padded"]["reference_pass_s"]
    out["ratio_shared_train_step"] = out["shared_prefix"]["train_step_s"] / out["padded"]["train_step_s"]
    out["ratio_shared_reference_pass"] = (out["shared_prefix"]["reference_pass_s"]
                                          / out["padded"]["reference_pass_s"])
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
