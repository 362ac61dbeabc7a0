"""Checkpoint drift: how far each checkpoint has moved from the base, in behaviour (KL) and in weights.

For every checkpoint step:

* ``kl_to_base``: mean per-token KL(policy || base) over a fixed set of token sequences (prompts + fixed
  continuations), at the continuation positions: ``sum_v p(v) (log p(v) - log q(v))`` with p the checkpoint's
  next-token distribution and q the base's, averaged over all continuation tokens (``n_tokens`` says how many);
* ``update_norm``: ``||scale * B @ A||_F`` of every LoRA module, rolled up per layer, per module kind
  (``self_attn.q_proj`` over all layers) and in total (root of the sum of squares).

The core, :func:`checkpoint_drift`, works over callables so it needs no trainer and no model::

    checkpoint_drift(steps, logprobs_fn, adapters)
      logprobs_fn(step | None) -> iterable of arrays [T_i, V]: log-probabilities of the next token at each of
                                   sequence i's continuation positions (None = the base model), same sequences
                                   and lengths for every step
      adapters: {step: {module: (A [r, in], B [out, r], scale)}} or a callable step -> that dict

:class:`ModelLogprobs` is a model-backed ``logprobs_fn``: an HF Qwen3.5 folder loaded with
``jaxrl.models.qwen35.from_pretrained``, each checkpoint applied by merging ``W + scale * B @ A`` into the
weights it touches (the base arrays are kept and put back, so no rounding accumulates), and
:func:`model_checkpoint_drift` puts the two together. Adapters in PEFT layout (``load_peft_adapter``): keys
``base_model.model.model.language_model.layers.N.<module>.lora_A.weight`` [r, in] / ``...lora_B.weight``
[out, r] (the text-only ``base_model.model.model.layers.N...`` too), scale = ``lora_alpha / r`` (or
``/ sqrt(r)`` with ``use_rslora``) from ``adapter_config.json``. Module names are ``layers.N.<module>``, the
model's own parameter paths.

Output (``drift.json``)::

    {"steps": [int, ...], "n_sequences", "n_tokens",
     "per_step": [{"step", "kl_to_base", "n_tokens", "n_sequences", "kl_max_token",
                   "kl_per_sequence": [mean KL of each sequence], "kl_sequence_std",
                   "update_norm": {"total", "modules": {name: norm}, "layers": {"layers.N": norm},
                                   "kinds": {kind: norm}} | null}, ...]}
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from jaxrl.data.chat import chat_stop_ids, encode_prompts, load_tokenizer
from jaxrl.data.problems import load_problems
from jaxrl.diagnostics.flags import DRIFT_MAX_NEW_TOKENS, DiagnoseSettings
from jaxrl.models import qwen35
from jaxrl.generation import generate

__all__ = ["Adapter", "lora_delta_norm", "update_norms", "token_kl", "checkpoint_drift", "parse_peft_tensors",
           "load_peft_adapter", "find_peft_checkpoints", "ModelLogprobs", "model_checkpoint_drift",
           "fixed_sequences"]

Adapter = Mapping[str, tuple]  # module name -> (A [r, in], B [out, r], scale)
AdapterSource = Union[Mapping[int, Adapter], Callable[[int], Adapter]]
LogprobsFn = Callable[[Optional[int]], Iterable[Any]]

_LAYER = re.compile(r"^(layers\.\d+)\.(.+)$")


# ------------------------------------------------------------------------------------------ update norms


def lora_delta_norm(A, B, scale: float) -> float:
    """``||scale * B @ A||_F`` without forming the [out, in] product: ``|scale| * sqrt(<B^T B, A A^T>)``."""
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    if A.ndim != 2 or B.ndim != 2 or B.shape[1] != A.shape[0]:
        raise ValueError(f"LoRA factors must be A [r, in] and B [out, r]; got A {A.shape}, B {B.shape}")
    sq = float(np.sum((B.T @ B) * (A @ A.T)))
    return abs(float(scale)) * math.sqrt(max(sq, 0.0))


def _rollup(norms: Mapping[str, float], key: Callable[[str], str]) -> dict[str, float]:
    sq: dict[str, float] = {}
    for name, v in norms.items():
        sq[key(name)] = sq.get(key(name), 0.0) + v * v
    return {k: math.sqrt(v) for k, v in sq.items()}


def update_norms(adapter: Adapter) -> dict:
    """Per-module update norms and their roll-ups: ``{"total", "modules", "layers", "kinds"}``."""
    modules = {}
    for name, factors in adapter.items():
        try:
            A, B, scale = factors
        except (TypeError, ValueError):
            raise ValueError(f"adapter module {name!r}: expected (A, B, scale), got {type(factors).__name__}") \
                from None
        try:
            modules[name] = lora_delta_norm(A, B, scale)
        except ValueError as e:
            raise ValueError(f"adapter module {name!r}: {e}") from None

    def layer(n):
        m = _LAYER.match(n)
        return m.group(1) if m else n

    def kind(n):
        m = _LAYER.match(n)
        return m.group(2) if m else n

    return {"total": math.sqrt(sum(v * v for v in modules.values())), "modules": modules,
            "layers": _rollup(modules, layer), "kinds": _rollup(modules, kind)}


# -------------------------------------------------------------------------------------------------- KL


def token_kl(policy_logp, base_logp) -> np.ndarray:
    """Per-position KL(policy || base) from log-probabilities ``[T, V]`` (renormalised, so logits work too).

    Returns float64 ``[T]``; exactly 0 where the two distributions are equal.
    """
    p = np.asarray(policy_logp, dtype=np.float64)
    q = np.asarray(base_logp, dtype=np.float64)
    if p.shape != q.shape or p.ndim != 2:
        raise ValueError(f"token_kl: expected two [T, V] arrays of the same shape, got {p.shape} and {q.shape}")
    p = p - _logsumexp(p)
    q = q - _logsumexp(q)
    kl = np.sum(np.exp(p) * (p - q), axis=-1)
    return np.maximum(kl, 0.0)  # exact KL is >= 0; clip float rounding of equal distributions


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    return m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def _adapter_for(adapters: Optional[AdapterSource], step: int) -> Optional[Adapter]:
    if adapters is None:
        return None
    if callable(adapters) and not isinstance(adapters, Mapping):
        return adapters(step)
    if step not in adapters:
        raise KeyError(f"no adapter for step {step}; adapters have steps {sorted(adapters)}")
    return adapters[step]


def checkpoint_drift(steps: Sequence[int], logprobs_fn: Optional[LogprobsFn] = None,
                     adapters: Optional[AdapterSource] = None, *, cache_base: bool = True) -> dict:
    """KL to the base and update norms for every step (module docstring for the output).

    Args:
      steps: checkpoint steps, e.g. [4, 8, ..., 125]; reported in ascending order.
      logprobs_fn: ``step | None -> iterable of [T_i, V]`` log-probabilities; None skips the KL.
      adapters: ``{step: adapter}`` or ``step -> adapter``; None skips the update norms.
      cache_base: keep the base's arrays in memory (one base pass); False recomputes them for every step,
        streaming, so memory stays at one sequence at a time when ``logprobs_fn`` yields lazily.
    Raises:
      ValueError naming the step and sequence when a checkpoint's sequences do not line up with the base's.
    """
    if logprobs_fn is None and adapters is None:
        raise ValueError("checkpoint_drift: give logprobs_fn (KL) and/or adapters (update norms)")
    steps = sorted(int(s) for s in steps)
    base_cache = [np.asarray(x) for x in logprobs_fn(None)] if (logprobs_fn and cache_base) else None
    per_step = []
    for step in steps:
        row: dict[str, Any] = {"step": step}
        if logprobs_fn is not None:
            base_iter = base_cache if base_cache is not None else logprobs_fn(None)
            seq_kl, total, n_tok, kl_max, n_seq = [], 0.0, 0, 0.0, 0
            pol_iter = iter(logprobs_fn(step))
            for i, q in enumerate(base_iter):
                p = next(pol_iter, None)
                if p is None:
                    raise ValueError(f"step {step}: {i} sequences, the base has more")
                if np.shape(p) != np.shape(q):
                    raise ValueError(f"step {step}, sequence {i}: shape {np.shape(p)} but the base has "
                                     f"{np.shape(q)}")
                kl = token_kl(p, q)
                total += float(kl.sum())
                n_tok += int(kl.size)
                kl_max = max(kl_max, float(kl.max()) if kl.size else 0.0)
                seq_kl.append(float(kl.mean()) if kl.size else 0.0)
                n_seq += 1
            if next(pol_iter, None) is not None:
                raise ValueError(f"step {step}: more sequences than the base's {n_seq}")
            if n_tok == 0:
                raise ValueError("checkpoint_drift: the sequences hold no continuation tokens")
            row.update(kl_to_base=total / n_tok, n_tokens=n_tok, n_sequences=n_seq, kl_max_token=kl_max,
                       kl_per_sequence=seq_kl, kl_sequence_std=float(np.std(seq_kl)))
        adapter = _adapter_for(adapters, step)
        row["update_norm"] = update_norms(adapter) if adapter is not None else None
        per_step.append(row)
    first = per_step[0] if per_step else {}
    return {"steps": steps, "n_sequences": first.get("n_sequences"), "n_tokens": first.get("n_tokens"),
            "per_step": per_step}


# ------------------------------------------------------------------------------------------ PEFT adapters

_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.language_model\.|model\.)?(layers\.\d+\..+?)"
                       r"\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


def parse_peft_tensors(tensors: Mapping[str, Any], scale: float, where: str = "adapter") -> dict:
    """``{module: (A, B, scale)}`` from PEFT-layout tensors (module docstring). Raises naming the key."""
    parts: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        m = _PEFT_KEY.match(key)
        if not m:
            if "lora_" in key:
                raise ValueError(f"{where}: unrecognised LoRA key {key!r}")
            continue  # e.g. modules_to_save: not a low-rank update
        parts.setdefault(m.group(1), {})[m.group(2)] = np.asarray(value)
    out = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"{where}: module {module!r} has no {missing}.weight")
        out[module] = (ab["A"], ab["B"], float(scale))
    if not out:
        raise ValueError(f"{where}: no LoRA tensors (keys like ...layers.N.<module>.lora_A.weight)")
    return out


def load_peft_adapter(folder: str | os.PathLike) -> dict:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) as ``{module: (A, B,
    scale)}``."""
    folder = Path(folder)
    cfg_path, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for p in (cfg_path, weights):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: missing (not a PEFT adapter folder)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        r, alpha = float(cfg["r"]), float(cfg["lora_alpha"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{cfg_path}: need numeric 'r' and 'lora_alpha': {e}") from None
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return parse_peft_tensors(load_file(str(weights)), scale, where=str(weights))


_STEP_DIR = re.compile(r"^(?:step_|checkpoint-|step-)?(\d+)$")


def find_peft_checkpoints(root: str | os.PathLike) -> dict[int, Path]:
    """``{step: folder}`` for PEFT folders under ``root`` named ``step_N``, ``checkpoint-N`` or ``N`` (the
    adapter may sit in the folder itself or one level down, e.g. ``step_8/peft/``)."""
    out = {}
    for d in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        m = _STEP_DIR.match(d.name)
        if not (m and d.is_dir()):
            continue
        for cand in [d] + sorted(p for p in d.iterdir() if p.is_dir()):
            if (cand / "adapter_model.safetensors").is_file():
                out[int(m.group(1))] = cand
                break
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------------------- model-backed


class ModelLogprobs:
    """A ``logprobs_fn`` for :func:`checkpoint_drift` backed by ``jaxrl.models.qwen35``.

    Args:
      model_dir: HF Qwen3.5 folder of the base model (container or text-only).
      adapters: ``{step: adapter}`` or ``step -> adapter`` (module names ``layers.N.<module>``).
      sequences: ``[(prompt_ids, continuation_ids), ...]``: the fixed token sequences; every continuation
        needs at least one token.
      batch_size: rows per forward; all rows are right-padded to the longest sequence so one program serves all.
      dtype: model dtype (float32 keeps small KLs exact).
      model: an already loaded model to use instead of loading ``model_dir`` (its weights are restored after
        each step).

    Calling it with a step yields, per sequence, float32 ``[len(continuation), V]`` log-probabilities of each
    continuation token's position. Memory: one batch of ``[B, T, V]`` on the device and the yielded arrays.
    """

    def __init__(self, model_dir: Optional[str], adapters: AdapterSource,
                 sequences: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                 batch_size: int = DiagnoseSettings.batch_size,
                 dtype=None, model=None):
        if model is None:
            model = qwen35.from_pretrained(model_dir, dtype=dtype or jnp.float32)
        self.model, self.adapters = model, adapters
        self.sequences = [(list(p), list(c)) for p, c in sequences]
        for i, (p, c) in enumerate(self.sequences):
            if not p or not c:
                raise ValueError(f"sequence {i}: prompt and continuation need at least one token each")
        self.batch_size = int(batch_size)
        self._length = max(len(p) + len(c) for p, c in self.sequences)

        @nnx.jit
        def forward(m, ids, mask):
            return jax.nn.log_softmax(m(ids, attention_mask=mask).astype(jnp.float32), axis=-1)

        self._forward = forward

    def _linear(self, module: str):
        obj = self.model
        try:
            for part in module.split("."):
                obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
            return obj.weight
        except (AttributeError, IndexError, TypeError):
            raise KeyError(f"adapter module {module!r} is not a linear layer of the model "
                           "(expected names like 'layers.0.self_attn.q_proj')") from None

    def _apply(self, adapter: Adapter, step: int) -> list:
        """Merges ``W + scale * B @ A`` into every touched weight; returns [(variable, original array)]."""
        saved = []
        try:
            for module, (A, B, scale) in adapter.items():
                var = self._linear(module)
                w = var[...]
                A, B = np.asarray(A, np.float32), np.asarray(B, np.float32)
                if (B.shape[0], A.shape[1]) != tuple(w.shape) or B.shape[1] != A.shape[0]:
                    raise ValueError(f"step {step}, module {module!r}: B {B.shape} @ A {A.shape} does not fit the "
                                     f"weight {tuple(w.shape)}")
                delta = float(scale) * (jnp.asarray(B) @ jnp.asarray(A))
                saved.append((var, w))
                var.set_value((w.astype(jnp.float32) + delta).astype(w.dtype))
        except BaseException:
            self._restore(saved)
            raise
        return saved

    @staticmethod
    def _restore(saved: list) -> None:
        for var, w in reversed(saved):
            var.set_value(w)  # the very base array: no rounding from subtract-after-add

    def __call__(self, step: Optional[int]):
        adapter = None if step is None else _adapter_for(self.adapters, step)
        for start in range(0, len(self.sequences), self.batch_size):
            chunk = self.sequences[start:start + self.batch_size]
            ids = np.zeros((self.batch_size, self._length), np.int32)
            mask = np.zeros((self.batch_size, self._length), np.int32)
            for row, (p, c) in enumerate(chunk):
                seq = p + c
                ids[row, :len(seq)] = seq
                mask[row, :len(seq)] = 1  # right padding: causal attention never sees it from real tokens
            # Merge, run, restore around each batch: the base and a checkpoint can then be streamed side by side
            # (checkpoint_drift(cache_base=False) interleaves the two generators over one model).
            saved = [] if adapter is None else self._apply(adapter, step)
            try:
                logp = np.asarray(self._forward(self.model, ids, mask))
            finally:
                self._restore(saved)
            for row, (p, c) in enumerate(chunk):
                # The logits at position t predict token t + 1: continuation tokens sit at len(p) ...
                yield logp[row, len(p) - 1:len(p) + len(c) - 1]


def model_checkpoint_drift(model_dir: Optional[str], adapters: AdapterSource, sequences=None, *,
                           steps: Optional[Sequence[int]] = None, prompts: Optional[Sequence[Sequence[int]]] = None,
                           max_new_tokens: int = DRIFT_MAX_NEW_TOKENS, eos_token_ids: Sequence[int] = (),
                           batch_size: int = DiagnoseSettings.batch_size,
                           dtype=None, model=None, cache_base: bool = True) -> dict:
    """:func:`checkpoint_drift` with :class:`ModelLogprobs`.

    Give ``sequences`` ``[(prompt_ids, continuation_ids)]``, or ``prompts`` (token ids) whose continuations are
    generated greedily from the base with ``jaxrl.generation.generate`` (``max_new_tokens``, ``eos_token_ids``).
    ``steps`` defaults to the keys of a mapping ``adapters``.
    """
    if steps is None:
        if not isinstance(adapters, Mapping):
            raise ValueError("model_checkpoint_drift: pass steps when adapters is a callable")
        steps = sorted(adapters)
    if model is None:
        model = qwen35.from_pretrained(model_dir, dtype=dtype or jnp.float32)
    if sequences is None:
        if not prompts:
            raise ValueError("model_checkpoint_drift: give sequences or prompts")
        out = generate(model, [list(p) for p in prompts], max_new_tokens=max_new_tokens, temperature=0.0,
                       eos_token_ids=tuple(eos_token_ids))
        sequences = [(list(p), list(t)) for p, t in zip(prompts, out.tokens) if len(t)]
    fn = ModelLogprobs(None, adapters, sequences, batch_size=batch_size, model=model)
    result = checkpoint_drift(steps, fn, adapters, cache_base=cache_base)
    result["model_dir"] = None if model_dir is None else os.fspath(model_dir)
    return result


def fixed_sequences(model, model_dir: str, problems, *, n_prompts: int = DiagnoseSettings.n_prompts,
                    max_new_tokens: int = DRIFT_MAX_NEW_TOKENS,
                    enable_thinking: bool = DiagnoseSettings.enable_thinking,
                    max_prompt_len: int = 4096) -> list[tuple[list[int], list[int]]]:
    """The fixed prompt set for drift: the first ``n_prompts`` problems, chat-templated with ``model_dir``'s
    tokenizer, each with the base model's greedy continuation (``max_new_tokens``, stopping at the chat's end
    tokens). Save the result (``launchers.diagnose`` writes ``*_sequences.jsonl``) so that later runs measure on
    exactly the same tokens.

    ``problems``: a problems.jsonl path or a list of ``Problem``. Prompts over ``max_prompt_len`` are skipped;
    a prompt whose continuation is empty (immediate stop) is dropped (it has no position to measure).
    """
    if isinstance(problems, (str, os.PathLike)):
        problems = load_problems(problems)
    tok = load_tokenizer(model_dir)
    chosen = list(problems)[:n_prompts]
    enc = encode_prompts(tok, [p.messages for p in chosen], enable_thinking, max_prompt_len=max_prompt_len,
                         on_overlong="skip")
    if not enc.ids:
        raise ValueError(f"no prompt fits max_prompt_len={max_prompt_len}")
    out = generate(model, enc.ids, max_new_tokens=max_new_tokens, temperature=0.0,
                   eos_token_ids=chat_stop_ids(tok, model.config.eos_token_id))
    return [(list(map(int, p)), list(map(int, t))) for p, t in zip(enc.ids, out.tokens) if len(t)]
