"""The one generation path (jaxrl.rollout.collect): offline rollouts, online GRPO/PPO rollouts and evaluation
decode and score the same text for the same tokens; the resumable writer refuses without touching files."""

import json
from pathlib import Path

import jax.numpy as jnp
import ml_collections
import pytest

from jaxrl.models import qwen35
from jaxrl.models.qwen35.config import tiny
from jaxrl.rewards.base import RewardResult
from jaxrl.backends import Generation, ModelSpec, SamplingParams
from jaxrl.data.chat import load_tokenizer
from jaxrl.generation.stopping import completion_text as decode_completion
from jaxrl.rollout.collect import Collector
from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
from jaxrl.rollout.writer import ResumableJsonl
from jaxrl.utils.io import ResumeError
from test_evaluate import numpy_init

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "jaxrl" / "assets" / "tasks" / "problems.jsonl"
CAP, N = 24, 4  # the near-uniform random model below stops within 24 tokens in about one sample of six
REWARD = "test_generation_path:text_reward"


def text_reward(completion, problem):
    """A reward that changes with every character of the text: a decoding difference changes the score."""
    return (sum(map(ord, completion)) % 97) / 96


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("generation_path")
    problems = [json.loads(line) for line in TASKS.read_text().splitlines()[:4]]
    path = root / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in problems))
    model_dir = str(root / "model")
    cfg = tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    qwen35.save_pretrained(numpy_init(cfg), model_dir, base_dir=None, layout="container")
    build_tiny_tokenizer(model_dir, [m["content"] for p in problems for m in p["messages"]])
    return {"root": root, "problems": str(path), "model_dir": model_dir, "ids": [p["id"] for p in problems],
            "model": qwen35.from_pretrained(model_dir, dtype=jnp.float32), "tokenizer": load_tokenizer(model_dir)}


@pytest.mark.slow
def test_rollouts_online_and_evaluation_score_the_same_text(env):
    """The same samples (same keys: seed, problem key, sample index) through the three consumers: same tokens,
    same text, same reward, sample for sample."""
    from jaxrl.algorithms.online.rollouts import Rollouts
    from jaxrl.algorithms.run import resolve_config
    from jaxrl.evaluation.runner import EvalConfig, Evaluator
    from jaxrl.rollout.runner import RolloutConfig, run_rollouts

    config = resolve_config(ml_collections.ConfigDict({
        "seed": 0, "model_path": env["model_dir"], "algorithm": "grpo",
        "data": {"source": "problems", "problems": env["problems"], "max_prompt_len": 192},
        "grpo": {"max_new_tokens": CAP, "num_generations": N, "temperature": 1.0, "top_p": 1.0},
        "reward": {"name": REWARD, "score": "partial"}}))
    engine = Rollouts(config, env["model"], None, prompts_per_rollout=len(env["ids"]), sampling=config.grpo)
    engine.open(str(env["root"]), env["model"])
    sampled = engine.run(env["model"], 0)
    problems = engine.source.prompts(0, len(env["ids"]))[1]
    assert sorted(p.id for p in problems) == sorted(env["ids"])  # rollout 0 covers every problem once

    common = dict(max_new_tokens=CAP, max_prompt_len=192, prompt_buckets=(192,), temperature=1.0,
                  seed=engine.sample_seed(0), dtype="float32", progress=False)
    out = env["root"] / "rollouts.jsonl"
    run_rollouts(RolloutConfig(problems=env["problems"], model=env["model_dir"], out=str(out), num_samples=N,
                               reward=REWARD, batch_size=8, **common),
                 model=env["model"], tokenizer=env["tokenizer"])
    offline = {(r["problem_id"], r["sample_index"]): r for r in map(json.loads, out.read_text().splitlines())}

    ev = Evaluator(EvalConfig(problems=env["problems"], base=env["model_dir"], out=str(env["root"] / "eval"),
                              num_samples=N, reward=REWARD, batch_size=8, n_resamples=200, **common),
                   model=env["model"], tokenizer=env["tokenizer"])
    try:
        evaluated = {(r["problem_id"], r["sample_index"]): r for r in ev.sample_model("base")}
    finally:
        ev.close()

    assert len(offline) == len(evaluated) == len(problems) * N
    for j, problem in enumerate(problems):
        for i in range(N):
            row, key = j * N + i, (problem.id, i)
            n = int(sampled.lengths[row])
            online_tokens = sampled.input_ids[row, 192:192 + n].tolist()
            assert offline[key]["completion_tokens"] == evaluated[key]["completion_tokens"] == n, key
            assert offline[key]["finish_reason"] == evaluated[key]["finish_reason"], key
            assert bool(sampled.truncated[row]) == (offline[key]["finish_reason"] == "length"), key
            text = decode_completion(env["tokenizer"], online_tokens, engine.stop_ids)
            assert offline[key]["completion"] == evaluated[key]["completion"] == text, key
            expected = 0.0 if sampled.truncated[row] else text_reward(text, problem)  # truncated samples score 0
            assert offline[key]["reward"]["partial"] == evaluated[key]["partial"] == pytest.approx(
                float(sampled.rewards[row])) == pytest.approx(expected), key
    # not trivially equal: different samples say different things, and the stop-token rule was exercised
    assert len({r["completion"] for r in offline.values()}) == len(offline)
    assert any(r["finish_reason"] == "stop" for r in offline.values())


