"""Plain-language flags: small checks that turn numbers into sentences a user can act on.

Each check returns a :class:`Flag` (or None when there is nothing to say). A flag's ``message`` carries the
numbers it rests on, with their sample size and interval, so it can be read on its own; ``evidence`` holds the
same numbers for machines. Severity: ``"error"`` (the results are not valid as they stand), ``"warning"`` (a
result should not be trusted / acted on yet), ``"info"`` (worth knowing).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import scipy.stats

from jaxrl.evaluation.stats import truncation_warning

__all__ = [
    "Flag", "SEVERITIES", "is_rate", "fmt_value", "fmt_diff", "fmt_interval", "interval_crosses_zero",
    "truncation_censoring", "kl_rising_reward_falling", "non_monotonic_checkpoints",
    "early_gain_not_significant", "length_bias_in_pairs", "semantic_failures_in_pairs", "nonfinite_updates",
    "termination_only_change", "sort_flags", "not_significant_after_selection", "underpowered",
    "selection_adjusted_gain", "gain_from_finishing", "confirmation_result",
]

SEVERITIES = ("error", "warning", "info")


@dataclasses.dataclass(frozen=True)
class Flag:
    severity: str  # "error" | "warning" | "info"
    code: str  # stable identifier, e.g. "interval_crosses_zero"
    message: str  # one or two plain sentences with the numbers, sample sizes and intervals
    evidence: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"Flag severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict:
        return {"severity": self.severity, "code": self.code, "message": self.message,
                "evidence": dict(self.evidence)}


def sort_flags(flags: Sequence[Optional[Flag]]) -> list[Flag]:
    """Drops None, orders errors first, then warnings, then info (stable within a severity)."""
    return sorted((f for f in flags if f is not None), key=lambda f: SEVERITIES.index(f.severity))


# ----------------------------------------------------------------------------------------------- units


def is_rate(metric: str) -> bool:
    """Metrics that are fractions in [0, 1] (shown as % and their differences as percentage points)."""
    return metric != "mean_completion_tokens" and not metric.endswith("_tokens")


def fmt_value(metric: str, v: Optional[float]) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{100 * v:.2f}%" if is_rate(metric) else f"{v:.1f} tokens"


def fmt_diff(metric: str, d: Optional[float]) -> str:
    if d is None:
        return "n/a"
    return f"{100 * d:+.2f} pp" if is_rate(metric) else f"{d:+.1f} tokens"


def fmt_interval(metric: str, lo: float, hi: float, confidence: Optional[float] = 0.95) -> str:
    conf = f"{confidence:.0%} " if confidence else ""
    if is_rate(metric):
        return f"{conf}interval [{100 * lo:+.2f}, {100 * hi:+.2f}] pp"
    return f"{conf}interval [{lo:+.1f}, {hi:+.1f}] tokens"


def _crosses(lo: float, hi: float) -> bool:
    return lo <= 0.0 <= hi


# ------------------------------------------------------------------------------------------- evaluation


def interval_crosses_zero(comparison: Mapping) -> Optional[Flag]:
    """A model-vs-baseline difference whose interval contains 0: no evidence of any difference.

    ``comparison`` is a results.json comparisons row (``model, baseline, metric, diff, ci_low, ci_high,
    n_pairs``, optional ``confidence``).
    """
    lo, hi = float(comparison["ci_low"]), float(comparison["ci_high"])
    if not _crosses(lo, hi):
        return None
    m, metric = comparison["model"], comparison["metric"]
    p = comparison.get("p_value")
    test = f" (p = {p:.3g}, {comparison.get('test', comparison.get('p_value_test', 'test'))})" if p is not None else ""
    return Flag("warning", "interval_crosses_zero",
                f"{m} vs {comparison['baseline']}, {metric}: {fmt_diff(metric, comparison['diff'])}, "
                f"{fmt_interval(metric, lo, hi, comparison.get('confidence', 0.95))} over "
                f"{comparison['n_pairs']} prompts{test}: interval crosses zero, so this is no evidence of a "
                "difference.",
                {k: comparison.get(k) for k in ("model", "baseline", "metric", "diff", "ci_low", "ci_high",
                                                "n_pairs", "p_value")})


def not_significant_after_selection(comparison: Mapping) -> Optional[Flag]:
    """A difference whose own interval excludes 0 but whose simultaneous interval (over every comparison of the
    results file) does not: it would not survive having been picked among the others."""
    if comparison.get("simultaneous_ci_low") is None:
        return None
    lo, hi = float(comparison["ci_low"]), float(comparison["ci_high"])
    slo, shi = float(comparison["simultaneous_ci_low"]), float(comparison["simultaneous_ci_high"])
    if _crosses(lo, hi) or not _crosses(slo, shi):
        return None
    m, metric, fam = comparison["model"], comparison["metric"], comparison.get("family_size")
    conf = comparison.get("confidence", 0.95)
    return Flag("warning", "not_significant_after_selection",
                f"{m} vs {comparison['baseline']}, {metric}: {fmt_diff(metric, comparison['diff'])}, "
                f"{fmt_interval(metric, lo, hi, conf)} over {comparison['n_pairs']} prompts excludes zero alone, but "
                f"not among the {fam} comparisons of this evaluation (simultaneous "
                f"{fmt_interval(metric, slo, shi, conf)}, adjusted p = "
                f"{comparison.get('simultaneous_p_value', float('nan')):.3g}). Picked as the best of several, it is "
                "no evidence of a difference: confirm it on fresh prompts.",
                {k: comparison.get(k) for k in ("model", "baseline", "metric", "diff", "ci_low", "ci_high",
                                                "simultaneous_ci_low", "simultaneous_ci_high", "family_size",
                                                "n_pairs", "simultaneous_p_value")})


def underpowered(comparison: Mapping, min_power: float = 0.8) -> Optional[Flag]:
    """An evaluation too small for the effect it reports: the observed difference is below the smallest effect
    these prompts detect with ``min_power`` probability (``comparison["power"]``, jaxrl.evaluation.planning)."""
    pw = comparison.get("power")
    if not pw or comparison.get("diff") in (None, 0) or pw.get("n_for_diff") is None:
        return None
    diff, mde, n = float(comparison["diff"]), float(pw["mde"]), int(comparison["n_pairs"])
    if abs(diff) >= mde:
        return None
    m, metric = comparison["model"], comparison["metric"]
    fam = pw.get("family_size") or 1
    fam_txt = (f" ({pw['n_for_diff_family']} with the correction for the {fam} comparisons)" if fam > 1 else "")
    return Flag("info", "underpowered",
                f"{m} vs {comparison['baseline']}, {metric}: {fmt_diff(metric, diff)} on {n} prompts is below the "
                f"smallest effect {n} prompts detect with {pw['power']:.0%} power ({fmt_diff(metric, mde).lstrip('+')}; SD of "
                f"the per-prompt differences {fmt_diff(metric, pw.get('sd', comparison.get('sd_diff'))).lstrip('+')}). A true "
                f"effect of this size needs about {pw['n_for_diff']} prompts{fam_txt} "
                "(python -m launchers.plan).",
                {"model": m, "metric": metric, "diff": diff, "n_pairs": n, "mde": mde,
                 "n_for_diff": pw["n_for_diff"], "n_for_diff_family": pw.get("n_for_diff_family")})


def selection_adjusted_gain(selection: Mapping) -> Optional[Flag]:
    """The best of several models: its naive gain beside the cross-fitted (selection-adjusted) one
    (``results["selection"][metric]``, jaxrl.evaluation.selection), when the naive gain looks significant. A
    warning when the naive gain is above the adjusted gain's interval (the choice inflated it), else info. Whether
    the best model itself beats the baseline after the selection is ``not_significant_after_selection``'s
    question (simultaneous intervals); this one is how large a gain "keep the best" really delivers."""
    nv, cf, metric = selection["naive"], selection["cross_fit"], selection["metric"]
    if nv.get("ci_low") is None:
        return None
    naive_sig = not _crosses(nv["ci_low"], nv["ci_high"]) and nv["diff"] > 0
    adj_sig = not _crosses(cf["ci_low"], cf["ci_high"]) and cf["diff"] > 0
    conf = cf.get("confidence", 0.95)
    msg = (f"{metric}: the best of {selection['n_candidates']} models, {nv['model']}, shows "
           f"{fmt_diff(metric, nv['diff'])} ({fmt_interval(metric, nv['ci_low'], nv['ci_high'], conf)}) over "
           f"{selection['n_pairs']} prompts; chosen on one half of the prompts and measured on the other "
           f"(cross-fit), the gain of keeping the best is {fmt_diff(metric, cf['diff'])} "
           f"({fmt_interval(metric, cf['ci_low'], cf['ci_high'], conf)}, n={cf['n_pairs']}); the halves chose "
           f"{cf['chosen_on_half'][0]} and {cf['chosen_on_half'][1]}.")
    if not naive_sig:
        return None
    ev = {"metric": metric, "naive": dict(nv), "cross_fit": dict(cf)}
    if nv["diff"] > cf["ci_high"]:
        return Flag("warning", "selection_adjusted_gain",
                    msg + " The naive gain lies above the selection-adjusted interval: the choice inflated it"
                    + ("." if adj_sig else ", and the adjusted gain is not significant."), ev)
    return Flag("info", "selection_adjusted_gain",
                msg + ("" if adj_sig else " The adjusted gain's interval contains 0: with this many prompts the "
                                          "choice itself is noisy."), ev)


def confirmation_result(row: Mapping, protocol: Mapping) -> Optional[Flag]:
    """The one confirmatory claim of a held-out confirmation (``row``: its comparison, ``claim ==
    "confirmatory"``): info when the selected model's gain replicates (interval above 0), a warning when not."""
    if row.get("claim") != "confirmatory":
        return None
    m, metric = row["model"], row["metric"]
    sel = protocol.get("selection") or {}
    naive = sel.get("naive") or {}
    chosen = (f" (chosen among {sel.get('n_candidates')} on split {(sel.get('split') or {}).get('split')!r} with "
              f"{fmt_diff(metric, naive.get('diff'))})" if naive.get("diff") is not None else "")
    text = (f"Confirmation on held-out split {((protocol.get('split') or {}).get('split'))!r}: {m}{chosen} vs "
            f"{row['baseline']}, {metric}: {fmt_diff(metric, row['diff'])}, "
            f"{fmt_interval(metric, row['ci_low'], row['ci_high'], row.get('confidence', 0.95))} over "
            f"{row['n_pairs']} prompts (p = {row['p_value']:.3g}).")
    ev = {k: row.get(k) for k in ("model", "metric", "diff", "ci_low", "ci_high", "n_pairs", "p_value")}
    if row["ci_low"] > 0:
        return Flag("info", "confirmation_result", text + " The selected checkpoint's gain replicates: a "
                    "confirmatory claim.", ev)
    return Flag("warning", "confirmation_result", text + " The gain did not replicate on fresh prompts: do not "
                "claim it.", ev)


