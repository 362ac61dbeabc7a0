"""Problems -> scored rollouts.jsonl, resumable: the work behind `python -m launchers.rollout`.

    summary = run_rollouts(RolloutConfig(problems="problems.jsonl", model="hf_dir", out="rollouts.jsonl",
                                         num_samples=8, temperature=1.0, max_new_tokens=4096, reward="code"))

One record per sample (docs/interfaces.md, plus what pair building and audits need):

    {"problem_id", "sample_index", "completion", "completion_tokens", "finish_reason": "stop" | "length",
     "reward": {"partial", "strict", "reason"}, "model",
     "messages", "max_new_tokens", "truncated", "prompt_tokens"}        (+ "token_ids", "logprobs" if asked)

Resumability: records are appended one finished problem (all its samples) at a time, then flushed and
fsync'ed. On restart, a partially written last line is cut off, records already present are kept, and only the
missing (problem_id, sample_index) are generated. Sample keys derive from (seed, problem id, sample index), not
from positions, so a resumed run writes what the interrupted run would have written. `<out>.meta.json` holds the
settings; resuming with different settings is refused (mixing them would corrupt the statistics).

Prompts longer than max_prompt_len after the chat template are skipped and counted (`on_overlong="skip"`) or
stop the run (`"error"`); never cut.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import zlib
from pathlib import Path
from typing import Callable, Optional

import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

from jaxrl.data.chat import chat_stop_ids, encode_prompts, load_tokenizer
from jaxrl.data.problems import load_problems
from jaxrl.models import lora, qwen35
from jaxrl.models.adapters import load_adapter as read_adapter
from jaxrl.rewards import get_reward
from jaxrl.rollout.generate import decode_texts
from jaxrl.rollout.sampler import Sampler
from jaxrl.utils.io import atomic_write_json, iter_jsonl, repair_tail
from jaxrl.utils.tree import dotted

logger = logging.getLogger(__name__)

# Settings that must match for a resumed run to continue an existing rollouts file.
_RESUME_KEYS = ("problems", "model", "adapter", "num_samples", "temperature", "top_p", "top_k", "max_new_tokens",
                "max_prompt_len", "enable_thinking", "reward", "seed", "dtype", "model_name")


@dataclasses.dataclass
class RolloutConfig:
    problems: str
    model: str
    out: str
    adapter: Optional[str] = None
    num_samples: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 4096
    max_prompt_len: int = 2048
    prompt_buckets: tuple = ()  # prompt lengths with their own compiled program; () = 32, 64, ... max_prompt_len
    enable_thinking: bool = False
    reward: str = "code"
    batch_size: int = 64  # rows (samples) per compiled call
    seed: int = 0
    on_overlong: str = "skip"
    dtype: str = "bfloat16"
    limit: int = 0  # 0 = every problem
    model_name: str = ""  # the "model" field; default: the model folder's name (+ adapter)
    save_logprobs: bool = False
    progress: bool = True


class ResumeError(ValueError):
    """An existing rollouts file that this run cannot continue (different settings, foreign records)."""


def problem_key(problem_id: str) -> int:
    """The 32-bit id a problem's sample keys derive from (stable across runs, orderings and machines)."""
    return zlib.crc32(problem_id.encode("utf-8"))


