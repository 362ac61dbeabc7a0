"""Continuous vs static batching of the JAX sampler: one workload through both, one process, interleaved.

    python -m benchmarks.bench_rollout_engine [--quick]

The continuous path is the generation engine, `jaxrl.generation.Sampler` (`slots` kept busy: finished rows
replaced by waiting ones between rounds, the last rows moved to fewer slots). The static path is the sampler the
engine replaced, `jaxrl/rollout/sampler.py`'s `Sampler` (rows in batches of `slots`, each batch decoded until its
longest row stops), which left the tree after STATIC_COMMIT: `jaxrl/` at that commit is extracted from git history
and imported next to this tree's as `jaxrl_static` (`benchmarks.versus.import_revision`), with its own copy of the
model holding the same weights. Same prompts, keys and settings; every repeat runs static then continuous (a load
burst on the shared machine hits both).

Workloads (fp32, sampled at temperature 1):
  * skewed: the demo's tiny model (vocab 48, hidden 64, a Gated DeltaNet and an attention layer, random weights
    perturbed and the head scaled 10x as `launchers.demo` writes it) with natural stops (its EOS): lengths
    roughly geometric, the longest row of a batch several times the mean;
  * truncation: the users' pattern, 45% of the rows running to the cap and the rest stopping uniformly before it
    (each row's own cap on the continuous side; the static side decodes every row to the cap, which its batches
    do anyway since each holds rows that run to it, and its rows are cut at their caps on the host to compare).
    On the "small" shape of benchmarks/common.py (hidden 256, 4 layers, vocab 2048) by default: there a decode
    step's time grows with its rows, as on an accelerator, while the tiny model's step on two CPU cores is mostly
    fixed per-step overhead (`truncation_model="demo"` runs it there too).

Two more sections (`run(sections=...)`), on the small shape:
  * adapter: decode tokens/s of the engine without an adapter, with a rank-16 all-linear LoRA adapter fused into
    its projections (`Qwen35.decode_weights`, what the engine does) and unfused (`fuse_adapters=False`), fp32
    and bf16, interleaved; and the sampler-vs-teacher-forced log-prob gap of the adapted policy (the sampler's
    log-probs against a training-style forward over prompt + completion with the adapter unfused);
  * gdn_state: a bf16 model sampling greedily with the Gated DeltaNet decode state stored in fp32 (the default)
    and in bf16 (`gdn_state_dtype`): where the two greedy rows first diverge, the log-prob drift of the bf16-state
    sampler against teacher-forced fp32-state log-probs of its own tokens, and decode tokens/s of both.

Counters that do not move with the machine's load: decode steps (model calls), slot-steps (slots x steps summed
over the calls), slot utilisation = tokens produced by decode steps / slot-steps (a row's first token comes from
its prefill), compiled sampler programs (each side's own TRACE_COUNTS), and the engine's rounds, inserts, prompt
prefills and shrinks. Measured with the load: seconds per run (median), useful tokens/s (the generated tokens of
all rows / seconds, prefill included) and the continuous / static ratio. `samples_identical`: every row's tokens
equal (cut at its cap) on both sides.

`--launcher` (`run_launcher`) times whole `python -m launchers.rollout` runs instead: this tree's launcher (the
engine) against STATIC_COMMIT's, run from a checkout of that commit's files with the jax backend's
`batching="static"` (its benchmarks/rollout_with_batching.py).

Prints one JSON object (also the return value of `run`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

WORKLOADS = ("skewed", "truncation")
TRUNCATED_FRACTION = 0.45
# The last commit with the static sampler (jaxrl/rollout/sampler.py) and the jax backend's batching="static";
# its jaxrl is imported as STATIC_PACKAGE for the static side.
STATIC_COMMIT = "c7219bb"
STATIC_PACKAGE = "jaxrl_static"


def static_package():
    """`jaxrl/` at STATIC_COMMIT, imported as STATIC_PACKAGE (once per process)."""
    from benchmarks.versus import import_revision
    return import_revision(STATIC_COMMIT, STATIC_PACKAGE)


def _module(package: str, name: str):
    import importlib
    return importlib.import_module(f"{package}.{name}")


def demo_model(package: str = "jaxrl"):
    """The demo's tiny model as `launchers.demo` writes its pretrained/ folder (jaxrl.demo.Demo.model), built
    by `package` (this tree's jaxrl or STATIC_PACKAGE)."""
    import jax.numpy as jnp

    qwen35 = _module(package, "models.qwen35")
    cfg = _module(package, "models.qwen35.config").tiny(
        vocab_size=48, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), eos_token_id=1)
    model = qwen35.init_model(cfg, dtype=jnp.float32, seed=0)
    _module(package, "models.qwen35.tiny_checkpoint").perturb_for_realism(model, 0)
    model.lm_head.weight[...] = model.lm_head.weight[...] * _module(package, "demo").HEAD_SCALE
    return model


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts of 33-64 tokens: one prompt bucket (64) on both sides, so the comparison is of batching alone."""
    rng = np.random.default_rng([seed, 1])
    return [rng.integers(2, vocab, size=int(rng.integers(33, 65))).tolist() for _ in range(count)]


def truncation_caps(rows: int, cap: int, seed: int) -> list[int]:
    """45% of the rows at the cap, the rest uniform in [1, cap - 1]."""
    rng = np.random.default_rng([seed, 2])
    return [cap if rng.random() < TRUNCATED_FRACTION else int(rng.integers(1, cap)) for _ in range(rows)]


def _side(stats: dict, rows: int, useful: int, seconds: list[float], programs: int) -> dict:
    slot_steps = stats["slot_steps"]
    median = statistics.median(seconds)
    return {"decode_steps": stats["decode_steps"], "slot_steps": slot_steps,
            "slot_utilisation": round((useful - rows) / slot_steps, 4) if slot_steps else None,
            "seconds_median": round(median, 4), "seconds": [round(s, 4) for s in seconds],
            "tokens_per_s": round(useful / median, 1), "compiled_programs": programs,
            **{k: stats[k] for k in ("inserts", "prefilled_prompts", "shrinks", "rounds") if k in stats}}


def small_model(dtype="float32", seed: int = 0, package: str = "jaxrl"):
    """benchmarks/common.py's SMALL_TEXT_CONFIG shape, random weights, built by `package`."""
    import jax.numpy as jnp

    from benchmarks.common import SMALL_TEXT_CONFIG
    cfg, _ = _module(package, "models.qwen35.config").parse_hf_config(dict(SMALL_TEXT_CONFIG))
    return _module(package, "models.qwen35").init_model(cfg, dtype=getattr(jnp, dtype), seed=seed)


