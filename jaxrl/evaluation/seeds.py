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
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["seeds_then_prompts"]


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
