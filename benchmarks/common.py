"""Shared helpers for the side-by-side benchmarks: timing, a small Qwen3.5 config both sides build, and tables."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

# A "small" Qwen3.5 shape: big enough that matmuls dominate Python overhead on two CPU cores, small enough that
# every benchmark finishes in seconds. Both jaxrl and transformers build exactly this config.
SMALL_TEXT_CONFIG = dict(
    vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=2, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    pad_token_id=0, eos_token_id=1)


def set_cpu_threads(n: int | None = None) -> int:
    """Give torch the same cores XLA uses, so a ratio compares implementations, not thread counts."""
    n = n or os.cpu_count() or 1
    try:
        import torch
        torch.set_num_threads(n)
    except ImportError:
        pass
    return n


def time_it(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> dict:
    """Median and best wall time of `fn()` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "best_s": min(times), "repeats": repeats}


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1) -> dict[str, dict]:
    """`time_it` for several sides at once, their repeats alternating (A B A B ...), so a load burst on a shared
    machine lands on both sides rather than on whichever ran during it. Per side: median, best and every time."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: {"median_s": statistics.median(t), "best_s": min(t), "repeats": repeats, "times_s": t}
            for name, t in times.items()}


def build_small_hf(seed: int = 0):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SMALL_TEXT_CONFIG)).eval()


def save_small_hf(folder: str, seed: int = 0):
    model = build_small_hf(seed)
    model.save_pretrained(folder)
    return model


def table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line([_fmt(r.get(c)) for c in columns]) for r in rows]
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "" if v is None else str(v)
