"""Averaged checkpoints as adapters: the exact weighted mean of several LoRA checkpoints, and its best rank-r
approximation.

    steps = average_steps(run, "last:3")                          # or "4,8,12": the steps that exist
    adapter = average_checkpoints(run, steps, weights=None)        # exact: rank sum(r_i), merged = mean of merged
    adapter = average_checkpoints(run, steps, rank=8)              # truncated SVD of that average, rank 8
    adapter.average                                                # the record written to jaxrl_export.json

**Exact.** A checkpoint i changes each adapted weight by `s_i B_i A_i` (s_i its scale). The weighted mean of those
updates, `sum_i w_i s_i B_i A_i`, is one product `B A` with `B = [w_1 s_1 B_1 | ... | w_k s_k B_k]` ([out, sum r_i])
and `A = [A_1; ...; A_k]` ([sum r_i, in]): an adapter of rank `sum r_i` (k r for one run) and scale 1 (alpha =
rank, no rsLoRA), each checkpoint's scale and weight folded into its block of B (computed in float64, stored in
fp32). Averaging A and B separately would not do: the mean of products is not the product of means.

**Truncated** (`rank=r`). The best rank-r approximation of each module's update (Eckart-Young), computed without
the dense [out, in] matrix: `B = Q_b R_b`, `A^T = Q_a R_a` (thin QR), `R_b R_a^T = U S V^T` (an SVD of a small
[sum r_i, sum r_i] core), so `B A = (Q_b U) S (Q_a V)^T`; the first r singular triplets give the factors, each
holding `sqrt(S)`. The relative residual of a module is `||B A - B_r A_r||_F / ||B A||_F = sqrt(sum_{j>r} S_j^2 /
sum_j S_j^2)`; every module's is recorded, and a warning names the worst one above RESIDUAL_WARN.

The weights are normalised to sum to 1; a weight may be 0 (the checkpoint drops out) but not negative.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np

from jaxrl.models.adapters import A_SUFFIX, B_SUFFIX, Adapter, AdapterError, adapter_steps, read_trainer_adapter

logger = logging.getLogger(__name__)

RESIDUAL_WARN = 0.1  # a module's relative residual above which a truncated average is reported as approximate
LAST = "last:"  # `last:N`: the newest N adapter checkpoints


def average_steps(checkpoint: str, spec: Sequence[str] | str) -> list[int]:
    """The steps `spec` names in the run at `checkpoint`: a list of step numbers (or their comma string), or
    `last:N`; each must be an adapter checkpoint there. ValueError naming the bad item and the steps present."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if str(s).strip()]
    available = adapter_steps(checkpoint)
    if len(items) == 1 and items[0].startswith(LAST):
        count = items[0][len(LAST):]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--average={items[0]}: expected last:N with N >= 1")
        if int(count) > len(available):
            raise ValueError(f"--average={items[0]}: {checkpoint} has only {len(available)} adapter checkpoint(s): "
                             f"{available}")
        return available[-int(count):]
    steps = []
    for item in items:
        if not item.isdigit():
            raise ValueError(f"--average: {item!r} is not a step number (expected STEP,STEP,... or last:N)")
        steps.append(int(item))
    if len(steps) < 1:
        raise ValueError("--average: no steps given (expected STEP,STEP,... or last:N)")
    if len(set(steps)) != len(steps):
        raise ValueError(f"--average: a step is listed twice: {steps}")
    missing = sorted(set(steps) - set(available))
    if missing:
        raise ValueError(f"--average: {checkpoint} has no adapter checkpoint for step(s) {missing}; present: "
                         f"{available}")
    return sorted(steps)


def normalised_weights(weights: Optional[Sequence[float]], count: int) -> list[float]:
    """`weights` (one per checkpoint, >= 0, not all 0) scaled to sum to 1; None = equal weights."""
    if weights is None or len(weights) == 0:
        return [1.0 / count] * count
    if len(weights) != count:
        raise ValueError(f"--average_weights: {len(weights)} weight(s) for {count} checkpoint(s)")
    values = [float(w) for w in weights]
    if any(not np.isfinite(w) or w < 0 for w in values) or sum(values) <= 0:
        raise ValueError(f"--average_weights: {values}: weights must be finite, >= 0 and not all 0")
    total = sum(values)
    return [w / total for w in values]


