"""Decode throughput of the generation engine against transformers `generate`, same config, batch and lengths.

    python -m benchmarks.bench_decode [--batch 8 --prompt_len 64 --new_tokens 128]

Both sides: the same random weights (transformers builds them, the JAX model loads the saved folder), fp32,
greedy, no EOS (every row runs to the cap), torch given the same threads as XLA, one process. Two configs:

  * "small": benchmarks/common.py's SMALL_TEXT_CONFIG (hidden 256, 4 layers, vocab 2048; 16 MB of fp32 weights).
    On two CPU cores a decode step of either implementation is bound by reading those weights, so this
    measures kernel speed more than engine design;
  * "tiny": the tests' tiny shape (hidden 64, vocab 256): per-step overhead dominates, which is where a
    compiled decode loop (no Python per token) differs most from an eager one.

Decode time is measured between the same two points on both sides: from the first generated token (which comes
out of prefill) to the last, i.e. N - 1 decode steps: the engine's decode round alone (jaxrl/generation/programs.py
`decode_round`, after its prefill and insert: `benchmarks.common.EngineBatch`), and transformers' `generate` timed
by a streamer that records when each token arrives. Decode tokens/s = batch * (N - 1) / that time; repeats are
interleaved so load bursts on the shared machine hit both sides. The end-to-end ratio (prefill included: a
`jaxrl.generation.Sampler` call against `generate`) is reported too, and the greedy tokens of both sides are
compared (they must agree: a fast wrong sampler is not a result).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from benchmarks.common import SMALL_TEXT_CONFIG, set_cpu_threads, time_it

CONFIGS = {
    "small": SMALL_TEXT_CONFIG,
    "tiny": dict(SMALL_TEXT_CONFIG, vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16,
                 linear_key_head_dim=16, linear_value_head_dim=16,
                 rope_parameters=dict(SMALL_TEXT_CONFIG["rope_parameters"], mrope_section=[1, 1, 0])),
}


def _save_hf(folder: str, config: dict, seed: int = 0):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config)).eval()
    model.save_pretrained(folder)
    return model


def run(batch: int = 8, prompt_len: int = 64, new_tokens: int = 128, repeats: int = 3,
        configs=("tiny", "small")) -> dict:
    """{config name: measurements} for each config, in one process."""
    return {name: run_config(name, batch, prompt_len, new_tokens, repeats) for name in configs}


def run_config(name: str, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    from benchmarks.common import EngineBatch
    from jaxrl.generation import Sampler
    from jaxrl.models import qwen35

    threads = set_cpu_threads()
    config = CONFIGS[name]
    with tempfile.TemporaryDirectory() as folder:
        hf = _save_hf(folder, config)
        model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    vocab = config["vocab_size"]
    prompts = np.random.default_rng(0).integers(2, vocab, size=(batch, prompt_len))

    sampler = Sampler(model, max_new_tokens=new_tokens, prompt_buckets=(prompt_len,), batch_size=batch)
    engine = EngineBatch(model, prompts, new_tokens)  # greedy, every row to the cap

    def ours_decode() -> float:
        """The decode round alone: first token (sampled by the insert from the prefill logits) to the last."""
        state = engine.prefill()
        start = time.perf_counter()
        engine.decode(state)
        return time.perf_counter() - start

    ids_t = torch.as_tensor(prompts)
    mask_t = torch.ones_like(ids_t)

    def theirs(streamer=None):
        with torch.inference_mode():
            return hf.generate(ids_t, attention_mask=mask_t, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0, streamer=streamer)

    def theirs_decode() -> float:
        """transformers between the same two points: its streamer sees the prompt, then each new token."""
        clock = _Clock()
        theirs(clock)
        return clock.times[-2] - clock.times[1]  # first generated token -> last generated token

    ours_decode(), theirs_decode()  # warm-up (compilation, allocator)
    # Interleaved repeats, so a burst of load on the shared machine hits both sides alike.
    jax_times, hf_times = [], []
    for _ in range(repeats):
        jax_times.append(ours_decode())
        hf_times.append(theirs_decode())
    jax_decode_s, hf_decode_s = float(np.median(jax_times)), float(np.median(hf_times))
    ours_e2e = time_it(lambda: sampler.sample(prompts.tolist(), temperature=0.0), repeats=repeats)["median_s"]
    hf_e2e = time_it(theirs, repeats=repeats)["median_s"]

    ours_tokens = sampler.sample(prompts.tolist(), temperature=0.0).tokens
    hf_tokens = theirs()[:, prompt_len:].tolist()
    match = float(np.mean([a == b for a, b in zip(ours_tokens, hf_tokens)]))
    decode_tokens = batch * (new_tokens - 1)  # steps after the first token, on both sides
    return {
        "config": name, "hidden_size": config["hidden_size"], "vocab_size": vocab, "batch": batch,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "threads": threads, "dtype": "float32",
        "device": jax.devices()[0].platform,
        # Two shared cores: other processes slow torch's spinning thread pool far more than XLA's, so the
        # machine's load is part of the result.
        "load_average_1min": os.getloadavg()[0],
        "jaxrl_decode_tokens_per_s": decode_tokens / jax_decode_s,
        "hf_decode_tokens_per_s": decode_tokens / hf_decode_s,
        "decode_ratio": hf_decode_s / jax_decode_s,
        "jaxrl_end_to_end_s": ours_e2e, "hf_end_to_end_s": hf_e2e, "end_to_end_ratio": hf_e2e / ours_e2e,
        "greedy_rows_equal_to_hf": match,
    }


class _Clock:
    """A transformers streamer that only records when each put() happens (prompt first, then each token)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        self.times.append(time.perf_counter())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default="tiny,small", help="comma list of: " + ", ".join(CONFIGS))
    args = parser.parse_args()
    result = run(args.batch, args.prompt_len, args.new_tokens, args.repeats, tuple(args.configs.split(",")))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
