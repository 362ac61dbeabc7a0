"""Seeded simulations of paired evaluations (shared by the statistics tests).

The model follows the statistics audit of 2026-12-01: every prompt has a difficulty ``p`` drawn from a
Beta distribution; a model with logit shift ``s`` passes a test with probability ``expit(logit(p) + s)``.

* binary reward: one pass / fail per sample;
* partial reward: the fraction of 10 tests passed, and a sample is truncated (scored 0) with probability 0.45.

Model and base share random numbers as the evaluator's common sample keys make them do: a (prompt, sample)
draw of the model reuses the base's uniforms with probability ``rho`` (a nearby checkpoint), else it draws fresh
ones. A sequence of checkpoints reuses the previous checkpoint's uniforms with probability ``stay``.

Everything is vectorised over replications: arrays are ``[R, n]`` per-prompt means (over the k samples).
"""

from __future__ import annotations

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

BETA = (0.6, 1.4)  # mean difficulty 0.3 with many prompts nearly always / never solved, as in code tasks
N_TESTS = 10
TRUNCATION = 0.45
_GRID = scipy.stats.beta(*BETA).ppf((np.arange(20000) + 0.5) / 20000)  # quantile grid for population means


def _shifted(p, s):
    return scipy.special.expit(scipy.special.logit(np.clip(p, 1e-9, 1 - 1e-9)) + s)


def true_diff(s: float, reward: str) -> float:
    """Population mean difference (model - base) of a logit shift ``s``."""
    if s == 0:
        return 0.0
    d = float(np.mean(_shifted(_GRID, s) - _GRID))
    return d * (1 - TRUNCATION) if reward == "partial" else d


def shift_for(effect: float, reward: str) -> float:
    """The logit shift whose population mean difference is ``effect``."""
    if effect == 0:
        return 0.0
    return float(scipy.optimize.brentq(lambda s: true_diff(s, reward) - effect, -5, 5, xtol=1e-10))


def _scores(p, u_test, u_trunc, reward):
    """Per-sample scores from uniforms: binary [R, n, k] or partial (u_test [R, n, k, 10])."""
    if reward == "binary":
        return (u_test < p[..., None]).astype(np.float64)
    passed = (u_test < p[..., None, None]).mean(axis=-1)
    return np.where(u_trunc < TRUNCATION, 0.0, passed)


def _uniforms(rng, shape, reward):
    return rng.random(shape + ((N_TESTS,) if reward == "partial" else ())), rng.random(shape)


def _reuse(rng, keep_prob, old, shape, reward):
    new = _uniforms(rng, shape, reward)
    keep = rng.random(shape) < keep_prob
    test = np.where(keep[..., None], old[0], new[0]) if reward == "partial" else np.where(keep, old[0], new[0])
    return test, np.where(keep, old[1], new[1])


def paired(rng, reps: int, n: int, k: int, reward: str, effect: float, rho: float):
    """(model, base) per-prompt means [R, n] and the true difference."""
    p = rng.beta(*BETA, size=(reps, n))
    shape = (reps, n, k)
    base_u = _uniforms(rng, shape, reward)
    model_u = _reuse(rng, rho, base_u, shape, reward)
    s = shift_for(effect, reward)
    base = _scores(p, *base_u, reward).mean(-1)
    model = _scores(_shifted(p, s), *model_u, reward).mean(-1)
    return model, base, true_diff(s, reward)


def checkpoints(rng, reps: int, n: int, k: int, m: int, stay: float, shifts=None, difficulty=(3.0, 1.0)):
    """Base + ``m`` checkpoints with both task metrics, like an evaluation's samples.

    Returns ``(partial, strict)`` arrays ``[R, m + 1, n]`` (index 0 is the base; per-prompt means over k samples).
    A sample's strict pass is "all 10 tests pass and not truncated"; its partial reward the fraction passed (0 if
    truncated). ``shifts``: logit shift per checkpoint (default all 0: no true effect anywhere).
    """
    shifts = np.zeros(m) if shifts is None else np.asarray(shifts, np.float64)
    # Default: easy enough that strict passes are not rare (per-test pass probability 0.75 on average).
    p = rng.beta(*difficulty, size=(reps, n))
    shape = (reps, n, k)
    u = _uniforms(rng, shape, "partial")
    partial, strict = [], []
    for j in range(m + 1):
        if j:
            u = _reuse(rng, stay, u, shape, "partial")
        pj = p if j == 0 else _shifted(p, shifts[j - 1])
        passed = u[0] < pj[..., None, None]
        trunc = u[1] < TRUNCATION
        partial.append(np.where(trunc, 0.0, passed.mean(-1)).mean(-1))
        strict.append(np.where(trunc, 0.0, passed.all(-1)).mean(-1))
    return np.stack(partial, 1), np.stack(strict, 1)
