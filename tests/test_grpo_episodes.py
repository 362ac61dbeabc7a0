"""GRPO over multi-turn episodes (grpo.environment): a tiny run trains end to end on episodes of a plug-in
environment, with finite metrics and the episode/* metrics; the rollout's rows are episodes (loss over sampled
tokens only); the code_feedback environment runs inside a GRPO rollout."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import first_batch, make_rollout, tiny_config
from jaxrl.algorithms.run import build_model, load_run_plugins, resolve_config, run_training
from jaxrl.algorithms.grpo_task import GRPOTask
from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
from jaxrl.models import qwen35
from jaxrl.models.qwen35.config import tiny
from jaxrl.parallel.mesh import make_mesh
from jaxrl.train.loop import Trainer
from test_evaluate import numpy_init

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "jaxrl" / "assets" / "tasks" / "problems.jsonl"
ENVS = Path(__file__).resolve().parent / "episode_envs.py"
P, CAP, E = 192, 8, 96


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random model folder whose eos ids include thirty ordinary tokens (a random model then ends its turns
    within the cap, so episodes have several turns), its tokenizer, and two toy problems."""
    root = tmp_path_factory.mktemp("grpo_episodes")
    records = [json.loads(line) for line in TASKS.read_text().splitlines()[:2]]
    model_dir = str(root / "model")
    cfg = tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
               eos_token_id=(1, *range(40, 70)))
    qwen35.save_pretrained(numpy_init(cfg), model_dir, base_dir=None, layout="container")
    build_tiny_tokenizer(model_dir, [m["content"] for p in records for m in p["messages"]]
                         + ["Answer in digits. Answer in letters. 0123456789"])
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"model": model_dir, "problems": str(root / "p.jsonl")}


def episode_config(base, steps=2, **grpo):
    grpo = {"num_generations": 4, "prompts_per_step": 2, "max_new_tokens": CAP, "environment": "alphabet",
            "max_turns": 2, "max_episode_tokens": E, "temperature": 1.0, "beta": 0.04, "logprob_batch_size": 8, **grpo}
    cfg = tiny_config("grpo", **grpo)
    cfg.model_path, cfg.model_preset, cfg.model_overrides = base["model"], "", {}
    cfg.plugins = (f"environment:alphabet={ENVS}:Alphabet",)
    cfg.data.source, cfg.data.problems, cfg.data.max_prompt_len = "problems", base["problems"], P
    cfg.batch.micro_batch_size, cfg.batch.grad_accum = 4, 2
    cfg.steps, cfg.checkpoint_every = steps, steps
    return cfg


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_a_tiny_grpo_run_over_episodes_trains_with_finite_metrics(base, tmp_path):
    cfg = episode_config(base)
    records = run_training(cfg, str(tmp_path / "run")).records
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("loss", "policy_loss", "kl", "grad_norm", "reward/mean", "advantage/std", "episode/turns_mean",
                    "episode/truncated_fraction", "episode/tokens_mean", "episode/failed_fraction"):
            assert np.isfinite(r[key]), (r["step"], key, r[key])
        assert 1.0 <= r["episode/turns_mean"] <= 2.0 and r["episode/failed_fraction"] == 0.0
        assert r["episode/tokens_mean"] > r["episode/sampled_tokens_mean"] > 0  # observations are in the rows
    assert max(r["episode/turns_mean"] for r in records) > 1.0  # some episodes took a second turn
    assert records[0]["kl"] < 1e-6 and records[0]["grad_norm"] > 0  # step 1: the policy is the reference, and learns


