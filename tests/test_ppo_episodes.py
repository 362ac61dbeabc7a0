"""PPO over multi-turn episodes (ppo.environment): environment tokens are not actions. GAE over an episode row
equals a hand computation in which the observation's tokens get no advantage and do not break the gamma/lambda
chain between turns (and equals GAE over the sampled tokens alone); the episode's return lands on its last sampled
token; a PPO rollout of code_feedback episodes on the tiny model has zero advantages, returns and KL at every
environment token; and a short run over them trains with finite metrics and resumes bit-exact."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import make_rollout, tiny_config
from jaxrl.algorithms import ppo as ppo_lib
from jaxrl.algorithms.online.rollouts import turn_reward_row
from jaxrl.environments.runner import Episode
from jaxrl.algorithms.ppo_task import PPOTask, returns_and_advantages
from jaxrl.algorithms.run import build_model, resolve_config
from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
from jaxrl.models import qwen35
from jaxrl.models.qwen35.config import tiny
from jaxrl.parallel.mesh import make_mesh
from jaxrl.train.loop import Trainer
from jaxrl.train.metrics import read_metrics
from test_evaluate import numpy_init

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "jaxrl" / "assets" / "tasks" / "problems.jsonl"
P, CAP, E = 192, 8, 96
MESH = (1, 1, 1)

# turn 1 (t0, t1), the observation (t2, t3: garbage rewards and values that must never be read), turn 2 (t4, t5),
# padding (t6)
MASK = np.array([[1, 1, 0, 0, 1, 1, 0]], np.float32)
REWARDS = np.array([[0.1, -0.2, 7.0, 7.0, 0.0, 1.0, 7.0]], np.float32)
VALUES = np.array([[0.5, 0.2, 9.0, 9.0, 0.4, 0.1, 9.0]], np.float32)
GAMMA, LAM = 0.9, 0.8


def test_gae_over_an_episode_skips_environment_tokens():
    adv, ret = jax.device_get(ppo_lib.gae(REWARDS, VALUES, MASK, GAMMA, LAM))
    # by hand, backwards over the sampled tokens; t1's next state is t4's (after the observation), one step away
    a5 = 1.0 + 0.0 - 0.1  # 0.9
    a4 = (0.0 + GAMMA * 0.1 - 0.4) + GAMMA * LAM * a5  # 0.338
    a1 = (-0.2 + GAMMA * 0.4 - 0.2) + GAMMA * LAM * a4  # 0.20336
    a0 = (0.1 + GAMMA * 0.2 - 0.5) + GAMMA * LAM * a1  # -0.0735808
    np.testing.assert_allclose(adv[0], [a0, a1, 0, 0, a4, a5, 0], atol=1e-6)
    np.testing.assert_allclose(ret[0], [a0 + 0.5, a1 + 0.2, 0, 0, a4 + 0.4, a5 + 0.1, 0], atol=1e-6)
    # the same as GAE over the sampled tokens alone (the observation removed)
    on = MASK[0] > 0
    dense, _ = jax.device_get(ppo_lib.gae(REWARDS[:, on], VALUES[:, on], np.ones((1, 4), np.float32), GAMMA, LAM))
    np.testing.assert_allclose(adv[0, on], dense[0], atol=1e-6)
    # treating the observation as two zero-reward steps would be another answer (what the skip avoids)
    zero_steps, _ = jax.device_get(ppo_lib.gae(np.where(MASK > 0, REWARDS, 0), np.where(MASK > 0, VALUES, 0),
                                               np.array([[1, 1, 1, 1, 1, 1, 0]], np.float32), GAMMA, LAM))
    assert abs(zero_steps[0, 1] - a1) > 0.05


def test_each_turns_reward_is_given_at_that_turns_last_sampled_token():
    e = Episode(0, 0, [5, 6], ids=list(range(6)), mask=[1, 1, 0, 0, 1, 1], rewards=[-0.05, 0.75])
    np.testing.assert_allclose(turn_reward_row(e, 8), [0, -0.05, 0, 0, 0, 0.75, 0, 0], atol=1e-7)
    # the PPO task's chain (KL rewards -> GAE, unwhitened) with them: the turn cost is in turn 1's returns only
    logp = np.array([[-1.0, -2.0, 0.0, 0.0, -0.5, -1.5, 0.0]], np.float32)
    turns = np.array([[0.0, -0.05, 0.0, 0.0, 0.0, 0.75, 0.0]], np.float32)
    _, adv, ret, _ = jax.device_get(returns_and_advantages(
        logp, logp, np.zeros_like(logp), MASK, np.zeros(1, np.float32), np.float32(0.1), turns, estimator="k1",
        gamma=1.0, lam=1.0, whiten_rewards=False, whiten_advantages=False))
    np.testing.assert_allclose(ret[0], [0.7, 0.7, 0, 0, 0.75, 0.75, 0], atol=1e-6)  # V = 0, no KL: the returns


def test_the_episode_return_is_scored_at_its_last_sampled_token():
    logp = np.array([[-1.0, -2.0, 0.0, 0.0, -0.5, -1.5, 0.0]], np.float32)
    ref = np.array([[-1.5, -2.0, -3.0, -3.0, -0.5, -1.0, -4.0]], np.float32)
    rewards, kl = jax.device_get(ppo_lib.kl_penalty_rewards(logp, ref, MASK, np.array([2.0], np.float32), 0.1))
    np.testing.assert_allclose(kl[0], [0.5, 0, 0, 0, 0, -0.5, 0], atol=1e-6)  # k1 = logp - ref, sampled tokens only
    np.testing.assert_allclose(rewards[0], [-0.05, 0, 0, 0, 0, 2.05, 0], atol=1e-6)
    # the task's whole chain (KL rewards -> GAE), unwhitened: the environment tokens get nothing
    white, adv, ret, _ = jax.device_get(returns_and_advantages(
        logp, ref, VALUES, MASK, np.array([2.0], np.float32), np.float32(0.1), estimator="k1", gamma=GAMMA, lam=LAM,
        whiten_rewards=False, whiten_advantages=False))
    expected, _ = jax.device_get(ppo_lib.gae(rewards, VALUES, MASK, GAMMA, LAM))
    np.testing.assert_allclose(adv, expected, atol=1e-6)
    assert np.all(adv[MASK == 0] == 0) and np.all(ret[MASK == 0] == 0)


# ------------------------------------------------------------------------------------------------ tiny runs


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random model whose eos ids include thirty ordinary tokens (its turns end within the cap, so episodes
    have a second turn), its tokenizer, and two toy problems."""
    root = tmp_path_factory.mktemp("ppo_episodes")
    records = [json.loads(line) for line in TASKS.read_text().splitlines()[:2]]
    model_dir = str(root / "model")
    cfg = tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
               eos_token_id=(1, *range(40, 70)))
    qwen35.save_pretrained(numpy_init(cfg), model_dir, base_dir=None, layout="container")
    build_tiny_tokenizer(model_dir, [m["content"] for p in records for m in p["messages"]]
                         + ["No program was found in your answer. Answer with the complete program in one ```python"])
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"model": model_dir, "problems": str(root / "p.jsonl")}