def gain_from_finishing(model: str, metric: str, entry: Mapping) -> Optional[Flag]:
    """Most of a difference comes from finishing more often (the finish part of the censoring decomposition is
    significant, the quality part is not): the model stops earlier, it does not solve more."""
    dec = entry.get("decomposition") or {}
    fin, qual = dec.get("finish"), dec.get("quality")
    if not fin or not qual or fin.get("diff") in (None, 0):
        return None
    fin_sig = not _crosses(fin["ci_low"], fin["ci_high"])
    qual_sig = not _crosses(qual["ci_low"], qual["ci_high"])
    if not fin_sig or qual_sig:
        return None
    return Flag("warning", "gain_from_finishing",
                f"{model}, {metric}: the finish-rate part of the difference is {fmt_diff(metric, fin['diff'])} "
                f"({fmt_interval(metric, fin['ci_low'], fin['ci_high'], None)}, n={fin['n_pairs']}) while the "
                f"quality-when-finished part is {fmt_diff(metric, qual['diff'])} "
                f"({fmt_interval(metric, qual['ci_low'], qual['ci_high'], None)}): the model "
                f"{'finishes more often' if fin['diff'] > 0 else 'finishes less often'}, it is not significantly "
                "better (or worse) at the task when it finishes.",
                {"model": model, "metric": metric, "finish": dict(fin), "quality": dict(qual)})


