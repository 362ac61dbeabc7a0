"""Offline rollouts and evaluation with the JAX backend over every device: the rows of each batch split over the
data axis of a mesh of all local devices and, with jax.distributed, the problems over processes. Each sample
depends only on (seed, problem id, sample index), so 1 device, 8 devices of one process and 2 processes x 4
devices write the same samples, token for token, into one output file; a run of two processes killed mid-way
resumes each process's part and ends with the same file.

The one-process comparisons run in this process (conftest fakes 8 CPU devices); the two-process ones start the
launchers as a user starts them on two hosts (tests/multihost.py), against a one-process one-device launch with
the same XLA flags.
"""

import json
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multihost
from test_evaluate import numpy_init
from jaxrl.data import formats
from jaxrl.data.chat import load_tokenizer
from jaxrl.models import qwen35
from jaxrl.models.qwen35.config import tiny
from jaxrl.rollout.runner import RolloutConfig, run_rollouts
from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
from jaxrl.utils.io import read_jsonl

TASKS = multihost.ROOT / "jaxrl" / "assets" / "tasks" / "problems.jsonl"

N, CAP = 2, 12
REWARD = "test_evaluate:vowel_reward"  # sleeps JAXRL_TEST_REWARD_SLEEP seconds a sample: a run slow enough to kill
COPIES = 2  # the 9 toy problems twice (other ids): 18 problems, 9 a process, several batches each


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_rollouts")
    base = [json.loads(line) for line in TASKS.read_text().splitlines()]
    problems = [dict(p, id=f"{p['id']}/{c}") for c in range(COPIES) for p in base]
    path = root / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in problems))
    model_dir = str(root / "model")
    cfg = tiny(num_hidden_layers=1, layer_types=("full_attention",))
    qwen35.save_pretrained(numpy_init(cfg), model_dir, base_dir=None, layout="container")
    build_tiny_tokenizer(model_dir, [m["content"] for p in problems for m in p["messages"]])
    return {"root": root, "problems": str(path), "model_dir": model_dir, "ids": [p["id"] for p in problems],
            "model": qwen35.from_pretrained(model_dir, dtype=jnp.float32), "tokenizer": load_tokenizer(model_dir)}


def rollout_config(env, out, mesh_shape, **kw):
    base = dict(problems=env["problems"], model=env["model_dir"], out=str(out), num_samples=N, temperature=1.0,
                max_new_tokens=CAP, max_prompt_len=192, prompt_buckets=(192,), batch_size=4, reward=REWARD,
                seed=3, dtype="float32", progress=False, save_logprobs=True, mesh_shape=mesh_shape)
    base.update(kw)
    return RolloutConfig(**base)


def key(r):
    return r["problem_id"], r["sample_index"]


def assert_same_rollouts(got, want):
    """The same samples in the same order, token for token; logprobs within float rounding (a row's sums run
    over other batch shapes)."""
    assert [key(r) for r in got] == [key(r) for r in want]
    for a, b in zip(got, want):
        assert a["token_ids"] == b["token_ids"], key(a)
        assert {k: v for k, v in a.items() if k != "logprobs"} == {k: v for k, v in b.items() if k != "logprobs"}
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-4, err_msg=str(key(a)))


@pytest.mark.slow  # a rollout run per mesh
def test_rollouts_on_eight_devices_equal_one_device(env):
    assert jax.local_device_count() == 8, "tests/conftest.py fakes 8 CPU devices"
    runs = {}
    for name, shape in (("one", (1, 1, 1)), ("eight", (-1, 1, 1))):
        out = env["root"] / f"{name}.jsonl"
        summary = run_rollouts(rollout_config(env, out, shape), model=env["model"], tokenizer=env["tokenizer"])
        runs[name] = (summary, read_jsonl(out))
    (one_summary, one), (eight_summary, eight) = runs["one"], runs["eight"]
    assert one_summary["devices"] == 1 and eight_summary["devices"] == 8  # the rows really were split over 8
    assert len(one) == len(env["ids"]) * N
    assert_same_rollouts(eight, one)


@pytest.mark.slow  # an evaluation per mesh
def test_evaluation_on_eight_devices_equals_one_device(env):
    from jaxrl.evaluation.runner import EvalConfig, Evaluator
    results = {}
    for name, shape in (("one", (1, 1, 1)), ("eight", (-1, 1, 1))):
        cfg = EvalConfig(problems=env["problems"], base=env["model_dir"], out=str(env["root"] / f"eval_{name}"),
                         num_samples=N, temperature=1.0, max_new_tokens=CAP, max_prompt_len=192,
                         prompt_buckets=(192,), reward=REWARD, batch_size=4, dtype="float32", seed=3,
                         n_resamples=200, progress=False, mesh_shape=shape)
        ev = Evaluator(cfg, model=env["model"], tokenizer=env["tokenizer"])
        results[name] = ev.run()
        assert ev.backend.mesh.devices.size == (1 if name == "one" else 8)
        ev.close()
    one = formats.read_samples(formats.samples_path(env["root"] / "eval_one", "base"))
    eight = formats.read_samples(formats.samples_path(env["root"] / "eval_eight", "base"))
    assert len(one) == len(env["ids"]) * N and eight == one
    assert results["eight"]["models"] == results["one"]["models"]


