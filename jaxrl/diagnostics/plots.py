"""PNG plots for the report (matplotlib, Agg backend; nothing is shown on screen).

Every function takes the plain dicts the diagnostics return and gives PNG bytes, or None when there is nothing
to plot. Titles and legends carry the sample sizes, so a plot can be read on its own.
"""

from __future__ import annotations

import io
import math
from typing import Mapping, Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # headless, and before pyplot is imported anywhere in this process
import matplotlib.pyplot as plt  # noqa: E402

from jaxrl.diagnostics.red_flags import is_rate  # noqa: E402
from jaxrl.data.formats import TRAIN_KEYS  # noqa: E402

__all__ = ["TRAINING_PANELS", "training_panels", "training_curves", "checkpoint_curves_plot", "termination_plot",
           "pair_audit_plot", "diff_plot", "drift_plot", "to_png"]

DPI = 80

# (title, keys drawn in the panel, log y). Panels whose keys are all absent are skipped.
TRAINING_PANELS = (
    ("loss", ("loss",), False),
    ("preference accuracy", ("preference_accuracy",), False),
    ("reward margin (chosen - rejected)", ("reward_margin",), False),
    ("implicit rewards", ("chosen_rewards", "rejected_rewards"), False),
    ("policy log-probs", ("chosen_logps", "rejected_logps"), False),
    ("reward (mean ± std over the batch)", ("reward_mean",), False),
    ("KL to reference", ("kl",), False),
    ("grad / update norm", ("grad_norm", "update_norm"), True),
    ("LoRA norm", ("lora_norm",), False),
    ("skipped updates (cumulative)", ("skipped_updates",), False),
    ("learning rate", ("learning_rate",), False),
    ("entropy", ("entropy",), False),
    ("clip fraction", ("clip_fraction",), False),
    ("rollout truncation rate", ("truncation_rate",), False),
    ("zero-variance groups", ("zero_variance_groups",), False),
    ("value loss", ("value_loss",), False),
    ("explained variance", ("explained_variance",), False),
    ("staleness (policy versions)", ("rollout/staleness_mean", "rollout/staleness_max"), False),
    ("partial rollouts: samples across versions, widest span",
     ("rollout/partial_fraction", "rollout/version_span_max"), False),
    ("dropped as too stale (cumulative)", ("rollout/dropped_stale", "rollout/dropped_stale_samples"), False),
    ("idle per rollout (s): trainer waiting, producer held back", ("time/trainer_idle_s", "time/rollout_idle_s"),
     False),
    ("tokens / s", ("tokens_per_s",), False),
    ("step time (s)", ("step_time_s",), False),
)
# nonfinite / update_skipped: the red marks; reward_std: the band around reward_mean.
_NOT_PLOTTED = {"step", "nonfinite", "update_skipped", "reward_std"}


def to_png(fig) -> bytes:
    buf = io.BytesIO()
    # Every figure is laid out before it gets here (tight_layout, or fixed margins), so no bbox_inches="tight":
    # that draws the whole figure a second time to measure it (its cost: benchmarks/RESULTS.md, section
    # 'Figures formerly quoted in code comments').
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def _num(v) -> Optional[float]:
    if isinstance(v, bool) or v is None or not isinstance(v, (int, float)):
        return None
    return float(v)


def training_panels(records: Sequence[Mapping]) -> list[tuple[str, tuple[str, ...], bool]]:
    """The panels to draw for these records: the known ones present, then one per unknown numeric key."""
    present = {k for r in records for k, v in r.items() if _num(v) is not None}
    panels = [p for p in TRAINING_PANELS if any(k in present for k in p[1])]
    extra = sorted(present - set(TRAIN_KEYS) - _NOT_PLOTTED)
    return panels + [(k, (k,), False) for k in extra]