def truncation_censoring(model: str, rate: Optional[float], n_samples: int, threshold: float = 0.10,
                         max_new_tokens: Optional[int] = None) -> Optional[Flag]:
    """More than ``threshold`` of a model's completions hit the cap: its rewards are censored (a truncated
    completion scores 0 whatever it would have become). Above 3x the threshold it is an error."""
    text = truncation_warning(rate, threshold, max_new_tokens)
    if text is None:
        return None
    severity = "error" if rate > 3 * threshold else "warning"
    return Flag(severity, "truncation_censoring",
                f"{model}: {text} ({round(rate * n_samples)} of {n_samples} samples); results censored. "
                "Compare with truncated samples excluded or re-sampled at a larger cap (termination section).",
                {"model": model, "truncation_rate": rate, "n_samples": n_samples, "threshold": threshold,
                 "max_new_tokens": max_new_tokens})


# ------------------------------------------------------------------------------------------- checkpoints


def kl_rising_reward_falling(steps: Sequence[int], kl: Sequence[Optional[float]],
                             reward: Sequence[Optional[float]], *, n: Optional[int] = None,
                             reward_name: str = "held-out reward", tol: float = 0.0) -> Optional[Flag]:
    """KL to the base keeps rising after the reward peaked: later updates move the model without helping it.

    ``steps``, ``kl`` and ``reward`` are aligned per checkpoint (None where one was not measured). Fires when
    the reward's peak is not the last checkpoint, the last reward is more than ``tol`` below the peak, and the
    KL at the last checkpoint exceeds the KL at the peak.
    """
    pts = [(s, k, r) for s, k, r in zip(steps, kl, reward) if k is not None and r is not None]
    pts.sort()
    if len(pts) < 3:
        return None
    i_peak = max(range(len(pts)), key=lambda i: (pts[i][2], -i))
    s_peak, k_peak, r_peak = pts[i_peak]
    s_last, k_last, r_last = pts[-1]
    if i_peak == len(pts) - 1 or not r_last < r_peak - tol or not k_last > k_peak:
        return None
    size = f" (n={n} prompts)" if n else ""
    return Flag("warning", "kl_rising_reward_falling",
                f"KL rising while {reward_name} falls: reward peaks at step {s_peak} ({r_peak:.4f}) and is "
                f"{r_last:.4f} at step {s_last}{size}, while KL to base grows from {k_peak:.4g} to {k_last:.4g}. "
                "Later updates move the model away from base without helping: consider an earlier checkpoint, "
                "a lower learning rate or a stronger KL/beta.",
                {"peak_step": s_peak, "peak_reward": r_peak, "last_step": s_last, "last_reward": r_last,
                 "kl_at_peak": k_peak, "kl_last": k_last, "n": n})


