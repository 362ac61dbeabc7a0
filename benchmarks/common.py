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


class EngineBatch:
    """One full batch of equal-length prompts through the generation engine's own programs
    (jaxrl/generation/programs.py), timed in the two parts a decode benchmark separates:

        batch = EngineBatch(model, prompts, new_tokens)         # prompts [B, P]; the weights' decode copies made
        state = batch.prefill()     # the slots' caches, every prompt prefilled, each row's first token sampled from
                                    # its prompt's last logits and moved into its slot (init_state, prefill, insert)
        state, steps = batch.decode(state)   # one round of decode steps until every row reaches the cap (no stop
                                             # ids): new_tokens - 1 steps
        batch.tokens(state)         # [B, new_tokens] generated ids

    The same programs and arguments the engine (jaxrl/generation/engine.py) runs for a pool of B slots whose rows
    all move in with one insert; `prefill` and `decode` block until their results are ready."""

    def __init__(self, model, prompts, new_tokens: int, temperature: float = 0.0, seed: int = 0, mesh=None):
        import numpy as np

        from jaxrl.generation import programs
        from jaxrl.generation.engine import STOP_WIDTH
        from jaxrl.generation.placement import Weights
        from jaxrl.generation.sampling import sampling_mode

        self.programs, self.mesh = programs, mesh
        self.weights = Weights.of(model, None, mesh)
        self.decode_weights = programs.prepare(self.weights.structure, self.weights.leaves, fuse_adapters=True)
        self.ids = np.asarray(prompts, np.int32)
        self.mask = np.ones_like(self.ids)
        self.rows, self.prompt_len = self.ids.shape
        self.new_tokens = int(new_tokens)
        self.mode = sampling_mode(float(temperature), 1.0, 0, int(model.config.vocab_size))
        pad = model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        rows = np.arange(self.rows, dtype=np.int32)
        # the insert's operands: row r takes prompt r into slot r, keyed (seed, group r, sample 0), capped at
        # new_tokens, no stop ids (-1); greedy rows carry temperature 1 as the engine's do (unused)
        self.insert_args = (rows, rows, np.full(self.rows, seed, np.uint32), rows.astype(np.uint32),
                            np.zeros(self.rows, np.uint32), np.full(self.rows, self.new_tokens, np.int32),
                            np.full(self.rows, temperature if temperature > 0 else 1.0, np.float32),
                            np.ones(self.rows, np.float32), np.full((self.rows, STOP_WIDTH), -1, np.int32))
        self.stop_width = STOP_WIDTH

    def prefill(self):
        import jax

        p, w = self.programs, self.weights
        state = p.init_state(w.structure, w.leaves, slots=self.rows, cache_len=self.prompt_len + self.new_tokens,
                             max_new_tokens=self.new_tokens, stop_width=self.stop_width, pad_id=self.pad_id,
                             mesh=self.mesh)
        fresh, logits = p.prefill(w.structure, w.leaves, self.ids, self.mask, mesh=self.mesh)
        state = p.insert(state, fresh, logits, *self.insert_args, mode=self.mode, pad_id=self.pad_id, mesh=self.mesh)
        return jax.block_until_ready(state)

    def decode(self, state):
        """(the state after the round, the decode steps it made)."""
        import numpy as np

        w = self.weights
        state, status, _ = self.programs.decode_round(
            w.structure, w.leaves, self.decode_weights, state, np.ones((self.rows,), bool), np.int32(self.new_tokens),
            np.int32(self.rows + 1),
            mode=self.mode, pad_id=self.pad_id, mesh=self.mesh)
        status = np.asarray(status)  # waits for the round
        return state, int(status[3, 0])

    def tokens(self, state):
        import numpy as np
        return np.asarray(state.tokens)


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
