"""Partial rollouts (`grpo.partial_rollouts`): the trainer publishes each policy version in place on two real
`launchers.serve` processes (each rollout split over them) while up to k = max_staleness rollouts run there, and
rows in flight continue under the new version. Proven here: every token's recorded version is the one whose adapter sampled it (the sampler's own
log-prob of each token is reproduced by that version's checkpointed adapter, the prefix cached by the version before
it where a row switched), rows did switch mid-row, no token of any step is over the bound, the per-token metrics
agree with the buffers, and a sample over the bound is dropped from the loss and counted. Plus the config checks."""

import numpy as np
import pytest

from serve_fixture import Served, build_base
from test_server_rollouts import PROMPT_BUCKET, metrics, overrides, rollout_buffer, train

K = 2
STEPS = 6  # 6 rollouts of one step each (version v: the parameters after v steps); one checkpoint, at the end (a
# checkpoint waits for the rollouts in flight)
CAP = 32
# Each server decodes one row at a time, one step a round, each round 5 ms longer (--debug_round_delay_s): a rollout
# (64 rows of up to CAP tokens; a random base rarely stops) takes several trainer steps, so the producer is the
# bottleneck and every publish finds a row mid-flight.
SERVER = ("--batch_size=1", "--round_steps=1", "--debug_round_delay_s=0.005")
SAMPLED_ATOL = 2e-4  # the sampler's decode path vs a teacher-forced pass, fp32 (test_server_partial)


# ------------------------------------------------------------------------------------------------- fast


def test_token_version_metrics_and_the_bound():
    from jaxrl.algorithms.online.controller import bound_token_versions, token_version_metrics

    versions = np.array([[3, 3, 4, -1],   # spans 3..4
                         [4, 4, 4, 4],    # one version
                         [1, 2, -1, -1],  # its first token is 3 versions behind rollout 4: over k = 2
                         [-1, -1, -1, -1]], np.int32)  # no tokens
    got = token_version_metrics(versions, 4)
    assert got == {"rollout/staleness_mean": pytest.approx((1 + 1 + 0 + 0 * 4 + 3 + 2) / 9),
                   "rollout/staleness_max": 3.0, "rollout/version_span_max": 1.0,
                   "rollout/partial_fraction": pytest.approx(2 / 3)}
    buffer = {"token_versions": versions, "completion_mask": np.ones((4, 4), np.float32),
              "sequence_mask": np.ones(4, np.float32)}
    dropped, kept = bound_token_versions(buffer, 4, max_staleness=2)
    assert dropped == 1
    np.testing.assert_array_equal(buffer["completion_mask"].sum(-1), [4, 4, 0, 4])
    np.testing.assert_array_equal(buffer["sequence_mask"], [1, 1, 0, 1])
    assert kept["rollout/staleness_max"] == 1.0 and kept["rollout/partial_fraction"] == pytest.approx(1 / 2)
    assert bound_token_versions({**buffer, "completion_mask": np.ones((4, 4))}, 4, max_staleness=3)[0] == 0


def test_the_report_plots_the_staleness_and_partial_rollout_metrics():
    from jaxrl.diagnostics.plots import training_panels

    records = [{"step": s, "loss": 0.1, "rollout/staleness_mean": 0.5, "rollout/staleness_max": 1.0,
                "rollout/partial_fraction": 0.25, "rollout/version_span_max": 1.0, "rollout/dropped_stale": 0.0,
                "rollout/dropped_stale_samples": 0.0, "time/trainer_idle_s": 0.2, "time/rollout_idle_s": 0.1,
                "rollout/samples_digest": "0123abcd"} for s in (1, 2)]
    panels = {title: keys for title, keys, _ in training_panels(records)}
    drawn = {k for keys in panels.values() for k in keys}
    assert {"rollout/staleness_mean", "rollout/staleness_max", "rollout/partial_fraction",
            "rollout/version_span_max", "rollout/dropped_stale_samples", "time/trainer_idle_s",
            "time/rollout_idle_s"} <= drawn
    assert panels["partial rollouts: samples across versions, widest span"] == ("rollout/partial_fraction",
                                                                              "rollout/version_span_max")
    assert not any("samples_digest" in k for k in drawn)  # a string, not a curve


def test_partial_rollout_settings_are_checked():
    from conftest import tiny_config
    from jaxrl.algorithms.run import resolve_config

    server = dict(rollout_backend="server", rollout_servers=("http://127.0.0.1:8000",))
    # each refusal names the requirements that are not met, and only those
    needs = {"backend": "grpo.rollout_backend='server'", "k": "grpo.max_staleness >= 1",
             "decoupled": "grpo.off_policy_loss='decoupled'"}
    for block, unmet in ((dict(rollout_backend="vllm", max_staleness=2, off_policy_loss="decoupled"), {"backend"}),
                         (dict(server, off_policy_loss="behaviour", max_staleness=2), {"decoupled"}),
                         (dict(server), {"k", "decoupled"})):
        with pytest.raises(ValueError, match="grpo.partial_rollouts continues rows across policy versions") as e:
            resolve_config(tiny_config("grpo", partial_rollouts=True, **block))
        assert {name for name, text in needs.items() if text in str(e.value)} == unmet, str(e.value)
    ok = resolve_config(tiny_config("grpo", partial_rollouts=True, max_staleness=2, off_policy_loss="decoupled",
                                    **server))
    assert ok.grpo.partial_rollouts and ok.grpo.max_staleness == 2


