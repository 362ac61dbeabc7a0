"""The difficulty record and the curriculum (jaxrl/algorithms/online/difficulty.py, `data.sampler`): on a pool of
always-solved, learnable and never-solved prompts the curriculum at least halves the share of zero-variance groups
that uniform sampling trains on at equal steps, each prompt's record survives a SIGKILL and the resumed run is bit
for bit the uninterrupted one, and the histogram is logged."""

import json
from pathlib import Path

import numpy as np
import pytest

from jaxrl.algorithms.online.difficulty import Difficulty

HERE = Path(__file__).resolve().parent


def test_the_record_classifies_and_sets_aside_and_the_draw_skips_what_is_set_aside():
    d = Difficulty(window=2, set_aside=3)
    pool = ["a", "b", "c", "d"]
    d.record(0, ["a"] * 2 + ["b"] * 2, np.array([1.0, 1.0, 0.0, 1.0]), 2)
    assert d.kind(d.prompts["a"]) == "learnable"  # one solved group of the two the window asks for
    d.record(1, ["a"] * 2 + ["c"] * 2, np.array([1.0, 1.0, 0.0, np.nan]), 2)
    assert d.kind(d.prompts["a"]) == "too_easy" and d.prompts["a"]["back_at"] == 5
    assert d.prompts["c"]["samples"] == 1 and d.prompts["c"]["recent"] == [0.0]
    assert d.metrics(1, pool) == {"difficulty/too_easy": 1.0, "difficulty/learnable": 2.0, "difficulty/too_hard": 0.0,
                                  "difficulty/unseen": 1.0, "difficulty/set_aside": 1.0}
    drawn = [int(i) for r in range(2, 4) for i in d.draw(r, pool, 3, seed=0, salt=1)]
    assert 0 not in drawn  # "a" is set aside until rollout 5
    again = Difficulty(window=2, set_aside=3)
    again.load_state_dict(json.loads(json.dumps(d.state_dict())))
    assert again.state_dict() == d.state_dict()
    assert [int(i) for i in again.draw(4, pool, 3, seed=0, salt=1)] == [int(i) for i in d.draw(4, pool, 3, seed=0,
                                                                                                  salt=1)]


def test_every_prompt_set_aside_still_gives_a_rollout_the_ones_due_back_first():
    d = Difficulty(set_aside=10)
    d.record(0, ["a", "b"], np.array([1.0, 0.0]), 1)
    assert sorted(int(i) for i in d.draw(1, ["a", "b"], 2, seed=0, salt=1)) == [0, 1]


