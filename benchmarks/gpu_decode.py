"""Decode throughput of the generation engine at the Qwen3.5-4B shape, 160 concurrent sequences (the users' 20
prompts x 8 samples), against the memory-bandwidth bound. Prints one JSON object.

    python -m benchmarks.gpu_decode                      # on a GPU: 4B shape, bf16, random weights
    python -m benchmarks.gpu_decode --tiny               # CPU smoke test of the same code path

Random weights are enough: decode cost does not depend on their values, and no EOS is configured, so every row
runs all `--new_tokens` steps. The generation engine's programs run as for one pool of `--batch` slots
(`benchmarks.common.EngineBatch`): prefill (the slots' caches allocated, the prompts prefilled, each row's first
token sampled and moved into its slot) and decode (one round of decode steps to the cap) are timed separately;
compile time is excluded by a warm-up call of the same shapes.

The bound: one decode step must read every weight once (the tied embedding is the output head, read in full;
an untied input embedding is only gathered), and read + write the recurrent state of each Gated DeltaNet layer
(fp32 [B, Hv, dk, dv]) and its conv window, and read the KV cache of each attention layer. Two KV figures are
given: `as_implemented` (the whole preallocated buffer, prompt bucket + new tokens, which is what a masked
fixed-shape attention reads) and `ideal` (only the filled slots, on average prompt + new/2). Step time >=
bytes / HBM bandwidth (H200: 4.8 TB/s), so tokens/s <= batch * bandwidth / bytes_per_step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e


def _log(message: str) -> None:
    print(f"[gpu_decode {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _peak_gib():
    """Peak device memory of this process so far (None where the backend keeps no statistics, e.g. the CPU)."""
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None


def step_bytes(cfg, batch: int, kv_slots: float, param_bytes: int, embed_bytes: int, dtype_bytes: int) -> dict:
    """Bytes one decode step must move, by kind."""
    n_linear = sum(t == "linear_attention" for t in cfg.layer_types)
    n_full = cfg.num_hidden_layers - n_linear
    gathered = batch * cfg.hidden_size * dtype_bytes  # an untied input embedding is only gathered, B rows
    weights = param_bytes if cfg.tie_word_embeddings else param_bytes - embed_bytes + gathered
    recurrent = 2 * batch * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = 2 * batch * (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * dtype_bytes
    kv = 2 * batch * kv_slots * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    return {"weights": int(weights), "gdn_state": int(n_linear * (recurrent + conv)), "kv": int(n_full * kv)}


def run(tiny: bool = False, batch: int = 160, prompt_len: int = 512, new_tokens: int = 256,
        bandwidth: float = H200_BANDWIDTH, repeats: int = 2) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.common import EngineBatch
    from jaxrl.models import qwen35
    from jaxrl.models.qwen35.config import qwen35_4b, tiny as tiny_config

    if tiny:
        cfg, dtype = tiny_config(), jnp.float32
    else:
        cfg, dtype = qwen35_4b(), jnp.bfloat16
    # Eager init, op by op on the device. (A jitted init has no inputs, so XLA constant-folds the random
    # weights at compile time: minutes for 4B parameters.)
    t0 = time.perf_counter()
    with jax.default_device(jax.devices()[0]):
        model = qwen35.init_model(cfg, dtype=dtype, seed=0)
    jax.block_until_ready(nnx.state(model))
    init_s = time.perf_counter() - t0
    _log(f"initialised {cfg.num_hidden_layers}-layer model on {jax.devices()[0].device_kind} in {init_s:.1f} s")

    rng = np.random.default_rng(0)
    prompts = rng.integers(10, min(cfg.vocab_size, 240_000), size=(batch, prompt_len)).astype(np.int32)

    t0 = time.perf_counter()
    # plain sampling at temperature 1 (the rollout setting); the engine's programs for one pool of `batch` slots
    engine = EngineBatch(model, prompts, new_tokens, temperature=1.0)  # compiles and runs the weight preparation
    params = engine.weights.leaves
    state, steps = engine.decode(engine.prefill())  # compiles the others
    compile_s = time.perf_counter() - t0
    _log(f"compiled and ran prefill + decode once in {compile_s:.1f} s")
    prefill_times, decode_times = [], []
    for _ in range(repeats):
        del state  # the caches of the last run go before the next run's are allocated
        t0 = time.perf_counter()
        state = engine.prefill()
        t1 = time.perf_counter()
        state, steps = engine.decode(state)
        t2 = time.perf_counter()
        prefill_times.append(t1 - t0)
        decode_times.append(t2 - t1)
        _log(f"prefill {t1 - t0:.3f} s, decode {t2 - t1:.3f} s")
    # steps: model calls in the round (new_tokens - 1: the first token comes from the prefill's logits)
    generated = int(np.asarray(state.generated).sum())
    decode_s = float(np.median(decode_times))
    prefill_s = float(np.median(prefill_times))

    leaves = jax.tree.leaves(params)
    param_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    embed = model.embed_tokens[...]
    embed_bytes = embed.size * embed.dtype.itemsize
    dtype_bytes = jnp.dtype(dtype).itemsize
    cache_slots = prompt_len + new_tokens
    implemented = step_bytes(cfg, batch, cache_slots, param_bytes, embed_bytes, dtype_bytes)
    ideal = step_bytes(cfg, batch, prompt_len + new_tokens / 2, param_bytes, embed_bytes, dtype_bytes)
    step_s = decode_s / max(steps, 1)
    report = {
        "shape": "tiny" if tiny else "qwen3.5-4b", "dtype": jnp.dtype(dtype).name, "batch": batch,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "device": str(jax.devices()[0].device_kind),
        "params": int(sum(x.size for x in leaves)), "init_s": init_s, "compile_s": compile_s,
        "prefill_s": prefill_s, "prefill_tokens_per_s": batch * prompt_len / prefill_s,
        "decode_s": decode_s, "decode_steps": steps, "generated_tokens": generated,
        "decode_tokens_per_s": batch * steps / decode_s, "ms_per_step": 1e3 * step_s,
        "bandwidth_bytes_per_s": bandwidth,
        "peak_device_memory_gib": _peak_gib(),
    }
    for name, parts in (("as_implemented", implemented), ("ideal", ideal)):
        total = sum(parts.values())
        bound = batch * bandwidth / total
        report[name] = {"bytes_per_step": parts, "total_bytes_per_step": total,
                        "bound_tokens_per_s": bound, "bound_ms_per_step": 1e3 * total / bandwidth,
                        "fraction_of_bound": (batch * steps / decode_s) / bound,
                        "achieved_bandwidth_bytes_per_s": total / step_s}
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config, small batch: a CPU smoke test")
    parser.add_argument("--batch", type=int, default=None, help="concurrent sequences (default 160; tiny: 4)")
    parser.add_argument("--prompt_len", type=int, default=None, help="prompt bucket (default 512; tiny: 32)")
    parser.add_argument("--new_tokens", type=int, default=None, help="decode steps + 1 (default 256; tiny: 16)")
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="HBM bytes/s (H200: 4.8e12)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    defaults = (4, 32, 16) if args.tiny else (160, 512, 256)
    batch, prompt_len, new_tokens = (v if v is not None else d for v, d in
                                     zip((args.batch, args.prompt_len, args.new_tokens), defaults))
    print(json.dumps(run(args.tiny, batch, prompt_len, new_tokens, args.bandwidth, args.repeats), indent=1))


if __name__ == "__main__":
    main()
