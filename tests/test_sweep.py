"""Sweeps, config plug-ins and the comparison table: expansion (grid, zip, cases, seeds, stable names), key and
type errors, dry run and cluster commands; the tiny DPO sweep (2 loss types x 2 betas x 2 seeds) run end to end
in subprocesses, SIGKILLed half-way and resumed without redoing finished points, its table equal to the
per-point files; a plug-in loss from a test file trained, evaluated per checkpoint and compared with a paired
interval under its own name; malformed plug-ins refused before anything trains."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl.algorithms.plugins import PluginError
from jaxrl.sweep.runner import merged_metrics
from jaxrl.sweep.spec import SweepError, load_sweep, parse_spec

pytestmark = pytest.mark.heavy  # sweeps of real training runs

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
TINY = "configs/sweeps/dpo_tiny_losses.py"
STEPS = 4  # dpo_tiny_losses: 4 steps, checkpoints at 2 and 4


def sweep_env(**extra) -> dict:
    # One CPU device is all a point's (1, 1, 1) mesh uses; this folder on the path for the test reward.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.update(extra)
    return env


def launch(*args, env=None, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launchers.sweep", *args], cwd=ROOT, capture_output=True,
                          text=True, env=env or sweep_env(), timeout=timeout)


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """One persistent compilation cache for the sweeps of this file (the second seed of a point compiles from it)."""
    return str(tmp_path_factory.mktemp("jax_cache"))


# ------------------------------------------------------------------------------------------------- expansion


GRID = {
    "base": "configs/sft_tiny.py",
    "axes": {"optimizer.learning_rate": [1e-3, 5e-4], "lora.rank": [4, 8]},
    "zip": [{"batch.micro_batch_size": [1, 2], "batch.grad_accum": [4, 2]}],
    "cases": {"sched": {"lin": {"optimizer.schedule": "linear"},
                        "cos": {"optimizer.schedule": "cosine", "optimizer.warmup_steps": 1}}},
    "seeds": [0, 1, 2],
    "fixed": {"steps": 3, "model_overrides.num_hidden_layers": 1},
}


def test_expansion_grid_zip_cases_seeds_and_stable_names():
    spec = parse_spec(GRID, "grid.py")
    points = spec.points()
    assert len(points) == 2 * 2 * 2 * 2 * 3
    # the first axis varies slowest, the seed fastest
    assert [p.labels["seed"] for p in points[:4]] == ["0", "1", "2", "0"]
    assert [p.labels["optimizer.learning_rate"] for p in points[:24:6]] == ["0.001"] * 4
    assert points[0].name == ("optimizer.learning_rate=0.001,lora.rank=4,batch.micro_batch_size+batch.grad_accum="
                              "1+4,sched=lin,seed=0")
    assert points[0].settings == {"optimizer.learning_rate": 1e-3, "lora.rank": 4, "batch.micro_batch_size": 1,
                                  "batch.grad_accum": 4, "optimizer.schedule": "linear", "seed": 0}
    slugs = [p.slug for p in points]
    assert len(set(slugs)) == len(slugs)
    assert all(re.fullmatch(r"[A-Za-z0-9._=+-]+", s) and len(s) <= 110 for s in slugs), slugs[:3]
    assert slugs[0].startswith("learning_rate=0.001__rank=4__micro_batch_size+grad_accum=1+4__sched=lin__seed=0__")

    # the same spec expands to the same names; adding a value keeps every existing point's folder
    assert [p.slug for p in parse_spec(GRID, "grid.py").points()] == slugs
    more = dict(GRID, axes={"optimizer.learning_rate": [1e-3, 5e-4, 1e-4], "lora.rank": [4, 8]})
    assert set(slugs) < {p.slug for p in parse_spec(more, "grid.py").points()}
    # a zip group written as tuples is the same axis
    tuples = dict(GRID, zip=[{("batch.micro_batch_size", "batch.grad_accum"): [(1, 4), (2, 2)]}])
    assert [p.slug for p in parse_spec(tuples, "grid.py").points()] == slugs

    # resolved configs: base + fixed + the point's settings
    last = spec.resolve(points[-1])
    assert (last["optimizer"]["learning_rate"], last["lora"]["rank"], last["batch"]["micro_batch_size"],
            last["batch"]["grad_accum"], last["optimizer"]["schedule"], last["optimizer"]["warmup_steps"],
            last["seed"], last["steps"], last["model_overrides"]["num_hidden_layers"]) == (
        5e-4, 8, 2, 2, "cosine", 1, 2, 3, 1)
    first = spec.resolve(points[0])
    assert first["optimizer"]["warmup_steps"] == 2  # sft_tiny's own value: the cos case's key did not leak


def test_config_keys_types_and_spec_errors_name_the_key():
    def err(d):
        with pytest.raises(SweepError) as ei:
            spec = parse_spec(d, "s.py")
            spec.resolve(spec.points()[0])
        return str(ei.value)

    msg = err({"base": "configs/sft_tiny.py", "axes": {"optimizer.learnig_rate": [1e-3]}})
    assert "optimizer.learnig_rate" in msg and "did you mean 'learning_rate'" in msg
    assert "'stepz'" in err({"base": "configs/sft_tiny.py", "fixed": {"stepz": 3}})
    msg = err({"base": "configs/sft_tiny.py", "axes": {"steps": ["ten"]}})
    assert "steps='ten'" in msg and "int" in msg
    assert "equal lengths" in err({"base": "configs/sft_tiny.py", "zip": [{"lora.rank": [4, 8],
                                                                            "lora.alpha": [8.0]}]})
    assert "varied by two axes" in err({"base": "configs/sft_tiny.py", "axes": {"lora.rank": [4]},
                                        "cases": {"c": {"x": {"lora.rank": 8}}}})
    assert "both varied" in err({"base": "configs/sft_tiny.py", "axes": {"lora.rank": [4]},
                                 "fixed": {"lora.rank": 8}})
    assert "unknown sweep keys ['axis']" in err({"base": "configs/sft_tiny.py", "axis": {}})
    assert "non-empty list" in err({"base": "configs/sft_tiny.py", "axes": {"lora.rank": []}})
    assert "not found" in err({"base": "configs/nope.py"})

    # `arg:` keys go into a family config's argument string (configs/dpo.py derives grad_accum from mb)
    spec = parse_spec({"base": "configs/dpo.py:model=tiny", "axes": {"arg:mb": [2, 4]}}, "s.py")
    got = [spec.resolve(p)["batch"] for p in spec.points()]
    assert [(b["micro_batch_size"], b["grad_accum"]) for b in got] == [(2, 4), (4, 2)]
    msg = err({"base": "configs/dpo.py:model=tiny", "axes": {"arg:mb": [3]}})
    assert "mb=3" in msg and "configs/dpo.py" in msg


def test_the_users_grids_expand_to_their_runs():
    from jaxrl.sweep.runner import evaluate_args

    def resolved(spec):
        sweep = load_sweep(spec)
        if sweep.evaluate:
            evaluate_args(sweep.evaluate, sweep.where)  # every key is a launchers.evaluate flag
        return sweep, [(p, sweep.resolve(p)) for p in sweep.points()]

    sweep, points = resolved("configs/sweeps/dpo_4b_lr_beta.py:pairs=/p/cohort,problems=/h.jsonl")
    assert [(c["optimizer"]["learning_rate"], c["dpo"]["beta"]) for _, c in points] == [
        (lr, b) for lr in (5e-7, 1e-6, 5e-6, 1e-5) for b in (0.01, 0.05, 0.1)]
    assert {(c["lora"]["rank"], c["lora"]["alpha"], c["steps"], c["data"]["max_length"], c["data"]["pairs"],
             c["algorithm"]) for _, c in points} == {(16, 32.0, 125, 6144, "/p/cohort", "dpo")}
    assert sweep.evaluate["steps"] == ["4", "8", "12", "16", "28", "40", "125"]

    sweep, points = resolved("configs/sweeps/grpo_9b_probes.py:problems=/p.jsonl,heldout=/h.jsonl,seeds=0+1")
    got = {(p.labels["probe"], p.labels["seed"]): (c["optimizer"]["learning_rate"], c["grpo"]["beta"],
                                                    c["lora"]["rank"], c["lora"]["alpha"], c["steps"], c["seed"])
           for p, c in points}
    assert got == {("default", "0"): (1e-6, 0.05, 16, 32.0, 16, 0), ("default", "1"): (1e-6, 0.05, 16, 32.0, 16, 1),
                   ("aggressive", "0"): (5e-6, 0.01, 16, 32.0, 16, 0),
                   ("aggressive", "1"): (5e-6, 0.01, 16, 32.0, 16, 1),
                   ("capacity", "0"): (1e-6, 0.05, 32, 64.0, 16, 0), ("capacity", "1"): (1e-6, 0.05, 32, 64.0, 16, 1)}
    assert sweep.baseline == {"probe": "default"}

    for model, clean in (("4b", 433), ("9b", 245)):
        _, points = resolved(f"configs/sweeps/dpo_length_clean.py:model={model},unfiltered=/u,clean=/c")
        assert {p.labels["pairs"]: (c["data"]["pairs"], c["data"]["expected_pairs"]) for p, c in points} == {
            "unfiltered": ("/u", 1000), "length_clean": ("/c", clean)}


@pytest.mark.slow
def test_dry_run_lists_points_and_print_commands_gives_one_per_point(tmp_path):
    out = tmp_path / "sweep"
    dry = launch(f"--sweep={TINY}", f"--out={out}", "--dry_run")
    assert dry.returncode == 0, dry.stderr
    slugs = re.findall(r"^\s+\d+\s+new\s+(\S+)$", dry.stdout, re.M)
    assert len(slugs) == 8 and len(set(slugs)) == 8
    assert "dpo.loss_type=ipo,dpo.beta=0.5,seed=1" in dry.stdout
    assert not out.exists()  # a dry run writes nothing

    cmds = launch(f"--sweep={TINY}", f"--out={out}", "--print_commands")
    assert cmds.returncode == 0, cmds.stderr
    lines = cmds.stdout.strip().splitlines()
    assert len(lines) == 8
    assert [re.search(r"--point=(\S+)$", ln).group(1) for ln in lines] == slugs
    assert all(ln.startswith(f"cd {ROOT} && ") and "-m launchers.sweep" in ln for ln in lines)
    # the folders are prepared (what each cluster job will find), nothing is trained
    for slug in slugs:
        status = json.loads((out / slug / "status.json").read_text())
        assert status["state"] == "pending" and status["attempts"] == []
        assert json.loads((out / slug / "config.json").read_text())["steps"] == STEPS
        assert not (out / slug / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------- plug-ins


BAD_LOSS = """
import jax.numpy as jnp