@pytest.mark.slow
def test_episode_rows_train_on_sampled_tokens_only(base, tmp_path):
    cfg = resolve_config(episode_config(base))
    load_run_plugins(cfg)  # the `alphabet` environment (run_training registers a run's plug-ins itself)
    model = build_model(cfg)
    task = GRPOTask(cfg, model, make_mesh((1, 1, 1)))
    trainer = Trainer(cfg, model, task, str(tmp_path / "run"), mesh=make_mesh((1, 1, 1)))
    batch, host = first_batch(trainer)
    assert batch["input_ids"].shape == (8, P + E) and batch["completion_mask"].shape == (8, E)
    episodes = task.rollouts.last_episodes
    assert any(e.turns == 2 for e in episodes)
    for row, e in enumerate(episodes):  # rows in episode order (one minibatch, no permutation)
        np.testing.assert_array_equal(batch["input_ids"][row, P:P + len(e.ids)], e.ids)
        np.testing.assert_array_equal(batch["completion_mask"][row, :len(e.mask)], e.mask)
        assert batch["completion_mask"][row, len(e.mask):].sum() == 0
    assert host["episode/turns_mean"] == pytest.approx(np.mean([e.turns for e in episodes]))
    rewards = np.array([e.reward for e in episodes])
    assert host["reward/mean"] == pytest.approx(rewards.mean(), abs=1e-6)
    # advantages per episode within each group of 4 episodes of a problem
    adv = batch["advantages"].reshape(2, 4)
    assert np.all(np.abs(adv.sum(1)) < 1e-4)
    # the reference pass over episode rows: zero at environment tokens, the policy's at sampled ones (step 0)
    ref = batch["ref_logp"]
    assert np.all(ref[batch["completion_mask"] == 0] == 0) and np.all(ref[batch["completion_mask"] > 0] < 0)


@pytest.mark.slow
def test_code_feedback_runs_inside_a_grpo_rollout(base, tmp_path):
    """The built-in environment on the real sandbox, from the config: the random model writes no program, so every
    episode gets the "No program" feedback as its second prompt, and scores 0 on the hidden tests."""
    cfg = episode_config(base, environment="code_feedback",
                         environment_options={"public_tests": 1, "workers": 1, "timeout_s": 5.0})
    cfg.plugins = ()
    cfg = resolve_config(cfg)
    model = build_model(cfg)
    task = GRPOTask(cfg, model, make_mesh((1, 1, 1)))
    buffer, metrics = make_rollout(task, model)
    episodes = task.rollouts.last_episodes
    assert metrics["episode/failed_fraction"] == 0.0 and metrics["reward/mean"] == 0.0
    multi = [e for e in episodes if e.turns == 2]
    assert multi, [(e.turns, e.truncated) for e in episodes]
    for e in multi:
        assert "No program was found" in e.observations[0][0]["content"]


def test_episode_settings_are_checked():
    with pytest.raises(ValueError, match="grpo.max_episode_tokens=8 must hold one turn of grpo.max_new_tokens=16"):
        resolve_config(tiny_config("grpo", environment="code_feedback", max_new_tokens=16, max_episode_tokens=8))
    with pytest.raises(ValueError, match="grpo.overlong_buffer"):
        resolve_config(tiny_config("grpo", environment="code_feedback", overlong_buffer=4, max_episode_tokens=64))
    with pytest.raises(ValueError, match="ppo.max_episode_tokens=8 must hold one turn of ppo.max_new_tokens=16"):
        resolve_config(tiny_config("ppo", environment="code_feedback", max_new_tokens=16, max_episode_tokens=8))
    with pytest.raises(ValueError, match="needs data.source='problems'"):
        cfg = resolve_config(tiny_config("grpo", environment="code_feedback", max_episode_tokens=64))
        GRPOTask(cfg, build_model(cfg), make_mesh((1, 1, 1)))



@pytest.mark.slow
def test_episodes_train_with_rollout_correction_and_dynamic_sampling(base, tmp_path):
    """Episodes through the rest of the online machinery: rollout correction over the sampled tokens of every turn
    (mismatch logged, finite) and dynamic sampling drawing more episode groups until enough have a reward spread."""
    cfg = episode_config(base, rollout_correction="token_truncate", dynamic_sampling=True, max_extra_draws=2)
    records = run_training(cfg, str(tmp_path / "run")).records
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("loss", "grad_norm", "reward/mean", "episode/turns_mean"):
            assert np.isfinite(r[key]), (r["step"], key, r[key])
        assert np.isfinite(r["mismatch/logp_abs_mean"]) and r["mismatch/logp_abs_max"] < 1e-3  # same weights
        assert r["dynamic_sampling/drawn_groups"] >= 2 and 0 <= r["dynamic_sampling/extra_draws"] <= 2
        assert r["dynamic_sampling/signal_groups"] <= r["dynamic_sampling/drawn_groups"]


