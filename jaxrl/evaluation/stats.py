"""Evaluation statistics: paired bootstrap intervals, an exact test on strict passes, model-vs-baseline
comparisons and the ``results.json`` / ``results.md`` writer (numpy + scipy; no jax).

Typical use (per-sample records -> metrics and per-prompt values, see :mod:`.metrics`)::

    metrics = {name: model_metrics(recs) for name, recs in records_by_model.items()}
    per_prompt = {name: per_prompt_values(recs) for name, recs in records_by_model.items()}
    comps = compare(per_prompt, baseline="base", metrics=["partial_reward_mean", "strict_rate"])
    write_results(out_dir, metrics, comps, max_new_tokens=8192)

Everything compares models on the SAME prompts (paired): a prompt's difficulty cancels in the per-prompt
difference, which is why a paired interval is much narrower than two independent ones.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings as _warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import scipy.stats

from jaxrl.evaluation.metrics import METRICS, default_ks, model_metrics, pass_at_k, per_prompt_values
from jaxrl.utils.io import atomic_write_json, atomic_write_text

__all__ = [
    "METRICS",
    "pass_at_k",
    "model_metrics",
    "per_prompt_values",
    "default_ks",
    "paired_bootstrap",
    "mcnemar_exact",
    "compare",
    "truncation_warning",
    "write_results",
    "format_results_md",
]

_METHODS = ("percentile", "bca")
# scipy >= 1.15 takes ``rng``; older releases only ``random_state`` (pyproject allows scipy >= 1.13).
_RNG_KW = "rng" if "rng" in inspect.signature(scipy.stats.bootstrap).parameters else "random_state"


def _as_1d(x, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array of per-prompt values, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: contains NaN or infinite values")
    return arr


def _mean_diff(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(a, axis=axis) - np.mean(b, axis=axis)


def paired_bootstrap(
    a,
    b,
    n_resamples: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
    method: str = "percentile",
) -> dict:
    """Paired bootstrap confidence interval of ``mean(a) - mean(b)``.

    Args:
      a: per-prompt values of the model, shape ``[P]`` (e.g. each prompt's mean partial reward, in [0, 1]).
      b: per-prompt values of the baseline on the same prompts, in the same order, shape ``[P]``.
      n_resamples: bootstrap resamples; prompts are resampled with replacement, keeping (a_i, b_i) together.
      confidence: two-sided confidence level.
      seed: seeds the resampling (same inputs + seed -> same interval).
      method: "percentile" (default) or "bca" (bias-corrected and accelerated). If BCa is undefined for
        these data (scipy returns NaN, e.g. when nearly every resample equals the estimate) the percentile
        interval is returned and ``method`` says so.
    Returns:
      ``{"diff", "ci_low", "ci_high", "n_pairs", "method"}``; ``diff`` is in the units of the inputs.
      All-equal differences (including P == 1) give the zero-width interval ``[diff, diff]``.

    Implemented with ``scipy.stats.bootstrap(paired=True, vectorized=True)``.
    """
    a = _as_1d(a, "paired_bootstrap a")
    b = _as_1d(b, "paired_bootstrap b")
    if a.shape != b.shape:
        raise ValueError(f"paired_bootstrap: a and b must pair up, got lengths {a.size} and {b.size}")
    if a.size == 0:
        raise ValueError("paired_bootstrap: no pairs")
    if method not in _METHODS:
        raise ValueError(f"paired_bootstrap: method must be one of {_METHODS}, got {method!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"paired_bootstrap: confidence must be in (0, 1), got {confidence}")
    if int(n_resamples) < 1:
        raise ValueError(f"paired_bootstrap: n_resamples must be >= 1, got {n_resamples}")
    d = a - b
    diff = float(np.mean(a) - np.mean(b))
    out = {"diff": diff, "ci_low": diff, "ci_high": diff, "n_pairs": int(a.size), "method": method}
    if np.ptp(d) == 0.0:
        # Every resample has the same mean difference: the interval is a point (scipy would warn / NaN).
        return out

    def run(m: str):
        with _warnings.catch_warnings():
            _warnings.simplefilter("ignore")  # DegenerateDataWarning for BCa: handled below by the fallback
            res = scipy.stats.bootstrap(
                (a, b), _mean_diff, n_resamples=int(n_resamples), paired=True, vectorized=True,
                confidence_level=confidence, method=m, **{_RNG_KW: np.random.default_rng(seed)},
            )
        return float(res.confidence_interval.low), float(res.confidence_interval.high)

    lo, hi = run("BCa" if method == "bca" else "percentile")
    if method == "bca" and not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = run("percentile")
        out["method"] = "percentile (bca undefined for these data)"
    out["ci_low"], out["ci_high"] = lo, hi
    return out


def _two_sided_binom_half(k_min: int, n: int) -> float:
    # Exact two-sided binomial test at p = 1/2: the distribution is symmetric, so the p-value is twice the
    # smaller tail, capped at 1.
    if n == 0:
        return 1.0
    return float(min(1.0, 2.0 * scipy.stats.binom.cdf(k_min, n, 0.5)))


def mcnemar_exact(a, b) -> dict:
    """McNemar's exact test on paired binary outcomes (e.g. strict pass of model ``a`` vs baseline ``b``).

    Args:
      a, b: per-prompt outcomes, shape ``[P]``, each 0/1 (or bool), same prompts in the same order.
    Returns:
      ``{"p_value", "b01", "b10", "n_pairs"}`` with ``b01`` = #(a=0, b=1) (model fails, baseline passes) and
      ``b10`` = #(a=1, b=0) (model passes, baseline fails). The p-value is the two-sided exact binomial test of
      ``b10`` out of ``b01 + b10`` discordant pairs at 1/2 (1.0 when there are no discordant pairs).
    """
    a = _as_1d(a, "mcnemar_exact a")
    b = _as_1d(b, "mcnemar_exact b")
    if a.shape != b.shape:
        raise ValueError(f"mcnemar_exact: a and b must pair up, got lengths {a.size} and {b.size}")
    for name, x in (("a", a), ("b", b)):
        if not np.all((x == 0) | (x == 1)):
            raise ValueError(f"mcnemar_exact {name}: outcomes must be 0/1")
    b01 = int(np.sum((a == 0) & (b == 1)))
    b10 = int(np.sum((a == 1) & (b == 0)))
    return {"p_value": _two_sided_binom_half(min(b01, b10), b01 + b10), "b01": b01, "b10": b10,
            "n_pairs": int(a.size)}


def _sign_test(a: np.ndarray, b: np.ndarray) -> dict:
    # Generalises McNemar to per-prompt rates (several samples a prompt): the exact sign test on the prompts
    # where the two differ. On 0/1 data it is exactly McNemar's exact test.
    b01 = int(np.sum(a < b))
    b10 = int(np.sum(a > b))
    return {"p_value": _two_sided_binom_half(min(b01, b10), b01 + b10), "b01": b01, "b10": b10,
            "n_pairs": int(a.size)}


def _aligned(model_vals, base_vals, model: str, baseline: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Pairs up two models' per-prompt values by problem id (mappings) or by position (arrays)."""
    if isinstance(model_vals, Mapping) != isinstance(base_vals, Mapping):
        raise TypeError(f"{metric}: model {model!r} and baseline {baseline!r} must both map problem_id -> value "
                        "or both be arrays")
    if not isinstance(base_vals, Mapping):
        a, b = np.asarray(model_vals, np.float64), np.asarray(base_vals, np.float64)
        if a.shape != b.shape:
            raise ValueError(f"{metric}: model {model!r} has {a.size} prompts, baseline {baseline!r} {b.size}")
        return a, b
    missing_in_model = [p for p in base_vals if p not in model_vals]
    missing_in_base = [p for p in model_vals if p not in base_vals]
    if missing_in_model or missing_in_base:
        def show(ids):
            return repr(ids[:20]) + (f" and {len(ids) - 20} more" if len(ids) > 20 else "")
        parts = []
        if missing_in_model:
            parts.append(f"{len(missing_in_model)} missing from model {model!r}: {show(missing_in_model)}")
        if missing_in_base:
            parts.append(f"{len(missing_in_base)} missing from baseline {baseline!r}: {show(missing_in_base)}")
        raise ValueError(f"{metric}: model {model!r} and baseline {baseline!r} were not evaluated on the same "
                         f"prompts; " + "; ".join(parts))
    ids = list(base_vals)  # baseline order, so results do not depend on the model's record order
    return (np.array([model_vals[p] for p in ids], np.float64), np.array([base_vals[p] for p in ids], np.float64))


def compare(
    models: Mapping[str, Mapping[str, Any]],
    baseline: str,
    metrics: Sequence[str] = ("partial_reward_mean", "strict_rate"),
    *,
    n_resamples: int = 10000,
    confidence: float = 0.95,
    seed: int = 0,
    method: str = "percentile",
) -> list[dict]:
    """Every non-baseline model against ``baseline``, on each metric: the ``comparisons`` of results.json.

    Args:
      models: ``{model_name: {metric: per_prompt}}`` where ``per_prompt`` maps problem_id -> value (as returned
        by ``metrics.per_prompt_values``) or is an array ``[P]`` aligned by position with the baseline's.
      baseline: key of ``models`` to compare against.
      metrics: per-prompt metrics to compare (any of ``metrics.METRICS``, or other keys the inputs hold).
      n_resamples, confidence, seed, method: passed to :func:`paired_bootstrap`.
    Returns:
      one dict per (model, metric), models in ``models`` order: ``{"model", "baseline", "metric", "diff",
      "ci_low", "ci_high", "n_pairs", "ci_crosses_zero", "model_value", "baseline_value", "confidence",
      "method", "n_resamples"}``; ``diff = model - baseline``; ``ci_crosses_zero`` is True when the interval
      contains 0 (no evidence of a difference at this level). ``strict_rate`` rows add ``p_value``, ``b01``,
      ``b10`` and ``p_value_test``: McNemar's exact test when every per-prompt value is 0/1 (one sample a
      prompt), else the exact sign test over prompts (its generalisation).
    Raises:
      KeyError naming the model / metric that is absent; ValueError naming the problem ids when a model and the
      baseline were not evaluated on the same prompts.
    """
    if baseline not in models:
        raise KeyError(f"baseline {baseline!r} is not among the models {list(models)}")
    rows = []
    for name, vals in models.items():
        if name == baseline:
            continue
        for metric in metrics:
            for who, v in ((name, vals), (baseline, models[baseline])):
                if metric not in v:
                    raise KeyError(f"model {who!r} has no per-prompt values for metric {metric!r}")
            a, b = _aligned(vals[metric], models[baseline][metric], name, baseline, metric)
            boot = paired_bootstrap(a, b, n_resamples=n_resamples, confidence=confidence, seed=seed, method=method)
            row = {
                "model": name,
                "baseline": baseline,
                "metric": metric,
                "diff": boot["diff"],
                "ci_low": boot["ci_low"],
                "ci_high": boot["ci_high"],
                "n_pairs": boot["n_pairs"],
                "ci_crosses_zero": bool(boot["ci_low"] <= 0.0 <= boot["ci_high"]),
                "model_value": float(a.mean()),
                "baseline_value": float(b.mean()),
                "confidence": confidence,
                "method": boot["method"],
                "n_resamples": int(n_resamples),
            }
            if metric == "strict_rate":
                binary = bool(np.all(np.isin(a, (0.0, 1.0))) and np.all(np.isin(b, (0.0, 1.0))))
                test = mcnemar_exact(a, b) if binary else _sign_test(a, b)
                row.update(p_value=test["p_value"], b01=test["b01"], b10=test["b10"],
                           p_value_test="mcnemar_exact" if binary else "sign_test")
            rows.append(row)
    return rows


def truncation_warning(rate: Optional[float], threshold: float = 0.10,
                       max_new_tokens: Optional[int] = None) -> Optional[str]:
    """A warning when more than ``threshold`` of completions hit the cap, else None.

    ``truncation_warning(0.45, max_new_tokens=8192)`` ->
    ``"truncation 45%: numbers are censored by the 8192-token cap"``.
    """
    if rate is None or not rate > threshold:
        return None
    cap = f"the {int(max_new_tokens)}-token cap" if max_new_tokens else "the generation cap"
    return f"truncation {rate:.0%}: numbers are censored by {cap}"


# ------------------------------------------------------------------------------------------------ writing

_MODEL_KEYS = ("partial_reward_mean", "strict_rate", "truncation_rate", "mean_completion_tokens", "pass_at_k",
               "n_prompts", "n_samples")
_COMPARISON_KEYS = ("model", "baseline", "metric", "diff", "ci_low", "ci_high", "n_pairs")


def _fmt(x, spec: str = ".4f") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)) and not spec.startswith("+"):
        return str(int(x))
    return format(float(x), spec)


