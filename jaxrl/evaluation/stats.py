"""Evaluation statistics: paired intervals that agree with their tests, simultaneous intervals over a family of
comparisons, and model-vs-baseline comparison rows (numpy + scipy; no jax).

Typical use (per-sample records -> metrics and per-prompt values, see :mod:`.metrics`)::

    per_prompt = {name: per_prompt_values(recs) for name, recs in records_by_model.items()}
    rows = compare(per_prompt, baseline="base", metrics=["partial_reward_mean", "strict_rate"])

Everything compares models on the SAME prompts (paired): a prompt's difficulty cancels in the per-prompt
difference, which is why a paired interval is much narrower than two independent ones. The unit of resampling is
the prompt (a prompt's samples are averaged first).

Which interval and test a row gets (``ci_method`` / ``test``), chosen so that the interval excludes 0 exactly
when ``p_value < 1 - confidence``:

* ``mcnemar_midp`` -- every per-prompt value of both models is 0 or 1 (one sample a prompt, a pass/fail metric).
  The test is McNemar's exact conditional test in its mid-p form: among the D discordant prompts, the model's
  wins are Binomial(D, 1/2) under no difference. (The plain exact test is kept as ``p_value_exact``: it is
  conservative -- 97-99% coverage in our simulations -- so the mid-p form is the one the interval inverts.)
  The interval: the mid-p interval of the share of discordant prompts the model wins, theta, scaled to the
  difference by the discordance rate psi (``diff = psi * (2 theta - 1)``), with psi's own sampling error (its
  mid-p interval) added in quadrature. Its sign is the test's decision, so the two never contradict each other;
  with no discordant prompt at all it is ``[-psi_U, +psi_U]``, psi_U the upper bound of 0 discordant in n.
* ``sign_flip`` -- anything else (several samples a prompt, partial rewards, token counts): the sign-flip
  permutation test of the mean per-prompt difference (exact enumeration of all 2^n sign patterns when
  ``2^n <= n_resamples + 1``, else ``n_resamples`` random patterns plus the observed one), and the interval that
  inverts it exactly: every shift ``delta`` whose shifted differences ``d - delta`` the test does not reject.
  Each sign pattern accepts an interval of shifts around the mean, so the accepted set is an interval and is
  computed in closed form (no bisection).
* ``zero_spread`` -- every per-prompt difference is the same value c (e.g. two greedy, near-identical models on a
  few prompts) and the metric is bounded: the data show no spread, which is not certainty. The test asks how
  likely n prompts in a row show c if a fraction psi of all prompts differed by as much as the metric's range
  allows: ``p(delta) = min(1, 2 (1 - psi(delta))^n)``. Never a zero-width interval from discreteness.

Simultaneous intervals (:func:`simultaneous`): a max-T bootstrap over every comparison of a family (all models x
metrics compared with the baseline in one results file; a sweep table's cells), resampling prompts jointly.
Each marginal interval is stretched about its estimate by ``c / z`` where c is the (1 - alpha) quantile of the
largest standardised bootstrap deviation over the family (never below z, so a family of one gives back the
marginal interval); ``simultaneous_p_value`` is the matching adjusted p-value.
"""

from __future__ import annotations

import inspect
import math
import warnings as _warnings
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import scipy.special as sp
import scipy.stats

from jaxrl.evaluation.metrics import METRICS, default_ks, model_metrics, pass_at_k, per_prompt_values
# The writer lives in .results; re-exported here, where callers have always found it.
from jaxrl.evaluation.results import format_results_md, truncation_warning, write_results

__all__ = [
    "METRICS",
    "pass_at_k",
    "model_metrics",
    "per_prompt_values",
    "default_ks",
    "paired_bootstrap",
    "mcnemar_exact",
    "binom_midp_interval",
    "paired_binary",
    "sign_flip",
    "zero_spread",
    "paired_difference",
    "paired_difference_rows",
    "add_simultaneous",
    "simultaneous",
    "mean_interval",
    "metric_bounds",
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


def _paired(a, b, who: str) -> tuple[np.ndarray, np.ndarray]:
    """Two non-empty 1-D arrays of equal length (per-prompt values of the model and the baseline)."""
    a, b = _as_1d(a, f"{who} a"), _as_1d(b, f"{who} b")
    if a.shape != b.shape:
        raise ValueError(f"{who}: a and b must pair up, got lengths {a.size} and {b.size}")
    if a.size == 0:
        raise ValueError(f"{who}: no pairs")
    return a, b


def _check_confidence(confidence: float, who: str) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"{who}: confidence must be in (0, 1), got {confidence}")
    # Rounded so that 1 - 0.95 is the float 0.05: a p-value of exactly 0.05 must compare the same way here and
    # in the pattern counts of the tests.
    return round(1.0 - float(confidence), 12)


