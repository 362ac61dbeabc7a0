"""Forward throughput of the jitted JAX Qwen3.5 against transformers, and the chunked kernel's scaling.

    python -m benchmarks.bench_forward

1. tokens/s of a full forward (logits) on the same small config, batch and length, jaxrl (jit, fp32) vs
   transformers (torch eager, fp32, same thread count), in one run, the repeats alternating, as a ratio (with the
   spread of the per-repeat ratios).
2. the chunked gated delta rule as the sequence doubles from 512 to 8192: time per doubling should be ~2x (linear);
   the recurrent form on the same inputs for contrast.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

from benchmarks.common import SMALL_TEXT_CONFIG, save_small_hf, set_cpu_threads, table, time_interleaved, time_it


def forward_ratio(batch: int = 4, seq_len: int = 512, repeats: int = 5) -> dict:
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from jaxrl.models import qwen35

    threads = set_cpu_threads()
    with tempfile.TemporaryDirectory() as folder:
        hf = save_small_hf(folder)
        model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    ids_np = np.random.default_rng(0).integers(2, SMALL_TEXT_CONFIG["vocab_size"], size=(batch, seq_len))
    ids = jnp.asarray(ids_np)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
    ids_t = torch.as_tensor(ids_np)

    def hf_forward():
        with torch.inference_mode():
            hf(input_ids=ids_t).logits

    timed = time_interleaved({"jaxrl": lambda: forward(state, ids).block_until_ready(), "hf": hf_forward},
                             repeats=repeats)
    ours, theirs = timed["jaxrl"], timed["hf"]
    pair_ratios = [t / o for o, t in zip(ours["times_s"], theirs["times_s"])]
    tokens = batch * seq_len
    return {"batch": batch, "seq_len": seq_len, "threads": threads, "repeats": repeats,
            "jaxrl_tokens_per_s": tokens / ours["median_s"], "hf_tokens_per_s": tokens / theirs["median_s"],
            "ratio": theirs["median_s"] / ours["median_s"],
            # each repeat's transformers time over the jaxrl time measured right before it: the spread the load
            # of the shared machine leaves in the ratio
            "pair_ratio_min": min(pair_ratios), "pair_ratio_max": max(pair_ratios)}


def kernel_scaling(lengths=(512, 1024, 2048, 4096, 8192), heads: int = 4, dim: int = 64, repeats: int = 3,
                   recurrent_max: int = 4096) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxrl.ops.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule

    chunk = jax.jit(chunk_gated_delta_rule)
    recurrent = jax.jit(recurrent_gated_delta_rule)
    rows = []
    for n in lengths:
        ks = jax.random.split(jax.random.PRNGKey(n), 5)
        q = jax.random.normal(ks[0], (1, n, heads // 2, dim))
        k = jax.random.normal(ks[1], (1, n, heads // 2, dim))
        v = jax.random.normal(ks[2], (1, n, heads, dim))
        g = -jax.nn.softplus(jax.random.normal(ks[3], (1, n, heads)))
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, n, heads)))
        c = time_it(lambda: chunk(q, k, v, g, beta)[0].block_until_ready(), repeats=repeats)
        row = {"seq_len": n, "chunked_ms": 1e3 * c["median_s"]}
        if n <= recurrent_max:
            r = time_it(lambda: recurrent(q, k, v, g, beta)[0].block_until_ready(), repeats=repeats)
            row["recurrent_ms"] = 1e3 * r["median_s"]
            row["recurrent_over_chunked"] = r["median_s"] / c["median_s"]
        if rows:
            row["growth_per_doubling"] = row["chunked_ms"] / rows[-1]["chunked_ms"]
        rows.append(row)
    return rows


def run(batch: int = 4, seq_len: int = 512, repeats: int = 5, lengths=(512, 1024, 2048, 4096, 8192),
        recurrent_max: int = 4096) -> dict:
    forward = forward_ratio(batch, seq_len, repeats)
    scaling = kernel_scaling(tuple(lengths), repeats=max(1, min(repeats, 3)), recurrent_max=recurrent_max)
    growth = [r["growth_per_doubling"] for r in scaling if "growth_per_doubling" in r]
    return {"forward": forward, "kernel_scaling": scaling,
            "kernel_mean_growth_per_doubling": float(np.mean(growth))}


def main() -> None:
    result = run()
    f = result["forward"]
    print(f"Forward, small Qwen3.5 (B={f['batch']}, T={f['seq_len']}, fp32, {f['threads']} threads)")
    print(table([{"impl": "jaxrl (jit)", "tokens/s": f["jaxrl_tokens_per_s"]},
                 {"impl": "transformers (torch)", "tokens/s": f["hf_tokens_per_s"]}], ["impl", "tokens/s"]))
    print(f"ratio jaxrl / transformers: {f['ratio']:.2f}x\n")
    print("Chunked gated delta rule (B=1, Hv=4, d=64)")
    print(table(result["kernel_scaling"], ["seq_len", "chunked_ms", "growth_per_doubling", "recurrent_ms",
                                           "recurrent_over_chunked"]))
    print(f"mean growth per doubling: {result['kernel_mean_growth_per_doubling']:.2f} (2.0 = linear)")
    if "--json" in sys.argv:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
