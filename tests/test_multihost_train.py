"""Training over two processes (jax.distributed, localhost coordinator, gloo CPU collectives), four fake devices
each, one 8-device global mesh: `launchers.train` started as a user starts it on two hosts, for DPO and GRPO.

Each case runs the same config four times: on one process with 8 devices; on two processes; on two processes with
process 0 killed (SIGKILL) after step 3, which takes process 1 down with it; and both restarted. Shown:
  * both processes write the Orbax checkpoints together (a save over several processes used to fail on colliding
    barrier names) and resume from them: the killed-and-restarted run ends bit-identical to the uninterrupted one,
    adapters of every step and every metric;
  * the two-process adapter equals the one-process one within float rounding (the cross-process all-reduce sums
    in another order); the measured difference is printed;
  * process 0 alone writes metrics.jsonl (each step once), TensorBoard (one event file per launch), config.json;
  * GRPO: the rollout is sampled over the 8-device mesh of both processes (each reads back every row), and the
    resume lands inside a rollout, whose buffer process 0 wrote and both processes read.
"""

import json
import os
import re

import numpy as np
import pytest

import multihost
from jaxrl.models.adapters import load_adapter
from jaxrl.train.checkpoints import RunCheckpoints
from jaxrl.train.metrics import read_metrics

pytestmark = pytest.mark.heavy  # two processes, a kill and a resume, per algorithm

MESH = ["--config.mesh.shape=(1,8,1)"]
CASES = {
    # 8 pairs a step, split over 8 devices; checkpoints at 2 and 4; killed after 3 -> resumes from 2
    "dpo": (["--config=configs/dpo_tiny.py", *MESH, "--config.batch.micro_batch_size=8", "--config.batch.grad_accum=1",
             "--config.steps=4", "--config.checkpoint_every=2"], 3, 2),
    # 64 rows a rollout, each trained on twice (num_iterations 2: a rollout spans 2 steps); checkpoints at 3 and 4;
    # killed after 3 -> resumes from 3, inside rollout 1, from its buffer rollouts/1.npz
    "grpo": (["--config=configs/grpo_tiny.py", *MESH, "--config.steps=4", "--config.checkpoint_every=3",
              "--config.grpo.num_iterations=2"], 3, 3),
}
STEPS = 4
# |two processes - one process| over every adapter factor after 4 steps (the cross-process all-reduces sum in
# another order, and Adam's first steps divide by the gradients' own magnitude, so a rounding-level gradient
# difference moves a factor by up to ~1e-4 of its step). Measured on factors of magnitude ~0.13: DPO 2.4e-7
# (0.004% of what steps 2->4 changed, 6.0e-3), GRPO 1.5e-5 (0.3% of step 4's change, 5.0e-3; GRPO also samples, recomputes the old and reference log-probs
# and normalises advantages over the 8-device mesh). The bounds leave room for other BLAS builds, and the
# difference must stay a small fraction of what one training step changes.
BOUNDS = {"dpo": 2e-6, "grpo": 5e-5}
STEP_FRACTION = 0.02
TIMEOUT = 900


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xla_cache")


def train(tmp_path, cache, name, args, processes, devices, *, workdir=None, per_process=None):
    """Exit codes of `launchers.train` on `processes` processes of `devices` devices; logs under `name`."""
    workdir = tmp_path / (workdir or name)
    return multihost.run(tmp_path, "launchers.train", [f"--workdir={workdir}", *args], timeout=TIMEOUT,
                         processes=processes, devices=devices, cache_dir=cache, name=name, per_process=per_process)


def adapters(workdir):
    ckpt = RunCheckpoints(str(workdir), async_save=False)
    steps = ckpt.adapter_steps()
    ckpt.close()
    return {s: load_adapter(str(workdir), step=s)[0] for s in steps}


