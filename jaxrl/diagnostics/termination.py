"""Termination analysis: how much of a model's score is decided by the generation cap.

A completion that hits the cap (``finish_reason == "length"``) scores 0 whatever it would have become, so a
high truncation rate censors the metrics. Three views:

* reward vs completion length (binned), and truncation rate per model;
* the metrics with truncated samples excluded (``model_metrics(...)["untruncated"]``, conditional on finishing);
* the metrics after re-sampling only the truncated prompts at a larger cap (:func:`resample_truncated`, given a
  ``resample_fn`` the evaluator provides), compared with the original on the same prompts, and -- the
  comparison that matters -- every model against the baseline with BOTH re-sampled at the larger cap
  (``extended_cap``, from ``jaxrl.evaluation.censoring``; the merged records are kept on disk by the evaluator
  under ``eval/resampled/<cap>/``, so this can be rebuilt).

Output of :func:`termination_analysis` (``termination.json``)::

    {"threshold": 0.1,
     "models": {NAME: {"n_prompts", "n_samples", "n_truncated", "truncation_rate", "max_new_tokens",
                       "metrics": model_metrics(records)   # incl. "untruncated"
                       "reward_truncated_mean", "reward_finished_mean",   # mean partial (None if no samples)
                       "reasons": {reason: count},
                       "reward_vs_length": [{"lo", "hi", "n", "partial_mean", "strict_rate",
                                             "truncated_fraction"}, ...]}},
     "resampled": {NAME: resample_truncated(...) without "records" (+ "records_file" when kept)},  # when given
     "extended_cap": censoring_section(...)["extended_cap"],   # when the baseline was re-sampled too
     "flags": [Flag.to_dict(), ...]}
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from jaxrl.data import formats
from jaxrl.data.formats import validate_sample
from jaxrl.diagnostics import red_flags
from jaxrl.diagnostics.flags import DiagnoseSettings
from jaxrl.evaluation.censoring import censoring_section, save_resampled
from jaxrl.evaluation.metrics import model_metrics, per_prompt_values
from jaxrl.evaluation.stats import compare
from jaxrl.utils.io import atomic_write_json

__all__ = ["reward_vs_length", "termination_analysis", "resample_truncated", "resample_evaluation", "ResampleFn"]

# resample_fn(problem_ids, max_new_tokens) -> one SAMPLES record per id, in order. An id repeats when several
# samples of that prompt were truncated.
ResampleFn = Callable[[Sequence[str], int], Sequence[Mapping]]


def _cap(records: Sequence[Mapping]) -> Optional[int]:
    caps = {r.get("max_new_tokens") for r in records} - {None}
    return max(caps) if caps else None


def reward_vs_length(records: Sequence[Mapping], n_bins: int = 8, max_tokens: Optional[int] = None) -> list[dict]:
    """Mean partial reward, strict rate and truncated fraction per completion-length bin.

    Bins are ``n_bins`` equal-width intervals over [0, ``max_tokens``] (default: the largest cap in the records,
    else the longest completion); the last bin is closed and holds the truncated samples at the cap. Empty bins
    are kept with ``n = 0`` and None means, so bins line up across models.
    """
    if not records:
        return []
    tokens = np.array([r["completion_tokens"] for r in records], dtype=np.float64)
    partial = np.array([r["partial"] for r in records], dtype=np.float64)
    strict = np.array([bool(r["strict"]) for r in records], dtype=np.float64)
    trunc = np.array([r["finish_reason"] == "length" for r in records], dtype=np.float64)
    top = float(max_tokens or _cap(records) or tokens.max() or 1.0)
    top = max(top, float(tokens.max()))
    edges = np.linspace(0.0, top, n_bins + 1)
    which = np.clip(np.searchsorted(edges, tokens, side="right") - 1, 0, n_bins - 1)
    out = []
    for b in range(n_bins):
        sel = which == b
        n = int(sel.sum())
        out.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "n": n,
                    "partial_mean": float(partial[sel].mean()) if n else None,
                    "strict_rate": float(strict[sel].mean()) if n else None,
                    "truncated_fraction": float(trunc[sel].mean()) if n else None})
    return out


def _model_summary(records: Sequence[Mapping], n_bins: int) -> dict:
    trunc = [r for r in records if r["finish_reason"] == "length"]
    done = [r for r in records if r["finish_reason"] != "length"]
    metrics = model_metrics(records)
    return {
        "n_prompts": metrics["n_prompts"],
        "n_samples": metrics["n_samples"],
        "n_truncated": len(trunc),
        "truncation_rate": metrics["truncation_rate"],
        "max_new_tokens": _cap(records),
        "metrics": metrics,
        "reward_truncated_mean": float(np.mean([r["partial"] for r in trunc])) if trunc else None,
        "reward_finished_mean": float(np.mean([r["partial"] for r in done])) if done else None,
        "reasons": dict(Counter(str(r.get("reason")) for r in records if r.get("reason"))),
        "reward_vs_length": reward_vs_length(records, n_bins),
    }


def termination_analysis(samples: Mapping[str, Sequence[Mapping]], *, n_bins: int = DiagnoseSettings.n_bins,
                         threshold: float = DiagnoseSettings.threshold,
                         resampled: Optional[Mapping[str, Mapping]] = None, baseline: str = "base",
                         n_resamples: int = 10000, confidence: float = 0.95, seed: int = 0) -> dict:
    """Per-model termination view (module docstring) with ``truncation_censoring`` flags.

    Args:
      samples: ``{model: SAMPLES records}``.
      n_bins: length bins of ``reward_vs_length``.
      threshold: truncation rate above which a model's results are flagged as censored.
      resampled: ``{model: resample_truncated(...)}`` to include (their ``records`` are not copied into the
        output; the evaluator keeps them in ``records_file``). With the baseline among them, ``extended_cap``
        compares every model with the baseline, both at the larger cap.
    """
    models = {name: _model_summary(recs, n_bins) for name, recs in samples.items()}
    flags = [red_flags.truncation_censoring(name, m["truncation_rate"], m["n_samples"], threshold, m["max_new_tokens"])
             for name, m in models.items()]
    out = {"threshold": threshold, "models": models, "flags": [f.to_dict() for f in red_flags.sort_flags(flags)]}
    if resampled:
        out["resampled"] = {n: {k: v for k, v in r.items() if k != "records"} for n, r in resampled.items()}
        caps = {int(r["max_new_tokens"]) for r in resampled.values()}
        if baseline in resampled and len(resampled) > 1 and len(caps) == 1:
            section = censoring_section({n: samples[n] for n in resampled}, baseline,
                                        resampled={caps.pop(): {n: r["records"] for n, r in resampled.items()}},
                                        n_resamples=n_resamples, confidence=confidence, seed=seed)
            out["extended_cap"] = section["extended_cap"] if section else None
    return out


def resample_truncated(records: Sequence[Mapping], resample_fn: ResampleFn, max_new_tokens: int, *,
                       metrics: Sequence[str] = ("partial_reward_mean", "strict_rate", "truncation_rate"),
                       n_resamples: int = 10000, confidence: float = 0.95, seed: int = 0) -> dict:
    """Re-runs only the truncated samples at a larger cap and recomputes the metrics.

    Args:
      records: one model's SAMPLES records.
      resample_fn: ``(problem_ids, max_new_tokens) -> records``; one id per truncated sample (ids repeat when a
        prompt had several truncated samples), one SAMPLES record back per id, in the same order.
      max_new_tokens: the larger cap; must exceed every cap the truncated samples were drawn with.
    Returns:
      ``{"max_new_tokens", "n_resampled", "still_truncated", "before": model_metrics, "after": model_metrics,
      "comparisons": stats.compare rows of after vs before (same prompts, paired), "records": merged records}``.
      Each truncated sample is replaced by its re-sample (keeping its ``sample_index``); others are unchanged.
    Raises:
      ValueError when the cap is not larger, or resample_fn returns the wrong number / prompts / malformed records.
    """
    trunc = [r for r in records if r["finish_reason"] == "length"]
    old_caps = {r.get("max_new_tokens") for r in trunc} - {None}
    if old_caps and max_new_tokens <= max(old_caps):
        raise ValueError(f"resample_truncated: max_new_tokens {max_new_tokens} must exceed the original cap "
                         f"{max(old_caps)}")
    ids = [str(r["problem_id"]) for r in trunc]
    new = list(resample_fn(ids, max_new_tokens)) if ids else []
    if len(new) != len(ids):
        raise ValueError(f"resample_fn returned {len(new)} records for {len(ids)} truncated samples")
    replaced = {}
    for i, (old, rec) in enumerate(zip(trunc, new)):
        try:
            validate_sample(rec)
        except KeyError as e:
            raise ValueError(f"resample_fn record {i}: missing key {e.args[0]!r}") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"resample_fn record {i}: {e}") from None
        if str(rec["problem_id"]) != str(old["problem_id"]):
            raise ValueError(f"resample_fn record {i}: problem_id {rec['problem_id']!r}, expected "
                             f"{old['problem_id']!r} (records must follow the ids' order)")
        replaced[(str(old["problem_id"]), int(old["sample_index"]))] = {
            **rec, "sample_index": int(old["sample_index"]), "resampled": True}
    merged = [replaced.get((str(r["problem_id"]), int(r["sample_index"])), r) for r in records]
    comps = compare({"after": per_prompt_values(merged), "before": per_prompt_values(records)}, baseline="before",
                    metrics=list(metrics), n_resamples=n_resamples, confidence=confidence, seed=seed)
    return {"max_new_tokens": int(max_new_tokens), "n_resampled": len(ids),
            "still_truncated": sum(1 for r in replaced.values() if r["finish_reason"] == "length"),
            "before": model_metrics(records), "after": model_metrics(merged), "comparisons": comps,
            "records": merged}


def resample_evaluation(ev, cap: int) -> str:
    """Re-draws the truncated samples of every model of a finished evaluation at the larger ``cap``.

    ``ev``: a ``jaxrl.evaluation.runner.Evaluator`` whose ``run()`` has written its samples. Keeps the merged
    records under ``<out>/resampled/<cap>/<model>.jsonl`` (``censoring.save_resampled``), writes
    ``<out>/termination.json`` (with every model vs the baseline, both at ``cap``) and rewrites results.json /
    results.md, whose ``censoring.extended_cap`` reads the kept records back. Returns termination.json's path.
    """
    samples = {name: formats.read_samples(formats.samples_path(ev.out, name)) for name in ev.specs}
    resampled = {}
    for name, recs in samples.items():
        resampled[name] = resample_truncated(recs, ev.resample_fn(name), cap, seed=ev.cfg.seed,
                                             n_resamples=ev.cfg.n_resamples, confidence=ev.cfg.confidence)
        resampled[name]["records_file"] = str(save_resampled(ev.out, cap, name, resampled[name]["records"]))
    report = termination_analysis(samples, threshold=ev.cfg.truncation_threshold, resampled=resampled,
                                  baseline=ev.cfg.baseline, n_resamples=ev.cfg.n_resamples,
                                  confidence=ev.cfg.confidence, seed=ev.cfg.seed)
    ev.write(samples, ev.run_audit())
    return str(atomic_write_json(ev.out / "termination.json", report))
