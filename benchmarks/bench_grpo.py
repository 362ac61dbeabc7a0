"""Where a GRPO step's time goes on this machine: sampling, scoring, reference / old log-probs, update.

    python -m benchmarks.bench_grpo                      # the small model (hidden 256, 4 layers, vocab 2048)
    python -m benchmarks.bench_grpo --model=tiny --steps=6 --max_new_tokens=16

Runs the real GRPO trainer (`jaxrl.algorithms.grpo_task` on `jaxrl.train.loop.Trainer`) on the token task
(random prompts of `prompt_len` tokens, K samples each, reward `token_block`) with `num_iterations=2` and
`recompute_old_logprobs=True`, so every other train step makes a rollout and every phase runs: the rollout steps
report sample / score / reference pass / old-log-prob pass (the trainer's `time/*` metrics), the other steps are
pure updates. The first rollout and the first update (compilation) are left out; medians of the rest.
fp32 weights, one device, LoRA r16/alpha32 on all 12 projections.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from benchmarks.common import SMALL_TEXT_CONFIG

SMALL = {k: SMALL_TEXT_CONFIG[k] for k in (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim")}
SMALL["layer_types"] = ("linear_attention", "full_attention") * (SMALL["num_hidden_layers"] // 2)


def make_config(model: str = "small", prompts: int = 8, k: int = 8, prompt_len: int = 32, max_new_tokens: int = 64,
                steps: int = 8, mb: int = 8, dtype: str = "float32", preset: str = "tiny"):
    from configs import grpo_tiny
    c = grpo_tiny.get_config()
    if model == "small":
        c.model_overrides = dict(SMALL)
    elif model != "tiny":
        raise ValueError(f"model={model!r}: tiny | small")
    c.model_preset = preset
    c.dtype = dtype
    c.steps = steps
    c.checkpoint_every = 10 ** 6  # the run's end still checkpoints once (after the timed steps)
    c.tensorboard = False
    c.checkpoint_async = False
    c.lora.rank, c.lora.alpha = 16, 32.0
    c.grpo.num_generations, c.grpo.prompts_per_step = k, prompts
    c.grpo.max_new_tokens = max_new_tokens
    c.grpo.num_iterations = 2
    c.grpo.recompute_old_logprobs = True
    c.grpo.temperature = 1.0
    c.grpo.logprob_batch_size = mb
    rows = prompts * k
    if rows % mb:
        raise ValueError(f"mb={mb} must divide prompts x k = {rows}")
    c.batch.micro_batch_size, c.batch.grad_accum = mb, rows // mb
    c.data.prompt_len = c.data.max_prompt_len = prompt_len
    c.data.score_tokens = min(8, max_new_tokens)
    return c


def summarize(records: list[dict], config) -> dict:
    """Medians over the steps after the first rollout / first update."""
    rollouts = [r for r in records if "time/rollout_s" in r][1:]
    updates = [r for r in records if "time/rollout_s" not in r and "compile_time_s" not in r]
    if not rollouts or not updates:
        raise ValueError("need at least 2 rollouts and 1 update after compilation: raise --steps")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = {phase: med([r[f"time/{phase}_s"] for r in rollouts])
           for phase in ("sample", "score", "ref_logp", "old_logp", "rollout")}
    out["update_s"] = med([r["step_time_s"] for r in updates])
    # a GRPO step with one update per rollout = everything once
    out["step_s"] = out["rollout"] + out["update_s"]
    total = out["step_s"]
    share = {f"share_{p}": out[p] / total for p in ("sample", "score", "ref_logp", "old_logp")}
    share["share_update"] = out["update_s"] / total
    rows = config.grpo.prompts_per_step * config.grpo.num_generations
    gen_tokens = med([r["completion/length_mean"] * rows for r in rollouts])
    return {
        "sample_s": out["sample"], "score_s": out["score"], "ref_logp_s": out["ref_logp"],
        "old_logp_s": out["old_logp"], "rollout_s": out["rollout"], "update_s": out["update_s"],
        "step_s": out["step_s"], **share,
        "rows": rows, "prompt_len": config.data.max_prompt_len, "max_new_tokens": config.grpo.max_new_tokens,
        "generated_tokens_per_rollout": gen_tokens, "sample_tokens_per_s": gen_tokens / out["sample"],
        "train_tokens_per_s": med([r["tokens_per_s"] for r in updates]),
        "first_step_compile_s": records[0].get("compile_time_s", 0.0),
        "first_rollout_s": records[0].get("time/rollout_s", 0.0),
        "timed_rollouts": len(rollouts), "timed_updates": len(updates),
    }


def run(model: str = "small", prompts: int = 8, k: int = 8, prompt_len: int = 32, max_new_tokens: int = 64,
        steps: int = 8, mb: int = 8, dtype: str = "float32", preset: str = "tiny", mesh_shape=(1, 1, 1)) -> dict:
    import jax

    from jaxrl.algorithms.run import run_training
    config = make_config(model, prompts, k, prompt_len, max_new_tokens, steps, mb, dtype, preset)
    config.mesh.shape = tuple(mesh_shape)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        records = run_training(config, workdir).records
    result = summarize(records, config)
    result.update(model=model if preset == "tiny" else preset, backend=jax.default_backend(),
                  device=jax.devices()[0].device_kind, devices=len(jax.devices()), dtype=dtype,
                  wall_s=time.perf_counter() - t0)
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", choices=("tiny", "small"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--mb", type=int, default=8)
    args = ap.parse_args(argv)
    result = run(args.model, args.prompts, args.k, args.prompt_len, args.max_new_tokens, args.steps, args.mb)
    for key in ("sample_s", "score_s", "ref_logp_s", "old_logp_s", "update_s", "step_s"):
        print(f"{key:>12}: {result[key]:8.3f} s" + (f"  ({result['share_' + key[:-2]]:.0%})"
                                                    if "share_" + key[:-2] in result else ""))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
