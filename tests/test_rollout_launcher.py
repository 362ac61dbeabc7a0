"""launchers/rollout.py and its runner: records, resuming after a crash, over-long prompts, the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jax.numpy as jnp

from jaxrl.utils.io import read_jsonl
from jaxrl.models import qwen35
from jaxrl.models.qwen35.config import tiny
from jaxrl.data.chat import PromptTooLongError, load_tokenizer
from jaxrl.rollout.runner import ResumeError, RolloutConfig, run_rollouts
from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "jaxrl" / "assets" / "tasks" / "problems.jsonl"
K = 4
INTERFACE_KEYS = {"problem_id", "sample_index", "completion", "completion_tokens", "finish_reason", "reward",
                  "model"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny container checkpoint with a tiny tokenizer, a problems file with one over-long problem, and the
    loaded model/tokenizer (shared so the runs below reuse one compiled program)."""
    root = tmp_path_factory.mktemp("rollout_launcher")
    problems = [json.loads(line) for line in TASKS.read_text().splitlines()[:3]]
    long = dict(problems[0], id="toy/too_long",
                messages=[{"role": "user", "content": problems[0]["messages"][0]["content"] * 3}])
    path = root / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in problems[:2] + [long] + problems[2:]))
    model_dir = str(root / "model")
    cfg = tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))  # half the compile time
    qwen35.save_pretrained(qwen35.init_model(cfg, seed=0), model_dir, base_dir=None, layout="container")
    build_tiny_tokenizer(model_dir, [m["content"] for p in problems for m in p["messages"]])
    model = qwen35.from_pretrained(model_dir, dtype=jnp.float32)
    return {"root": root, "problems": str(path), "model_dir": model_dir, "model": model,
            "tokenizer": load_tokenizer(model_dir), "ids": [p["id"] for p in problems]}


def config(env, out, **kw):
    base = dict(problems=env["problems"], model=env["model_dir"], out=str(out), num_samples=K, temperature=1.0,
                max_new_tokens=8, max_prompt_len=192, prompt_buckets=(192,), batch_size=1, reward="exact_match",
                seed=3, dtype="float32", progress=False,
                mesh_shape=(1, 1, 1))  # one device, one engine slot: a call takes 4 slots' worth of rows
    # (JaxBackend's collect_factor), K = 4: a written batch is one problem
    base.update(kw)
    return RolloutConfig(**base)


def run(env, cfg, **kw):
    return run_rollouts(cfg, model=env["model"], tokenizer=env["tokenizer"], **kw)


def by_key(records):
    return {(r["problem_id"], r["sample_index"]): r for r in records}


@pytest.mark.heavy
@pytest.mark.slow
def test_records_resume_and_settings(env):
    full_out = env["root"] / "full.jsonl"
    summary = run(env, config(env, full_out))
    full = read_jsonl(full_out)
    assert len(full) == 3 * K and len(by_key(full)) == 3 * K
    assert {r["problem_id"] for r in full} == set(env["ids"])
    assert summary["skipped_overlong"] == [{"problem_id": "toy/too_long",
                                            "prompt_tokens": summary["skipped_overlong"][0]["prompt_tokens"]}]
    assert summary["skipped_overlong"][0]["prompt_tokens"] > 192
    problems = {json.loads(line)["id"]: json.loads(line) for line in Path(env["problems"]).read_text().splitlines()}
    for r in full:
        assert INTERFACE_KEYS <= set(r)
        assert r["finish_reason"] in ("stop", "length") and r["truncated"] == (r["finish_reason"] == "length")
        assert 1 <= r["completion_tokens"] <= 8
        assert r["finish_reason"] == "stop" or r["completion_tokens"] == 8
        assert set(r["reward"]) >= {"partial", "strict"} and 0.0 <= r["reward"]["partial"] <= 1.0
        assert r["max_new_tokens"] == 8 and r["messages"] == problems[r["problem_id"]]["messages"]
        assert r["model"] == "model"
        if r["truncated"]:
            assert r["reward"]["reason"] == "truncated"
    assert summary["samples_written"] == 3 * K
    samples = [tuple(r["completion"] for r in full if r["problem_id"] == pid) for pid in env["ids"]]
    assert all(len(set(s)) > 1 for s in samples)  # K samples of a problem are not one sample repeated

    # A run killed after its first problem, whose next record was cut mid-line ...
    out = env["root"] / "resumed.jsonl"

    def crash(progress):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(env, config(env, out), on_batch=crash)
    lines = out.read_text().splitlines(keepends=True)
    assert len(lines) == K
    # ... and lost half of its first problem's records (a crash between two group writes of an older version).
    torn = json.dumps(full[0])[:37]
    out.write_text("".join(lines[:2]) + torn)
    summary = run(env, config(env, out))
    assert summary["samples_resumed"] == 2 and summary["samples_written"] == 3 * K - 2
    resumed = read_jsonl(out)
    assert len(resumed) == 3 * K
    assert by_key(resumed) == by_key(full)  # exactly the uninterrupted run's samples, nothing lost or repeated

    # A finished file resumes to a no-op; other settings are refused instead of mixed in.
    assert run(env, config(env, out))["samples_written"] == 0
    with pytest.raises(ResumeError, match="temperature: 1.0 -> 0.5"):
        run(env, config(env, out, temperature=0.5))


def test_overlong_policy_error(env):
    with pytest.raises(PromptTooLongError, match="toy/too_long"):
        run(env, config(env, env["root"] / "err.jsonl", on_overlong="error"))


@pytest.mark.heavy
@pytest.mark.slow
def test_cli(env):
    """The absl launcher end to end in a fresh process: flags, model and tokenizer loading, progress bar."""
    out = env["root"] / "cli.jsonl"
    cmd = [sys.executable, "-m", "launchers.rollout", f"--problems={env['problems']}",
           f"--model={env['model_dir']}", f"--out={out}", "--num_samples=2", "--max_new_tokens=4",
           "--max_prompt_len=192", "--prompt_buckets=192", "--batch_size=2", "--limit=1", "--dtype=float32",
           "--reward=exact_match", "--temperature=0.7", "--top_p=0.9"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, XLA_FLAGS=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out)
    assert [(r["problem_id"], r["sample_index"]) for r in records] == [(env["ids"][0], 0), (env["ids"][0], 1)]
    assert "samples/s" in proc.stderr and "tokens/s" in proc.stderr
    meta = json.loads((env["root"] / "cli.jsonl.meta.json").read_text())
    assert meta["status"] == "complete" and meta["samples_written"] == 2