def training_curves(records: Sequence[Mapping]) -> Optional[bytes]:
    """One grid of panels (``training_panels``) over the optimizer steps; non-finite steps marked in red."""
    if not records:
        return None
    panels = training_panels(records)
    if not panels:
        return None
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.0 * rows), squeeze=False)
    steps = [r["step"] for r in records]
    bad = [r["step"] for r in records if r.get("nonfinite")]
    for ax, (title, keys, log) in zip(axes.flat, panels):
        for key in keys:
            pts = [(r["step"], _num(r.get(key))) for r in records if _num(r.get(key)) is not None]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="." if len(xs) < 60 else None, lw=1.2, label=f"{key} (n={len(xs)} steps)")
            if key == "reward_mean":
                band = [(r["step"], _num(r.get("reward_mean")), _num(r.get("reward_std"))) for r in records]
                band = [(s, m, sd) for s, m, sd in band if m is not None and sd is not None]
                if band:
                    bx, bm, bs = zip(*band)
                    ax.fill_between(bx, [m - s for m, s in zip(bm, bs)], [m + s for m, s in zip(bm, bs)],
                                    alpha=0.2)
        for s in bad:
            ax.axvline(s, color="red", alpha=0.35, lw=1)
        if log and all(_num(r.get(k)) is None or _num(r.get(k)) > 0 for r in records for k in keys):
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    # the title sits in the top 0.6 inch, which the panels leave free (a tall grid otherwise runs into it)
    height = fig.get_figheight()
    fig.suptitle(f"Training curves ({len(steps)} logged steps; red lines: non-finite updates)", fontsize=11,
                 y=1 - 0.12 / height, va="top")
    # Fixed margins in inches instead of tight_layout, which measures every tick label of every panel (slow on a
    # grid of many panels: benchmarks/RESULTS.md, section 'Figures formerly quoted in code comments'): 0.9 in
    # for y tick labels and 1.1 in between columns, 0.9 in between rows for the x label and the next title, the
    # top 0.6 in for the suptitle.
    width = fig.get_figwidth()
    axes_height = (height - 0.6 - 0.5 - 0.9 * (rows - 1)) / rows
    fig.subplots_adjust(left=0.9 / width, right=1 - 0.25 / width, bottom=0.5 / height, top=1 - 0.6 / height,
                        wspace=1.1 / ((width - 1.15 - 1.1 * (cols - 1)) / cols), hspace=0.9 / axes_height)
    return to_png(fig)


