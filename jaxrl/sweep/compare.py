"""The comparison table of a sweep: one row per point with its training summary, its evaluation results at each
checkpoint and each difference to the baseline point with a paired interval; sortable and filterable by any
column; written as Markdown, CSV and JSON, and as an HTML report with the metric plotted against each axis.

    table = build_table(load_points("runs/sweep"), baseline="dpo.beta=0.1", sort="-eval_preference_accuracy@4")
    to_markdown(table), to_csv(table)         # jaxrl.sweep.report.write_comparison writes them all + report.html

Columns (names are what --sort / --filter take):

    point, <one per axis>, state, baseline            the point's slug, its axis labels, status, its baseline
    final_step, loss, loss_last<k>, preference_accuracy, preference_accuracy_last<k>, reward_mean,
    reward_mean_last<k>, kl, skipped_updates, train_time_s, eval_time_s
                                                      from metrics.jsonl (the last training step; the mean of
                                                      the last k) and status.json (wall seconds, all attempts)
    <metric>@<step>                                   evaluation at checkpoint <step> (0 = the base model):
                                                      `eval_*` keys the trainer logged at its checkpoints (DPO
                                                      held-out pairs) and eval/results.json metrics
                                                      (partial_reward_mean, strict_rate, ...)
    diff:<metric>@<step>, ci_low:..., ci_high:...     point - its baseline at the same step; the interval is the
                                                      paired one over prompts (jaxrl.evaluation.stats: it agrees
                                                      with the test whose p-value is p:...) when both points
                                                      have per-sample files of that checkpoint
                                                      (eval/samples/step_<N>.jsonl) on the same prompts, else
                                                      empty (held-out DPO metrics come without per-pair values)
    p:..., sim_low:..., sim_high:..., sim_p:...       the p-value, and the simultaneous interval over EVERY diff
                                                      cell of the table that has one (max-T bootstrap, prompts
                                                      resampled jointly): sorting a grid by diff and taking the top
                                                      row is a selection among all of them; a cell is significant
                                                      after that selection when sim_low..sim_high excludes 0
                                                      (marked * in the Markdown / HTML)

Step 0 is the base model: where both points evaluated the same base weights (equal fingerprints) its difference
is 0 by construction, not an estimate, and it is left out of the family.

Over seeds (``over_seeds``): the mean and SD of every column over a recipe's seeds, and for each diff cell the
recipe-level interval of jaxrl.evaluation.seeds (seeds, then prompts, resampled), with ``n_seeds``. A cell is
averaged only when every seed of the recipe has it: a point whose record of that checkpoint is missing (a run
killed before writing it) leaves the cell empty, and the notes say which point lacks what -- never a mean over
fewer seeds than the recipe has. ``build_table`` notes such incomplete points too (column ``incomplete``).

The baseline: a point slug, or a selector {axis: value} ("dpo.beta=0.1,dpo.loss_type=sigmoid"; short names
such as `beta` work when unambiguous). A selector that leaves some axes open pairs each point with the baseline
point that shares its other labels -- typically the same seed, so seed-to-seed noise cancels. Default: the
sweep's `baseline`, else the first value of every axis except the seed.
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import io
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from jaxrl.data.formats import (BASE_MODEL, CONFIG_FILE, EVAL_DIR, checkpoint_name, model_step, read_results,
                                read_samples, samples_path)
from jaxrl.evaluation.metrics import per_prompt_values
from jaxrl.evaluation.seeds import seeds_then_prompts, seeds_then_prompts_family
from jaxrl.evaluation.selection import selection_summary
from jaxrl.evaluation.stats import compare, simultaneous
from jaxrl.sweep.flags import DEFAULT_METRICS, CompareSettings
from jaxrl.sweep.runner import STATUS_FILE, SWEEP_FILE, merged_metrics, read_json
from jaxrl.sweep.spec import SEED, fmt, short_key

RESULTS_METRICS = ("partial_reward_mean", "strict_rate", "truncation_rate", "mean_completion_tokens")


@dataclasses.dataclass
class PointData:
    slug: str
    name: str
    labels: dict
    values: dict
    state: str
    status: dict
    config: dict
    records: list  # metrics.jsonl, one merged record per step
    results: Optional[dict]  # eval/results.json
    dir: Path


def load_points(sweep_dir: str | os.PathLike) -> tuple[dict, list[PointData]]:
    """(sweep.json, every point's files) of a sweep folder."""
    root = Path(sweep_dir)
    meta = read_json(root / SWEEP_FILE)
    if meta is None:
        raise FileNotFoundError(f"{root / SWEEP_FILE} not found: is {root} a sweep folder (launchers.sweep --out)?")
    points = []
    for p in meta["points"]:
        d = root / p["slug"]
        status = read_json(d / STATUS_FILE) or {"state": "new"}
        results = None
        if (d / EVAL_DIR / "results.json").is_file():
            results = read_results(d / EVAL_DIR)
        points.append(PointData(p["slug"], p["name"], p["labels"], p.get("values", {}), status.get("state", "new"),
                                status, read_json(d / CONFIG_FILE) or {}, merged_metrics(d / "metrics.jsonl"),
                                results, d))
    return meta, points


# ----------------------------------------------------------------------------------------------- summaries


def _num(v) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _first(rec: Mapping, keys: Sequence[str]):
    return next((rec[k] for k in keys if _num(rec.get(k)) is not None), None)


def training_summary(records: Sequence[Mapping], status: Mapping, last_k: int = CompareSettings.last_k) -> dict:
    """The training columns of one point (module docstring); None where the run logged no such metric."""
    train = [r for r in records if "loss" in r or "grad_norm" in r]
    out: dict[str, Any] = {"final_step": train[-1]["step"] if train else None}
    aliases = {"loss": ("loss",), "preference_accuracy": ("preference_accuracy",),
               "reward_mean": ("reward_mean", "reward/mean"), "kl": ("kl", "rollout/kl_ref")}
    for col, keys in aliases.items():
        out[col] = _first(train[-1], keys) if train else None
        if col != "kl":
            tail = [_first(r, keys) for r in train[-last_k:]]
            tail = [v for v in tail if v is not None]
            out[f"{col}_last{last_k}"] = sum(tail) / len(tail) if tail else None
    out["skipped_updates"] = train[-1].get("skipped_updates") if train else None
    out["train_time_s"] = status.get("train_seconds")
    out["eval_time_s"] = status.get("eval_seconds")
    return out


def checkpoint_evals(point: PointData) -> dict[int, dict[str, float]]:
    """{step: {metric: value}}: the trainer's `eval_*` records and eval/results.json models (base = step 0)."""
    out: dict[int, dict[str, float]] = {}
    for r in point.records:
        vals = {k: float(v) for k, v in r.items() if k.startswith("eval_") and _num(v) is not None}
        if vals:
            out.setdefault(int(r["step"]), {}).update(vals)
    if point.results:
        for name, entry in point.results["models"].items():
            step = model_step(name, entry)
            if step is None:
                continue
            out.setdefault(step, {}).update({m: float(entry[m]) for m in RESULTS_METRICS
                                             if _num(entry.get(m)) is not None})
    return out


def _samples(point: PointData, step: int):
    path = samples_path(point.dir / EVAL_DIR, BASE_MODEL if step == 0 else checkpoint_name(step))
    return read_samples(path) if path.is_file() else None


# ----------------------------------------------------------------------------------------------- baseline


def _resolve_axis(key: str, axes: Sequence[Mapping]) -> str:
    names = [a["name"] for a in axes]
    if key in names:
        return key
    by_short = [a["name"] for a in axes if short_key(a["name"]) == key or key in a.get("keys", [])]
    if len(by_short) == 1:
        return by_short[0]
    raise KeyError(f"baseline selector key {key!r} is not an axis of this sweep (axes: {', '.join(names)})"
                   + (f"; it matches several: {by_short}" if by_short else ""))


def parse_selector(selector: Any, axes: Sequence[Mapping]) -> dict[str, str]:
    """{axis name: label} from a dict or 'k=v,k2=v2' (values compared as labels: fmt(value))."""
    if isinstance(selector, str):
        items = {}
        for part in (s.strip() for s in selector.split(",")):
            if part:
                k, sep, v = part.partition("=")
                if not sep:
                    raise ValueError(f"baseline {selector!r}: expected a point slug or axis=value[,axis=value]")
                items[k.strip()] = v.strip()
        selector = items
    out = {}
    for k, v in selector.items():
        axis = _resolve_axis(str(k), axes)
        label = v if isinstance(v, str) else fmt(v)
        labels = next(a["labels"] for a in axes if a["name"] == axis)
        if label not in labels:
            # the same number written differently ("1e-6" for 1e-06): compare as floats
            match = [lab for lab in labels if _float(lab) is not None and _float(lab) == _float(label)]
            if len(match) != 1:
                raise KeyError(f"baseline {axis}={label!r}: the axis has values {labels}")
            label = match[0]
        out[axis] = label
    return out


def _float(s) -> Optional[float]:
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def baseline_partners(meta: Mapping, points: Sequence[PointData], baseline: Any = None) -> dict[str, Optional[str]]:
    """{point slug: its baseline point's slug (None: that point is not in the sweep)} (module docstring)."""
    axes = meta["axes"]
    if baseline is None:
        baseline = meta.get("baseline")
    if isinstance(baseline, str):
        exact = [p for p in points if p.slug == baseline]
        if not exact and "=" not in baseline:
            exact = [p for p in points if p.slug.endswith(baseline) or p.slug.startswith(baseline)]
            if len(exact) != 1:
                raise KeyError(f"baseline {baseline!r} names no single point; points: "
                               f"{', '.join(p.slug for p in points)}")
        if exact:
            return {p.slug: exact[0].slug for p in points}
    if baseline is None:
        selector = {a["name"]: a["labels"][0] for a in axes if a["name"] != SEED}
    else:
        selector = parse_selector(baseline, axes)
    by_labels = {tuple(sorted(p.labels.items())): p.slug for p in points}
    return {p.slug: by_labels.get(tuple(sorted({**p.labels, **selector}.items()))) for p in points}


# ----------------------------------------------------------------------------------------------- the table


@dataclasses.dataclass
class Table:
    columns: list[str]
    rows: list[dict]
    axes: list[str]
    metrics: list[str]
    steps: list[int]
    notes: list[str]
    baseline: Any
    per_prompt: dict = dataclasses.field(default_factory=dict)  # (point, "metric@step") -> {prompt: diff}

    def numeric(self, col: str) -> list[Optional[float]]:
        return [_num(r.get(col)) for r in self.rows]


def _metric_steps(evals: Mapping[str, Mapping[int, Mapping]], metrics: Sequence[str]) -> list[int]:
    return sorted({s for e in evals.values() for s, vals in e.items() if any(m in vals for m in metrics)})


def build_table(meta: Mapping, points: Sequence[PointData], *, baseline: Any = None,
                metrics: Optional[Sequence[str]] = None, steps: Optional[Sequence[int]] = None,
                last_k: int = CompareSettings.last_k, sort: Optional[str] = None, filters: Sequence[str] = (),
                n_resamples: int = CompareSettings.n_resamples, confidence: float = CompareSettings.confidence,
                seed: int = CompareSettings.seed) -> Table:
    axes = [a["name"] for a in meta["axes"]]
    evals = {p.slug: checkpoint_evals(p) for p in points}
    present = {m for e in evals.values() for vals in e.values() for m in vals}
    if metrics is None:
        metrics = [m for m in DEFAULT_METRICS if m in present]
    else:
        missing = [m for m in metrics if m not in present]
        if missing and points and any(evals.values()):
            raise KeyError(f"metric(s) {missing} are in no point's evaluation; available: {sorted(present)}")
    all_steps = _metric_steps(evals, metrics)
    steps = [s for s in all_steps if not steps or s in set(steps)]
    partners = baseline_partners(meta, points, baseline)
    by_slug = {p.slug: p for p in points}
    notes: list[str] = []
    rows = []
    sample_cache: dict = {}

    def samples(p, s):
        if (p.slug, s) not in sample_cache:
            sample_cache[(p.slug, s)] = _samples(p, s)
        return sample_cache[(p.slug, s)]

    family: list[tuple[dict, str, dict, dict]] = []  # (row, cell, {prompt: diff}, comparison row)
    for p in points:
        row: dict[str, Any] = {"point": p.slug, **{a: p.labels.get(a) for a in axes}, "state": p.state,
                               "baseline": partners.get(p.slug)}
        row.update(training_summary(p.records, p.status, last_k))
        partner = by_slug.get(partners.get(p.slug) or "")
        for s in steps:
            for m in metrics:
                v = evals[p.slug].get(s, {}).get(m)
                row[f"{m}@{s}"] = v
                b = evals[partner.slug].get(s, {}).get(m) if partner else None
                cell = f"{m}@{s}"
                row[f"diff:{cell}"] = v - b if v is not None and b is not None else None
                for key in ("ci_low", "ci_high", "p", "sim_low", "sim_high", "sim_p"):
                    row[f"{key}:{cell}"] = None
                if partner is None or partner is p or v is None or b is None or m not in RESULTS_METRICS:
                    continue
                if s == 0 and _same_base(p, partner):  # the same base weights: 0 by construction
                    row[f"diff:{cell}"] = 0.0
                    row[f"ci_low:{cell}"] = row[f"ci_high:{cell}"] = 0.0
                    continue
                mine, theirs = samples(p, s), samples(partner, s)
                if not mine or not theirs:
                    continue
                mine_pp, theirs_pp = per_prompt_values(mine), per_prompt_values(theirs)
                try:
                    comp = compare({"point": mine_pp, "baseline": theirs_pp}, "baseline", [m],
                                   n_resamples=n_resamples, confidence=confidence, seed=seed, family=False)[0]
                except ValueError as e:  # not the same prompts: no paired interval, say why
                    notes.append(f"{p.slug} vs {partner.slug} at step {s}: {e}")
                    continue
                row[f"diff:{cell}"] = comp["diff"]
                row[f"ci_low:{cell}"], row[f"ci_high:{cell}"] = comp["ci_low"], comp["ci_high"]
                row[f"p:{cell}"] = comp["p_value"]
                family.append((row, cell, {i: mine_pp[m][i] - theirs_pp[m][i] for i in theirs_pp[m]}, comp))
        missing = [f"{m}@{s}" for s in steps for m in metrics if row.get(f"{m}@{s}") is None
                   and s <= (row.get("final_step") or 0) and any(evals[q.slug].get(s, {}).get(m) is not None
                                                                 for q in points if q is not p)]
        row["incomplete"] = ", ".join(missing) or None
        if missing:
            notes.append(f"{p.slug} lacks {row['incomplete']} that other points have (a record missing: resume the "
                         "point to write it); it is left out of every comparison of those cells")
        rows.append(row)
    if family:
        _simultaneous_cells(family, confidence=confidence, n_resamples=n_resamples, seed=seed)
        notes.append(f"{len(family)} differences with a paired interval: the simultaneous intervals (sim_low / "
                     f"sim_high) hold for all {len(family)} at once; * marks the cells still significant after "
                     "choosing among them (sorting by diff and reading the top row is such a choice).")
        notes += _best_cells_cross_fit(family, confidence=confidence, n_resamples=n_resamples, seed=seed)
    columns = list(rows[0]) if rows else ["point", *axes, "state", "baseline"]
    table = Table(columns, rows, axes, list(metrics), steps, notes, baseline,
                  per_prompt={(r["point"], cell): d for r, cell, d, _ in family})
    parsed = [parse_filter(table, f) for f in filters]  # every filter checked, also when there are no rows
    before = len(table.rows)
    for f in parsed:
        table.rows = [r for r in table.rows if _match(f, r)]
    if before and not table.rows:
        raise ValueError(f"--filter {' '.join(repr(f) for f in filters)} keeps none of the {before} points (nothing "
                         "written); check the column names and values in comparison.csv")
    if sort:
        sort_rows(table, sort)
    return table


def _same_base(a: PointData, b: PointData) -> bool:
    """Both points evaluated bit-identical base weights (results.json fingerprints)."""
    fa = ((a.results or {}).get("models") or {}).get("base", {}).get("fingerprint")
    fb = ((b.results or {}).get("models") or {}).get("base", {}).get("fingerprint")
    return fa is not None and fa == fb


def _simultaneous_cells(family, *, confidence: float, n_resamples: int, seed: int) -> None:
    """Adds sim_low / sim_high / sim_p to every cell of the family (max-T over all of them, prompts resampled
    jointly over the union of their prompt ids)."""
    ids = sorted({i for _, _, d, _ in family for i in d})
    pos = {i: k for k, i in enumerate(ids)}
    diffs = np.zeros((len(family), len(ids)))
    masks = np.zeros((len(family), len(ids)), bool)
    for j, (_, _, d, _) in enumerate(family):
        for i, v in d.items():
            diffs[j, pos[i]] = v
            masks[j, pos[i]] = True
    comps = [c for _, _, _, c in family]
    sim = simultaneous(diffs, [c["diff"] for c in comps], [c["ci_low"] for c in comps],
                       [c["ci_high"] for c in comps], masks=masks, p_values=[c["p_value"] for c in comps],
                       confidence=confidence, n_resamples=n_resamples, seed=seed, bounds=[(-1.0, 1.0)] * len(comps))
    for j, (row, cell, _, _) in enumerate(family):
        row[f"sim_low:{cell}"] = float(sim["ci_low"][j])
        row[f"sim_high:{cell}"] = float(sim["ci_high"][j])
        row[f"sim_p:{cell}"] = float(sim["p_value"][j])


def _best_cells_cross_fit(family, *, confidence: float, n_resamples: int, seed: int) -> list[str]:
    """Per metric@step cell: the naive best point's diff beside its cross-fitted gain (points on the same prompts)."""
    notes = []
    by_cell: dict[str, list] = {}
    for row, cell, d, comp in family:
        by_cell.setdefault(cell, []).append((row["point"], d, comp))
    for cell, members in by_cell.items():
        ids = list(members[0][1])
        if len(members) < 2 or any(set(d) != set(ids) for _, d, _ in members):
            continue
        metric = cell.rsplit("@", 1)[0]
        per_prompt = {"__baseline__": {metric: {i: 0.0 for i in ids}}}
        per_prompt.update({slug: {metric: d} for slug, d, _ in members})
        rows = [{**comp, "model": slug, "metric": metric} for slug, _, comp in members]
        sel = selection_summary(per_prompt, "__baseline__", metric, rows=rows, confidence=confidence,
                                n_resamples=n_resamples, seed=seed)
        if sel is None:
            continue
        nv, cf = sel["naive"], sel["cross_fit"]
        notes.append(f"{cell}: the best of {len(members)} points by diff is {nv['model']} ({nv['diff']:+.4g}); "
                     f"selection-adjusted (chosen on one half of the prompts, measured on the other): "
                     f"{cf['diff']:+.4g} [{cf['ci_low']:+.4g}, {cf['ci_high']:+.4g}] over {cf['n_pairs']} prompts.")
    return notes


_OPS = (">=", "<=", "!=", "==", ">", "<", "~")


def column(table: Table, name: str) -> str:
    if name in table.columns:
        return name
    close = difflib.get_close_matches(name, table.columns, n=4, cutoff=0.5)
    raise KeyError(f"no column {name!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
                   + f" (columns: {', '.join(table.columns)})")


def parse_filter(table: Table, expr: str) -> tuple[str, str, str]:
    """(column, operator, value) of `COLUMN OP VALUE`; ValueError / KeyError (naming the nearest column) when the
    expression is malformed, a comparison's value is not a number, or the value starts with an operator sign (a
    mistyped operator such as `===` or `=>`, which would otherwise match no row)."""
    m = re.match(r"^\s*(.+?)\s*(>=|<=|!=|==|>|<|~)\s*(.*?)\s*$", expr)
    usage = f"expected COLUMN OP VALUE with OP one of {' '.join(_OPS)} (~ = contains)"
    if not m:
        raise ValueError(f"filter {expr!r}: {usage}")
    col, op, want = column(table, m.group(1)), m.group(2), m.group(3)
    if want[:1] in ("=", "<", ">", "!", "~"):
        raise ValueError(f"filter {expr!r}: the value {want!r} starts with an operator sign; {usage}")
    if op in (">=", "<=", ">", "<") and _float(want) is None:
        raise ValueError(f"filter {expr!r}: {op} compares numbers, and {want!r} is not one")
    return col, op, want


def _match(parsed: tuple[str, str, str], row: Mapping) -> bool:
    col, op, want = parsed
    have = row.get(col)
    if op == "~":
        return have is not None and want in str(have)
    a, b = _float(have), _float(want)
    if a is None or b is None:  # text: equality only
        if op in ("==", "!="):
            return (str(have) == want) == (op == "==")
        return False
    return {">=": a >= b, "<=": a <= b, "!=": a != b, "==": a == b, ">": a > b, "<": a < b}[op]


def sort_rows(table: Table, key: str) -> None:
    desc = key.startswith("-")
    col = column(table, key.lstrip("-+"))

    def k(r):
        v = r.get(col)
        f = _float(v)
        missing = v is None
        return (missing, 0, -f if desc else f, "") if f is not None else (missing, 1, 0.0, str(v))

    table.rows.sort(key=k)  # numbers before text, missing values last, either direction


# ----------------------------------------------------------------------------------------------- seeds


def over_seeds(table: Table) -> Optional[Table]:
    """Mean (and std, n) over the seed axis of every numeric column, one row per combination of the other axes."""
    if SEED not in table.axes:
        return None
    others = [a for a in table.axes if a != SEED]
    groups: dict[tuple, list] = {}
    for r in table.rows:
        groups.setdefault(tuple(r.get(a) for a in others), []).append(r)
    skip = {"point", "state", "baseline", SEED, *others}
    numeric = [c for c in table.columns if c not in skip and not c.startswith(("ci_", "p:", "sim_"))
               and any(_num(r.get(c)) is not None for r in table.rows)]
    rows, notes, recipe_cols = [], [], []
    family: list = []  # (row, cell, seeds, [{prompt: diff} per seed]) of every recipe-level interval
    for key, members in groups.items():
        row: dict[str, Any] = dict(zip(others, key))
        row["seeds"] = ",".join(str(m.get(SEED)) for m in members)
        for c in numeric:
            vals = [_num(m.get(c)) for m in members]
            if None in vals and any(v is not None for v in vals):
                lacking = [m["point"] for m, v in zip(members, vals) if v is None]
                recipe = ", ".join(f"{a}={v}" for a, v in zip(others, key)) or "the recipe"
                notes.append(f"{c} of {recipe}: not averaged, {', '.join(lacking)} lack(s) it (incomplete "
                             f"records; {len(members) - len(lacking)} of {len(members)} seeds have it)")
                vals = []
            vals = [v for v in vals if v is not None]
            row[c] = sum(vals) / len(vals) if vals else None
            # equal values (the base model's score in every seed) have no spread, not a rounding error's
            row[f"std:{c}"] = (None if len(vals) < 2 else 0.0 if len(set(vals)) == 1 else
                               math.sqrt(sum((v - row[c]) ** 2 for v in vals) / (len(vals) - 1)))
            if not c.startswith("diff:"):
                continue
            # The recipe's effect: seeds, then prompts, resampled (every seed's point on the same prompts).
            cells = [table.per_prompt.get((m["point"], c[5:])) for m in members]
            if len(cells) > 1 and all(cells) and all(set(d) == set(cells[0]) for d in cells):
                ids = list(cells[0])
                r = seeds_then_prompts([[d[i] for i in ids] for d in cells])
                row[f"ci_low:{c[5:]}"], row[f"ci_high:{c[5:]}"] = r["ci_low"], r["ci_high"]
                row[f"p:{c[5:]}"], row[f"n_seeds:{c[5:]}"] = r["p_value"], r["n_seeds"]
                for col in (f"ci_low:{c[5:]}", f"ci_high:{c[5:]}", f"p:{c[5:]}", f"n_seeds:{c[5:]}"):
                    if col not in recipe_cols:
                        recipe_cols.append(col)
                family.append((row, c[5:], [m.get(SEED) for m in members], cells))
                if r["n_seeds"] < 5 and not notes:
                    notes.append(f"recipe-level intervals (seeds, then prompts, resampled) rest on {r['n_seeds']} "
                                 "seeds: with fewer than 5 the seed-to-seed spread is poorly known.")
        rows.append(row)
    if family:
        notes.append(_recipe_family(family))
        recipe_cols += [f"{k}:{cell}" for cell in dict.fromkeys(c for _, c, _, _ in family)
                        for k in ("sim_low", "sim_high", "sim_p")]
    cols = others + ["seeds"] + [x for c in numeric for x in (c, f"std:{c}")] + recipe_cols
    return Table(cols, rows, others, table.metrics, table.steps, notes, table.baseline)


def _recipe_family(family: list) -> str:
    """Adds sim_low / sim_high / sim_p to every recipe-level cell of the over-seeds table: max-T over all of them,
    seeds and prompts resampled jointly (jaxrl.evaluation.seeds.seeds_then_prompts_family). Returns the note."""
    seed_sets = {tuple(sorted(map(str, seeds))) for _, _, seeds, _ in family}
    if len(seed_sets) > 1:
        return ("recipe-level simultaneous intervals: not computed, the recipes were run with different seeds "
                f"({sorted(seed_sets)}); each recipe's interval above holds for that recipe alone")
    ids = sorted({i for _, _, _, cells in family for d in cells for i in d})
    pos = {i: k for k, i in enumerate(ids)}
    diffs = np.zeros((len(family), len(next(iter(seed_sets))), len(ids)))
    masks = np.zeros((len(family), len(ids)), bool)
    for j, (_, _, seeds, cells) in enumerate(family):
        order = sorted(range(len(seeds)), key=lambda k: str(seeds[k]))  # seed s pairs with the baseline's seed s
        for si, k in enumerate(order):
            for i, v in cells[k].items():
                diffs[j, si, pos[i]] = v
                masks[j, pos[i]] = True
    fam = seeds_then_prompts_family(diffs, masks, bounds=[(-1.0, 1.0)] * len(family))
    for j, (row, cell, _, _) in enumerate(family):
        row[f"sim_low:{cell}"], row[f"sim_high:{cell}"] = fam["sim_low"][j], fam["sim_high"][j]
        row[f"sim_p:{cell}"] = fam["sim_p"][j]
    return (f"{len(family)} recipe-level differences: their simultaneous intervals (sim_low / sim_high; seeds and "
            f"prompts resampled jointly, max-T) hold for all {len(family)} at once; * marks the recipes still "
            "significant after choosing among them.")


# ----------------------------------------------------------------------------------------------- writers


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return format(v, ".6g")
    return str(v)


def to_csv(table: Table) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(table.columns)
    for r in table.rows:
        w.writerow([_cell(r.get(c)) for c in table.columns])
    return buf.getvalue()


_HIDDEN = ("ci_low:", "ci_high:", "std:", "p:", "sim_low:", "sim_high:", "sim_p:", "n_seeds:")


def display_columns(table: Table) -> list[str]:
    """The columns shown in Markdown / HTML: diff and interval share one cell; empty columns are left out."""
    return [c for c in table.columns if not c.startswith(_HIDDEN)
            and (c in ("point", "state", "baseline") or c in table.axes
                 or any(r.get(c) is not None for r in table.rows))]


def display_cell(table: Table, row: Mapping, col: str) -> str:
    v = row.get(col)
    if col == "baseline" and v is not None and v == row.get("point"):
        return "(self)"
    if col.startswith("diff:") and v is not None:
        lo, hi = row.get("ci_low:" + col[5:]), row.get("ci_high:" + col[5:])
        slo, shi = row.get("sim_low:" + col[5:]), row.get("sim_high:" + col[5:])
        text = f"{v:+.4g}" + (f" [{lo:+.4g}, {hi:+.4g}]" if lo is not None and hi is not None else "")
        if slo is not None and shi is not None and not slo <= 0.0 <= shi:
            text += "*"  # significant after the selection among every cell with an interval
        if row.get("n_seeds:" + col[5:]):
            text += f" (n_seeds={row['n_seeds:' + col[5:]]})"
        return text
    if f"std:{col}" in row and v is not None:
        sd = row.get(f"std:{col}")
        return format(v, ".4g") + (f" ± {sd:.2g}" if sd is not None else "")
    if isinstance(v, float):
        return format(v, ".4g")
    return "" if v is None else str(v)


def to_markdown(table: Table, title: str = "") -> str:
    cols = display_columns(table)
    lines = [f"## {title}", ""] if title else []
    lines += ["| " + " | ".join(c.replace("|", "/") for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in table.rows:
        lines.append("| " + " | ".join(display_cell(table, r, c).replace("|", "/") for c in cols) + " |")
    return "\n".join(lines) + "\n"


def default_plot_metric(table: Table) -> Optional[str]:
    """The metric the plots show: the first evaluation metric at the last evaluated step, else the last-k mean
    of the preference accuracy / reward, else the final loss."""
    cands = [f"{m}@{table.steps[-1]}" for m in table.metrics] if table.steps else []
    cands += [c for c in table.columns if c.startswith(("preference_accuracy_last", "reward_mean_last"))]
    cands += ["loss"]
    return next((c for c in cands if c in table.columns and any(v is not None for v in table.numeric(c))), None)
