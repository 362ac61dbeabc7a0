"""One GRPO step at the users' 4B shape on an accelerator: 20 prompts x 8 samples, up to 4,096 new tokens; JSON.

    python -m benchmarks.gpu_grpo                                  # Qwen3.5-4B shape, bf16, random weights
    python -m benchmarks.gpu_grpo --max_new_tokens=1024 --steps=3  # a shorter cap
    python -m benchmarks.gpu_grpo --tiny                           # CPU smoke run (tests)
    python -m benchmarks.gpu_grpo --prompt_len=2048 --layout=shared_prefix   # one row layout (issue 51): run
                                                                   # padded, packed and shared_prefix in turn

The real trainer (configs/grpo.py:run=4b_base: LoRA r16/alpha32, beta 0.01 with the reference pass, one update
per rollout over 160 rows, micro-batch `--mb`, full remat) on random-weight Qwen3.5-4B with the token task's
random prompts of `--prompt_len` tokens (a random model rarely emits EOS, so completions run to the cap: the
worst case, as for the users' 43-49% truncated rollouts). Every step samples, scores, runs the reference pass
and updates; the first step (compilation) is reported separately, the phases are medians over the rest:
sample_s, score_s, ref_logp_s, update_s (= step time - rollout time), plus tokens/s of sampling and training.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def _peak_gib():
    """Peak device memory of this process (None where the backend keeps no statistics, e.g. the CPU)."""
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None


def make_config(tiny: bool, prompts: int, k: int, prompt_len: int, max_new_tokens: int, steps: int, mb: int,
                layout: str = "auto"):
    from configs import grpo
    c = grpo.get_config(f"run=4b_base,mb={mb if not tiny else 4},k={k},prompts={prompts},"
                        f"max_new_tokens={max_new_tokens}")
    c.model_preset = "tiny" if tiny else "qwen3.5-4b"
    c.model_path = ""
    if tiny:
        c.model_overrides.num_hidden_layers = 2
        c.model_overrides.layer_types = ("linear_attention", "full_attention")
        c.dtype = "float32"
        c.mesh.shape = (1, 1, 1)
        c.logprob_chunk_size = 64
    c.steps = steps
    c.checkpoint_every = 10 ** 6
    c.tensorboard = False
    c.checkpoint_async = False
    c.data.source = "token_task"
    c.data.max_prompt_len = c.data.prompt_len = prompt_len
    c.data.score_tokens = min(8, max_new_tokens)
    c.reward.name = "token_block"
    c.grpo.logprob_batch_size = c.batch.micro_batch_size
    c.grpo.layout = layout
    c.remat = "none" if tiny else "full"
    return c


def run(tiny: bool = False, prompts: int = 20, k: int = 8, prompt_len: int = 512, max_new_tokens: int = 4096,
        steps: int = 3, mb: int = 8, layout: str = "auto") -> dict:
    import jax

    from jaxrl.algorithms.run import run_training
    config = make_config(tiny, prompts, k, prompt_len, max_new_tokens, steps, mb, layout)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        records = run_training(config, workdir).records
    timed = records[1:] or records
    med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    rows = prompts * k
    out = {"sample_s": med("time/sample_s"), "score_s": med("time/score_s"), "ref_logp_s": med("time/ref_logp_s"),
           "rollout_s": med("time/rollout_s"), "step_s": med("step_time_s")}
    out["update_s"] = out["step_s"] - out["rollout_s"]
    gen = statistics.median(r["completion/length_mean"] * rows for r in timed)
    seq = config.data.max_prompt_len + config.grpo.max_new_tokens
    out.update({
        "rows": rows, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens, "generated_tokens": gen,
        "sample_tokens_per_s": gen / out["sample_s"], "train_tokens_per_s": med("tokens_per_s"),
        "train_rows_x_len": [rows, seq], "first_step_s": records[0]["step_time_s"] +
        records[0].get("compile_time_s", 0.0), "first_compile_s": records[0].get("compile_time_s", 0.0),
        "timed_steps": len(timed), "loss": [r["loss"] for r in records], "kl": [r.get("kl") for r in records],
        "model": "tiny" if tiny else "qwen3.5-4b", "dtype": config.dtype, "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "mb": config.batch.micro_batch_size,
        "grad_accum": config.batch.grad_accum, "wall_s": time.perf_counter() - t0,
        "peak_device_memory_gib": _peak_gib(),
        # the row layout each step ran (jaxrl/algorithms/online/layout.py): the setting and its counters
        "layout": layout, **{key: med(key) for key in ("layout/packed", "layout/shared_prefix", "layout/row_tokens",
                                                        "layout/prompt_tokens", "layout/padding_tokens")}})
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (smoke test)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=512)
    ap.add_argument("--max_new_tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--layout", default="auto", choices=("auto", "padded", "packed", "shared_prefix"),
                    help="grpo.layout: the rows of the passes and the train step")
    args = ap.parse_args(argv)
    if args.tiny:
        result = run(True, prompts=2, k=4, prompt_len=8, max_new_tokens=8, steps=2, layout=args.layout)
    else:
        result = run(False, args.prompts, args.k, args.prompt_len, args.max_new_tokens, args.steps, args.mb,
                     args.layout)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