# ------------------------------------------------------------------------------------------------- a real run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial_rollouts")
    base = build_base(root / "base")
    servers = [Served(root, base, f"--allowed_lora_roots={root}", f"--max_prompt_len={PROMPT_BUCKET}",
                      f"--prompt_buckets={PROMPT_BUCKET}", "--max_model_len=128", *SERVER, name=f"serve{k}")
               for k in range(2)]  # each version published to both, each rollout split over them
    args = overrides(base, [s.url for s in servers], "server") + [
        f"--config.steps={STEPS}", f"--config.checkpoint_every={STEPS}", "--config.grpo.num_iterations=1",
        f"--config.grpo.max_new_tokens={CAP}", f"--config.grpo.max_staleness={K}",
        "--config.grpo.partial_rollouts=True", "--config.grpo.off_policy_loss=decoupled"]
    proc = train(root / "run", root / "jax_cache", *args)
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        yield {"workdir": root / "run", "base": base, "root": root, "urls": [s.url for s in servers]}
    finally:
        for s in servers:
            s.stop()


def forward_of(model, adapter):
    """A jitted `model(ids, cache=)` with `adapter` attached (None: the base; LoRA starts at B = 0, the base)."""
    import jax
    from flax import nnx

    from jaxrl.models.adapters import attach, detach

    if adapter is not None:
        attach(model, adapter)
    graphdef, state = nnx.split(model)
    detach(model)
    return jax.jit(lambda ids, cache: nnx.merge(graphdef, state)(ids, cache=cache))


def segmented_logprobs(model, forwards, prompt, tokens, versions):
    """log p(tokens[t]) with each token sampled by `forwards[versions[t]]` on the cache the earlier versions wrote:
    the input that predicts token t (the prompt's last token, or token t - 1) is read by token t's version."""
    import jax

    ids = list(prompt) + list(tokens)
    cache = model.init_cache(1, len(ids))
    logits, start = [], 0
    inputs_end = [len(prompt) + t for t in range(len(tokens))]  # token t is predicted from ids[:inputs_end[t]]
    t = 0
    while t < len(tokens):
        u = t
        while u + 1 < len(tokens) and versions[u + 1] == versions[t]:
            u += 1
        stop = inputs_end[u]  # feed through the input that predicts token u
        out, cache = forwards[int(versions[t])](np.asarray([ids[start:stop]], np.int32), cache)
        logits.append(np.asarray(out[0]))
        start, t = stop, u + 1
    logp = np.asarray(jax.nn.log_softmax(np.concatenate(logits)[len(prompt) - 1:].astype(np.float32), axis=-1))
    return logp[np.arange(len(tokens)), tokens]


@pytest.mark.heavy
def test_every_token_is_tagged_with_the_version_that_sampled_it(run):
    """Every stored rollout r: its tokens' versions lie in [r - k, r], never decrease along a row, and cover exactly
    its sampled tokens. Every sample whose versions' adapters exist (the run keeps the newest k + 1 versions' PEFT
    folders; version 0 is the base, LoRA starting at B = 0) reproduces the sampler's log-prob of each token from its
    version's adapter, the cache holding what the earlier versions wrote; for the rows that switched, the same pass
    with the first version throughout does not. Rows did switch mid-row."""
    import os

    import jax.numpy as jnp

    from jaxrl.models.peft import read_peft_adapter
    from jaxrl.models import qwen35

    workdir = run["workdir"]
    model = qwen35.from_pretrained(run["base"], dtype=jnp.float32)
    forwards = {0: forward_of(model, None)}
    folders = workdir / "rollout_adapters"
    for name in os.listdir(folders):
        forwards[int(name[1:])] = forward_of(model, read_peft_adapter(str(folders / name))[0])
    assert sorted(forwards) == [0, STEPS - 3, STEPS - 2, STEPS - 1]  # k + 1 kept, besides the base

    switched = checked = 0
    for r in range(STEPS):
        b = rollout_buffer(str(workdir), r)
        versions, ids, attn = b["token_versions"], b["input_ids"], b["attention_mask"]
        real, P = versions >= 0, ids.shape[1] - CAP  # P: data.max_prompt_len, the prompts' left-padded columns
        np.testing.assert_array_equal(real, attn[:, P:] == 1, err_msg=f"rollout {r}")
        assert versions[real].min() >= max(r - K, 0) and versions[real].max() <= r, (r, np.unique(versions[real]))
        for i in range(len(ids)):
            n = int(real[i].sum())
            v = versions[i, :n]
            assert (np.diff(v) >= 0).all(), (r, i, v)
            if not set(v.tolist()) <= set(forwards):
                continue
            prompt = ids[i, :P][attn[i, :P] == 1].tolist()
            tokens = ids[i, P:P + n].tolist()
            got = segmented_logprobs(model, forwards, prompt, tokens, v)
            np.testing.assert_allclose(got, b["sampler_logp"][i, :n], atol=SAMPLED_ATOL,
                                       err_msg=f"rollout {r} sample {i} versions {v.tolist()}")
            checked += 1
            if v[0] != v[-1]:  # and the tokens after the switch are not the first version's
                unswitched = segmented_logprobs(model, forwards, prompt, tokens, np.full_like(v, v[0]))
                after = v != v[0]
                assert np.abs(unswitched[after] - b["sampler_logp"][i, :n][after]).max() > 10 * SAMPLED_ATOL
                switched += 1
    assert checked >= 64 and switched >= 2, (checked, switched)


