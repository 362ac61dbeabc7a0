"""Pair audit: what a DPO pairs file teaches, beyond its reward margins.

Static part (no code runs): the admissibility filters of ``jaxrl.data.pairs.filter_pairs`` (truncation, length
difference, margin; what they would drop) and its length / margin / reward distributions, plus:

* length bias: ``chosen_tokens - rejected_tokens`` per pair (mean with a paired-bootstrap interval, histogram),
  the fraction of pairs where chosen is shorter / longer, and the exact sign test of shorter vs longer
  (``stats.mcnemar_exact`` on the two indicators: ties drop out);
* the correlation of the reward margin with the length difference (Pearson and Spearman, with p-values);
* how many chosen completions are not full solutions (``chosen_reward < 1``).

Semantic part: re-score a seeded sample of chosen completions against the problems file with the reward the
pairs were scored with (``reward``, else the one ``pairs_lib.recorded_reward`` finds: build_pairs records it in
the audit.json beside pairs.jsonl) and list those whose re-run disagrees with the record: partial below the
recorded ``chosen_reward``, or a recorded full score (1.0) that is no longer strict. A chosen completion that was
recorded as a partial solution is no failure of the pair (``chosen_not_full`` counts those). When the reward is
unknown the part says so (``semantic.skipped``) instead of judging with a reward the pairs were not scored with.

Output (``pairs.json``)::

    {"n_pairs", "source", "filters": filter_pairs audit (fail_counts, distributions, ...), "cap_known": bool,
     "length_bias": {"n_pairs", "mean_diff", "ci_low", "ci_high", "median_diff", "fraction_chosen_shorter",
                     "fraction_chosen_longer", "fraction_equal", "sign_test": {"p_value", "b01", "b10", ...},
                     "histogram": {"edges", "counts"}, "margin_vs_length_diff": {"pearson", "pearson_p",
                     "spearman", "spearman_p"}},
     "truncation": {"chosen_length_finish", "rejected_length_finish"},
     "chosen_not_full": {"n", "fraction"},
     "points": {"length_diff": [...], "margin": [...]},          # for plots (at most 2000 pairs)
     "semantic": {"reward", "n_checked", "n_failed", "n_not_strict", "n_below_recorded", "missing_problems",
                  "seed", "failures": [{"pair_id", "problem_id", "recorded_reward", "partial", "strict", "tests",
                                        "reason", "detail", "chosen"}]}  # only with problems
                 | {"reward": None, "skipped": "why"}                       # the reward is unknown
     "flags": [...]}
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional, Sequence

import numpy as np
import scipy.stats

from jaxrl.data import pairs as pairs_lib
from jaxrl.data.problems import Problem, load_problems
from jaxrl.diagnostics import red_flags
from jaxrl.diagnostics.flags import DiagnoseSettings
from jaxrl.diagnostics.generation_diff import trim_text
from jaxrl.evaluation.stats import mcnemar_exact, paired_bootstrap
from jaxrl.rewards import get_reward
from jaxrl.rewards.base import close_reward

__all__ = ["audit_pairs", "length_bias", "semantic_audit"]

_HUGE_CAP = 2**31 - 1


def length_bias(pairs: Sequence[Mapping], bins: int = 20, seed: int = 0) -> dict:
    """Chosen-vs-rejected length statistics (module docstring). Lengths are completion tokens."""
    c = np.array([p["chosen_tokens"] for p in pairs], dtype=np.float64)
    r = np.array([p["rejected_tokens"] for p in pairs], dtype=np.float64)
    margin = np.array([p["chosen_reward"] - p["rejected_reward"] for p in pairs], dtype=np.float64)
    d = c - r
    if d.size == 0:
        return {"n_pairs": 0}
    boot = paired_bootstrap(c, r, seed=seed)
    # Sign test: indicators (chosen shorter, chosen longer); McNemar's discordant pairs are exactly the untied ones.
    sign = mcnemar_exact((d < 0).astype(float), (d > 0).astype(float))
    counts, edges = np.histogram(d, bins=bins)
    corr = {"pearson": None, "pearson_p": None, "spearman": None, "spearman_p": None}
    if d.size >= 3 and np.ptp(d) > 0 and np.ptp(margin) > 0:
        pr = scipy.stats.pearsonr(d, margin)
        sr = scipy.stats.spearmanr(d, margin)
        corr = {"pearson": float(pr.statistic), "pearson_p": float(pr.pvalue),
                "spearman": float(sr.statistic), "spearman_p": float(sr.pvalue)}
    return {"n_pairs": int(d.size), "mean_diff": boot["diff"], "ci_low": boot["ci_low"], "ci_high": boot["ci_high"],
            "median_diff": float(np.median(d)), "fraction_chosen_shorter": float(np.mean(d < 0)),
            "fraction_chosen_longer": float(np.mean(d > 0)), "fraction_equal": float(np.mean(d == 0)),
            "sign_test": {**sign, "test": "exact sign test of chosen shorter vs chosen longer (ties dropped)"},
            "histogram": {"edges": [float(e) for e in edges], "counts": [int(x) for x in counts]},
            "margin_vs_length_diff": corr}


def _problem_index(problems) -> dict[str, Problem]:
    if isinstance(problems, (str, os.PathLike)):
        problems = load_problems(problems)
    if isinstance(problems, Mapping):
        return dict(problems)
    return {p.id: p for p in problems}


def _reward_of(name: str, timeout_s: float, workers: int):
    """The reward `name` built to re-score (the code verifier with the audit's timeout and sandboxes)."""
    return get_reward(name, timeout_s=timeout_s, workers=workers) if name == "code" else get_reward(name)


def semantic_audit(pairs: Sequence[Mapping], problems, *, verifier=None, reward: Optional[str] = None,
                   sample_size: int = DiagnoseSettings.sample_size, seed: int = DiagnoseSettings.seed,
                   timeout_s: float = DiagnoseSettings.timeout_s, workers: int = DiagnoseSettings.workers,
                   tol: float = 1e-9, max_chars: int = 1500) -> dict:
    """Re-scores a seeded sample of chosen completions; returns the ``semantic`` section.

    Args:
      problems: problems.jsonl path, list of ``Problem`` or ``{id: Problem}``.
      verifier: anything with ``score(completions, problems, truncated)`` (kept open); else the reward named
        ``reward`` (the code verifier with ``timeout_s`` and ``workers``), built here and closed afterwards.
      sample_size: pairs to re-check (all if fewer), drawn with ``numpy.random.default_rng(seed)``.
    """
    index = _problem_index(problems)
    n = len(pairs)
    k = min(sample_size, n)
    picks = sorted(np.random.default_rng(seed).choice(n, size=k, replace=False).tolist()) if k else []
    missing = sorted({str(pairs[i]["problem_id"]) for i in picks} - set(index))
    checked = [i for i in picks if str(pairs[i]["problem_id"]) in index]
    own = verifier is None
    if own:
        if reward is None:
            raise ValueError("semantic_audit: give the reward the pairs were scored with (reward=) or a verifier")
        verifier = _reward_of(reward, timeout_s, workers)
    try:
        results = verifier.score([pairs[i]["chosen"] for i in checked],
                                 [index[str(pairs[i]["problem_id"])] for i in checked],
                                 truncated=[pairs[i].get("chosen_finish_reason") == "length" for i in checked]) \
            if checked else []
    finally:
        if own:
            close_reward(verifier)
    failures, not_strict, below = [], 0, 0
    for i, res in zip(checked, results):
        p = pairs[i]
        recorded = float(p["chosen_reward"])
        is_below = res.partial < recorded - tol
        not_strict += not res.strict
        below += is_below
        # a disagreement with the record: a lower score, or a recorded full score that no longer passes all
        if is_below or (recorded >= 1.0 - tol and not res.strict):
            failures.append({"pair_id": p.get("pair_id"), "problem_id": str(p["problem_id"]),
                             "recorded_reward": float(p["chosen_reward"]), "partial": res.partial,
                             "strict": res.strict, "tests": list(res.tests), "reason": res.reason,
                             "detail": getattr(res, "detail", None), "chosen": trim_text(p["chosen"], max_chars)})
    return {"reward": reward or getattr(verifier, "name", type(verifier).__name__), "n_checked": len(checked),
            "n_failed": len(failures), "n_not_strict": not_strict,
            "n_below_recorded": below, "missing_problems": missing, "seed": seed, "sample_size": sample_size,
            "failures": failures}


def audit_pairs(pairs: Sequence[Mapping] | str | os.PathLike, *, config: Optional[pairs_lib.PairConfig] = None,
                problems=None, verifier=None, reward: Optional[str] = None,
                sample_size: int = DiagnoseSettings.sample_size, seed: int = DiagnoseSettings.seed,
                timeout_s: float = DiagnoseSettings.timeout_s, workers: int = DiagnoseSettings.workers,
                max_points: int = 2000) -> dict:
    """The full audit (module docstring). ``pairs``: records or a pairs.jsonl path.

    ``config``: the filters to evaluate (default ``PairConfig()``). A pair without ``max_new_tokens`` whose cap
    the config does not give either is judged for truncation by its finish reasons only (``cap_known`` False).
    The semantic part runs only when ``problems`` is given, with ``verifier``, else the reward named ``reward``,
    else the one recorded for a pairs.jsonl (``pairs_lib.recorded_reward``); without any it is skipped, saying so.
    """
    source = None
    if isinstance(pairs, (str, os.PathLike)):
        source = os.fspath(pairs)
        pairs = pairs_lib.read_pairs(pairs)
    pairs = list(pairs)
    cfg = config or pairs_lib.PairConfig()
    cap_known = cfg.max_new_tokens is not None or all(p.get("max_new_tokens") is not None for p in pairs)
    if not cap_known:
        # filter_pairs needs a cap; a huge one leaves truncation to the finish reasons.
        cfg = dataclasses.replace(cfg, max_new_tokens=_HUGE_CAP)
    _, filters = pairs_lib.filter_pairs(pairs, cfg)
    lb = length_bias(pairs, seed=seed)
    rng = np.random.default_rng(seed)
    show = np.sort(rng.choice(len(pairs), size=min(max_points, len(pairs)), replace=False)) if pairs else []
    out = {
        "n_pairs": len(pairs), "source": source, "cap_known": cap_known, "filters": filters, "length_bias": lb,
        "truncation": {
            "chosen_length_finish": sum(p.get("chosen_finish_reason") == "length" for p in pairs),
            "rejected_length_finish": sum(p.get("rejected_finish_reason") == "length" for p in pairs)},
        "chosen_not_full": {"n": sum(float(p["chosen_reward"]) < 1.0 for p in pairs),
                            "fraction": float(np.mean([float(p["chosen_reward"]) < 1.0 for p in pairs]))
                            if pairs else None},
        "points": {"length_diff": [int(pairs[i]["chosen_tokens"] - pairs[i]["rejected_tokens"]) for i in show],
                   "margin": [float(pairs[i]["chosen_reward"] - pairs[i]["rejected_reward"]) for i in show]},
    }
    if problems is not None:
        if verifier is None and reward is None and source is not None:
            reward = pairs_lib.recorded_reward(source)
        if verifier is None and reward is None:
            out["semantic"] = {"reward": None, "skipped": (
                "cannot judge: the reward these pairs were scored with is unknown (no audit.json beside the pairs "
                "naming it, nor rollouts with a .meta.json); pass --reward to re-score them")}
        else:
            out["semantic"] = semantic_audit(pairs, problems, verifier=verifier, reward=reward,
                                             sample_size=sample_size, seed=seed, timeout_s=timeout_s,
                                             workers=workers)
    flags = [red_flags.length_bias_in_pairs(out), red_flags.semantic_failures_in_pairs(out)]
    out["flags"] = [f.to_dict() for f in red_flags.sort_flags(flags)]
    return out