def metric_bounds(metric: str) -> Optional[tuple[float, float]]:
    """Range of a per-prompt DIFFERENCE of ``metric``: (-1, 1) for rates and rewards in [0, 1], None (unbounded)
    for token counts."""
    return None if metric.endswith("_tokens") else (-1.0, 1.0)


# ------------------------------------------------------------------------------------------ legacy bootstrap


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
    """Paired bootstrap confidence interval of ``mean(a) - mean(b)`` (descriptive; :func:`compare` uses
    :func:`paired_difference`, whose intervals agree with a test).

    ``method``: "percentile" or "bca" (falls back to percentile where BCa is undefined, and says so). Returns
    ``{"diff", "ci_low", "ci_high", "n_pairs", "method"}``; all-equal differences give ``[diff, diff]``.
    """
    a, b = _paired(a, b, "paired_bootstrap")
    if method not in _METHODS:
        raise ValueError(f"paired_bootstrap: method must be one of {_METHODS}, got {method!r}")
    _check_confidence(confidence, "paired_bootstrap")
    if int(n_resamples) < 1:
        raise ValueError(f"paired_bootstrap: n_resamples must be >= 1, got {n_resamples}")
    d = a - b
    diff = float(np.mean(a) - np.mean(b))
    out = {"diff": diff, "ci_low": diff, "ci_high": diff, "n_pairs": int(a.size), "method": method}
    if np.ptp(d) == 0.0:
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
    if n == 0:
        return 1.0
    return float(min(1.0, 2.0 * scipy.stats.binom.cdf(k_min, n, 0.5)))


def mcnemar_exact(a, b) -> dict:
    """McNemar's exact test on paired binary outcomes (model ``a`` vs baseline ``b``, same prompts in order).

    Returns ``{"p_value", "b01", "b10", "n_pairs"}`` with ``b01`` = #(a=0, b=1), ``b10`` = #(a=1, b=0); the
    p-value is the two-sided exact binomial test of ``b10`` of ``b01 + b10`` at 1/2 (1.0 without discordance).
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


# ---------------------------------------------------------------------------------------- binary (McNemar)


def _midp_tails(x, n, theta):
    """(P(X > x) + P(X = x)/2, P(X < x) + P(X = x)/2) for X ~ Binomial(n, theta), elementwise (integer x, n)."""
    below = np.where(x > 0, sp.bdtr(np.maximum(x - 1, 0), n, theta), 0.0)  # P(X < x)
    upto = sp.bdtr(x, n, theta)  # P(X <= x)
    half = 0.5 * (upto - below)
    return 1.0 - upto + half, below + half


def binom_midp_interval(x, n, confidence: float = 0.95, iters: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Mid-p confidence interval of a binomial proportion (elementwise over arrays ``x`` of ``n``).

    The bounds solve ``P(X > x) + P(X = x)/2 = alpha/2`` (lower) and ``P(X < x) + P(X = x)/2 = alpha/2`` (upper);
    both tails are monotone in theta, so bisection finds them. ``x = 0`` gives lower 0, ``x = n`` upper 1, and
    ``n = 0`` the whole [0, 1].
    """
    alpha = _check_confidence(confidence, "binom_midp_interval")
    x = np.asarray(np.rint(x), np.int64)
    n = np.broadcast_to(np.asarray(np.rint(n), np.int64), x.shape)
    lo_a, hi_a = np.zeros(x.shape), np.ones(x.shape)  # lower bound: upper tail increases with theta
    lo_b, hi_b = np.zeros(x.shape), np.ones(x.shape)  # upper bound: lower tail decreases with theta
    for _ in range(iters):
        mid_a, mid_b = (lo_a + hi_a) / 2, (lo_b + hi_b) / 2
        up, _ = _midp_tails(x, n, mid_a)
        _, down = _midp_tails(x, n, mid_b)
        big = up > alpha / 2
        hi_a, lo_a = np.where(big, mid_a, hi_a), np.where(big, lo_a, mid_a)
        big = down > alpha / 2
        lo_b, hi_b = np.where(big, mid_b, lo_b), np.where(big, hi_b, mid_b)
    lower = np.where((x > 0) & (n > 0), (lo_a + hi_a) / 2, 0.0)
    upper = np.where((x < n) & (n > 0), (lo_b + hi_b) / 2, 1.0)
    return lower, upper


def _mcnemar_midp(b10, b01) -> np.ndarray:
    """Two-sided McNemar mid-p: ``2 * (P(X < m) + P(X = m)/2)``, X ~ Bin(D, 1/2), m = min(b10, b01); 1 if D = 0."""
    b10, b01 = np.asarray(b10, np.float64), np.asarray(b01, np.float64)
    d = b10 + b01
    m = np.minimum(b10, b01)
    p = 2.0 * (scipy.stats.binom.cdf(m - 1, d, 0.5) + 0.5 * scipy.stats.binom.pmf(m, d, 0.5))
    return np.where(d > 0, np.minimum(1.0, p), 1.0)