@pytest.mark.heavy
def test_no_step_trains_a_token_over_the_bound_and_the_metrics_are_per_token(run):
    from jaxrl.algorithms.online.controller import token_version_metrics

    steps = metrics(run["workdir"])
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        assert s["rollout/staleness_max"] <= K and s["rollout/dropped_stale_samples"] == 0
        assert np.isfinite(s["loss"]) and not s["update_skipped"]
        assert s["rollout/adapter_digest"] == s["rollout/served_digest"]  # the version published, served
        assert s["rollout/published_version"] == s["step"] - 1
        b = rollout_buffer(str(run["workdir"]), s["step"] - 1)
        want = token_version_metrics(b["token_versions"], s["step"] - 1)
        assert {k: s[k] for k in want} == pytest.approx(want)
    assert max(s["rollout/partial_fraction"] for s in steps) > 0  # rows continued under a new version
    assert max(s["rollout/staleness_max"] for s in steps) >= 1


@pytest.mark.heavy
def test_ppo_with_partial_rollouts_trains_on_tagged_tokens(run):
    """PPO (value head, GAE, the adaptive KL controller updated by k producer threads under its lock) with partial
    rollouts on the same servers: the run finishes finite, every step inside the bound, with per-token metrics."""
    import subprocess
    import sys

    from launcher_env import launch_env
    from test_server_rollouts import ROOT

    root, urls = run["root"], run["urls"]
    workdir = root / "ppo"
    cmd = [sys.executable, "-m", "launchers.train", "--config=configs/ppo_tiny.py", f"--workdir={workdir}",
           f"--config.model_path={run['base']}", "--config.steps=12", "--config.checkpoint_every=12",
           "--config.tensorboard=False", "--config.checkpoint_async=False", "--config.ppo.rollout_backend=server",
           f"--config.ppo.rollout_servers=({', '.join(repr(u) for u in urls)},)", f"--config.ppo.max_staleness={K}",
           "--config.ppo.partial_rollouts=True", "--config.ppo.off_policy_loss=decoupled",
           "--config.ppo.adaptive_kl=True", f"--config.ppo.max_new_tokens={CAP}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(root / "jax_cache"), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = metrics(workdir)
    assert [s["step"] for s in steps] == list(range(1, 13))
    assert all(np.isfinite(s["loss"]) and s["rollout/staleness_max"] <= K for s in steps)
    assert all(s["rollout/dropped_stale_samples"] == 0 and np.isfinite(s["kl_coef"]) for s in steps)
    # per-token metrics: the buffers carried token versions (the run's buffers are pruned with its checkpoints)
    assert all("rollout/version_span_max" in s for s in steps)
    assert max(s["rollout/staleness_max"] for s in steps) >= 1


@pytest.mark.heavy
def test_a_run_resumed_inside_a_rollout_it_must_sample_again_publishes_first(run):
    """Killed after step 3, the first of rollout 1's two (a checkpoint every step), and rollout 1's stored buffer
    lost: the resumed process starts inside the rollout, having published nothing yet; it publishes its version
    before sampling rollout 1 again (warned), and the run ends."""
    root, urls = run["root"], run["urls"]
    workdir = root / "resumed"
    args = overrides(run["base"], urls, "server") + [
        "--config.steps=4", "--config.checkpoint_every=1", "--config.grpo.num_iterations=2",
        "--config.grpo.max_new_tokens=8",
        f"--config.grpo.max_staleness={K}", "--config.grpo.partial_rollouts=True",
        "--config.grpo.off_policy_loss=decoupled"]
    first = train(workdir, root / "jax_cache", *args, kill_after=3)
    assert first.returncode == -9, first.stderr[-3000:]
    (workdir / "rollouts" / "1.npz").unlink()
    second = train(workdir, root / "jax_cache", *args)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed at step 3, in rollout 1, but" in second.stderr and "sampling a new rollout" in second.stderr
    steps = metrics(workdir)
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and all(np.isfinite(s["loss"]) for s in steps)
