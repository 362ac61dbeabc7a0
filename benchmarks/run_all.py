"""Every side-by-side CPU benchmark in one go, one table of ratios: `make bench`.

    python -m benchmarks.run_all                       # full sizes (durations: benchmarks/RESULTS.md, 'Reproduce')
    python -m benchmarks.run_all --quick               # smaller sizes, fewer steps
    python -m benchmarks.run_all --only=train_step,dpo --out=bench_out

Each benchmark (benchmarks/bench_*.py) runs in its own subprocess, one after another (never in parallel: they
would share the cores), through its `run(**kwargs)` function; the child writes the returned dict as JSON. A
benchmark that fails or passes `--timeout_s` is recorded as failed with the tail of its output, and the others
still run. The driver then prints ONE table:

    benchmark | jaxrl | peer | unit | ratio | notes

ratio > 1 always means jaxrl is better: jaxrl speed / peer speed for rates, peer / jaxrl for times and memory.
It writes `<out>/results.json` (machine, every benchmark's full result, the rows) and `<out>/results.md` (the
table and the machine), and each child's output to `<out>/logs/<name>.log`.

The machine is part of the result: CPU model, cores, memory, load average before and after every benchmark
(the CPU may be shared), library versions. Children run with XLA's forced host device count removed from
XLA_FLAGS (the Makefile sets 8 fake devices for the tests): every benchmark measures one CPU device, whether
started by `make bench` or by hand.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from importlib import metadata
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> module, kwargs of its run() for the full and the quick run, and what the row numbers mean.
BENCHES: dict[str, dict] = {
    "forward": dict(
        module="benchmarks.bench_forward",
        peer="transformers (torch eager)",
        full=dict(batch=4, seq_len=1024, repeats=5),  # the configuration of issue 15
        quick=dict(batch=2, seq_len=256, repeats=3, lengths=[512, 1024, 2048], recurrent_max=2048)),
    "train_step": dict(
        module="benchmarks.bench_train_step",
        peer="PEFT + torch",
        full=dict(batch=4, seq_len=256, steps=5),
        quick=dict(batch=2, seq_len=128, steps=3)),
    "decode": dict(
        module="benchmarks.bench_decode",
        peer="transformers generate",
        full=dict(batch=8, prompt_len=64, new_tokens=128, repeats=3),
        quick=dict(batch=4, prompt_len=32, new_tokens=32, repeats=2)),
    "verifier": dict(
        module="benchmarks.bench_verifier",
        peer="subprocess.run per test",
        full=dict(programs=60),
        quick=dict(programs=20)),
    "dpo": dict(
        module="benchmarks.bench_dpo",
        peer="TRL DPOTrainer + PEFT",
        full=dict(pairs=4, prompt_len=128, completion_len=127, steps=6, warmup=2, rounds=2),
        quick=dict(pairs=2, prompt_len=64, completion_len=63, steps=3, warmup=2, rounds=1)),
    "kernels": dict(
        module="benchmarks.bench_kernels",
        peer="the formulation each replaced (jaxrl, same process, interleaved)",
        full=dict(shape="small", batch=4, seq_len=1024, decode_batch=8, repeats=5),
        quick=dict(shape="small", batch=2, seq_len=512, decode_batch=8, repeats=3)),
    "grpo": dict(
        module="benchmarks.bench_grpo",
        peer=None,  # no peer: where one GRPO step's time goes
        full=dict(model="small", prompts=8, k=8, prompt_len=32, max_new_tokens=64, steps=8, mb=8),
        quick=dict(model="small", prompts=4, k=4, prompt_len=16, max_new_tokens=16, steps=6, mb=8)),
    "server": dict(
        module="benchmarks.bench_server",
        peer="the ThreadingHTTPServer server it replaced (git history)",
        full=dict(requests=256, concurrency=32, prompt_len=48, max_tokens=64),
        quick=dict(requests=64, concurrency=16, prompt_len=32, max_tokens=16)),
    "rollout_engine": dict(
        module="benchmarks.bench_rollout_engine",
        peer="the static-batch sampler (jaxrl at c7219bb, from git history; same process, interleaved)",
        full=dict(prompts=32, samples=8, slots=64, max_new_tokens=256, truncation_prompts=20, repeats=3),
        quick=dict(prompts=16, samples=8, slots=32, max_new_tokens=128, truncation_prompts=10, repeats=2,
                   sections=())),
    "packing": dict(
        module="benchmarks.bench_packing",
        peer="the padded layout (jaxrl, same pairs, run back to back)",
        full=dict(pairs=64, scale=16, mb=4, grad_accum=2, epochs=2),
        quick=dict(pairs=32, scale=32, mb=4, grad_accum=2, epochs=3)),
    "overlap": dict(
        module="benchmarks.bench_overlap",
        peer="overlap off (jaxrl, the same server run, alternated)",
        full=dict(steps=12, rounds=2, servers=1),
        quick=dict(steps=5, rounds=1, servers=1)),
}


# ------------------------------------------------------------------------------------------------ rows


def _row(bench: str, what: str, jaxrl, peer, unit: str, higher_is_better: bool = True, notes: str = "") -> dict:
    ratio = None
    if isinstance(jaxrl, (int, float)) and isinstance(peer, (int, float)) and jaxrl > 0 and peer > 0:
        ratio = jaxrl / peer if higher_is_better else peer / jaxrl
    return {"benchmark": f"{bench}: {what}", "jaxrl": jaxrl, "peer": peer, "unit": unit, "ratio": ratio,
            "notes": notes}


def rows_forward(r: dict) -> list[dict]:
    f = r["forward"]
    longest = r["kernel_scaling"][-1]
    notes = (f"small Qwen3.5, B={f['batch']} T={f['seq_len']} fp32, {f['threads']} threads; chunked GDN kernel "
             f"growth per doubling of T {r['kernel_mean_growth_per_doubling']:.2f} (2.0 = linear), "
             f"{longest['chunked_ms']:.1f} ms at T={longest['seq_len']}")
    return [_row("forward", "logits, tokens/s", f["jaxrl_tokens_per_s"], f["hf_tokens_per_s"], "tok/s",
                 notes=notes)]


def rows_train_step(r: dict) -> list[dict]:
    j, p = r["jaxrl"], r["peft_torch"]
    base = f"B={r['batch']} T={r['seq_len']} LoRA {r['lora']} fp32, median of {r['timed_steps']} steps"
    return [_row("train_step", "LoRA SFT step, tokens/s", j["tokens_per_s"], p["tokens_per_s"], "tok/s",
                 notes=f"{base}; jaxrl compile {j['compile_s']:.1f} s (untimed)"),
            _row("train_step", "peak RSS", j["peak_rss_mb"], p["peak_rss_mb"], "MB", higher_is_better=False,
                 notes="whole process (framework + weights + activations), lower is better")]


def rows_decode(r: dict) -> list[dict]:
    rows = []
    for name, c in r.items():
        rows.append(_row("decode", f"{name} config, decode tokens/s", c["jaxrl_decode_tokens_per_s"],
                         c["hf_decode_tokens_per_s"], "tok/s",
                         notes=(f"hidden {c['hidden_size']}, B={c['batch']} prompt {c['prompt_len']} new "
                                f"{c['new_tokens']} greedy fp32; end-to-end ratio {c['end_to_end_ratio']:.2f}; "
                                f"greedy rows equal to HF {c['greedy_rows_equal_to_hf']:.0%}")))
    return rows


def rows_verifier(r: dict) -> list[dict]:
    ms = lambda s: 1e3 * s  # noqa: E731
    return [_row("verifier", "latency per test", ms(r["verifier_median_per_test_s"]),
                 ms(r["subprocess_median_per_test_s"]), "ms", higher_is_better=False,
                 notes=(f"{r['programs']} trivial programs, isolation {r['isolation']}; vs `python -I -S`: "
                        f"{r['per_test_speedup_vs_bare_subprocess']:.1f}x; the peer has no sandbox")),
            _row("verifier", "throughput, all cores", r["verifier_programs_per_s"], r["subprocess_programs_per_s"],
                 "programs/s", notes=f"{r['cores']} cores")]


def rows_dpo(r: dict) -> list[dict]:
    rows = []
    for mode, e in r["modes"].items():
        rows.append(_row("dpo", f"train step ({mode} reference), tokens/s", e["jaxrl"]["tokens_per_s"],
                         e["trl"]["tokens_per_s"], "tok/s",
                         notes=(f"{r['pairs_per_step']} pairs x 2 x T={r['seq_len']}, sigmoid beta {r['beta']}, "
                                f"LoRA {r['lora']} fp32, best of {r['rounds']} round(s); ratio of best steps "
                                f"{e['ratio_best_tokens_per_s']:.2f}, of tokens per CPU-second "
                                f"{e['ratio_tokens_per_cpu_s']:.2f}")))
    return rows


def rows_grpo(r: dict) -> list[dict]:
    shape = (f"{r['model']} model, {r['rows']} rows (prompt {r['prompt_len']}, up to {r['max_new_tokens']} new), "
             f"{r['dtype']}")
    rows = [_row("grpo", "step (rollout + update)", r["step_s"], None, "s",
                 notes=(f"{shape}; sampling {r['sample_tokens_per_s']:,.0f} tok/s, training "
                        f"{r['train_tokens_per_s']:,.0f} tok/s; no peer (time split only)"))]
    for phase, label in (("sample", "sampling"), ("score", "scoring"), ("ref_logp", "reference log-probs"),
                         ("old_logp", "old log-probs"), ("update", "update")):
        rows.append(_row("grpo", f"  {label}", r[f"{phase}_s"], None, "s",
                         notes=f"{r['share_' + phase]:.0%} of the step"))
    return rows


def rows_kernels(r: dict) -> list[dict]:
    shape = f"{r['shape']} heads, B={r['batch']} T={r['seq_len']} {r['dtype']}; interleaved with the reference"
    a, g, d = r["attention"], r["gdn"], r["decode_update"]
    return [_row("kernels", f"attention fwd+bwd ({a['implementation']}) vs dense masked", a["fast_ms"],
                 a["reference_ms"], "ms", higher_is_better=False, notes=shape),
            _row("kernels", "GDN chunked fwd+bwd vs token recurrence", g["fast_ms"], g["reference_ms"], "ms",
                 higher_is_better=False, notes=f"{shape}; chunk {g['chunk_size']}"),
            _row("kernels", "GDN decode update vs recurrence", d["fast_us"], d["reference_us"], "us",
                 higher_is_better=False, notes=f"{d['batch']} rows, fp32 state"),
            _row("kernels", "decode projections, [in, out] copies vs [out, in]", r["decode_projections"]["fast_us"],
                 r["decode_projections"]["reference_us"], "us", higher_is_better=False,
                 notes=f"{r['decode_projections']['batch']} rows against each of the model's "
                       f"{r['decode_projections']['weights']} weights ({r['decode_projections']['weight_mb']:.1f} MB)")]


def rows_server(r: dict) -> list[dict]:
    load = r["load"]
    notes = (f"small Qwen3.5 fp32, {load['requests']} requests x {load['max_tokens']} tokens from "
             f"{load['concurrency']} clients; reconnects old {r['old']['reconnects']}, new {r['new']['reconnects']}; "
             f"compiled while timed old {r['old']['compiled_while_timed']}, new {r['new']['compiled_while_timed']}")
    return [_row("server", "requests/s", r["new"]["requests_per_s"], r["old"]["requests_per_s"], "req/s",
                 notes=notes),
            _row("server", "completion tokens/s", r["new"]["tokens_per_s"], r["old"]["tokens_per_s"], "tok/s")]


def rows_rollout_engine(r: dict) -> list[dict]:
    rows = []
    for name in ("skewed", "truncation"):
        if name not in r:
            continue
        w = r[name]
        c, s = w["continuous"], w["static"]
        notes = (f"{w['model']} model, {w['rows']} rows through {w['slots']} slots, cap {w['max_new_tokens']}, mean "
                 f"length {w['mean_length']}; decode steps {s['decode_steps']} -> {c['decode_steps']}, slot "
                 f"utilisation {s['slot_utilisation']:.0%} -> {c['slot_utilisation']:.0%}; samples identical "
                 f"{w['samples_identical']}; load {w['load_average_before'][0]}")
        rows.append(_row("rollout_engine", f"{name}: continuous vs static batching, tokens/s", c["tokens_per_s"],
                         s["tokens_per_s"], "tok/s", notes=notes))
    if "adapter" in r:
        for dtype in ("float32", "bfloat16"):
            a = r["adapter"][dtype]
            rows.append(_row("rollout_engine", f"decode with a LoRA adapter ({dtype}), tokens/s",
                             a["adapter_fused"]["tokens_per_s"], a["base"]["tokens_per_s"], "tok/s",
                             notes=(f"peer = no adapter; unfused {a['adapter_unfused_vs_base']:.2f}x of base; "
                                    "sampler vs teacher-forced log-prob gap max "
                                    f"{a['teacher_forced_gap']['max']:.2g}")))
    return rows


def rows_packing(r: dict) -> list[dict]:
    p, u = r["packed"], r["padded"]
    notes = (f"small model, {r['pairs']} pairs of the pair builder's length spread / {r['scale']} (T {u['seq_len']}), "
             f"mb {r['mb']} x {r['grad_accum']}; packed rows {p['row_lengths']} ({p['compiles']} compiles); "
             f"load {u['load_before'][0]} -> {p['load_after'][0]}")
    return [_row("packing", "DPO epoch, real tokens/s (packed vs padded)", p["tokens_per_s"], u["tokens_per_s"],
                 "tok/s", notes=notes),
            _row("packing", "DPO epoch, real tokens per CPU-second", p["tokens_per_cpu_s"], u["tokens_per_cpu_s"],
                 "tok/CPU-s", notes="process CPU time: what other processes on shared cores disturb least"),
            _row("packing", "fill ratio (real / row tokens)", p["fill_ratio"], u["fill_ratio"], "",
                 notes=(f"mean over the steps, as logged (`fill_ratio`); the whole {r['cohort']}-pair cohort at full "
                        f"scale, as planned: {r['full_scale']['packed']:.2f} vs {r['full_scale']['padded']:.2f}"))]


def rows_overlap(r: dict) -> list[dict]:
    notes = (f"the demo's GRPO ({r['prompts']} x {r['k']} rows, <= {r['max_new_tokens']} new tokens, {r['dtype']}) on "
             f"{r['servers']} launchers.serve, {r['timed_steps']} timed steps x {r['rounds']} round(s), "
             f"{r['cores']} cores; load {r['load_average_before'][0]} -> {r['load_average_after'][0]}")
    return [_row("overlap", "GRPO step wall time, overlap on vs off", r["on_step_s"], r["off_step_s"], "s",
                 higher_is_better=False, notes=notes)]


ROWS: dict[str, Callable[[dict], list[dict]]] = {
    "forward": rows_forward, "train_step": rows_train_step, "decode": rows_decode, "verifier": rows_verifier,
    "dpo": rows_dpo, "kernels": rows_kernels, "grpo": rows_grpo, "server": rows_server,
    "rollout_engine": rows_rollout_engine, "packing": rows_packing, "overlap": rows_overlap}


# ------------------------------------------------------------------------------------------------ machine


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _version(pkg: str):
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            names = re.findall(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        cpu = names[0] if names else cpu
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = round(int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1)) / 2**20, 1)
    except (OSError, AttributeError):
        pass
    return {
        "cpu_model": cpu, "logical_cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gib": mem_gib, "platform": platform.platform(), "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "trl",
                                              "peft", "numpy")},
    }


# ------------------------------------------------------------------------------------------------ driver


def _child_env() -> dict:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_group(cmd: list[str], env: dict, log, timeout_s: float):
    """Run `cmd` in its own process group, output to `log`; on timeout kill the whole group (benchmarks start
    workers of their own). Returns the exit code, or "timeout"."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill_group():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group()
        return "timeout"
    except BaseException:  # Ctrl-C: the group is in its own session and would not get the signal
        kill_group()
        raise


