"""Sweep comparison tables that survive the selection: simultaneous intervals over every diff cell, the
selection-adjusted gain of the best point, the base (step 0) as an exact zero, and recipe-level intervals over
seeds -- on a constructed sweep folder (no training), so it runs in seconds."""

import json

import numpy as np
import pytest

from jaxrl.utils.io import atomic_write_json
from jaxrl.data import formats
from jaxrl.evaluation.analysis import analyze
from jaxrl.evaluation.results import write_results
from jaxrl.sweep.compare import build_table, display_cell, load_points, over_seeds
from jaxrl.sweep.report import write_comparison

LRS = ("1e-06", "5e-06", "1e-05")
SEEDS = ("0", "1", "2")
N = 80


def _recs(values):
    return [{"problem_id": f"p{i}", "sample_index": 0, "completion": "c", "completion_tokens": 5,
             "finish_reason": "stop", "partial": float(v), "strict": bool(v == 1.0), "tests": [], "reason": None,
             "max_new_tokens": 16} for i, v in enumerate(values)]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """3 learning rates x 3 seeds; the baseline is lr 1e-06 of the same seed. lr 1e-05 really helps (+0.15 on
    every prompt, plus noise); lr 5e-06 does nothing."""
    root = tmp_path_factory.mktemp("sweep")
    rng = np.random.default_rng(0)
    base = np.round(rng.uniform(0, 1, N) * 4) / 4
    points = []
    for lr in LRS:
        for seed in SEEDS:
            slug = f"lr={lr}__seed={seed}"
            points.append({"slug": slug, "name": slug, "labels": {"optimizer.learning_rate": lr, "seed": seed},
                           "values": {}})
            d = root / slug
            shift = 0.15 if lr == "1e-05" else 0.0
            step = np.clip(base + shift + rng.normal(0, 0.15, N), 0, 1)
            records = {"base": _recs(base), "step_4": _recs(step)}
            for name, recs in records.items():
                formats.write_samples(formats.samples_path(d / "eval", name), recs)
            out = analyze(records, "base", n_resamples=500)
            models = out.pop("models")
            for name in models:
                models[name].update(step=None if name == "base" else 4, fingerprint=f"{name}-{slug}"
                                    if name != "base" else "base-weights")
            write_results(d / "eval", models, out.pop("comparisons"), warnings=out.pop("warnings"), extra=out)
            atomic_write_json(d / "status.json", {"state": "done"})
    atomic_write_json(root / "sweep.json", {
        "name": "lr", "base": "configs/dpo.py", "baseline": "optimizer.learning_rate=1e-06", "points": points,
        "axes": [{"name": "optimizer.learning_rate", "kind": "grid", "labels": list(LRS),
                  "values": [float(x) for x in LRS]},
                 {"name": "seed", "kind": "seed", "labels": list(SEEDS), "values": [int(s) for s in SEEDS]}]})
    return root


def test_sweep_cells_carry_simultaneous_intervals_and_the_selection(sweep):
    meta, points = load_points(sweep)
    table = build_table(meta, points, metrics=["partial_reward_mean"], n_resamples=2000,
                        sort="-diff:partial_reward_mean@4")
    rows = {r["point"]: r for r in table.rows}
    cell = "partial_reward_mean@4"
    family = [r for r in table.rows if r[f"sim_low:{cell}"] is not None]
    assert len(family) == 6  # the 1e-06 points are their own baseline: 2 lrs x 3 seeds compared
    for r in family:
        assert r[f"sim_low:{cell}"] <= r[f"ci_low:{cell}"] <= r[f"diff:{cell}"] <= r[f"ci_high:{cell}"] \
            <= r[f"sim_high:{cell}"]
        assert (r[f"p:{cell}"] < 0.05) == (r[f"ci_low:{cell}"] > 0 or r[f"ci_high:{cell}"] < 0)
        text = display_cell(table, r, f"diff:{cell}")
        assert text.endswith("*") == (not r[f"sim_low:{cell}"] <= 0 <= r[f"sim_high:{cell}"])
    helped = [r for r in family if r["optimizer.learning_rate"] == "1e-05"]
    assert all(display_cell(table, r, f"diff:{cell}").endswith("*") for r in helped)
    assert table.rows[0]["optimizer.learning_rate"] == "1e-05"  # sorted by diff, descending
    # step 0: the same base weights in every point -> exactly 0, not an estimate, and not in the family
    r = rows["lr=1e-05__seed=0"]
    assert (r["diff:partial_reward_mean@0"], r["ci_low:partial_reward_mean@0"]) == (0.0, 0.0)
    assert r["sim_low:partial_reward_mean@0"] is None
    notes = " ".join(table.notes)
    assert "6 differences with a paired interval" in notes and "selection-adjusted" in notes


