"""Every GPU benchmark in one go, within a wall-clock budget (default 9 minutes: one
device call; the first four items are the ones that matter most); JSON per benchmark to --out.

    python -m benchmarks.gpu_all                          # on a GPU machine; writes bench_out/gpu_*.json
    python -m benchmarks.gpu_all --out="$OUT" --budget_s=540
    python -m benchmarks.gpu_all --dry_run --out=/tmp/g   # the same scripts, tiny shapes, on the CPU

In order of priority, each in its own process so device memory is returned between them, each with a time limit
that is the smaller of its own cap and what is left of the budget (a benchmark is skipped when less than its
minimum is left; `--only` picks some):

  1. gpu_train_step_4b      DPO train step (chosen + rejected, policy + adapter-off reference), Qwen3.5-4B shape,
                            bf16, LoRA r16, T=4096, micro-batch 1, remat=auto: MFU, tokens/s, peak device memory
  2. gpu_train_step_9b_mb2  the same at the 9B shape, T=6144, micro-batch 2 (does it fit one H200?)
  3. gpu_decode_4b          decode of the rollout engine at the 4B shape (160 x (512 + 256)) against the
                            HBM-bandwidth bound; prefill tokens/s; peak device memory
  4. gpu_kernels_4b         each kernel alone at the 4B head shapes (benchmarks/bench_kernels.py): attention
                            fwd + bwd (T=4096), GDN chunked fwd + bwd, the decode update at 160 rows, each
                            against its roofline
  5. gpu_rollout_4b         one GRPO rollout through the continuous-batching engine, 20 prompts x 8 samples x
                            4,096 new tokens, LoRA r16 on (benchmarks/gpu_rollout.py): tokens/s, % of the HBM
                            bound, compiled programs, compile time
  6. gpu_grpo_4b            one GRPO step's time split at 20 prompts x 8 samples (--grpo_new_tokens new tokens)
  7. gpu_train_step_4b_mb2  4B, T=4096, micro-batch 2
  8. gpu_train_step_9b      9B, T=6144, micro-batch 1

Only with `--only=aot_real_shapes` (not in the default run: it compiles nine programs and runs none):
     aot_real_shapes        benchmarks/aot_real_shapes.py on the GPU: compile time and XLA:GPU's memory analysis of
                            the DPO steps (4B T=4096 mb 1, 9B T=6144 mb 1 and 2), the GRPO step and the decode round,
                            scanned and unrolled, from abstract shapes (the CPU's figures are in
                            benchmarks/RESULTS.md)

Compiled programs persist (jaxrl/utils/compile_cache.py): every child runs with JAX's persistent compilation
cache at --compilation_cache (default $XDG_CACHE_HOME/jaxrl/xla, else ~/.cache/jaxrl/xla; none: off; an inherited
JAX_COMPILATION_CACHE_DIR wins), so a rerun on the same machine loads the 4B/9B programs instead of compiling
them again, and its `compile_s` figures are then load times (gpu_all.json records the folder used and how many
entries it held at the start).

Random weights of the preset shapes (jaxrl/models/qwen35/config.py: qwen35_4b, qwen35_9b); nothing is
downloaded. Also written: `<out>/gpu_all.json` (every result or failure, the device, the 4B/9B FLOP arithmetic)
and a one-line-per-benchmark summary on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (module, kwargs of its run(), kwargs for --dry_run, time cap s, minimum time worth starting s), in order
# of priority: what the targets need first (4B DPO MFU, 9B T=6144 fitting with micro-batch 2, decode
# against the HBM bound, each kernel against its roofline), then the rest.
_TINY_STEP = dict(tiny=True, seq_len=32, steps=1)
GPU_BENCHES = {
    "gpu_train_step_4b": ("benchmarks.gpu_train_step",
                          dict(model="4b", seq_len=4096, pairs_per_device=1, steps=3, remat="auto", lora_rank=16),
                          _TINY_STEP, 240, 90),
    "gpu_train_step_9b_mb2": ("benchmarks.gpu_train_step",
                              dict(model="9b", seq_len=6144, pairs_per_device=2, steps=3, remat="auto",
                                   lora_rank=16),
                              dict(_TINY_STEP, pairs_per_device=2), 300, 120),
    "gpu_decode_4b": ("benchmarks.gpu_decode", dict(batch=160, prompt_len=512, new_tokens=256, repeats=2),
                      dict(tiny=True, batch=4, prompt_len=32, new_tokens=16, repeats=1), 180, 90),
    "gpu_kernels_4b": ("benchmarks.bench_kernels",
                       dict(shape="4b", batch=1, seq_len=4096, decode_batch=160, repeats=5, reference=False),
                       dict(tiny=True), 120, 45),
    "gpu_rollout_4b": ("benchmarks.gpu_rollout",
                       dict(prompts=20, samples=8, prompt_len=512, new_tokens=4096, lora_rank=16),
                       dict(tiny=True, prompts=2, samples=4, prompt_len=16, new_tokens=32, lora_rank=4), 420, 240),
    "gpu_grpo_4b": ("benchmarks.gpu_grpo", dict(prompts=20, k=8, prompt_len=512, max_new_tokens=512, steps=2, mb=8),
                    dict(tiny=True, prompts=2, k=4, prompt_len=8, max_new_tokens=8, steps=2), 300, 150),
    "gpu_train_step_4b_mb2": ("benchmarks.gpu_train_step",
                              dict(model="4b", seq_len=4096, pairs_per_device=2, steps=3, remat="auto",
                                   lora_rank=16),
                              dict(_TINY_STEP, pairs_per_device=2), 240, 90),
    "gpu_train_step_9b": ("benchmarks.gpu_train_step",
                          dict(model="9b", seq_len=6144, pairs_per_device=1, steps=3, remat="auto", lora_rank=16),
                          _TINY_STEP, 300, 120),
    "aot_real_shapes": ("benchmarks.aot_real_shapes", dict(shape="real", scan_layers="both"),
                        dict(shape="tiny", programs="dpo_4b,decode_4b", scan_layers="both"), 540, 120),
}
# Run only when --only names them.
NOT_BY_DEFAULT = ("aot_real_shapes",)


def _worker(module: str, kwargs: dict, json_out: str) -> None:
    import importlib
    result = importlib.import_module(module).run(**kwargs)
    with open(json_out, "w") as f:
        json.dump(result, f, indent=1, default=str)


def _summary(name: str, r: dict) -> str:
    gib = lambda v: "-" if v is None else f"{v:.1f} GiB"  # noqa: E731
    if name.startswith("gpu_train_step"):
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        return (f"{r['model']} seq {r['seq_len']} x {r['rows_per_step']} rows: step {r['step_s']:.3f} s, "
                f"{r['tokens_per_s']:,.0f} tok/s, {r['achieved_tflops_per_device']:.0f} TFLOP/s, MFU {mfu}, "
                f"peak {gib(r.get('peak_device_memory_gib'))}, compile {r['compile_s']:.0f} s")
    if name.startswith("gpu_decode"):
        return (f"{r['shape']} B={r['batch']}: decode {r['decode_tokens_per_s']:,.0f} tok/s "
                f"({r['ms_per_step']:.1f} ms/step, {r['as_implemented']['fraction_of_bound']:.0%} of the bandwidth "
                f"bound), prefill {r['prefill_tokens_per_s']:,.0f} tok/s, peak {gib(r.get('peak_device_memory_gib'))}")
    if name.startswith("gpu_kernels"):
        frac = lambda k: f"{r[k]['fraction_of_roofline']:.0%} of roofline" if "fraction_of_roofline" in r[k] else ""  # noqa: E731
        return (f"attention ({r['attention']['implementation']}) fwd+bwd {r['attention']['fast_ms']:.2f} ms "
                f"{frac('attention')}; GDN fwd+bwd {r['gdn']['fast_ms']:.2f} ms {frac('gdn')}; decode update "
                f"B={r['decode_update']['batch']} {r['decode_update']['fast_us']:.0f} us {frac('decode_update')}")
    if name.startswith("gpu_rollout"):
        return (f"{r['shape']} {r['rows']} rows x {r['new_tokens']} new, LoRA r{r['lora_rank']}: "
                f"{r['tokens_per_s']:,.0f} tok/s ({r['fraction_of_hbm_bound']:.0%} of the HBM bound), "
                f"{r['decode_steps']} steps, utilisation {r['slot_utilisation']:.0%}, {r['compiled_programs']} "
                f"programs compiled in {r['compile_s']:.0f} s, peak {gib(r.get('peak_device_memory_gib'))}")
    if name == "aot_real_shapes":
        return "; ".join(f"{p['program']} scan={p.get('scan_layers')}: " + (
            f"compile {p['compile_s']:.0f} s, peak {p['memory']['peak_gib']:.1f} GiB, remat "
            f"{p['remat'].get('chosen', '-')}" if "error" not in p else f"ERROR {p['error'][:120]}")
            for p in r["programs"])
    if name.startswith("gpu_grpo"):
        return (f"{r['model']} {r['rows']} rows x {r['max_new_tokens']} new: step {r['step_s']:.1f} s = sample "
                f"{r['sample_s']:.1f} + score {r['score_s']:.2f} + ref {r['ref_logp_s']:.1f} + update "
                f"{r['update_s']:.1f}; peak {gib(r.get('peak_device_memory_gib'))}")
    return ""


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_out"))
    ap.add_argument("--budget_s", type=float, default=540.0, help="wall-clock budget of the whole run (what does "
                    "not fit is skipped, in the order of GPU_BENCHES)")
    ap.add_argument("--only", default="", help="comma list of: " + ", ".join(GPU_BENCHES))
    ap.add_argument("--grpo_new_tokens", type=int, default=512, help="GRPO cap on new tokens (users' runs: 4096)")
    ap.add_argument("--dry_run", action="store_true", help="tiny shapes on any backend (a CPU check of the scripts)")
    ap.add_argument("--compilation_cache", default=None, help="JAX persistent compilation cache of the children: a "
                    "folder, or none (default $XDG_CACHE_HOME/jaxrl/xla; an inherited JAX_COMPILATION_CACHE_DIR "
                    "wins)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kwargs", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--json_out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker, json.loads(args.kwargs), args.json_out)
        return {}

    from jaxrl.utils import compile_cache
    child_env = compile_cache.child_env(args.compilation_cache)
    cache_dir = child_env.get(compile_cache.ENV)
    # This process only does arithmetic on abstract shapes: keep it off the accelerator, whose memory the
    # benchmarks (children, with the original environment) need in full.
    os.environ["JAX_PLATFORMS"] = "cpu"
    from benchmarks.gpu_train_step import shape_report
    from benchmarks.run_all import run_group
    names = [n for n in args.only.split(",") if n] or [n for n in GPU_BENCHES if n not in NOT_BY_DEFAULT]
    unknown = [n for n in names if n not in GPU_BENCHES]
    if unknown:
        ap.error(f"--only: unknown {unknown}; choose from {list(GPU_BENCHES)}")
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "dry_run": args.dry_run,
              "budget_s": args.budget_s, "device": _device(child_env),
              "compilation_cache": {"folder": cache_dir, "entries_at_start": _entries(cache_dir)},
              "shapes": [shape_report("4b", 4096, 1, 16), shape_report("9b", 6144, 2, 16)], "benchmarks": {}}
    for name in names:
        module, kwargs, dry_kwargs, cap, minimum = GPU_BENCHES[name]
        kwargs = dict(dry_kwargs if args.dry_run else kwargs)
        if name.startswith("gpu_grpo") and not args.dry_run:
            kwargs["max_new_tokens"] = args.grpo_new_tokens
        if name == "aot_real_shapes":  # one line per program as it compiles: what finished survives a time limit
            kwargs["out"] = os.path.join(args.out, f"{name}{'_dry_run' if args.dry_run else ''}.jsonl")
        left = args.budget_s - (time.perf_counter() - start)
        entry = {"module": module, "kwargs": kwargs}
        if left < minimum and not args.dry_run:
            entry.update(status="skipped", error=f"{left:.0f} s of the budget left, needs at least {minimum} s")
            report["benchmarks"][name] = entry
            print(f"[gpu_all] {name}: skipped ({entry['error']})", flush=True)
            continue
        limit = max(1.0, min(cap, left)) if not args.dry_run else 600.0
        json_out = os.path.join(args.out, f"{name}{'_dry_run' if args.dry_run else ''}.json")
        log_out = json_out[:-5] + ".log"
        if os.path.exists(json_out):
            os.unlink(json_out)
        cmd = [sys.executable, "-m", "benchmarks.gpu_all", f"--worker={module}", f"--kwargs={json.dumps(kwargs)}",
               f"--json_out={json_out}"]
        print(f"[gpu_all] {name}: {module} {kwargs} (limit {limit:.0f} s)", flush=True)
        t0 = time.perf_counter()
        with open(log_out, "w") as log:
            rc = run_group(cmd, child_env, log, limit)
        entry["wall_s"] = round(time.perf_counter() - t0, 1)
        if rc == 0 and os.path.exists(json_out):
            with open(json_out) as f:
                entry["result"] = json.load(f)
            entry["status"] = "ok"
            print(f"[gpu_all] {name}: ok in {entry['wall_s']} s: {_summary(name, entry['result'])}", flush=True)
        else:
            with open(log_out, errors="replace") as f:
                tail = f.read()[-3000:]
            entry.update(status="failed", error=(f"timed out after {limit:.0f} s" if rc == "timeout" else
                                                 f"exit code {rc}") + "\n" + tail)
            print(f"[gpu_all] {name}: FAILED in {entry['wall_s']} s: {entry['error'][-1500:]}", flush=True)
        report["benchmarks"][name] = entry
    report["wall_s"] = round(time.perf_counter() - start, 1)
    path = os.path.join(args.out, "gpu_all_dry_run.json" if args.dry_run else "gpu_all.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"[gpu_all] wrote {path} in {report['wall_s']} s")
    return report


def _entries(folder) -> int | None:
    """jax's cache entries in `folder` (`<key>-cache` files): 0 on a first run, the programs' count on a rerun."""
    if not folder:
        return None
    return sum(1 for n in os.listdir(folder) if n.endswith("-cache")) if os.path.isdir(folder) else 0


def _device(env: dict) -> dict:
    """The accelerator, asked in a child process (so this process never holds device memory)."""
    code = ("import jax, json; d = jax.devices(); print(json.dumps({'backend': jax.default_backend(), "
            "'device_kind': d[0].device_kind, 'devices': len(d), 'jax': jax.__version__}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:  # the benchmarks themselves will show what is wrong
        return {"error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    main()