def run_one(name: str, kwargs: dict, out_dir: str, timeout_s: float) -> dict:
    """One benchmark in a child process; never raises."""
    log_path = os.path.join(out_dir, "logs", f"{name}.log")
    json_path = os.path.join(out_dir, "logs", f"{name}.json")
    if os.path.exists(json_path):
        os.unlink(json_path)
    cmd = [sys.executable, "-m", "benchmarks.run_all", f"--worker={name}", f"--kwargs={json.dumps(kwargs)}",
           f"--json_out={json_path}"]
    entry = {"name": name, "module": BENCHES[name]["module"], "kwargs": kwargs, "load_before": _loadavg(),
             "started": datetime.datetime.now().isoformat(timespec="seconds")}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = run_group(cmd, _child_env(), log, timeout_s)
    entry.update(wall_s=round(time.perf_counter() - t0, 1), load_after=_loadavg())
    if rc == 0 and os.path.exists(json_path):
        with open(json_path) as f:
            entry["result"] = json.load(f)
        try:
            entry["rows"] = ROWS[name](entry["result"])
            entry["status"] = "ok"
        except Exception as e:  # a result we cannot read is a failure of this benchmark only
            entry.update(status="failed", error=f"reading the result: {type(e).__name__}: {e}")
    else:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        reason = f"timed out after {timeout_s:.0f} s" if rc == "timeout" else f"exit code {rc}"
        entry.update(status="failed", error=f"{reason}\n{tail}")
    return entry


