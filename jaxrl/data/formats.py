"""The files the diagnostics and the report read: their single definition, readers and validators.

The trainer and the evaluator WRITE these; this module is the contract they write to. Every reader raises an
error that names the file, the line (JSON Lines) or the key path (JSON), and the offending key.

Workdir (``docs/reference/interfaces.md``)::

    DIR/config.json            the resolved training config (any JSON object)
    DIR/metrics.jsonl          one JSON object per optimizer step (TRAINING METRICS below)
    DIR/checkpoints/           Orbax, adapter-only step folders (not read here)
    DIR/eval/results.json      evaluation summary (RESULTS below)
    DIR/eval/samples/NAME.jsonl  every scored sample of model NAME (SAMPLES below)
    DIR/diagnostics/WHAT.json  outputs of ``launchers.diagnose`` (drift, pairs, diff, termination, curves)
    DIR/report.html            ``launchers.report``

TRAINING METRICS (``metrics.jsonl``), one object a step. Required: ``step`` (int >= 0). Every other key is
optional; each value is a number, a bool or null (NaN / Infinity tokens are accepted: a diverging run is what
the report must show). Known keys (``TRAIN_KEYS``):

* all algorithms: ``loss``, ``grad_norm``, ``update_norm``, ``lora_norm``, ``learning_rate``,
  ``skipped_updates`` (cumulative count), ``nonfinite`` (bool: this step's update was non-finite and skipped),
  ``tokens_per_s``, ``step_time_s``;
* DPO: ``preference_accuracy``, ``reward_margin``, ``chosen_rewards``, ``rejected_rewards``, ``chosen_logps``,
  ``rejected_logps``;
* GRPO / PPO: ``reward_mean``, ``reward_std``, ``kl``, ``clip_fraction``, ``entropy``, ``truncation_rate``,
  ``zero_variance_groups``, ``value_loss``, ``explained_variance``.

``update_skipped`` (0/1, what ``jaxrl.train`` writes) is read as ``nonfinite`` when that key is absent; a
non-finite value may also be written as null. Known keys must hold a number, a bool or null; other keys may hold
any JSON (e.g. the trainer's ``nonfinite_reason`` string and ``nonfinite_groups`` list) and are kept; the
numeric ones are plotted. A step that appears twice (a resumed run re-logs the steps after
its last checkpoint) keeps its LAST record; records are returned sorted by step.

RESULTS (``eval/results.json``, written by ``jaxrl.evaluation.stats.write_results``)::

    {"models": {NAME: {"partial_reward_mean": float, "strict_rate": float, "truncation_rate": float,
                       "mean_completion_tokens": float, "pass_at_k": {"1": float, ...},
                       "n_prompts": int, "n_samples": int,
                       "step": int | null,                  # optimizer step of a checkpoint; null for base
                       "average": {...} | null,             # optional: an averaged or EMA adapter (below)
                       "untruncated": {... same keys without truncation_rate ...}   # optional
                       }},
     "comparisons": [{"model", "baseline", "metric", "diff", "ci_low", "ci_high", "n_pairs",
                      ... optional: "confidence", "ci_crosses_zero", "p_value", "model_value", ...}],
     "warnings": [str, ...],                                 # optional
     "max_new_tokens": int                                   # optional: the evaluation's generation cap
    }

Optional keys the evaluator adds (``jaxrl.evaluation.analysis``; readers must not require them):

* per model: ``"intervals": {"confidence", "partial_reward_mean": [lo, hi], "strict_rate": [lo, hi],
  "truncation_rate": [lo, hi], "pass_at_k": {"k": [lo, hi]}}``;
* per comparison: ``"p_value"`` (always; the test ``"test"`` = ``"mcnemar_midp" | "sign_flip" | "zero_spread"``,
  also under the older name ``"p_value_test"``; ``"p_value_exact"``: plain exact McNemar on binary rows),
  ``"significant"`` (p < 1 - confidence, exactly when [ci_low, ci_high] excludes 0), ``"ci_method"``,
  ``"b01"``, ``"b10"``, ``"n_discordant"``, ``"sd_diff"`` (SD of the per-prompt differences),
  ``"simultaneous_ci_low"``, ``"simultaneous_ci_high"``, ``"simultaneous_p_value"``, ``"family_size"``,
  ``"significant_after_selection"`` (max-T over every row of the file), ``"claim"`` =
  ``"exploratory" | "confirmatory"``, ``"power": {"power", "mde", "mde_family", "family_size", "n_for_diff",
  "n_for_diff_family"}``;
* top level: ``"family"`` (``size``, ``models``, ``metrics``, ``baseline``, ``critical_value``, ``method``),
  ``"selection"`` (``{metric: {"naive": {...}, "cross_fit": {"diff", "ci_low", "ci_high", "p_value",
  "chosen_on_half", ...}}}``), ``"censoring"`` (``{"models": {name: {metric: {"finished", "bounds",
  "decomposition"}}}, "extended_cap": {...} | null}``), ``"protocol"`` (``{"role": "exploratory" | "selection" |
  "confirmation", "split": {...} | null, ...}``).

Model names: ``base`` for the base model and ``step_<N>`` for the checkpoint after N optimizer steps (so curves
over steps are recoverable even without ``"step"``); any other name is a free-standing model (no step). An
averaged candidate (``"step"`` null) says what it averages in ``"average"``: ``{"kind": "mean", "steps": [...],
"weights": [...], "rank", "exact_rank", ...}`` (``launchers.export --average``; with ``"residual"`` when
truncated) or ``{"kind": "ema", "decay", "step", "over": "lora_factors"}`` (``ema_<N>``, the EMA saved with step
N); :func:`averaged_steps` reads it.
``diff = model - baseline`` in the metric's units (rates are fractions, not percent).

SAMPLES (``eval/samples/NAME.jsonl``), one scored completion a line::

    {"problem_id": str, "sample_index": int >= 0, "completion": str, "completion_tokens": int >= 0,
     "finish_reason": "stop" | "length", "partial": float in [0, 1], "strict": bool,
     "tests": [status, ...],            # per-test statuses of jaxrl.rewards ("pass", "wrong", "timeout", ...)
     "reason": str | null,              # why nothing ran ("truncated", "no_code", ...), null when tests ran
     "max_new_tokens": int >= 1 | null} # the generation cap this sample was drawn with

An evaluation over episodes (``--environment``) adds ``"episode"``: turns, texts, rewards, observations,
solved_turn, tokens, ... (jaxrl/evaluation/episodes.py); ``completion`` is then the last turn.

(problem_id, sample_index) is unique within a file. These records are exactly what
``jaxrl.evaluation.metrics.model_metrics`` / ``per_prompt_values`` take. Write them with :func:`write_samples`.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from jaxrl.utils.io import JsonlError, atomic_write_json, iter_jsonl, read_jsonl, write_jsonl

__all__ = [
    "FormatError", "CONFIG_FILE", "METRICS_FILE", "EVAL_DIR", "RESULTS_FILE", "SAMPLES_DIR", "DIAGNOSTICS_DIR",
    "REPORT_FILE", "TRAIN_KEYS", "COMMON_KEYS", "DPO_KEYS", "RL_KEYS", "MODEL_KEYS", "COMPARISON_KEYS",
    "SAMPLE_KEYS", "CLAIMS", "FINISH_REASONS", "TEST_STATUSES", "BASE_MODEL", "model_step", "averaged_steps",
    "checkpoint_name",
    "read_training_metrics", "read_config", "read_results", "validate_results", "validate_sample",
    "read_samples", "write_samples", "samples_path", "available_samples", "diagnostics_path",
    "write_diagnostic", "read_diagnostic", "DIAGNOSTICS", "group_by_prompt", "model_order",
]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
EVAL_DIR = "eval"
RESULTS_FILE = "results.json"
SAMPLES_DIR = "samples"
DIAGNOSTICS_DIR = "diagnostics"
REPORT_FILE = "report.html"
BASE_MODEL = "base"
# What launchers.diagnose writes under DIR/diagnostics/ (one JSON object each; shapes: the modules' docstrings).
DIAGNOSTICS = ("drift", "pairs", "diff", "termination", "curves")

COMMON_KEYS = ("loss", "grad_norm", "update_norm", "lora_norm", "learning_rate", "skipped_updates", "nonfinite",
               "tokens_per_s", "step_time_s")
DPO_KEYS = ("preference_accuracy", "reward_margin", "chosen_rewards", "rejected_rewards", "chosen_logps",
            "rejected_logps")
RL_KEYS = ("reward_mean", "reward_std", "kl", "clip_fraction", "entropy", "truncation_rate",
           "zero_variance_groups", "value_loss", "explained_variance")
TRAIN_KEYS = ("step",) + COMMON_KEYS + DPO_KEYS + RL_KEYS
# (report key, name the GRPO / PPO trainers log it under), the first present one is used
RL_ALIASES = (("reward_mean", "reward/mean"), ("reward_std", "reward/std"),
              ("truncation_rate", "completion/truncation_rate"), ("clip_fraction", "clip_fraction/region"),
              ("kl", "rollout/kl"), ("value_loss", "vf_loss"))

MODEL_KEYS = ("partial_reward_mean", "strict_rate", "truncation_rate", "mean_completion_tokens", "pass_at_k",
              "n_prompts", "n_samples")
COMPARISON_KEYS = ("model", "baseline", "metric", "diff", "ci_low", "ci_high", "n_pairs")
CLAIMS = ("exploratory", "confirmatory")
SAMPLE_KEYS = ("problem_id", "sample_index", "completion", "completion_tokens", "finish_reason", "partial",
               "strict", "tests", "reason", "max_new_tokens")
FINISH_REASONS = ("stop", "length")
TEST_STATUSES = ("pass", "wrong", "timeout", "error", "output_limit", "memory")

_STEP_NAME = re.compile(r"^step_(\d+)$")


class FormatError(ValueError):
    """A file that does not follow the formats above; ``str(err)`` starts with ``"<path>: "``."""


# ------------------------------------------------------------------------------------------------ names


def model_step(name: str, entry: Optional[Mapping] = None) -> Optional[int]:
    """Optimizer step of a model: ``entry["step"]`` when given, else parsed from ``step_<N>``; 0 for ``base``;
    None for a model that is not on the checkpoint axis."""
    if entry is not None and entry.get("step") is not None:
        return int(entry["step"])
    if name == BASE_MODEL:
        return 0
    m = _STEP_NAME.match(name)
    return int(m.group(1)) if m else None


def averaged_steps(entry: Optional[Mapping]) -> Optional[list[int]]:
    """The steps a results.json model entry averages (an EMA: the step it was saved at), None for a model that is
    no average."""
    average = (entry or {}).get("average")
    if not isinstance(average, Mapping):
        return None
    steps = average.get("steps") if average.get("kind") == "mean" else [average.get("step")]
    return [int(s) for s in steps if s is not None] or None


def checkpoint_name(step: int) -> str:
    """``step_<N>``: the model name the evaluator gives the checkpoint after ``step`` optimizer steps."""
    return f"step_{int(step)}"


# ------------------------------------------------------------------------------------------- validation


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_train_record(rec: dict) -> None:
    step = rec.get("step", KeyError)
    if step is KeyError:
        raise KeyError("step")
    if not _is_number(step) or step != int(step) or step < 0:
        raise ValueError(f"key 'step': must be an integer >= 0, got {step!r}")
    for key in TRAIN_KEYS[1:] + ("update_skipped",):
        value = rec.get(key)
        if value is None or isinstance(value, bool) or _is_number(value):
            continue
        raise ValueError(f"key {key!r}: must be a number, a bool or null, got {type(value).__name__} {value!r}")
    for key in ("nonfinite", "update_skipped"):
        if rec.get(key) not in (None, True, False, 0, 1):
            raise ValueError(f"key {key!r}: must be a bool (or 0/1), got {rec[key]!r}")


def read_training_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a ``metrics.jsonl``, validated, one per step (records of one step merged, later values win),

    Raises ``JsonlError("path:LINE: reason")`` for a malformed line, FileNotFoundError when absent.
    """
    by_step: dict[int, dict] = {}
    for rec in read_jsonl(path, validate=_check_train_record):
        rec = dict(rec)
        rec["step"] = int(rec["step"])
        if rec.get("nonfinite") is None and rec.get("update_skipped") is not None:
            rec["nonfinite"] = bool(rec["update_skipped"])  # the trainer's name for the same fact
        for key, alias in RL_ALIASES:  # the online trainers' namespaced names for the report's keys
            if rec.get(key) is None and rec.get(alias) is not None:
                rec[key] = rec[alias]
        # Several records can share a step (the train record, then the periodic eval_* record): merge them. A
        # resumed run re-logs steps: the later values win.
        by_step[rec["step"]] = {**by_step.get(rec["step"], {}), **rec}
    return [by_step[s] for s in sorted(by_step)]