def checkpoint_curves_plot(curves: Mapping) -> Optional[bytes]:
    """Per metric: difference vs base per step with its interval (error bars), and the raw value."""
    metrics = curves.get("metrics") or {}
    if not metrics:
        return None
    names = list(metrics)
    fig, axes = plt.subplots(1, len(names), figsize=(4.6 * len(names), 3.4), squeeze=False)
    for ax, metric in zip(axes[0], names):
        pts = [p for p in metrics[metric]["points"]]
        scale = 100.0 if is_rate(metric) else 1.0
        with_ci = [p for p in pts if p["diff"] is not None]
        xs = [p["step"] for p in with_ci]
        ys = [scale * p["diff"] for p in with_ci]
        lo = [scale * (p["diff"] - p["ci_low"]) for p in with_ci]
        hi = [scale * (p["ci_high"] - p["diff"]) for p in with_ci]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, lw=1.2, label="checkpoints")
        # averaged candidates beside the steps they average: the point at the last of them, a bar over their span
        for avg in (a for a in metrics[metric].get("averages") or [] if a["diff"] is not None):
            y = scale * avg["diff"]
            line = ax.errorbar([avg["step"]], [y], yerr=[[scale * (avg["diff"] - avg["ci_low"])],
                                                         [scale * (avg["ci_high"] - avg["diff"])]],
                               marker="D" if avg.get("kind") == "mean" else "s", capsize=3, ls="none",
                               label=avg["model"])
            if len(avg["steps"]) > 1:
                ax.hlines(y, min(avg["steps"]), max(avg["steps"]), colors=line[0].get_color(), lw=2.5, alpha=0.4)
        ax.axhline(0.0, color="black", lw=0.8)
        if metrics[metric].get("averages"):
            ax.legend(fontsize=7)
        n = pts[0].get("n_prompts")
        unit = "pp" if is_rate(metric) else "tokens"
        ax.set_title(f"{metric}\nvs base ({unit}), 95% intervals, n={n} prompts", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return to_png(fig)


def termination_plot(term: Mapping) -> Optional[bytes]:
    """Reward vs completion length per model, and truncation rate per model."""
    models = term.get("models") or {}
    if not models:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    for name, m in models.items():
        bins = [b for b in m["reward_vs_length"] if b["n"]]
        if bins:
            ax1.plot([(b["lo"] + b["hi"]) / 2 for b in bins], [b["partial_mean"] for b in bins], marker="o",
                     label=f"{name} (n={m['n_samples']})")
    ax1.set_xlabel("completion tokens (bin centre)")
    ax1.set_ylabel("mean partial reward")
    ax1.set_title("reward vs completion length", fontsize=10)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    names = list(models)
    rates = [100 * models[n]["truncation_rate"] for n in names]
    ax2.bar(range(len(names)), rates, color=["tab:red" if r > 100 * term.get("threshold", 0.1) else "tab:blue"
                                               for r in rates])
    ax2.axhline(100 * term.get("threshold", 0.1), color="black", ls="--", lw=0.8)
    ax2.set_xticks(range(len(names)), [f"{n}\n(n={models[n]['n_samples']})" for n in names], fontsize=7,
                   rotation=30)
    ax2.set_ylabel("% of samples truncated")
    ax2.set_title("truncation rate per model (dashed: flag threshold)", fontsize=10)
    fig.tight_layout()
    return to_png(fig)


def pair_audit_plot(audit: Mapping) -> Optional[bytes]:
    """Histogram of chosen - rejected tokens, and margin vs length difference."""
    lb = audit.get("length_bias") or {}
    if not lb.get("n_pairs"):
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    h = lb["histogram"]
    edges, counts = h["edges"], h["counts"]
    ax1.bar(edges[:-1], counts, width=[b - a for a, b in zip(edges, edges[1:])], align="edge", alpha=0.8)
    ax1.axvline(0, color="black", lw=0.8)
    ax1.set_xlabel("chosen - rejected tokens")
    ax1.set_ylabel("pairs")
    ax1.set_title(f"length difference (n={lb['n_pairs']} pairs; chosen shorter in "
                  f"{lb['fraction_chosen_shorter']:.0%})", fontsize=10)
    pts = audit.get("points") or {}
    ax2.scatter(pts.get("length_diff", []), pts.get("margin", []), s=8, alpha=0.5)
    c = lb.get("margin_vs_length_diff", {}).get("spearman")
    ax2.set_xlabel("chosen - rejected tokens")
    ax2.set_ylabel("reward margin")
    ax2.set_title(f"margin vs length difference (Spearman {c:+.2f})" if c is not None
                  else "margin vs length difference", fontsize=10)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return to_png(fig)


def diff_plot(diff: Mapping) -> Optional[bytes]:
    """Changed samples per tag (improved / worsened) and each tag's net contribution to the mean reward."""
    s = diff["summary"]
    tags = [t for t, v in s["by_tag"].items() if v["n"]]
    if not tags:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2))
    x = range(len(tags))
    ax1.bar([i - 0.2 for i in x], [s["by_tag"][t]["improved"] for t in tags], width=0.4, label="improved",
            color="tab:green")
    ax1.bar([i + 0.2 for i in x], [s["by_tag"][t]["worsened"] for t in tags], width=0.4, label="worsened",
            color="tab:red")
    ax1.set_xticks(list(x), tags)
    ax1.set_ylabel("changed samples")
    ax1.set_title(f"{diff['model_b']} vs {diff['model_a']}: {s['n_changed']} of {s['n_compared']} samples changed",
                  fontsize=10)
    ax1.legend(fontsize=7)
    ax2.bar(list(x), [100 * s["by_tag"][t]["net_delta"] for t in tags], color="tab:purple")
    ax2.axhline(0, color="black", lw=0.8)
    ax2.set_xticks(list(x), tags)
    ax2.set_ylabel("pp of mean partial reward")
    ax2.set_title(f"net contribution per tag (total {100 * s['mean_partial_diff']:+.2f} pp)", fontsize=10)
    fig.tight_layout()
    return to_png(fig)


def drift_plot(drift: Mapping) -> Optional[bytes]:
    """KL to base per checkpoint, and the update norm per step (total and per module kind)."""
    rows = drift.get("per_step") or []
    if not rows:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    kl = [(r["step"], r["kl_to_base"]) for r in rows if r.get("kl_to_base") is not None]
    if kl:
        ax1.plot(*zip(*kl), marker="o")
        ax1.set_title(f"KL(checkpoint || base) per token (n={rows[0].get('n_tokens')} tokens, "
                      f"{rows[0].get('n_sequences')} sequences)", fontsize=9)
    else:
        ax1.set_title("KL not measured", fontsize=9)
    ax1.set_xlabel("step")
    ax1.grid(alpha=0.3)
    norms = [r for r in rows if r.get("update_norm")]
    if norms:
        ax2.plot([r["step"] for r in norms], [r["update_norm"]["total"] for r in norms], marker="o", lw=2,
                 color="black", label="total")
        kinds = sorted({k for r in norms for k in r["update_norm"]["kinds"]})
        for k in kinds[:12]:
            ax2.plot([r["step"] for r in norms], [r["update_norm"]["kinds"].get(k, 0.0) for r in norms], lw=1,
                     label=k)
        ax2.legend(fontsize=6)
    ax2.set_title("update norm ||scale·B·A||_F", fontsize=9)
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return to_png(fig)