def worker(name: str, kwargs: dict, json_out: str) -> None:
    from benchmarks.common import set_cpu_threads
    set_cpu_threads()
    module = importlib.import_module(BENCHES[name]["module"])
    result = module.run(**kwargs)
    with open(json_out, "w") as f:
        json.dump(result, f, default=str)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) >= 1 else f"{v:.3f}"
    return str(v)


def table_md(rows: list[dict]) -> str:
    cols = ["benchmark", "jaxrl", "peer", "unit", "ratio", "notes"]
    cells = [[_fmt(r[c]) + ("x" if c == "ratio" and r[c] is not None else "") for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = lambda xs: "| " + " | ".join(x.ljust(w) for x, w in zip(xs, widths)) + " |"  # noqa: E731
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def render_md(report: dict) -> str:
    m = report["machine"]
    v = m["versions"]
    lines = [
        f"# jaxrl CPU benchmarks ({'quick' if report['quick'] else 'full'} run, {report['date']})",
        "",
        "ratio > 1 means jaxrl is better: jaxrl speed / peer speed (for times and memory: peer / jaxrl).",
        "",
        table_md(report["rows"]),
        "",
        "Peers: " + "; ".join(f"{n}: {BENCHES[n]['peer']}" for n in report["ran"] if BENCHES[n]["peer"]) + ".",
        "",
        f"Machine: {m['cpu_model']}, {m['usable_cores']} usable cores ({m['logical_cores']} logical), "
        f"{m['memory_gib']} GiB; {m['platform']}; Python {m['python']}; jax {v['jax']}, jaxlib {v['jaxlib']}, "
        f"flax {v['flax']}, torch {v['torch']}, transformers {v['transformers']}, trl {v['trl']}, "
        f"peft {v['peft']}.",
        f"Load average (1, 5, 15 min): {report['load_before']} before, {report['load_after']} after; "
        f"per benchmark:",
        "",
    ]
    for b in report["benchmarks"]:
        lines.append(f"- {b['name']}: {b['status']}, {b['wall_s']} s, load {b['load_before'][0]} -> "
                     f"{b['load_after'][0]}")
    failed = [b for b in report["benchmarks"] if b["status"] != "ok"]
    if failed:
        lines += ["", "## Failed", ""]
        for b in failed:
            lines += [f"### {b['name']}", "", "```", b["error"].strip()[-2000:], "```", ""]
    lines += ["", f"Command: `{report['command']}` (total {report['wall_s']} s).", ""]
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma list of: " + ", ".join(BENCHES))
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer steps (a few minutes)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out"), help="output folder")
    parser.add_argument("--timeout_s", type=float, default=None,
                        help="per benchmark (default 1800; --quick: 600)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kwargs", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--json_out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(args.kwargs), args.json_out)
        return None

    names = [n for n in args.only.split(",") if n] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        parser.error(f"--only: unknown {unknown}; choose from {list(BENCHES)}")
    timeout_s = args.timeout_s or (600.0 if args.quick else 1800.0)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    report = {"date": datetime.date.today().isoformat(), "quick": args.quick, "ran": names,
              "command": " ".join(["python -m benchmarks.run_all", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine_info(), "load_before": _loadavg(), "benchmarks": [], "rows": []}
    t0 = time.perf_counter()
    for name in names:
        kwargs = BENCHES[name]["quick" if args.quick else "full"]
        print(f"[run_all] {name}: {BENCHES[name]['module']} {kwargs} (load {_loadavg()[0]})", flush=True)
        entry = run_one(name, kwargs, args.out, timeout_s)
        report["benchmarks"].append(entry)
        if entry["status"] == "ok":
            report["rows"] += entry["rows"]
            print(f"[run_all] {name}: ok in {entry['wall_s']} s", flush=True)
        else:
            report["rows"].append(_row(name, "FAILED", None, None, "", notes=entry["error"].strip()
                                       .splitlines()[-1][:160] if entry["error"].strip() else ""))
            print(f"[run_all] {name}: FAILED in {entry['wall_s']} s: {entry['error'][-1500:]}", flush=True)
    report.update(load_after=_loadavg(), wall_s=round(time.perf_counter() - t0, 1))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    md = render_md(report)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    print()
    print(table_md(report["rows"]))
    print(f"\nload average {report['load_before']} -> {report['load_after']}; wrote "
          f"{os.path.join(args.out, 'results.json')} and results.md")
    return report


if __name__ == "__main__":
    _report = main()
    if _report is not None and any(b["status"] != "ok" for b in _report["benchmarks"]):
        sys.exit(1)  # the files are written; `make bench` still says that something failed