def _scaled_by_discordance(s_lo, s_hi, s_hat, d, n, p, alpha, confidence):
    """The difference ``psi * mu`` from an interval for mu (the mean difference on the D discordant prompts,
    ``[s_lo, s_hi]`` around ``s_hat``) and the discordance rate ``psi = D / n`` with its own mid-p interval,
    combined in quadrature; the test ``p`` (a test of mu = 0, whatever psi is) decides the sign."""
    psi = d / n
    p_lo, p_hi = binom_midp_interval(d, n, confidence)
    est = psi * s_hat
    # psi's error moves a bound outwards in the direction of its sign: up for a positive bound, down for a negative
    h_hi = np.abs(s_hi) * np.where(s_hi > 0, p_hi - psi, psi - p_lo)
    h_lo = np.abs(s_lo) * np.where(s_lo < 0, p_hi - psi, psi - p_lo)
    hi = est + np.sqrt((psi * (s_hi - s_hat)) ** 2 + h_hi ** 2)
    lo = est - np.sqrt((psi * (s_hat - s_lo)) ** 2 + h_lo ** 2)
    sig = p < alpha
    # Where the quadrature would pull a significant bound across 0, take the conservative psi bound instead.
    tiny = np.finfo(float).tiny
    pos, neg = sig & (s_hat > 0), sig & (s_hat < 0)
    lo = np.where(pos & (lo <= 0), np.maximum(s_lo * p_lo, tiny), lo)
    hi = np.where(neg & (hi >= 0), np.minimum(s_hi * p_lo, -tiny), hi)
    lo = np.where(~sig, np.minimum(lo, 0.0), lo)
    hi = np.where(~sig, np.maximum(hi, 0.0), hi)
    return lo, hi


def paired_binary(b10, b01, n, confidence: float = 0.95) -> dict:
    """Difference of two paired proportions from the discordant counts (elementwise over arrays).

    Args:
      b10: prompts the model passes and the baseline fails; b01: the reverse; n: prompts in all.
    Returns:
      ``{"diff", "ci_low", "ci_high", "p_value", "p_value_exact"}`` (arrays): ``diff = (b10 - b01) / n``, the
      McNemar mid-p test and the interval of the module docstring (``mcnemar_midp``); ``p_value_exact`` is the
      plain exact McNemar test. ``ci_low > 0`` or ``ci_high < 0`` exactly when ``p_value < 1 - confidence``.
    """
    alpha = _check_confidence(confidence, "paired_binary")
    b10 = np.asarray(b10, np.float64)
    b01 = np.asarray(b01, np.float64)
    n = np.broadcast_to(np.asarray(n, np.float64), b10.shape)
    d = b10 + b01
    if np.any(d > n) or np.any(n < 1) or np.any(b10 < 0) or np.any(b01 < 0):
        raise ValueError("paired_binary: need 0 <= b10, b01 and b10 + b01 <= n, n >= 1")
    t_lo, t_hi = binom_midp_interval(b10, d, confidence)
    s_hat = np.where(d > 0, (b10 - b01) / np.maximum(d, 1), 0.0)  # mu = 2 theta - 1 on the discordant prompts
    p = _mcnemar_midp(b10, b01)
    lo, hi = _scaled_by_discordance(2 * t_lo - 1, 2 * t_hi - 1, s_hat, d, n, p, alpha, confidence)
    exact = np.where(d > 0, np.minimum(1.0, 2.0 * scipy.stats.binom.cdf(np.minimum(b10, b01), d, 0.5)), 1.0)
    return {"diff": (b10 - b01) / n, "ci_low": np.maximum(lo, -1.0), "ci_high": np.minimum(hi, 1.0),
            "p_value": p, "p_value_exact": exact}


# ------------------------------------------------------------------------------------- sign-flip permutation


def _sign_patterns(n: int, n_resamples: int, seed: int, chunk: int = 2048):
    """Yields blocks of sign patterns [b, n] (+1 / -1). All 2^n when that is at most n_resamples + 1 (exact),
    else the identity followed by n_resamples random patterns. Returns (generator, total, exact)."""
    if n <= 30 and 2 ** n <= n_resamples + 1:
        total = 2 ** n

        def gen():
            bits = np.arange(n)
            for start in range(0, total, chunk):
                codes = np.arange(start, min(total, start + chunk))[:, None]
                yield np.where((codes >> bits) & 1, -1.0, 1.0)
        return gen(), total, True
    rng = np.random.default_rng([seed, 7])

    def gen():
        yield np.ones((1, n))
        left = n_resamples
        while left > 0:
            b = min(chunk, left)
            yield np.where(rng.random((b, n)) < 0.5, -1.0, 1.0)
            left -= b
    return gen(), n_resamples + 1, False