def t_scalar_loss(p):
    return jnp.mean(p.delta)      # a scalar, where per-pair losses [B] are due
"""


def test_plugins_section_forms_and_reward_plugins(tmp_path):
    from jaxrl.rewards import get_reward
    from jaxrl.algorithms.plugins import load_plugins, parse_plugins
    from jaxrl.rewards.registry import example_problem
    path = tmp_path / "t_plug.py"
    path.write_text(textwrap.dedent("""
        def t_len_reward(completion, problem):
            return min(len(completion), 10) / 10

        def t_list_reward(completion, problem):
            return [1.0, 0.0]

        def t_two_args(completion):
            return 0.0
    """))
    entries = parse_plugins([{"kind": "reward", "name": "t_len", "path": f"{path}:t_len_reward"},
                             f"kl:t_k=mod.x:fn", f"advantage:{path}:f"])
    assert [(e.kind, e.name, e.path) for e in entries] == [
        ("reward", "t_len", f"{path}:t_len_reward"), ("kl", "t_k", "mod.x:fn"), ("advantage", "", f"{path}:f")]
    assert [e.where for e in entries] == ["plugins[0]", "plugins[1]", "plugins[2]"]
    with pytest.raises(PluginError, match=r"plugins\[0\].*unknown plug-in kind 'loss'"):
        parse_plugins(["loss:x=a.py:f"])
    with pytest.raises(PluginError, match=r"plugins\[0\].*unknown keys \['fn'\]"):
        parse_plugins([{"kind": "kl", "path": "a.py:f", "fn": "g"}])

    assert load_plugins(entries[:1]) == [{"kind": "reward", "name": "t_len", "path": f"{path}:t_len_reward"}]
    problem = example_problem()
    scores = get_reward("t_len").score(["abc", "a" * 30], [problem, problem])
    assert [s.partial for s in scores] == [0.3, 1.0]
    load_plugins(entries[:1])  # the same plug-in again (a resumed run): fine
    with pytest.raises(PluginError, match=r"plugins\[0\].*'code' is already taken"):
        load_plugins(parse_plugins([f"reward:code={path}:t_len_reward"]))
    with pytest.raises(PluginError, match=r"plugins\[0\].*t_list.*not one number"):
        load_plugins(parse_plugins([f"reward:t_list={path}:t_list_reward"]))
    with pytest.raises(PluginError, match=r"plugins\[0\].*wrong signature \(completion\)"):
        load_plugins(parse_plugins([f"reward:t_two={path}:t_two_args"]))


@pytest.mark.slow
def test_malformed_plugin_fails_before_training(tmp_path):
    bad = tmp_path / "t_bad_losses.py"
    bad.write_text(BAD_LOSS)
    # run_training: the PluginError comes before the model, the data or the workdir
    from configs import dpo_tiny
    from jaxrl.algorithms.run import run_training
    c = dpo_tiny.get_config()
    c.plugins = ({"kind": "dpo_loss", "name": "t_scalar", "path": f"{bad}:t_scalar_loss"},)
    c.dpo.loss_type = "t_scalar"
    workdir = tmp_path / "run"
    with pytest.raises(PluginError) as ei:
        run_training(c, str(workdir))
    msg = str(ei.value)
    assert all(s in msg for s in ("plugins[0]", "t_scalar", "returned a scalar", "[B]")), msg
    assert not workdir.exists()

    # a sweep naming it stops before any point starts (exit status 2), naming the plug-in
    out = tmp_path / "sweep"
    r = launch(f"--sweep={TINY}:losses=sigmoid+t_scalar_loss,betas=0.1,seeds=0,plugin={bad}:t_scalar_loss",
               f"--out={out}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "PluginError" in r.stderr and "t_scalar_loss" in r.stderr and "returned a scalar" in r.stderr
    for status in out.glob("*/status.json"):
        assert json.loads(status.read_text())["attempts"] == []
    assert not list(out.glob("*/metrics.jsonl")) and not list(out.glob("*/logs"))


@pytest.mark.slow
def test_unknown_objective_name_fails_before_training(tmp_path):
    out = tmp_path / "sweep"
    r = launch(f"--sweep={TINY}:losses=sigmoid+sigmod,betas=0.1,seeds=0", f"--out={out}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "dpo.loss_type='sigmod': no dpo_loss named 'sigmod'" in r.stderr and "plugins" in r.stderr
    assert "dpo.loss_type=sigmod" in r.stderr  # the point it came from
    assert not list(out.glob("*/metrics.jsonl"))


# ------------------------------------------------------------------------------------------------- the tiny sweep


def _wait_for(pred, timeout, what):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _snapshot(d: Path) -> dict:
    files = [d / "metrics.jsonl", d / "status.json", d / "logs" / "train.log"] + sorted(
        (d / "checkpoints" / "adapters").iterdir())
    return {str(f): (f.stat().st_mtime_ns, f.read_bytes() if f.is_file() else None) for f in files}


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory, jax_cache):
    """The 8-point sweep, killed (SIGKILL, no clean-up) while the 4th point waits after its step-2 checkpoint,
    then rerun to the end. Returns what the tests check."""
    out = tmp_path_factory.mktemp("tiny") / "sweep"
    slugs = [p.slug for p in load_sweep(TINY).points()]
    victim = slugs[3]
    cmd = [sys.executable, "-m", "launchers.sweep", f"--sweep={TINY}", f"--out={out}",
           f"--compilation_cache={jax_cache}"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=sweep_env(JAXRL_SWEEP_DEBUG_PAUSE=f"{victim}@2"))
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[3/8] done"):
                break
        assert any(ln.startswith("[3/8] done") for ln in lines), "".join(lines)
        # the 4th point trains to its step-2 checkpoint and waits there (the test-only pause)
        _wait_for(lambda: "PAUSED after step 2" in (out / victim / "logs" / "train.log").read_text(errors="ignore")
                  if (out / victim / "logs" / "train.log").exists() else False, 300, "the 4th point's pause")
        before = {s: _snapshot(out / s) for s in slugs[:3]}
        child = json.loads((out / victim / "status.json").read_text())["pid"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    first_run_s = time.time() - t0
    # the point's training died with the sweep (its watchdog): nothing races the resumed sweep
    _wait_for(lambda: not Path(f"/proc/{child}").exists() or b"zombie" in Path(f"/proc/{child}/status")
              .read_bytes().lower(), 10, f"the killed sweep's training process {child} to exit")
    killed_status = json.loads((out / victim / "status.json").read_text())

    t0 = time.time()
    resumed = launch(f"--sweep={TINY}", f"--out={out}", f"--compilation_cache={jax_cache}")
    return {"out": out, "slugs": slugs, "victim": victim, "before": before, "killed_status": killed_status,
            "first_lines": "".join(lines), "resumed": resumed, "times": (first_run_s, time.time() - t0)}


@pytest.mark.slow
def test_tiny_sweep_is_resumed_without_redoing_finished_points(tiny_sweep):
    out, slugs, victim = tiny_sweep["out"], tiny_sweep["slugs"], tiny_sweep["victim"]
    r = tiny_sweep["resumed"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print("first run (killed) %.0f s, resumed run %.0f s" % tiny_sweep["times"])
    assert tiny_sweep["killed_status"]["state"] == "running"  # what the kill left behind
    for s in slugs[:3]:
        assert f"done (earlier) {s}" in r.stdout
        assert _snapshot(out / s) == tiny_sweep["before"][s]  # not rerun: files, mtimes, checkpoints unchanged
        status = json.loads((out / s / "status.json").read_text())
        assert status["state"] == "done" and len(status["attempts"]) == 1
    assert f"{victim}: interrupted during train; resuming" in r.stdout
    st = json.loads((out / victim / "status.json").read_text())
    # attempt 1 was killed with the sweep (no exit status recorded); attempt 2 resumed from the step-2 state
    assert st["state"] == "done" and [a.get("returncode") for a in st["attempts"]] == [None, 0]
    assert [a["resumed_from_step"] for a in st["attempts"]] == [0, 2]
    log = (out / victim / "logs" / "train.log").read_text()
    assert log.count("===== train attempt") == 2 and "resumed from" in log.split("===== train attempt 2")[1]
    for s in slugs:
        status = json.loads((out / s / "status.json").read_text())
        assert status["state"] == "done", (s, status.get("error"))
        records = merged_metrics(out / s / "metrics.jsonl")
        assert [rec["step"] for rec in records] == [1, 2, 3, 4]
        assert sorted(int(p.name) for p in (out / s / "checkpoints" / "adapters").iterdir()) == [2, 4]
    # the resumed point's steps 1-2 come from the first attempt, 3-4 from the second: one consistent run
    rec = merged_metrics(out / victim / "metrics.jsonl")
    assert all(np.isfinite(x["loss"]) for x in rec)
    # finished: --print_commands has nothing left to run
    again = launch(f"--sweep={TINY}", f"--out={out}", "--print_commands")
    assert again.returncode == 0 and again.stdout.strip() == "", again.stdout


@pytest.mark.slow
def test_tiny_sweep_settings_reached_training(tiny_sweep):
    """Each point trained what its name says: the step-1 loss (adapters still zero: policy = reference) is the
    loss type's closed form at its beta -- sigmoid log 2, IPO (1 / (2 beta))^2 -- and seeds draw other data."""
    out = tiny_sweep["out"]
    for slug in tiny_sweep["slugs"]:
        cfg = json.loads((out / slug / "config.json").read_text())
        first = merged_metrics(out / slug / "metrics.jsonl")[0]
        beta, loss_type = cfg["dpo"]["beta"], cfg["dpo"]["loss_type"]
        want = math.log(2.0) if loss_type == "sigmoid" else (1.0 / (2.0 * beta)) ** 2
        assert first["loss"] == pytest.approx(want, rel=1e-4), (slug, first["loss"])
        assert f"loss/{loss_type}" in first
    by_seed = {}
    for slug in tiny_sweep["slugs"][:2]:  # sigmoid, beta 0.1, seeds 0 and 1
        by_seed[slug] = merged_metrics(out / slug / "metrics.jsonl")[-1]["chosen_logps"]
    assert len(set(by_seed.values())) == 2


