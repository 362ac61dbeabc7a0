"""Everything results.json says about a set of models, from their per-sample records: the one statistics path of
the evaluator (``runner.Evaluator.write``) and of anyone holding records.

    out = analyze({"base": base_records, "step_28": step_records}, "base", problems="heldout.jsonl")
    write_results(folder, out.pop("models"), out.pop("comparisons"), warnings=out.pop("warnings"), extra=out)

Sections (keys of the returned dict; the results.json schema is in jaxrl/data/formats.py):

* ``models`` -- ``model_metrics`` per model, with ``intervals`` (each mean with its interval and n);
* ``comparisons`` -- every model against the baseline on each compared metric (:func:`stats.compare`: interval
  and test that agree), with the family's simultaneous intervals, ``power`` (minimum detectable effect on these
  prompts) and ``claim`` (exploratory / confirmatory, :mod:`.protocol`);
* ``family`` -- what the simultaneous intervals cover (size, models, metrics, critical value);
* ``selection`` -- per task metric, the naive best model and its cross-fitted gain (:mod:`.selection`);
* ``censoring`` -- bounds, finish / quality split, paired finished-only and extended-cap comparisons
  (:mod:`.censoring`), when any sample hit the cap;
* ``protocol`` -- the evaluation's role and split; ``warnings`` -- what a reader must know (identical copies at
  temperature 0, selection on a held-out split).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from jaxrl.evaluation import planning
from jaxrl.evaluation.censoring import censoring_section
from jaxrl.evaluation.metrics import (identical_copies, model_metrics, per_prompt_pass_at_k, per_prompt_values)
from jaxrl.evaluation.protocol import label_claims, protocol_summary
from jaxrl.evaluation.selection import selection_summary
from jaxrl.evaluation.stats import add_simultaneous, compare, mean_interval

__all__ = ["COMPARED", "SELECTION_METRICS", "analyze", "sampling_warning"]

COMPARED = ("partial_reward_mean", "strict_rate", "truncation_rate", "mean_completion_tokens")
SELECTION_METRICS = ("partial_reward_mean", "strict_rate")  # the task metrics checkpoints are chosen on
_INTERVAL_METRICS = ("partial_reward_mean", "strict_rate", "truncation_rate")


def sampling_warning(temperature: float, num_samples: int) -> Optional[str]:
    """Greedy decoding draws the same completion every time: n samples a prompt are one sample counted n times."""
    if temperature == 0 and num_samples > 1:
        return (f"temperature 0 with num_samples={num_samples}: greedy decoding repeats the same completion, so the "
                f"{num_samples} samples a prompt are one sample counted {num_samples} times (n_samples and pass@k "
                "overstate the evidence); use --num_samples=1, or sample at temperature > 0")
    return None


def _intervals(per_prompt: Mapping, passk: Mapping, confidence: float) -> dict:
    out = {"confidence": confidence}
    for metric in _INTERVAL_METRICS:
        r = mean_interval(list(per_prompt[metric].values()), confidence)
        out[metric] = [r["ci_low"], r["ci_high"]]
    out["pass_at_k"] = {}
    for k, vals in passk.items():
        r = mean_interval(list(vals.values()), confidence)
        out["pass_at_k"][k] = [r["ci_low"], r["ci_high"]]
    return out


def analyze(records: Mapping[str, Sequence[Mapping]], baseline: str, *, metrics: Sequence[str] = COMPARED,
            n_resamples: int = 10000, confidence: float = 0.95, seed: int = 0,
            resampled: Optional[Mapping[int, Mapping[str, Sequence[Mapping]]]] = None,
            protocol: Optional[Mapping] = None, problems: Optional[str] = None,
            power: float = planning.DEFAULT_POWER, references: Sequence[str] = ()) -> dict:
    """The results.json sections (module docstring) for ``{model: SAMPLES records}``.

    Args:
      baseline: the model every other one is compared with.
      metrics: per-prompt metrics compared; ``pass_at_<k>`` for the largest k > 1 the samples allow is added.
      resampled: ``censoring.load_resampled(eval_dir)``: records re-drawn at larger caps.
      protocol: the evaluation folder's ``protocol.json`` (None: exploratory); problems: the problems file (its
        frozen split, if any, is recorded).
      references: models shown for reference (a distillation's teacher): their metrics and their comparison with
        the baseline (marginal interval, ``"reference": true``), but they are not candidates: outside the
        simultaneous family, the selection and the protocol's candidate count.
    """
    references = [n for n in references if n in records]
    if baseline in references:
        raise ValueError(f"the baseline {baseline!r} cannot be a reference row")
    if baseline not in records:
        raise KeyError(f"baseline {baseline!r} is not among the models {list(records)}")
    models = {name: model_metrics(recs) for name, recs in records.items()}
    per_prompt = {name: per_prompt_values(recs) for name, recs in records.items()}
    passk = {name: per_prompt_pass_at_k(recs) for name, recs in records.items()}
    metrics = list(metrics)
    ks = sorted(set.intersection(*(set(p) for p in passk.values())), key=int)
    if ks and int(ks[-1]) > 1:
        key = f"pass_at_{ks[-1]}"
        for name in per_prompt:
            per_prompt[name][key] = passk[name][ks[-1]]
        metrics.append(key)
    for name in models:
        models[name]["intervals"] = _intervals(per_prompt[name], passk[name], confidence)
        if name in references:
            models[name]["reference"] = True
    rows = compare(per_prompt, baseline, metrics, n_resamples=n_resamples, confidence=confidence, seed=seed,
                   family=False)
    for row in rows:
        if row["model"] in references:
            row["reference"] = True
    family = {"size": 0}
    members = [r for r in rows if r["model"] not in references]
    if members:
        ids = list(per_prompt[baseline][metrics[0]])
        diffs = [np.array([per_prompt[r["model"]][r["metric"]][i] - per_prompt[baseline][r["metric"]][i]
                           for i in ids]) for r in members]
        summary = add_simultaneous(members, diffs, confidence=confidence, n_resamples=n_resamples, seed=seed)
        family = {"size": summary["family_size"],
                  "models": [n for n in records if n != baseline and n not in references],
                  "metrics": metrics, "baseline": baseline, "confidence": confidence, "n_resamples": n_resamples,
                  "critical_value": summary["critical_value"],
                  "method": "max-T bootstrap over prompts (resampled jointly for every comparison), standardised "
                            "by each comparison's bootstrap standard error; never narrower than the marginal "
                            "interval"}
    for row in rows:
        row["power"] = planning.row_power(row, power)
    proto, warnings = protocol_summary(protocol, problems, len(records) - 1 - len(references))
    label_claims(rows, proto)
    selection = {}
    for metric in SELECTION_METRICS:
        if metric in metrics:
            candidates = {n: v for n, v in per_prompt.items() if n not in references}
            s = selection_summary(candidates, baseline, metric, rows=members, confidence=confidence,
                                  n_resamples=n_resamples, seed=seed)
            if s is not None:
                selection[metric] = s
    for name, recs in records.items():
        same, multi = identical_copies(recs)
        if multi and same == multi:
            warnings.append(f"{name}: every prompt's samples are identical copies ({multi} prompts): one sample "
                            "counted several times (greedy decoding?); n_samples and pass@k overstate the evidence")
    censoring = censoring_section(records, baseline, resampled=resampled, confidence=confidence,
                                  n_resamples=n_resamples, seed=seed)
    return {"models": models, "comparisons": rows, "family": family, "selection": selection or None,
            "censoring": censoring, "protocol": proto, "warnings": warnings}
