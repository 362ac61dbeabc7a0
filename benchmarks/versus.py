"""jaxrl against an earlier jaxrl, interleaved in one process: forward, LoRA train step, decode (CPU ratios that
survive a shared machine, since both sides see the same load at the same moments).

    python -m benchmarks.versus --base=bd07f80                  # the working tree vs commit bd07f80
    python -m benchmarks.versus --base=main --only=forward,decode --repeats=7
    python -m benchmarks.versus --base=bd07f80 --quick         # small sizes: a check that it runs

The base revision's `jaxrl/` is extracted with `git archive` into a temporary folder and imported under another
name (`jaxrl_base`, its imports rewritten), so both versions live in one interpreter. Both build the same
checkpoint (benchmarks/common.py:SMALL_TEXT_CONFIG, hidden 256, 4 layers, vocab 2048, fp32) and run the same
inputs; each repeat runs the base, then the working tree, and the ratio is base time / new time of the medians
(> 1: the working tree is faster). Decode is a greedy `sample` call of each tree's own sampler, whichever layout
the tree has (`sampler_class`: jaxrl/generation's engine from c7219bb on, the jaxrl/rollout samplers before it).
Prints JSON.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import SMALL_TEXT_CONFIG, save_small_hf, set_cpu_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_NAME = "jaxrl_base"


def extract_tree(revision: str, folder: str, paths=("jaxrl",)) -> None:
    """`paths` (folders or files of the repository) at `revision` -> folder, as they are (`git archive`)."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", revision, *paths], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)


def rename_imports(text: str, name: str) -> str:
    """Python source with every `jaxrl` module name (`jaxrl.models`, `import jaxrl`) replaced by `name`."""
    return re.sub(r"\bjaxrl(?=[. ]|$)", name, text, flags=re.M)


def extract_base(revision: str, folder: str, name: str = BASE_NAME) -> None:
    """`jaxrl/` at `revision` -> folder/<name>, every `jaxrl` import renamed."""
    extract_tree(revision, folder)
    os.rename(os.path.join(folder, "jaxrl"), os.path.join(folder, name))
    for dirpath, _, files in os.walk(os.path.join(folder, name)):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(dirpath, file)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(rename_imports(text, name))


_IMPORTED: dict = {}  # package name -> the revision it was extracted from (one per name and process)


