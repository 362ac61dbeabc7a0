"""Problems -> scored rollouts.jsonl, resumable: the work behind `python -m launchers.rollout`.

    summary = run_rollouts(RolloutConfig(problems="problems.jsonl", model="hf_dir", out="rollouts.jsonl",
                                         num_samples=8, temperature=1.0, max_new_tokens=4096, reward="code"))

One record per sample (docs/reference/interfaces.md, plus what pair building and audits need):

    {"problem_id", "sample_index", "completion", "completion_tokens", "finish_reason": "stop" | "length",
     "reward": {"partial", "strict", "reason"}, "model",
     "messages", "max_new_tokens", "truncated", "prompt_tokens"}        (+ "token_ids", "logprobs" if asked)

Resumability: records are appended one finished problem (all its samples) at a time, then flushed and
fsync'ed. On restart, a partially written last line is cut off, records already present are kept, and only the
missing (problem_id, sample_index) are generated. Sample keys derive from (seed, problem id, sample index), not
from positions, so a resumed run writes what the interrupted run would have written. `<out>.meta.json` holds the
settings; resuming with different settings is refused (mixing them would corrupt the statistics).

The checkpoint is part of the settings: `<out>.meta.json` records the step `adapter` resolved to (a run folder
resolves to its newest checkpoint) and the adapter's digest, and a resume whose `adapter` resolves to another
checkpoint (the run trained on since) is refused, so one file never holds samples of two checkpoints.

Prompts longer than max_prompt_len after the chat template are skipped and counted (`on_overlong="skip"`) or
stop the run (`"error"`); never cut.

One writer per output: the process holds a lock on `<out>` (`.<name>.lock` beside it, jaxrl.utils.io.writer_lock)
while it writes; a second run on the same --out is refused naming the first one's pid, before it writes anything.

Devices and processes (the jax backend): the rows of each batch are split over the data axis of a mesh of this
process's devices (`mesh_shape`, default every local device; the batch size is rounded up to a multiple). With
several processes (`jax.distributed`, the launchers' --coordinator_address etc.), process i of n takes every n-th
problem (`jaxrl.parallel.distributed.share`), samples it on its own devices and appends to its part file
`<out>.parts/part-<i>-of-<n>.jsonl` (a ResumableJsonl of the same settings, resumable on its own); after a
barrier, process 0 merges the parts into `<out>`, in problem order: the file a single process would have written.
Records already in `<out>` or in any part file are never drawn again.
Interrupted (SIGINT / SIGTERM with jaxrl.utils.interrupt installed, as the launcher does): the batch in flight is
written and fsync'ed, then Interrupted is raised; rerunning the command resumes. The loop that shares, resumes,
writes and merges is jaxrl.rollout.sampling_loop (evaluation runs the same one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

from jaxrl.data.chat import OVERLONG_POLICIES, chat_stop_ids, encode_prompts, load_tokenizer
from jaxrl.data.problems import load_problems
from jaxrl.models.peft import read_adapter
from jaxrl.models.qwen35.config import load_hf_config
from jaxrl.parallel.mesh import local_mesh
from jaxrl.parallel.distributed import is_main_process
from jaxrl.rewards import REWARDS, get_reward
from jaxrl.backends.base import ModelSpec, SamplingParams
from jaxrl.backends.flags import (backend_field, backend_spec, max_lora_rank_field, mesh_shape_field, server_field,
                                  server_url_field, vllm_field)
from jaxrl.backends.jax_backend import DTYPES
from jaxrl.backends.options import ServerOptions, VLLMLaunchOptions
from jaxrl.backends.settings import BackendContext, RolloutSpec
from jaxrl.rollout.collect import Collector, Sample
from jaxrl.rollout.sampling_loop import Counts, ProgressBar, SamplingLoop, on_disk
from jaxrl.rollout.writer import ResumableJsonl
from jaxrl.utils.io import ResumeError
from jaxrl.utils.dataclass_flags import flag_field
from jaxrl.utils.seeds import seed_field
from jaxrl.utils.io import sibling_lock_file, writer_lock

__all__ = ["REWARD_HELP", "RewardChoiceError", "RolloutConfig", "ResumeError", "check_model_folder",
           "check_reward_choice", "record_of", "run_rollouts", "sampling_of"]

logger = logging.getLogger(__name__)

# Settings that must match for a resumed run to continue an existing rollouts file. The adapter is compared by
# what it is (the step it resolved to, its digest), not by how it was named: a run folder and its step folder are
# the same checkpoint, and one run folder is another checkpoint after more training.
_RESUME_KEYS = ("problems", "model", "adapter_step", "adapter_digest", "num_samples", "temperature", "top_p",
                "top_k", "max_new_tokens", "max_prompt_len", "enable_thinking", "reward", "seed", "dtype",
                "model_name", "backend")
_OF_THE_ADAPTER = ("adapter_step", "adapter_digest")  # read off the checkpoint --adapter resolved to, not the flags
# The rewards a flag may name, read from the registry (plug-ins registered later are accepted too).
REWARD_HELP = (f"Reward: {', '.join(REWARDS.names())} (jaxrl.rewards; code is the sandboxed verifier), or "
               "module:function of your own.")


class RewardChoiceError(ValueError):
    """An unknown reward, or an option the reward does not take: a usage error naming the flag."""


def check_reward_choice(name: str, options: Mapping, flag: str = "--reward") -> None:
    """RewardChoiceError unless `name` is a registered reward (or user code, "module:function") that takes every
    keyword of `options`; nothing is built."""
    if ":" in name:
        return  # user code: its own signature decides when it is built
    if name not in REWARDS:
        raise RewardChoiceError(f"{flag}={name}: unknown reward; registered: {', '.join(REWARDS.names())} (or name "
                                "your own as module:function)")
    try:
        params = inspect.signature(REWARDS.get(name)).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    takes = [k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for key in options:
        if key not in takes:
            raise RewardChoiceError(f"--reward_kwargs: reward {name!r} takes no option {key!r}; its options: "
                                    f"{', '.join(takes) or '(none)'}")


def check_model_folder(path: str, flag: str) -> None:
    """FileNotFoundError naming the flag unless `path` is an HF model folder (with config.json): a mistyped path
    is one line, not the tokenizer library's traceback."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{flag}={path}: no such folder (an HF model folder with config.json)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{flag}={path}: not an HF model folder (no config.json in it)")