def load_adapter(model, path: str):
    """Attaches the adapter checkpoint at `path` (a run workdir, its checkpoints/ or adapters/ folder, or one
    step folder; `jaxrl.train.checkpoints` format) to `model` in place and returns it.

    The checkpoint's meta names the adapted modules, rank, alpha and rsLoRA flag; the factors must match the
    attached adapters name for name and shape (an error names the first that does not).
    """
    params, meta = read_adapter(path)
    spec = meta.get("lora") or {}
    for key in ("modules", "rank", "alpha"):
        if key not in spec:
            raise ValueError(f"{path}: adapter meta has no lora.{key}; cannot rebuild the adapters")
    lora.apply_lora(model, targets=tuple(spec["modules"]), rank=int(spec["rank"]), alpha=float(spec["alpha"]),
                    use_rslora=bool(spec.get("use_rslora", False)))
    slots = {dotted(p): v for p, v in nnx.to_flat_state(nnx.state(model, lora.LoRAParam))}
    missing, unexpected = sorted(set(slots) - set(params)), sorted(set(params) - set(slots))
    if missing or unexpected:
        raise ValueError(f"{path}: adapter factors do not match the model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    for name, var in slots.items():
        value = params[name]
        if tuple(value.shape) != tuple(var[...].shape):
            raise ValueError(f"{path}: {name} has shape {tuple(value.shape)}, the model expects "
                             f"{tuple(var[...].shape)}")
        var[...] = jnp.asarray(value, var[...].dtype)
    return model


def _validate_record(rec: dict) -> None:
    for key in ("problem_id", "sample_index", "finish_reason"):
        if key not in rec:
            raise KeyError(key)
    if not isinstance(rec["sample_index"], int):
        raise TypeError("sample_index must be an integer")


def read_done(path: Path, num_samples: int) -> dict[str, set[int]]:
    """{problem_id: sample indices already written} of an existing rollouts file."""
    done: dict[str, set[int]] = {}
    if not path.exists():
        return done
    for lineno, rec in iter_jsonl(path, validate=_validate_record):
        sidx = rec["sample_index"]
        if not 0 <= sidx < num_samples:
            raise ResumeError(f"{path}:{lineno}: sample_index {sidx} is outside [0, num_samples={num_samples})")
        if sidx in done.setdefault(str(rec["problem_id"]), set()):
            raise ResumeError(f"{path}:{lineno}: duplicate record for ({rec['problem_id']!r}, {sidx})")
        done[str(rec["problem_id"])].add(sidx)
    return done


def _settings(cfg: RolloutConfig) -> dict:
    settings = {k: getattr(cfg, k) for k in _RESUME_KEYS}
    for k in ("problems", "model", "adapter"):  # the same files named another way are the same settings
        if settings[k]:
            settings[k] = os.path.abspath(settings[k])
    return settings


def _check_meta(meta_path: Path, out: Path, settings: dict) -> None:
    if not meta_path.exists():
        if out.exists() and out.stat().st_size > 0:
            raise ResumeError(f"{out} exists but {meta_path} does not, so its settings are unknown; move it away "
                              "or delete it to start over")
        return
    with open(meta_path) as f:
        old = json.load(f).get("settings", {})
    diffs = [k for k in _RESUME_KEYS if k in old and old[k] != settings[k]]
    if diffs:
        detail = ", ".join(f"{k}: {old[k]!r} -> {settings[k]!r}" for k in diffs)
        raise ResumeError(f"{out} was written with other settings ({detail}); resume with the same settings or "
                          "write to another --out")


def _append_group(f, records: list[dict]) -> None:
    f.write("".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in records))
    f.flush()
    os.fsync(f.fileno())