def import_revision(revision: str, name: str):
    """`jaxrl/` at `revision` imported as the package `name` next to this tree's jaxrl (`extract_base` into a
    temporary folder removed when the process exits); a second call with the same name returns the same package.
    What another benchmark uses to run code that left the tree (benchmarks/bench_rollout_engine.py's static
    sampler, benchmarks/bench_server.py's older servers)."""
    if name in _IMPORTED:
        if _IMPORTED[name] != revision:
            raise ValueError(f"{name} is already jaxrl at {_IMPORTED[name]}, not {revision}")
        return importlib.import_module(name)
    folder = tempfile.mkdtemp(prefix=f"{name}_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    extract_base(revision, folder, name)
    sys.path.insert(0, folder)
    _IMPORTED[name] = revision
    return importlib.import_module(name)


# Where a jaxrl tree's sampler lives, newest layout first: the generation engine (jaxrl/generation, c7219bb on),
# the rollout engine before it, and the static sampler before that. The first that imports is the tree's sampler.
SAMPLERS = ("generation.sampler.Sampler", "rollout.engine.ContinuousSampler", "rollout.sampler.Sampler")


def sampler_class(pkg) -> tuple[type, str]:
    """(the sampler class a jaxrl tree samples with, its path under the package), whichever layout the tree has:
    each takes (model, max_new_tokens=, prompt_buckets=, batch_size=) and has `sample(prompts, temperature=...)`."""
    for path in SAMPLERS:
        module, _, cls = path.rpartition(".")
        try:
            found = importlib.import_module(f"{pkg.__name__}.{module}")
        except ModuleNotFoundError as e:  # this layout's module is not in the tree (a missing dependency is raised)
            if e.name and e.name.split(".")[0] == pkg.__name__:
                continue
            raise
        return getattr(found, cls), path
    raise ImportError(f"{pkg.__name__} has none of the samplers {SAMPLERS}")


def _median_ms(times):
    return 1e3 * float(np.median(times))


def _interleave(fns: dict, repeats: int) -> dict:
    for fn in fns.values():  # compile / warm up
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    out = {f"{name}_ms": _median_ms(t) for name, t in times.items()}
    out["ratio"] = float(np.median(times["base"]) / np.median(times["new"]))
    return out


def bench_forward(pkgs: dict, folder: str, batch: int, seq_len: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    ids = jnp.asarray(np.random.default_rng(0).integers(2, SMALL_TEXT_CONFIG["vocab_size"], size=(batch, seq_len)))
    fns = {}
    for name, pkg in pkgs.items():
        model = pkg.models.qwen35.from_pretrained(folder, dtype=jnp.float32)
        graphdef, state = nnx.split(model)
        fn = jax.jit(lambda state, ids, g=graphdef: nnx.merge(g, state)(ids))
        fns[name] = lambda fn=fn, state=state: fn(state, ids).block_until_ready()
    return dict(_interleave(fns, repeats), batch=batch, seq_len=seq_len)


def bench_train_step(pkgs: dict, folder: str, batch: int, seq_len: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import ml_collections

    ids = np.random.default_rng(0).integers(2, SMALL_TEXT_CONFIG["vocab_size"], size=(batch, seq_len)).astype(np.int32)
    fns = {}
    for name, pkg in pkgs.items():
        sub = lambda mod: importlib.import_module(f"{pkg.__name__}.{mod}")  # noqa: E731
        lora, step_mod, state_mod = sub("models.lora"), sub("train.step"), sub("train.state")
        model = pkg.models.qwen35.from_pretrained(folder, dtype=jnp.float32)
        lora.apply_lora(model, "all-linear", rank=16, alpha=32.0)
        graphdef, trainable, frozen = lora.split_lora(model)
        codec = state_mod.ParamCodec(trainable)
        optim = sub("train.optim")
        values = dict(learning_rate=1e-4, schedule="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0)
        # a tree from before the typed configs takes the optimizer block as a ConfigDict
        opt = optim.OptimizerConfig(**values) if hasattr(optim, "OptimizerConfig") else ml_collections.ConfigDict(
            values)
        tx, schedule = optim.make_optimizer(opt, total_steps=1000)
        mesh = sub("parallel.mesh").make_mesh((1, 1, 1), jax.devices()[:1])
        step_fn = step_mod.make_train_step(sub("train.objective").NextToken(chunk_size=512), tx, schedule,
                                           graphdef, codec)
        box = {"state": state_mod.create_train_state(codec.to_flat(trainable), tx, seed=0, mesh=mesh)}
        split = step_mod.put_batch(step_mod.split_batch({"input_ids": ids, "attention_mask": np.ones_like(ids)}, 1),
                                   mesh)
        compiled = step_mod.jit_train_step(step_fn, mesh, box["state"], frozen, split)

        def run(box=box, compiled=compiled, frozen=frozen, split=split):
            box["state"], _ = compiled(box["state"], frozen, split)
            jax.block_until_ready(box["state"].params)

        fns[name] = run
    return dict(_interleave(fns, repeats), batch=batch, seq_len=seq_len)


def bench_decode(pkgs: dict, folder: str, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """Greedy `sample` of `batch` prompts to the cap (no EOS: every row runs `new_tokens`), prefill and decode,
    through each tree's own sampler (`sampler_class`: the engine's Sampler in the new layout, the static or the
    rollout-engine sampler in an older one)."""
    import jax.numpy as jnp

    prompts = np.random.default_rng(0).integers(2, SMALL_TEXT_CONFIG["vocab_size"], size=(batch, prompt_len)).tolist()
    fns, tokens, which = {}, {}, {}
    for name, pkg in pkgs.items():
        cls, which[name] = sampler_class(pkg)
        model = pkg.models.qwen35.from_pretrained(folder, dtype=jnp.float32)
        sampler = cls(model, max_new_tokens=new_tokens, prompt_buckets=(prompt_len,), batch_size=batch)
        box = tokens[name] = {}

        def run(s=sampler, box=box):
            box["tokens"] = s.sample(prompts, temperature=0.0).tokens  # host lists: every row is done

        fns[name] = run
    result = _interleave(fns, repeats)  # whole calls: prefill + decode + the host's part
    result.update(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, samplers=which,
                  greedy_tokens_equal=tokens["base"]["tokens"] == tokens["new"]["tokens"])
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare against (commit, branch, tag)")
    ap.add_argument("--only", default="forward,train_step,decode")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seq_len", type=int, default=1024, help="forward sequence length (B=4)")
    ap.add_argument("--quick", action="store_true", help="small sizes, 2 repeats: a check that it runs")
    args = ap.parse_args(argv)
    train_len, new_tokens = 256, 128
    if args.quick:
        args.seq_len, args.repeats, train_len, new_tokens = 128, 2, 64, 16
    threads = set_cpu_threads()
    with tempfile.TemporaryDirectory() as tmp:
        extract_base(args.base, tmp)
        sys.path.insert(0, tmp)
        pkgs = {"base": importlib.import_module(f"{BASE_NAME}.models.qwen35"),
                "new": importlib.import_module("jaxrl.models.qwen35")}
        pkgs = {name: importlib.import_module(mod.__name__.split(".")[0]) for name, mod in pkgs.items()}
        folder = os.path.join(tmp, "small")
        save_small_hf(folder)
        result = {"base": args.base, "threads": threads, "load_before": os.getloadavg()[0]}
        for name in args.only.split(","):
            if name == "forward":
                result["forward"] = bench_forward(pkgs, folder, 4, args.seq_len, args.repeats)
            elif name == "train_step":
                result["train_step"] = bench_train_step(pkgs, folder, 4, train_len, args.repeats)
            elif name == "decode":
                result["decode"] = bench_decode(pkgs, folder, 8, 64, new_tokens, args.repeats)
            else:
                ap.error(f"--only: unknown {name!r}")
            print(f"[versus] {name}: {json.dumps(result[name])}", file=sys.stderr, flush=True)
        result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