def test_the_curriculum_needs_a_pool_and_nothing_sampled_ahead():
    from conftest import tiny_config
    from jaxrl.algorithms.online.settings import OnlineDataConfig
    from jaxrl.algorithms.run import resolve_config
    with pytest.raises(ValueError, match=r"data.sampler='curriculum' sets prompts of a pool aside: it needs "
                                         r"data.source='problems'"):
        OnlineDataConfig(sampler="curriculum", source="token_task")
    cfg = tiny_config("grpo", max_staleness=1, rollout_backend="server", rollout_servers=("http://x:1",))
    cfg.data.source, cfg.data.problems, cfg.data.sampler = "problems", "p.jsonl", "curriculum"
    cfg.model_path = "/m"
    with pytest.raises(ValueError, match=r"needs grpo.max_staleness=0 \(got 1\)"):
        resolve_config(cfg)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A tiny random model with a tokenizer, and 12 problems: 4 easy, 4 learnable, 4 hard (tests/curriculum_rewards.py
    scores them)."""
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
    from jaxrl.models import qwen35
    from jaxrl.models.qwen35.config import tiny
    from test_evaluate import numpy_init

    root = tmp_path_factory.mktemp("curriculum")
    model_dir = str(root / "model")
    # every id a token of the tokenizer (a completion decodes to text), and 28 of them end a completion: a random
    # model stops within the cap (a truncated completion scores 0)
    cfg = tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), vocab_size=128,
               eos_token_id=(1, *range(100, 128)))
    qwen35.save_pretrained(numpy_init(cfg), model_dir, base_dir=None, layout="container")
    build_tiny_tokenizer(model_dir, ["Answer in digits. Answer in letters. 0123456789 abc"], vocab_size=128)
    records = [{"id": f"{kind}-{i}", "messages": [{"role": "user", "content": f"Answer in digits {i}"}],
                "test_type": "stdin", "tests": [{"input": "", "output": "0\n"}]}
               for kind in ("easy", "learn", "hard") for i in range(4)]
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"model": model_dir, "problems": str(root / "p.jsonl")}


def pool_config(pool, sampler: str, steps: int = 16):
    from conftest import tiny_config
    cfg = tiny_config("grpo", num_generations=4, prompts_per_step=4, max_new_tokens=16, temperature=1.0, beta=0.0,
                      logprob_batch_size=16)
    cfg.model_path, cfg.model_preset, cfg.model_overrides = pool["model"], "", {}
    cfg.data.source, cfg.data.problems, cfg.data.max_prompt_len = "problems", pool["problems"], 64
    # a group of an easy prompt with one truncated sample (scored 0) still counts as solved
    cfg.data.sampler, cfg.data.curriculum_set_aside, cfg.data.curriculum_solved = sampler, 8, 0.75
    cfg.plugins = (f"reward:tiered={HERE / 'curriculum_rewards.py'}:tiered",)
    cfg.reward.name = "tiered"
    cfg.batch.micro_batch_size, cfg.batch.grad_accum = 8, 2
    cfg.steps, cfg.checkpoint_every, cfg.keep_checkpoints = steps, 4, 3
    return cfg


@pytest.mark.heavy  # two GRPO runs of 16 steps on the tiny model
def test_the_curriculum_halves_the_zero_variance_groups_against_uniform_sampling(pool, tmp_path):
    from jaxrl.algorithms.run import run_training

    share = {}
    for sampler in ("uniform", "curriculum"):
        records = run_training(pool_config(pool, sampler), str(tmp_path / sampler)).records
        share[sampler] = float(np.mean([r["zero_variance_groups"] for r in records]))
        last = records[-1]
        assert sum(last[f"difficulty/{k}"] for k in ("too_easy", "learnable", "too_hard", "unseen")) == 12
        assert last["difficulty/too_easy"] == 4 and last["difficulty/too_hard"] >= 4  # a learnable group can fail
    print(share)
    assert share["uniform"] > 0.5 and share["curriculum"] <= share["uniform"] / 2, share


CONFIG_FILE = '''
import sys
sys.path.insert(0, {tests!r})
from test_curriculum import pool_config


def get_config():
    return pool_config({pool!r}, "curriculum", steps=8)
'''


@pytest.mark.heavy  # three training processes of the tiny model
def test_a_curriculum_run_killed_resumes_bit_for_bit_with_each_prompts_record(pool, tmp_path):
    """SIGKILLed after step 6 (the newest checkpoint is step 4's, whose task state holds every prompt's record),
    resumed: steps 5-8 draw the same prompts and log the same numbers, difficulty/* included, and the step-8
    adapter is the uninterrupted run's."""
    from launcher_env import launch
    from jaxrl.models.adapters import load_adapter
    from jaxrl.train.metrics import read_metrics

    config = tmp_path / "curriculum_config.py"
    config.write_text(CONFIG_FILE.format(tests=str(HERE), pool=pool))
    cache = tmp_path / "xla"
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    args = (f"--config={config}",)
    done = launch("train", *args, f"--workdir={straight}", cache=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = launch("train", *args, f"--workdir={broken}", "--debug_kill_after_step=6", cache=cache)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = launch("train", *args, f"--workdir={broken}", cache=cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 4)" in resumed.stderr

    def steps_5_to_8(workdir):
        records = [r for r in read_metrics(str(workdir)) if 5 <= r["step"] <= 8]
        return {r["step"]: {k: v for k, v in r.items() if not (k.endswith("_s") or k.startswith("time/")
                                                              or k.endswith("per_s"))} for r in records}

    want, got = steps_5_to_8(straight), steps_5_to_8(broken)
    assert sorted(want) == [5, 6, 7, 8] and sorted(got) == [5, 6, 7, 8]
    assert any(want[s]["difficulty/set_aside"] > 0 for s in want)
    for step in want:
        assert got[step] == want[step], step
    a, _ = load_adapter(str(straight), 8)
    b, _ = load_adapter(str(broken), 8)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
