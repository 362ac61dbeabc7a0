"""EMA of the adapter during training (config `ema.decay`): a run killed with SIGKILL and resumed ends bit-identical
to an uninterrupted one, EMA included; `ema.decay=0` writes the checkpoint's own adapter as its EMA, bit for bit;
the EMA adapters (`ema_<N>`) and averaged adapters (`averages/<name>`) are a run's evaluation candidates like its
steps, members of the family of simultaneous intervals, and drawn beside their steps in the report."""

from __future__ import annotations

import os

import numpy as np
import pytest
from launcher_env import build, launch

from jaxrl.models.adapters import load_adapter

EMA_ROOT = os.path.join("checkpoints", "ema")


def vowel_reward(completion, problem):
    """Toy reward: the fraction of the five vowels in the completion."""
    return sum(v in completion for v in "aeiou") / 5


def assert_same_adapters(a: str, b: str, step: int) -> dict:
    """The adapter checkpoints `a` and `b` (paths load_adapter reads) of `step` hold bit-identical factors; returns
    a's factors."""
    a_params, a_meta = load_adapter(a, step)
    b_params, b_meta = load_adapter(b, step)
    assert a_meta["step"] == b_meta["step"] == step and sorted(a_params) == sorted(b_params)
    for name in a_params:
        np.testing.assert_array_equal(b_params[name], a_params[name], err_msg=f"{name} of step {step}")
    return a_params