def non_monotonic_checkpoints(metric: str, steps: Sequence[int], values: Sequence[float], *,
                              n_prompts: Optional[int] = None, tol: float = 0.0,
                              higher_is_better: bool = True,
                              best_vs_last: Optional[Mapping] = None) -> Optional[Flag]:
    """A checkpoint curve that changes direction (moves of at most ``tol`` are ignored as flat).

    A rise then a fall (for a higher-is-better metric) is the overtraining shape and says so. ``best_vs_last``:
    the paired comparison last - best (``diff, ci_low, ci_high, n_pairs``); with it the flag says whether the fall
    is more than noise, and is only ``info`` when its interval contains 0.
    """
    pts = sorted(zip(steps, values))
    if len(pts) < 3:
        return None
    signs = []
    for (s0, v0), (s1, v1) in zip(pts, pts[1:]):
        d = v1 - v0
        if abs(d) > tol:
            signs.append(1 if d > 0 else -1)
    changes = sum(1 for a, b in zip(signs, signs[1:]) if a != b)
    if changes == 0:
        return None
    i_best = max(range(len(pts)), key=lambda i: (pts[i][1] if higher_is_better else -pts[i][1], -i))
    s_best, v_best = pts[i_best]
    s_last, v_last = pts[-1]
    size = f" ({n_prompts} prompts per checkpoint)" if n_prompts else ""
    values_txt = ", ".join(f"{s}: {fmt_value(metric, v)}" for s, v in pts)
    severity = "warning"
    if i_best not in (0, len(pts) - 1):
        msg = (f"{metric} is not monotonic over checkpoints{size}: best at step {s_best} "
               f"({fmt_value(metric, v_best)}), then {fmt_value(metric, v_last)} at step {s_last} "
               f"({fmt_diff(metric, v_last - v_best)}). Later training overwrites an earlier gain, or the "
               f"differences are noise. Values: {values_txt}.")
        if best_vs_last is not None and best_vs_last.get("ci_low") is not None:
            lo, hi = best_vs_last["ci_low"], best_vs_last["ci_high"]
            verdict = ("within noise" if _crosses(lo, hi) else "more than noise")
            msg += (f" Step {s_last} vs step {s_best}, paired: {fmt_diff(metric, best_vs_last['diff'])}, "
                    f"{fmt_interval(metric, lo, hi, best_vs_last.get('confidence', 0.95))} over "
                    f"{best_vs_last['n_pairs']} prompts: the fall is {verdict}.")
            severity = "info" if _crosses(lo, hi) else "warning"
    else:
        msg = (f"{metric} changes direction {changes} time(s) over checkpoints{size}; the curve is noisy. "
               f"Values: {values_txt}.")
    return Flag(severity, "non_monotonic_checkpoints", msg,
                {"metric": metric, "steps": [s for s, _ in pts], "values": [v for _, v in pts],
                 "direction_changes": changes, "best_step": s_best, "last_step": s_last,
                 "best_vs_last": dict(best_vs_last) if best_vs_last else None})


