"""The sweep's outputs: comparison.md / .csv / .json (the table of jaxrl.sweep.compare) and the HTML report
(OUT/report.html): the comparison table, the mean over seeds, the chosen metric against each varied axis, failed
points with their errors, links to the points' own reports. Self-contained like the run report
(jaxrl.diagnostics.page): inline CSS, PNG plots as data URIs.

    write_comparison("runs/sweep")            # comparison.{md,csv,json} + report.html in the sweep folder
"""

from __future__ import annotations

import datetime
import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from jaxrl.diagnostics import page, plots
from jaxrl.sweep.compare import (Table, build_table, column, default_plot_metric, display_cell, display_columns,
                                 load_points, over_seeds, to_csv, to_markdown)
from jaxrl.sweep.spec import SEED
from jaxrl.utils.io import atomic_write_json, atomic_write_text

FILES = {"md": "comparison.md", "csv": "comparison.csv", "json": "comparison.json", "html": "report.html",
         "summary": "comparison_summary.md"}

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
    cols = display_columns(table)
    rows = [[page.escape(display_cell(table, r, c)) for c in cols] for r in table.rows]
    return page.table(cols, rows, left=1 + len(table.axes))


def render_sweep_html(meta: Mapping, points: Sequence, table, seeds, metric: Optional[str]) -> str:
    title = f"jaxrl sweep: {meta.get('name', '')}"
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    states: dict[str, int] = {}
    for p in points:
        states[p.state] = states.get(p.state, 0) + 1
    axes_rows = [[page.escape(a["name"]), page.escape(a["kind"]), page.escape(", ".join(a["labels"])), page.escape(", ".join(a.get("keys", [])))]
                 for a in meta["axes"]]
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{page.escape(title)}</title>"
             f"<style>{page.CSS}</style></head><body><h1>{page.escape(title)}</h1>"
             f"<p class='muted'>generated {when} from {page.escape(meta.get('sweep'))}; base config "
             f"<code>{page.escape(meta.get('base'))}</code></p>"
             f"<p>{page.escape(meta.get('description') or '')}</p>"
             f"<p>{len(points)} points: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())) + "</p>",
             "<h2 id='axes'>Axes</h2>" + page.table(["axis", "kind", "values", "config keys"], axes_rows)]
    parts.append("<h2 id='table'>Comparison</h2><p class='muted'>diff = point − its baseline point at the same "
                 "step (the <i>baseline</i> column), with a 95% paired bootstrap interval over prompts where both "
                 "points have per-sample evaluation files. Steps after @ are checkpoints (0 = the base model). "
                 "The same table: comparison.md, comparison.csv.</p>" + _html_table(table))
    if seeds is not None:
        parts.append("<h2 id='seeds'>Mean ± std over seeds</h2>" + _html_table(seeds))
    if metric:
        parts.append(f"<h2 id='plots'>{page.escape(metric)} against each axis</h2>"
                     + (page.img(axis_plot(table, meta["axes"], metric), f"{metric} vs axes")
                        or "<p class='muted'>nothing to plot (no varied axis or no values)</p>"))
    failed = [p for p in points if p.state == "failed"]
    if failed:
        parts.append("<h2 id='failed'>Failed points</h2>" + "".join(
            f"<h3>{page.escape(p.slug)}</h3><pre>{page.escape(p.status.get('error') or '')}</pre>" for p in failed))
    for n in table.notes:
        parts.append(f'<div class="flag warning"><span class="sev">note</span>{page.escape(n)}</div>')
    links = [f"<li><a href='{page.escape(p.slug)}/report.html'>{page.escape(p.slug)}</a></li>" for p in points
             if (p.dir / "report.html").is_file()]
    if links:
        parts.append("<h2 id='points'>Point reports</h2><ul>" + "".join(links) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_comparison(sweep_dir: str | os.PathLike, out: Optional[str | os.PathLike] = None, *,
                     plot_metric: Optional[str] = None, **kwargs) -> dict[str, Path]:
    """Build the table (build_table kwargs) and write comparison.md / .csv / .json and report.html into `out`
    (default: the sweep folder); returns their paths."""
    meta, points = load_points(sweep_dir)
    table = build_table(meta, points, **kwargs)
    seeds = over_seeds(table)
    out = Path(out) if out else Path(sweep_dir)
    plot_metric = plot_metric or default_plot_metric(table)
    if plot_metric is not None:
        column(table, plot_metric)
    head = (f"# Sweep {meta.get('name', '')}: {len(table.rows)} point(s)\n\n"
            f"Base config `{meta.get('base')}`; axes: {', '.join(table.axes) or '(none)'}; baseline: "
            f"{kwargs.get('baseline') or meta.get('baseline') or 'first value of each axis'} (each point's "
            "baseline is in the `baseline` column). `diff` = point - baseline at the same step, with a 95% paired "
            "interval over prompts where per-sample files exist (it agrees with the test whose p-value is in the "
            "`p:` column of comparison.csv); `*` = still significant after choosing among every such cell of the "
            "table (simultaneous intervals `sim_low:` / `sim_high:`). Sorting by diff picks the largest of many "
            "noisy numbers: read the `*` and the selection-adjusted gains in the notes.\n\n")
    md = head + to_markdown(table, "Points")
    if seeds is not None:
        md += ("\n" + to_markdown(seeds, "Mean ± std over seeds")
               + "\nIn this table a diff's interval is the recipe's: seeds, then prompts, resampled.\n")
    notes = table.notes + (seeds.notes if seeds is not None else [])
    if notes:
        md += "\n## Notes\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    paths = {"md": atomic_write_text(out / FILES["md"], md),
             "summary": atomic_write_text(out / FILES["summary"], summary_markdown(table, seeds, points)),
             "csv": atomic_write_text(out / FILES["csv"], to_csv(table))}
    if seeds is not None:
        paths["csv_seeds"] = atomic_write_text(out / "comparison_seeds.csv", to_csv(seeds))
    paths["json"] = atomic_write_json(out / FILES["json"], _jsonable_table(meta, table, seeds))
    paths["html"] = atomic_write_text(out / FILES["html"], render_sweep_html(meta, points, table, seeds,
                                                                             plot_metric))
    return paths


