"""MFU of the LoRA DPO-style train step at the Qwen3.5 4B and 9B shapes, for a GPU machine; prints JSON.

    python -m benchmarks.gpu_train_step --model=9b --seq_len=4096 --pairs_per_device=1 --remat=full
    python -m benchmarks.gpu_train_step --model=4b --peak_tflops=989      # peak per device, dense bf16
    python -m benchmarks.gpu_train_step --tiny                            # CPU smoke run (tests)
    python -m benchmarks.gpu_train_step --dry_run    # CPU: 4B/9B parameter and FLOP arithmetic + the tiny step

The step is the real training step (`jaxrl.train.step`: micro-batch scan, AdamW, clipping, non-finite masking,
explicit shardings, donated state) with a DPO-style objective: each pair's chosen and rejected rows go through
the policy (LoRA r16/alpha32 on all 12 projections) and through the reference (the same weights with adapters
off, no gradient), sequence log-probs from the chunked `token_logprobs`, sigmoid DPO loss (beta 0.1). Weights
random (the preset shape), bf16; LoRA fp32; every layer rematerialised (`--remat`); mesh (1, all devices, 1).

Model FLOPs per step (hardware recomputation by remat is *not* counted, as usual for MFU):
    linear  = 2 * (matmul weights incl. lm_head) per token, forward
    lora    = 2 * r * (in + out) per adapted module per token, forward
    attn    = full attention, causal: 2 * T * n_heads * head_dim per token per layer (QK^T and AV), forward
    gdn     = chunked gated delta rule: 2 * C * (d_k + d_v) * H_v + 4 * d_k * d_v * H_v per token per layer
    step    = tokens * (3 * linear + 3 * lora + 4 * (attn + gdn))
the policy's forward (1) and backward to the activations (1 for matmuls against frozen weights, 2 for the
attention cores, 2 for the adapters' weights and inputs), plus the reference forward (1, no adapters).
MFU = step FLOPs / (step time * devices * peak FLOP/s of one device).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional

import numpy as np

# Dense bf16 peak per device (FLOP/s) by a substring of `device_kind`.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "A100": 312e12, "B200": 2250e12, "L40S": 362e12}
BETA = 0.1


class DPOStyle:
    """Sigmoid DPO on rows laid out (chosen_0, rejected_0, chosen_1, ...): loss_sum = sum over the micro-batch's
    pairs of -log sigmoid(beta * (policy margin - reference margin)) / pairs in the global batch."""

    def __init__(self, chunk_size: int = 512):
        self.chunk_size = chunk_size

    def normalisers(self, batch):
        import jax.numpy as jnp
        return {"num_pairs": jnp.float32(batch["input_ids"].shape[0] // 2)}

    def loss(self, model, mb, normalisers, rng):
        import jax
        import jax.numpy as jnp

        from jaxrl.models.lora import adapters_disabled
        from jaxrl.ops.logprobs import token_logprobs

        ids, attn, mask = mb["input_ids"], mb["attention_mask"], mb["loss_mask"][:, 1:].astype(jnp.float32)

        def seq_logps(m):
            hidden, _ = m.hidden_states(ids, attn)
            lp = token_logprobs(hidden[:, :-1], m.head_weight(), ids[:, 1:], chunk_size=self.chunk_size)
            return jnp.sum(lp * mask, axis=-1).reshape(-1, 2)  # [pairs, (chosen, rejected)]

        policy = seq_logps(model)
        with adapters_disabled(model):
            reference = jax.lax.stop_gradient(seq_logps(model))
        z = BETA * ((policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1]))
        loss = jnp.sum(-jax.nn.log_sigmoid(z)) / normalisers["num_pairs"]
        accuracy = jnp.sum((z > 0).astype(jnp.float32)) / normalisers["num_pairs"]
        return loss, {"preference_accuracy": accuracy}


def init_model(cfg, dtype, seed: int, remat: str, mesh):
    """Random weights in one jitted program placed onto their shards, like
    `jaxrl.models.qwen35.init.init_model_jit`, but with the key an argument of the program: a program without
    inputs lets XLA constant-fold the random weights at compile time (minutes for billions of parameters on a
    GPU, see benchmarks/gpu_decode.py)."""
    import jax
    from flax import nnx

    from jaxrl.models import qwen35
    from jaxrl.parallel import sharding as shd

    make = lambda key: qwen35.Qwen35(cfg, dtype=dtype, rngs=nnx.Rngs(key), remat=remat)  # noqa: E731
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(jax.random.key(seed))))
    key = jax.random.key(seed)
    init = jax.jit(lambda key: nnx.split(make(key))[1], out_shardings=shd.nnx_state_shardings(abstract, mesh))
    # as in init_model_jit: on the CPU a low LLVM optimisation level compiles the random-number code faster
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    return nnx.merge(graphdef, init.lower(key).compile(compiler_options=options)(key))


def model_flops(cfg, lora_rank: int, rows: int, seq_len: int) -> dict:
    """Model FLOPs of one DPO-style step over `rows` sequences of `seq_len` tokens (see the module docstring)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    attn_q = cfg.num_attention_heads * cfg.head_dim
    attn_kv = cfg.num_key_value_heads * cfg.head_dim
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    linear = lora = attn = gdn = 0.0
    shapes = []  # (in, out) of every adapted projection
    for layer_type in cfg.layer_types:
        if layer_type == "linear_attention":
            shapes += [(h, cfg.linear_conv_dim), (h, cfg.linear_value_dim), (h, hv), (h, hv),
                       (cfg.linear_value_dim, h)]
            gdn += 2 * cfg.gdn_chunk * (dk + dv) * hv + 4 * dk * dv * hv
        else:
            shapes += [(h, 2 * attn_q), (h, attn_kv), (h, attn_kv), (attn_q, h)]
            attn += 2 * seq_len * attn_q
        shapes += [(h, inter), (h, inter), (inter, h)]
    for i, o in shapes:
        linear += 2 * i * o
        lora += 2 * lora_rank * (i + o)
    linear += 2 * h * cfg.vocab_size  # the head
    tokens = rows * seq_len
    per_token = 3 * linear + 3 * lora + 4 * (attn + gdn)
    return {"per_step": tokens * per_token, "per_token": per_token, "tokens": tokens,
            "share_linear": 3 * linear / per_token, "share_attention_cores": 4 * (attn + gdn) / per_token}