def sign_flip(d, confidence: float = 0.95, n_resamples: int = 10000, seed: int = 0, mask=None) -> dict:
    """Sign-flip permutation test of mean(d) = 0 and the interval that inverts it (module docstring).

    Args:
      d: per-prompt differences, ``[n]`` or ``[R, n]`` (R independent rows share the sign patterns).
      mask: optional boolean array like ``d``: only the True entries of a row are its data (rows of different
        sizes, padded). Enumeration is exact when ``2^n <= n_resamples + 1`` (n: the padded width).
    Returns:
      ``{"diff", "ci_low", "ci_high", "p_value", "exact"}``; arrays of shape ``[R]`` (floats for 1-D input).
      ``p_value`` is the fraction of sign patterns (the observed one included) whose |mean| is at least the
      observed one; the interval is every delta with ``p(delta) >= alpha``, so it excludes 0 exactly when
      ``p_value < alpha``. Bounds are infinite when a row is too small for any pattern to reject (n = 1).
    """
    alpha = _check_confidence(confidence, "sign_flip")
    d = np.asarray(d, np.float64)
    one = d.ndim == 1
    d2 = d[None] if one else d
    if d2.ndim != 2 or d2.shape[1] == 0:
        raise ValueError(f"sign_flip: expected [n] or [R, n] differences, got shape {d.shape}")
    w = np.ones_like(d2) if mask is None else np.asarray(mask, bool).reshape(d2.shape).astype(np.float64)
    size = w.sum(axis=1)
    if np.any(size == 0):
        raise ValueError("sign_flip: a row has no values")
    dw = d2 * w
    r, n = d2.shape
    m = dw.sum(axis=1) / size
    scale = np.maximum(np.abs(dw).max(axis=1), 1e-300)
    patterns, total, exact = _sign_patterns(n, int(n_resamples), seed)
    los, his = [], []
    for s in patterns:
        a = dw @ s.T / size[:, None]  # [R, b]: mean of the sign-flipped differences
        c = w @ s.T / size[:, None]  # [R, b]: mean of the signs
        with np.errstate(divide="ignore", invalid="ignore"):
            r1 = (m[:, None] - a) / (1.0 - c)  # where a - delta c = +(m - delta)
            r2 = (a + m[:, None]) / (1.0 + c)  # where a - delta c = -(m - delta)
        degenerate = np.abs(np.abs(c) - 1.0) < 1e-12  # all signs equal: |a - delta c| = |m - delta| for every delta
        lo, hi = np.minimum(r1, r2), np.maximum(r1, r2)
        tie = 1e-12 * scale[:, None]  # exact ties (|flipped| == |observed|) count as "at least as extreme"
        lo = np.where(np.abs(lo) < tie, 0.0, lo)
        hi = np.where(np.abs(hi) < tie, 0.0, hi)
        los.append(np.where(degenerate, -np.inf, lo))
        his.append(np.where(degenerate, np.inf, hi))
    lo, hi = np.concatenate(los, axis=1), np.concatenate(his, axis=1)  # [R, total]
    need = int(math.ceil(alpha * total - 1e-9))  # accepted where at least `need` patterns are as extreme
    if need <= 0:
        ci_lo, ci_hi = np.full(r, -np.inf), np.full(r, np.inf)
    else:
        ci_lo = np.partition(lo, need - 1, axis=1)[:, need - 1]
        ci_hi = np.partition(hi, total - need, axis=1)[:, total - need]
    p = np.sum((lo <= 0.0) & (hi >= 0.0), axis=1) / total
    out = {"diff": m, "ci_low": ci_lo, "ci_high": ci_hi, "p_value": p, "exact": exact}
    if one:
        out = {k: (float(v[0]) if isinstance(v, np.ndarray) else v) for k, v in out.items()}
    return out


def zero_spread(c: float, n: int, bounds: tuple[float, float], confidence: float = 0.95) -> dict:
    """Test and interval for n per-prompt differences that all equal ``c`` (module docstring, ``zero_spread``).

    ``bounds``: the range a difference can take (``metric_bounds``). Under a mean ``delta``, a fraction psi of
    prompts at least ``|c - delta| / (c - bound)`` must differ from c; n identical values then have probability
    at most ``(1 - psi)^n``.
    """
    alpha = _check_confidence(confidence, "zero_spread")
    lo_b, hi_b = bounds
    psi_max = 1.0 - (alpha / 2) ** (1.0 / n)  # largest share of unseen other values n identical draws allow
    lo = c - psi_max * (c - lo_b)
    hi = c + psi_max * (hi_b - c)
    if c == 0.0:
        p = 1.0
    else:
        psi = c / (c - lo_b) if c > 0 else c / (c - hi_b)
        p = float(min(1.0, 2.0 * (1.0 - psi) ** n))
    if p >= alpha:  # the same statement at delta = 0, also at the rounding edge
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    return {"diff": float(c), "ci_low": float(lo), "ci_high": float(hi), "p_value": p}


