"""Base + checkpoints on a problems file -> samples, metrics, paired comparisons, weight audit: the work behind
`python -m launchers.evaluate`.

    cfg = EvalConfig(problems="heldout.jsonl", base="Qwen3.5-4B", out="run/eval",
                     models=[ModelSpec("step_28", "adapter", "run/checkpoints/adapters/28", step=28)],
                     num_samples=1, temperature=0.0, max_new_tokens=8192)
    results = Evaluator(cfg).run()

Outputs under `out/` (formats: jaxrl/data/formats.py):

    results.json, results.md     metrics per model (+ "untruncated", intervals), comparisons with the baseline
                                 (paired over prompts, each interval agreeing with its test; simultaneous intervals
                                 over the file's family; jaxrl.evaluation.analysis), the selection-adjusted gain,
                                 censoring, power, the protocol's claims, warnings (truncation above the
                                 threshold, skipped prompts, models with identical weights)
    samples/<name>.jsonl         every scored completion (formats.write_samples); with `environment`, every episode
                                 (jaxrl.evaluation.episodes: results add solved within t turns)
    audit.json                   the weight audit (jaxrl.export.audit) of every model against the base
    cache/<name>.jsonl           completions as they are scored, appended one problem at a time (the resume state)
    resampled/<cap>/<name>.jsonl the samples with the truncated ones re-drawn at a larger cap (launchers.evaluate
                                 --resample_max_new_tokens; jaxrl.evaluation.censoring), read back by write()
    protocol.json, selection.json  the evaluation's role (select on dev / confirm on held-out; .protocol)

Honesty rules this module enforces:

* Every model is scored on the same prompts, tokenised once with the base's tokenizer and chat template, with the
  same sample keys (seed, problem id, sample index): differences are paired, and random streams are shared.
* Every model's weights are fingerprinted (sha256 of its language tower, an adapter merged in the stored dtype:
  a label of base + adapter, which every backend serves unmerged; `jaxrl.export.audit`) and the
  fingerprint is stored in results.json; the digest of the adapter the backend REALLY carries is read back from
  the loaded model and must equal the file's. Two models with identical language weights raise a warning, and so
  does a merged export whose merge rounded its adapter's update away (`merge_fidelity`, jaxrl.export.merge).
* Every process its share: the jax backend splits each batch's rows over a mesh of this process's devices
  (`mesh_shape`, default all of them); with several processes (`jax.distributed`, the launcher's
  --coordinator_address etc.) process i of n samples every n-th problem on its own devices into its part of each
  model's cache (`cache/<name>.jsonl.parts/`, jaxrl.rollout.writer), process 0 merges the parts after a barrier
  and alone writes samples, audit and results; the samples are the ones a single process draws.
* Nothing replaced silently: an --out whose results.json holds models or prompts this run does not have (a
  narrower rerun, e.g. --limit=8 on a 64-prompt folder) is refused before any work (OutputExistsError), unless
  `overwrite` (then the samples files of the models left out are removed with the old results). A run of the
  same models and prompts, or of more models on the same prompts, resumes and adds to what is there. A folder
  holding a confirmation (protocol.json) is never overwritten: the one look is written once
  (protocol.refuse_overwrite).
* Every value and every model folder / adapter is checked before a model is loaded or a cache is created.
* Interrupted (SIGINT / SIGTERM with jaxrl.utils.interrupt installed, as the launcher does): the batch in flight
  is written to the cache, then Interrupted is raised; rerunning the command resumes.
* Resumable: a killed evaluation continues where it stopped. The cache of a model is bound to its fingerprint,
  the sampling settings, the reward and the backend (`CACHE_KEYS`); resuming with other values is refused, so
  samples of different weights or settings are never mixed. A cached sample whose problem changed (tests
  included) is drawn again. Samples are keyed by (problem, sample index), so raising --num_samples reuses the
  samples already drawn. An adapter named by its run folder resolves to the newest checkpoint: the cache and
  results.json record that step (`adapter_step`) and digest, and a resume after more training (another digest)
  is refused.
* One writer per --out: process 0 holds the folder's lock (`.jaxrl.lock`, jaxrl.utils.io.writer_lock) while it
  writes; a second evaluation into the same folder is refused naming the first one's pid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import jax

from jaxrl.algorithms import plugins
from jaxrl.data import formats
from jaxrl.data.chat import OVERLONG_POLICIES, chat_stop_ids, encode_prompts, load_tokenizer
from jaxrl.data.problems import load_problems
from jaxrl.environments.registry import ENVIRONMENTS
from jaxrl.environments.runner import EpisodeRunner
from jaxrl.evaluation.analysis import COMPARED, analyze, sampling_warning  # [stats]
from jaxrl.evaluation.censoring import load_resampled
from jaxrl.evaluation.episodes import EpisodeStream, episode_markdown, episode_record, episode_summary
from jaxrl.evaluation.protocol import read_protocol, refuse_overwrite
from jaxrl.evaluation.stats import write_results
from jaxrl.export.audit import FolderSource, MergedSource, audit
from jaxrl.export.merge import FIDELITY_WARN, is_lossy, read_provenance
from jaxrl.models.peft import LayoutError, is_peft_folder, mismatch_message, read_adapter, read_peft_adapter
from jaxrl.models.adapters import (ADAPTERS, AVERAGES, CHECKPOINTS, EMA, CheckpointNotFound, adapter_root,
                                   adapter_steps, run_folder)
from jaxrl.models.qwen35.config import load_hf_config
from jaxrl.parallel import distributed
from jaxrl.parallel.mesh import local_mesh
from jaxrl.rewards import get_reward
from jaxrl.backends.base import MODEL_KINDS, ModelSpec, SamplingParams
from jaxrl.backends.flags import (backend_field, backend_spec, max_lora_rank_field, mesh_shape_field, server_field,
                                  server_url_field, vllm_field)
from jaxrl.backends.jax_backend import DTYPES
from jaxrl.backends.options import ServerOptions, VLLMLaunchOptions
from jaxrl.backends.settings import BackendContext
from jaxrl.rollout.collect import Collector, Sample
from jaxrl.rollout.keys import problem_key
from jaxrl.rollout.runner import REWARD_HELP, check_model_folder
from jaxrl.rollout.sampling_loop import Counts, ProgressBar, SamplingLoop, on_disk
from jaxrl.rollout.writer import ResumableJsonl, settings_diff
from jaxrl.utils.io import ResumeError
from jaxrl.utils.dataclass_flags import NOT_A_FLAG, flag_field
from jaxrl.utils.seeds import seed_field
from jaxrl.utils.io import (OutputExistsError, atomic_write_json, atomic_write_text, folder_lock_file, sha256_file,
                            writer_lock)

__all__ = ["BASE", "CACHE_KEYS", "COMPARED", "EvalConfig", "Evaluator", "MODEL_KINDS", "ModelSpec", "ResumeError",
           "averaged_adapters", "checkpoint_specs", "default_reward_kwargs", "ema_name", "run_evaluation",
           "summarize"]

logger = logging.getLogger(__name__)

BASE = formats.BASE_MODEL
# The settings of evaluation over episodes; recorded (and compared on resume) only when --environment is set, so
# the caches of single-turn evaluations written before them still resume.
EPISODE_KEYS = ("environment", "environment_options", "max_turns", "max_episode_tokens")
# Settings a model's cached samples depend on; resuming with any other value is refused.
CACHE_KEYS = ("fingerprint", "adapter_digest", "temperature", "top_p", "top_k", "max_new_tokens", "enable_thinking",
              "reward", "reward_kwargs", "seed", "backend", "dtype", "tokenizer") + EPISODE_KEYS


@dataclasses.dataclass
class EvalConfig:
    """The settings of an evaluation; each field but `models` is also a flag of launchers.evaluate
    (jaxrl.evaluation.flags), its default and help declared here once."""

    problems: str = flag_field(help="problems.jsonl (canonical schema, docs/reference/interfaces.md).")
    base: str = flag_field(help="Base HF folder (default: model_path of the run's config.json).")
    out: str = flag_field(help="Output folder (default: <--checkpoints>/eval).")
    # ModelSpec; "base" is added first when absent (launchers.evaluate: --checkpoints, --adapters, --models)
    models: list = dataclasses.field(default_factory=list, metadata=NOT_A_FLAG)
    # names among `models` shown for reference (a distillation's teacher, launchers.evaluate --references): compared
    # with the baseline, never candidates (jaxrl.evaluation.analysis.analyze)
    references: tuple = dataclasses.field(default=(), metadata=NOT_A_FLAG)
    num_samples: int = flag_field(1, help="Samples per problem (n; pass@k for k <= n).")
    temperature: float = flag_field(0.0, help="0 = greedy.")
    top_p: float = flag_field(1.0, help="Nucleus mass in (0, 1].")
    top_k: int = flag_field(0, help="Top-k; 0 = off.")
    max_new_tokens: int = flag_field(8192, help="Completion cap (a sample hitting it is truncated).")
    max_prompt_len: int = flag_field(4096, help="Prompt budget after the chat template.")
    prompt_buckets: tuple[int, ...] = flag_field((), help="Prompt lengths with their own compiled program.")
    enable_thinking: bool = flag_field(False, help="Qwen3.5 thinking mode in the generation prompt.")
    reward: str = flag_field("code", help=REWARD_HELP + " code runs in LiveCodeBench-compatible mode.")
    reward_kwargs: dict = flag_field(default_factory=dict, help="JSON keyword arguments of the reward, e.g. "
                                                                "'{\"timeout_s\": 10, \"workers\": 8}'.")
    baseline: str = flag_field(BASE, help="The model every other one is compared with.")
    backend: str = backend_field()  # built from backend_spec(cfg) (jaxrl.backends.flags)
    server_url: Optional[str] = server_url_field()  # server | vllm: a running server
    server: ServerOptions = server_field()  # server | vllm: the --server_* flags
    vllm: VLLMLaunchOptions = vllm_field()  # vllm without server_url: the --vllm_* flags
    vllm_max_lora_rank: int = max_lora_rank_field()
    truncation_threshold: float = flag_field(0.10, help="Warn when more completions than this hit the cap.")
    seed: int = seed_field(0, help="Sampling and bootstrap seed.")
    dtype: str = flag_field("bfloat16", choices=DTYPES, help="Compute dtype.")
    batch_size: int = flag_field(64, help="Samples per compiled batch (jax backend); samples in flight at once "
                                          "(server backends: vLLM wants hundreds).")
    limit: int = flag_field(0, help="Only the first N problems (0 = all).")
    on_overlong: str = flag_field("skip", choices=OVERLONG_POLICIES, help="Over-long prompts.")
    n_resamples: int = flag_field(10000, help="Bootstrap resamples.")
    confidence: float = flag_field(0.95, help="Interval confidence level.")
    progress: bool = flag_field(True, help="Progress bars.")
    mesh_shape: Optional[tuple[int, ...]] = mesh_shape_field()  # jax backend: (data, fsdp, tensor) over this
    #                                     process's devices; None = one device without a mesh
    overwrite: bool = flag_field(False, help="Replace the results in --out of models or prompts this run leaves "
                                             "out (without it a narrower rerun is refused).")
    environment: str = flag_field("", help="Evaluate multi-turn episodes of this environment ('' = single "
                                           "completions): code_feedback, python_tool, a registered plug-in name, or a "
                                           "plug-in path file.py:Class (docs/guides/episodes.md).")
    environment_options: dict = flag_field(default_factory=dict, help="JSON options of --environment, e.g. "
                                                                      "'{\"public_tests\": 1}'.")
    max_turns: int = flag_field(1, help="Turns of an episode at most (--environment); results report solved "
                                        "within t turns for t = 1..max_turns.")
    max_episode_tokens: int = flag_field(0, help="Tokens of an episode after its prompt (turns and observations); "
                                                 "0 = max_turns x (max_new_tokens + max_prompt_len).")


def check_values(cfg: EvalConfig) -> SamplingParams:
    """Every value of `cfg` that is not a file: ValueError naming each bad one; returns the sampling parameters."""
    sampling = SamplingParams(n=cfg.num_samples, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)
    bad = []
    if not 0.0 <= cfg.truncation_threshold < 1.0:
        bad.append(f"truncation_threshold must be in [0, 1), got {cfg.truncation_threshold}")
    if not 0.0 < cfg.confidence < 1.0:
        bad.append(f"confidence must be in (0, 1) (0.95 for 95%), got {cfg.confidence}")
    for key, minimum in (("n_resamples", 1), ("batch_size", 1), ("limit", 0), ("max_prompt_len", 1)):
        if int(getattr(cfg, key)) < minimum:
            bad.append(f"{key} must be >= {minimum}, got {getattr(cfg, key)}")
    if any(int(b) < 1 for b in cfg.prompt_buckets):
        bad.append(f"prompt_buckets must be positive, got {list(cfg.prompt_buckets)}")
    if int(cfg.max_turns) < 1:
        bad.append(f"max_turns must be >= 1, got {cfg.max_turns}")
    elif not cfg.environment and (int(cfg.max_turns) != 1 or cfg.max_episode_tokens or cfg.environment_options):
        bad.append("max_turns, max_episode_tokens and environment_options need environment (episodes)")
    if cfg.environment and 0 < int(cfg.max_episode_tokens) < int(cfg.max_new_tokens):
        bad.append(f"max_episode_tokens={cfg.max_episode_tokens} cannot hold one turn of max_new_tokens="
                   f"{cfg.max_new_tokens}")
    elif int(cfg.max_episode_tokens) < 0:
        bad.append(f"max_episode_tokens must be >= 0, got {cfg.max_episode_tokens}")
    if bad:
        raise ValueError("; ".join(bad))
    return sampling


def episode_tokens(cfg: EvalConfig) -> int:
    """The token budget of an episode after its prompt (`max_episode_tokens`, 0: room for every turn and after
    each an observation as long as a prompt may be)."""
    return int(cfg.max_episode_tokens) or int(cfg.max_turns) * (int(cfg.max_new_tokens) + int(cfg.max_prompt_len))


def check_episode_fits(cfg: EvalConfig, context: int, base: str) -> None:
    """ValueError naming the flag when an episode (its prompt and its token budget) is longer than the model's
    context: positions the model was never given, and a session row (the jax backend's caches) sized by the budget
    that no device holds (--max_turns=1000000 asked for terabytes). Checked before anything is loaded or
    written."""
    if not cfg.environment:
        return
    budget = episode_tokens(cfg)
    if int(cfg.max_prompt_len) + budget <= context:
        return
    room = context - int(cfg.max_prompt_len)
    if cfg.max_episode_tokens:
        flag, source = f"--max_episode_tokens={cfg.max_episode_tokens}", "max_episode_tokens"
        fix = f"set --max_episode_tokens to at most {room}"
    else:
        flag, source = f"--max_turns={cfg.max_turns}", "max_turns x (max_new_tokens + max_prompt_len)"
        fix = f"lower --max_turns, or set --max_episode_tokens (at most {room} here)"
    if room < int(cfg.max_new_tokens):  # not even one turn fits after the prompt
        fix = f"lower --max_prompt_len (the prompt leaves {max(room, 0)} tokens, max_new_tokens={cfg.max_new_tokens})"
    raise ValueError(f"{flag}: an episode of up to {cfg.max_prompt_len} prompt + {budget} tokens ({source}) is longer "
                     f"than the context of the model in {base} ({context} tokens, max_position_embeddings); {fix}")


def holds_records(path: Path) -> bool:
    """Whether a JSONL file holds a complete line (a torn last line, cut off on the next start, does not count)."""
    if not path.exists():
        return False
    data = path.read_bytes()
    return bool(data[:data.rfind(b"\n") + 1].strip())


def recorded_settings_differ(log: ResumableJsonl) -> bool:
    """Whether `log`'s settings record exists and differs from its settings in a compared key."""
    if not log.meta_path.exists():
        return False
    with open(log.meta_path, encoding="utf-8") as f:
        recorded = json.load(f).get("settings", {})
    return bool(settings_diff(recorded, log.settings, log.compare))


def environment_factory(name: str):
    """The environment class of --environment: a registered name, or a plug-in `file.py:Class` loaded (and checked
    on an example episode) here. ValueError naming the flag otherwise."""
    if ":" in name:
        try:
            return plugins.load("environment", name)
        except Exception as e:  # noqa: BLE001 - one line naming the flag
            raise ValueError(f"--environment={name!r}: {e}") from None
    try:
        return ENVIRONMENTS.get(name)
    except KeyError:
        raise ValueError(f"--environment={name!r}: no such environment (registered: "
                         f"{', '.join(plugins.names('environment'))}; or a plug-in file.py:Class)") from None


def default_reward_kwargs(name: str) -> dict:
    """The code verifier in LiveCodeBench-compatible mode (its import preamble and int limit), as the users'
    LCB numbers were produced; toy rewards take none."""
    return {"lcb_compat": True} if name == "code" else {}


def checkpoint_specs(workdir: str, steps: Optional[Sequence[int | str]] = None) -> list[ModelSpec]:
    """The candidates of a run: `step_<N>` for every adapter checkpoint, `ema_<N>` for every EMA adapter
    (checkpoints/ema/<N>, config `ema.decay`) and every averaged adapter under `<run>/averages/` (launchers.export
    --average), named by its folder; or only those `steps` lists: step numbers (or `step_<N>`), `ema_<N>`, average
    names. CheckpointNotFound names what is missing and what the run holds."""
    root = adapter_root(workdir)
    if root is None:
        raise CheckpointNotFound(f"{os.path.abspath(workdir)}: no {CHECKPOINTS}/{ADAPTERS} folder (not a run "
                                 "workdir)")
    root = os.path.join(os.path.dirname(root), ADAPTERS)  # --checkpoints=RUN/checkpoints/ema names the same run
    ema_root = os.path.join(os.path.dirname(root), EMA)
    found = {formats.checkpoint_name(s): ModelSpec(formats.checkpoint_name(s), "adapter", os.path.join(root, str(s)),
                                                    step=s) for s in adapter_steps(root)}
    found.update({ema_name(s): ModelSpec(ema_name(s), "adapter", os.path.join(ema_root, str(s)))
                  for s in adapter_steps(root, EMA)})
    found.update({name: ModelSpec(name, "adapter", folder) for name, folder in averaged_adapters(workdir).items()})
    if not steps:
        return list(found.values())
    wanted = [formats.checkpoint_name(int(s)) if str(s).isdigit() else str(s) for s in steps]
    missing = [w for w in wanted if w not in found]
    if missing:
        raise CheckpointNotFound(f"{workdir}: no candidate {', '.join(missing)} (steps are numbers, EMA adapters "
                                 f"ema_<N>, averages their folder names under {AVERAGES}/); present: "
                                 f"{', '.join(found) or 'none'}")
    return [found[w] for w in dict.fromkeys(wanted)]


def ema_name(step: int) -> str:
    """`ema_<N>`: the model name of the EMA adapter saved with the checkpoint of step N."""
    return f"ema_{int(step)}"


def averaged_adapters(workdir: str) -> dict[str, str]:
    """{folder name: folder} of the averaged adapters under `<run>/averages/` (PEFT folders whose jaxrl_export.json
    records an `average`); any other folder there is left out with a warning naming it."""
    folder = os.path.join(run_folder(workdir), AVERAGES)
    if not os.path.isdir(folder):
        return {}
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue  # an export in progress writes a hidden temporary sibling
        if is_peft_folder(path) and (read_provenance(path) or {}).get("average"):
            out[name] = path
        else:
            logger.warning("%s: not an averaged adapter (a PEFT folder written by launchers.export --average); left "
                           "out of the run's candidates", path)
    return out



def _scored_by(ev: Mapping) -> str:
    """What scored the samples, as results.md says it: the reward (single completions) or, over episodes, the
    environment (its reward is the episode's return; the `reward` setting is not used)."""
    if ev.get("environment"):
        return (f"episodes of environment `{ev['environment']}` {json.dumps(ev.get('environment_options') or {})} "
                f"(up to {ev['max_turns']} turns, {ev['max_episode_tokens']} tokens), scored by their return")
    return f"reward `{ev['reward']}` {json.dumps(ev['reward_kwargs'])}"

class Evaluator:
    """One evaluation (module docstring). `run()` does everything; the pieces are public for tools and tests.

    model / tokenizer / reward: already built objects (a loaded base model for the jax backend, a tokenizer, a
    Reward), to skip loading them from the config.
    """

    def __init__(self, cfg: EvalConfig, *, model=None, tokenizer=None, reward=None, backend=None):
        self.sampling = check_values(cfg)  # bad values fail here, before anything is loaded or written
        self.cfg = cfg
        self.out = Path(cfg.out)
        specs = list(cfg.models)
        if not any(s.name == BASE for s in specs):
            specs.insert(0, ModelSpec(BASE, "base"))
        names = [s.name for s in specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {dupes}")
        if cfg.baseline not in names:
            raise ValueError(f"baseline {cfg.baseline!r} is not among the models {names}")
        stray = [n for n in cfg.references if n not in names or n == cfg.baseline]
        if stray:
            raise ValueError(f"reference rows {stray} must be models of this evaluation other than the baseline "
                             f"{cfg.baseline!r}")
        self.specs = {s.name: s for s in specs}

        problems = load_problems(cfg.problems)
        if cfg.limit:
            problems = problems[: cfg.limit]
        ids = [p.id for p in problems]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{cfg.problems}: problem ids repeat")
        if tokenizer is None:
            check_model_folder(cfg.base, "--base")  # a mistyped path: one line, not the tokenizer's traceback
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.base)
        base_cfg, self.base_layout, _ = load_hf_config(cfg.base)
        self.stop_ids = chat_stop_ids(self.tokenizer, base_cfg.eos_token_id)
        enc = encode_prompts(self.tokenizer, [p.messages for p in problems], cfg.enable_thinking,
                             cfg.max_prompt_len, on_overlong=cfg.on_overlong, names=ids)
        self.n_problems_total = len(problems)
        self.skipped = [{"problem_id": problems[i].id, "prompt_tokens": n} for i, n in enc.skipped]
        self.problems = [problems[i] for i in enc.kept]
        self.prompts = {problems[i].id: list(p) for i, p in zip(enc.kept, enc.ids)}
        if not self.problems:
            raise ValueError(f"{cfg.problems}: no problem fits max_prompt_len={cfg.max_prompt_len}")
        self.by_id = {p.id: p for p in self.problems}
        self._adapters: dict = {}
        for spec in self.specs.values():  # every model folder and adapter readable, before any model is loaded
            if spec.kind == "hf":
                check_model_folder(spec.path, f"--models={spec.name}")
                load_hf_config(spec.path)
            self.adapter(spec.name)
        self.replaced = self.check_output()

        if reward is None:
            reward = get_reward(cfg.reward, **{**default_reward_kwargs(cfg.reward), **cfg.reward_kwargs})
        self.reward = reward
        self.reward_kwargs = {**default_reward_kwargs(cfg.reward), **cfg.reward_kwargs}
        self.environment = environment_factory(cfg.environment) if cfg.environment else None
        check_episode_fits(cfg, base_cfg.max_position_embeddings, cfg.base)  # before the backend sizes its rows
        # episodes: the last turn's prompt is the first prompt and the episode so far
        longest = cfg.max_prompt_len + (episode_tokens(cfg) - cfg.max_new_tokens if cfg.environment else 0)
        if backend is None:
            mesh = local_mesh(cfg.mesh_shape) if cfg.backend == "jax" and cfg.mesh_shape is not None else None
            backend = backend_spec(cfg).build(BackendContext(
                cfg.base, stop_ids=tuple(self.stop_ids), max_prompt_len=longest, max_new_tokens=cfg.max_new_tokens,
                pad_id=self.tokenizer.pad_token_id, model=model, dtype=cfg.dtype, seed=cfg.seed,
                batch_size=cfg.batch_size, prompt_buckets=tuple(cfg.prompt_buckets) or None, mesh=mesh,
                out_dir=str(self.out), lora_rank=cfg.vllm_max_lora_rank))
        self.backend = backend
        self.collector = Collector(backend, reward, tokenizer=self.tokenizer, stop_ids=self.stop_ids)
        self.episodes = None
        if self.environment is not None:
            self.episodes = EpisodeStream(EpisodeRunner(
                self.collector, self.environment, tokenizer=self.tokenizer, enable_thinking=cfg.enable_thinking,
                max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens, max_episode_tokens=episode_tokens(cfg),
                max_prompt_len=cfg.max_prompt_len, options=dict(cfg.environment_options)))
        self.audit_report: Optional[dict] = None
        self._loaded: Optional[str] = None
        self.tokenizer_digest = _tokenizer_digest(cfg.base)

    # ---------------------------------------------------------------------------------------------------- output
    def check_output(self) -> list[str]:
        """Refuses (OutputExistsError) an `out` whose results.json holds models or prompts this run does not have,
        unless cfg.overwrite; returns the names of the models whose results would be replaced (overwrite).
        ProtocolError for --overwrite into a folder that holds a confirmation (protocol.refuse_overwrite)."""
        if self.cfg.overwrite:
            refuse_overwrite(self.out)
        path = self.out / formats.RESULTS_FILE
        if not path.exists():
            return []
        old = formats.read_results(path)
        old_models = list(old["models"])
        old_ids = self._result_problem_ids(old, old_models)
        new_ids = sorted(self.by_id)
        missing = [m for m in old_models if m not in self.specs]
        same_prompts = old_ids == new_ids if old_ids is not None else (
            (old.get("evaluation") or {}).get("n_problems") == len(new_ids))
        if not missing and same_prompts:
            return []
        if self.cfg.overwrite:
            return missing
        n_old = len(old_ids) if old_ids is not None else (old.get("evaluation") or {}).get("n_problems")
        what = []
        if missing:
            what.append(f"models {', '.join(missing)} that this run does not evaluate")
        if not same_prompts:
            what.append(f"{n_old} prompts where this run has {len(new_ids)}")
        raise OutputExistsError(
            f"{path}: holds the results of {len(old_models)} model(s) on {n_old} prompts, with "
            f"{' and '.join(what)}; rerunning would replace them: evaluate the same models and prompts (that "
            f"resumes and adds to them), choose another --out, or pass --overwrite")

    def _result_problem_ids(self, results: Mapping, models: Sequence[str]) -> Optional[list]:
        """The problem ids of an earlier evaluation (its samples files), or None when it left none."""
        for name in models:
            path = formats.samples_path(self.out, name)
            if path.exists():
                return sorted({str(r["problem_id"]) for r in formats.read_samples(path)})
        return None

    # --------------------------------------------------------------------------------------------------- weights
    def adapter(self, name: str):
        """The Adapter of model `name` (None for base / HF folders); PEFT adapters must match the base layout."""
        spec = self.specs[name]
        if spec.kind != "adapter":
            return None
        if name not in self._adapters:
            if is_peft_folder(spec.path):
                adapter, layout = read_peft_adapter(spec.path)
                if layout != self.base_layout.kind:
                    raise LayoutError(mismatch_message(layout, self.base_layout.kind, spec.path))
            else:
                adapter = read_adapter(spec.path)
            self._adapters[name] = adapter
        return self._adapters[name]

    def source(self, name: str):
        """The audit source of model `name` (what its fingerprint is computed from)."""
        spec = self.specs[name]
        if spec.kind == "base":
            return FolderSource(self.cfg.base)
        if spec.kind == "hf":
            return FolderSource(spec.path)
        return MergedSource(self.cfg.base, self.adapter(name))

    def run_audit(self) -> dict:
        """Fingerprints every model and compares it with the base; writes `out/audit.json`."""
        if self.audit_report is None:
            t0 = time.perf_counter()
            self.audit_report = audit({n: self.source(n) for n in self.specs}, reference=BASE)
            if distributed.is_main_process():
                atomic_write_json(self.out / "audit.json", self.audit_report)
            logger.info("weight audit of %d models: %.1f s", len(self.specs), time.perf_counter() - t0)
        return self.audit_report

    def load(self, name: str) -> None:
        """Makes `name` the backend's model and proves it carries the intended adapter."""
        if self._loaded == name:
            return
        adapter = self.adapter(name)
        self.backend.load(self.specs[name], adapter)
        got = self.backend.loaded_digest()
        want = adapter.digest() if adapter is not None else None
        if got != want:
            raise RuntimeError(f"model {name!r}: the backend carries adapter digest {got}, expected {want} "
                               "(the evaluation would score other weights than the ones named)")
        served = self.backend.served_fingerprint()
        expected = self.run_audit()["fingerprints"][name]
        if served is not None and served != expected:
            raise RuntimeError(f"model {name!r}: the backend serves weights with fingerprint {served[:12]}, the "
                               f"audit expects {expected[:12]} (a stale or foreign merged folder?)")
        self._loaded = name

    # ----------------------------------------------------------------------------------------------------- cache
    def settings(self, name: str) -> dict:
        cfg = self.cfg
        adapter = self.adapter(name)
        return {"model": dataclasses.asdict(self.specs[name]), "base": os.path.abspath(cfg.base),
                "fingerprint": self.run_audit()["fingerprints"][name],
                "adapter_digest": adapter.digest() if adapter is not None else None,
                "adapter_step": adapter.step if adapter is not None else None,  # what a run folder resolved to
                "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                "max_new_tokens": cfg.max_new_tokens, "enable_thinking": cfg.enable_thinking,
                "reward": cfg.reward, "reward_kwargs": self.reward_kwargs, "seed": cfg.seed,
                "backend": self.backend.name or cfg.backend,
                "dtype": cfg.dtype, "tokenizer": self.tokenizer_digest, **self.episode_settings()}

    def episode_settings(self) -> dict:
        """The EPISODE_KEYS of an evaluation over episodes ({} for single completions)."""
        cfg = self.cfg
        if not cfg.environment:
            return {}
        return {"environment": cfg.environment, "environment_options": dict(cfg.environment_options),
                "max_turns": int(cfg.max_turns), "max_episode_tokens": episode_tokens(cfg)}

    def cache_path(self, name: str) -> Path:
        return self.out / "cache" / f"{name}.jsonl"

    def cache(self, name: str) -> ResumableJsonl:
        """Model `name`'s resume cache (its settings are the ones its samples depend on, CACHE_KEYS). A cache file
        (or part file) without a sample binds no settings: its settings record is dropped here, so an evaluation
        that failed before its first sample (a backend out of memory, a crash) never refuses the corrected
        command."""
        log = ResumableJsonl(self.cache_path(name), self.settings(name), compare=CACHE_KEYS, what="samples",
                             hint="evaluate into another --out, or delete this model's cache to start it over")
        for file in on_disk(log):
            # only another run's settings: a part file of this run (another process) may be between its start and
            # its first sample
            if not holds_records(file.path) and recorded_settings_differ(file):
                file.meta_path.unlink(missing_ok=True)  # another process of this run may have dropped it
                logger.info("%s: holds no samples; the settings of the run that created it are dropped", file.path)
        return log

    def cached_records(self, log: ResumableJsonl) -> dict[tuple[str, int], dict]:
        """The usable records of a model's cache: of this evaluation's problems, drawn for their current version."""
        cached: dict[tuple[str, int], dict] = {}
        stale = 0
        for _, rec in log.read():
            problem = self.by_id.get(rec.get("problem_id"))
            if problem is None:
                continue  # another --limit / problems subset: kept in the file, unused here
            if rec.get("problem_fingerprint") != problem.fingerprint:
                stale += 1  # the problem (e.g. its tests) changed: the score is void, draw again
                continue
            cached[(rec["problem_id"], int(rec["sample_index"]))] = rec  # a later line wins
        if stale:
            logger.warning("%s: %d cached samples belong to problems that changed since; drawing them again",
                           log.path, stale)
        return cached

    # ---------------------------------------------------------------------------------------------- generation
    def record(self, sample: Sample, problem_id: str, max_new_tokens: int) -> dict:
        """One SAMPLES record (jaxrl.data.formats) of a scored sample."""
        r = sample.result
        return {"problem_id": problem_id, "sample_index": sample.sample_index, "completion": sample.text,
                "completion_tokens": len(sample.tokens), "finish_reason": sample.finish_reason,
                "partial": float(r.partial), "strict": bool(r.strict), "tests": list(r.tests), "reason": r.reason,
                "max_new_tokens": int(max_new_tokens), "prompt_tokens": len(self.prompts[problem_id]),
                "problem_fingerprint": self.by_id[problem_id].fingerprint}

    def collect(self, problem_ids: Sequence[str], sampling: SamplingParams,
                wanted=None) -> list[dict]:
        """Samples, decodes and scores `sampling.n` completions of each problem with the loaded model."""
        samples = self.collector.collect([self.prompts[pid] for pid in problem_ids],
                                         [problem_key(pid) for pid in problem_ids],
                                         [self.by_id[pid] for pid in problem_ids], sampling, wanted=wanted)
        return [self.record(s, problem_ids[s.prompt_index], sampling.max_new_tokens) for s in samples]

    def sample_model(self, name: str, on_batch: Optional[Callable[[dict], None]] = None) -> list[dict]:
        """Draws (or resumes) model `name`'s samples; returns its records in problem order, then sample index.
        Several processes: this process's share into its part of the cache, then the parts merged (module
        docstring; the loop: jaxrl.rollout.sampling_loop)."""
        cfg = self.cfg
        log = self.cache(name)
        cached: dict[tuple[str, int], dict] = {}
        for source in on_disk(log):  # the cache, then the parts of several processes not merged yet
            for key, rec in self.cached_records(source).items():
                cached.setdefault(key, rec)
        loop = SamplingLoop(log, [(p, self.prompts[p.id]) for p in self.problems], cfg.num_samples, cached,
                            label=f"evaluation {self.out} {name}")

        def record(sample, problem, prompt: list[int]) -> dict:
            rec = (self.record(sample, problem.id, self.sampling.max_new_tokens) if self.episodes is None else
                   episode_record(sample.episode, problem.id, max_new_tokens=self.sampling.max_new_tokens,
                                  problem_fingerprint=problem.fingerprint))
            cached[(problem.id, rec["sample_index"])] = rec
            return rec

        def report(counts: Counts) -> None:
            on_batch({"model": name, "problems_done": counts.batch_problems})

        loop.run(self.collector, self.sampling, record,
                 stop_message=lambda counts: self._stop_message(name), prepare=lambda: self.load(name),
                 progress=ProgressBar(name, unit="problem") if cfg.progress else None,
                 on_batch=report if on_batch is not None else None, stream=self.episodes)
        loop.finish(keep=self._current)
        if loop.processes > 1:
            cached = self.cached_records(log)
        return [cached[(p.id, i)] for p in self.problems for i in range(cfg.num_samples)]

    def _current(self, record: dict) -> bool:
        """A cached record of this evaluation's problems, drawn for their current version."""
        problem = self.by_id.get(record.get("problem_id"))
        return problem is not None and record.get("problem_fingerprint") == problem.fingerprint

    # ------------------------------------------------------------------------------------------------- results
    def lock(self):
        """The lock of this evaluation's folder (one writer per --out; jaxrl.utils.io.writer_lock), held by process 0
        (the other processes write only their part files); re-entrant."""
        if not distributed.is_main_process():
            return contextlib.nullcontext()
        return writer_lock(folder_lock_file(self.out), self.out,
                           hint="wait for it to finish, or evaluate into another --out")

    def run(self, on_batch: Optional[Callable[[dict], None]] = None) -> dict:
        """Audit, sample every model (resuming), write samples, results.json and results.md; returns results."""
        with self.lock():
            return self._run(on_batch)

    def _run(self, on_batch: Optional[Callable[[dict], None]]) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        main = distributed.is_main_process()
        report = self.run_audit()
        for name in self.replaced:  # --overwrite: the old results of models this run leaves out go with them
            formats.samples_path(self.out, name).unlink(missing_ok=True)
            logger.warning("%s: removed the samples of %s (not part of this evaluation; --overwrite)", self.out,
                           name)
        records = {}
        for name in self.specs:
            t0 = time.perf_counter()
            records[name] = self.sample_model(name, on_batch=on_batch)
            if main:
                formats.write_samples(formats.samples_path(self.out, name), records[name])
            logger.info("%s: %d samples in %.1f s", name, len(records[name]), time.perf_counter() - t0)
        if jax.process_count() == 1:
            return self.write(records, report)
        results = self.write(records, report) if main else None  # process 0 alone writes the results ...
        distributed.barrier(f"evaluation {self.out}: results written")
        return results if main else formats.read_results(self.out)  # ... which every process returns

    def _stop_message(self, name: str) -> str:
        done = sum(1 for _ in self.cache_path(name).open()) if self.cache_path(name).exists() else 0
        return (f"evaluation stopped while sampling {name} ({done} samples in {self.cache_path(name)}); rerun the "
                f"same command to resume")

    def summarize(self, records: Mapping[str, Sequence[Mapping]]) -> tuple[dict, list]:
        """:func:`summarize` with this evaluation's baseline and bootstrap settings."""
        cfg = self.cfg
        return summarize(records, cfg.baseline, n_resamples=cfg.n_resamples, confidence=cfg.confidence,
                         seed=cfg.seed)

    def write(self, records: Mapping[str, Sequence[Mapping]], report: Optional[dict] = None,
              out: Optional[str] = None) -> dict:
        """results.json + results.md for `records` ({model: SAMPLES records}) into `out` (default: the
        evaluation's folder); returns the validated results."""
        cfg = self.cfg
        report = report or self.run_audit()
        out_dir = Path(out) if out else self.out
        # [stats] The statistics of results.json (jaxrl.evaluation.analysis): comparisons with simultaneous
        # intervals, the selection-adjusted gain, censoring (using re-sampled records kept under
        # out/resampled/<cap>/, see launchers.evaluate --resample_max_new_tokens), power, and the claim labels
        # of out/protocol.json (select on dev, confirm once on held-out).
        stats = analyze(records, cfg.baseline, n_resamples=cfg.n_resamples, confidence=cfg.confidence,
                        seed=cfg.seed, resampled=load_resampled(out_dir), protocol=read_protocol(self.out),
                        problems=cfg.problems, references=cfg.references)
        metrics, comps = stats.pop("models"), stats.pop("comparisons")
        warnings = [w for w in [sampling_warning(cfg.temperature, cfg.num_samples)] if w] + stats.pop("warnings")
        if cfg.environment:  # solved within t turns, turns and tokens per episode (jaxrl.evaluation.episodes)
            for name, recs in records.items():
                metrics[name]["episodes"] = episode_summary(recs, cfg.max_turns, cfg.confidence)
            failed = {name: m["episodes"]["failed"] for name, m in metrics.items() if m["episodes"]["failed"]}
            if failed:
                warnings.append(f"episodes failed (their environment raised; scored 0, the error in the samples' "
                                f"reason): {failed}")
        if self.skipped:
            warnings.append(f"{len(self.skipped)} of {self.n_problems_total} problems were skipped (prompt over "
                            f"max_prompt_len={cfg.max_prompt_len} tokens); every model was scored on the other "
                            f"{len(self.problems)}")
        for group in report["same_weights"]:
            warnings.append(f"models {', '.join(group)} have bit-identical language weights (fingerprint "
                            f"{report['fingerprints'][group[0]][:12]}): they are the same model")
        for name, m in metrics.items():
            spec = self.specs[name]
            entry = report["models"][name]
            lossy = self._merge_fidelity(name)
            if lossy is not None:
                m["merge_fidelity"] = lossy
                if lossy["lossy"]:
                    warnings.append(
                        f"model {name} is a merged export that kept its adapter's update only approximately "
                        f"(update_rel_error {lossy['update_rel_error']:.3g}, merged in "
                        f"{lossy['merge_dtype']}; {spec.path}/jaxrl_export.json): its scores are those of the "
                        f"rounded model, not of the checkpoint it was merged from")
            m["step"] = spec.step
            m["fingerprint"] = entry["fingerprint"]
            m["adapter_digest"] = self.adapter(name).digest() if spec.kind == "adapter" else None
            m["adapter_step"] = self.adapter(name).step if spec.kind == "adapter" else None
            # an averaged or EMA adapter: what it averages (the report draws it beside those steps)
            m["average"] = self.adapter(name).average if spec.kind == "adapter" else None
            m["source"] = {"kind": spec.kind, "path": os.path.abspath(spec.path) if spec.path else
                           os.path.abspath(cfg.base)}
            if name != BASE:
                m["weights_vs_base"] = {"changed_tensors": len(entry["changed"]),
                                        "max_abs_diff": entry["language"]["max_abs_diff"],
                                        "rel_delta_norm": entry["language"]["rel_delta_norm"]}
        extra = {"max_new_tokens": cfg.max_new_tokens,
                 "evaluation": {"problems": os.path.abspath(cfg.problems), "n_problems": len(self.problems),
                                "skipped_problems": self.skipped, "num_samples": cfg.num_samples,
                                "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                                "enable_thinking": cfg.enable_thinking, "reward": cfg.reward,
                                "max_new_tokens": cfg.max_new_tokens, "max_prompt_len": cfg.max_prompt_len,
                                "on_overlong": cfg.on_overlong,
                                "reward_kwargs": self.reward_kwargs, "backend": cfg.backend, "dtype": cfg.dtype,
                                "seed": cfg.seed, "baseline": cfg.baseline, "base": os.path.abspath(cfg.base),
                                **self.episode_settings(),
                                "truncation_threshold": cfg.truncation_threshold,
                                "bootstrap": {"n_resamples": cfg.n_resamples, "confidence": cfg.confidence,
                                              "seed": cfg.seed, "unit": "prompt"}},
                 "audit": "audit.json", **stats}  # [stats] family, selection, censoring, protocol
        json_path, md_path = write_results(out_dir, metrics, comps, warnings=warnings,
                                           max_new_tokens=cfg.max_new_tokens,
                                           truncation_threshold=cfg.truncation_threshold, extra=extra)
        results = formats.read_results(json_path)
        atomic_write_text(md_path, md_path.read_text(encoding="utf-8") + episode_markdown(results["models"])
                          + self._md_details(results))
        return results

    def _merge_fidelity(self, name: str) -> Optional[dict]:
        """What a merged export (a model of kind "hf" with jaxrl_export.json) kept of its adapter, else None."""
        spec = self.specs[name]
        info = read_provenance(spec.path) if spec.kind == "hf" else None
        fidelity = (info or {}).get("merge_fidelity")
        if not fidelity:
            return None
        return {"update_rel_error": fidelity["update_rel_error"], "zeroed_fraction": fidelity.get("zeroed_fraction"),
                "merge_dtype": info.get("merge_dtype", "stored"), "threshold": FIDELITY_WARN,
                "lossy": is_lossy(info), "logits_rel_error": (fidelity.get("logits") or {}).get("rel_error")}

    def _md_details(self, results: Mapping) -> str:
        ev = results["evaluation"]
        lines = ["", "## Weights (audit.json)", "",
                 "Fingerprint: sha256 of the language tower of base + adapter merged in the stored dtype (a label "
                 "of the weights; adapters are sampled unmerged). Equal fingerprints mean the same weights.", "",
                 "| model | step | fingerprint | adapter digest | tensors changed vs base | max abs diff | "
                 "rel. delta norm |", "|---|---|---|---|---|---|---|"]
        for name, m in results["models"].items():
            w = m.get("weights_vs_base") or {}
            rel = w.get("rel_delta_norm")
            lines.append(f"| {name} | {'–' if m.get('step') is None else m['step']} | `{m['fingerprint'][:12]}` | "
                         f"{'`' + m['adapter_digest'][:12] + '`' if m.get('adapter_digest') else '–'} | "
                         f"{w.get('changed_tensors', '–')} | "
                         f"{'–' if not w else format(w['max_abs_diff'], '.3g')} | "
                         f"{'–' if rel is None else format(rel, '.3g')} |")
        lines += ["", "## Settings", "",
                  f"{ev['n_problems']} problems ({len(ev['skipped_problems'])} skipped as over-long) from "
                  f"`{ev['problems']}`; {ev['num_samples']} sample(s) a problem at temperature "
                  f"{ev['temperature']} (top_p {ev['top_p']}, top_k {ev['top_k']}), cap "
                  f"{results['max_new_tokens']} new tokens, thinking {'on' if ev['enable_thinking'] else 'off'}; "
                  f"{_scored_by(ev)}; backend {ev['backend']} "
                  f"({ev['dtype']}); seed {ev['seed']}. Intervals: paired over prompts, "
                  f"{ev['bootstrap']['confidence']:.0%}; sign-flip patterns and max-T bootstrap resamples: "
                  f"{ev['bootstrap']['n_resamples']}.", ""]
        return "\n".join(lines)

    # ------------------------------------------------------------------------------------- termination analysis
    def resample_fn(self, name: str):
        """`resample_fn(problem_ids, max_new_tokens) -> SAMPLES records` for
        `jaxrl.diagnostics.termination.resample_truncated` on model `name`'s samples.

        The k-th occurrence of a problem id redraws the k-th truncated sample of that problem (in the samples'
        order) with the same key, so on the jax backend it continues the same random stream past the old cap
        (greedy: the very same completion, only longer). Ids beyond the known truncated samples take indices
        0, 1, ... Nothing is cached: re-sampling is an analysis, not part of the evaluation.
        """
        truncated: dict[str, list[int]] = {}
        path = formats.samples_path(self.out, name)
        if path.exists():
            for rec in formats.read_samples(path):
                if rec["finish_reason"] == "length":
                    truncated.setdefault(rec["problem_id"], []).append(int(rec["sample_index"]))

        def resample(problem_ids: Sequence[str], max_new_tokens: int) -> list[dict]:
            wanted: list[tuple[str, int]] = []
            seen: dict[str, int] = {}
            for pid in problem_ids:
                if pid not in self.by_id:
                    raise KeyError(f"resample_fn: problem {pid!r} is not part of this evaluation")
                k = seen.get(pid, 0)
                seen[pid] = k + 1
                known = truncated.get(pid, [])
                wanted.append((pid, known[k] if k < len(known) else k))
            if not wanted:
                return []
            wanted_set = set(wanted)
            self.load(name)
            unique = list(dict.fromkeys(pid for pid, _ in wanted))
            n = max(i for _, i in wanted) + 1
            sampling = self.sampling.replace(n=n, max_new_tokens=int(max_new_tokens))
            by_key = {(r["problem_id"], r["sample_index"]): r for r in self.collect(
                unique, sampling, wanted=lambda j, i: (unique[j], i) in wanted_set)}
            return [by_key[key] for key in wanted]

        return resample

    def close(self) -> None:
        self.collector.close()


def summarize(records: Mapping[str, Sequence[Mapping]], baseline: str = BASE, *, metrics: Sequence[str] = COMPARED,
              n_resamples: int = 10000, confidence: float = 0.95, seed: int = 0) -> tuple[dict, list]:
    """(per-model metrics, comparisons with the baseline) from {model: SAMPLES records}: the metric path of
    results.json (`jaxrl.evaluation.analysis.analyze`: per-model metrics with intervals; comparisons whose interval
    agrees with their test, with the family's simultaneous intervals), usable on any records, e.g. a fixed set of
    completions."""
    # [stats] one statistics path for summarize() and write()
    out = analyze(records, baseline, metrics=metrics, n_resamples=n_resamples, confidence=confidence, seed=seed)
    return out["models"], out["comparisons"]


def _tokenizer_digest(folder: str) -> str:
    """sha256 over the tokenizer / chat-template files of the base (they define the prompts)."""
    h = hashlib.sha256()
    for fname in sorted(os.listdir(folder)):
        if fname.startswith("tokenizer") or fname.startswith("chat_template") or fname in (
                "vocab.json", "merges.txt", "special_tokens_map.json"):
            h.update(fname.encode() + b"\0" + sha256_file(os.path.join(folder, fname)).encode())
    return h.hexdigest()


def run_evaluation(cfg: EvalConfig, **kwargs) -> dict:
    """`Evaluator(cfg, **kwargs).run()`, closing the reward's sandboxes and the backend afterwards."""
    ev = Evaluator(cfg, **kwargs)
    try:
        return ev.run()
    finally:
        ev.close()
