"""Censoring-aware comparison of a model with the baseline: what the generation cap does to a difference.

A completion that hits the cap (``finish_reason == "length"``) scores 0 whatever it would have become, so a
model that finishes more often looks better even if it solves nothing more. Per (model, metric) against the
baseline, on the same prompts (every part a paired interval over prompts, :func:`stats.paired_difference`):

* ``finished`` -- the difference on the prompts BOTH models finished at least once, each prompt's mean over its
  finished samples (the paired form of results.md's "untruncated" columns, which average different prompts);
* ``bounds`` -- the difference if every truncated sample had scored 0 (as it does) versus the prompt's mean over
  its finished samples (the model's mean over finished samples where a prompt has none): ``lower`` = model as
  scored - baseline imputed, ``upper`` = model imputed - baseline as scored. The censoring-robust statement is
  the interval from lower's low end to upper's high end, under the assumption that a cut-off completion would
  not have done better than the finished ones of its prompt;
* ``decomposition`` -- per prompt, with finish rate f and mean over finished samples q (a model that never
  finishes a prompt takes the other model's q there), the exact split ``f_m q_m - f_b q_b =
  (f_m - f_b)(q_m + q_b)/2 + (q_m - q_b)(f_m + f_b)/2``: a ``finish`` part ("finishes more often") and a
  ``quality`` part ("better when it finishes"), each with its interval; ``residual`` is what truncated samples
  scored above 0 (0 for the rewards of jaxrl.rewards).

Re-sampled records (``launchers.evaluate --resample_max_new_tokens``: the truncated samples drawn again at a
larger cap, continuing the same random stream) are kept under ``<eval>/resampled/<cap>/<model>.jsonl`` so that
the comparison that matters -- model vs baseline, BOTH at the larger cap -- is computed (``extended_cap``) and
can be rebuilt from disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from jaxrl.data import formats
from jaxrl.evaluation.metrics import per_prompt_finished, per_prompt_values
from jaxrl.evaluation.stats import compare, paired_difference

__all__ = ["RESAMPLED_DIR", "TASK_METRICS", "resampled_path", "save_resampled", "load_resampled",
           "censored_comparison", "censoring_section"]

RESAMPLED_DIR = "resampled"
TASK_METRICS = ("partial_reward_mean", "strict_rate")
_TRUNCATED = {"partial_reward_mean": "truncated_partial", "strict_rate": "truncated_strict"}


def resampled_path(eval_dir: str | os.PathLike, cap: int, name: str) -> Path:
    """``<eval_dir>/resampled/<cap>/<name>.jsonl``: model ``name``'s records with its truncated samples re-drawn at
    ``cap`` new tokens (the other samples as they were)."""
    return Path(eval_dir) / RESAMPLED_DIR / str(int(cap)) / f"{name}.jsonl"


def save_resampled(eval_dir: str | os.PathLike, cap: int, name: str, records: Sequence[Mapping]) -> Path:
    """Writes the merged records of ``termination.resample_truncated(...)["records"]`` (validated SAMPLES)."""
    return formats.write_samples(resampled_path(eval_dir, cap, name), records)


def load_resampled(eval_dir: str | os.PathLike) -> dict[int, dict[str, list]]:
    """``{cap: {model: records}}`` of every re-sampled file under ``<eval_dir>/resampled/``."""
    root = Path(eval_dir) / RESAMPLED_DIR
    out: dict[int, dict[str, list]] = {}
    if not root.is_dir():
        return out
    for folder in sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        files = sorted(folder.glob("*.jsonl"), key=lambda p: formats.model_order(p.stem))
        if files:
            out[int(folder.name)] = {p.stem: formats.read_samples(p) for p in files}
    return out


def _row(d_or_a, b=None, *, n_resamples, confidence, seed) -> dict:
    a = np.asarray(d_or_a, np.float64)
    b = np.zeros_like(a) if b is None else np.asarray(b, np.float64)
    r = paired_difference(a, b, confidence=confidence, n_resamples=n_resamples, seed=seed)
    return {k: r[k] for k in ("diff", "ci_low", "ci_high", "p_value", "test", "n_pairs")}


def censored_comparison(model_records: Sequence[Mapping], base_records: Sequence[Mapping], *,
                        metrics: Sequence[str] = TASK_METRICS, confidence: float = 0.95, n_resamples: int = 10000,
                        seed: int = 0) -> dict:
    """``{metric: {"finished", "bounds", "decomposition"}}`` for one model against the baseline (module
    docstring); every entry has ``diff, ci_low, ci_high, p_value, test, n_pairs``."""
    vm, vb = per_prompt_values(model_records), per_prompt_values(base_records)
    fm, fb = per_prompt_finished(model_records), per_prompt_finished(base_records)
    ids = list(vb["partial_reward_mean"])
    if set(ids) != set(vm["partial_reward_mean"]):
        raise ValueError("censored_comparison: the model and the baseline were not evaluated on the same prompts")
    kw = dict(n_resamples=n_resamples, confidence=confidence, seed=seed)
    out = {}
    for metric in metrics:
        a = np.array([vm[metric][i] for i in ids])
        b = np.array([vb[metric][i] for i in ids])
        f_m = np.array([fm["finish_rate"][i] for i in ids])
        f_b = np.array([fb["finish_rate"][i] for i in ids])
        q_m = np.array([fm[metric].get(i, np.nan) for i in ids])
        q_b = np.array([fb[metric].get(i, np.nan) for i in ids])
        entry: dict = {"finish_rate_model": float(f_m.mean()), "finish_rate_baseline": float(f_b.mean())}
        both = ~np.isnan(q_m) & ~np.isnan(q_b)
        entry["finished"] = (_row(q_m[both], q_b[both], **kw) if both.any() else
                             {"diff": None, "ci_low": None, "ci_high": None, "p_value": None, "test": None,
                              "n_pairs": 0})
        # Bounds: a truncated sample scored 0 (as observed) or as its prompt's finished mean.
        g_m = float(np.nanmean(q_m)) if (~np.isnan(q_m)).any() else 0.0
        g_b = float(np.nanmean(q_b)) if (~np.isnan(q_b)).any() else 0.0
        imp_m = np.where(np.isnan(q_m), g_m, q_m)
        imp_b = np.where(np.isnan(q_b), g_b, q_b)
        lower, upper = _row(a, imp_b, **kw), _row(imp_m, b, **kw)
        entry["bounds"] = {"lower": lower, "upper": upper, "ci_low": lower["ci_low"], "ci_high": upper["ci_high"],
                           "assumption": "a truncated completion would score between 0 and the mean of its "
                                         "prompt's finished completions"}
        # Decomposition into finishing more often and doing better when finished.
        qm2 = np.where(np.isnan(q_m), np.where(np.isnan(q_b), 0.0, q_b), q_m)
        qb2 = np.where(np.isnan(q_b), qm2, q_b)
        finish = (f_m - f_b) * (qm2 + qb2) / 2
        quality = (qm2 - qb2) * (f_m + f_b) / 2
        residual = (a - b) - finish - quality
        entry["decomposition"] = {"finish": _row(finish, **kw), "quality": _row(quality, **kw),
                                  "residual": float(residual.mean())}
        out[metric] = entry
    return out


def censoring_section(records: Mapping[str, Sequence[Mapping]], baseline: str, *,
                      resampled: Optional[Mapping[int, Mapping[str, Sequence[Mapping]]]] = None,
                      metrics: Sequence[str] = TASK_METRICS, confidence: float = 0.95, n_resamples: int = 10000,
                      seed: int = 0) -> Optional[dict]:
    """results.json ``censoring``: None when no sample of any model hit the cap (and nothing was re-sampled).

    Returns ``{"models": {name: censored_comparison(...)}, "extended_cap": {"max_new_tokens", "models": {name:
    {"comparisons": compare rows at the larger cap (both models re-sampled), "truncation_rate",
    "baseline_truncation_rate", "censored": censored_comparison(...)}}} | None}``. ``extended_cap`` uses the
    largest re-sampled cap that has the baseline.
    """
    truncated = any(r["finish_reason"] == "length" for recs in records.values() for r in recs)
    if not truncated and not resampled:
        return None
    kw = dict(confidence=confidence, n_resamples=n_resamples, seed=seed)
    out: dict = {"models": {}, "extended_cap": None, "confidence": confidence}
    if truncated:
        for name, recs in records.items():
            if name != baseline:
                out["models"][name] = censored_comparison(recs, records[baseline], metrics=metrics, **kw)
    caps = [c for c, by in (resampled or {}).items() if baseline in by and len(by) > 1]
    if caps:
        cap = max(caps)
        by = resampled[cap]
        ext = {"max_new_tokens": cap, "models": {}}
        vb = per_prompt_values(by[baseline])
        base_trunc = float(np.mean(list(vb["truncation_rate"].values())))
        for name, recs in by.items():
            if name == baseline:
                continue
            vm = per_prompt_values(recs)
            rows = compare({name: vm, baseline: vb}, baseline, [*metrics, "truncation_rate"], family=False,
                           n_resamples=n_resamples, confidence=confidence, seed=seed)
            ext["models"][name] = {"comparisons": rows,
                                   "truncation_rate": float(np.mean(list(vm["truncation_rate"].values()))),
                                   "baseline_truncation_rate": base_trunc,
                                   "n_resampled": sum(1 for r in recs if r.get("resampled")),
                                   "baseline_n_resampled": sum(1 for r in by[baseline] if r.get("resampled")),
                                   "censored": censored_comparison(recs, by[baseline], metrics=metrics, **kw)}
        out["extended_cap"] = ext
    return out