def losses(workdir):
    return [(r["step"], r["loss"], r["lora_norm"]) for r in read_metrics(str(workdir)) if "loss" in r]


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_two_processes_checkpoint_resume_and_match_one_process(algorithm, tmp_path, cache):
    args, kill_after, resume_from = CASES[algorithm]
    log = lambda name, n: multihost.tail(tmp_path, name, n)  # noqa: E731

    assert train(tmp_path, cache, "one", args, 1, 8) == [0], log("one", 1)
    assert train(tmp_path, cache, "two", args, 2, 4) == [0, 0], log("two", 2)
    for i in range(2):
        assert f"done: {STEPS} steps" in multihost.log_of(tmp_path, "two", i)

    # process 0 killed after step `kill_after`: process 1 cannot go on without it and stops too
    codes = train(tmp_path, cache, "broken", args, 2, 4, per_process={0: [f"--debug_kill_after_step={kill_after}"]})
    assert codes[0] == -9 and codes[1] != 0, (codes, log("broken", 2))
    ckpt = RunCheckpoints(str(tmp_path / "broken"), async_save=False)
    assert ckpt.latest_step() == resume_from
    ckpt.close()
    assert [s for s, _, _ in losses(tmp_path / "broken")] == list(range(1, kill_after + 1))

    # both restarted: they resume from the newest checkpoint both wrote and finish
    codes = train(tmp_path, cache, "resumed", args, 2, 4, workdir="broken")
    assert codes == [0, 0], log("resumed", 2)
    for i in range(2):
        assert "resumed from" in multihost.log_of(tmp_path, "resumed", i)
        assert f"(step {resume_from})" in multihost.log_of(tmp_path, "resumed", i)
    if algorithm == "grpo":
        assert "resumed inside rollout 1: loaded" in multihost.log_of(tmp_path, "resumed", 1)

    two, broken, one = (adapters(tmp_path / n) for n in ("two", "broken", "one"))
    assert sorted(two) == sorted(broken) == sorted(one) and STEPS in two
    for step in two:  # the resumed run is the uninterrupted one, bit for bit
        assert sorted(broken[step]) == sorted(two[step])
        for name, value in two[step].items():
            np.testing.assert_array_equal(broken[step][name], value, err_msg=f"step {step} {name}")
    assert losses(tmp_path / "broken") == losses(tmp_path / "two")

    final, ref = two[STEPS], one[STEPS]
    assert any(np.abs(v).max() > 1e-3 for n, v in ref.items() if n.endswith("lora_B"))  # it trained
    diff = max(float(np.abs(final[n].astype(np.float64) - ref[n]).max()) for n in ref)
    scale = max(float(np.abs(v).max()) for v in ref.values())
    before = sorted(one)[-2]  # the checkpoint before the last: what the last steps changed
    change = max(float(np.abs(ref[n].astype(np.float64) - one[before][n]).max()) for n in ref)
    print(f"{algorithm}: |two processes - one process| <= {diff:.3g} over adapter factors of magnitude <= "
          f"{scale:.3g}; steps {before}->{STEPS} changed them by up to {change:.3g}")
    assert diff <= BOUNDS[algorithm] and diff <= STEP_FRACTION * change, (diff, change)
    # GRPO's loss is ~1e-8 on its first, on-policy steps: relative agreement there is rounding noise
    np.testing.assert_allclose([l for _, l, _ in losses(tmp_path / "two")],
                               [l for _, l, _ in losses(tmp_path / "one")], rtol=1e-5, atol=1e-6)

    # process 0 alone writes: every step's metrics once, one TensorBoard event file per launch, config.json
    for name, launches in (("two", 1), ("broken", 2)):
        workdir = tmp_path / name
        assert [s for s, _, _ in losses(workdir)] == list(range(1, STEPS + 1))
        assert len(os.listdir(workdir / "tensorboard")) == launches
        assert json.loads((workdir / "config.json").read_text())["steps"] == STEPS
    for name in ("two", "resumed"):  # progress lines: process 0 only
        assert re.search(r"step \d/4  loss", multihost.log_of(tmp_path, name, 0))
        assert not re.search(r"step \d/4  loss", multihost.log_of(tmp_path, name, 1))