def test_decoding_drops_only_a_final_stop_id(env):
    tok = env["tokenizer"]
    body = tok("print(1)", add_special_tokens=False)["input_ids"]
    stop = {1}
    assert decode_completion(tok, body + [1], stop) == "print(1)"
    # A completion a backend reports as "stop" whose last token is not a stop id (a stop string, or an engine
    # that leaves the stop token out) keeps every token: evaluation and rollouts decode it alike.
    assert decode_completion(tok, body, stop) == "print(1)"
    assert decode_completion(None, [17, 42, 1], stop) == "17 42"
    assert decode_completion(None, [17, 1, 42], stop) == "17 1 42"  # only the final token is a stop


class _Recorder:
    def __init__(self):
        self.seen = []

    def score(self, completions, problems, truncated=None):
        self.seen.append((list(completions), list(truncated)))
        return [RewardResult(partial=0.5, strict=False, tests=[]) for _ in completions]


class _FixedBackend:
    """A backend that returns fixed generations: the collector's own logic under test, not a sampler's."""
    name = "fixed"

    def __init__(self, gens):
        self.gens, self.closed = gens, False

    def generate(self, prompts, group_ids, sampling):
        return list(self.gens)

    def close(self):
        self.closed = True


def test_collector_keeps_wanted_samples_and_passes_truncation():
    gens = [Generation([5, 6, 1], "stop", 0, 0, [-1.0, -2.0, -0.5]), Generation([7, 8], "length", 0, 1),
            Generation([9, 1], "stop", 1, 0)]
    reward = _Recorder()
    backend = _FixedBackend(gens)
    collector = Collector(backend, reward, tokenizer=None, stop_ids=(1,))
    samples = collector.collect([[3], [4]], [11, 12], ["p0", "p1"], SamplingParams(n=2, max_new_tokens=3),
                                wanted=lambda j, i: (j, i) != (1, 0))
    assert [(s.prompt_index, s.sample_index, s.text, s.truncated) for s in samples] == [
        (0, 0, "5 6", False), (0, 1, "7 8", True)]
    assert samples[0].logprobs == [-1.0, -2.0, -0.5] and samples[1].logprobs is None
    assert reward.seen == [(["5 6", "7 8"], ["stop", "length"])]  # only the wanted samples are scored
    assert set(collector.last_times) == {"sample_s", "score_s"}
    collector.close()
    assert backend.closed
    with pytest.raises(ValueError, match="2 prompts but 1 problems"):
        collector.collect([[3], [4]], [11, 12], ["p0"], SamplingParams())


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -1.0, "temperature must be a finite number >= 0"), ("top_p", 0.0, "top_p must be in"),
    ("top_k", -2, "top_k must be >= 0"), ("n", 0, "n \\(samples per prompt\\) must be >= 1"),
    ("max_new_tokens", 0, "max_new_tokens must be >= 1"), ("temperature", float("nan"), "temperature")])
def test_sampling_params_refuse_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_model_spec_names_are_file_names():
    with pytest.raises(ValueError, match="kind must be one of"):
        ModelSpec("x", "merged")
    with pytest.raises(ValueError, match="needs a path"):
        ModelSpec("x", "adapter")
    with pytest.raises(ValueError, match="not usable as a file name"):
        ModelSpec("../x", "base")


def test_writer_refuses_other_settings_without_touching_files(tmp_path):
    path = tmp_path / "out.jsonl"
    log = ResumableJsonl(path, {"seed": 1, "temperature": 1.0}, compare=("seed", "temperature"), what="rollouts")
    assert log.read() == []
    log.start()
    log.append([{"problem_id": "a", "sample_index": 0}, {"problem_id": "a", "sample_index": 1}])
    log.close()
    with open(path, "a") as f:
        f.write('{"problem_id": "b", "sam')  # a torn last line, as a kill mid-write leaves it
    before = (path.read_bytes(), log.meta_path.read_bytes())

    other = ResumableJsonl(path, {"seed": 1, "temperature": 0.5}, compare=("seed", "temperature"), what="rollouts")
    with pytest.raises(ResumeError, match="temperature: 1.0 -> 0.5"):
        other.read()
    assert (path.read_bytes(), log.meta_path.read_bytes()) == before  # a refusal writes nothing

    same = ResumableJsonl(path, {"seed": 1, "temperature": 1.0}, compare=("seed", "temperature"), what="rollouts")
    assert [r["sample_index"] for _, r in same.read()] == [0, 1]  # the torn line is not a record ...
    assert path.read_bytes() == before[0]  # ... and reading does not cut it yet
    same.start()  # starting the resumed run does
    same.append([{"problem_id": "b", "sample_index": 0}])
    meta = same.finish({"samples_written": 1})
    assert [json.loads(line)["problem_id"] for line in path.read_text().splitlines()] == ["a", "a", "b"]
    assert meta["status"] == "complete" and json.loads(same.meta_path.read_text())["samples_written"] == 1

    orphan = tmp_path / "orphan.jsonl"
    orphan.write_text('{"problem_id": "a", "sample_index": 0}\n')
    with pytest.raises(ResumeError, match="settings of its rollouts are unknown"):
        ResumableJsonl(orphan, {}, compare=(), what="rollouts").read()


def test_rollouts_refuse_bad_values_before_any_work(env, tmp_path):
    from jaxrl.rollout.runner import RolloutConfig, run_rollouts
    out = tmp_path / "r.jsonl"
    for bad, message in ((dict(temperature=-1.0), "temperature must be a finite number >= 0"),
                         (dict(batch_size=0), "batch_size must be >= 1"),
                         (dict(num_samples=0), "must be >= 1")):
        cfg = RolloutConfig(problems=env["problems"], model=env["model_dir"], out=str(out), progress=False,
                            **bad)
        with pytest.raises(ValueError, match=message):
            run_rollouts(cfg)
        assert not out.exists() and not Path(str(out) + ".meta.json").exists()
