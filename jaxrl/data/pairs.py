"""Preference pairs for DPO: build them from scored rollouts, filter them, audit them, freeze a cohort.

Inputs and outputs follow docs/reference/interfaces.md:

* ``rollouts.jsonl``: ``{"problem_id", "sample_index", "completion", "completion_tokens", "finish_reason",
  "reward": {"partial", "strict"}, "model"}``, optionally ``"messages"`` (the prompt) and ``"max_new_tokens"``
  (the generation cap the sample was drawn with).
* ``pairs.jsonl``: ``{"problem_id", "messages", "chosen", "rejected", "chosen_reward", "rejected_reward",
  "chosen_tokens", "rejected_tokens"}`` plus ``pair_id`` and provenance keys (sample indices, finish reasons,
  the cap, the model) so that a later :func:`filter_pairs` pass can re-check everything.
* ``audit.json``: what was kept, what was dropped and why, and the length / margin / reward distributions.

Rewards are the verifier's ``partial`` reward (fraction of tests passed, in [0, 1]); lengths are completion
tokens.

Admissibility of a (chosen, rejected) pair, defaults from the users' report (K=8, 4096 cap):

* ``chosen_truncated`` / ``rejected_truncated``: the completion has ``finish_reason == "length"`` or
  ``completion_tokens > cap - truncation_buffer`` (buffer 24: exactly ``cap - 24`` tokens is kept,
  ``cap - 23`` is dropped). A truncated completion's low reward says "too long", not "wrong".
* ``length_diff_over_max``: ``|chosen_tokens - rejected_tokens| > max_length_diff`` (512 kept, 513 dropped),
  so that DPO cannot learn "shorter wins" instead of "correct wins".
* ``margin_under_min``: ``chosen_reward - rejected_reward < min_margin`` (0.5; compared with a 1e-9
  tolerance so that e.g. 0.7 - 0.2 counts as 0.5).

The reasons are checked in that order; the audit counts every failing reason (``fail_counts``) and the first
one (``first_fail_counts``, which sums to the number dropped).

Selection per prompt (samples ranked by partial reward; ties broken by fewer completion tokens, then lower
sample_index -- for the chosen side and the rejected side alike, so the choice is deterministic and does not
favour long completions; shorter also makes a truncated pick less likely):

* ``pairing="single"`` (default): one pair a prompt.
  - ``selection="best_worst"`` (default): the best sample vs the worst; if that pair fails a filter the prompt
    is dropped. This is the users' "drop" rule and keeps the pair maximally contrastive.
  - ``selection="best_admissible"``: if best-vs-worst fails, take the admissible pair with the largest margin
    instead (ties: better-ranked chosen, then worse-ranked rejected). Recovers prompts whose worst sample was
    truncated, at the cost of smaller margins; the audit counts these as ``rescued``.
* ``pairing="all"``: every admissible pair with ``chosen_reward > rejected_reward`` (``selection`` unused).

Prompts with fewer than 2 samples (``single_sample``) or whose samples all have the same reward (``all_tied``)
give no candidate at all.

Cohorts: :func:`freeze_cohort` orders pairs by ``sha256(f"{seed}:{pair_id}")`` (a seeded shuffle that does not
depend on file order; a smaller cohort with the same seed is a prefix of a larger one) and writes the first N to
``cohort/pairs.jsonl`` + ``cohort/manifest.json`` (ids in order and the file's sha256). :func:`verify_cohort`
re-checks the sha256; the DPO trainer calls it at start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from jaxrl.utils.dataclass_flags import flag_field
from jaxrl.utils.seeds import seed_field
from jaxrl.utils.io import (OutputExistsError, atomic_write_json, iter_jsonl, jsonl_bytes, read_jsonl, sha256_file,
                            write_jsonl)

__all__ = [
    "BuildPairsSettings",
    "PairConfig",
    "Sample",
    "REASONS",
    "CohortError",
    "NoPairsError",
    "read_rollouts",
    "read_pairs",
    "read_problem_messages",
    "recorded_reward",
    "rollouts_reward",
    "truncation_buffer_warning",
    "no_pairs_message",
    "build_pairs",
    "filter_pairs",
    "pair_id",
    "write_pairs",
    "freeze_cohort",
    "check_cohort_writable",
    "verify_cohort",
    "load_cohort",
    "format_audit",
]

PAIRINGS = ("single", "all")
SELECTIONS = ("best_worst", "best_admissible")
# Checked (and reported as "first failing reason") in this order.
REASONS = ("chosen_truncated", "rejected_truncated", "length_diff_over_max", "margin_under_min")
_MARGIN_TOL = 1e-9  # partial rewards are fractions like 0.7 - 0.2 = 0.49999999999999994
PAIR_KEYS = ("problem_id", "messages", "chosen", "rejected", "chosen_reward", "rejected_reward",
             "chosen_tokens", "rejected_tokens")


@dataclasses.dataclass(frozen=True)
class PairConfig:
    """Pair filters and selection; see the module docstring. Token counts are completion tokens. The fields are
    launchers.build_pairs' flags (jaxrl.utils.dataclass_flags)."""

    min_margin: float = flag_field(0.5, help="Minimum chosen - rejected partial reward.")
    truncation_buffer: int = flag_field(24, help="A completion with more than max_new_tokens - truncation_buffer "
                                        "tokens counts as truncated.")
    max_length_diff: int = flag_field(512, help="Maximum |chosen_tokens - rejected_tokens|.")
    # fallback cap when a record has no "max_new_tokens"
    max_new_tokens: Optional[int] = flag_field(None, help="Generation cap, used for records that do not carry "
                                               "their own max_new_tokens.")
    pairing: str = flag_field("single", choices=PAIRINGS, help="single: one pair a prompt; all: every admissible "
                              "pair.")
    selection: str = flag_field("best_worst", choices=SELECTIONS, help="best_worst: best vs worst or drop the "
                                "prompt; best_admissible: fall back to the admissible pair with the largest margin.")

    def __post_init__(self):
        if self.pairing not in PAIRINGS:
            raise ValueError(f"pairing must be one of {PAIRINGS}, got {self.pairing!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if self.truncation_buffer < 0 or self.max_length_diff < 0:
            raise ValueError("truncation_buffer and max_length_diff must be >= 0")
        if self.max_new_tokens is not None and self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")


@dataclasses.dataclass(frozen=True)
class BuildPairsSettings:
    """What launchers.build_pairs reads and writes (its filters: PairConfig); the fields are its flags. One of
    `rollouts` and `pairs_in` is given, and `out_dir` (the launcher checks both)."""

    rollouts: Optional[str] = flag_field(None, help="rollouts.jsonl to build pairs from.")
    pairs_in: Optional[str] = flag_field(None, help="Existing pairs.jsonl to filter (instead of --rollouts).")
    problems: Optional[str] = flag_field(None, help="problems.jsonl giving the prompt messages when the rollouts "
                                         "carry no 'messages'.")
    out_dir: Optional[str] = flag_field(None, help="Output folder for pairs.jsonl, audit.json and cohort/.")
    cohort_size: int = flag_field(0, help="If > 0, freeze this many pairs into out_dir/cohort/.")
    seed: int = seed_field(0, help="Seed of the cohort selection.")
    overwrite: bool = flag_field(False, help="Replace what --out_dir holds (pairs.jsonl, audit.json, cohort/) when "
                                 "this build gives other pairs or another cohort.")
    skip_malformed: bool = flag_field(False, help="Skip (and count) malformed input lines instead of failing.")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One scored rollout; ``line`` is its line in the rollouts file (0 when built in memory)."""

    problem_id: str
    sample_index: int
    completion: str
    completion_tokens: int
    finish_reason: str
    partial: float
    strict: bool
    model: Optional[str] = None
    messages: Optional[list] = None
    max_new_tokens: Optional[int] = None
    line: int = 0


class CohortError(ValueError):
    """A frozen cohort is missing, inconsistent, or its file no longer matches its manifest."""


class NoPairsError(ValueError):
    """A build whose filters keep no pair (nothing is written; the message gives the counts per filter)."""


# ------------------------------------------------------------------------------------------------ reading


def _int(rec: Mapping, key: str, minimum: int = 0) -> int:
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def _reward(v: Any, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, got {v!r}")
    return float(v)


def _sample_from_record(rec: Mapping, line: int = 0) -> Sample:
    reward = rec["reward"]
    if not isinstance(reward, Mapping):
        raise TypeError(f"reward must be an object with partial and strict, got {reward!r}")
    partial = _reward(reward["partial"], "reward.partial")
    if not 0.0 <= partial <= 1.0:
        raise ValueError(f"reward.partial must be in [0, 1], got {partial}")
    strict = reward["strict"]
    if strict not in (True, False, 0, 1):
        raise ValueError(f"reward.strict must be a bool, got {strict!r}")
    finish = rec["finish_reason"]
    if finish not in ("stop", "length"):
        raise ValueError(f"finish_reason must be 'stop' or 'length', got {finish!r}")
    if not isinstance(rec["completion"], str):
        raise TypeError("completion must be a string")
    messages = rec.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise TypeError("messages must be a list of {role, content}")
    cap = rec.get("max_new_tokens")
    return Sample(
        problem_id=str(rec["problem_id"]),
        sample_index=_int(rec, "sample_index"),
        completion=rec["completion"],
        completion_tokens=_int(rec, "completion_tokens"),
        finish_reason=finish,
        partial=partial,
        strict=bool(strict),
        model=rec.get("model"),
        messages=messages,
        max_new_tokens=None if cap is None else _int(rec, "max_new_tokens", 1),
        line=line,
    )


def read_rollouts(path: str | os.PathLike, *, skip_malformed: bool = BuildPairsSettings.skip_malformed,
                  skipped: Optional[list] = None) -> list[Sample]:
    """Samples of a rollouts.jsonl. A malformed line raises ``JsonlError("path:LINE: reason")``; with
    ``skip_malformed`` it is left out and its message appended to ``skipped``. A repeated
    (problem_id, sample_index) is always an error naming both lines (it would double-count a sample)."""
    samples = [_sample_from_record(rec, lineno) for lineno, rec in
               iter_jsonl(path, validate=_sample_from_record, skip_malformed=skip_malformed, skipped=skipped)]
    seen: dict[tuple[str, int], int] = {}
    for s in samples:
        key = (s.problem_id, s.sample_index)
        if key in seen:
            raise ValueError(f"{path}:{s.line}: duplicate sample (problem_id {s.problem_id!r}, sample_index "
                             f"{s.sample_index}) first seen on line {seen[key]}")
        seen[key] = s.line
    return samples


def _validate_pair(rec: Mapping) -> None:
    for key in PAIR_KEYS:
        if key not in rec:
            raise KeyError(key)
    for key in ("chosen", "rejected"):
        if not isinstance(rec[key], str):
            raise TypeError(f"{key} must be a string")
    for key in ("chosen_reward", "rejected_reward"):
        _reward(rec[key], key)
    for key in ("chosen_tokens", "rejected_tokens"):
        _int(rec, key)
    if rec.get("max_new_tokens") is not None:
        _int(rec, "max_new_tokens", 1)
    for key in ("chosen_finish_reason", "rejected_finish_reason"):
        if rec.get(key) not in (None, "stop", "length"):
            raise ValueError(f"{key} must be 'stop' or 'length', got {rec[key]!r}")


def read_pairs(path: str | os.PathLike, *, skip_malformed: bool = BuildPairsSettings.skip_malformed,
               skipped: Optional[list] = None) -> list[dict]:
    """Records of a pairs.jsonl, each checked for the docs/reference/interfaces.md keys (errors name file and line)."""
    return read_jsonl(path, validate=_validate_pair, skip_malformed=skip_malformed, skipped=skipped)


def read_problem_messages(path: str | os.PathLike) -> dict[str, list]:
    """``{id: messages}`` from a problems.jsonl (used when rollouts carry no ``messages``)."""
    def validate(rec):
        if "id" not in rec:
            raise KeyError("id")
        if not isinstance(rec["messages"], list):
            raise TypeError("messages must be a list")
    return {str(r["id"]): r["messages"] for r in read_jsonl(path, validate=validate)}


def rollouts_reward(path: str | os.PathLike) -> Optional[str]:
    """The reward a rollouts file was scored with (`<path>.meta.json`, written by launchers.rollout), or None."""
    meta = Path(os.fspath(path) + ".meta.json")
    try:
        return json.loads(meta.read_text(encoding="utf-8")).get("settings", {}).get("reward") or None
    except (OSError, ValueError, AttributeError):
        return None


def recorded_reward(pairs_path: str | os.PathLike) -> Optional[str]:
    """The reward the pairs of a pairs.jsonl were scored with: `reward` of the audit.json beside it (build_pairs
    records it), else that of the rollouts it names as its input; None when neither says."""
    audit_path = Path(pairs_path).parent / "audit.json"
    try:
        audit = json.loads(audit_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(audit, dict):
        return None
    if audit.get("reward"):
        return str(audit["reward"])
    source = (audit.get("input") or {}).get("path")
    return rollouts_reward(source) if source else None


def truncation_buffer_warning(samples: Sequence[Sample], config: PairConfig, where: str) -> Optional[str]:
    """A warning when `truncation_buffer` is at least a cap of the samples: every completion then counts as
    truncated and no pair can be kept."""
    caps = sorted({s.max_new_tokens or config.max_new_tokens for s in samples} - {None})
    small = [c for c in caps if config.truncation_buffer >= c]
    if not small:
        return None
    return (f"--truncation_buffer={config.truncation_buffer} >= max_new_tokens={small[0]} (the cap of {where}): "
            f"every completion counts as truncated and no pair can be kept; pass a --truncation_buffer below the "
            f"cap (e.g. {max(1, small[0] // 8)})")


def no_pairs_message(audit: Mapping, where: str) -> str:
    """Why a build kept no pair: the first failing reasons' counts, as one line."""
    reasons = ", ".join(f"{r} {n}" for r, n in audit["first_fail_counts"].items() if n)
    prompts = audit["prompts"]
    why = (f"{audit['candidates']} candidate pairs all dropped (first failing reason: {reasons})" if reasons else
           f"no candidate pair ({prompts.get('single_sample', 0)} prompts with one sample, "
           f"{prompts.get('all_tied', 0)} with all rewards tied)")
    return (f"{where}: no pair kept: {why}; nothing written. Loosen the filter that drops them (--min_margin, "
            "--truncation_buffer, --max_length_diff) or sample more completions a prompt")


# ---------------------------------------------------------------------------------------------- building


def pair_id(problem_id: str, chosen: str, rejected: str) -> str:
    """Stable id of a pair: first 16 hex digits of sha256 over (problem_id, chosen, rejected).

    Content-based, so the same pair gets the same id whether built from rollouts or read from an old file, and
    identical pairs (e.g. two samples with the same text) collapse to one id.
    """
    blob = json.dumps([str(problem_id), chosen, rejected], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _failures(chosen_tokens: int, rejected_tokens: int, chosen_trunc: bool, rejected_trunc: bool,
              margin: float, cfg: PairConfig) -> list[str]:
    """Failing reasons, in ``REASONS`` order (empty = admissible)."""
    out = []
    if chosen_trunc:
        out.append("chosen_truncated")
    if rejected_trunc:
        out.append("rejected_truncated")
    if abs(chosen_tokens - rejected_tokens) > cfg.max_length_diff:
        out.append("length_diff_over_max")
    if margin < cfg.min_margin - _MARGIN_TOL:
        out.append("margin_under_min")
    return out


def _is_truncated(tokens: int, finish_reason: Optional[str], cap: int, buffer: int) -> bool:
    return finish_reason == "length" or tokens > cap - buffer


def _cap(record_cap: Optional[int], cfg: PairConfig, where: str) -> int:
    # The record's own cap is what that completion was generated with, so it wins over the flag.
    cap = record_cap if record_cap is not None else cfg.max_new_tokens
    if cap is None:
        raise ValueError(f"{where}: the generation cap is unknown (no max_new_tokens in the record); "
                         "pass --max_new_tokens / PairConfig(max_new_tokens=...)")
    return cap


class _Audit:
    """Accumulates candidate checks and the pairs kept."""

    def __init__(self, cfg: PairConfig, mode: str):
        self.cfg, self.mode = cfg, mode
        self.candidates = self.passed = self.rescued = self.duplicates = 0
        self.fail = {r: 0 for r in REASONS}
        self.first = {r: 0 for r in REASONS}
        self.cand_rows: list[tuple[float, float, int, int]] = []  # (chosen_reward, rejected_reward, c_tok, r_tok)

    def check(self, c_rew, r_rew, c_tok, r_tok, c_trunc, r_trunc) -> list[str]:
        reasons = _failures(c_tok, r_tok, c_trunc, r_trunc, c_rew - r_rew, self.cfg)
        self.candidates += 1
        self.cand_rows.append((c_rew, r_rew, c_tok, r_tok))
        for r in reasons:
            self.fail[r] += 1
        if reasons:
            self.first[reasons[0]] += 1
        else:
            self.passed += 1
        return reasons

    def result(self, kept: Sequence[Mapping], prompts: dict) -> dict:
        kept_rows = [(p["chosen_reward"], p["rejected_reward"], p["chosen_tokens"], p["rejected_tokens"])
                     for p in kept]
        return {
            "mode": self.mode,
            "config": dataclasses.asdict(self.cfg),
            "prompts": prompts,
            "candidates": self.candidates,
            "passed": self.passed,
            "dropped": self.candidates - self.passed,
            "rescued": self.rescued,
            "duplicates_removed": self.duplicates,
            "kept": len(kept),
            "fail_counts": dict(self.fail),
            "first_fail_counts": dict(self.first),
            "reason_order": list(REASONS),
            "distributions": {"candidates": _distributions(self.cand_rows), "kept": _distributions(kept_rows)},
        }


def _summary(x: Sequence[float], bins: int = 10) -> Optional[dict]:
    """mean, median, p10, p90, min, max and a ``bins``-bin equal-width histogram of ``x`` (None if empty)."""
    if len(x) == 0:
        return None
    a = np.asarray(x, dtype=np.float64)
    counts, edges = np.histogram(a, bins=bins)
    p10, p50, p90 = np.percentile(a, [10, 50, 90])
    return {"n": int(a.size), "mean": float(a.mean()), "median": float(p50), "p10": float(p10),
            "p90": float(p90), "min": float(a.min()), "max": float(a.max()),
            "histogram": {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}}


def _distributions(rows: Sequence[tuple[float, float, int, int]]) -> dict:
    """Distributions of chosen vs rejected reward and length, the margin and the length bias.

    ``length_bias`` = chosen_tokens - rejected_tokens per pair (tokens; > 0 means chosen is longer).
    """
    if not rows:
        return {"n": 0}
    a = np.asarray(rows, dtype=np.float64)
    bias = a[:, 2] - a[:, 3]
    return {
        "n": int(len(a)),
        "chosen_reward": _summary(a[:, 0]),
        "rejected_reward": _summary(a[:, 1]),
        "margin": _summary(a[:, 0] - a[:, 1]),
        "chosen_tokens": _summary(a[:, 2]),
        "rejected_tokens": _summary(a[:, 3]),
        "length_bias": _summary(bias),
        "fraction_chosen_longer": float(np.mean(bias > 0)),
        "fraction_chosen_shorter": float(np.mean(bias < 0)),
    }


def _make_pair(pid: str, messages: list, c: Sample, r: Sample, cap: int) -> dict:
    rec = {
        "pair_id": pair_id(pid, c.completion, r.completion),
        "problem_id": pid,
        "messages": messages,
        "chosen": c.completion,
        "rejected": r.completion,
        "chosen_reward": c.partial,
        "rejected_reward": r.partial,
        "chosen_tokens": c.completion_tokens,
        "rejected_tokens": r.completion_tokens,
        "chosen_sample_index": c.sample_index,
        "rejected_sample_index": r.sample_index,
        "chosen_finish_reason": c.finish_reason,
        "rejected_finish_reason": r.finish_reason,
        "max_new_tokens": cap,
    }
    if c.model is not None and c.model == r.model:
        rec["model"] = c.model
    return rec


def build_pairs(samples: Iterable[Sample], config: PairConfig = PairConfig(),
                messages: Optional[Mapping[str, list]] = None) -> tuple[list[dict], dict]:
    """Preference pairs from scored samples, with the audit.

    Args:
      samples: rollouts (see :func:`read_rollouts`), any order; prompts keep the order of first appearance.
      config: filters and selection (module docstring).
      messages: ``{problem_id: messages}`` for prompts whose samples carry no ``messages``.
    Returns:
      (pairs in pairs.jsonl schema, audit dict). Audit keys: ``prompts`` {total, single_sample, all_tied,
      with_candidates, with_pairs, without_admissible_pair}; ``candidates`` (pairs checked: best-vs-worst per
      prompt for pairing="single", every ordered pair with a reward gap for "all"); ``passed``; ``dropped`` =
      candidates - passed; ``rescued`` (best_admissible replacements); ``duplicates_removed``; ``kept`` =
      pairs returned = passed + rescued; ``fail_counts`` / ``first_fail_counts`` per reason over candidates;
      ``distributions`` of candidates and kept pairs.
    Raises:
      ValueError naming the problem when its cap or its messages are unknown.
    """
    cfg = config
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.problem_id, []).append(s)
    audit = _Audit(cfg, "rollouts")
    prompts = {"total": len(groups), "single_sample": 0, "all_tied": 0, "with_candidates": 0, "with_pairs": 0,
               "without_admissible_pair": 0}
    kept: list[dict] = []
    for pid, group in groups.items():
        if len(group) < 2:
            prompts["single_sample"] += 1
            continue
        if len({s.partial for s in group}) == 1:
            prompts["all_tied"] += 1
            continue
        prompts["with_candidates"] += 1
        msgs = next((s.messages for s in group if s.messages is not None), None)
        if msgs is None:
            msgs = (messages or {}).get(pid)
        if msgs is None:
            line = f" (line {group[0].line})" if group[0].line else ""
            raise ValueError(f"problem {pid!r}{line}: no messages in its rollouts; pass a problems file "
                             "(--problems) so pairs.jsonl gets the prompt")
        caps = {s.sample_index: _cap(s.max_new_tokens, cfg, f"problem {pid!r} sample {s.sample_index}"
                                     + (f" (line {s.line})" if s.line else "")) for s in group}
        trunc = {s.sample_index: _is_truncated(s.completion_tokens, s.finish_reason, caps[s.sample_index],
                                               cfg.truncation_buffer) for s in group}
        best = sorted(group, key=lambda s: (-s.partial, s.completion_tokens, s.sample_index))
        worst = sorted(group, key=lambda s: (s.partial, s.completion_tokens, s.sample_index))

        def check(c: Sample, r: Sample, record: bool = True) -> list[str]:
            if record:
                return audit.check(c.partial, r.partial, c.completion_tokens, r.completion_tokens,
                                   trunc[c.sample_index], trunc[r.sample_index])
            return _failures(c.completion_tokens, r.completion_tokens, trunc[c.sample_index],
                             trunc[r.sample_index], c.partial - r.partial, cfg)

        def cap_of(c: Sample, r: Sample) -> int:
            return max(caps[c.sample_index], caps[r.sample_index])

        n_before = len(kept)
        if cfg.pairing == "single":
            c, r = best[0], worst[0]
            if not check(c, r):
                kept.append(_make_pair(pid, msgs, c, r, cap_of(c, r)))
            elif cfg.selection == "best_admissible":
                # Largest margin first; then better-ranked chosen, then worse-ranked rejected (rank = list index).
                options = [(-(ci.partial - rj.partial), i, j, ci, rj)
                           for i, ci in enumerate(best) for j, rj in enumerate(worst)
                           if ci.partial > rj.partial and not check(ci, rj, record=False)]
                if options:
                    _, _, _, ci, rj = min(options, key=lambda o: o[:3])
                    kept.append(_make_pair(pid, msgs, ci, rj, cap_of(ci, rj)))
                    audit.rescued += 1
        else:
            seen: set[str] = set()
            for ci in best:
                for rj in worst:
                    if not ci.partial > rj.partial:
                        continue
                    pid_hash = pair_id(pid, ci.completion, rj.completion)
                    if pid_hash in seen:  # same texts as a pair already considered: one training example
                        audit.duplicates += 1
                        continue
                    seen.add(pid_hash)
                    if not check(ci, rj):
                        kept.append(_make_pair(pid, msgs, ci, rj, cap_of(ci, rj)))
        if len(kept) > n_before:
            prompts["with_pairs"] += 1
        else:
            prompts["without_admissible_pair"] += 1
    return kept, audit.result(kept, prompts)


def filter_pairs(pairs: Iterable[Mapping], config: PairConfig = PairConfig()) -> tuple[list[dict], dict]:
    """The same admissibility filters applied to existing pairs (the users' "length-clean" pass).

    Truncation uses ``chosen_tokens`` / ``rejected_tokens`` against the record's ``max_new_tokens`` (else
    ``config.max_new_tokens``; one of them is required), plus ``chosen_finish_reason`` /
    ``rejected_finish_reason`` when present. ``selection`` / ``pairing`` do not apply. Exact duplicates (same
    ``pair_id``) are removed first and counted. Kept pairs get a ``pair_id`` if they had none; every other
    key is kept as it was.
    Returns (kept pairs, audit) with the audit keys of :func:`build_pairs` (``mode`` = "pairs").
    """
    cfg = config
    audit = _Audit(cfg, "pairs")
    kept: list[dict] = []
    seen: set[str] = set()
    all_pids: dict[str, None] = {}
    for i, p in enumerate(pairs):
        try:
            _validate_pair(p)
        except (KeyError, ValueError, TypeError) as e:
            what = f"missing key {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"pair {i} (problem_id {p.get('problem_id')!r}): {what}") from None
        all_pids[str(p["problem_id"])] = None
        pid_hash = p.get("pair_id") or pair_id(p["problem_id"], p["chosen"], p["rejected"])
        if pid_hash in seen:
            audit.duplicates += 1
            continue
        seen.add(pid_hash)
        cap = _cap(p.get("max_new_tokens"), cfg, f"pair {i} (problem_id {p['problem_id']!r})")
        c_tok, r_tok = int(p["chosen_tokens"]), int(p["rejected_tokens"])
        reasons = audit.check(float(p["chosen_reward"]), float(p["rejected_reward"]), c_tok, r_tok,
                              _is_truncated(c_tok, p.get("chosen_finish_reason"), cap, cfg.truncation_buffer),
                              _is_truncated(r_tok, p.get("rejected_finish_reason"), cap, cfg.truncation_buffer))
        if not reasons:
            kept.append({"pair_id": pid_hash, **{k: v for k, v in p.items() if k != "pair_id"}})
    with_pairs = len({p["problem_id"] for p in kept})
    prompts = {"total": len(all_pids), "with_pairs": with_pairs, "without_admissible_pair": len(all_pids) - with_pairs}
    return kept, audit.result(kept, prompts)


# ----------------------------------------------------------------------------------------------- writing


def write_pairs(out_dir: str | os.PathLike, pairs: Sequence[Mapping], audit: Mapping) -> tuple[Path, Path]:
    """``out_dir/pairs.jsonl`` and ``out_dir/audit.json``, each written atomically."""
    out_dir = Path(out_dir)
    return write_jsonl(out_dir / "pairs.jsonl", pairs), atomic_write_json(out_dir / "audit.json", audit)


def check_build_output(out_dir: str | os.PathLike, pairs: Sequence[Mapping],
                       overwrite: bool = BuildPairsSettings.overwrite, cohort: Optional[tuple[int, int]] = None) -> str:
    """What writing these pairs (and the cohort `(size, seed)`, if any) into `out_dir` would do, checked before
    anything is written: "new" (no pairs there), "same" (pairs.jsonl already holds exactly these pairs: a rerun;
    a cohort asked for is added when there is none) or "replace" (other pairs, with `overwrite`: pairs.jsonl,
    audit.json and the cohort frozen from the old pairs are all replaced). OutputExistsError when the folder holds
    other pairs (or a cohort frozen from them) and not `overwrite`: they are never replaced silently."""
    out_dir = Path(out_dir)
    path, cohort_dir = out_dir / "pairs.jsonl", out_dir / "cohort"
    frozen = (cohort_dir / "manifest.json").exists() or (cohort_dir / "pairs.jsonl").exists()
    if not path.exists() and not frozen:
        return "new"
    same = path.exists() and path.read_bytes() == jsonl_bytes(pairs, path)
    if same and (cohort is None or not frozen or _same_cohort(cohort_dir, pairs, *cohort)):
        return "same"
    if overwrite:
        return "replace"
    if same:
        raise OutputExistsError(f"{cohort_dir}: a frozen cohort already exists ({_describe_cohort(cohort_dir)}); "
                                f"freezing size {cohort[0]} with seed {cohort[1]} would replace it: choose another "
                                "--out_dir, or pass --overwrite to replace it")
    held = f"{sum(1 for _ in path.open('rb'))} pairs" if path.exists() else "no pairs.jsonl"
    stale = f" and the cohort frozen from them ({cohort_dir})" if frozen else ""
    raise OutputExistsError(f"{path if path.exists() else out_dir}: holds {held}{stale}; this build gives "
                            f"{len(pairs)} other pairs and would replace them: choose another --out_dir, or pass "
                            "--overwrite to replace pairs.jsonl, audit.json and cohort/")


def _describe_cohort(cohort_dir: Path) -> str:
    try:
        m = json.loads((cohort_dir / "manifest.json").read_text(encoding="utf-8"))
        return f"size {m.get('size')}, seed {m.get('seed')}"
    except (OSError, ValueError):
        return "no readable manifest"


def _same_cohort(cohort_dir: Path, pairs: Sequence[Mapping], size: int, seed: int) -> bool:
    """Whether the cohort frozen in `cohort_dir` is the one `freeze_cohort(pairs, size, seed)` would write."""
    try:
        m = json.loads((cohort_dir / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (m.get("size"), m.get("seed"), m.get("pair_ids")) == (size, seed, cohort_order(pairs, seed)[:size])


def cohort_order(pairs: Sequence[Mapping], seed: int) -> list[str]:
    """Every pair id in cohort order: ascending ``sha256(f"{seed}:{pair_id}")``."""
    ids = [p.get("pair_id") or pair_id(p["problem_id"], p["chosen"], p["rejected"]) for p in pairs]
    return sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())


def remove_cohort(out_dir: str | os.PathLike) -> Optional[Path]:
    """Deletes ``out_dir/cohort`` (its manifest first, so an interrupted removal never leaves a manifest that
    vouches for pairs it no longer matches); returns the folder removed, or None."""
    cohort = Path(out_dir) / "cohort"
    if not cohort.exists():
        return None
    (cohort / "manifest.json").unlink(missing_ok=True)
    shutil.rmtree(cohort)
    return cohort


def _cohort_dir(path: str | os.PathLike) -> Path:
    # Accept the cohort folder itself or the build folder that holds cohort/.
    path = Path(path)
    if not (path / "manifest.json").exists() and (path / "cohort" / "manifest.json").exists():
        return path / "cohort"
    return path


def check_cohort_writable(out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """``out_dir/cohort``; raises FileExistsError if a cohort is frozen there and not ``overwrite``."""
    cohort = Path(out_dir) / "cohort"
    existing = [n for n in ("manifest.json", "pairs.jsonl") if (cohort / n).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{cohort}: a frozen cohort already exists ({', '.join(existing)}); "
                              "pass --overwrite to replace it")
    return cohort


def freeze_cohort(pairs: Sequence[Mapping], out_dir: str | os.PathLike, size: int,
                  seed: int = BuildPairsSettings.seed, overwrite: bool = False, source: Optional[str] = None) -> dict:
    """Freezes ``size`` pairs chosen by ``seed`` into ``out_dir/cohort/{pairs.jsonl, manifest.json}``.

    Order: ascending ``sha256(f"{seed}:{pair_id}")`` (a seeded shuffle independent of input order), first
    ``size`` kept, written in that order. The manifest holds ``pair_ids`` (file order), ``sha256`` of
    pairs.jsonl, ``size``, ``seed``, ``n_available`` and ``source``; it is written last, so a cohort without a
    manifest is an interrupted freeze. Raises FileExistsError if a cohort exists and not ``overwrite``,
    ValueError if ``size`` exceeds the pairs available or pair ids repeat.
    """
    cohort = check_cohort_writable(out_dir, overwrite)
    if size < 1:
        raise ValueError(f"cohort size must be >= 1, got {size}")
    if size > len(pairs):
        raise ValueError(f"cohort size {size} exceeds the {len(pairs)} pairs available")
    recs = [{"pair_id": p.get("pair_id") or pair_id(p["problem_id"], p["chosen"], p["rejected"]),
             **{k: v for k, v in p.items() if k != "pair_id"}} for p in pairs]
    ids = [r["pair_id"] for r in recs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"pair_id {dup!r} occurs more than once; remove duplicates before freezing a cohort")
    order = sorted(range(len(recs)), key=lambda i: hashlib.sha256(f"{seed}:{ids[i]}".encode()).hexdigest())
    chosen = [recs[i] for i in order[:size]]
    if (cohort / "manifest.json").exists():
        os.unlink(cohort / "manifest.json")  # overwrite: never leave an old manifest next to new pairs
    path = write_jsonl(cohort / "pairs.jsonl", chosen)
    manifest = {"file": "pairs.jsonl", "sha256": sha256_file(path), "size": size, "seed": seed,
                "n_available": len(recs), "selection": "ascending sha256(f'{seed}:{pair_id}'), first size",
                "source": source, "pair_ids": [r["pair_id"] for r in chosen]}
    atomic_write_json(cohort / "manifest.json", manifest)
    return manifest


def verify_cohort(path: str | os.PathLike) -> dict:
    """Checks a frozen cohort (its folder, or the build folder holding ``cohort/``); returns its manifest.

    Raises CohortError naming the file when the manifest or pairs file is missing, or the pairs file's sha256
    differs from the manifest's (the file changed after freezing).
    """
    cohort = _cohort_dir(path)
    manifest_path = cohort / "manifest.json"
    if not manifest_path.is_file():
        raise CohortError(f"{manifest_path}: no cohort manifest (freeze one with build_pairs --cohort_size)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        expected = manifest["sha256"]
        pairs_path = cohort / manifest.get("file", "pairs.jsonl")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CohortError(f"{manifest_path}: unreadable manifest: {e}") from None
    if not pairs_path.is_file():
        raise CohortError(f"{pairs_path}: missing (listed in {manifest_path})")
    actual = sha256_file(pairs_path)
    if actual != expected:
        raise CohortError(f"{pairs_path}: sha256 {actual} does not match {manifest_path} ({expected}); "
                          "the frozen cohort was modified")
    return manifest


def load_cohort(path: str | os.PathLike) -> list[dict]:
    """:func:`verify_cohort`, then the cohort's pairs (in manifest order)."""
    manifest = verify_cohort(path)
    cohort = _cohort_dir(path)
    return read_pairs(cohort / manifest.get("file", "pairs.jsonl"))


# ------------------------------------------------------------------------------------------------ report


def format_audit(audit: Mapping) -> str:
    """A few human-readable lines summarising an audit dict."""
    p = audit["prompts"]
    lines = [f"prompts: {p['total']} total, {p['with_pairs']} with pairs"
             + "".join(f", {p[k]} {k}" for k in ("single_sample", "all_tied", "without_admissible_pair") if k in p),
             f"candidate pairs: {audit['candidates']} checked, {audit['passed']} passed, {audit['dropped']} dropped"
             + (f", {audit['rescued']} rescued (best_admissible)" if audit.get("rescued") else "")
             + (f", {audit['duplicates_removed']} duplicates removed" if audit.get("duplicates_removed") else ""),
             f"pairs kept: {audit['kept']}"]
    if audit["dropped"]:
        lines.append("dropped, first failing reason: "
                     + ", ".join(f"{r} {n}" for r, n in audit["first_fail_counts"].items() if n))
        lines.append("failing reasons (a pair can fail several): "
                     + ", ".join(f"{r} {n}" for r, n in audit["fail_counts"].items() if n))
    kept = audit["distributions"]["kept"]
    if kept.get("n"):
        lines.append(f"kept: chosen tokens mean {kept['chosen_tokens']['mean']:.1f}, rejected tokens mean "
                     f"{kept['rejected_tokens']['mean']:.1f}, length bias (chosen - rejected) mean "
                     f"{kept['length_bias']['mean']:+.1f}, margin mean {kept['margin']['mean']:.3f}")
    if "input" in audit:
        inp = audit["input"]
        lines.append(f"input: {inp.get('path')} ({inp.get('records')} records, "
                     f"{inp.get('skipped_malformed', 0)} malformed skipped)")
    if "cohort" in audit:
        c = audit["cohort"]
        lines.append(f"cohort: {c['size']} pairs frozen (seed {c['seed']}) in {c['dir']}, sha256 {c['sha256'][:12]}…")
    return "\n".join(lines)