# ----------------------------------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xla_cache_sharded")


def rollout_args(env, out):
    return [f"--problems={env['problems']}", f"--model={env['model_dir']}", f"--out={out}", f"--num_samples={N}",
            "--temperature=1.0", f"--max_new_tokens={CAP}", "--max_prompt_len=192", "--prompt_buckets=192",
            "--batch_size=4", f"--reward={REWARD}", "--seed=3", "--dtype=float32", "--save_logprobs",
            "--noprogress"]


def lines(path):
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.heavy
@pytest.mark.slow
def test_rollouts_over_two_processes_equal_one_device_and_resume_per_part(env, tmp_path, cache):
    ref_out, out = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    codes = multihost.run(tmp_path, "launchers.rollout", rollout_args(env, ref_out), processes=1, devices=1,
                          cache_dir=cache, name="one")
    assert codes == [0], multihost.tail(tmp_path, "one", 1)

    # Two processes of 4 devices, slowed by the reward, killed once both have written part of their share.
    parts = [out.with_name(out.name + ".parts") / f"part-{i:05d}-of-00002.jsonl" for i in range(2)]
    with multihost.job(tmp_path, "launchers.rollout", rollout_args(env, out), processes=2, devices=4,
                       cache_dir=cache, name="killed", env={"JAXRL_TEST_REWARD_SLEEP": "0.3"}) as procs:
        deadline = time.time() + 600
        while time.time() < deadline and not all(lines(p) >= N for p in parts):
            assert all(p.poll() is None for p in procs), multihost.tail(tmp_path, "killed", 2)
            time.sleep(0.05)
        for p in procs:
            p.send_signal(signal.SIGKILL)
        codes = multihost.wait(procs, 60)
    assert codes == [-signal.SIGKILL] * 2
    assert not out.exists() or lines(out) == 0  # nothing merged yet: every sample so far is in a part
    kept = {i: parts[i].read_text().count("\n") for i in range(2)}  # whole records (a torn last one is cut)
    assert 0 < sum(lines(p) for p in parts) < len(env["ids"]) * N

    codes = multihost.run(tmp_path, "launchers.rollout", rollout_args(env, out), processes=2, devices=4,
                          cache_dir=cache, name="resumed")
    assert codes == [0, 0], multihost.tail(tmp_path, "resumed", 2)
    assert not parts[0].parent.exists()  # merged into the one output file, then removed
    assert_same_rollouts(read_jsonl(out), read_jsonl(ref_out))
    meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
    assert meta["status"] == "complete" and meta["samples_resumed"] == sum(kept.values())
    assert meta["samples_written"] + meta["samples_resumed"] == len(env["ids"]) * N
    assert [p["devices"] for p in meta["processes"]] == [4, 4]
    for i in range(2):  # each process resumed its own part: what it had written before the kill, not redrawn
        assert meta["processes"][i]["samples_resumed"] == kept[i]


@pytest.mark.heavy
@pytest.mark.slow
def test_evaluation_over_two_processes_equals_one_device(env, tmp_path, cache):
    def args(out):
        return [f"--problems={env['problems']}", f"--base={env['model_dir']}", f"--out={out}",
                f"--num_samples={N}", "--temperature=1.0", f"--max_new_tokens={CAP}", "--max_prompt_len=192",
                "--prompt_buckets=192", "--batch_size=4", f"--reward={REWARD}", "--dtype=float32", "--seed=3",
                "--n_resamples=200", "--noprogress"]
    for name, processes, devices in (("one", 1, 1), ("two", 2, 4)):
        codes = multihost.run(tmp_path, "launchers.evaluate", args(tmp_path / name), processes=processes,
                              devices=devices, cache_dir=cache, name=f"eval_{name}")
        assert codes == [0] * processes, multihost.tail(tmp_path, f"eval_{name}", processes)
    one = formats.read_samples(formats.samples_path(tmp_path / "one", "base"))
    two = formats.read_samples(formats.samples_path(tmp_path / "two", "base"))
    assert len(one) == len(env["ids"]) * N and two == one
    assert formats.read_results(tmp_path / "two")["models"] == formats.read_results(tmp_path / "one")["models"]
    assert not (tmp_path / "two" / "cache" / "base.jsonl.parts").exists()
    assert len(read_jsonl(tmp_path / "two" / "cache" / "base.jsonl")) == len(one)