def shape_report(model: str = "9b", seq_len: int = 4096, pairs: int = 1, lora_rank: int = 16,
                 peak_tflops: float = PEAK_BF16["H200"] / 1e12) -> dict:
    """The arithmetic of one step at a real shape, without building the model (abstract shapes only): parameter
    count, bf16 weight bytes, model FLOPs per step, and the step time that a given MFU would mean."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.models import qwen35

    cfg = {"4b": qwen35.qwen35_4b, "9b": qwen35.qwen35_9b}[model]()
    abstract = nnx.eval_shape(lambda: qwen35.Qwen35(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract))
    params = sum(int(np.prod(x.shape)) for x in leaves)
    weight_bytes = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)
    flops = model_flops(cfg, lora_rank, 2 * pairs, seq_len)
    peak = peak_tflops * 1e12
    return {"model": model, "params": params, "weight_gib": weight_bytes / 2**30, "seq_len": seq_len,
            "rows_per_step": 2 * pairs, "tokens_per_step": flops["tokens"],
            "model_tflops_per_step": flops["per_step"] / 1e12, "model_gflops_per_token": flops["per_token"] / 1e9,
            "share_linear": flops["share_linear"], "share_attention_cores": flops["share_attention_cores"],
            "peak_tflops_per_device": peak_tflops,
            "step_s_at_mfu": {f"{m:.0%}": flops["per_step"] / (m * peak) for m in (1.0, 0.5, 0.4, 0.3)}}


def peak_flops(device_kind: str, override_tflops: Optional[float]) -> Optional[float]:
    if override_tflops:
        return override_tflops * 1e12
    for key, value in PEAK_BF16.items():
        if key.lower() in device_kind.lower():
            return value
    return None


def run(model: str = "9b", seq_len: int = 4096, pairs_per_device: int = 1, grad_accum: int = 1, steps: int = 5,
        remat: str = "full", lora_rank: int = 16, peak_tflops: Optional[float] = None, tiny: bool = False,
        lora_dropout: float = 0.0) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxrl.models import lora, qwen35
    from jaxrl.parallel.mesh import make_mesh
    from jaxrl.train.optim import OptimizerConfig, make_optimizer
    from jaxrl.train.state import ParamCodec, create_train_state
    from jaxrl.train.step import jit_train_step, make_train_step, put_batch, split_batch

    if tiny:
        cfg = qwen35.tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
        seq_len, steps = min(seq_len, 64), min(steps, 2)
    else:
        cfg = {"4b": qwen35.qwen35_4b, "9b": qwen35.qwen35_9b}[model]()
    devices = jax.devices()[:1] if tiny else jax.devices()  # the smoke run: one device, a quick compile
    mesh = make_mesh((1, len(devices), 1), devices)
    options = {"xla_backend_optimization_level": 0} if tiny and jax.default_backend() == "cpu" else None
    t0 = time.perf_counter()
    policy = init_model(cfg, jnp.bfloat16, seed=0, remat=remat, mesh=mesh)
    report = lora.apply_lora(policy, "all-linear", rank=lora_rank, alpha=2.0 * lora_rank, dropout=lora_dropout)
    init_s = time.perf_counter() - t0
    graphdef, trainable, frozen = lora.split_lora(policy)
    codec = ParamCodec(trainable)
    opt_cfg = OptimizerConfig(learning_rate=5e-7, schedule="linear", warmup_steps=0, weight_decay=0.0,
                              max_grad_norm=1.0)
    tx, schedule = make_optimizer(opt_cfg, total_steps=steps + 2)
    step_fn = make_train_step(DPOStyle(), tx, schedule, graphdef, codec)
    state = create_train_state(codec.to_flat(trainable), tx, seed=0, mesh=mesh)

    rows = 2 * pairs_per_device * len(devices) * grad_accum  # global batch: chosen/rejected rows
    rng = np.random.default_rng(0)
    ids = rng.integers(2, cfg.vocab_size, size=(rows, seq_len)).astype(np.int32)
    prompt = seq_len // 4  # the completion (loss) part is the last three quarters
    loss_mask = np.zeros((rows, seq_len), np.int32)
    loss_mask[:, prompt:] = 1
    ids[1::2, :prompt] = ids[0::2, :prompt]  # a pair shares its prompt
    batch = put_batch(split_batch({"input_ids": ids, "attention_mask": np.ones_like(ids), "loss_mask": loss_mask},
                                  grad_accum), mesh)
    t0 = time.perf_counter()
    compiled = jit_train_step(step_fn, mesh, state, frozen, batch).lower(state, frozen, batch).compile(
        compiler_options=options)
    compile_s = time.perf_counter() - t0
    first = None
    for _ in range(2):  # warm-up
        state, metrics = compiled(state, frozen, batch)
        first = first if first is not None else {k: float(v) for k, v in jax.device_get(metrics).items()}
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, frozen, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    flops = model_flops(cfg, lora_rank, rows, seq_len)
    kind = devices[0].device_kind
    peak = peak_flops(kind, peak_tflops)
    stats = devices[0].memory_stats() or {}
    return {
        "model": "tiny" if tiny else model, "device_kind": kind, "devices": len(devices),
        "seq_len": seq_len, "rows_per_step": rows, "pairs_per_step": rows // 2, "grad_accum": grad_accum,
        "remat": remat, "lora": f"r{lora_rank}/alpha{2 * lora_rank} all-linear ({report['trainable_params']:,} "
                                f"trainable)", "dtype": "bfloat16 base, fp32 LoRA",
        "step_s": step_s, "step_s_all": times, "tokens_per_s": flops["tokens"] / step_s,
        "tokens_per_s_per_device": flops["tokens"] / step_s / len(devices),
        "model_tflops_per_step": flops["per_step"] / 1e12, "share_linear": flops["share_linear"],
        "achieved_tflops_per_device": flops["per_step"] / step_s / len(devices) / 1e12,
        "peak_tflops_per_device": None if peak is None else peak / 1e12,
        "mfu": None if peak is None else flops["per_step"] / step_s / (len(devices) * peak),
        "compile_s": compile_s, "init_s": init_s,
        "first_loss": first["loss"], "first_grad_norm": first["grad_norm"],
        "last_loss": float(metrics["loss"]), "update_skipped_total": int(metrics["nonfinite_total"]),
        "peak_device_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30 if stats else None,
    }


def main(argv=None) -> None:
    from jaxrl.models.qwen35.model import REMAT_CHOICES  # every policy the model takes, "auto" included

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("4b", "9b"), default="9b")
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--pairs_per_device", type=int, default=1)
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--remat", default="full", choices=REMAT_CHOICES)
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument("--peak_tflops", type=float, default=None, help="dense bf16 peak of one device")
    parser.add_argument("--lora_dropout", type=float, default=0.0)
    parser.add_argument("--tiny", action="store_true", help="tiny model, short sequences: a CPU smoke run")
    parser.add_argument("--dry_run", action="store_true",
                        help="no accelerator needed: the 4B and 9B shape / FLOP arithmetic at --seq_len and "
                             "--pairs_per_device, then one step of the tiny model")
    args = parser.parse_args(argv)
    if args.dry_run:
        peak = args.peak_tflops or PEAK_BF16["H200"] / 1e12
        result = {"shapes": [shape_report(m, args.seq_len, args.pairs_per_device, args.lora_rank, peak)
                             for m in ("4b", "9b")],
                  "tiny_step": run(seq_len=32, steps=1, remat=args.remat, lora_rank=args.lora_rank,
                                   peak_tflops=peak, tiny=True)}
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    result = run(args.model, args.seq_len, args.pairs_per_device, args.grad_accum, args.steps, args.remat,
                 args.lora_rank, args.peak_tflops, args.tiny, args.lora_dropout)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
