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

Devices and processes (the jax backend): the rows of each batch are split over the data axis of a mesh of this
process's devices (`mesh_shape`, default every local device; the batch size is rounded up to a multiple). With
several processes (`jax.distributed`, the launchers' --coordinator_address etc.), process i of n takes every n-th
problem (`jaxrl.parallel.distributed.share`), samples it on its own devices and appends to its part file
`<out>.parts/part-<i>-of-<n>.jsonl` (a ResumableJsonl of the same settings, resumable on its own); after a
barrier, process 0 merges the parts into `<out>`, in problem order: the file a single process would have written.
Records already in `<out>` or in any part file are never drawn again.
Interrupted (SIGINT / SIGTERM with jaxrl.utils.interrupt installed, as the launcher does): the batch in flight is
written and fsync'ed, then Interrupted is raised; rerunning the command resumes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

import jax
from tqdm import tqdm

from jaxrl.data.chat import chat_stop_ids, encode_prompts, load_tokenizer
from jaxrl.data.problems import load_problems
from jaxrl.export.peft import read_adapter
from jaxrl.models.qwen35.config import load_hf_config
from jaxrl.parallel import distributed
from jaxrl.parallel.mesh import local_mesh
from jaxrl.rewards import get_reward
from jaxrl.rollout.backends import BACKENDS, JaxBackend, ModelSpec, SamplingParams, make_backend
from jaxrl.rollout.backends.jax_backend import DTYPES
from jaxrl.rollout.collect import Collector, Sample
from jaxrl.rollout.keys import problem_key
from jaxrl.rollout.writer import ResumableJsonl, ResumeError
from jaxrl.utils import interrupt

__all__ = ["RolloutConfig", "ResumeError", "record_of", "run_rollouts", "sampling_of"]

logger = logging.getLogger(__name__)

# Settings that must match for a resumed run to continue an existing rollouts file.
_RESUME_KEYS = ("problems", "model", "adapter", "num_samples", "temperature", "top_p", "top_k", "max_new_tokens",
                "max_prompt_len", "enable_thinking", "reward", "seed", "dtype", "model_name", "backend")


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
    batch_size: int = 64  # rows (samples) per compiled call; server backends: samples in flight at once
    seed: int = 0
    on_overlong: str = "skip"
    dtype: str = "bfloat16"
    limit: int = 0  # 0 = every problem
    model_name: str = ""  # the "model" field; default: the model folder's name (+ adapter)
    save_logprobs: bool = False
    progress: bool = True
    backend: str = "jax"  # jax | vllm | server (jaxrl.rollout.backends)
    backend_kwargs: dict = dataclasses.field(default_factory=dict)  # e.g. {"url": ...}, vLLM's parallel sizes
    mesh_shape: Optional[tuple] = (-1, 1, 1)  # jax backend: (data, fsdp, tensor) over this process's devices;
    #                                           None = one device without a mesh


def _validate_record(rec: dict) -> None:
    for key in ("problem_id", "sample_index", "finish_reason"):
        if key not in rec:
            raise KeyError(key)
    if not isinstance(rec["sample_index"], int):
        raise TypeError("sample_index must be an integer")


def _record_key(rec: dict) -> tuple:
    return str(rec["problem_id"]), int(rec["sample_index"])


def done_samples(existing: list[tuple[int, dict]], path: Path, num_samples: int) -> dict[str, set[int]]:
    """{problem_id: sample indices already written} of an existing rollouts file (its (line, record) pairs)."""
    done: dict[str, set[int]] = {}
    for lineno, rec in existing:
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
    # Other backends draw other streams: their samples must not mix with the jax backend's. The jax backend is
    # recorded as None, the value meta files written before this key existed hold.
    settings["backend"] = None if cfg.backend == "jax" else cfg.backend
    return settings


def sampling_of(cfg: RolloutConfig) -> SamplingParams:
    return SamplingParams(n=cfg.num_samples, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)


def record_of(sample: Sample, problem, prompt_len: int, cfg: RolloutConfig, model_name: str) -> dict:
    """One rollouts.jsonl line (module docstring)."""
    rec = {"problem_id": problem.id, "sample_index": sample.sample_index, "completion": sample.text,
           "completion_tokens": len(sample.tokens), "finish_reason": sample.finish_reason,
           "reward": {"partial": float(sample.result.partial), "strict": bool(sample.result.strict),
                      "reason": sample.result.reason},
           "model": model_name, "messages": [dict(m) for m in problem.messages],
           "max_new_tokens": cfg.max_new_tokens, "truncated": sample.truncated, "prompt_tokens": prompt_len}
    if cfg.save_logprobs:
        rec["token_ids"] = list(sample.tokens)
        rec["logprobs"] = [float(x) for x in sample.logprobs or ()]
    return rec


def run_rollouts(cfg: RolloutConfig, *, model=None, tokenizer=None, reward=None,
                 on_batch: Optional[Callable[[dict], None]] = None) -> dict:
    """Runs (or resumes) the rollouts of `cfg`; returns a summary (also stored in `<out>.meta.json`).

    model / tokenizer / reward: already loaded objects, to skip loading them from cfg (tests, trainers); a given
    model is used as it is (cfg.adapter is not applied to it).
    on_batch: called after each written batch with running counts (progress reporting, fault injection).
    """
    sampling = sampling_of(cfg)  # bad sampling values fail here, before anything is loaded or written
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {cfg.batch_size}")
    if cfg.limit < 0 or cfg.max_prompt_len < 1 or any(int(b) < 1 for b in cfg.prompt_buckets):
        raise ValueError(f"limit must be >= 0, max_prompt_len and prompt_buckets positive; got limit={cfg.limit}, "
                         f"max_prompt_len={cfg.max_prompt_len}, prompt_buckets={list(cfg.prompt_buckets)}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {cfg.dtype!r}")
    if cfg.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {cfg.backend!r}")
    out = Path(cfg.out)
    log = ResumableJsonl(out, _settings(cfg), compare=_RESUME_KEYS, what="rollouts",
                         hint="write to another --out")
    log.check()

    problems = load_problems(cfg.problems)
    if cfg.limit:
        problems = problems[:cfg.limit]
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model)
    encoded = encode_prompts(tokenizer, [p.messages for p in problems], cfg.enable_thinking, cfg.max_prompt_len,
                             on_overlong=cfg.on_overlong, names=[p.id for p in problems])
    skipped = [{"problem_id": problems[i].id, "prompt_tokens": n} for i, n in encoded.skipped]
    for s in skipped:
        logger.warning("skipping problem %s: %d prompt tokens > max_prompt_len=%d", s["problem_id"],
                       s["prompt_tokens"], cfg.max_prompt_len)
    # what is on disk: the file, and the part files of several processes (this run's, or an interrupted run's)
    done: dict[str, set[int]] = {}
    for source in [log] + log.parts():
        for pid, indices in done_samples(source.read(validate=_validate_record), source.path,
                                         cfg.num_samples).items():
            done.setdefault(pid, set()).update(indices)
    kept_ids = {problems[i].id for i in encoded.kept}
    foreign = sorted(set(done) - kept_ids)
    if foreign:
        raise ResumeError(f"{out} has records for problems not in this run (e.g. {foreign[0]!r}); it belongs to "
                          "another problems file or --limit")
    processes, index = jax.process_count(), jax.process_index()
    mine = distributed.share(len(encoded.kept))
    todo = [(problems[encoded.kept[j]], encoded.ids[j]) for j in mine
            if len(done.get(problems[encoded.kept[j]].id, ())) < cfg.num_samples]
    already = sum(len(done.get(problems[encoded.kept[j]].id, ())) for j in mine)

    adapter = read_adapter(cfg.adapter) if cfg.adapter and (model is None or cfg.backend != "jax") else None
    if reward is None:
        reward = get_reward(cfg.reward)
    model_name = cfg.model_name or Path(cfg.model.rstrip("/")).name + (f"+{cfg.adapter}" if cfg.adapter else "")
    eos = model.config.eos_token_id if model is not None else load_hf_config(cfg.model)[0].eos_token_id
    stop_ids = chat_stop_ids(tokenizer, eos)
    if cfg.backend == "jax":
        backend = JaxBackend(cfg.model, model=model, dtype=None if model is not None else cfg.dtype,
                             batch_size=cfg.batch_size, max_prompt_len=cfg.max_prompt_len,
                             prompt_buckets=tuple(cfg.prompt_buckets) or None, stop_ids=stop_ids,
                             pad_id=tokenizer.pad_token_id,
                             mesh=None if cfg.mesh_shape is None else local_mesh(cfg.mesh_shape))
    else:  # a server: the adapter is served as LoRA from a PEFT folder exported next to the output
        backend = make_backend(cfg.backend, base_dir=cfg.model, out_dir=str(out.parent / f"{out.name}.backend"),
                               stop_ids=stop_ids, max_prompt_len=cfg.max_prompt_len,
                               max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, dtype=cfg.dtype,
                               **cfg.backend_kwargs)
    if model is None or cfg.backend != "jax":
        backend.load(ModelSpec("rollout", "adapter" if adapter is not None else "base", cfg.adapter), adapter)
    collector = Collector(backend, reward, tokenizer=tokenizer, stop_ids=stop_ids)

    writer = log if processes == 1 else log.part(index, processes)  # several processes: each its own part
    writer.start()
    # samples per collect call: the jax backend's compiled batch, a server's requests in flight (its own batching)
    per_batch = max(1, getattr(backend, "batch_size", cfg.batch_size) // cfg.num_samples)
    total = len(mine) * cfg.num_samples
    bar = None
    if cfg.progress:
        bar = tqdm(total=total, initial=already, unit="sample", desc="rollouts", dynamic_ncols=True)
    written, truncated, generated_tokens, start = 0, 0, 0, time.perf_counter()
    try:
        for b in range(0, len(todo), per_batch):
            chunk = todo[b:b + per_batch]
            samples = collector.collect(
                [ids for _, ids in chunk], [problem_key(p.id) for p, _ in chunk], [p for p, _ in chunk], sampling,
                wanted=lambda j, i: i not in done.get(chunk[j][0].id, ()))
            by_problem: dict[int, list[dict]] = {}
            for s in samples:
                problem, prompt = chunk[s.prompt_index]
                by_problem.setdefault(s.prompt_index, []).append(record_of(s, problem, len(prompt), cfg, model_name))
            for j in sorted(by_problem):
                writer.append(by_problem[j])
            written += len(samples)
            truncated += sum(s.truncated for s in samples)
            generated_tokens += sum(len(s.tokens) for s in samples)
            elapsed = max(time.perf_counter() - start, 1e-9)
            if bar is not None:
                bar.update(len(samples))
                bar.set_postfix({"samples/s": f"{written / elapsed:.2f}",
                                 "tokens/s": f"{generated_tokens / elapsed:.1f}"})
            if on_batch is not None:
                on_batch({"written": written, "generated_tokens": generated_tokens})
            interrupt.check(lambda: f"rollouts stopped with {already + written} of {total} samples in {out}; "
                                    "rerun the same command to resume")
    finally:
        writer.close()
        if bar is not None:
            bar.close()
        if cfg.backend != "jax":
            backend.close()  # stops a server this run started (a given jax model stays the caller's)
    summary = _summary(len(problems), skipped, total, already, written, truncated, generated_tokens,
                       time.perf_counter() - start)
    # the devices this process sampled on (a server's are its own business)
    summary["devices"] = (1 if backend.mesh is None else int(backend.mesh.devices.size)) if cfg.backend == "jax" \
        else None
    positions = {problems[i].id: j for j, i in enumerate(encoded.kept)}
    order = lambda rec: (positions[str(rec["problem_id"])], int(rec["sample_index"]))  # noqa: E731
    if processes == 1:
        if log.parts():  # left by an interrupted run of several processes: theirs join the file now
            log.merge_parts(_record_key, order, validate=_validate_record)
        return log.finish(summary)
    writer.finish(summary)
    distributed.barrier(f"rollouts {out}: parts written")
    if index == 0:
        parts = [json.loads(log.part(i, processes).meta_path.read_text()) for i in range(processes)]
        log.merge_parts(_record_key, order, validate=_validate_record)
        log.finish(_merged_summary(summary, parts, len(log.read())))
    distributed.barrier(f"rollouts {out}: merged")
    return json.loads(log.meta_path.read_text())


def _summary(problems: int, skipped: list, total: int, already: int, written: int, truncated: int,
             generated_tokens: int, elapsed: float) -> dict:
    return {"problems": problems, "skipped_overlong": skipped, "samples_total": total,
            "samples_resumed": already, "samples_written": written, "truncated_written": truncated,
            "truncation_rate_written": truncated / written if written else None,
            "generated_tokens": generated_tokens, "seconds": round(elapsed, 3),
            "samples_per_s": written / elapsed if elapsed > 0 else None,
            "tokens_per_s": generated_tokens / elapsed if elapsed > 0 else None}


def _merged_summary(mine: dict, parts: list[dict], records: int) -> dict:
    """The summary of a run of several processes: their parts' counts summed, the slowest one's seconds."""
    total = {k: sum(p[k] for p in parts) for k in ("samples_total", "samples_written", "truncated_written",
                                                   "generated_tokens")}
    elapsed = max(p["seconds"] for p in parts)
    summary = _summary(mine["problems"], mine["skipped_overlong"], total["samples_total"],
                       records - total["samples_written"], total["samples_written"], total["truncated_written"],
                       total["generated_tokens"], elapsed)
    summary["processes"] = [{k: p.get(k) for k in ("samples_total", "samples_resumed", "samples_written",
                                                   "seconds", "devices")} for p in parts]
    devices = [p.get("devices") for p in parts]
    summary["devices"] = None if None in devices else sum(devices)
    return summary