def run_rollouts(cfg: RolloutConfig, *, model=None, tokenizer=None, reward=None,
                 on_batch: Optional[Callable[[dict], None]] = None) -> dict:
    """Runs (or resumes) the rollouts of `cfg`; returns a summary (also stored in `<out>.meta.json`).

    model / tokenizer / reward: already loaded objects, to skip loading them from cfg (tests, trainers).
    on_batch: called after each written batch with running counts (progress reporting, fault injection).
    """
    if cfg.num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {cfg.num_samples}")
    out = Path(cfg.out)
    meta_path = out.with_name(out.name + ".meta.json")
    settings = _settings(cfg)
    _check_meta(meta_path, out, settings)

    problems = load_problems(cfg.problems)
    if cfg.limit:
        problems = problems[:cfg.limit]
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model)
    if model is None:
        dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
        if cfg.dtype not in dtypes:
            raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {cfg.dtype!r}")
        model = qwen35.from_pretrained(cfg.model, dtype=dtypes[cfg.dtype])
        if cfg.adapter:
            model = load_adapter(model, cfg.adapter)
    if reward is None:
        reward = get_reward(cfg.reward)
    model_name = cfg.model_name or Path(cfg.model.rstrip("/")).name + (f"+{cfg.adapter}" if cfg.adapter else "")

    encoded = encode_prompts(tokenizer, [p.messages for p in problems], cfg.enable_thinking, cfg.max_prompt_len,
                             on_overlong=cfg.on_overlong, names=[p.id for p in problems])
    skipped = [{"problem_id": problems[i].id, "prompt_tokens": n} for i, n in encoded.skipped]
    for s in skipped:
        logger.warning("skipping problem %s: %d prompt tokens > max_prompt_len=%d", s["problem_id"],
                       s["prompt_tokens"], cfg.max_prompt_len)

    removed = repair_tail(out)
    if removed:
        logger.warning("%s: removed a partially written last line (%d bytes)", out, removed)
    done = read_done(out, cfg.num_samples)
    kept_ids = {problems[i].id for i in encoded.kept}
    foreign = sorted(set(done) - kept_ids)
    if foreign:
        raise ResumeError(f"{out} has records for problems not in this run (e.g. {foreign[0]!r}); it belongs to "
                          "another problems file or --limit")
    todo = [(problems[i], ids) for i, ids in zip(encoded.kept, encoded.ids)
            if len(done.get(problems[i].id, ())) < cfg.num_samples]
    already = sum(len(v) for v in done.values())
    atomic_write_json(meta_path, {"settings": settings, "status": "running"})

    stop_ids = chat_stop_ids(tokenizer, model.config.eos_token_id)
    sampler = Sampler(model, max_new_tokens=cfg.max_new_tokens, max_prompt_len=cfg.max_prompt_len,
                      prompt_buckets=tuple(cfg.prompt_buckets) or None, batch_size=cfg.batch_size,
                      eos_token_ids=stop_ids,
                      pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else None)
    per_batch = max(1, sampler.batch_size // cfg.num_samples)
    total = len(encoded.kept) * cfg.num_samples
    bar = None
    if cfg.progress:
        bar = tqdm(total=total, initial=already, unit="sample", desc="rollouts", dynamic_ncols=True)
    written, truncated, generated_tokens, start = 0, 0, 0, time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as f:
        for b in range(0, len(todo), per_batch):
            chunk = todo[b:b + per_batch]
            result = sampler.sample([ids for _, ids in chunk], n=cfg.num_samples, temperature=cfg.temperature,
                                    top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed,
                                    group_ids=[problem_key(p.id) for p, _ in chunk])
            texts = decode_texts(tokenizer, result.tokens, result.finish_reasons)
            rows = [i for i in range(len(result)) if result.sample_indices[i] not in
                    done.get(chunk[result.prompt_indices[i]][0].id, ())]
            scores = reward.score([texts[i] for i in rows], [chunk[result.prompt_indices[i]][0] for i in rows],
                                  truncated=[result.finish_reasons[i] for i in rows])
            by_problem: dict[int, list[dict]] = {}
            for i, score in zip(rows, scores):
                problem, prompt = chunk[result.prompt_indices[i]]
                rec = {"problem_id": problem.id, "sample_index": result.sample_indices[i], "completion": texts[i],
                       "completion_tokens": len(result.tokens[i]), "finish_reason": result.finish_reasons[i],
                       "reward": {"partial": float(score.partial), "strict": bool(score.strict),
                                  "reason": score.reason},
                       "model": model_name, "messages": [dict(m) for m in problem.messages],
                       "max_new_tokens": cfg.max_new_tokens, "truncated": result.finish_reasons[i] == "length",
                       "prompt_tokens": len(prompt)}
                if cfg.save_logprobs:
                    rec["token_ids"] = result.tokens[i]
                    rec["logprobs"] = [float(x) for x in result.logprobs[i]]
                by_problem.setdefault(result.prompt_indices[i], []).append(rec)
            for j in sorted(by_problem):
                _append_group(f, by_problem[j])
            written += len(rows)
            truncated += sum(result.finish_reasons[i] == "length" for i in rows)
            generated_tokens += sum(result.num_tokens)
            elapsed = max(time.perf_counter() - start, 1e-9)
            if bar is not None:
                bar.update(len(rows))
                bar.set_postfix({"samples/s": f"{written / elapsed:.2f}",
                                 "tokens/s": f"{generated_tokens / elapsed:.1f}"})
            if on_batch is not None:
                on_batch({"written": written, "generated_tokens": generated_tokens})
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - start
    summary = {"settings": settings, "status": "complete", "problems": len(problems),
               "skipped_overlong": skipped, "samples_total": total, "samples_resumed": already,
               "samples_written": written, "truncated_written": truncated,
               "truncation_rate_written": truncated / written if written else None,
               "generated_tokens": generated_tokens, "seconds": round(elapsed, 3),
               "samples_per_s": written / elapsed if elapsed > 0 else None,
               "tokens_per_s": generated_tokens / elapsed if elapsed > 0 else None}
    atomic_write_json(meta_path, summary)
    return summary