def read_config(workdir: str | os.PathLike) -> Optional[dict]:
    """``DIR/config.json`` as a dict, None when absent; FormatError naming the file and line when invalid."""
    path = Path(workdir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise FormatError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(cfg, dict):
        raise FormatError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _require_number(d: Mapping, key: str, where: str, *, nullable: bool = False, lo=None, hi=None) -> None:
    if key not in d:
        raise FormatError(f"{where}: missing key {key!r}")
    v = d[key]
    if v is None and nullable:
        return
    if not _is_number(v) or not math.isfinite(v):
        raise FormatError(f"{where}: key {key!r} must be a finite number, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise FormatError(f"{where}: key {key!r} = {v} is outside [{lo}, {hi}]")


def _check_model_entry(entry: Any, where: str, untruncated: bool = False) -> None:
    if not isinstance(entry, Mapping):
        raise FormatError(f"{where}: expected an object, got {type(entry).__name__}")
    keys = [k for k in MODEL_KEYS if not (untruncated and k == "truncation_rate")]
    for key in keys:
        if key == "pass_at_k":
            if not isinstance(entry.get(key, None), Mapping):
                raise FormatError(f"{where}: key 'pass_at_k' must be an object {{k: value}}, "
                                  f"got {entry.get(key, 'nothing')!r}")
            for k, v in entry[key].items():
                if not str(k).isdigit():
                    raise FormatError(f"{where}: pass_at_k key {k!r} is not an integer k")
                _require_number(entry[key], k, f"{where}.pass_at_k", lo=0.0, hi=1.0)
        elif key in ("n_prompts", "n_samples"):
            _require_number(entry, key, where, lo=0)
        elif key == "mean_completion_tokens":
            _require_number(entry, key, where, nullable=untruncated, lo=0.0)
        else:
            _require_number(entry, key, where, nullable=untruncated, lo=0.0, hi=1.0)
    step = entry.get("step")
    if step is not None and (not _is_number(step) or step != int(step) or step < 0):
        raise FormatError(f"{where}: key 'step' must be an integer >= 0 or null, got {step!r}")
    if not untruncated and entry.get("untruncated") is not None:
        _check_model_entry(entry["untruncated"], f"{where}.untruncated", untruncated=True)


def validate_results(results: Any, where: str = RESULTS_FILE) -> dict:
    """Checks a results.json object against RESULTS (module docstring); returns it. Raises FormatError."""
    if not isinstance(results, Mapping):
        raise FormatError(f"{where}: expected a JSON object, got {type(results).__name__}")
    models = results.get("models")
    if not isinstance(models, Mapping) or not models:
        raise FormatError(f"{where}: key 'models' must be a non-empty object {{name: metrics}}")
    for name, entry in models.items():
        _check_model_entry(entry, f"{where}: models[{name!r}]")
    comps = results.get("comparisons", [])
    if not isinstance(comps, list):
        raise FormatError(f"{where}: key 'comparisons' must be a list")
    for i, c in enumerate(comps):
        w = f"{where}: comparisons[{i}]"
        if not isinstance(c, Mapping):
            raise FormatError(f"{w}: expected an object")
        for key in COMPARISON_KEYS:
            if key not in c:
                raise FormatError(f"{w}: missing key {key!r}")
        for key in ("diff", "ci_low", "ci_high"):
            _require_number(c, key, w)
        if c["ci_low"] > c["ci_high"]:
            raise FormatError(f"{w}: ci_low {c['ci_low']} > ci_high {c['ci_high']}")
        for key in ("model", "baseline"):
            if c[key] not in models:
                raise FormatError(f"{w}: {key} {c[key]!r} is not among the models {sorted(models)}")
        if "simultaneous_ci_low" in c or "simultaneous_ci_high" in c:
            for key in ("simultaneous_ci_low", "simultaneous_ci_high"):
                _require_number(c, key, w)
            if c["simultaneous_ci_low"] > c["simultaneous_ci_high"]:
                raise FormatError(f"{w}: simultaneous_ci_low {c['simultaneous_ci_low']} > simultaneous_ci_high "
                                  f"{c['simultaneous_ci_high']}")
        for key in ("p_value", "simultaneous_p_value"):
            if c.get(key) is not None:
                _require_number(c, key, w, lo=0.0, hi=1.0)
        if c.get("claim") is not None and c["claim"] not in CLAIMS:
            raise FormatError(f"{w}: claim must be one of {CLAIMS}, got {c['claim']!r}")
    return dict(results)


def read_results(path: str | os.PathLike) -> dict:
    """A validated ``results.json`` (a folder is taken to hold it). FormatError names the file and key."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise FormatError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return validate_results(results, where=str(path))


def validate_sample(rec: Mapping) -> None:
    """Raises KeyError / ValueError / TypeError when ``rec`` is not a SAMPLES record (module docstring)."""
    for key in SAMPLE_KEYS:
        if key not in rec:
            raise KeyError(key)
    if not isinstance(rec["problem_id"], str):
        raise TypeError(f"key 'problem_id': must be a string, got {rec['problem_id']!r}")
    for key, lo in (("sample_index", 0), ("completion_tokens", 0)):
        v = rec[key]
        if not _is_number(v) or v != int(v) or v < lo:
            raise ValueError(f"key {key!r}: must be an integer >= {lo}, got {v!r}")
    if not isinstance(rec["completion"], str):
        raise TypeError("key 'completion': must be a string")
    if rec["finish_reason"] not in FINISH_REASONS:
        raise ValueError(f"key 'finish_reason': must be 'stop' or 'length', got {rec['finish_reason']!r}")
    p = rec["partial"]
    if not _is_number(p) or not 0.0 <= p <= 1.0:
        raise ValueError(f"key 'partial': must be a number in [0, 1], got {p!r}")
    if rec["strict"] not in (True, False):
        raise ValueError(f"key 'strict': must be a bool, got {rec['strict']!r}")
    if not isinstance(rec["tests"], list) or any(t not in TEST_STATUSES for t in rec["tests"]):
        raise ValueError(f"key 'tests': must be a list of {TEST_STATUSES}, got {rec['tests']!r}")
    if rec["reason"] is not None and not isinstance(rec["reason"], str):
        raise TypeError(f"key 'reason': must be a string or null, got {rec['reason']!r}")
    cap = rec["max_new_tokens"]
    if cap is not None and (not _is_number(cap) or cap != int(cap) or cap < 1):
        raise ValueError(f"key 'max_new_tokens': must be an integer >= 1 or null, got {cap!r}")


def read_samples(path: str | os.PathLike) -> list[dict]:
    """Validated SAMPLES records of one model. JsonlError names file:line (also for a repeated sample)."""
    records, where = [], {}
    for line, rec in iter_jsonl(path, validate=validate_sample):
        key = (rec["problem_id"], int(rec["sample_index"]))
        if key in where:
            raise JsonlError(path, line, f"duplicate sample (problem_id {key[0]!r}, sample_index {key[1]}); "
                                         f"first at line {where[key]}")
        where[key] = line
        records.append(rec)
    return records


def write_samples(path: str | os.PathLike, records: Iterable[Mapping]) -> Path:
    """Validates SAMPLES records and writes them atomically (what the evaluator calls per model).

    Raises ValueError naming the record index and key when one is malformed or a sample repeats.
    """
    out, seen = [], set()
    for i, rec in enumerate(records):
        try:
            validate_sample(rec)
        except KeyError as e:
            raise ValueError(f"{path}: record {i}: missing key {e.args[0]!r}") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: record {i}: {e}") from None
        key = (rec["problem_id"], int(rec["sample_index"]))
        if key in seen:
            raise ValueError(f"{path}: record {i}: duplicate sample {key}")
        seen.add(key)
        out.append({k: rec[k] for k in SAMPLE_KEYS} | {k: v for k, v in rec.items() if k not in SAMPLE_KEYS})
    return write_jsonl(path, out)


def samples_path(eval_dir: str | os.PathLike, name: str) -> Path:
    """``eval_dir/samples/<name>.jsonl``."""
    return Path(eval_dir) / SAMPLES_DIR / f"{name}.jsonl"


def available_samples(eval_dir: str | os.PathLike) -> dict[str, Path]:
    """``{model name: samples file}`` for every ``eval_dir/samples/*.jsonl``."""
    folder = Path(eval_dir) / SAMPLES_DIR
    if not folder.is_dir():
        return {}
    files = {p.stem: p for p in folder.glob("*.jsonl")}
    return {n: files[n] for n in sorted(files, key=model_order)}


def model_order(name: str) -> tuple:
    """Sort key: base first, then checkpoints by step, then other models by name."""
    step = model_step(name)
    return (0, step, name) if step is not None else (1, 0, name)


# ---------------------------------------------------------------------------------------- diagnostics io


def diagnostics_path(workdir: str | os.PathLike, what: str) -> Path:
    """``DIR/diagnostics/<what>.json``."""
    if what not in DIAGNOSTICS:
        raise ValueError(f"unknown diagnostic {what!r}; one of {DIAGNOSTICS}")
    return Path(workdir) / DIAGNOSTICS_DIR / f"{what}.json"


def write_diagnostic(path: str | os.PathLike, result: Mapping) -> Path:
    """Writes a diagnostic's JSON atomically (NaN is refused: it would not be JSON)."""
    return atomic_write_json(path, result)


def read_diagnostic(path: str | os.PathLike) -> Optional[dict]:
    """A diagnostic JSON written by :func:`write_diagnostic`; None when absent."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise FormatError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return obj


def group_by_prompt(records: Sequence[Mapping]) -> dict[str, list[Mapping]]:
    """``{problem_id: [records]}`` in first-appearance order."""
    out: dict[str, list[Mapping]] = {}
    for r in records:
        out.setdefault(str(r["problem_id"]), []).append(r)
    return out