def paired_difference_rows(a, b, *, confidence: float = 0.95, n_resamples: int = 10000, seed: int = 0,
                           bounds: Optional[tuple[float, float]] = (-1.0, 1.0)) -> dict:
    """:func:`paired_difference` for R independent rows at once (``a``, ``b``: ``[R, n]``), as simulations need.

    Returns arrays ``[R]``: ``diff, ci_low, ci_high, p_value, b01, b10, sd_diff`` and ``test`` (str).
    """
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"paired_difference_rows: need two equal [R, n] arrays, got {a.shape} and {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("paired_difference_rows: contains NaN or infinite values")
    _check_confidence(confidence, "paired_difference_rows")
    d = a - b
    r, n = d.shape
    b10, b01 = np.sum(d > 0, axis=1), np.sum(d < 0, axis=1)
    out = {"diff": d.mean(axis=1), "ci_low": np.empty(r), "ci_high": np.empty(r), "p_value": np.empty(r),
           "test": np.empty(r, dtype=object), "b01": b01, "b10": b10,
           "sd_diff": d.std(axis=1, ddof=1) if n > 1 else np.zeros(r)}
    binary = (np.all((a == 0) | (a == 1), axis=1) & np.all((b == 0) | (b == 1), axis=1)
              if bounds is not None else np.zeros(r, bool))
    flat = (np.ptp(d, axis=1) == 0) & ~binary & (bounds is not None)
    rest = ~binary & ~flat
    if binary.any():
        res = paired_binary(b10[binary], b01[binary], n, confidence)
        for key in ("ci_low", "ci_high", "p_value"):
            out[key][binary] = res[key]
        out["test"][binary] = "mcnemar_midp"
    for i in np.flatnonzero(flat):
        res = zero_spread(float(d[i, 0]), n, bounds, confidence)
        for key in ("ci_low", "ci_high", "p_value"):
            out[key][i] = res[key]
        out["test"][i] = "zero_spread"
    scaled = rest & (bounds is not None)  # bounded metric: mu on the discordant prompts, scaled by psi
    plain = rest & (bounds is None)
    if scaled.any():
        dr = d[scaled]
        nz = dr != 0
        cnt = nz.sum(axis=1)
        # Left-pack each row's nonzero differences (zeros cannot move a sign-flip statistic; shifting them
        # by delta would, which is what breaks the plain inversion on zero-inflated data).
        order = np.argsort(~nz, axis=1, kind="stable")
        width = int(cnt.max())
        packed = np.take_along_axis(dr, order, axis=1)[:, :width]
        pmask = np.arange(width)[None, :] < cnt[:, None]
        res = sign_flip(packed, confidence, n_resamples, seed, mask=pmask)
        mu_lo = np.clip(res["ci_low"], bounds[0], bounds[1])
        mu_hi = np.clip(res["ci_high"], bounds[0], bounds[1])
        lo, hi = _scaled_by_discordance(mu_lo, mu_hi, res["diff"], cnt.astype(float), float(n), res["p_value"],
                                        _check_confidence(confidence, "paired_difference_rows"), confidence)
        out["ci_low"][scaled] = np.maximum(lo, bounds[0])
        out["ci_high"][scaled] = np.minimum(hi, bounds[1])
        out["p_value"][scaled] = res["p_value"]
        out["test"][scaled] = "sign_flip (exact)" if res["exact"] else "sign_flip"
    if plain.any():
        res = sign_flip(d[plain], confidence, n_resamples, seed)
        # one prompt, unbounded metric: no pattern can reject; keep the file's numbers finite
        out["ci_low"][plain] = np.maximum(res["ci_low"], -1e300)
        out["ci_high"][plain] = np.minimum(res["ci_high"], 1e300)
        out["p_value"][plain] = res["p_value"]
        out["test"][plain] = "sign_flip (exact)" if res["exact"] else "sign_flip"
    return out


def paired_difference(a, b, *, confidence: float = 0.95, n_resamples: int = 10000, seed: int = 0,
                      bounds: Optional[tuple[float, float]] = (-1.0, 1.0)) -> dict:
    """``mean(a) - mean(b)`` over paired per-prompt values with an interval and a test that agree.

    Picks ``mcnemar_midp`` for 0/1 values, ``zero_spread`` when every difference is equal (bounded metrics),
    else ``sign_flip`` (module docstring). ``bounds``: range of a difference (None: unbounded, e.g. tokens).
    Returns ``{"diff", "ci_low", "ci_high", "p_value", "test", "ci_method", "n_pairs", "b01", "b10",
    "n_discordant", "sd_diff"}`` (+ ``"p_value_exact"`` for binary data); b10 counts prompts where the model is
    higher, b01 where it is lower; ``sd_diff`` is the SD of the per-prompt differences. ``test`` names the test
    family (``mcnemar_midp``, ``sign_flip``, ``zero_spread``), ``ci_method`` the interval (``sign_flip (exact)``
    when every sign pattern was enumerated).
    """
    a, b = _paired(a, b, "paired_difference")
    r = paired_difference_rows(a[None], b[None], confidence=confidence, n_resamples=n_resamples, seed=seed,
                               bounds=bounds)
    how = str(r["test"][0])
    b10, b01 = int(r["b10"][0]), int(r["b01"][0])
    out = {"diff": float(r["diff"][0]), "ci_low": float(r["ci_low"][0]), "ci_high": float(r["ci_high"][0]),
           "p_value": float(r["p_value"][0]), "test": how.split(" ")[0], "ci_method": how,
           "n_pairs": int(a.size), "b01": b01, "b10": b10, "n_discordant": b10 + b01,
           "sd_diff": float(r["sd_diff"][0])}
    if how == "mcnemar_midp":
        out["p_value_exact"] = _two_sided_binom_half(min(b01, b10), b01 + b10)
    return out