@pytest.mark.heavy  # a real `launchers.serve` process and a two-thread run
def test_episodes_sampled_ahead_on_a_server(base, tmp_path):
    """GRPO over episodes with rollout_backend='server' and overlap (max_staleness=1): the producer samples each
    rollout's episodes on a real `launchers.serve` from the previous step's adapter (the served digest the
    trainer's), so every rollout after the first trains one version behind, and the run's metrics stay finite."""
    from serve_fixture import Served
    server = Served(tmp_path, base["model"], f"--allowed_lora_roots={tmp_path.parents[1]}", "--batch_size=8",
                    f"--max_prompt_len={P + E - CAP}", f"--max_model_len={P + E}")
    try:
        cfg = episode_config(base, steps=4, rollout_backend="server", rollout_servers=(server.url,),
                             rollout_batch_size=8, max_staleness=1)
        records = run_training(cfg, str(tmp_path / "run")).records
    finally:
        server.stop()
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["rollout/staleness_max"] for r in records] == [0, 1, 1, 1]
    for r in records:
        assert r["rollout/served_digest"] == r["rollout/adapter_digest"]
        for key in ("loss", "grad_norm", "reward/mean", "episode/turns_mean"):
            assert np.isfinite(r[key]), (r["step"], key, r[key])
    assert max(r["episode/turns_mean"] for r in records) > 1.0


@pytest.mark.heavy  # a real `launchers.serve` process, k = 2 rollouts on it at once
def test_episodes_take_partial_rollouts_with_a_version_per_sampled_token(base, tmp_path):
    """GRPO over episodes with partial rollouts (max_staleness=2, decoupled) on a real `launchers.serve`: every
    rollout's stored `token_versions` give each sampled token a published version in [r - k, r] that never
    decreases along an episode, and observation tokens (mask 0) none (-1); the per-token staleness metrics equal a
    recomputation from the stored buffers; the run's metrics stay finite."""
    from jaxrl.algorithms.online.buffer import RolloutStore
    from jaxrl.algorithms.online.controller import token_version_metrics
    from serve_fixture import Served
    k = 2
    server = Served(tmp_path, base["model"], f"--allowed_lora_roots={tmp_path.parents[1]}", "--batch_size=8",
                    f"--max_prompt_len={P + E - CAP}", f"--max_model_len={P + E}", "--debug_round_delay_s=0.005")
    try:
        cfg = episode_config(base, steps=4, rollout_backend="server", rollout_servers=(server.url,),
                             rollout_batch_size=8, max_staleness=k, partial_rollouts=True,
                             off_policy_loss="decoupled")
        cfg.keep_checkpoints = None  # every state kept: no rollout buffer is pruned
        records = run_training(cfg, str(tmp_path / "run")).records
    finally:
        server.stop()
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    store = RolloutStore(str(tmp_path / "run"))
    for r in records:
        rollout = r["step"] - 1
        for key in ("loss", "grad_norm", "reward/mean", "episode/turns_mean", "offpolicy/is_weight_mean"):
            assert np.isfinite(r[key]), (r["step"], key, r[key])
        assert r["rollout/staleness_max"] <= k and r["rollout/dropped_stale_samples"] == 0
        buffer, _ = store.load(rollout)
        versions, mask = buffer["token_versions"], buffer["completion_mask"]
        sampled, trained = versions >= 0, mask.sum(-1) > 0  # (a masked episode's row is all 0s)
        assert sampled.any() and not sampled[trained][mask[trained] == 0].any()  # observations carry no version
        assert ((versions[sampled] >= rollout - k) & (versions[sampled] <= rollout)).all()
        for row in versions:
            real = row[row >= 0]
            assert (np.diff(real) >= 0).all()  # a later turn never samples with an older version
        again = token_version_metrics(versions, rollout)
        assert {key: r[key] for key in again} == pytest.approx(again)
    assert max(r["episode/turns_mean"] for r in records) > 1.0