def early_gain_not_significant(metric: str, points: Sequence[Mapping]) -> list[Flag]:
    """Gains over the base at checkpoints before the last one that the evidence does not support.

    ``points``: per checkpoint ``{"step", "diff", "ci_low", "ci_high", "n_pairs"}`` (vs base), optionally
    ``"ci_low_adjusted", "ci_high_adjusted", "adjusted_confidence", "n_checkpoints"`` (the interval widened for
    having picked the best of ``n_checkpoints``; see ``curves.checkpoint_curves``). Flags:

    * every earlier checkpoint whose diff > 0 but whose interval crosses zero (warning);
    * the best checkpoint when its nominal interval excludes zero but the adjusted one does not (warning);
    * the best checkpoint when its interval excludes zero but no adjusted interval is known and it was picked
      among several checkpoints (info: the nominal interval does not account for the choice).
    """
    pts = sorted((p for p in points if p.get("diff") is not None), key=lambda p: p["step"])
    if len(pts) < 2:
        return []
    last = pts[-1]["step"]
    out = []
    for p in pts[:-1]:
        if p["diff"] > 0 and _crosses(p["ci_low"], p["ci_high"]):
            out.append(Flag(
                "warning", "early_gain_not_significant",
                f"{metric} at step {p['step']}: {fmt_diff(metric, p['diff'])} vs base, "
                f"{fmt_interval(metric, p['ci_low'], p['ci_high'], p.get('confidence', 0.95))} over "
                f"{p['n_pairs']} prompts crosses zero: this early gain is not significant; do not select the "
                f"checkpoint on it (last checkpoint, step {last}: {fmt_diff(metric, pts[-1]['diff'])}).",
                {"metric": metric, "step": p["step"], "diff": p["diff"], "ci_low": p["ci_low"],
                 "ci_high": p["ci_high"], "n_pairs": p["n_pairs"], "last_step": last}))
    best = max(pts, key=lambda p: p["diff"])
    m = best.get("n_checkpoints", len(pts))
    # The best checkpoint is a selection among m whether or not it is the last one.
    if best["diff"] > 0 and not _crosses(best["ci_low"], best["ci_high"]) and m > 1:
        lo_a, hi_a = best.get("ci_low_adjusted"), best.get("ci_high_adjusted")
        nominal = fmt_interval(metric, best["ci_low"], best["ci_high"], best.get("confidence", 0.95))
        ev = {"metric": metric, "step": best["step"], "diff": best["diff"], "ci_low": best["ci_low"],
              "ci_high": best["ci_high"], "n_pairs": best["n_pairs"], "n_checkpoints": m,
              "ci_low_adjusted": lo_a, "ci_high_adjusted": hi_a}
        how = best.get("adjustment") or "corrected for that choice"
        if lo_a is not None and _crosses(lo_a, hi_a):
            out.append(Flag(
                "warning", "early_gain_not_significant",
                f"{metric} at step {best['step']}: {fmt_diff(metric, best['diff'])} vs base, {nominal} over "
                f"{best['n_pairs']} prompts, but it is the best of {m} checkpoints: {how} "
                f"({fmt_interval(metric, lo_a, hi_a, best.get('adjusted_confidence'))}) the interval crosses zero.",
                ev))
        elif lo_a is None:
            out.append(Flag(
                "info", "early_gain_not_significant",
                f"{metric} at step {best['step']}: {fmt_diff(metric, best['diff'])} vs base, {nominal} over "
                f"{best['n_pairs']} prompts is the best of {m} checkpoints; the interval is not corrected for "
                "that choice, so confirm it on fresh prompts before selecting this checkpoint.", ev))
    return out


