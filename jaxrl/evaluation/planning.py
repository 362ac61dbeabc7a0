"""Power and sample size for paired model-vs-baseline evaluations, and the variance split that chooses prompts
against samples per prompt.

For a paired comparison on n prompts the standard error of the mean difference is ``sd_diff / sqrt(n)``, where
``sd_diff`` is the SD of the per-prompt differences (each a mean over the prompt's k samples). A two-sided test
at level alpha (alpha / m with a Bonferroni correction over a family of m comparisons) detects a true effect
``delta`` with probability ``power`` when::

    n >= ((z_{1 - alpha / (2 m)} + z_{power}) * sd_diff / delta)^2

With k samples a prompt, ``sd_diff^2(k) = between + within / k``: ``within`` is the variance of a single paired
sample difference inside a prompt (mean over prompts of the variance over its samples, paired by sample index --
common random numbers), ``between`` the rest. More samples only shrink the within part; prompts shrink both. A
pilot with one sample a prompt cannot separate the two, so its whole variance counts as between (the
conservative choice: more samples are then assumed not to help).

The users' numbers: their interval [+0.05, +6.30] pp on 100 prompts implies SE 1.59 pp, sd_diff 15.9 pp; a
+2 pp effect then needs ``((1.96 + 0.84) * 15.9 / 2)^2 = 496`` prompts at 80% power, and 788 with a correction
over 7 checkpoints (``required_prompts(0.159, 0.02)``, ``required_prompts(0.159, 0.02, family=7)``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence

import numpy as np
import scipy.stats

from jaxrl.utils.dataclass_flags import flag_field

__all__ = ["required_prompts", "minimum_detectable_effect", "power_at", "sd_from_interval", "variance_components",
           "plan_table", "row_power", "DEFAULT_POWER", "PlanSettings"]

METRICS = ("partial_reward_mean", "strict_rate")  # the per-sample metrics a plan is made for


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """One plan (launchers.plan; its fields are the launcher's flags, jaxrl.utils.dataclass_flags): the effect and
    the test, and where the variance comes from: a pilot evaluation (`results`), or the users' own numbers
    (`sd_diff`, or `pilot_interval` with `pilot_n`)."""

    results: Optional[str] = flag_field(None, help="Pilot evaluation folder (or its results.json) with samples/.")
    model: Optional[str] = flag_field(None, help="Pilot model compared with the baseline (default: the one with the "
                                      "largest |diff| on --metric).")
    metric: str = flag_field("partial_reward_mean", choices=METRICS, help="Metric.")
    effect: float = flag_field(0.02, help="True effect to detect, in the metric's units (0.02 = 2 pp).")
    power: float = flag_field(0.8, help="Probability of detecting it.")
    alpha: float = flag_field(0.05, help="Two-sided level of each test.")
    family: Optional[int] = flag_field(None, help="Comparisons to correct for (default: the pilot's family size, "
                                       "else 1).")
    samples: tuple[int, ...] = flag_field((1, 2, 4, 8, 16), help="Samples a prompt to plan for.")
    sd_diff: Optional[float] = flag_field(None, help="SD of the per-prompt differences (no pilot files needed).")
    pilot_interval: Optional[tuple[float, ...]] = flag_field(None, help="LOW,HIGH: a pilot's 95% interval of the "
                                                             "difference (with --pilot_n): its SD is implied.")
    pilot_n: Optional[int] = flag_field(None, help="Prompts behind --pilot_interval.")
    correlation: Optional[float] = flag_field(None, help="Base-only pilot: assumed model-base correlation of the "
                                              "per-prompt means.")
    out: Optional[str] = flag_field(None, help="Also write the plan as JSON here.")


DEFAULT_POWER = PlanSettings.power


def _z_sum(power: float, alpha: float, family: int) -> float:
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if int(family) < 1:
        raise ValueError(f"family must be >= 1, got {family}")
    return float(scipy.stats.norm.ppf(1 - alpha / (2 * int(family))) + scipy.stats.norm.ppf(power))


def required_prompts(sd_diff: float, effect: float, power: float = DEFAULT_POWER, alpha: float = PlanSettings.alpha,
                     family: int = 1) -> int:
    """Prompts needed to detect ``effect`` (same units as ``sd_diff``) at ``power``, two-sided ``alpha`` (over a
    Bonferroni family of ``family`` comparisons). Raises ValueError for a zero effect."""
    if effect == 0:
        raise ValueError("required_prompts: effect must be non-zero")
    if sd_diff < 0:
        raise ValueError(f"required_prompts: sd_diff must be >= 0, got {sd_diff}")
    return max(1, int(math.ceil((_z_sum(power, alpha, family) * sd_diff / abs(effect)) ** 2)))


def minimum_detectable_effect(sd_diff: float, n: int, power: float = DEFAULT_POWER,
                              alpha: float = PlanSettings.alpha, family: int = 1) -> float:
    """The smallest true effect detected with probability ``power`` on ``n`` prompts."""
    if n < 1:
        raise ValueError(f"minimum_detectable_effect: n must be >= 1, got {n}")
    return _z_sum(power, alpha, family) * sd_diff / math.sqrt(n)


def power_at(n: int, sd_diff: float, effect: float, alpha: float = PlanSettings.alpha, family: int = 1) -> float:
    """Probability that the two-sided test at ``alpha / family`` rejects when the true effect is ``effect``."""
    if sd_diff == 0:
        return 1.0 if effect != 0 else alpha / family
    zc = scipy.stats.norm.ppf(1 - alpha / (2 * family))
    shift = abs(effect) * math.sqrt(n) / sd_diff
    return float(scipy.stats.norm.sf(zc - shift) + scipy.stats.norm.cdf(-zc - shift))


def sd_from_interval(ci_low: float, ci_high: float, n: int, confidence: float = 0.95) -> float:
    """sd_diff implied by a (normal-theory) interval on n prompts: ``sqrt(n) * width / (2 z)``."""
    z = scipy.stats.norm.ppf(1 - (1 - confidence) / 2)
    return math.sqrt(n) * (ci_high - ci_low) / (2 * z)


def _by_prompt(records: Sequence[Mapping], metric: str) -> dict[str, dict[int, float]]:
    key = {"partial_reward_mean": "partial", "strict_rate": "strict"}.get(metric)
    if key is None:
        raise ValueError(f"variance_components: metric must be partial_reward_mean or strict_rate, got {metric!r}")
    out: dict[str, dict[int, float]] = {}
    for r in records:
        reward = r["reward"] if key not in r and "reward" in r else r
        out.setdefault(str(r["problem_id"]), {})[int(r.get("sample_index", 0))] = float(reward[key])
    return out


def variance_components(model_records: Optional[Sequence[Mapping]], base_records: Sequence[Mapping],
                        metric: str = PlanSettings.metric, *, correlation: Optional[float] = None) -> dict:
    """The pilot's variance split (module docstring).

    Args:
      model_records: a model's SAMPLES records on the pilot prompts (None: a base-only pilot; then the difference
        is modelled as two models with per-prompt correlation ``correlation`` of their true means and independent
        samples, ``correlation`` required).
      base_records: the baseline's records on the same prompts.
    Returns:
      ``{"metric", "n_prompts", "k", "sd_diff" (at the pilot's k), "between", "within", "correlation" (of the
      per-prompt means, model vs base), "base_sd", "base_between", "base_within", "within_identified", "source"}``.
    """
    base = _by_prompt(base_records, metric)
    ids = list(base)
    k = min(len(v) for v in base.values())

    def split(groups: Sequence[Sequence[float]]):
        means = np.array([np.mean(g) for g in groups])
        within = float(np.mean([np.var(g, ddof=1) for g in groups])) if k > 1 else 0.0
        total = float(np.var(means, ddof=1)) if len(means) > 1 else 0.0
        return means, total, within, max(total - within / k, 0.0) if k > 1 else total

    b_means, b_total, b_within, b_between = split([list(base[i].values()) for i in ids])
    out = {"metric": metric, "n_prompts": len(ids), "k": int(k), "within_identified": k > 1,
           "base_sd": math.sqrt(b_total), "base_between": b_between, "base_within": b_within}
    if model_records is None:
        if correlation is None:
            raise ValueError("variance_components: a base-only pilot needs the model-base correlation")
        between = 2 * b_between * (1 - correlation)
        within = 2 * b_within
        out.update(source=f"base-only pilot, assumed correlation {correlation}", correlation=float(correlation),
                   between=between, within=within, sd_diff=math.sqrt(between + within / k))
        return out
    model = _by_prompt(model_records, metric)
    if set(model) != set(ids):
        raise ValueError("variance_components: the model and the baseline were not evaluated on the same prompts")
    diffs = []
    for i in ids:
        common = sorted(set(model[i]) & set(base[i]))
        # paired by sample index (shared keys); unpaired samples contribute through their means only
        diffs.append([model[i][j] - base[i][j] for j in common] if len(common) == k else
                     [np.mean(list(model[i].values())) - np.mean(list(base[i].values()))] * k)
    d_means, d_total, d_within, d_between = split(diffs)
    m_means = np.array([np.mean(list(model[i].values())) for i in ids])
    corr = (float(np.corrcoef(m_means, b_means)[0, 1]) if len(ids) > 2 and np.std(m_means) > 0
            and np.std(b_means) > 0 else None)
    out.update(source="paired pilot", correlation=corr, between=d_between, within=d_within,
               sd_diff=math.sqrt(d_total))
    return out


def plan_table(components: Mapping, effect: float, *, power: float = DEFAULT_POWER,
               alpha: float = PlanSettings.alpha, family: int = 1,
               ks: Sequence[int] = PlanSettings.samples) -> list[dict]:
    """Prompts (and samples = prompts x k) needed per samples-a-prompt k, without and with the correction for a
    family of ``family`` comparisons."""
    rows = []
    for k in ks:
        sd = math.sqrt(components["between"] + components["within"] / int(k))
        n1 = required_prompts(sd, effect, power, alpha, 1) if sd > 0 else 1
        nf = required_prompts(sd, effect, power, alpha, family) if sd > 0 else 1
        rows.append({"k": int(k), "sd_diff": sd, "prompts": n1, "samples": n1 * int(k), "prompts_family": nf,
                     "samples_family": nf * int(k), "family": int(family)})
    return rows


def row_power(row: Mapping, power: float = DEFAULT_POWER) -> Optional[dict]:
    """For a comparison row (``sd_diff``, ``n_pairs``, ``diff``, ``ci_low``, ``ci_high``, ``confidence``,
    ``family_size``): the minimum detectable effect at ``power`` on its prompts, alone and after the family's
    correction, and the prompts the observed difference would need. The SD used is the larger of ``sd_diff`` and
    the one the row's interval implies, so that differences without spread (all equal) do not claim infinite
    power. None without ``sd_diff``."""
    sd, n = row.get("sd_diff"), int(row.get("n_pairs") or 0)
    if sd is None or n < 2:
        return None
    alpha = round(1.0 - float(row.get("confidence", 0.95)), 12)
    if row.get("ci_low") is not None and row.get("ci_high") is not None:
        sd = max(float(sd), sd_from_interval(row["ci_low"], row["ci_high"], n, 1.0 - alpha))
    if not math.isfinite(sd) or sd > 1e100:  # too few prompts for the test to bound anything
        return None
    fam = int(row.get("family_size") or 1)
    diff = float(row["diff"])
    out = {"power": power, "sd": float(sd), "mde": minimum_detectable_effect(sd, n, power, alpha),
           "mde_family": minimum_detectable_effect(sd, n, power, alpha, fam), "family_size": fam,
           "n_for_diff": None, "n_for_diff_family": None}
    if diff != 0 and sd > 0:
        out["n_for_diff"] = required_prompts(sd, diff, power, alpha)
        out["n_for_diff_family"] = required_prompts(sd, diff, power, alpha, fam)
    return out
