"""Per-model evaluation metrics from per-sample records (numpy only).

A *sample record* is one scored completion::

    {"problem_id": str, "sample_index": int, "partial": float in [0, 1], "strict": bool,
     "finish_reason": "stop" | "length", "completion_tokens": int}

``partial`` / ``strict`` may instead sit under ``"reward": {"partial", "strict"}`` as in ``rollouts.jsonl``, so a
rollouts file can be scored directly. ``finish_reason == "length"`` means the completion hit the generation cap
(truncated).

Aggregation is **per prompt first, then over prompts**: each metric is the mean over a prompt's samples, and the
reported value is the unweighted mean of those per-prompt values. A prompt with 8 samples therefore weighs as much
as a prompt with 1, and the per-prompt values are exactly what the paired bootstrap of :mod:`.stats` resamples.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

__all__ = [
    "METRICS",
    "pass_at_k",
    "pass_at_k_per_problem",
    "default_ks",
    "model_metrics",
    "per_prompt_values",
    "per_prompt_pass_at_k",
    "per_prompt_finished",
    "identical_copies",
]

# Per-prompt metrics that ``per_prompt_values`` returns and ``stats.compare`` can compare.
# (pass@1 per prompt equals strict_rate per prompt, so it needs no separate entry.)
METRICS = ("partial_reward_mean", "strict_rate", "truncation_rate", "mean_completion_tokens")


# ----------------------------------------------------------------------------------------------- pass@k


def pass_at_k_per_problem(n, c, k: int) -> np.ndarray:
    """Unbiased pass@k per problem (Chen et al. 2021): ``1 - C(n-c, k) / C(n, k)``.

    Args:
      n: samples per problem, int or int array ``[P]``.
      c: strictly correct samples per problem, same shape as ``n``, ``0 <= c <= n``.
      k: attempts, ``1 <= k <= min(n)``.
    Returns:
      float64 array ``[P]`` (``[1]`` for scalar input), each in ``[0, 1]``.

    Uses the product form ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which never forms the huge binomials.
    """
    n = np.atleast_1d(np.asarray(n))
    c = np.atleast_1d(np.asarray(c))
    if n.shape != c.shape:
        raise ValueError(f"pass_at_k: n and c shapes differ: {n.shape} vs {c.shape}")
    if n.size == 0:
        raise ValueError("pass_at_k: no problems")
    if not (np.all(n == np.round(n)) and np.all(c == np.round(c))):
        raise ValueError("pass_at_k: n and c must be integers")
    k = int(k)
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got {k}")
    if np.any(c < 0) or np.any(c > n):
        raise ValueError("pass_at_k: need 0 <= c <= n for every problem")
    if np.any(n < k):
        raise ValueError(f"pass_at_k: k={k} exceeds the samples of some problem (min n = {int(n.min())})")
    out = np.empty(n.shape, dtype=np.float64)
    for i, (ni, ci) in enumerate(zip(n.astype(np.int64).tolist(), c.astype(np.int64).tolist())):
        if ni - ci < k:
            out[i] = 1.0  # every draw of k contains a correct sample
        else:
            out[i] = 1.0 - float(np.prod(1.0 - k / np.arange(ni - ci + 1, ni + 1, dtype=np.float64)))
    return out


def pass_at_k(n, c, k: int) -> float:
    """Mean over problems of :func:`pass_at_k_per_problem` (a plain float; scalar ``n, c`` -> that problem's)."""
    return float(np.mean(pass_at_k_per_problem(n, c, k)))


def default_ks(n_min: int) -> list[int]:
    """The k values reported when samples per prompt are at least ``n_min``: powers of two <= n_min, plus n_min.

    E.g. 1 -> [1]; 8 -> [1, 2, 4, 8]; 5 -> [1, 2, 4, 5].
    """
    if n_min < 1:
        raise ValueError(f"default_ks: n_min must be >= 1, got {n_min}")
    ks = [2**i for i in range(int(math.log2(n_min)) + 1)]
    if ks[-1] != n_min:
        ks.append(n_min)
    return ks


# ----------------------------------------------------------------------------------------- sample records


def _sample(rec: Mapping, i: int) -> tuple[str, int, float, bool, bool, float]:
    """(problem_id, sample_index, partial, strict, truncated, completion_tokens) of record ``i``, validated."""
    where = f"record {i}"
    try:
        pid = str(rec["problem_id"])
        where = f"record {i} (problem_id {pid!r})"
        reward = rec["reward"] if "partial" not in rec and "reward" in rec else rec
        partial = float(reward["partial"])
        strict = reward["strict"]
        finish = rec["finish_reason"]
        tokens = float(rec["completion_tokens"])
        idx = int(rec.get("sample_index", 0))
    except KeyError as e:
        raise KeyError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: bad value: {e}") from None
    if not (0.0 <= partial <= 1.0):  # also rejects NaN
        raise ValueError(f"{where}: partial must be in [0, 1], got {partial}")
    if strict not in (True, False, 0, 1):
        raise ValueError(f"{where}: strict must be a bool, got {strict!r}")
    if not (tokens >= 0 and math.isfinite(tokens)):
        raise ValueError(f"{where}: completion_tokens must be >= 0, got {tokens}")
    return pid, idx, partial, bool(strict), finish == "length", tokens


def _group(records: Iterable[Mapping]) -> dict[str, np.ndarray]:
    """problem_id -> float array ``[n_samples_of_prompt, 4]`` of (partial, strict, truncated, tokens).

    Prompts keep the order of their first appearance. Duplicate (problem_id, sample_index) is an error: it would
    silently over-weight that sample.
    """
    rows: dict[str, list] = {}
    seen: dict[tuple[str, int], int] = {}
    for i, rec in enumerate(records):
        pid, idx, partial, strict, trunc, tokens = _sample(rec, i)
        if (pid, idx) in seen:
            raise ValueError(
                f"records {seen[(pid, idx)]} and {i}: duplicate sample (problem_id {pid!r}, sample_index {idx})"
            )
        seen[(pid, idx)] = i
        rows.setdefault(pid, []).append((partial, float(strict), float(trunc), tokens))
    if not rows:
        raise ValueError("no sample records")
    return {pid: np.asarray(r, dtype=np.float64) for pid, r in rows.items()}


def _aggregate(groups: Mapping[str, np.ndarray], ks: Optional[Sequence[int]], with_truncation: bool) -> dict:
    per_prompt = np.stack([g.mean(axis=0) for g in groups.values()])  # [P, 4] per-prompt means
    n = np.array([len(g) for g in groups.values()])
    c = np.array([int(g[:, 1].sum()) for g in groups.values()])
    ks = default_ks(int(n.min())) if ks is None else [int(k) for k in ks if int(k) <= int(n.min())]
    out = {
        "partial_reward_mean": float(per_prompt[:, 0].mean()),
        "strict_rate": float(per_prompt[:, 1].mean()),
        # str keys: the same dict before and after a JSON round trip.
        "pass_at_k": {str(k): pass_at_k(n, c, k) for k in ks},
    }
    if with_truncation:
        out["truncation_rate"] = float(per_prompt[:, 2].mean())
    out["mean_completion_tokens"] = float(per_prompt[:, 3].mean())
    out["n_prompts"] = int(len(n))
    out["n_samples"] = int(n.sum())
    return out


def model_metrics(records: Iterable[Mapping], ks: Optional[Sequence[int]] = None) -> dict:
    """Metrics of one model from its sample records (see the module docstring for the record format).

    Args:
      records: sample records, any number of samples per prompt.
      ks: pass@k values to report; default :func:`default_ks` of the smallest samples-per-prompt. Values above
        the smallest samples-per-prompt are dropped (pass@k is undefined for a prompt with fewer than k samples).
    Returns:
      ``{"partial_reward_mean", "strict_rate", "pass_at_k": {"1": ..., ...}, "truncation_rate",
      "mean_completion_tokens" (tokens), "n_prompts", "n_samples", "untruncated": {...}}`` where every mean is
      per prompt first, then over prompts. ``untruncated`` holds the same metrics (without ``truncation_rate``,
      which is 0 there by construction) over the completions with ``finish_reason != "length"`` only, with its
      own ``n_prompts`` / ``n_samples`` (prompts whose samples were all truncated drop out); its means are
      ``None`` when every completion was truncated. It is conditional on finishing, so it is not an unbiased
      estimate of the uncensored model; it shows how much the cap moves the numbers.
    """
    groups = _group(records)
    out = _aggregate(groups, ks, with_truncation=True)
    untrunc = {pid: g[g[:, 2] == 0] for pid, g in groups.items()}
    untrunc = {pid: g for pid, g in untrunc.items() if len(g)}
    if untrunc:
        out["untruncated"] = _aggregate(untrunc, ks, with_truncation=False)
    else:
        out["untruncated"] = {
            "partial_reward_mean": None,
            "strict_rate": None,
            "pass_at_k": {},
            "mean_completion_tokens": None,
            "n_prompts": 0,
            "n_samples": 0,
        }
    return out


def per_prompt_values(records: Iterable[Mapping]) -> dict[str, dict[str, float]]:
    """Per-prompt values of each metric in :data:`METRICS`: ``{metric: {problem_id: value}}``.

    The value of a prompt is the mean over its samples (strict_rate: fraction of strictly correct samples;
    truncation_rate: fraction with finish_reason "length"; mean_completion_tokens: tokens). This is the input
    ``stats.compare`` expects per model.
    """
    groups = _group(records)
    means = {pid: g.mean(axis=0) for pid, g in groups.items()}
    return {name: {pid: float(m[col]) for pid, m in means.items()} for col, name in
            zip((0, 1, 2, 3), ("partial_reward_mean", "strict_rate", "truncation_rate", "mean_completion_tokens"))}


def per_prompt_pass_at_k(records: Iterable[Mapping], ks: Optional[Sequence[int]] = None) -> dict[str, dict[str, float]]:
    """``{str(k): {problem_id: unbiased pass@k of that prompt}}`` for each k up to the smallest samples-per-prompt
    (default :func:`default_ks`); their mean is ``model_metrics(...)["pass_at_k"][str(k)]``."""
    groups = _group(records)
    ids = list(groups)
    n = np.array([len(groups[p]) for p in ids])
    c = np.array([int(groups[p][:, 1].sum()) for p in ids])
    ks = default_ks(int(n.min())) if ks is None else [int(k) for k in ks if int(k) <= int(n.min())]
    return {str(k): dict(zip(ids, pass_at_k_per_problem(n, c, k).tolist())) for k in ks}


def per_prompt_finished(records: Iterable[Mapping]) -> dict[str, dict[str, float]]:
    """Per prompt: ``finish_rate`` (share of samples that did not hit the cap) for every prompt, and the means of
    ``partial_reward_mean`` / ``strict_rate`` over the FINISHED samples for prompts that have one; plus
    ``truncated_partial`` / ``truncated_strict``, the means over the truncated samples where there are some (0 for
    the rewards of :mod:`jaxrl.rewards`, which score a truncated completion 0)."""
    groups = _group(records)
    out: dict[str, dict[str, float]] = {k: {} for k in ("finish_rate", "partial_reward_mean", "strict_rate",
                                                        "truncated_partial", "truncated_strict")}
    for pid, g in groups.items():
        done, cut = g[g[:, 2] == 0], g[g[:, 2] == 1]
        out["finish_rate"][pid] = float(len(done) / len(g))
        if len(done):
            out["partial_reward_mean"][pid] = float(done[:, 0].mean())
            out["strict_rate"][pid] = float(done[:, 1].mean())
        if len(cut):
            out["truncated_partial"][pid] = float(cut[:, 0].mean())
            out["truncated_strict"][pid] = float(cut[:, 1].mean())
    return out


def identical_copies(records: Iterable[Mapping]) -> tuple[int, int]:
    """(prompts with more than one sample whose completions are all the same text, prompts with more than one
    sample). Records without ``completion`` count as distinct. Greedy decoding makes every copy identical, and
    then n samples a prompt are one sample counted n times (pass@k and n_samples overstate the evidence)."""
    texts: dict[str, list] = {}
    for rec in records:
        texts.setdefault(str(rec["problem_id"]), []).append(rec.get("completion", object()))
    multi = [t for t in texts.values() if len(t) > 1]
    same = sum(1 for t in multi if all(isinstance(x, str) and x == t[0] for x in t))
    return same, len(multi)