# ------------------------------------------------------------------------------------ one model's mean


def mean_interval(values, confidence: float = 0.95, bounds: Optional[tuple[float, float]] = (0.0, 1.0)) -> dict:
    """Interval of one model's mean of per-prompt values: Wilson for 0/1 values, Student t otherwise (clipped to
    ``bounds``), and the zero-spread bound when every value is equal (never a zero-width interval for a bounded
    metric). Returns ``{"mean", "ci_low", "ci_high", "n", "ci_method"}``."""
    alpha = _check_confidence(confidence, "mean_interval")
    x = _as_1d(values, "mean_interval")
    n = int(x.size)
    if n == 0:
        raise ValueError("mean_interval: no values")
    mean = float(x.mean())
    if bounds is not None and np.all(np.isin(x, bounds)):
        z = scipy.stats.norm.ppf(1 - alpha / 2)
        phat = float(np.mean(x == bounds[1]))
        centre = (phat + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n))
        width = bounds[1] - bounds[0]
        lo, hi, how = bounds[0] + width * (centre - half), bounds[0] + width * (centre + half), "wilson"
    elif np.ptp(x) == 0.0 and bounds is not None:
        psi = 1.0 - (alpha / 2) ** (1.0 / n)
        lo, hi, how = mean - psi * (mean - bounds[0]), mean + psi * (bounds[1] - mean), "zero_spread"
    elif n == 1:
        lo, hi, how = -math.inf, math.inf, "t"
    else:
        half = scipy.stats.t.ppf(1 - alpha / 2, n - 1) * x.std(ddof=1) / math.sqrt(n)
        lo, hi, how = mean - half, mean + half, "t"
    if bounds is not None:
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
    return {"mean": mean, "ci_low": float(lo), "ci_high": float(hi), "n": n, "ci_method": how}


# ------------------------------------------------------------------------------------- simultaneous (max-T)


def max_t(dev, est, ci_low, ci_high, *, p_values=None, confidence: float = 0.95,
          bounds: Optional[Sequence[Optional[tuple[float, float]]]] = None):
    """The single-step max-T step shared by every simultaneous family (`simultaneous` over prompts,
    jaxrl.evaluation.seeds over seeds then prompts): from the bootstrap deviations ``dev`` ``[R, J, B]`` (each
    resample's estimate minus the observed one, the same resamples for all J comparisons) and each comparison's
    estimate and marginal interval ``[R, J]``, the simultaneous intervals, adjusted p-values ``[R, J]`` and the
    critical value ``[R]``."""
    alpha = _check_confidence(confidence, "max_t")
    z = float(scipy.stats.norm.ppf(1 - alpha / 2))
    dev = np.asarray(dev, np.float64)
    est, lo, hi = (np.asarray(x, np.float64).reshape(dev.shape[:2]) for x in (est, ci_low, ci_high))
    r = dev.shape[0]
    # Standardise by the bootstrap standard error (the usual max-T); a comparison without spread (every
    # difference equal) takes its marginal half-width instead, so it never divides by zero.
    se = np.sqrt(np.mean(dev ** 2, axis=2))
    fallback = np.maximum(hi - est, est - lo) / z
    se = np.where(se > 0, se, np.where(fallback > 0, fallback, np.inf))
    mx = -np.sort(-np.abs(dev / se[..., None]).max(axis=1), axis=1)  # descending maxima, [R, B]
    k = int(math.ceil(alpha * mx.shape[1])) - 1
    c = mx[:, k] if k >= 0 else np.full(r, np.inf)  # [R]
    t_obs = np.abs(est) / se
    asc = mx[:, ::-1]
    count = np.stack([mx.shape[1] - np.searchsorted(asc[i], t_obs[i], side="left") for i in range(r)])
    p_boot = np.where(t_obs > 0, count / mx.shape[1], 1.0)
    marginal = (np.where((lo > 0) | (hi < 0), 0.0, 1.0) if p_values is None
                else np.asarray(p_values, np.float64).reshape(est.shape))
    p_adj = np.maximum(p_boot, marginal)
    # The max-T interval, widened to the marginal one where that is wider (it is the better statement about a
    # single comparison): 0 is outside exactly when both the max-T and the marginal test reject.
    finite = np.isfinite(se)  # a comparison without any spread (and a zero-width interval) keeps its interval
    with np.errstate(invalid="ignore"):
        s_lo = np.where(finite, np.minimum(est - c[:, None] * se, lo), lo)
        s_hi = np.where(finite, np.maximum(est + c[:, None] * se, hi), hi)
    if bounds is not None:
        blo = np.array([-np.inf if bd is None else bd[0] for bd in bounds])
        bhi = np.array([np.inf if bd is None else bd[1] for bd in bounds])
        s_lo, s_hi = np.maximum(s_lo, blo), np.minimum(s_hi, bhi)
    # Agreement at the edge (rounding): the adjusted test decides whether 0 is inside.
    sig = p_adj < alpha
    s_lo = np.where(~sig & (est >= 0), np.minimum(s_lo, 0.0), s_lo)
    s_hi = np.where(~sig & (est <= 0), np.maximum(s_hi, 0.0), s_hi)
    return s_lo, s_hi, p_adj, c