def test_ema_update_is_the_convex_combination_and_decay_zero_is_the_factor_bit_for_bit():
    import jax.numpy as jnp

    from jaxrl.train.step import ema_update
    rng = np.random.default_rng(0)
    ema = {"a.lora.lora_A": jnp.asarray(rng.standard_normal((4, 7)), jnp.float32)}
    params = {"a.lora.lora_A": jnp.asarray(rng.standard_normal((4, 7)), jnp.float32), "v_head": jnp.ones(3)}
    zero = ema_update(ema, params, 0.0)
    assert list(zero) == ["a.lora.lora_A"]  # only the entries the EMA keeps (the LoRA factors)
    np.testing.assert_array_equal(np.asarray(zero["a.lora.lora_A"]), np.asarray(params["a.lora.lora_A"]))
    got = np.asarray(ema_update(ema, params, 0.75)["a.lora.lora_A"], np.float64)
    want = 0.75 * np.asarray(ema["a.lora.lora_A"], np.float64) + 0.25 * np.asarray(params["a.lora.lora_A"], np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------- kill, resume

SFT = ("--config=configs/sft_tiny.py", "--config.steps=8", "--config.checkpoint_every=4", "--config.data.seq_len=16",
       "--config.lora.targets=q_proj,in_proj_qkv,down_proj", "--config.ema.decay=0.75", "--config.tensorboard=False")


@pytest.mark.slow  # three training processes of the tiny model (one compile, shared through the XLA cache)
@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_a_killed_run_resumes_bit_identical_ema_included(tmp_path):
    from jaxrl.train.metrics import read_metrics
    cache = tmp_path / "xla"
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    done = launch("train", *SFT, f"--workdir={straight}", cache=cache)
    assert done.returncode == 0, done.stderr[-3000:]

    # killed after step 5: the newest state (and EMA) is step 4's; steps 5.. are redone from the restored EMA
    killed = launch("train", *SFT, f"--workdir={broken}", "--debug_kill_after_step=5", cache=cache)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(os.listdir(broken / EMA_ROOT)) == ["4"]
    resumed = launch("train", *SFT, f"--workdir={broken}", cache=cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "(step 4)" in resumed.stderr

    for step in (4, 8):
        assert_same_adapters(str(straight), str(broken), step)
        ema = assert_same_adapters(str(straight / EMA_ROOT), str(broken / EMA_ROOT), step)
        adapter = load_adapter(str(straight), step)[0]
        # the EMA is its own adapter: it lags the trained factors (an EMA restarted at the resume would differ)
        assert max(float(np.abs(ema[n] - adapter[n]).max()) for n in ema if n.endswith("lora_B")) > 1e-4
    meta = load_adapter(str(broken / EMA_ROOT), 8)[1]
    assert meta["ema"] == {"decay": 0.75, "step": 8, "over": "lora_factors"}
    assert [r["loss"] for r in read_metrics(str(broken))] == [r["loss"] for r in read_metrics(str(straight))]


# ------------------------------------------------------------------------ decay 0, candidates, evaluation


@pytest.fixture(scope="module")
def ema0_run(tmp_path_factory):
    """A 3-step SFT run with ema.decay=0 on the launcher tests' tiny model folder (checkpoints at 2 and 3), and
    that folder's problems."""
    from configs import sft_tiny
    from jaxrl.algorithms.run import run_training
    root = tmp_path_factory.mktemp("ema0")
    env = build(root / "env", n_problems=9)
    cfg = sft_tiny.get_config()
    cfg.tensorboard, cfg.checkpoint_async = False, False
    cfg.compile_options = {"xla_backend_optimization_level": 0}
    cfg.model_path = env["model"]
    cfg.steps, cfg.checkpoint_every, cfg.data.seq_len = 3, 2, 16
    cfg.lora.targets = "q_proj,down_proj"
    cfg.ema.decay = 0.0
    workdir = root / "run"
    run_training(cfg, str(workdir))
    return env, workdir


def test_decay_zero_writes_the_checkpoint_itself_as_its_ema(ema0_run):
    from jaxrl.models.peft import read_adapter
    _, workdir = ema0_run
    assert sorted(os.listdir(workdir / EMA_ROOT)) == ["2", "3"]
    for step in (2, 3):
        params = assert_same_adapters(str(workdir), str(workdir / EMA_ROOT), step)
        assert any(np.abs(params[n]).max() > 0 for n in params if n.endswith("lora_B"))  # it trained
        ema = read_adapter(str(workdir / EMA_ROOT / str(step)))
        assert ema.average == {"kind": "ema", "decay": 0.0, "step": step, "over": "lora_factors"}
        assert ema.digest() == read_adapter(str(workdir), step).digest()


@pytest.mark.slow  # an evaluation (the sampler's compile) of the tiny model in this process
@pytest.mark.heavy  # minutes of the fast tier (make test-heavy, CI run it)
def test_ema_and_averaged_adapters_are_candidates_counted_in_the_family_and_drawn_in_the_report(ema0_run, tmp_path):
    from jaxrl.data.problems import load_problems
    from jaxrl.data.splits import freeze_splits
    from jaxrl.diagnostics.report import build_report
    from jaxrl.evaluation import protocol as P
    from jaxrl.evaluation.runner import EvalConfig, Evaluator, checkpoint_specs
    from jaxrl.export import export_average
    from jaxrl.models.adapters import CheckpointNotFound
    env, workdir = ema0_run
    average = export_average(str(workdir), None, None, average="last:2", overwrite=True)
    assert average["out"] == str(workdir / "averages" / "avg_2-3")

    specs = checkpoint_specs(str(workdir))
    assert [s.name for s in specs] == ["step_2", "step_3", "ema_2", "ema_3", "avg_2-3"]
    assert {s.name: s.path for s in specs}["ema_3"] == str(workdir / EMA_ROOT / "3")
    assert checkpoint_specs(str(workdir / EMA_ROOT)) == specs  # the run's ema/ folder names the same run
    assert [s.name for s in checkpoint_specs(str(workdir), ["ema_3", "avg_2-3", 2])] == ["ema_3", "avg_2-3", "step_2"]
    with pytest.raises(CheckpointNotFound, match="no candidate ema_7.*present: step_2, step_3, ema_2, ema_3, avg_2-3"):
        checkpoint_specs(str(workdir), ["ema_7"])

    # --role=select on a dev split: the EMA and the average are candidates like step_2
    splits = tmp_path / "splits"
    freeze_splits(load_problems(env["problems"]), splits, seed=0)
    out = workdir / "eval"
    P.write_protocol(out, {"role": "selection", "split": P.split_identity(splits / "dev.jsonl")})
    chosen = [s for s in specs if s.name in ("step_2", "ema_3", "avg_2-3")]
    ev = Evaluator(EvalConfig(problems=str(splits / "dev.jsonl"), base=env["model"], out=str(out), models=chosen,
                              num_samples=2, temperature=1.0, max_new_tokens=8, max_prompt_len=192,
                              prompt_buckets=(192,), reward="test_ema:vowel_reward", batch_size=4, dtype="float32",
                              seed=3, n_resamples=200, progress=False))
    try:
        results = ev.run()
    finally:
        ev.close()
    models = results["models"]
    assert models["ema_3"]["average"] == {"kind": "ema", "decay": 0.0, "step": 3, "over": "lora_factors"}
    assert models["avg_2-3"]["average"]["steps"] == [2, 3] and models["step_2"]["average"] is None
    assert models["ema_3"]["adapter_digest"] == ev.adapter("ema_3").digest()
    assert sorted(results["family"]["models"]) == ["avg_2-3", "ema_3", "step_2"]
    selection = P.write_selection(out, results, base=env["model"])
    assert selection["n_candidates"] == 3

    report = build_report(str(workdir), eval_dir=str(out)).read_text()
    assert "EMA at 3" in report and "mean of 2, 3" in report  # beside the steps in the checkpoint curves
    assert "3 models against the baseline, 2 of them averaged checkpoints" in report
