"""Checkpoint curves: every evaluation metric per optimizer step, with its paired interval vs the base.

Input is an evaluation's ``results.json`` (``formats.RESULTS``) holding ``base`` and checkpoints ``step_<N>``, and
possibly averaged candidates (models with an ``"average"`` record: exact or truncated averages of checkpoints,
``launchers.export --average``, and EMA adapters ``ema_<N>``). Those are traced beside the steps they average (in
``averages``, at the last of their steps), with the same interval fields; they are members of the results file's
family (its simultaneous intervals count them), and of the Bonferroni fallback's m.
The interval of a checkpoint is its results.json comparison row against the baseline; where that row is absent
and the per-sample files are given, it is computed with ``jaxrl.evaluation.stats.compare`` (the same paired
bootstrap the evaluator uses).

Selecting the best of m checkpoints and quoting its 95% interval overstates the evidence. Every point carries
the results file's simultaneous interval (max-T over every comparison of the file, ``simultaneous_ci_low`` /
``simultaneous_ci_high``); the best checkpoint's adjusted interval (``ci_low_adjusted`` / ``ci_high_adjusted``) is
that one, or, for results without it and with samples, a Bonferroni interval over every checkpoint x flagged
metric (confidence ``1 - (1 - c) / (m * len(flag_metrics))``). ``flags.early_gain_not_significant`` uses it,
whether or not the best checkpoint is the last one. With samples, the non-monotonic flag also compares the last
checkpoint with the best one, paired (``best_vs_last``), and says whether the fall is more than noise.

Output (``curves.json``)::

    {"baseline": "base", "confidence": 0.95, "n_checkpoints": m, "n_averages": a,
     "metrics": {METRIC: {"higher_is_better": bool,
                          "points": [{"step", "model", "value", "n_prompts", "n_samples",
                                      "diff", "ci_low", "ci_high", "n_pairs", "confidence", "ci_crosses_zero",
                                      "p_value", "simultaneous_ci_low", "simultaneous_ci_high", "family_size",
                                      optional "ci_low_adjusted", "ci_high_adjusted", "adjusted_confidence",
                                      "adjustment", "n_checkpoints"}, ...],
                          "averages": [{the same keys as a point, "kind": "mean" | "ema", "steps": [...]}, ...],
                          "best_vs_last": {"diff", "ci_low", "ci_high", "n_pairs", ...} | None}},
                                    # points sorted by step; the base is step 0, diff 0; an average's "step" is
                                    # the last step it averages
     "flags": [Flag.to_dict(), ...]}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

from jaxrl.data.formats import (BASE_MODEL, available_samples, averaged_steps, model_step, read_results,
                                read_samples)
from jaxrl.diagnostics import red_flags
from jaxrl.diagnostics.flags import DiagnoseSettings
from jaxrl.evaluation.metrics import per_prompt_values
from jaxrl.evaluation.stats import compare

__all__ = ["CURVE_METRICS", "FLAG_METRICS", "checkpoint_curves", "curves_from_eval_dir", "load_eval_samples"]

CURVE_METRICS = ("partial_reward_mean", "strict_rate", "truncation_rate", "mean_completion_tokens")
FLAG_METRICS = ("partial_reward_mean", "strict_rate")  # the task metrics; the others are descriptive
_LOWER_IS_BETTER = ("truncation_rate",)


def load_eval_samples(eval_dir: str | os.PathLike, names: Optional[Sequence[str]] = None) -> dict[str, list]:
    """``{model: SAMPLES records}`` for the sample files under ``eval_dir/samples`` (only ``names`` if given)."""
    files = available_samples(eval_dir)
    return {n: read_samples(p) for n, p in files.items() if names is None or n in names}


def _comparison_index(results: Mapping) -> dict[tuple[str, str, str], Mapping]:
    return {(c["model"], c["baseline"], c["metric"]): c for c in results.get("comparisons", [])}


def checkpoint_curves(
    results: Mapping | str | os.PathLike,
    *,
    metrics: Sequence[str] = CURVE_METRICS,
    baseline: str = BASE_MODEL,
    samples: Optional[Mapping[str, Sequence[Mapping]]] = None,
    confidence: float = 0.95,
    n_resamples: int = 10000,
    seed: int = DiagnoseSettings.seed,
    tol: float = DiagnoseSettings.tol,
    flag_metrics: Sequence[str] = FLAG_METRICS,
) -> dict:
    """Curves over checkpoints with intervals and flags (see the module docstring for the output).

    Args:
      results: a results.json dict, or its path / folder.
      metrics: metrics to trace (keys of each model entry).
      baseline: the step-0 model every checkpoint is compared with.
      samples: ``{model: SAMPLES records}`` used for missing comparisons and the selection-adjusted interval
        (e.g. :func:`load_eval_samples`); optional.
      confidence, n_resamples, seed: of any interval computed here (results.json intervals are used as they are).
      tol: moves of at most ``tol`` count as flat for the non-monotonic flag.
      flag_metrics: metrics whose shape is flagged (non-monotonic, early gain not significant).
    """
    if not isinstance(results, Mapping):
        results = read_results(results)
    models = results["models"]
    if baseline not in models:
        raise KeyError(f"baseline {baseline!r} is not among the evaluated models {sorted(models)}")
    ckpts = sorted(((model_step(n, e), n) for n, e in models.items() if n != baseline
                    and model_step(n, e) is not None), key=lambda t: t[0])
    averages = sorted(((averaged_steps(e), n) for n, e in models.items() if n != baseline
                       and model_step(n, e) is None and averaged_steps(e)), key=lambda t: (t[0][-1], t[1]))
    index = _comparison_index(results)
    samples = dict(samples or {})
    per_prompt = {}

    def pp(name):
        if name not in per_prompt:
            per_prompt[name] = per_prompt_values(samples[name])
        return per_prompt[name]

    def computed(name, metric, conf, against=baseline):
        rows = compare({name: pp(name), against: pp(against)}, baseline=against, metrics=[metric],
                       n_resamples=n_resamples, confidence=conf, seed=seed, family=False)
        return rows[0]

    out_metrics = {}
    flags: list[Optional[red_flags.Flag]] = []
    m = len(ckpts)
    for metric in metrics:
        if any(models[n].get(metric) is None for _, n in ckpts) or models[baseline].get(metric) is None:
            continue
        base_entry = models[baseline]
        points = [{"step": model_step(baseline, base_entry) or 0, "model": baseline,
                   "value": base_entry[metric], "n_prompts": base_entry["n_prompts"],
                   "n_samples": base_entry["n_samples"], "diff": 0.0, "ci_low": 0.0, "ci_high": 0.0,
                   "n_pairs": base_entry["n_prompts"], "confidence": None, "ci_crosses_zero": True}]
        def point(step, name):
            e = models[name]
            row = index.get((name, baseline, metric))
            if row is None and name in samples and baseline in samples:
                row = computed(name, metric, confidence)
            pt = {"step": step, "model": name, "value": e[metric], "n_prompts": e["n_prompts"],
                  "n_samples": e["n_samples"], "diff": None, "ci_low": None, "ci_high": None, "n_pairs": None,
                  "confidence": None, "ci_crosses_zero": None, "p_value": None, "simultaneous_ci_low": None,
                  "simultaneous_ci_high": None, "family_size": None}
            if row is not None:
                pt.update(diff=row["diff"], ci_low=row["ci_low"], ci_high=row["ci_high"], n_pairs=row["n_pairs"],
                          confidence=row.get("confidence", confidence),
                          ci_crosses_zero=bool(row["ci_low"] <= 0.0 <= row["ci_high"]),
                          **{k: row.get(k) for k in ("p_value", "simultaneous_ci_low", "simultaneous_ci_high",
                                                     "family_size")})
            return pt

        points.extend(point(step, name) for step, name in ckpts)
        averaged = [{**point(steps[-1], name), "kind": models[name]["average"].get("kind"), "steps": steps}
                    for steps, name in averages if models[name].get(metric) is not None]
        higher = metric not in _LOWER_IS_BETTER
        with_ci = [p for p in points[1:] if p["diff"] is not None]
        if metric in flag_metrics and with_ci and m > 1:
            best = max(with_ci, key=lambda p: p["diff"])
            best["n_checkpoints"] = m
            if best.get("simultaneous_ci_low") is not None:
                best.update(ci_low_adjusted=best["simultaneous_ci_low"],
                            ci_high_adjusted=best["simultaneous_ci_high"], adjusted_confidence=best["confidence"],
                            adjustment=f"after the {best['family_size']} comparisons of the evaluation (max-T)")
            elif best["diff"] > 0 and best["model"] in samples and baseline in samples:
                # every candidate (checkpoints and averages) x every metric one may be chosen on
                family = (m + len(averages)) * len(flag_metrics)
                adj = 1.0 - (1.0 - confidence) / family
                row = computed(best["model"], metric, adj)
                best.update(ci_low_adjusted=row["ci_low"], ci_high_adjusted=row["ci_high"],
                            adjusted_confidence=adj, adjustment=f"Bonferroni over {family} comparisons")
        best_vs_last = None
        by_value = [p for p in points if p["value"] is not None]
        if metric in flag_metrics and len(by_value) >= 3:
            top = max(by_value, key=lambda p: (p["value"] if higher else -p["value"], -p["step"]))
            last = by_value[-1]
            if top is not last and top["model"] in samples and last["model"] in samples:
                row = computed(last["model"], metric, confidence, against=top["model"])
                best_vs_last = {k: row[k] for k in ("diff", "ci_low", "ci_high", "n_pairs", "p_value", "test",
                                                    "confidence")}
                best_vs_last.update(best=top["model"], last=last["model"])
        out_metrics[metric] = {"higher_is_better": higher, "points": points, "averages": averaged,
                               "best_vs_last": best_vs_last}
        if metric in flag_metrics:
            flags.append(red_flags.non_monotonic_checkpoints(metric, [p["step"] for p in points],
                                                     [p["value"] for p in points], tol=tol,
                                                     n_prompts=base_entry["n_prompts"], higher_is_better=higher,
                                                     best_vs_last=best_vs_last))
            flags.extend(red_flags.early_gain_not_significant(metric, with_ci))
    return {"baseline": baseline, "confidence": confidence, "n_checkpoints": m, "n_averages": len(averages),
            "metrics": out_metrics,
            "flags": [f.to_dict() for f in red_flags.sort_flags(flags)]}


def curves_from_eval_dir(eval_dir: str | os.PathLike, **kwargs) -> dict:
    """:func:`checkpoint_curves` of ``eval_dir/results.json`` with the sample files it has; ``eval_dir`` (absolute)
    is recorded, so a report finds the evaluation its curves were drawn from."""
    eval_dir = Path(eval_dir)
    out = checkpoint_curves(read_results(eval_dir), samples=load_eval_samples(eval_dir), **kwargs)
    out["eval_dir"] = os.path.abspath(eval_dir)
    return out
