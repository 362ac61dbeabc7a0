"""Non-finite masking inside the jitted step, driven through the real Trainer loop with injected faults."""

import json
import os

import numpy as np
import pytest

import jax

from configs import sft_tiny
from jaxrl.parallel.mesh import make_mesh
from jaxrl.models.adapters import load_adapter
from jaxrl.train.checkpoints import RunCheckpoints
from jaxrl.algorithms.run import build_model, resolve_config
from jaxrl.train.loop import NonFiniteError, Trainer
from jaxrl.train.metrics import read_metrics
from jaxrl.algorithms.sft_task import SFTTask

NAN, INF = float("nan"), float("inf")
# 0-based step -> (added to the loss, added to the in_proj_qkv gradients)
FAULTS = {1: (NAN, 0.0), 3: (0.0, INF), 5: (NAN, 0.0), 6: (0.0, NAN)}


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_counted_and_the_limit_stops_with_a_checkpoint(tmp_path):
    cfg = sft_tiny.get_config()
    cfg.steps = 10
    cfg.checkpoint_every = 4
    cfg.max_consecutive_nonfinite = 2
    cfg.checkpoint_async = False
    cfg.tensorboard = False
    cfg.data.seq_len = 16
    cfg.lora.targets = "in_proj_qkv,down_proj"  # one layer, two adapters: a short compile
    cfg.model_overrides.num_hidden_layers = 1
    cfg.model_overrides.layer_types = ("linear_attention",)
    cfg.compile_options.xla_backend_optimization_level = 0  # and a quicker one
    cfg = resolve_config(cfg)
    model = build_model(cfg)
    snapshots = {}

    def snapshot(done, trainer):
        s = jax.device_get(trainer.state)
        snapshots[done] = (s.params, jax.tree.leaves(s.opt_state), int(s.opt_step))

    workdir = str(tmp_path / "run")
    trainer = Trainer(cfg, model, SFTTask(cfg, vocab_size=256), workdir, mesh=make_mesh((1, 1, 1)),
                      fault_fn=lambda step: FAULTS.get(step), fault_group="in_proj_qkv", on_step_end=snapshot)
    with pytest.raises(NonFiniteError, match=r"2 non-finite updates in a row \(max_consecutive_nonfinite=2\)"):
        trainer.run()
    snapshot(7, trainer)  # the stop raised before the step-end hook of step 7

    records = {r["step"]: r for r in read_metrics(workdir)}
    assert sorted(records) == list(range(1, 8))  # stopped after step 7 (steps 6 and 7 both skipped)
    assert [records[s]["update_skipped"] for s in range(1, 8)] == [0, 1, 0, 1, 0, 1, 1]
    assert [records[s]["skipped_updates"] for s in range(1, 8)] == [0, 1, 1, 2, 2, 3, 4]
    assert records[5]["nonfinite_consecutive"] == 0 and records[7]["nonfinite_consecutive"] == 2
    # loss fault: the loss is NaN, the gradients are fine; gradient fault: exactly the in_proj_qkv group
    assert records[2]["nonfinite_reason"] == "loss is nan" and records[2]["nonfinite_groups"] == []
    assert records[2]["loss"] is None and records[2]["loss_finite"] is False
    assert records[4]["loss_finite"] is True and records[4]["nonfinite_groups"] == ["in_proj_qkv"]
    assert records[4]["nonfinite_reason"] == "non-finite gradients in in_proj_qkv"
    assert records[4]["update_norm"] == 0.0 and records[3]["update_norm"] > 0
    assert all(records[s]["nonfinite_groups"] == [] for s in (1, 3, 5))

    for skipped in (2, 4, 6, 7):  # parameters, optimizer state and schedule position bit-identical
        (p0, o0, s0), (p1, o1, s1) = snapshots[skipped - 1], snapshots[skipped]
        assert s0 == s1
        for name in p0:
            np.testing.assert_array_equal(p0[name], p1[name])
        for a, b in zip(o0, o1):
            np.testing.assert_array_equal(a, b)
    for applied in (3, 5):  # and training goes on
        assert snapshots[applied][2] == snapshots[applied - 1][2] + 1
        assert any(not np.array_equal(snapshots[applied][0][n], snapshots[applied - 1][0][n])
                   for n in snapshots[applied][0])
    # the schedule did not move across the skipped step: step 3 uses the rate step 2 would have used
    assert records[3]["learning_rate"] == records[2]["learning_rate"] > records[1]["learning_rate"]

    # the stop saved a checkpoint of step 7 (state and adapter), beside the cadence one of step 4
    ckpt = RunCheckpoints(workdir, keep=2, async_save=False)
    assert ckpt.latest_step() == 7 and ckpt.adapter_steps() == [4, 7]
    ckpt.close()
    params, meta = load_adapter(workdir)
    assert meta["step"] == 7 and meta["lora"]["rank"] == cfg.lora.rank
    for name, value in params.items():
        np.testing.assert_array_equal(value, snapshots[7][0][name])
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["max_consecutive_nonfinite"] == 2