@dataclasses.dataclass
class RolloutConfig:
    """The settings of a rollout run; each field is also a flag of launchers.rollout (jaxrl.rollout.flags), its
    default and help declared here once."""

    problems: str = flag_field(help="problems.jsonl (canonical schema of docs/reference/interfaces.md).")
    model: str = flag_field(help="HF model folder (weights, config.json, tokenizer, chat template).")
    out: str = flag_field(help="Output rollouts.jsonl (appended to and resumed if it exists).")
    adapter: Optional[str] = flag_field(None, help="Optional adapter checkpoint folder (trainer format).")
    num_samples: int = flag_field(8, help="Samples per problem (K).")
    temperature: float = flag_field(1.0, help="Sampling temperature; 0 = greedy.")
    top_p: float = flag_field(1.0, help="Nucleus sampling mass in (0, 1].")
    top_k: int = flag_field(0, help="Top-k filtering; 0 = off.")
    max_new_tokens: int = flag_field(4096, help="Generation cap; a sample hitting it is truncated (finish_reason "
                                                "'length').")
    max_prompt_len: int = flag_field(2048, help="Prompt budget in tokens after the chat template.")
    prompt_buckets: tuple[int, ...] = flag_field((), help="Prompt lengths that get their own compiled program "
                                                         "(default 32, 64, ... up to --max_prompt_len).")
    enable_thinking: bool = flag_field(False, help="Qwen3.5 thinking mode in the generation prompt.")
    reward: str = flag_field("code", help=REWARD_HELP)
    batch_size: int = flag_field(64, help="Samples per compiled batch (jax backend); samples in flight at once "
                                          "(server backends).")
    seed: int = seed_field(0, help="Sampling seed.")
    on_overlong: str = flag_field("skip", choices=OVERLONG_POLICIES,
                                  help="Prompts over --max_prompt_len: skip (counted in the summary) or error.")
    dtype: str = flag_field("bfloat16", choices=DTYPES, help="Model compute dtype.")
    limit: int = flag_field(0, help="Use only the first N problems (0 = all).")
    model_name: str = flag_field("", help="Value of the records' 'model' field (default: the model folder's name, "
                                          "+ADAPTER with --adapter).")
    save_logprobs: bool = flag_field(False, help="Also write token_ids and per-token logprobs.")
    progress: bool = flag_field(True, help="Show a progress bar.")
    backend: str = backend_field()  # jax | vllm | server (jaxrl.backends); built from backend_spec(cfg)
    server_url: Optional[str] = server_url_field()  # server | vllm: a running server
    server: ServerOptions = server_field()  # server | vllm: the --server_* flags (jaxrl.backends.flags)
    vllm: VLLMLaunchOptions = vllm_field()  # vllm without server_url: the --vllm_* flags
    vllm_max_lora_rank: int = max_lora_rank_field()
    mesh_shape: Optional[tuple[int, ...]] = mesh_shape_field()  # jax backend: (data, fsdp, tensor) over this
    #                                     process's devices; None = one device without a mesh


