"""A sweep's `prepare` commands (what its base config reads, made before any point) and the loss-ablation sweep on
the demo's task (configs/sweeps/grpo_demo_policy_losses.py): its expansion, its prepare command, its evaluation
flags; `launchers.demo --until`. The ablation run end to end is in test_loss_ablation.py (heavy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.algorithms.policy_loss import POLICY_LOSSES
from jaxrl.sweep.runner import SweepRunner
from jaxrl.sweep.spec import SweepError, load_sweep, parse_spec

ROOT = Path(__file__).resolve().parents[1]
ABLATION = "configs/sweeps/grpo_demo_policy_losses.py"


def _spec(prepare):
    return parse_spec({"base": "configs/sft_tiny.py", "fixed": {"steps": 1}, "prepare": prepare}, "s.py")


def test_prepare_must_be_a_list_of_argv_lists():
    for bad in ("make data", [["python", 3]], [[]], ["python", "-c", "1"]):
        with pytest.raises(SweepError, match="'prepare' must be a list of commands"):
            _spec(bad)
    assert _spec(None).prepare == ()


def test_prepare_runs_before_the_points_logs_and_fails_naming_the_command(tmp_path):
    made = tmp_path / "made.txt"
    ok = ["python", "-c", f"import sys; open({str(made)!r}, 'w').write(sys.executable); print('built it')"]
    lines = []
    runner = SweepRunner(_spec([ok]), str(tmp_path / "out"), echo=lines.append)
    runner.prepare(runner.plan())
    runner.run_prepare()
    assert made.read_text() == sys.executable  # "python" is the runner's interpreter
    assert "built it" in (tmp_path / "out" / "logs" / "prepare.log").read_text()
    assert len(lines) == 1 and lines[0].startswith(f"prepare: {sys.executable} -c ")
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["prepare"] == [ok]

    bad = ["python", "-c", "raise SystemExit('no data here')"]
    runner = SweepRunner(_spec([bad, ok]), str(tmp_path / "out2"), echo=lambda m: None)
    made.unlink()
    with pytest.raises(SweepError) as ei:
        runner.run_prepare()
    msg = str(ei.value)
    assert "prepare command" in msg and "exited with status 1" in msg and "no data here" in msg
    assert "prepare.log" in msg and not made.exists()  # the commands after a failure do not run


def test_the_loss_ablation_expands_to_every_loss_and_seed_on_the_demo_task(tmp_path):
    spec = load_sweep(f"{ABLATION}:demo={tmp_path / 'd'}")
    points = spec.points()
    builtin = {"ppo_clip", "gspo", "cispo", "sapo", "gmpo", "kl_cov", "clip_cov"}
    assert builtin <= set(POLICY_LOSSES.names())
    assert {p.labels["grpo.policy_loss"] for p in points} == builtin and len(points) == 3 * len(builtin)
    assert spec.prepare == (("python", "-m", "launchers.demo", f"--workdir={tmp_path / 'd'}", "--until=warm_up"),)
    cfg = spec.resolve(points[0])
    assert cfg["model_path"] == str(tmp_path / "d" / "base_model") and cfg["reward"]["name"] == "charset"
    assert cfg["data"]["problems"] == str(tmp_path / "d" / "tasks" / "train.jsonl")
    assert cfg["grpo"]["num_iterations"] == 2 and cfg["steps"] == 48
    assert spec.evaluate["problems"] == str(tmp_path / "d" / "tasks" / "eval.jsonl") and spec.evaluate["steps"] == [48]
    SweepRunner(spec, str(tmp_path / "out"))  # the evaluate block's flags are launchers.evaluate's
    est = load_sweep(f"{ABLATION}:demo={tmp_path / 'd'},losses=ppo_clip,estimators=rloo+grpo+pass_at_k@2,seeds=0")
    assert est.baseline == {"grpo.policy_loss": "ppo_clip", "estimator": "grpo"}
    points = {p.labels["estimator"]: est.resolve(p)["grpo"] for p in est.points()}
    assert sorted(points) == ["grpo", "pass_at_k@2", "rloo"]
    assert (points["pass_at_k@2"]["advantage_estimator"], points["pass_at_k@2"]["pass_at_k_k"]) == ("pass_at_k", 2)
    assert points["rloo"]["pass_at_k_k"] == 0


def test_the_demo_task_config_is_the_demos_grpo_stage(tmp_path):
    """configs/grpo_demo.py builds the run the demo's GRPO stage trains (the demo calls it)."""
    from configs import grpo_demo
    from jaxrl.demo import Demo

    class Capture(Demo):
        def _train(self, config, workdir):
            self.config = config
            raise StopIteration

    demo = Capture(str(tmp_path))
    with pytest.raises(StopIteration):
        demo.grpo()
    assert demo.config.to_dict() == grpo_demo.get_config(f"demo={tmp_path}").to_dict()


@pytest.mark.slow
def test_demo_until_stops_after_the_stage_and_refuses_an_unknown_one(tmp_path):
    r = subprocess.run([sys.executable, "-m", "launchers.demo", f"--workdir={tmp_path / 'x'}", "--until=warmup"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--until='warmup': not a stage of the demo" in r.stderr + r.stdout
    assert not (tmp_path / "x").exists()
    from jaxrl.demo import Demo
    from jaxrl.demo_settings import DemoSettings
    lines = []
    assert Demo(str(tmp_path / "d"), DemoSettings.quick(), log=lines.append).run("tasks") is None
    assert (tmp_path / "d" / "tasks" / "eval.jsonl").is_file() and not (tmp_path / "d" / "base_model").exists()
    assert lines[-1].startswith("[demo] tasks: done")


def test_a_key_the_code_gained_since_a_point_ran_is_not_a_change_of_its_config(tmp_path):
    """A point's config.json written before a key existed resumes (the key is at its default); a value that differs
    is still refused, naming the key."""
    spec = load_sweep(f"{ABLATION}:demo={tmp_path / 'd'},losses=ppo_clip,seeds=0")
    runner = SweepRunner(spec, str(tmp_path / "out"))
    planned = runner.plan()
    runner.prepare(planned)
    d = planned[0].dir
    old = json.loads((d / "config.json").read_text())
    del old["grpo"]["ref_reset_optimizer"]  # as a run of the code before that key was written it
    (d / "config.json").write_text(json.dumps(old))
    (d / "status.json").write_text(json.dumps({"state": "running", "attempts": [{"phase": "train"}]}))
    assert runner.plan()[0].conflict == []
    old["grpo"]["beta"] = 0.5
    (d / "config.json").write_text(json.dumps(old))
    assert runner.plan()[0].conflict == ["grpo.beta: 0.5 -> 0.04"]