def format_results_md(results: Mapping) -> str:
    """The human-readable ``results.md`` for a results.json dict."""
    models = results["models"]
    ks = sorted({k for m in models.values() for k in m.get("pass_at_k", {})}, key=int)
    lines = ["# Evaluation results", ""]
    if results.get("warnings"):
        lines += ["## Warnings", ""] + [f"- **{w}**" for w in results["warnings"]] + [""]
    lines += ["## Models", "",
              "Means are per prompt first (over a prompt's samples), then over prompts.", ""]
    head = (["model", "prompts", "samples", "partial_reward_mean", "strict_rate"] + [f"pass@{k}" for k in ks]
            + ["truncation_rate", "mean_completion_tokens", "untruncated partial_reward_mean",
               "untruncated strict_rate", "untruncated prompts / samples"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in models.items():
        u = m.get("untruncated") or {}
        cells = ([name, _fmt(m["n_prompts"]), _fmt(m["n_samples"]), _fmt(m["partial_reward_mean"]),
                  _fmt(m["strict_rate"])] + [_fmt(m["pass_at_k"].get(k)) for k in ks]
                 + [_fmt(m["truncation_rate"]), _fmt(m["mean_completion_tokens"], ".1f"),
                    _fmt(u.get("partial_reward_mean")), _fmt(u.get("strict_rate")),
                    f"{_fmt(u.get('n_prompts'))} / {_fmt(u.get('n_samples'))}" if u else "–"])
        lines.append("| " + " | ".join(cells) + " |")
    comps = results.get("comparisons") or []
    if comps:
        lines += ["", "## Comparisons (model - baseline, paired bootstrap over prompts)", "",
                  "An interval that contains 0 is no evidence of a difference.", "",
                  "| model | baseline | metric | diff | interval | n_pairs | p_value | contains 0 |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in comps:
            conf = c.get("confidence")
            interval = f"[{_fmt(c['ci_low'], '+.4f')}, {_fmt(c['ci_high'], '+.4f')}]"
            if conf is not None:
                interval = f"{conf:.0%} {interval}"
            p = c.get("p_value")
            p_cell = "" if p is None else f"{p:.4g} ({c.get('p_value_test', 'exact')})"
            crosses = c.get("ci_crosses_zero", c["ci_low"] <= 0.0 <= c["ci_high"])
            lines.append(f"| {c['model']} | {c['baseline']} | {c['metric']} | {_fmt(c['diff'], '+.4f')} | "
                         f"{interval} | {c['n_pairs']} | {p_cell} | {_fmt(bool(crosses))} |")
    return "\n".join(lines) + "\n"


def write_results(
    out_dir: str | os.PathLike,
    models_metrics: Mapping[str, Mapping],
    comparisons: Sequence[Mapping],
    *,
    warnings: Sequence[str] = (),
    max_new_tokens: Optional[int] = None,
    truncation_threshold: float = 0.10,
    extra: Optional[Mapping] = None,
) -> tuple[Path, Path]:
    """Writes ``out_dir/results.json`` (interfaces.md schema + ``warnings`` + ``extra``) and ``results.md``.

    Args:
      models_metrics: ``{name: model_metrics(...)}``; each needs the interfaces.md keys (extra keys kept).
      comparisons: rows of :func:`compare` (extra keys kept).
      warnings: messages to add; a :func:`truncation_warning` per model above ``truncation_threshold``
        (prefixed with the model name) is added automatically, naming ``max_new_tokens`` when given.
      extra: more top-level keys for results.json (e.g. the evaluation config); may not replace
        "models", "comparisons" or "warnings".
    Returns:
      (path of results.json, path of results.md). Both are written atomically (temp file + os.replace).
    """
    for name, m in models_metrics.items():
        for key in _MODEL_KEYS:
            if key not in m:
                raise KeyError(f"models_metrics[{name!r}] lacks {key!r}")
    for i, c in enumerate(comparisons):
        for key in _COMPARISON_KEYS:
            if key not in c:
                raise KeyError(f"comparisons[{i}] lacks {key!r}")
    all_warnings = list(warnings)
    for name, m in models_metrics.items():
        w = truncation_warning(m["truncation_rate"], truncation_threshold, max_new_tokens)
        if w:
            all_warnings.append(f"{name}: {w}")
    results = {"models": {n: dict(m) for n, m in models_metrics.items()},
               "comparisons": [dict(c) for c in comparisons],
               "warnings": all_warnings}
    for key, value in (extra or {}).items():
        if key in results:
            raise ValueError(f"write_results: extra key {key!r} would replace a results.json key")
        results[key] = value
    out_dir = Path(out_dir)
    json_path = atomic_write_json(out_dir / "results.json", results)
    md_path = atomic_write_text(out_dir / "results.md", format_results_md(results))
    return json_path, md_path