def _validate_record(rec: dict) -> None:
    for key in ("problem_id", "sample_index", "finish_reason"):
        if key not in rec:
            raise KeyError(key)
    if not isinstance(rec["sample_index"], int):
        raise TypeError("sample_index must be an integer")


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


def _settings(cfg: RolloutConfig, adapter) -> dict:
    """The settings the samples depend on (`<out>.meta.json`); `adapter`: the one --adapter resolved to."""
    settings = {k: getattr(cfg, k) for k in (*_RESUME_KEYS, "adapter") if k not in _OF_THE_ADAPTER}
    settings["adapter_step"] = None if adapter is None else adapter.step
    settings["adapter_digest"] = None if adapter is None else adapter.digest()
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
    spec = backend_spec(cfg)  # the backend's typed spec: a choice its options do not fit fails here
    if reward is None:
        check_reward_choice(cfg.reward, {})
    if model is None or tokenizer is None:
        check_model_folder(cfg.model, "--model")
    out = Path(cfg.out)
    # the checkpoint --adapter resolves to now (a run folder: its newest), recorded and compared on resume
    adapter = read_adapter(cfg.adapter) if cfg.adapter else None
    hint = "write to another --out" + (", or pin the checkpoint the file was started with (--adapter=<run>/"
                                       "checkpoints/adapters/<step>)" if adapter is not None else "")
    log = ResumableJsonl(out, _settings(cfg, adapter), compare=_RESUME_KEYS, what="rollouts", hint=hint)
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
    kept = [(problems[i], ids) for i, ids in zip(encoded.kept, encoded.ids)]
    _done_on_disk(log, cfg, out, kept)  # refused here, before anything is written: foreign or duplicate records
    if model is not None and cfg.backend == "jax":
        adapter = None  # a given model is used as it is
    with writer_lock(sibling_lock_file(out), out, hint="wait for it to finish, or write to another --out") \
            if is_main_process() else _no_lock():
        # read again under the lock: what another writer added before it let go is never drawn twice
        loop = SamplingLoop(log, kept, cfg.num_samples, _done_on_disk(log, cfg, out, kept), label=f"rollouts {out}")
        return _sample(cfg, spec, problems, skipped, loop, out, sampling, adapter, model, tokenizer, reward,
                       on_batch)


