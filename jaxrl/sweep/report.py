"""The sweep's HTML report (OUT/report.html): the comparison table, the mean over seeds, the chosen metric against
each varied axis, failed points with their errors, links to the points' own reports. Self-contained like the run
report (jaxrl.diagnostics.report, whose CSS and table helpers it uses): inline CSS, PNG plots as data URIs."""

from __future__ import annotations

import datetime
import math
from typing import Any, Mapping, Optional, Sequence

from jaxrl.diagnostics import plots
from jaxrl.diagnostics.report import _CSS, _e, _img, _table
from jaxrl.sweep.spec import SEED

plt = plots.plt  # matplotlib with the Agg backend (set by jaxrl.diagnostics.plots)


def _as_number(v: Any) -> Optional[float]:
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def axis_plot(table, axes_meta: Sequence[Mapping], metric: str) -> Optional[bytes]:
    """One panel per varied axis: `metric` of every point against the axis value; one series per combination
    of the other non-seed axes (seeds are the dots of a series, its line joins their means)."""
    varied = [a for a in axes_meta if a["name"] != SEED and len(a["labels"]) > 1]
    if not varied or not any(v is not None for v in table.numeric(metric)):
        return None
    fig, axs = plt.subplots(1, len(varied), figsize=(5.2 * len(varied), 3.8), squeeze=False)
    for ax, a in zip(axs[0], varied):
        name, labels = a["name"], list(a["labels"])
        xs_num = [_as_number(v) for v in a.get("values", labels)]
        numeric = all(x is not None for x in xs_num) and len(set(xs_num)) == len(xs_num)
        pos = {lab: (xs_num[i] if numeric else i) for i, lab in enumerate(labels)}
        others = [o["name"] for o in axes_meta if o["name"] not in (name, SEED)]
        series: dict[tuple, dict] = {}
        for r in table.rows:
            y = _as_number(r.get(metric))
            if y is None or r.get(name) not in pos:
                continue
            series.setdefault(tuple(r.get(o) for o in others), {}).setdefault(r[name], []).append(y)
        for key, by_x in series.items():
            xs = sorted(by_x, key=lambda lab: pos[lab])
            label = ", ".join(f"{o}={v}" for o, v in zip(others, key)) or "all"
            means = [sum(by_x[x]) / len(by_x[x]) for x in xs]
            line, = ax.plot([pos[x] for x in xs], means, marker="o", lw=1.4,
                            label=f"{label} (n={sum(len(v) for v in by_x.values())})")
            for x in xs:
                if len(by_x[x]) > 1:
                    ax.scatter([pos[x]] * len(by_x[x]), by_x[x], s=14, alpha=0.5, color=line.get_color())
        if numeric:
            pos_vals = [v for v in xs_num if v > 0]
            if len(pos_vals) == len(xs_num) and max(xs_num) / min(xs_num) >= 50:
                ax.set_xscale("log")
            ax.set_xticks(xs_num, labels, fontsize=7, rotation=30)
        else:
            ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30)
        ax.set_xlabel(name)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} vs {name}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("dots: seeds; lines: their mean" if any(a["name"] == SEED for a in axes_meta) else "",
                 fontsize=9)
    fig.tight_layout()
    return plots.to_png(fig)


def _html_table(table) -> str:
    from jaxrl.sweep.compare import display_cell, display_columns
    cols = display_columns(table)
    rows = [[_e(display_cell(table, r, c)) for c in cols] for r in table.rows]
    return _table(cols, rows, left=1 + len(table.axes))


def render_sweep_html(meta: Mapping, points: Sequence, table, seeds, metric: Optional[str]) -> str:
    title = f"jaxrl sweep: {meta.get('name', '')}"
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    states: dict[str, int] = {}
    for p in points:
        states[p.state] = states.get(p.state, 0) + 1
    axes_rows = [[_e(a["name"]), _e(a["kind"]), _e(", ".join(a["labels"])), _e(", ".join(a.get("keys", [])))]
                 for a in meta["axes"]]
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>"
             f"<p class='muted'>generated {when} from {_e(meta.get('sweep'))}; base config "
             f"<code>{_e(meta.get('base'))}</code></p>"
             f"<p>{_e(meta.get('description') or '')}</p>"
             f"<p>{len(points)} points: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())) + "</p>",
             "<h2 id='axes'>Axes</h2>" + _table(["axis", "kind", "values", "config keys"], axes_rows)]
    parts.append("<h2 id='table'>Comparison</h2><p class='muted'>diff = point − its baseline point at the same "
                 "step (the <i>baseline</i> column), with a 95% paired bootstrap interval over prompts where both "
                 "points have per-sample evaluation files. Steps after @ are checkpoints (0 = the base model). "
                 "The same table: comparison.md, comparison.csv.</p>" + _html_table(table))
    if seeds is not None:
        parts.append("<h2 id='seeds'>Mean ± std over seeds</h2>" + _html_table(seeds))
    if metric:
        parts.append(f"<h2 id='plots'>{_e(metric)} against each axis</h2>"
                     + (_img(axis_plot(table, meta["axes"], metric), f"{metric} vs axes")
                        or "<p class='muted'>nothing to plot (no varied axis or no values)</p>"))
    failed = [p for p in points if p.state == "failed"]
    if failed:
        parts.append("<h2 id='failed'>Failed points</h2>" + "".join(
            f"<h3>{_e(p.slug)}</h3><pre>{_e(p.status.get('error') or '')}</pre>" for p in failed))
    for n in table.notes:
        parts.append(f'<div class="flag warning"><span class="sev">note</span>{_e(n)}</div>')
    links = [f"<li><a href='{_e(p.slug)}/report.html'>{_e(p.slug)}</a></li>" for p in points
             if (p.dir / "report.html").is_file()]
    if links:
        parts.append("<h2 id='points'>Point reports</h2><ul>" + "".join(links) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)
