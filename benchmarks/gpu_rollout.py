"""One GRPO rollout through the generation engine (continuous batching) at the Qwen3.5-4B shape with a LoRA
adapter on: the users' 20 prompts x 8 samples x 4,096 new tokens, against the HBM-bandwidth bound. Prints one JSON
object.

    python -m benchmarks.gpu_rollout                     # on a GPU: 4B shape, bf16, random weights + adapter
    python -m benchmarks.gpu_rollout --tiny              # CPU smoke test of the same code path

What runs is what online GRPO runs (`jaxrl.generation.Sampler`, `JaxBackend`'s defaults): 160 slots
(rollout_batch_size 0: one per row), one prompt length, the adapter (rank 16, all-linear, random B) fused into its
projections for decoding (`Qwen35.decode_weights`), rows moving to fewer slots as the rollout drains. Random
weights do not give the users' lengths, so each row gets its own cap in their truncation pattern: 45% run to
4,096, the rest stop uniformly before (`benchmarks.bench_rollout_engine.truncation_caps`).

One rollout is timed; its compilations are timed by JAX's own compile events (`jax.monitoring`) and subtracted,
so one call gives both the compile time and the steady-state time. Reported: useful tokens/s (generated tokens
/ steady seconds), decode steps, slot-steps, slot utilisation, compiled sampler programs and compile seconds,
peak device memory, and the fraction of the HBM bound: the bytes every decode step must move (every weight once,
the adapter factors, the Gated DeltaNet state read + written and the conv window for each slot, the KV cache of
the filled slots, on average prompt + new / 2) summed over the rollout's steps at the slot counts it ran at,
over the bandwidth (H200: 4.8 TB/s), against the measured steady seconds (prefill included: a bound on decode
alone would flatter it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e


def _log(message: str) -> None:
    print(f"[gpu_rollout {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _peak_gib():
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None


def bound_bytes(cfg, stats: dict, weight_bytes: int, prompt_len: int, new_tokens: int, dtype_bytes: int,
                state_bytes: int) -> float:
    """The bytes the rollout's decode steps must move at least (module docstring): the weights once per step, the
    per-slot caches once per slot-step."""
    n_linear = sum(t == "linear_attention" for t in cfg.layer_types)
    n_full = cfg.num_hidden_layers - n_linear
    per_slot = n_linear * (2 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
                           * state_bytes + 2 * (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * dtype_bytes)
    per_slot += n_full * 2 * (prompt_len + new_tokens / 2) * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    return stats["decode_steps"] * weight_bytes + stats["slot_steps"] * per_slot


def run(tiny: bool = False, prompts: int = 20, samples: int = 8, prompt_len: int = 512, new_tokens: int = 4096,
        lora_rank: int = 16, bandwidth: float = H200_BANDWIDTH, gdn_state_dtype: str = "float32",
        seed: int = 0) -> dict:
    import jax
    import jax.monitoring
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.bench_rollout_engine import truncation_caps
    from jaxrl.models import lora, qwen35
    from jaxrl.models.qwen35.config import qwen35_4b, tiny as tiny_config
    from jaxrl.generation import Sampler, engine_programs

    compile_events: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, seconds, **_: compile_events.append(seconds) if name.startswith("/jax/core/compile/") else None)

    cfg, dtype = (tiny_config(), jnp.float32) if tiny else (qwen35_4b(), jnp.bfloat16)
    t0 = time.perf_counter()
    with jax.default_device(jax.devices()[0]):  # eager init (a jitted one would constant-fold 4B weights)
        model = qwen35.init_model(cfg, dtype=dtype, seed=seed)
        model.set_compute(gdn_state_dtype=gdn_state_dtype)
        if lora_rank:
            lora.apply_lora(model, "all-linear", rank=lora_rank, alpha=2 * lora_rank, seed=seed + 1)
            key = jax.random.PRNGKey(seed + 2)
            for i, (_, adapter) in enumerate(lora.iter_lora(model)):
                b = adapter.lora_B
                b[...] = 0.02 * jax.random.normal(jax.random.fold_in(key, i), b[...].shape)
    jax.block_until_ready(nnx.state(model))
    _log(f"initialised {cfg.num_hidden_layers}-layer model (+ LoRA r{lora_rank}) in {time.perf_counter() - t0:.1f} s")

    rows = prompts * samples
    rng = np.random.default_rng(seed)
    ids = [rng.integers(10, min(cfg.vocab_size, 240_000), size=prompt_len).tolist() for _ in range(prompts)]
    caps = truncation_caps(rows, new_tokens, seed)
    sampler = Sampler(model, max_new_tokens=new_tokens, prompt_buckets=(prompt_len,), batch_size=rows)
    programs_before, compiled_before = engine_programs(), len(compile_events)
    t0 = time.perf_counter()
    out = sampler.sample(ids, n=samples, temperature=1.0, seed=seed, row_caps=caps)
    wall_s = time.perf_counter() - t0
    compile_s = float(sum(compile_events[compiled_before:]))
    steady_s = wall_s - compile_s
    stats = out.stats
    useful = sum(len(t) for t in out.tokens)
    _log(f"rollout: {useful} tokens in {wall_s:.1f} s ({compile_s:.1f} s compiling), {stats['decode_steps']} steps")

    dtype_bytes = jnp.dtype(dtype).itemsize
    nbytes = lambda leaves: sum(x.size * x.dtype.itemsize for x in leaves)  # noqa: E731
    factors = jax.tree.leaves(nnx.state(model, lora.LoRAParam))  # stored fp32, read in the compute dtype
    weight_bytes = (nbytes(jax.tree.leaves(nnx.state(model, nnx.Param))) - nbytes(factors)
                    + sum(x.size for x in factors) * dtype_bytes)
    if not cfg.tie_word_embeddings:  # an untied input embedding is only gathered
        weight_bytes -= model.embed_tokens[...].size * dtype_bytes
    total = bound_bytes(cfg, stats, weight_bytes, prompt_len, new_tokens, dtype_bytes,
                        jnp.dtype(gdn_state_dtype).itemsize)
    bound_s = total / bandwidth
    return {
        "shape": "tiny" if tiny else "qwen3.5-4b", "dtype": jnp.dtype(dtype).name, "device":
        str(jax.devices()[0].device_kind), "rows": rows, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "lora_rank": lora_rank, "gdn_state_dtype": gdn_state_dtype, "useful_tokens": useful,
        "truncated_rows": sum(r == "length" and len(t) == new_tokens for r, t in zip(out.finish_reasons, out.tokens)),
        "wall_s": wall_s, "compile_s": compile_s, "steady_s": steady_s, "tokens_per_s": useful / steady_s,
        "decode_steps": stats["decode_steps"], "slot_steps": stats["slot_steps"],
        "slot_utilisation": (useful - rows) / stats["slot_steps"], "inserts": stats["inserts"],
        "shrinks": stats["shrinks"], "rounds": stats["rounds"],
        "compiled_programs": engine_programs() - programs_before, "program_bound": sampler.program_bound(),
        "bound_bytes": total, "bound_s": bound_s, "fraction_of_hbm_bound": bound_s / steady_s,
        "bandwidth_bytes_per_s": bandwidth, "peak_device_memory_gib": _peak_gib(),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model, tiny shapes (a CPU check of the script)")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=None)
    ap.add_argument("--new_tokens", type=int, default=None)
    ap.add_argument("--lora_rank", type=int, default=16)
    ap.add_argument("--gdn_state_dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    small = dict(prompts=2, prompt_len=16, new_tokens=32) if args.tiny else dict(prompts=20, prompt_len=512,
                                                                                 new_tokens=4096)
    for k in small:
        if getattr(args, k) is not None:
            small[k] = getattr(args, k)
    result = run(tiny=args.tiny, samples=args.samples, lora_rank=args.lora_rank,
                 gdn_state_dtype=args.gdn_state_dtype, **small)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