@pytest.mark.slow
def test_tiny_sweep_table_matches_the_point_files(tiny_sweep):
    out = tiny_sweep["out"]
    data = json.loads((out / "comparison.json").read_text())
    with open(out / "comparison.csv", newline="") as f:
        csv_rows = {r["point"]: r for r in csv.DictReader(f)}
    rows = {r["point"]: r for r in data["rows"]}
    assert set(rows) == set(csv_rows) == set(tiny_sweep["slugs"])
    assert data["steps"] == [2, 4] and data["metrics"] == ["eval_preference_accuracy", "eval_reward_margin"]
    for slug, row in rows.items():
        d = out / slug
        records = merged_metrics(d / "metrics.jsonl")
        status = json.loads((d / "status.json").read_text())
        point = json.loads((d / "point.json").read_text())
        last = records[-1]
        want = {"final_step": 4, "loss": last["loss"], "preference_accuracy": last["preference_accuracy"],
                "preference_accuracy_last5": sum(r["preference_accuracy"] for r in records) / len(records),
                "loss_last5": sum(r["loss"] for r in records) / len(records),
                "skipped_updates": last["skipped_updates"], "train_time_s": status["train_seconds"],
                "state": "done", **point["labels"]}
        for step in (2, 4):
            for m in data["metrics"]:
                want[f"{m}@{step}"] = records[step - 1][m]
        for col, value in want.items():
            assert row[col] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), (slug, col)
            if isinstance(value, float):
                assert float(csv_rows[slug][col]) == pytest.approx(value, rel=1e-5), (slug, col)
            else:
                assert csv_rows[slug][col] == str(value), (slug, col)
        # the baseline is sigmoid / beta 0.1 with the point's own seed; diff = point - baseline, same step
        base = rows[row["baseline"]]
        assert (base["dpo.loss_type"], base["dpo.beta"], base["seed"]) == ("sigmoid", "0.1", row["seed"])
        for step in (2, 4):
            for m in data["metrics"]:
                assert row[f"diff:{m}@{step}"] == pytest.approx(row[f"{m}@{step}"] - base[f"{m}@{step}"], abs=1e-15)
                assert row[f"ci_low:{m}@{step}"] is None  # held-out pair metrics come without per-pair values
    # the mean over seeds
    seeds = {(r["dpo.loss_type"], r["dpo.beta"]): r for r in data["over_seeds"]["rows"]}
    assert len(seeds) == 4
    for (loss_type, beta), r in seeds.items():
        members = [x for x in rows.values() if (x["dpo.loss_type"], x["dpo.beta"]) == (loss_type, beta)]
        assert r["loss"] == pytest.approx(np.mean([x["loss"] for x in members]), rel=1e-12)
        assert r["std:loss"] == pytest.approx(np.std([x["loss"] for x in members], ddof=1), rel=1e-9)
    md = (out / "comparison.md").read_text()
    html = (out / "report.html").read_text()
    for slug in tiny_sweep["slugs"]:
        assert slug in md and slug in html
    assert "data:image/png;base64," in html
    assert "<h2 id='plots'>eval_preference_accuracy@4 against each axis</h2>" in html