def simultaneous(diffs, est, ci_low, ci_high, *, masks=None, p_values=None, confidence: float = 0.95,
                 n_resamples: int = 10000, seed: int = 0,
                 bounds: Optional[Sequence[Optional[tuple[float, float]]]] = None) -> dict:
    """Simultaneous intervals for a family of J comparisons (module docstring, max-T bootstrap).

    Args:
      diffs: per-prompt differences of each comparison, ``[J, U]`` over the same U prompts (the union of the
        family's prompts; ``masks[j, u]`` False where comparison j lacks prompt u). Prompts are resampled jointly.
        A leading batch dimension ``[R, J, U]`` runs R independent families with the same resamples (simulations).
      est, ci_low, ci_high: each comparison's estimate and marginal interval (``[J]`` or ``[R, J]``).
      p_values: the marginal p-values; the adjusted p-value is never below its marginal one.
      bounds: per comparison, the range of a difference (None: unbounded); the intervals are clipped to it.
    Returns:
      ``{"ci_low", "ci_high", "p_value"`` (like ``est``), ``"critical_value"`` (float, or ``[R]``),
      ``"family_size", "z"}``. A simultaneous interval excludes 0 exactly when its ``p_value < 1 - confidence``.
    """
    alpha = _check_confidence(confidence, "simultaneous")
    dm = np.asarray(diffs, np.float64)
    batched = dm.ndim == 3
    if not batched:
        dm = dm[None]
    est, lo, hi = (np.asarray(x, np.float64).reshape(dm.shape[:2]) for x in (est, ci_low, ci_high))
    r, j, u = dm.shape
    if j == 0:
        e = est if batched else est[0]
        return {"ci_low": e, "ci_high": e, "p_value": e, "critical_value": None, "family_size": 0, "z": None}
    mk = np.ones(dm.shape, bool) if masks is None else np.asarray(masks, bool).reshape(dm.shape)
    dm = np.where(mk, dm, 0.0)
    z = float(scipy.stats.norm.ppf(1 - alpha / 2))
    rng = np.random.default_rng([seed, 11])
    flat_d = dm.reshape(r * j, u)
    flat_m = mk.reshape(r * j, u).astype(np.float64)
    devs = []
    chunk = max(1, min(int(n_resamples), 2_000_000 // max(u, r * j, 1)))
    left = int(n_resamples)
    while left > 0:
        b = min(chunk, left)
        idx = rng.integers(0, u, size=(b, u))
        w = np.bincount((idx + u * np.arange(b)[:, None]).ravel(), minlength=b * u).reshape(b, u).astype(float)
        num = (flat_d @ w.T).reshape(r, j, b)
        den = (flat_m @ w.T).reshape(r, j, b)
        with np.errstate(divide="ignore", invalid="ignore"):
            devs.append(np.where(den > 0, num / den, est[..., None]) - est[..., None])
        left -= b
    dev = np.concatenate(devs, axis=2)  # [R, J, B]
    s_lo, s_hi, p_adj, c = max_t(dev, est, lo, hi, p_values=p_values, confidence=confidence, bounds=bounds)
    if not batched:
        s_lo, s_hi, p_adj, c = s_lo[0], s_hi[0], p_adj[0], float(c[0])
    return {"ci_low": s_lo, "ci_high": s_hi, "p_value": p_adj, "critical_value": c, "family_size": int(j), "z": z}


# ----------------------------------------------------------------------------------------------- compare


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
    family: bool = True,
) -> list[dict]:
    """Every non-baseline model against ``baseline``, on each metric: the ``comparisons`` of results.json.

    Args:
      models: ``{model_name: {metric: per_prompt}}`` where ``per_prompt`` maps problem_id -> value (as returned
        by ``metrics.per_prompt_values``) or is an array ``[P]`` aligned by position with the baseline's.
      baseline: key of ``models`` to compare against.
      metrics: per-prompt metrics to compare.
      n_resamples: sign-flip patterns and max-T bootstrap resamples; confidence: two-sided level; seed: seeds both.
      family: add the simultaneous intervals over all returned rows (the family of this comparison).
    Returns:
      one dict per (model, metric), models in ``models`` order: ``{"model", "baseline", "metric", "diff",
      "ci_low", "ci_high", "n_pairs", "ci_crosses_zero", "model_value", "baseline_value", "confidence",
      "method", "ci_method", "n_resamples", "p_value", "test", "p_value_test", "significant", "b01", "b10",
      "n_discordant", "sd_diff"}`` (+ ``"p_value_exact"`` on binary rows) and with ``family``:
      ``"simultaneous_ci_low", "simultaneous_ci_high", "simultaneous_p_value", "family_size",
      "significant_after_selection"``. ``diff = model - baseline``; ``significant`` is ``p_value < 1 -
      confidence``, which is exactly when the interval excludes 0 (``ci_crosses_zero`` False).
    Raises:
      KeyError naming the model / metric that is absent; ValueError naming the problem ids when a model and the
      baseline were not evaluated on the same prompts.
    """
    if baseline not in models:
        raise KeyError(f"baseline {baseline!r} is not among the models {list(models)}")
    alpha = _check_confidence(confidence, "compare")
    pairs = {}  # (model, metric) -> (a, b), in row order
    for name, vals in models.items():
        if name == baseline:
            continue
        for metric in metrics:
            for who, v in ((name, vals), (baseline, models[baseline])):
                if metric not in v:
                    raise KeyError(f"model {who!r} has no per-prompt values for metric {metric!r}")
            pairs[(name, metric)] = _aligned(vals[metric], models[baseline][metric], name, baseline, metric)
    tested = {}
    for metric in metrics:  # one vectorised call per metric: every model has the baseline's prompts
        keys = [k for k in pairs if k[1] == metric]
        if keys:
            a = np.stack([pairs[k][0] for k in keys])
            b = np.stack([pairs[k][1] for k in keys])
            r = paired_difference_rows(a, b, confidence=confidence, n_resamples=n_resamples, seed=seed,
                                       bounds=metric_bounds(metric))
            for i, k in enumerate(keys):
                tested[k] = {key: v[i] for key, v in r.items()}
    rows, diffs = [], []
    for (name, metric), (a, b) in pairs.items():
        r = tested[(name, metric)]
        how = str(r["test"])
        b10, b01 = int(r["b10"]), int(r["b01"])
        row = {"model": name, "baseline": baseline, "metric": metric, "diff": float(r["diff"]),
               "ci_low": float(r["ci_low"]), "ci_high": float(r["ci_high"]), "n_pairs": int(a.size),
               "ci_crosses_zero": bool(r["ci_low"] <= 0.0 <= r["ci_high"]),
               "model_value": float(a.mean()), "baseline_value": float(b.mean()), "confidence": confidence,
               "method": how, "ci_method": how, "n_resamples": int(n_resamples),
               "p_value": float(r["p_value"]), "test": how.split(" ")[0], "p_value_test": how.split(" ")[0],
               "significant": bool(r["p_value"] < alpha), "b01": b01, "b10": b10, "n_discordant": b01 + b10,
               "sd_diff": float(r["sd_diff"])}
        if how == "mcnemar_midp":
            row["p_value_exact"] = _two_sided_binom_half(min(b01, b10), b01 + b10)
        rows.append(row)
        diffs.append(a - b)
    if family and rows:
        add_simultaneous(rows, diffs, confidence=confidence, n_resamples=n_resamples, seed=seed)
    return rows


def add_simultaneous(rows: list[dict], diffs: Sequence[np.ndarray], *, masks=None, confidence: float = 0.95,
                     n_resamples: int = 10000, seed: int = 0) -> dict:
    """Adds ``simultaneous_ci_low/high``, ``simultaneous_p_value``, ``family_size`` and
    ``significant_after_selection`` to every row (in place; the family is all of ``rows``); returns
    :func:`simultaneous`'s summary (``critical_value``, ``family_size``, ``z``)."""
    alpha = 1.0 - confidence
    sim = simultaneous(diffs, [r["diff"] for r in rows], [r["ci_low"] for r in rows], [r["ci_high"] for r in rows],
                       masks=masks, p_values=[r["p_value"] for r in rows], confidence=confidence,
                       n_resamples=n_resamples, seed=seed, bounds=[metric_bounds(r["metric"]) for r in rows])
    for i, row in enumerate(rows):
        row["simultaneous_ci_low"] = float(sim["ci_low"][i])
        row["simultaneous_ci_high"] = float(sim["ci_high"][i])
        row["simultaneous_p_value"] = float(sim["p_value"][i])
        row["family_size"] = sim["family_size"]
        row["significant_after_selection"] = bool(sim["p_value"][i] < alpha)
    return {"critical_value": sim["critical_value"], "family_size": sim["family_size"], "z": sim["z"]}