def episode_config(base, **ppo):
    # code_feedback with a turn cost: the random model writes no program, so an episode's return is -0.05 per
    # "No program" reply (0 when its first turn hits the cap): returns differ between episodes
    ppo = {"num_generations": 2, "prompts_per_rollout": 2, "max_new_tokens": CAP, "environment": "code_feedback",
           "environment_options": {"public_tests": 1, "workers": 1, "timeout_s": 5.0, "turn_cost": 0.05},
           "max_turns": 2, "max_episode_tokens": E, "temperature": 1.0, "logprob_batch_size": 4, "epochs": 1,
           "minibatches": 2, **ppo}
    cfg = tiny_config("ppo", **ppo)
    cfg.model_path, cfg.model_preset, cfg.model_overrides = base["model"], "", {}
    cfg.data.source, cfg.data.problems, cfg.data.max_prompt_len = "problems", base["problems"], P
    cfg.batch.micro_batch_size, cfg.batch.grad_accum = 2, 1
    return cfg


@pytest.mark.heavy  # a rollout of episodes and its three teacher-forced passes compile: long for the fast tier
def test_a_ppo_rollout_of_episodes_trains_sampled_tokens_only(base):
    cfg = resolve_config(episode_config(base))
    model = build_model(cfg)
    task = PPOTask(cfg, model, make_mesh(MESH))
    buffer, metrics = make_rollout(task, model)
    episodes = task.rollouts.last_episodes
    assert buffer["input_ids"].shape == (4, P + E) and buffer["completion_mask"].shape == (4, E)
    assert any(e.turns == 2 for e in episodes) and metrics["episode/turns_mean"] > 1.0
    assert metrics["reward/mean"] == pytest.approx(np.mean([e.reward for e in episodes]))
    assert len({e.reward for e in episodes}) > 1, [e.reward for e in episodes]  # the returns below differ
    for row, e in enumerate(episodes):  # rows in episode order
        np.testing.assert_array_equal(buffer["completion_mask"][row, :len(e.mask)], e.mask)
        assert buffer["completion_mask"][row, len(e.mask):].sum() == 0
    m = buffer["completion_mask"] > 0
    in_rows = buffer["attention_mask"][:, P:] > 0
    assert (in_rows & ~m).sum() > 0  # observation tokens are in the rows, attended ...
    for key in ("advantages", "returns", "old_logp", "old_values"):  # ... and carry nothing the loss reads
        assert np.all(buffer[key][~m] == 0), key
        assert np.all(np.isfinite(buffer[key])), key
    # the returns are GAE over each row's sampled tokens alone, each turn's reward at its last one (step 0: the
    # policy is the reference, so no KL reward; a zero-initialised value head: V = 0): the "No program" reply's
    # cost is in the first turn's returns, not in the second's
    two = 0
    for row, e in enumerate(episodes):
        on = m[row]
        rewards = turn_reward_row(e, E)[:len(e.mask)][np.asarray(e.mask) > 0][None]
        _, ret = jax.device_get(ppo_lib.gae(rewards, np.zeros_like(rewards), np.ones_like(rewards), cfg.ppo.gamma,
                                            cfg.ppo.lam))
        np.testing.assert_allclose(buffer["returns"][row, on], ret[0], atol=1e-6)
        if e.turns == 2 and e.rewards[0] < 0:
            first = e.mask.index(0)  # the first turn's sampled tokens
            assert np.all(ret[0, :first] < 0) and np.all(ret[0, first:] == 0), ret
            two += 1
    assert two