MODELS = {"demo": demo_model, "small": small_model}


def static_twin(model_name: str, model):
    """The model `MODELS[model_name]` builds, built by STATIC_PACKAGE, holding `model`'s very weights."""
    from flax import nnx
    twin = MODELS[model_name](package=static_package().__name__)
    nnx.update(twin, nnx.state(model))
    return twin


def run_workload(name: str, prompts: int, samples: int, slots: int, max_new_tokens: int, repeats: int,
                 seed: int = 0, model_name: str = "demo") -> dict:
    from jaxrl.generation import TRACE_COUNTS, Sampler

    static = _module(static_package().__name__, "rollout.sampler")  # the static Sampler and its TRACE_COUNTS
    model = MODELS[model_name]()
    vocab = int(model.config.vocab_size)
    ids = _prompts(prompts, vocab, seed)
    rows = prompts * samples
    stops = (int(model.config.eos_token_id),) if name == "skewed" else ()
    caps = truncation_caps(rows, max_new_tokens, seed) if name == "truncation" else None
    settings = dict(max_new_tokens=max_new_tokens, prompt_buckets=(64,), batch_size=slots, eos_token_ids=stops)
    samplers = {"static": static.Sampler(static_twin(model_name, model), **settings),
                "continuous": Sampler(model, **settings)}
    counts = {"static": static.TRACE_COUNTS, "continuous": TRACE_COUNTS}
    call = dict(n=samples, temperature=1.0, seed=seed)

    def draw(side: str):
        if side == "continuous" and caps is not None:
            return samplers[side].sample(ids, row_caps=caps, **call)
        return samplers[side].sample(ids, **call)

    programs, outs = {}, {}
    for side in samplers:  # the first call compiles; not timed
        before = sum(counts[side].values())
        outs[side] = draw(side)
        programs[side] = sum(counts[side].values()) - before
    seconds = {side: [] for side in samplers}
    load_before = os.getloadavg()
    for _ in range(repeats):
        for side in samplers:
            t0 = time.perf_counter()
            outs[side] = draw(side)
            seconds[side].append(time.perf_counter() - t0)
    load_after = os.getloadavg()

    static, cont = outs["static"], outs["continuous"]
    static_tokens = static.tokens if caps is None else [t[:c] for t, c in zip(static.tokens, caps)]
    identical = static_tokens == cont.tokens
    useful = sum(len(t) for t in cont.tokens)
    result = {"workload": name, "model": model_name, "rows": rows, "prompts": prompts, "samples_per_prompt": samples,
              "slots": slots, "static_commit": STATIC_COMMIT,
              "max_new_tokens": max_new_tokens, "useful_tokens": useful,
              "mean_length": round(useful / rows, 2), "longest": max(len(t) for t in cont.tokens),
              "truncated_rows": sum(r == "length" for r in cont.finish_reasons),
              "static": _side(static.stats, rows, useful, seconds["static"], programs["static"]),
              "continuous": _side(cont.stats, rows, useful, seconds["continuous"], programs["continuous"]),
              "samples_identical": identical, "repeats": repeats,
              "load_average_before": [round(x, 2) for x in load_before],
              "load_average_after": [round(x, 2) for x in load_after]}
    s, c = result["static"], result["continuous"]
    result["ratios"] = {"tokens_per_s": round(c["tokens_per_s"] / s["tokens_per_s"], 3),
                        "decode_steps": round(s["decode_steps"] / c["decode_steps"], 3),
                        "slot_steps": round(s["slot_steps"] / c["slot_steps"], 3)}
    return result