def test_recipe_level_interval_over_seeds(sweep, tmp_path):
    meta, points = load_points(sweep)
    table = build_table(meta, points, metrics=["partial_reward_mean"], n_resamples=1000)
    seeds = over_seeds(table)
    by_lr = {r["optimizer.learning_rate"]: r for r in seeds.rows}
    cell = "partial_reward_mean@4"
    good, null = by_lr["1e-05"], by_lr["5e-06"]
    assert good[f"n_seeds:{cell}"] == 3 and good[f"ci_low:{cell}"] > 0.05
    assert null[f"ci_low:{cell}"] < 0 < null[f"ci_high:{cell}"]
    assert "(n_seeds=3)" in display_cell(seeds, good, f"diff:{cell}")
    assert any("rest on 3 seeds" in n for n in seeds.notes)
    paths = write_comparison(sweep, tmp_path, metrics=["partial_reward_mean"], n_resamples=500)
    md = paths["md"].read_text()
    assert "significant after choosing among every such cell" in md and "seeds, then prompts" in md
    data = json.loads(paths["json"].read_text())
    assert any(row.get(f"sim_low:{cell}") is not None for row in data["rows"])


def test_recipe_level_intervals_are_simultaneous_across_recipes(sweep, tmp_path):
    """The over-seeds table's recipe intervals form a family too (choosing the best learning rate is a selection
    among them): each recipe's simultaneous interval holds its marginal one, the real +0.15 survives the choice
    (marked *), the null recipe's does not; the printed summary (comparison_summary.md) carries them."""
    meta, points = load_points(sweep)
    seeds = over_seeds(build_table(meta, points, metrics=["partial_reward_mean"], n_resamples=1000))
    cell = "partial_reward_mean@4"
    by_lr = {r["optimizer.learning_rate"]: r for r in seeds.rows}
    for r in (by_lr["1e-05"], by_lr["5e-06"]):
        assert r[f"sim_low:{cell}"] <= r[f"ci_low:{cell}"] <= r[f"diff:{cell}"] <= r[f"ci_high:{cell}"]
        assert r[f"ci_high:{cell}"] <= r[f"sim_high:{cell}"]
    assert by_lr["1e-05"][f"sim_low:{cell}"] > 0 and display_cell(seeds, by_lr["1e-05"], f"diff:{cell}").count("*")
    assert by_lr["5e-06"][f"sim_low:{cell}"] < 0 < by_lr["5e-06"][f"sim_high:{cell}"]
    assert "*" not in display_cell(seeds, by_lr["5e-06"], f"diff:{cell}")
    assert any("recipe-level differences" in n and "hold for all" in n for n in seeds.notes)
    summary = write_comparison(sweep, tmp_path, metrics=["partial_reward_mean"], n_resamples=500)["summary"]
    text = summary.read_text()
    assert text.startswith("## Mean ± std over seeds") and "(n_seeds=3)" in text and "*" in text
    assert "loss_last5" not in text and "recipe-level differences" in text
    assert "simultaneous:partial_reward_mean@4" in text and "Each evaluation: 80 prompts, 80 samples" in text
    assert "diff:partial_reward_mean@0" not in text  # 0 by construction in every row (the same base weights)