@pytest.mark.slow
def test_compare_sorts_filters_and_picks_baselines(tiny_sweep, tmp_path):
    from jaxrl.sweep.compare import build_table, load_points
    meta, points = load_points(tiny_sweep["out"])
    t = build_table(meta, points, sort="-loss", filters=["dpo.loss_type==ipo", "dpo.beta>0.2"])
    assert [r["dpo.beta"] for r in t.rows] == ["0.5", "0.5"] and {r["dpo.loss_type"] for r in t.rows} == {"ipo"}
    assert t.rows[0]["loss"] >= t.rows[1]["loss"]
    t = build_table(meta, points, sort="eval_reward_margin@4")
    margins = [r["eval_reward_margin@4"] for r in t.rows]
    assert margins == sorted(margins)
    # one fixed baseline point (a slug) for every row; a short-name selector
    slug = tiny_sweep["slugs"][5]
    t = build_table(meta, points, baseline=slug)
    assert {r["baseline"] for r in t.rows} == {slug}
    t = build_table(meta, points, baseline="loss_type=ipo,beta=0.5")
    assert all(r["baseline"].startswith("loss_type=ipo__beta=0.5__seed=" + r["seed"]) for r in t.rows)
    with pytest.raises(KeyError, match="did you mean"):
        build_table(meta, points, sort="eval_reward_margn@4")
    with pytest.raises(KeyError, match="has values"):
        build_table(meta, points, baseline="beta=0.3")
    # the launcher: the same table into another folder, filtered
    r = subprocess.run([sys.executable, "-m", "launchers.compare", f"--sweep_dir={tiny_sweep['out']}",
                        f"--out={tmp_path}", "--filter=seed==1", "--sort=-eval_preference_accuracy@4"],
                       cwd=ROOT, capture_output=True, text=True, env=sweep_env())
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "comparison.csv", newline="") as f:
        assert [row["seed"] for row in csv.DictReader(f)] == ["1"] * 4