def summary_markdown(table: Table, seeds: Optional[Table], points: Sequence = ()) -> str:
    """The verdict in a few columns (what launchers.sweep prints at its end): per recipe (over seeds when the sweep
    has seeds, else per point) the evaluation metrics at each evaluated step and their difference to the baseline
    with its interval and its simultaneous interval (`*` where it survives the choice among all of them), the
    evaluations' sample sizes (from the points' results.json); then the notes."""
    # over seeds when some recipe has several (one seed each: the points' own paired intervals say more)
    by_seeds = seeds is not None and any("," in str(r.get("seeds") or "") for r in seeds.rows)
    t = seeds if by_seeds else table
    cells = [f"{m}@{st}" for st in t.steps for m in t.metrics]
    keep = set(t.axes) | {"seeds"} | set(cells) | {f"{p}:{c}" for c in cells for p in (
        "diff", "ci_low", "ci_high", "sim_low", "sim_high", "n_seeds")} | {f"std:{c}" for c in cells}
    if not cells:  # no evaluation: the training summary's last-k means
        keep |= {c for c in t.columns if c.endswith(tuple(f"_last{k}" for k in range(1, 100)))}
    # a difference that is 0 by construction in every row (the same base model at step 0) says nothing
    zero = {c for c in t.columns if c.startswith("diff:") and all(r.get(c) in (0.0, None) for r in t.rows)}
    columns, rows = [], [dict(r) for r in t.rows]
    for c in t.columns:
        if c not in keep or c in zero:
            continue
        columns.append(c)
        if c.startswith("diff:") and any(r.get(f"sim_low:{c[5:]}") is not None for r in rows):
            columns.append(f"simultaneous:{c[5:]}")  # shown beside the marginal one: it survives the choice
            for r in rows:
                lo, hi = r.get(f"sim_low:{c[5:]}"), r.get(f"sim_high:{c[5:]}")
                r[f"simultaneous:{c[5:]}"] = None if lo is None else f"[{lo:+.4g}, {hi:+.4g}]"
    small = Table(columns, rows, t.axes, t.metrics, t.steps, [], t.baseline)
    title = "Mean ± std over seeds" if by_seeds else "Points"
    sizes = sorted({(m["n_prompts"], m["n_samples"]) for p in points for m in ((p.results or {}).get("models") or
                                                                                 {}).values() if "n_prompts" in m})
    size = ("Each evaluation: " + "; ".join(f"{a} prompts, {b} samples" for a, b in sizes) + ".\n\n") if sizes else ""
    notes = table.notes + (seeds.notes if seeds is not None else [])
    return (to_markdown(small, title) + "\n" + size
            + ("\n".join(f"- {n}" for n in notes) + "\n" if notes else ""))


def _jsonable_table(meta, table: Table, seeds: Optional[Table]) -> dict:
    clean = lambda rows: [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)  # noqa: E731
                           for k, v in r.items()} for r in rows]
    return {"sweep": meta.get("sweep"), "name": meta.get("name"), "axes": table.axes, "metrics": table.metrics,
            "steps": table.steps, "baseline": table.baseline if table.baseline is not None else meta.get("baseline"),
            "columns": table.columns, "rows": clean(table.rows), "notes": table.notes,
            "over_seeds": None if seeds is None else {"columns": seeds.columns, "rows": clean(seeds.rows)}}