def _attach_adapter(model, seed: int = 1):
    """A rank-16 all-linear adapter with random B (an untrained adapter changes nothing)."""
    import jax

    from jaxrl.models import lora
    lora.apply_lora(model, "all-linear", rank=16, alpha=32, seed=seed)
    key = jax.random.PRNGKey(seed)
    for i, (_, adapter) in enumerate(lora.iter_lora(model)):
        b = adapter.lora_B
        b[...] = 0.02 * jax.random.normal(jax.random.fold_in(key, i), b[...].shape)
    return model


def teacher_forced_gap(model, prompts: list[list[int]], out, width: int) -> dict:
    """max and mean |sampler log-prob - teacher-forced log-prob| over every generated token: the forward of
    training (adapters unfused, the chunked delta rule) over each prompt + completion, one row at a time."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    graphdef, state = nnx.split(model)

    @jax.jit
    def logprobs(state, ids, mask):
        logits = nnx.merge(graphdef, state)(ids, attention_mask=mask).astype(jnp.float32)
        return jax.nn.log_softmax(logits, axis=-1)

    gaps = []
    for i, tokens in enumerate(out.tokens):
        prompt = prompts[out.prompt_indices[i]]
        ids = np.zeros((1, width + out.max_new_tokens), np.int32)
        mask = np.zeros_like(ids)
        ids[0, width - len(prompt):width] = prompt
        ids[0, width:width + len(tokens)] = tokens
        mask[0, width - len(prompt):width + len(tokens)] = 1
        lp = np.asarray(logprobs(state, jnp.asarray(ids), jnp.asarray(mask)))[0]
        ref = lp[np.arange(width - 1, width - 1 + len(tokens)), tokens]
        gaps.append(np.abs(np.asarray(out.logprobs[i], np.float64) - ref))
    gaps = np.concatenate(gaps)
    return {"max": float(gaps.max()), "mean": float(gaps.mean()), "tokens": int(gaps.size)}


def run_adapter(rows: int = 32, max_new_tokens: int = 64, repeats: int = 3, seed: int = 0) -> dict:
    """Decode speed of the engine with and without an adapter (every row to the cap), and the sampler-vs-teacher-
    forced gap of the adapted policy; fp32 and bf16."""
    from jaxrl.generation import Sampler
    out = {"rows": rows, "max_new_tokens": max_new_tokens, "lora": "rank 16, all-linear"}
    for dtype in ("float32", "bfloat16"):
        base, adapted = small_model(dtype), _attach_adapter(small_model(dtype))
        ids = _prompts(rows, int(base.config.vocab_size), seed)
        settings = dict(max_new_tokens=max_new_tokens, prompt_buckets=(64,), batch_size=rows)
        samplers = {"base": Sampler(base, **settings),
                    "adapter_fused": Sampler(adapted, **settings),
                    "adapter_unfused": Sampler(adapted, fuse_adapters=False, **settings)}
        outs = {name: s.sample(ids, temperature=1.0, seed=seed) for name, s in samplers.items()}  # compiles
        seconds = {name: [] for name in samplers}
        for _ in range(repeats):
            for name, sampler in samplers.items():
                t0 = time.perf_counter()
                outs[name] = sampler.sample(ids, temperature=1.0, seed=seed)
                seconds[name].append(time.perf_counter() - t0)
        tokens = sum(len(t) for t in outs["base"].tokens)
        entry = {name: {"tokens_per_s": round(tokens / statistics.median(t), 1),
                        "seconds": [round(x, 4) for x in t]} for name, t in seconds.items()}
        entry["adapter_fused_vs_base"] = round(entry["adapter_fused"]["tokens_per_s"]
                                               / entry["base"]["tokens_per_s"], 3)
        entry["adapter_unfused_vs_base"] = round(entry["adapter_unfused"]["tokens_per_s"]
                                                 / entry["base"]["tokens_per_s"], 3)
        entry["fused_equals_unfused_tokens"] = outs["adapter_fused"].tokens == outs["adapter_unfused"].tokens
        entry["teacher_forced_gap"] = teacher_forced_gap(adapted, ids, outs["adapter_fused"], 64)
        out[dtype] = entry
    return out


def run_gdn_state(rows: int = 16, max_new_tokens: int = 128, repeats: int = 3, seed: int = 0) -> dict:
    """gdn_state_dtype bfloat16 vs float32 in a bf16 model: greedy divergence, log-prob drift, decode speed."""
    from jaxrl.generation import Sampler
    models = {dt: small_model("bfloat16").set_compute(gdn_state_dtype=dt) for dt in ("float32", "bfloat16")}
    ids = _prompts(rows, int(models["float32"].config.vocab_size), seed)
    settings = dict(max_new_tokens=max_new_tokens, prompt_buckets=(64,), batch_size=rows)
    samplers = {dt: Sampler(m, **settings) for dt, m in models.items()}
    outs = {dt: s.sample(ids) for dt, s in samplers.items()}
    seconds = {dt: [] for dt in samplers}
    for _ in range(repeats):
        for dt, sampler in samplers.items():
            t0 = time.perf_counter()
            outs[dt] = sampler.sample(ids)
            seconds[dt].append(time.perf_counter() - t0)
    first_divergence = []
    for a, b in zip(outs["float32"].tokens, outs["bfloat16"].tokens):
        first_divergence.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
    # the bf16-state sampler's log-probs of its own tokens against the fp32-state forward (teacher-forced)
    drift = teacher_forced_gap(models["float32"], ids, outs["bfloat16"], 64)
    reference = teacher_forced_gap(models["float32"], ids, outs["float32"], 64)
    tokens = rows * max_new_tokens
    return {"rows": rows, "max_new_tokens": max_new_tokens, "model_dtype": "bfloat16",
            "rows_identical": sum(d is None for d in first_divergence),
            "first_divergence": first_divergence,
            "logprob_gap_bf16_state": drift, "logprob_gap_fp32_state": reference,
            "tokens_per_s": {dt: round(tokens / statistics.median(t), 1) for dt, t in seconds.items()}}


def static_tree(folder: str) -> str:
    """What `python -m benchmarks.rollout_with_batching` needs at STATIC_COMMIT (jaxrl/, launchers/, configs/ and
    that script, as they were) extracted into folder/static_tree; its path."""
    from benchmarks.versus import extract_tree
    tree = os.path.join(folder, "static_tree")
    os.makedirs(tree, exist_ok=True)
    extract_tree(STATIC_COMMIT, tree, ("jaxrl", "launchers", "configs", "benchmarks/__init__.py",
                                       "benchmarks/rollout_with_batching.py"))
    return tree


def run_launcher(problems: int = 128, samples: int = 32, max_new_tokens: int = 512, repeats: int = 2,
                 workdir: str = "") -> dict:
    """`python -m launchers.rollout` on the demo's random model (its pretrained/ folder and its 128 held-out
    prompts) with `samples` samples per prompt and cap `max_new_tokens`, the static sampler (STATIC_COMMIT's
    launcher with the jax backend's `batching="static"`: its benchmarks/rollout_with_batching.py, run from a
    checkout of that commit's files, `static_tree`) against this tree's launcher (the engine), each a fresh process,
    alternated: `cold` with no compilation cache (every program compiled in the run, what a first run pays), `warm`
    with a cache a first run of each side filled (what a rerun on the same machine pays). samples/s is the
    launcher's own (its meta.json: from the first sample drawn to the last written, compilation included)."""
    import subprocess
    import sys
    import tempfile

    from benchmarks.versus import ROOT
    from jaxrl.demo import Demo
    root = workdir or tempfile.mkdtemp(prefix="bench_rollout_launcher_")
    demo = Demo(os.path.join(root, "demo"), log=lambda _: None)
    demo.claim_folder()
    demo.model()
    demo.tasks()
    out = {"problems": problems, "samples_per_prompt": samples, "max_new_tokens": max_new_tokens,
           "repeats": repeats, "static_commit": STATIC_COMMIT,
           "load_average_before": [round(x, 2) for x in os.getloadavg()]}
    # each side's source tree (its folder is the subprocess's working directory and only entry of PYTHONPATH, so
    # `jaxrl` is that tree's) and module
    trees = {"static": static_tree(root), "continuous": ROOT}
    modules = {"static": ["benchmarks.rollout_with_batching", "static"], "continuous": ["launchers.rollout"]}

    def launch(side: str, cache: str, tag: str) -> dict:
        path = os.path.join(root, f"{side}_{tag}.jsonl")
        for stale in (path, path + ".meta.json"):
            if os.path.exists(stale):
                os.remove(stale)
        cmd = [sys.executable, "-m", *modules[side], f"--problems={demo.p['eval']}",
               f"--model={demo.p['pretrained']}", f"--out={path}", f"--num_samples={samples}",
               f"--max_new_tokens={max_new_tokens}", "--max_prompt_len=64", "--dtype=float32", "--reward=charset",
               "--temperature=1.0", "--noprogress", f"--compilation_cache={cache}"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=trees[side],
                              env={**os.environ, "JAX_COMPILATION_CACHE_DIR": "", "PYTHONPATH": trees[side]})
        if done.returncode:
            raise RuntimeError(f"{side} launcher failed ({done.returncode}):\n{done.stderr[-3000:]}")
        meta = json.load(open(path + ".meta.json"))
        records = [json.loads(line) for line in open(path)]
        return {"samples_per_s": round(meta["samples_per_s"], 1), "seconds": meta["seconds"],
                "process_s": round(time.perf_counter() - t0, 2), "mean_length": round(
                    meta["generated_tokens"] / meta["samples_written"], 2),
                "tokens": [(r["completion"], r["finish_reason"]) for r in records]}

    sides = ("static", "continuous")
    out["in_process"] = _launcher_in_process(demo, samples, max_new_tokens, repeats, root)
    caches = {side: os.path.join(root, f"cache_{side}") for side in sides}
    runs = {f"{side}_{kind}": [] for side in sides for kind in ("cold", "warm")}
    for side in sides:  # fills each side's cache (not measured)
        launch(side, caches[side], "fill")
    for r in range(repeats):
        for side in sides:
            runs[f"{side}_cold"].append(launch(side, "none", f"cold{r}"))
            runs[f"{side}_warm"].append(launch(side, caches[side], f"warm{r}"))
    first = runs["static_cold"][0]["tokens"]
    out["samples_identical"] = all(run["tokens"] == first for entries in runs.values() for run in entries)
    out["mean_length"] = runs["static_cold"][0]["mean_length"]
    for key, entries in runs.items():
        out[key] = {"samples_per_s": [e["samples_per_s"] for e in entries],
                    "seconds": [e["seconds"] for e in entries], "process_s": [e["process_s"] for e in entries]}
    for kind in ("cold", "warm"):
        s, c = (statistics.median(out[f"{side}_{kind}"]["samples_per_s"]) for side in sides)
        out[f"ratio_{kind}"] = round(c / s, 3)
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return out


def _launcher_in_process(demo, samples: int, max_new_tokens: int, repeats: int, root: str) -> dict:
    """`run_rollouts` (what the launcher calls) in this process: STATIC_PACKAGE's with its jax backend's
    `batching="static"`, then this tree's `jaxrl.rollout.runner.run_rollouts` (the engine), each warmed up once:
    the sampling loop's own seconds without a process's start, tracing and program loading."""
    import functools

    from jaxrl.rollout import runner
    static = _module(static_package().__name__, "rollout.runner")
    runners = {"static": static, "continuous": runner}
    plain = static.JaxBackend
    seconds = {side: [] for side in runners}
    written = {}
    try:
        static.JaxBackend = functools.partial(plain, batching="static")
        for r in range(repeats + 1):
            for side, module in runners.items():
                path = os.path.join(root, f"in_process_{side}_{r}.jsonl")
                cfg = module.RolloutConfig(problems=os.fspath(demo.p["eval"]), model=os.fspath(demo.p["pretrained"]),
                                           out=path, num_samples=samples, max_new_tokens=max_new_tokens,
                                           max_prompt_len=64, dtype="float32", reward="charset", temperature=1.0,
                                           progress=False)
                meta = module.run_rollouts(cfg)
                written[side] = meta["samples_written"]
                if r:  # the first round compiles
                    seconds[side].append(meta["seconds"])
    finally:
        static.JaxBackend = plain
    out = {side: {"seconds": t, "samples_per_s_median": round(written[side] / statistics.median(t), 1)}
           for side, t in seconds.items()}
    out["ratio"] = round(statistics.median(seconds["static"]) / statistics.median(seconds["continuous"]), 3)
    return out


def run(workloads=WORKLOADS, prompts: int = 32, samples: int = 8, slots: int = 64, max_new_tokens: int = 256,
        truncation_prompts: int = 20, truncation_model: str = "small", repeats: int = 3, seed: int = 0,
        sections=("adapter", "gdn_state")) -> dict:
    """{workload: measurements, section: measurements}. skewed: `prompts` x `samples` rows; truncation:
    `truncation_prompts` x `samples` (20 x 8: the users' GRPO rollout) on `truncation_model`."""
    import jax
    out = {"jax": jax.__version__, "devices": str(jax.devices()[0]), "cores": len(os.sched_getaffinity(0))}
    for name in workloads:
        count = prompts if name == "skewed" else truncation_prompts
        model = "demo" if name == "skewed" else truncation_model
        out[name] = run_workload(name, count, samples, slots, max_new_tokens, repeats, seed, model)
    if "adapter" in sections:
        out["adapter"] = run_adapter(repeats=repeats, seed=seed)
    if "gdn_state" in sections:
        out["gdn_state"] = run_gdn_state(repeats=repeats, seed=seed)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--sections", default="adapter,gdn_state")
    parser.add_argument("--truncation_model", default="small", choices=sorted(MODELS))
    parser.add_argument("--launcher", action="store_true", help="only launchers.rollout, static (STATIC_COMMIT) vs "
                        "engine (run_launcher: 128 prompts x 32 samples, cap 512, the demo's random model)")
    args = parser.parse_args(argv)
    if args.launcher:
        result = run_launcher(repeats=args.repeats)
        print(json.dumps(result, indent=1))
        return result
    sizes = dict(prompts=16, truncation_prompts=10, slots=32, max_new_tokens=128) if args.quick else {}
    result = run(workloads=tuple(w for w in args.workloads.split(",") if w), repeats=args.repeats,
                 truncation_model=args.truncation_model,
                 sections=tuple(x for x in args.sections.split(",") if x), **sizes)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