# ------------------------------------------------------------------------------------------------ pairs


def length_bias_in_pairs(audit: Mapping, *, min_fraction: float = 0.6, min_abs_corr: float = 0.3,
                         alpha: float = 0.05) -> Optional[Flag]:
    """The chosen side is systematically shorter (or longer) than the rejected one, or the margin tracks the
    length difference: DPO can then learn "shorter wins" instead of "correct wins".

    ``audit``: ``pair_audit.audit_pairs(...)`` output (uses its ``length_bias`` section).
    """
    lb = audit.get("length_bias") or {}
    n = lb.get("n_pairs", 0)
    if not n:
        return None
    shorter, longer = lb["fraction_chosen_shorter"], lb["fraction_chosen_longer"]
    p = lb["sign_test"]["p_value"]
    corr = lb.get("margin_vs_length_diff", {}).get("spearman")
    corr_p = lb.get("margin_vs_length_diff", {}).get("spearman_p")
    reasons = []
    if p < alpha and max(shorter, longer) >= min_fraction:
        side = "shorter" if shorter > longer else "longer"
        reasons.append(f"chosen is {side} than rejected in {max(shorter, longer):.0%} of {n} pairs "
                       f"(sign test p={p:.2g}; mean chosen - rejected {lb['mean_diff']:+.1f} tokens, "
                       f"95% interval [{lb['ci_low']:+.1f}, {lb['ci_high']:+.1f}])")
    if corr is not None and corr_p is not None and abs(corr) >= min_abs_corr and corr_p < alpha:
        reasons.append(f"reward margin correlates with the length difference (Spearman {corr:+.2f}, "
                       f"p={corr_p:.2g}, n={n})")
    if not reasons:
        return None
    return Flag("warning", "length_bias_in_pairs",
                "Length bias in pairs: " + "; ".join(reasons) + ". DPO can learn length instead of correctness; "
                "filter with a tighter max_length_diff or balance lengths.",
                {"n_pairs": n, "fraction_chosen_shorter": shorter, "fraction_chosen_longer": longer,
                 "sign_test_p": p, "spearman": corr, "spearman_p": corr_p})