@pytest.mark.heavy  # three short runs (full, stopped, resumed), each compiling its programs
def test_a_short_ppo_run_over_episodes_is_finite_and_resumes_bit_exact(base, tmp_path):
    cfg = episode_config(base)
    cfg.steps, cfg.checkpoint_every, cfg.keep_checkpoints = 4, 3, 1

    def run(workdir, **kwargs):
        c = resolve_config(cfg)
        model = build_model(c)
        trainer = Trainer(c, model, PPOTask(c, model, make_mesh(MESH)), workdir, mesh=make_mesh(MESH), **kwargs)
        return trainer, trainer.run()

    full_dir = str(tmp_path / "full")
    full_trainer, result = run(full_dir)
    assert [r["step"] for r in result.records] == [1, 2, 3, 4]
    for r in result.records:
        for key in ("loss", "pg_loss", "vf_loss", "grad_norm", "reward/mean", "advantage/std", "value/mean",
                    "return/mean", "rollout/kl", "episode/turns_mean", "episode/tokens_mean"):
            assert np.isfinite(r[key]), (r["step"], key, r[key])
        assert r["episode/failed_fraction"] == 0.0 and r["episode/tokens_mean"] > r["episode/sampled_tokens_mean"]
    assert max(r["episode/turns_mean"] for r in result.records) > 1.0
    full = jax.device_get(full_trainer.state.params)

    class Stop(Exception):
        pass

    def stop_after_3(done, trainer):
        if done == 3:
            raise Stop

    part_dir = str(tmp_path / "part")
    with pytest.raises(Stop):
        run(part_dir, on_step_end=stop_after_3)
    assert os.path.exists(os.path.join(part_dir, "rollouts", "1.npz"))  # rollout 1 = steps 3-4, stored
    resumed_trainer, resumed_result = run(part_dir)
    assert [r["step"] for r in resumed_result.records] == [4]
    resumed = jax.device_get(resumed_trainer.state.params)
    assert set(resumed) == set(full) and any(n.startswith("value_head.") for n in full)
    for name in full:
        np.testing.assert_array_equal(resumed[name], full[name], err_msg=name)
    a = {r["step"]: r for r in read_metrics(full_dir)}
    b = {r["step"]: r for r in read_metrics(part_dir)}
    for step in range(1, 5):
        for key in ("loss", "vf_loss", "reward/mean", "rollout/kl", "episode/turns_mean"):
            assert a[step][key] == b[step][key], (step, key)
