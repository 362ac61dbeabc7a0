"""The gain of a SELECTED model, estimated honestly: cross-fitting over prompts.

Picking the best of m checkpoints by its difference to the base and quoting that difference overstates it (the
winner's curse): with 8 checkpoints and no true effect at all, the best one shows +2 to +3 pp on 100 prompts.
Cross-fitting separates choosing from measuring:

* the prompts are split into two halves (by ``sha256(f"{seed}:{problem_id}")`` order, alternating, so the split
  does not depend on the file's order and the halves differ in size by at most one);
* the best model is chosen on half A and its difference measured on half B, and the other way round;
* each prompt thus carries the difference of the model chosen WITHOUT it; their mean is the selection-adjusted
  gain: an unbiased estimate of what "evaluate m models on this many prompts and keep the best" delivers (chosen on
  half the prompts), and its interval is the usual paired one on those per-prompt values.

When both halves choose the same model the estimate is that model's difference (no selection effect); when they
disagree, the disagreement itself says the choice is noise.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Optional, Sequence

import numpy as np

from jaxrl.evaluation.stats import metric_bounds, paired_difference_rows

__all__ = ["fold_of", "cross_fit_values", "selection_summary"]


def fold_of(problem_ids: Sequence[str], seed: int = 0) -> np.ndarray:
    """0/1 per prompt: the two halves of the cross-fit (module docstring)."""
    keys = [hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest() for pid in problem_ids]
    order = np.argsort(np.array(keys), kind="stable")
    fold = np.empty(len(keys), np.int64)
    fold[order] = np.arange(len(keys)) % 2
    return fold


def cross_fit_values(diffs, fold, higher_is_better: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Per-prompt differences of the model chosen on the OTHER half.

    Args:
      diffs: ``[M, n]`` per-prompt differences (model - baseline) of M candidate models, or ``[R, M, n]``.
      fold: ``[n]`` 0/1 half of each prompt (:func:`fold_of`).
    Returns:
      ``(values [.., n], chosen [.., 2])``: ``chosen[f]`` is the model index picked on half ``f`` (used to
      measure the prompts of half ``1 - f``).
    """
    d = np.asarray(diffs, np.float64)
    fold = np.asarray(fold)
    sign = 1.0 if higher_is_better else -1.0
    chosen, values = [], np.empty(d.shape[:-2] + d.shape[-1:])
    for f in (0, 1):
        on = fold == f
        if not on.any() or on.all():
            raise ValueError("cross_fit_values: each half needs at least one prompt")
        pick = np.argmax(sign * d[..., on].mean(axis=-1), axis=-1)  # chosen on half f
        chosen.append(pick)
        other = ~on
        values[..., other] = np.take_along_axis(d[..., other], pick[..., None, None], axis=-2)[..., 0, :]
    return values, np.stack(chosen, axis=-1)


def selection_summary(per_prompt: Mapping[str, Mapping[str, Mapping[str, float]]], baseline: str, metric: str, *,
                      rows: Sequence[Mapping] = (), higher_is_better: bool = True, confidence: float = 0.95,
                      n_resamples: int = 10000, seed: int = 0) -> Optional[dict]:
    """The naive best model on ``metric`` and its cross-fitted, selection-adjusted gain.

    Args:
      per_prompt: ``{model: per_prompt_values(...)}`` (baseline included).
      rows: the comparison rows of this family (for the naive best's intervals), optional.
    Returns:
      None with fewer than two candidate models or four prompts, else ``{"metric", "n_candidates", "n_pairs",
      "naive": {"model", "diff", "ci_low", "ci_high", "simultaneous_ci_low", "simultaneous_ci_high"},
      "cross_fit": {"diff", "ci_low", "ci_high", "p_value", "test", "n_pairs", "chosen_on_half": [name, name],
      "agree": bool, "split": ...}}``.
    """
    names = [n for n in per_prompt if n != baseline]
    base = per_prompt[baseline][metric]
    ids = list(base)
    if len(names) < 2 or len(ids) < 4:
        return None
    d = np.array([[per_prompt[n][metric][p] - base[p] for p in ids] for n in names])
    fold = fold_of(ids, seed)
    values, chosen = cross_fit_values(d, fold, higher_is_better)
    r = paired_difference_rows(values[None], np.zeros((1, len(ids))), confidence=confidence,
                               n_resamples=n_resamples, seed=seed, bounds=metric_bounds(metric))
    sign = 1.0 if higher_is_better else -1.0
    best = names[int(np.argmax(sign * d.mean(axis=1)))]
    row = next((c for c in rows if c["model"] == best and c["metric"] == metric), {})
    picked = [names[int(i)] for i in chosen]
    return {"metric": metric, "higher_is_better": higher_is_better, "n_candidates": len(names),
            "n_pairs": len(ids),
            "naive": {"model": best, "diff": float(d[names.index(best)].mean()),
                      **{k: row.get(k) for k in ("ci_low", "ci_high", "p_value", "simultaneous_ci_low",
                                                 "simultaneous_ci_high", "simultaneous_p_value")}},
            "cross_fit": {"diff": float(r["diff"][0]), "ci_low": float(r["ci_low"][0]),
                          "ci_high": float(r["ci_high"][0]), "p_value": float(r["p_value"][0]),
                          "test": str(r["test"][0]).split(" ")[0], "n_pairs": len(ids), "confidence": confidence,
                          "chosen_on_half": picked, "agree": picked[0] == picked[1],
                          "split": f"2 halves by sha256(seed:problem_id) order, alternating (seed {seed})"}}
