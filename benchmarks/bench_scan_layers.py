"""Scanned vs unrolled layers on the CPU at the train-step benchmark's widths, several depths, one process.

    python -m benchmarks.bench_scan_layers                       # 4, 8 and 16 layers
    python -m benchmarks.bench_scan_layers --layers=4 --steps=11
    python -m benchmarks.bench_scan_layers --layers=4,16 --remat=full --steps=3   # the layers rematerialised

The model is `benchmarks.common.SMALL_TEXT_CONFIG` (hidden 256, its (Gated DeltaNet, attention) block) with
`num_hidden_layers` set to each depth, random weights, fp32, LoRA r16 / alpha 32 on the 12 projections, and the
step `bench_train_step` times (`jaxrl.train.step`, next-token loss, AdamW, clipping, B=4, T=256, one micro-batch).
Per depth, the step is compiled with the layers scanned and unrolled (`scan_layers=True` / `False`, whatever the
default would choose), back to back: lower and compile seconds (wall and this process's CPU), XLA's memory
analysis (temporaries) and the optimised HLO's instruction count; then the two compiled steps run alternately
(A B A B ..., so a load burst lands on both) and the medians are compared. What the default (`scan_layers=None`)
decides for the depth and remat policy is printed beside them (`Qwen35Config.scan_decision`); benchmarks/RESULTS.md,
'CPU: when scanning pays (issue 37)', has the figures behind that default.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import numpy as np

from benchmarks.common import SMALL_TEXT_CONFIG

LORA = dict(rank=16, alpha=32.0)


def _config(num_layers: int):
    from jaxrl.models.qwen35.config import parse_hf_config

    raw = dict(SMALL_TEXT_CONFIG, num_hidden_layers=num_layers, model_type="qwen3_5_text")
    return parse_hf_config(raw, "SMALL_TEXT_CONFIG")[0]


def _step(cfg, scan: bool, batch: int, seq_len: int, remat: str = "none"):
    """(compiled step, its arguments, a record of the compile)."""
    import jax
    import jax.numpy as jnp

    from jaxrl.models import lora, qwen35
    from jaxrl.parallel.mesh import make_mesh
    from jaxrl.train.objective import NextToken
    from jaxrl.train.optim import OptimizerConfig, make_optimizer
    from jaxrl.train.state import ParamCodec, create_train_state
    from jaxrl.train.step import jit_train_step, make_train_step, put_batch, split_batch

    model = qwen35.init_model(cfg, seed=0, dtype=jnp.float32, remat=remat)
    model.set_compute(scan_layers=scan)
    lora.apply_lora(model, "all-linear", rank=LORA["rank"], alpha=LORA["alpha"])
    assert (model.layer_cycle()[0] is not None) == scan, model.layer_cycle()
    graphdef, trainable, frozen = lora.split_lora(model)
    codec = ParamCodec(trainable)
    opt_cfg = OptimizerConfig(learning_rate=1e-4, schedule="constant", warmup_steps=0, weight_decay=0.0,
                              max_grad_norm=1.0)
    tx, schedule = make_optimizer(opt_cfg, total_steps=1000)
    mesh = make_mesh((1, 1, 1))
    step_fn = make_train_step(NextToken(chunk_size=512), tx, schedule, graphdef, codec)
    state = create_train_state(codec.to_flat(trainable), tx, seed=0, mesh=mesh)
    ids = np.random.default_rng(0).integers(2, cfg.vocab_size, size=(batch, seq_len)).astype(np.int32)
    split = put_batch(split_batch({"input_ids": ids, "attention_mask": np.ones_like(ids)}, 1), mesh)
    wall, cpu = time.perf_counter(), time.process_time()
    lowered = jit_train_step(step_fn, mesh, state, frozen, split).lower(state, frozen, split)
    lower_wall, lower_cpu = time.perf_counter() - wall, time.process_time() - cpu
    wall, cpu = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    compile_wall, compile_cpu = time.perf_counter() - wall, time.process_time() - cpu
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    record = {"lower_s": lower_wall, "lower_cpu_s": lower_cpu, "compile_s": compile_wall,
              "compile_cpu_s": compile_cpu, "temp_mib": mem.temp_size_in_bytes / 2**20,
              "argument_mib": mem.argument_size_in_bytes / 2**20,
              "hlo_instructions": len(re.findall(r"^\s*(?:ROOT )?%\S+ = ", hlo, flags=re.M)),
              "frozen_mib": sum(x.nbytes for x in jax.tree.leaves(frozen)) / 2**20}
    return compiled, [state, frozen, split], record


def measure(num_layers: int, steps: int, batch: int, seq_len: int, remat: str = "none") -> dict:
    import jax

    from jaxrl.models.qwen35.config import repeat_cycle

    cfg = _config(num_layers)
    decision = cfg.scan_decision(remat)
    out = {"layers": num_layers, "remat": remat, "cycle": repeat_cycle(cfg.layer_types),
           "default_scans": decision[0] is not None, "default_why": decision[1]}
    runs = {}
    for scan in (True, False):
        compiled, args, record = _step(cfg, scan, batch, seq_len, remat)
        out["scanned" if scan else "unrolled"] = record
        runs[scan] = (compiled, args)
    times = {True: [], False: []}
    for scan in (True, False):  # warm-up: the first call of each
        compiled, args = runs[scan]
        args[0], _ = compiled(*args)
        jax.block_until_ready(args[0].params)
    for _ in range(steps):
        for scan in (True, False):
            compiled, args = runs[scan]
            t0 = time.perf_counter()
            args[0], _ = compiled(*args)
            jax.block_until_ready(args[0].params)
            times[scan].append(time.perf_counter() - t0)
    for scan in (True, False):
        out["scanned" if scan else "unrolled"].update(step_s=statistics.median(times[scan]), step_times_s=times[scan])
    s, u = out["scanned"], out["unrolled"]
    out["ratios_scanned_over_unrolled"] = {
        "step": s["step_s"] / u["step_s"],
        "lower_plus_compile_cpu": (s["lower_cpu_s"] + s["compile_cpu_s"]) / (u["lower_cpu_s"] + u["compile_cpu_s"]),
        "lower_plus_compile_wall": (s["lower_s"] + s["compile_s"]) / (u["lower_s"] + u["compile_s"]),
        "temp": s["temp_mib"] / u["temp_mib"]}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="4,8,16", help="comma-separated depths (multiples of 2)")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per setting (alternating)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--remat", default="none",
                        help="the remat policy, resolved (not auto): none (the benchmark's) | matmuls | full | ...")
    parser.add_argument("--out", default=None, help="append one JSON line per depth to this file")
    args = parser.parse_args(argv)
    for n in (int(x) for x in args.layers.split(",")):
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        load_before = os.getloadavg()
        result = measure(n, args.steps, args.batch, args.seq_len, args.remat)
        result.update(started=started, load_before=load_before, load_after=os.getloadavg())
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