@pytest.mark.slow
def test_a_failing_point_does_not_stop_the_sweep(tmp_path, jax_cache):
    sweep = tmp_path / "broken_sweep.py"
    sweep.write_text(textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("tiny_losses", {str(ROOT / TINY)!r})
        tiny = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tiny)

        def get_sweep():
            s = tiny.get_sweep("losses=sigmoid,betas=0.1,seeds=0")
            s["cases"] = {{"data": {{"broken": {{"data.source": "nope"}}, "ok": {{"data.source": "synthetic"}}}}}}
            return s
    """))
    out = tmp_path / "sweep"
    r = launch(f"--sweep={sweep}", f"--out={out}", f"--compilation_cache={jax_cache}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"^\[1/2\] failed \S*data=broken", r.stdout, re.M), r.stdout
    assert re.search(r"^\[2/2\] done \S*data=ok", r.stdout, re.M), r.stdout
    broken, ok = (json.loads(next(out.glob(f"*data={n}*")).joinpath("status.json").read_text())
                  for n in ("broken", "ok"))
    assert broken["state"] == "failed" and broken["phase"] == "train" and broken["attempts"][0]["returncode"] == 1
    assert "data.source='nope'" in broken["error"] and "train.log" in broken["error"]
    assert ok["state"] == "done"
    # rerun without retrying the failed point: nothing runs, the exit status still says a point failed
    again = launch(f"--sweep={sweep}", f"--out={out}", "--noretry_failed")
    assert again.returncode == 1 and "[2/2] done (earlier)" in again.stdout
    assert json.loads(next(out.glob("*data=broken*")).joinpath("status.json").read_text())["attempts"] == \
        broken["attempts"]
    data = json.loads((out / "comparison.json").read_text())
    assert {r["data"]: r["state"] for r in data["rows"]} == {"broken": "failed", "ok": "done"}
    html = (out / "report.html").read_text()
    assert "Failed points" in html and "data.source=&#x27;nope&#x27;" in html


# ------------------------------------------------------------------------------------------------- plug-in + eval


def length_reward(completion, problem):
    """Toy evaluation reward, sensitive to any change of the sampled text (so two models' scores differ)."""
    return (len(completion) % 5) / 4


MARGIN_LOSS = """
import jax


def t_margin_dpo(p):
    # DPO with a target margin: -log sigmoid(beta * delta - 0.5)
    return -jax.nn.log_sigmoid(p.beta * p.delta - 0.5)
"""


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A tiny HF model folder with a tokenizer: what launchers.evaluate needs as the base."""
    import jax.numpy as jnp  # noqa: F401 - numpy_init builds jax arrays
    from test_evaluate import numpy_init

    from jaxrl.models import qwen35
    from jaxrl.models.qwen35.config import tiny
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
    folder = str(tmp_path_factory.mktemp("tiny_base"))
    problems = [json.loads(line) for line in (ROOT / "jaxrl/assets/tasks/problems.jsonl").read_text().splitlines()]
    cfg = tiny(num_hidden_layers=1, layer_types=("full_attention",))
    qwen35.save_pretrained(numpy_init(cfg), folder, base_dir=None, layout="container")
    build_tiny_tokenizer(folder, [m["content"] for p in problems for m in p["messages"]])
    return folder


@pytest.mark.slow
def test_plugin_loss_trains_is_evaluated_and_compared_under_its_own_name(tmp_path, tiny_base, jax_cache):
    losses = tmp_path / "my_losses.py"
    losses.write_text(MARGIN_LOSS)
    sweep = tmp_path / "plugin_sweep.py"
    sweep.write_text(textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("tiny_losses", {str(ROOT / TINY)!r})
        tiny = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tiny)

        def get_sweep():
            s = tiny.get_sweep("losses=sigmoid+t_margin_dpo,betas=0.1,seeds=0,plugin={losses}:t_margin_dpo")
            s["fixed"].update({{"model_path": {tiny_base!r}, "model_preset": ""}})
            for k in ("model_overrides.num_hidden_layers", "model_overrides.layer_types"):
                del s["fixed"][k]  # the model comes from the folder
            s["evaluate"] = {{"problems": {str(ROOT / 'jaxrl/assets/tasks/problems.jsonl')!r}, "limit": 6,
                             "num_samples": 2, "temperature": 1.0, "max_new_tokens": 16, "max_prompt_len": 192,
                             "prompt_buckets": [192], "reward": "test_sweep:length_reward", "batch_size": 12,
                             "dtype": "float32", "n_resamples": 2000, "progress": False}}
            return s
    """))
    out = tmp_path / "sweep"
    r = launch(f"--sweep={sweep}", f"--out={out}", f"--compilation_cache={jax_cache}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "base-model samples reused from" in r.stdout  # the base model was sampled once for the sweep
    data = json.loads((out / "comparison.json").read_text())
    rows = {r["dpo.loss_type"]: r for r in data["rows"]}
    assert set(rows) == {"sigmoid", "t_margin_dpo"}
    plug = rows["t_margin_dpo"]
    plug_dir = out / plug["point"]
    records = merged_metrics(plug_dir / "metrics.jsonl")
    # it trained with the plug-in: step 1 (zero adapters, delta = 0) is -log sigmoid(-0.5)
    assert records[0]["loss/t_margin_dpo"] == pytest.approx(math.log1p(math.exp(0.5)), rel=1e-4)
    assert plug["loss"] == pytest.approx(records[-1]["loss"], rel=1e-12)
    assert "t_margin_dpo" in (out / "comparison.md").read_text()
    assert "t_margin_dpo" in (out / "report.html").read_text()

    # evaluation at every checkpoint (0 = base), and the paired interval against the sigmoid point by hand
    from jaxrl.data.formats import read_results, read_samples
    from jaxrl.evaluation.stats import paired_difference
    assert data["steps"] == [0, 2, 4] and data["metrics"][:2] == ["partial_reward_mean", "strict_rate"]
    base_dir = out / rows["sigmoid"]["point"]
    for step, name in ((0, "base"), (2, "step_2"), (4, "step_4")):
        res = read_results(plug_dir / "eval")["models"][name]
        assert plug[f"partial_reward_mean@{step}"] == pytest.approx(res["partial_reward_mean"], rel=1e-12)

        def per_prompt(folder):
            by = {}
            for rec in read_samples(folder / "eval" / "samples" / f"{name}.jsonl"):
                by.setdefault(rec["problem_id"], []).append(rec["partial"])
            return {k: sum(v) / len(v) for k, v in by.items()}

        a, b = per_prompt(plug_dir), per_prompt(base_dir)
        assert sorted(a) == sorted(b) and len(a) == 6
        ids = list(b)  # the baseline's prompt order, as the comparison pairs them (the resampling is by index)
        want = paired_difference([a[i] for i in ids], [b[i] for i in ids], n_resamples=10000, seed=0)
        assert plug[f"diff:partial_reward_mean@{step}"] == pytest.approx(np.mean([a[i] - b[i] for i in ids]),
                                                                          abs=1e-12)
        if step:  # step 0 is the same base in both points: checked below
            assert plug[f"ci_low:partial_reward_mean@{step}"] == pytest.approx(want["ci_low"], abs=1e-12)
            assert plug[f"ci_high:partial_reward_mean@{step}"] == pytest.approx(want["ci_high"], abs=1e-12)
            assert plug[f"p:partial_reward_mean@{step}"] == pytest.approx(want["p_value"], abs=1e-12)
    # the base model is the same weights in both points: its paired difference is exactly zero (by construction,
    # so it is no interval and not part of the table's family)
    assert plug["diff:partial_reward_mean@0"] == 0.0 and plug["ci_low:partial_reward_mean@0"] == 0.0
    assert plug["sim_low:partial_reward_mean@0"] is None