def _done_on_disk(log: ResumableJsonl, cfg: RolloutConfig, out: Path, kept: list) -> set[tuple[str, int]]:
    """The (problem id, sample index) pairs already in the file and the part files of several processes (this
    run's, or an interrupted run's); ResumeError for records of problems this run does not have."""
    done: set[tuple[str, int]] = set()
    for source in on_disk(log):
        for pid, indices in done_samples(source.read(validate=_validate_record), source.path,
                                         cfg.num_samples).items():
            done.update((pid, i) for i in indices)
    foreign = sorted({pid for pid, _ in done} - {p.id for p, _ in kept})
    if foreign:
        raise ResumeError(f"{out} has records for problems not in this run (e.g. {foreign[0]!r}); it belongs to "
                          "another problems file or --limit")
    return done


@contextlib.contextmanager
def _no_lock():
    yield  # processes other than 0 write only their own part files


def _sample(cfg: RolloutConfig, spec: RolloutSpec, problems, skipped, loop: SamplingLoop, out: Path,
            sampling: SamplingParams, adapter, model, tokenizer, reward, on_batch) -> dict:
    """The sampling of run_rollouts, under the output's lock: the backend, the loop, the summary."""
    if reward is None:
        reward = get_reward(cfg.reward)
    model_name = cfg.model_name or Path(cfg.model.rstrip("/")).name + (f"+{cfg.adapter}" if cfg.adapter else "")
    eos = model.config.eos_token_id if model is not None else load_hf_config(cfg.model)[0].eos_token_id
    stop_ids = chat_stop_ids(tokenizer, eos)
    jax = cfg.backend == "jax"
    # a server: the adapter is served as LoRA from a PEFT folder exported next to the output (out_dir)
    backend = spec.build(BackendContext(
        cfg.model, stop_ids=tuple(stop_ids), max_prompt_len=cfg.max_prompt_len, max_new_tokens=cfg.max_new_tokens,
        pad_id=tokenizer.pad_token_id, model=model, dtype=None if jax and model is not None else cfg.dtype,
        seed=cfg.seed, batch_size=cfg.batch_size, prompt_buckets=tuple(cfg.prompt_buckets) or None,
        mesh=local_mesh(cfg.mesh_shape) if jax and cfg.mesh_shape is not None else None,
        out_dir=str(out.parent / f"{out.name}.backend"), lora_rank=cfg.vllm_max_lora_rank))
    if model is None or cfg.backend != "jax":
        backend.load(ModelSpec("rollout", "adapter" if adapter is not None else "base", cfg.adapter), adapter)
    collector = Collector(backend, reward, tokenizer=tokenizer, stop_ids=stop_ids)

    def record(sample: Sample, problem, prompt: list[int]) -> dict:
        return record_of(sample, problem, len(prompt), cfg, model_name)

    def report(counts: Counts) -> None:
        on_batch({"written": counts.written, "generated_tokens": counts.generated_tokens})

    def stop_message(counts: Counts) -> str:
        return (f"rollouts stopped with {counts.resumed + counts.written} of {counts.total} samples in {out}; "
                "rerun the same command to resume")

    try:
        counts = loop.run(collector, sampling, record, stop_message=stop_message,
                          progress=ProgressBar("rollouts", unit="sample") if cfg.progress else None,
                          on_batch=report if on_batch is not None else None)
    finally:
        if cfg.backend != "jax":
            backend.close()  # stops a server this run started (a given jax model stays the caller's)
    summary = _summary(len(problems), skipped, counts.total, counts.resumed, counts.written, counts.truncated,
                       counts.generated_tokens, time.perf_counter() - counts.started)
    # the devices this process sampled on (a server's are its own business)
    summary["devices"] = (1 if backend.mesh is None else int(backend.mesh.devices.size)) if cfg.backend == "jax" \
        else None
    return loop.finish(summary=summary, validate=_validate_record,
                       merged_summary=lambda parts, records: _merged_summary(summary, parts, records))


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