def exact_average(adapters: Sequence[Adapter], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """{factor name: fp32 array} of the exact weighted mean (module docstring): rank sum(r_i), scale 1."""
    modules = adapters[0].modules
    for adapter in adapters[1:]:
        if adapter.modules != modules:
            extra = sorted(set(adapter.modules) ^ set(modules))
            raise AdapterError(f"{adapter.source}: adapts other modules than {adapters[0].source} (e.g. {extra[0]}); "
                               "only checkpoints of one run can be averaged")
    params = {}
    for module in modules:
        a_blocks, b_blocks = [], []
        for adapter, weight in zip(adapters, weights):
            a, b = adapter.factors(module)
            a_blocks.append(a.astype(np.float64))
            b_blocks.append(b.astype(np.float64) * (weight * adapter.scale))
        params[module + A_SUFFIX] = np.concatenate(a_blocks, axis=0).astype(np.float32)
        params[module + B_SUFFIX] = np.concatenate(b_blocks, axis=1).astype(np.float32)
    return params


def truncate(b: np.ndarray, a: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(B_r [out, rank], A_r [rank, in], relative residual) of the best rank-`rank` approximation of `b @ a`, from
    QR factors and the SVD of their small core (module docstring); float64 inside, fp32 factors out. A product of
    lower rank is padded with zero rows / columns."""
    b, a = b.astype(np.float64), a.astype(np.float64)
    q_b, r_b = np.linalg.qr(b)
    q_a, r_a = np.linalg.qr(a.T)
    u, s, vt = np.linalg.svd(r_b @ r_a.T)
    keep = min(rank, s.size)
    root = np.sqrt(s[:keep])
    b_r = np.zeros((b.shape[0], rank))
    a_r = np.zeros((rank, a.shape[1]))
    b_r[:, :keep] = (q_b @ u[:, :keep]) * root
    a_r[:keep] = root[:, None] * (vt[:keep] @ q_a.T)
    total = float(np.sum(s ** 2))
    residual = float(np.sqrt(np.sum(s[keep:] ** 2) / total)) if total > 0 else 0.0
    return b_r.astype(np.float32), a_r.astype(np.float32), residual


def average_checkpoints(checkpoint: str, steps: Sequence[int], weights: Optional[Sequence[float]] = None,
                        rank: Optional[int] = None) -> Adapter:
    """The Adapter of the weighted mean of the adapter checkpoints `steps` of the run at `checkpoint` (exact, or
    truncated to `rank`); its `average` record says what it is (written to jaxrl_export.json by the exports)."""
    steps = [int(s) for s in steps]
    weights = normalised_weights(weights, len(steps))
    adapters = [read_trainer_adapter(checkpoint, step) for step in steps]
    params = exact_average(adapters, weights)
    exact_rank = sum(a.rank for a in adapters)
    record = {"kind": "mean", "steps": steps, "weights": weights, "exact_rank": exact_rank,
              "checkpoints": [{"step": a.step, "adapter_digest": a.digest(), "rank": a.rank, "scale": a.scale}
                              for a in adapters]}
    if rank is not None:
        if not 1 <= int(rank) < exact_rank:
            raise ValueError(f"--average_rank={rank}: must be in [1, {exact_rank}) (the exact average of these "
                             f"{len(steps)} checkpoints has rank {exact_rank}; leave --average_rank out for it)")
        residuals = {}
        for module in adapters[0].modules:
            b_r, a_r, residuals[module] = truncate(params[module + B_SUFFIX], params[module + A_SUFFIX], int(rank))
            params[module + A_SUFFIX], params[module + B_SUFFIX] = a_r, b_r
        worst = max(residuals, key=residuals.get)
        record["residual"] = {"max": residuals[worst], "worst_module": worst, "warn_above": RESIDUAL_WARN,
                              "modules": residuals}
        if residuals[worst] > RESIDUAL_WARN:
            logger.warning("the rank-%d average of steps %s keeps its update only approximately: relative residual "
                           "%.3g in %s (%d of %d modules above %.2g); export the exact average (no --average_rank) "
                           "or a larger rank", int(rank), steps, residuals[worst], worst,
                           sum(r > RESIDUAL_WARN for r in residuals.values()), len(residuals), RESIDUAL_WARN)
    out_rank = exact_rank if rank is None else int(rank)
    record["rank"] = out_rank
    return Adapter(params=params, rank=out_rank, alpha=float(out_rank), use_rslora=False, dropout=0.0, step=None,
                   source=f"{adapters[0].source.rsplit(' (step', 1)[0]} (average of steps {steps})",
                   model_path=adapters[0].model_path, kind="average", average=record)


def average_name(steps: Sequence[int], weights: Optional[Sequence[float]] = None, rank: Optional[int] = None) -> str:
    """The default folder (and model) name of an average: `avg_4-8-12`, `_weighted` when the weights are not equal,
    `_r8` when truncated."""
    name = "avg_" + "-".join(str(int(s)) for s in steps)
    if weights is not None and len(set(normalised_weights(weights, len(steps)))) > 1:
        name += "_weighted"
    return name + (f"_r{int(rank)}" if rank is not None else "")
