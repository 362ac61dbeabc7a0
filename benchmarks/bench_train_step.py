"""LoRA train-step throughput and peak memory: jaxrl (one jitted step) vs PEFT + torch, same model, same batch.

    python -m benchmarks.bench_train_step                # prints a table and JSON
    python -m benchmarks.bench_train_step --batch=4 --seq_len=256 --steps=5
    python -m benchmarks.bench_train_step --also_scanned    # + jaxrl with its layers scanned (scan_layers=True)

Both sides load the same small Qwen3.5 checkpoint (`benchmarks.common.SMALL_TEXT_CONFIG`: hidden 256, 4 layers,
vocab 2048), attach LoRA r16 / alpha 32 to the 12 projections (dropout 0), and train on the same batch of
random tokens with a next-token loss and AdamW (lr 1e-4, clipping 1.0), in fp32 on the CPU with the same thread
count. One step = forward, backward, clip, optimizer update:
  * jaxrl: `jaxrl.train.step` (chunked log-probs, gradient accumulation scan with 1 micro-batch, non-finite
    masking), the whole step one XLA program;
  * torch: `peft.get_peft_model(Qwen3_5ForCausalLM)`, `loss.backward()`, `clip_grad_norm_`, `AdamW.step()`.
Each side runs in its own subprocess so peak RSS (`resource.getrusage`, the process's whole footprint: framework,
weights, activations) is measured separately; `jax.devices()[0].memory_stats()` is None on the CPU. The first
step (compilation for JAX, warm-up for torch) is excluded from the timing and reported separately. jaxrl runs with
its defaults (`scan_layers` None: this model, without remat, runs its layers unrolled; `layer_cycle` in the
result says which); `--also_scanned` adds a second jaxrl worker with the layers scanned, the step the default was
before, so one run compares both with the same torch figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import SMALL_TEXT_CONFIG, save_small_hf, set_cpu_threads, table

LORA = dict(rank=16, alpha=32.0)
LR = 1e-4


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _batch(batch: int, seq_len: int) -> np.ndarray:
    return np.random.default_rng(0).integers(2, SMALL_TEXT_CONFIG["vocab_size"], size=(batch, seq_len))


def jax_worker(model_dir: str, batch: int, seq_len: int, steps: int, scan_layers: str = "default") -> dict:
    import jax
    import jax.numpy as jnp

    from jaxrl.models import lora, qwen35
    from jaxrl.parallel.mesh import make_mesh
    from jaxrl.train.objective import NextToken
    from jaxrl.train.optim import OptimizerConfig, make_optimizer
    from jaxrl.train.state import ParamCodec, create_train_state
    from jaxrl.train.step import jit_train_step, make_train_step, put_batch, split_batch

    model = qwen35.from_pretrained(model_dir, dtype=jnp.float32)
    if scan_layers != "default":
        model.set_compute(scan_layers=scan_layers == "on")
    lora.apply_lora(model, "all-linear", rank=LORA["rank"], alpha=LORA["alpha"])
    layer_cycle = model.layer_cycle(model.remat_policy(batch, seq_len))[0]
    graphdef, trainable, frozen = lora.split_lora(model)
    codec = ParamCodec(trainable)
    opt_cfg = OptimizerConfig(learning_rate=LR, schedule="constant", warmup_steps=0, weight_decay=0.0,
                              max_grad_norm=1.0)
    tx, schedule = make_optimizer(opt_cfg, total_steps=steps + 1)
    mesh = make_mesh((1, 1, 1))
    step_fn = make_train_step(NextToken(chunk_size=512), tx, schedule, graphdef, codec)
    state = create_train_state(codec.to_flat(trainable), tx, seed=0, mesh=mesh)
    ids = _batch(batch, seq_len).astype(np.int32)
    split = put_batch(split_batch({"input_ids": ids, "attention_mask": np.ones_like(ids)}, 1), mesh)
    t0 = time.perf_counter()
    compiled = jit_train_step(step_fn, mesh, state, frozen, split).lower(state, frozen, split).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, metrics = compiled(state, frozen, split)
    first_loss = float(metrics["loss"])
    first_step_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, frozen, split)
        jax.block_until_ready(state.params)
        times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats()
    return {"step_s": statistics.median(times), "first_step_s": first_step_s, "compile_s": compile_s,
            "first_loss": first_loss, "last_loss": float(metrics["loss"]), "peak_rss_mb": _peak_rss_mb(),
            "device_peak_mb": None if not stats else stats.get("peak_bytes_in_use", 0) / 2**20,
            "scan_layers": scan_layers, "layer_cycle": layer_cycle}


def torch_worker(model_dir: str, batch: int, seq_len: int, steps: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForCausalLM

    from jaxrl.models.lora import ALL_LINEAR

    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                             target_modules=list(ALL_LINEAR)))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    ids = torch.as_tensor(_batch(batch, seq_len))

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    t0 = time.perf_counter()
    first_loss = step()
    first_step_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        last_loss = step()
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "first_step_s": first_step_s, "compile_s": 0.0,
            "first_loss": first_loss, "last_loss": last_loss, "peak_rss_mb": _peak_rss_mb(), "device_peak_mb": None}


def _spawn(side: str, model_dir: str, batch: int, seq_len: int, steps: int, scan_layers: str = "default") -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "benchmarks.bench_train_step", f"--worker={side}", f"--model_dir={model_dir}",
           f"--batch={batch}", f"--seq_len={seq_len}", f"--steps={steps}", f"--json_out={out}",
           f"--scan_layers={scan_layers}"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def run(batch: int = 4, seq_len: int = 256, steps: int = 5, also_scanned: bool = False) -> dict:
    """Both sides in fresh subprocesses; returns the numbers and the ratio (jaxrl tokens/s / torch tokens/s);
    also_scanned: jaxrl with scan_layers=True too (`jaxrl_scanned`, `ratio_tokens_per_s_scanned`)."""
    threads = set_cpu_threads()
    with tempfile.TemporaryDirectory() as folder:
        save_small_hf(folder, seed=0)
        jax_r = _spawn("jax", folder, batch, seq_len, steps)
        scanned_r = _spawn("jax", folder, batch, seq_len, steps, "on") if also_scanned else None
        torch_r = _spawn("torch", folder, batch, seq_len, steps)
    tokens = batch * seq_len
    result = {"batch": batch, "seq_len": seq_len, "timed_steps": steps, "threads": threads,
              "lora": f"r{LORA['rank']}/alpha{int(LORA['alpha'])} all-linear", "dtype": "float32"}
    for name, r in (("jaxrl", jax_r), ("peft_torch", torch_r)):
        result[name] = dict(r, tokens_per_s=tokens / r["step_s"])
    result["ratio_tokens_per_s"] = result["jaxrl"]["tokens_per_s"] / result["peft_torch"]["tokens_per_s"]
    result["ratio_peak_rss"] = jax_r["peak_rss_mb"] / torch_r["peak_rss_mb"]
    if scanned_r is not None:
        result["jaxrl_scanned"] = dict(scanned_r, tokens_per_s=tokens / scanned_r["step_s"])
        result["ratio_tokens_per_s_scanned"] = result["jaxrl_scanned"]["tokens_per_s"] / result["peft_torch"][
            "tokens_per_s"]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--also_scanned", action="store_true",
                        help="also time jaxrl with its layers scanned (scan_layers=True)")
    parser.add_argument("--scan_layers", choices=("default", "on", "off"), default="default", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=("jax", "torch"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json_out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        set_cpu_threads()
        if args.worker == "jax":
            result = jax_worker(args.model_dir, args.batch, args.seq_len, args.steps, args.scan_layers)
        else:
            result = torch_worker(args.model_dir, args.batch, args.seq_len, args.steps)
        with open(args.json_out, "w") as f:
            json.dump(result, f)
        return
    result = run(args.batch, args.seq_len, args.steps, args.also_scanned)
    rows = [dict(side=name, **{k: result[name][k] for k in ("tokens_per_s", "step_s", "first_step_s",
                                                             "peak_rss_mb", "first_loss")})
            for name in ("jaxrl", "jaxrl_scanned", "peft_torch") if name in result]
    print(table(rows, ["side", "tokens_per_s", "step_s", "first_step_s", "peak_rss_mb", "first_loss"]))
    print(f"ratio tokens/s (jaxrl / peft+torch): {result['ratio_tokens_per_s']:.2f}; "
          f"peak RSS ratio: {result['ratio_peak_rss']:.2f}")
    if args.also_scanned:
        print(f"ratio tokens/s, jaxrl scanned / peft+torch: {result['ratio_tokens_per_s_scanned']:.2f}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
