"""Inference over training seeds: does a RECIPE help, not only this adapter on these prompts.

A paired interval over prompts treats the trained adapter as fixed: it says "this adapter beats the baseline on
prompts like these". Training the same recipe with another seed gives another adapter, and the seed-to-seed
spread is often as large as the effect. With S seeds of a recipe, each compared with its baseline on the same P
prompts (per-prompt differences ``d[s, p]``), the two-stage bootstrap resamples seeds, then prompts (the same
prompt draw for every seed, since the prompts are shared), and recomputes the mean difference. Its percentile
interval covers the recipe's mean effect over seeds and prompts; the matching p-value is the bootstrap's two-sided
share of resampled means on the other side of 0 (so the interval excludes 0 exactly when p < alpha).

With 2 seeds the seed stage has only 3 distinct draws: the interval is then a rough statement (``n_seeds`` says
how many there were); 5 or more seeds make it a useful one.

Several recipes against one baseline recipe (an ablation: each loss variant against `ppo_clip`, seed s of every
variant paired with the baseline's seed s) are a family: reading off the best variant is a selection among them.
``seeds_then_prompts_family`` resamples seeds and prompts once per draw for all of them (they share the
baseline's runs and the prompts) and gives max-T simultaneous intervals (jaxrl.evaluation.stats.max_t): they hold
for every variant at once, so the chosen one's claim survives the choice.
"""

from __future__ import annotations

import math

import numpy as np

from jaxrl.evaluation.stats import max_t

__all__ = ["seeds_then_prompts", "seeds_then_prompts_family"]


def seeds_then_prompts(diffs, confidence: float = 0.95, n_resamples: int = 10000, seed: int = 0) -> dict:
    """Two-stage (seeds, then prompts) bootstrap of the mean of ``diffs`` ``[S, P]`` (module docstring).

    Returns ``{"diff", "ci_low", "ci_high", "p_value", "n_seeds", "n_prompts", "seed_sd"}``; ``seed_sd`` is the SD
    over seeds of each seed's mean difference.
    """
    d = np.asarray(diffs, np.float64)
    if d.ndim != 2 or d.shape[0] < 1 or d.shape[1] < 1:
        raise ValueError(f"seeds_then_prompts: expected [seeds, prompts] differences, got shape {d.shape}")
    if not np.all(np.isfinite(d)):
        raise ValueError("seeds_then_prompts: contains NaN or infinite values")
    alpha = round(1.0 - confidence, 12)
    s, p = d.shape
    rng = np.random.default_rng([seed, 13])
    boot = np.empty(int(n_resamples))
    chunk = max(1, 2_000_000 // max(s * p, 1))
    for start in range(0, int(n_resamples), chunk):
        b = min(chunk, int(n_resamples) - start)
        si = rng.integers(0, s, size=(b, s))
        pi = rng.integers(0, p, size=(b, p))
        boot[start:start + b] = d[si[:, :, None], pi[:, None, :]].mean(axis=(1, 2))
    boot.sort()
    n = boot.size
    lo = float(boot[max(0, int(math.floor(alpha / 2 * n)))])
    hi = float(boot[min(n - 1, int(math.ceil((1 - alpha / 2) * n)) - 1)])
    pval = float(min(1.0, 2 * min(np.sum(boot <= 0), np.sum(boot >= 0)) / n))
    est = float(d.mean())
    if pval >= alpha:  # the same decision as the test
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    elif lo <= 0 <= hi:
        lo, hi = (max(lo, np.nextafter(0.0, 1.0)), hi) if est > 0 else (lo, min(hi, np.nextafter(0.0, -1.0)))
    return {"diff": est, "ci_low": lo, "ci_high": hi, "p_value": pval, "n_seeds": int(s), "n_prompts": int(p),
            "seed_sd": float(d.mean(axis=1).std(ddof=1)) if s > 1 else None}


def seeds_then_prompts_family(diffs, masks=None, confidence: float = 0.95, n_resamples: int = 10000, seed: int = 0,
                              bounds=None) -> dict:
    """Simultaneous (max-T) intervals for K recipes' mean differences (module docstring).

    Args:
      diffs: ``[K, S, U]`` per-seed, per-prompt differences of each recipe against its baseline; seed s is the same
        baseline run for every recipe, and U is the union of the family's prompts.
      masks: ``[K, U]``, False where recipe k's comparison lacks prompt u (default: every prompt).
      bounds: per recipe, the range of a difference (None: unbounded); the intervals are clipped to it.
    Returns:
      ``{"diff", "ci_low", "ci_high", "p_value"`` (each recipe's marginal two-stage interval, as
      ``seeds_then_prompts``), ``"sim_low", "sim_high", "sim_p"`` (simultaneous over the K), ``"critical_value",
      "n_seeds", "family_size"}``; lists of K.
    """
    d = np.asarray(diffs, np.float64)
    if d.ndim != 3 or min(d.shape) < 1:
        raise ValueError(f"seeds_then_prompts_family: expected [recipes, seeds, prompts] differences, got {d.shape}")
    k, s, u = d.shape
    m = np.ones((k, u), bool) if masks is None else np.asarray(masks, bool).reshape(k, u)
    if not m.any(axis=1).all():
        raise ValueError("seeds_then_prompts_family: a recipe has no prompt")
    if not np.all(np.isfinite(d[np.broadcast_to(m[:, None, :], d.shape)])):
        raise ValueError("seeds_then_prompts_family: contains NaN or infinite values")
    marg = [seeds_then_prompts(d[j][:, m[j]], confidence, n_resamples, seed) for j in range(k)]
    est = np.array([r["diff"] for r in marg])
    dm = np.where(m[:, None, :], d, 0.0)
    rng = np.random.default_rng([seed, 17])
    devs = []
    chunk = max(1, 2_000_000 // max(k * s * u, 1))
    left = int(n_resamples)
    while left > 0:
        b = min(chunk, left)
        # multiplicities of each seed and each prompt in the draw (the same draw for every recipe)
        ws = np.apply_along_axis(np.bincount, 1, rng.integers(0, s, size=(b, s)), minlength=s).astype(float)
        wp = np.apply_along_axis(np.bincount, 1, rng.integers(0, u, size=(b, u)), minlength=u).astype(float)
        num = np.einsum("bs,ksu,bu->kb", ws, dm, wp)
        den = s * (m.astype(float) @ wp.T)  # [K, b]
        with np.errstate(divide="ignore", invalid="ignore"):
            devs.append(np.where(den > 0, num / den, est[:, None]) - est[:, None])
        left -= b
    dev = np.concatenate(devs, axis=1)
    lo, hi = np.array([r["ci_low"] for r in marg]), np.array([r["ci_high"] for r in marg])
    p = np.array([r["p_value"] for r in marg])
    s_lo, s_hi, p_adj, c = max_t(dev[None], est[None], lo[None], hi[None], p_values=p[None], confidence=confidence,
                                 bounds=bounds)
    return {"diff": est.tolist(), "ci_low": lo.tolist(), "ci_high": hi.tolist(), "p_value": p.tolist(),
            "sim_low": s_lo[0].tolist(), "sim_high": s_hi[0].tolist(), "sim_p": p_adj[0].tolist(),
            "critical_value": float(c[0]), "n_seeds": int(s), "family_size": int(k)}
