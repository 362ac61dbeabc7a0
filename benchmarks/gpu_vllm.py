"""vLLM 0.33 LoRA against the jax backend on one GPU: greedy token agreement of a PEFT export served as LoRA, whether
the LoRA changes vLLM's outputs at all (vllm#49354), and rollout throughput (K samples per prompt, long caps) of
vLLM vs the JAX sampler. Prints one JSON object and a markdown row for benchmarks/RESULTS.md.

    # H200, the official 4B checkpoint, vLLM in its own venv (docs/guides/vllm.md)
    python -m benchmarks.gpu_vllm --base=/models/Qwen3.5-4B --vllm_python=~/.venvs/vllm --out=/tmp/gpu_vllm
    # CPU dry run of the same code: a tiny random model, jaxrl's launchers.serve standing in for vLLM
    python -m benchmarks.gpu_vllm --tiny --out=/tmp/gpu_vllm_tiny

The adapter is random (all 12 projection kinds, rank 16) with every module's update set to --update_rel of its
weight's norm, so its effect on greedy completions is clear; it is exported as a PEFT folder and served unmerged
by both sides (the jax backend attaches it, vLLM loads it through /v1/load_lora_adapter). Agreement: per greedy
completion, the share of positions up to the first differing token (over the shorter length), and the share of
completions identical token for token. bf16 kernels differ between the two, so agreement below 1 is expected once
two logits tie closely; a LoRA that vLLM ignored shows as vLLM's adapter completions equal to its base ones.
Throughput: one timed call each after a warm-up call of one full batch (the JAX sampler compiles per shape; a
smaller tail batch may still compile inside the timed call: seconds against minutes). Both engines share the GPU:
JAX gets XLA_PYTHON_CLIENT_MEM_FRACTION (default here 0.45), vLLM --gpu_memory_utilization (0.45).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _log(message: str) -> None:
    print(f"[gpu_vllm {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def tiny_base(folder: str) -> str:
    """A tiny random Qwen3.5 container with a tokenizer (CPU dry runs)."""
    import jax.numpy as jnp

    from jaxrl.models import qwen35
    from jaxrl.models.qwen35.config import tiny
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
    if not os.path.isfile(os.path.join(folder, "config.json")):
        cfg = tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
        from flax import nnx

        from jaxrl.models.qwen35.model import Qwen35
        model = Qwen35(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
        qwen35.save_pretrained(model, folder, base_dir=None, layout="container")
        build_tiny_tokenizer(folder, [p["messages"][0]["content"] for p in problems(None, 8)])
    return folder


def problems(path, n):
    path = path or os.path.join(ROOT, "jaxrl", "assets", "tasks", "problems.jsonl")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [dict(rows[i % len(rows)], id=f"{rows[i % len(rows)]['id']}#{i}") for i in range(n)]


def random_adapter(base: str, update_rel: float, rank: int = 16, seed: int = 0):
    import jax.numpy as jnp

    from jaxrl.models.adapters import Adapter
    from jaxrl.models import qwen35
    from jaxrl.models.lora import linears
    model = qwen35.from_pretrained(base, dtype=jnp.float32)
    rng = np.random.default_rng(seed)
    params = {}
    for path, lin in linears(model):
        if path == "lm_head":
            continue
        a = rng.standard_normal((rank, lin.in_features)).astype(np.float32)
        b = rng.standard_normal((lin.out_features, rank)).astype(np.float32)
        w = np.linalg.norm(np.asarray(lin.weight[...], np.float64))
        d = np.linalg.norm((2.0 * (b @ a)).astype(np.float64))  # scale alpha/r = 2
        params[path + ".lora.lora_A"], params[path + ".lora.lora_B"] = a, (b * (update_rel * w / d)).astype(
            np.float32)
    return Adapter(params=params, rank=rank, alpha=2.0 * rank, source=f"random, update {update_rel} of |W|")


def agreement(a, b) -> dict:
    """Greedy completions of two backends, row for row."""
    shares, exact = [], 0
    for x, y in zip(a, b):
        n = min(len(x.tokens), len(y.tokens))
        first = next((i for i in range(n) if x.tokens[i] != y.tokens[i]), n)
        shares.append(first / n if n else 1.0)
        exact += x.tokens == y.tokens
    return {"prefix_agreement": float(np.mean(shares)), "identical": exact / len(a), "n": len(a)}


def run(args) -> dict:
    from jaxrl.models.peft import export_peft
    from jaxrl.models.qwen35.config import load_hf_config
    from jaxrl.backends import JaxBackend, ModelSpec, SamplingParams
    from jaxrl.backends.settings import BackendContext, ServerRollout, VLLMLaunchOptions, VLLMRollout
    from jaxrl.data.chat import chat_stop_ids, encode_prompts, load_tokenizer
    from jaxrl.rollout.keys import problem_key

    os.makedirs(args.out, exist_ok=True)
    base = tiny_base(os.path.join(args.out, "tiny_base")) if args.tiny else os.path.abspath(args.base)
    tok = load_tokenizer(base)
    stop_ids = chat_stop_ids(tok, load_hf_config(base)[0].eos_token_id)
    adapter = random_adapter(base, args.update_rel)
    peft_dir = os.path.join(args.out, "peft")
    export_peft(adapter, peft_dir, base, overwrite=True)
    probs = problems(args.problems, max(args.num_prompts, args.throughput_prompts))
    enc = encode_prompts(tok, [p["messages"] for p in probs], False, args.max_prompt_len, on_overlong="skip")
    prompts, groups = enc.ids, [problem_key(probs[i]["id"]) for i in enc.kept]
    cap = max(args.greedy_tokens, args.max_new_tokens)

    server_proc = None
    if args.tiny:  # jaxrl's own server stands in for vLLM
        ready = os.path.join(args.out, "ready")
        if os.path.exists(ready):
            os.remove(ready)
        server_proc = subprocess.Popen([sys.executable, "-m", "launchers.serve", f"--base={base}", "--port=0",
                                        f"--ready_file={ready}", f"--max_prompt_len={args.max_prompt_len}",
                                        f"--batch_size={args.batch_size}",
                                        f"--allowed_lora_roots={os.path.abspath(args.out)}"], cwd=ROOT)
        while not os.path.exists(ready):
            if server_proc.poll() is not None:
                raise RuntimeError("launchers.serve exited")
            time.sleep(0.5)
    context = BackendContext(base, stop_ids=tuple(stop_ids), max_prompt_len=args.max_prompt_len, max_new_tokens=cap,
                             seed=0, out_dir=args.out)
    if args.tiny:
        server = ServerRollout((open(ready).read().strip(),)).build(context)
    else:
        server = VLLMRollout(launch=VLLMLaunchOptions(
            python=args.vllm_python or "", gpu_memory_utilization=args.gpu_memory_utilization)).build(context)
    jax_backend = JaxBackend(base, dtype="bfloat16", batch_size=args.batch_size, max_prompt_len=args.max_prompt_len,
                             stop_ids=stop_ids, pad_id=tok.pad_token_id)
    out = {"base": base, "device": _device(), "update_rel": args.update_rel, "adapter_modules": len(adapter.modules),
           "server": None}
    try:
        greedy = SamplingParams(n=1, max_new_tokens=args.greedy_tokens, temperature=0.0)
        p, g = prompts[:args.num_prompts], groups[:args.num_prompts]
        gens = {}
        for name, spec, ad in (("base", ModelSpec("base", "base"), None),
                               ("lora", ModelSpec("lora", "adapter", peft_dir), adapter)):
            for side, backend in (("jax", jax_backend), ("server", server)):
                t0 = time.perf_counter()
                backend.load(spec, ad)
                if side == "server":
                    assert backend.loaded_digest() == (ad.digest() if ad is not None else None)
                gens[(side, name)] = backend.generate(p, g, greedy)
                _log(f"greedy {side}/{name}: {time.perf_counter() - t0:.1f} s")
        out["server"] = server.description
        out["greedy"] = {"tokens": args.greedy_tokens, "prompts": len(p),
                         "base": agreement(gens[("jax", "base")], gens[("server", "base")]),
                         "lora": agreement(gens[("jax", "lora")], gens[("server", "lora")]),
                         "lora_vs_base_server": agreement(gens[("server", "lora")], gens[("server", "base")]),
                         "lora_vs_base_jax": agreement(gens[("jax", "lora")], gens[("jax", "base")])}

        sampling = SamplingParams(n=args.num_samples, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
        tp, tg = prompts[:args.throughput_prompts], groups[:args.throughput_prompts]
        throughput = {}
        for side, backend in (("jax", jax_backend), ("server", server)):
            k = max(1, args.batch_size // args.num_samples)  # one full batch: compiles the main shapes
            backend.generate(tp[:k], tg[:k], sampling)
            t0 = time.perf_counter()
            rows = backend.generate(tp, tg, sampling)
            seconds = time.perf_counter() - t0
            tokens = sum(len(r.tokens) for r in rows)
            throughput[side] = {"seconds": seconds, "samples": len(rows), "generated_tokens": tokens,
                                "tokens_per_s": tokens / seconds,
                                "truncated": sum(r.finish_reason == "length" for r in rows) / len(rows)}
            _log(f"throughput {side}: {tokens} tokens in {seconds:.1f} s")
        throughput["server_over_jax"] = throughput["server"]["tokens_per_s"] / throughput["jax"]["tokens_per_s"]
        out["throughput"] = {"prompts": len(tp), "num_samples": args.num_samples,
                             "max_new_tokens": args.max_new_tokens, **throughput}
    finally:
        server.close()
        jax_backend.close()
        if server_proc is not None:
            server_proc.terminate()
            server_proc.wait(timeout=60)
    gr, th = out["greedy"], out["throughput"]
    out["results_md_row"] = (
        f"| vLLM LoRA vs jax ({out['server']}, {out['device']}) | greedy {gr['tokens']} tok x {gr['prompts']}: "
        f"prefix agreement base {gr['base']['prefix_agreement']:.3f} / LoRA {gr['lora']['prefix_agreement']:.3f}; "
        f"LoRA changes {1 - gr['lora_vs_base_server']['identical']:.0%} of vLLM's completions | rollouts "
        f"{th['prompts']}x{th['num_samples']} at {th['max_new_tokens']} tok: vLLM "
        f"{th['server']['tokens_per_s']:.0f} tok/s vs jax {th['jax']['tokens_per_s']:.0f} tok/s "
        f"({th['server_over_jax']:.2f}x) |")
    return out


def _device() -> str:
    import jax
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="HF folder of the base (the official Qwen3.5-4B on a GPU)")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny random model, launchers.serve as server")
    ap.add_argument("--vllm_python", default=None, help="the vLLM environment (docs/guides/vllm.md)")
    ap.add_argument("--problems", default=None, help="problems.jsonl (default: jaxrl's toy tasks, repeated)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--update_rel", type=float, default=1e-2, help="||s*B*A|| / ||W|| of every adapted module")
    ap.add_argument("--num_prompts", type=int, default=64, help="greedy prompts")
    ap.add_argument("--greedy_tokens", type=int, default=256)
    ap.add_argument("--throughput_prompts", type=int, default=128)
    ap.add_argument("--num_samples", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=4096)
    ap.add_argument("--max_prompt_len", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=256, help="jax sampler rows per compiled call")
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.45,
                    help="vLLM's share of the GPU (the JAX backend shares it; set XLA_PYTHON_CLIENT_MEM_FRACTION "
                         "to the rest)")
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # before jax starts: leave vLLM its share
    if args.tiny:
        args.num_prompts, args.greedy_tokens = min(args.num_prompts, 4), min(args.greedy_tokens, 16)
        args.throughput_prompts, args.max_new_tokens, args.batch_size = (min(args.throughput_prompts, 4),
                                                                         min(args.max_new_tokens, 16), 8)
        args.max_prompt_len = 192
    elif not args.base:
        ap.error("--base is required (or --tiny)")
    print(json.dumps(run(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