def semantic_failures_in_pairs(audit: Mapping, max_fraction: float = 0.0) -> Optional[Flag]:
    """Chosen completions whose re-run scores below the recorded reward (or a recorded full score no longer
    strict): the pair may teach the wrong preference."""
    sem = audit.get("semantic") or {}
    n = sem.get("n_checked", 0)
    if not n:
        return None
    bad = sem["n_failed"]
    if bad / n <= max_fraction:
        return None
    lo = float(scipy.stats.beta.ppf(0.025, bad, n - bad + 1)) if bad > 0 else 0.0
    hi = float(scipy.stats.beta.ppf(0.975, bad + 1, n - bad)) if bad < n else 1.0
    return Flag("warning" if bad / n < 0.2 else "error", "semantic_failures_in_pairs",
                f"Semantic audit: {bad} of {n} sampled chosen completions score below their recorded reward on a "
                f"re-run of the reward ({sem.get('reward')}) ({bad / n:.0%}, 95% Clopper-Pearson interval "
                f"{lo:.0%}-{hi:.0%} of all pairs): the recorded rewards do not reproduce, so these pairs may prefer "
                "a worse completion.",
                {"n_checked": n, "n_failed": bad, "ci_low": lo, "ci_high": hi})


# --------------------------------------------------------------------------------------------- training


def nonfinite_updates(records: Sequence[Mapping]) -> Optional[Flag]:
    """Non-finite updates in training (``nonfinite`` steps, or a growing ``skipped_updates`` count)."""
    bad_steps = [r["step"] for r in records if r.get("nonfinite")]
    skipped = max((r["skipped_updates"] for r in records if isinstance(r.get("skipped_updates"), (int, float))),
                  default=0)
    n = max(len(bad_steps), int(skipped))
    if n == 0:
        return None
    shown = ", ".join(map(str, bad_steps[:10])) + (" ..." if len(bad_steps) > 10 else "")
    reasons = list(dict.fromkeys(str(r["nonfinite_reason"]) for r in records
                                 if r.get("nonfinite") and r.get("nonfinite_reason")))
    why = f"; reported: {'; '.join(reasons[:3])}" if reasons else ""
    return Flag("warning", "nonfinite_updates",
                f"{n} of {len(records)} logged steps had non-finite updates and were skipped"
                + (f" (steps {shown}{why})" if bad_steps else "")
                + ". Skipped updates change the effective schedule; look at grad norms before these steps.",
                {"n_skipped": n, "steps": bad_steps, "n_steps": len(records), "reasons": reasons})


# -------------------------------------------------------------------------------------- generation diffs


def termination_only_change(diff: Mapping, min_share: float = 0.5) -> Optional[Flag]:
    """Most of the reward change between two models comes from termination/format changes, not new code.

    ``diff``: ``generation_diff.diff_generations(...)`` output (uses ``summary.by_tag``).
    """
    s = diff["summary"]
    total = sum(abs(t["abs_delta"]) for t in s["by_tag"].values())
    if total == 0:
        return None
    share = sum(s["by_tag"].get(t, {}).get("abs_delta", 0.0) for t in ("termination", "format")) / total
    if share < min_share:
        return None
    a, b = diff["model_a"], diff["model_b"]
    counts = ", ".join(f"{t} {v['n']}" for t, v in s["by_tag"].items() if v["n"])
    return Flag("warning", "termination_only_change",
                f"{b} vs {a}: {share:.0%} of the reward change comes from termination/format changes "
                f"(changed samples: {counts}; {s['n_compared']} compared), not from different algorithms. "
                "The gain is about when the model stops or how it formats, not how it solves.",
                {"model_a": a, "model_b": b, "share": share, "by_tag": {t: v["n"] for t, v in s["by_tag"].items()}})
