"""DPO on the training core: the objective against an independent forward, learning on CPU, the reference cache,
a SIGKILLed run resuming bit-identically, and a tampered cohort refused at start."""

import json
import math
import os
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxrl.algorithms import dpo as dpo_lib
from jaxrl.algorithms import dpo_task
from jaxrl.algorithms.dpo_task import DPOObjective, DPOTask, sequence_logps_all
from jaxrl.data import dpo_data
from jaxrl.data.pairs import CohortError, freeze_cohort
from jaxrl.models.lora import LoRAParam, iter_lora
from jaxrl.parallel.mesh import mesh_from_config
from jaxrl.generation import generate
from jaxrl.models.adapters import load_adapter
from jaxrl.train.checkpoints import RunCheckpoints
from jaxrl.algorithms.run import build_model, load_run_plugins, resolve_config, run_training
from jaxrl.train.loop import Trainer
from jaxrl.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK = {"xla_backend_optimization_level": 0}  # test compiles: a low LLVM level compiles much faster


# ------------------------------------------------------------------------------------------ objective


def _ragged_pairs(n, vocab, seed):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        p, lc, lr = (int(x) for x in rng.integers(1, 7, size=3))
        tok = lambda k: [int(t) for t in rng.integers(2, vocab, size=k)]  # noqa: E731
        recs.append({"pair_id": str(i), "prompt_ids": tok(p), "chosen_ids": tok(lc), "rejected_ids": tok(lr)})
    return recs


def _independent_logps(logits, recs):
    """Per pair: the sum over its completion tokens of log softmax (float64) of the full [B, T, V] logits, and
    the per-token values; positions come from the raw lengths, not from any mask the code under test built."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    logsm = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    tokens = [[logsm[i, len(r["prompt_ids"]) + j - 1, t] for j, t in enumerate(r["completion"])]
              for i, r in enumerate(recs)]
    return np.asarray([sum(t) for t in tokens]), tokens


@partial(jax.jit, static_argnames=("objective", "graphdef", "grad"), compiler_options=QUICK)
def _objective_program(objective, graphdef, lora, rest, batch, normalisers, grad):
    def loss(lora_state):
        return objective.loss(nnx.merge(graphdef, lora_state, rest), batch, normalisers, jax.random.key(0))
    if not grad:
        return loss(lora), None
    return jax.value_and_grad(loss, has_aux=True)(lora)


def _run_objective(objective, model, batch, normalisers=None, grad=False):
    """(loss, metrics, grads wrt the LoRA factors (an nnx.State) or None) of `objective` on one micro-batch."""
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)
    normalisers = objective.normalisers(batch) if normalisers is None else normalisers
    (value, metrics), grads = _objective_program(objective, graphdef, lora, rest, batch, normalisers, grad)
    return float(value), {k: float(v) for k, v in metrics.items()}, grads


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_objective_equals_dpo_on_an_independent_forward():
    c = resolve_config(tiny_config("dpo"))
    model = build_model(c, mesh_from_config(c.mesh))
    recs = _ragged_pairs(6, 256, seed=0)
    seqs = dpo_data.build_sequences(dpo_data.pretokenized_pairs(recs), dpo_data.SequenceConfig(
        max_length=32, pad_multiple=16))
    batch = {k: jnp.asarray(v) for k, v in seqs.arrays.items()}
    beta, w_sft = 0.1, 0.5
    # RPO (sigmoid + w x chosen NLL) covers both kinds of term; chunk 8 < 2 x 6 x 15 rows: the chunked log-prob
    # path with a ragged last chunk
    rpo = dict(loss_types=("sigmoid", "sft"), loss_weights=(1.0, w_sft), beta=beta, chunk_size=8)
    off = DPOObjective(reference="adapters_off", **rpo)

    # step 0: fresh adapters (B = 0) are the reference exactly: the sigmoid term is log 2
    _, m0, _ = _run_objective(off, model, batch)
    assert abs(m0["loss/sigmoid"] - math.log(2.0)) < 1e-6 and abs(m0["reward_margin"]) < 1e-6

    # the independent computation: full logits of plain forwards, in float64 on the host; the reference is the
    # same weights with B = 0
    lora_graph, lora0, rest = nnx.split(model, LoRAParam, ...)
    lora0 = jax.tree.map(jnp.copy, lora0)  # a snapshot: the split state shares the model's variables
    forward = jax.jit(lambda lo, re, ids, m: nnx.merge(lora_graph, lo, re)(ids, attention_mask=m),
                      compiler_options=QUICK)

    def independent(lora_state):
        out = {}
        for side in ("chosen", "rejected"):
            logits = forward(lora_state, rest, batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"])
            out[side], out[side + "_tokens"] = _independent_logps(
                logits, [dict(r, completion=r[f"{side}_ids"]) for r in recs])
        return out

    def formula(pol, ref):  # RPO: the published DPO loss -log sigmoid(z) + w x token-mean NLL of chosen
        z = beta * ((pol["chosen"] - ref["chosen"]) - (pol["rejected"] - ref["rejected"]))
        nll = -sum(sum(t) for t in pol["chosen_tokens"]) / sum(len(t) for t in pol["chosen_tokens"])
        return float(np.mean(np.log1p(np.exp(-z)))), nll, z

    ref = independent(lora0)
    rng = np.random.default_rng(1)
    for _, adapter in iter_lora(model):  # now move the policy away from the reference
        adapter.lora_B[...] = jnp.asarray(rng.normal(0, 0.1, adapter.lora_B[...].shape), jnp.float32)
    _, lora, _ = nnx.split(model, LoRAParam, ...)
    pol = independent(lora)
    sigmoid, nll, z = formula(pol, ref)
    assert abs(sigmoid - math.log(2.0)) > 1e-3  # the perturbation matters

    loss, m, _ = _run_objective(off, model, batch)
    np.testing.assert_allclose(loss, sigmoid + w_sft * nll, rtol=1e-5)
    np.testing.assert_allclose(m["loss/sigmoid"], sigmoid, rtol=1e-5)
    np.testing.assert_allclose(m["loss/sft"], nll, rtol=1e-5)
    for key, value in (("chosen_logps", pol["chosen"]), ("rejected_logps", pol["rejected"]),
                       ("ref_chosen_logps", ref["chosen"]), ("ref_rejected_logps", ref["rejected"]),
                       ("chosen_rewards", beta * (pol["chosen"] - ref["chosen"])),
                       ("rejected_rewards", beta * (pol["rejected"] - ref["rejected"])), ("reward_margin", z),
                       ("preference_accuracy", (z > 0).astype(float))):
        np.testing.assert_allclose(m[key], value.mean(), rtol=1e-4, atol=1e-6, err_msg=key)
    for side in ("chosen", "rejected"):
        np.testing.assert_allclose(m[f"{side}_length"], np.mean([len(r[f"{side}_ids"]) for r in recs]), rtol=1e-6)

    # the precomputed reference (batched pass, adapters off) == the one computed in the step: same loss, metrics
    pre_c, pre_r = sequence_logps_all(model, seqs.arrays, adapters=False, batch_size=4, chunk_size=8,
                                      compile_options=QUICK)
    np.testing.assert_allclose(pre_c, ref["chosen"], rtol=1e-5)
    np.testing.assert_allclose(pre_r, ref["rejected"], rtol=1e-5)
    pre = DPOObjective(reference="batch", **rpo)
    with_ref = dict(batch, ref_chosen_logps=jnp.asarray(pre_c), ref_rejected_logps=jnp.asarray(pre_r))
    loss_pre, m_pre, grads = _run_objective(pre, model, with_ref, grad=True)
    np.testing.assert_allclose(loss_pre, loss, rtol=1e-6)
    for k, v in m.items():
        np.testing.assert_allclose(m_pre[k], v, rtol=1e-5, atol=1e-6, err_msg=k)

    # gradients: directional derivatives of the independent formula by central differences (no autodiff), along
    # the gradient and along the gradient re-weighted elementwise at random (which checks each element's share)
    def unit(tree):
        norm = math.sqrt(sum(float(jnp.sum(x ** 2)) for x in jax.tree.leaves(tree)))
        return jax.tree.map(lambda x: x / norm, tree), norm
    along_grad, g_norm = unit(grads)
    assert g_norm > 1e-3
    reweighted, _ = unit(jax.tree.map(lambda g: g * jnp.asarray(rng.uniform(0, 2, g.shape), jnp.float32), grads))
    eps = 1e-3  # small enough for the curvature, large enough for float32 forwards
    for direction in (along_grad, reweighted):
        moved = [jax.tree.map(lambda p, d, s=s: p + s * eps * d, lora, direction) for s in (1.0, -1.0)]
        values = [sum(formula(independent(mv), ref)[:2] * np.array([1.0, w_sft])) for mv in moved]
        numeric = (values[0] - values[1]) / (2 * eps)
        analytic = sum(float(jnp.sum(g * d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
        np.testing.assert_allclose(analytic, numeric, rtol=5e-3)

    # micro-batches: shares under the global normalisers add up to the full batch (loss and every metric)
    norms = pre.normalisers(with_ref)
    halves = [_run_objective(pre, model, {k: v[s] for k, v in with_ref.items()}, norms)
              for s in (slice(0, 3), slice(3, 6))]
    np.testing.assert_allclose(halves[0][0] + halves[1][0], loss_pre, rtol=1e-5)
    for k, v in m_pre.items():
        np.testing.assert_allclose(halves[0][1][k] + halves[1][1][k], v, rtol=1e-5, atol=1e-6, err_msg=k)


# ------------------------------------------------------------------------------------------ learning


def _pattern_rate(model, prompts, targets):
    """Fraction of greedily generated tokens (first 4) that continue the prompt's progression."""
    out = generate(model, prompts, max_new_tokens=len(targets[0]), temperature=0.0, eos_token_ids=())
    hits = sum(int(a == b) for toks, tgt in zip(out.tokens, targets) for a, b in zip(toks, tgt))
    return hits / sum(len(t) for t in targets)


@pytest.mark.heavy
@pytest.mark.slow
def test_dpo_learns_the_preferred_pattern_on_cpu(tmp_path):
    c = resolve_config(tiny_config("dpo"))
    mesh = mesh_from_config(c.mesh)
    model = build_model(c, mesh)
    task = DPOTask(c, model, mesh)
    workdir = str(tmp_path / "run")
    trainer = Trainer(c, model, task, workdir, mesh=mesh)
    init = jax.tree.map(jnp.copy, trainer.state.params)
    base = nnx.merge(trainer.graphdef, trainer.codec.to_state(init), trainer.frozen)  # B = 0: the base policy

    held = task.eval
    assert len(held) == 24 and len(task.train) == 168 and not set(held.pair_ids) & set(task.train.pair_ids)
    before = task.evaluate(base)
    # policy == reference exactly before training: no pair is preferred (margins are exactly 0)
    assert before["eval_preference_accuracy"] == 0.0 and before["eval_reward_margin"] == 0.0
    base_c, base_r = sequence_logps_all(base, held.arrays, adapters=True, batch_size=task.ref_batch_size,
                                        chunk_size=64, mesh=mesh, compile_options=QUICK)
    base_prefers = float(np.mean(base_c > base_r))
    assert base_prefers < 0.8  # the random model has no idea which completion follows the rule

    P = c.data.synthetic_prompt_len
    ids = held.arrays["chosen_input_ids"]
    prompts = [[int(t) for t in row[:P]] for row in ids]
    targets = [[int(t) for t in row[P:P + c.data.synthetic_completion_len]] for row in ids]
    rate_before = _pattern_rate(base, prompts, targets)

    result = trainer.run()
    assert result.final_step == c.steps
    trained = trainer.current_model()
    after = task.evaluate(trained)
    rate_after = _pattern_rate(trained, prompts, targets)
    print(f"\nheld-out preference accuracy {before['eval_preference_accuracy']:.3f} -> "
          f"{after['eval_preference_accuracy']:.3f} (base log-prob preference {base_prefers:.3f}); reward margin "
          f"{after['eval_reward_margin']:.4f}; greedy pattern rate {rate_before:.3f} -> {rate_after:.3f}")
    assert after["eval_preference_accuracy"] >= 0.9
    assert after["eval_reward_margin"] > 0.1 and after["eval_chosen_rewards"] > 0
    assert after["eval_loss"] < math.log(2.0) - 0.05 and before["eval_loss"] == pytest.approx(math.log(2.0))
    assert rate_before <= 0.1 and rate_after >= 0.5

    # the step metrics: loss starts at log 2 and falls; late mini-batch accuracy is high
    records = result.records
    assert abs(records[0]["loss"] - math.log(2.0)) < 1e-5
    assert np.mean([r["loss"] for r in records[-4:]]) < 0.6
    assert np.mean([r["preference_accuracy"] for r in records[-4:]]) >= 0.9
    eval_lines = [r for r in read_metrics(workdir) if "eval_preference_accuracy" in r]
    assert [r["step"] for r in eval_lines] == [4, 8, 12, 16, 20]
    assert eval_lines[-1]["eval_preference_accuracy"] == pytest.approx(after["eval_preference_accuracy"])

    # the reference stays fixed: recomputed with the adapters off from the trained model == the cache, bitwise;
    # and each step's ref_chosen_logps metric is the cache's mean over that step's pairs
    with np.load(os.path.join(workdir, dpo_task.REF_CACHE)) as f:
        cached_c, cached_r = np.asarray(f["ref_chosen_logps"]), np.asarray(f["ref_rejected_logps"])
    now_c, now_r = sequence_logps_all(trained, task.train.arrays, adapters=False, batch_size=task.ref_batch_size,
                                      chunk_size=64, mesh=mesh, compile_options=QUICK)
    np.testing.assert_array_equal(now_c, cached_c)
    np.testing.assert_array_equal(now_r, cached_r)
    for r in (records[0], records[-1]):
        rows = task.rows(r["step"] - 1)
        np.testing.assert_allclose(r["ref_chosen_logps"], cached_c[rows].mean(), rtol=1e-6)
    stats = json.load(open(os.path.join(workdir, dpo_task.DATA_STATS)))
    assert stats["train"]["kept"] == 192 and stats["train_pairs"] == 168 and stats["eval_pairs"] == 24

    # the cache is reused when its fingerprint matches and recomputed when it is stale
    path = os.path.join(workdir, dpo_task.REF_CACHE)
    mtime = os.stat(path).st_mtime_ns
    again = DPOTask(c, model, mesh)
    again.setup(trainer.context())
    assert os.stat(path).st_mtime_ns == mtime
    np.testing.assert_array_equal(again.ref["chosen"], cached_c)
    c2 = resolve_config(tiny_config("dpo", max_length=48))  # another length policy: the fingerprint differs
    stale = DPOTask(c2, model, mesh)
    stale.setup(trainer.context())
    with np.load(path) as f:
        assert json.loads(str(f["fingerprint"]))["max_length"] == 48
    np.testing.assert_array_equal(stale.ref["chosen"], cached_c)


# ------------------------------------------------------------------------------------------ cohort, resume


@pytest.fixture(scope="module")
def untrained():
    """(model, mesh) of the tiny config, for tests that only build tasks (they never change the model)."""
    c = resolve_config(tiny_config("dpo"))
    mesh = mesh_from_config(c.mesh)
    return build_model(c, mesh), mesh


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    recs = dpo_data.synthetic_pairs(60, vocab_size=256, seed=5, num_tokens=32)
    out = tmp_path_factory.mktemp("pairs")
    manifest = freeze_cohort(recs, out, size=48, seed=0)
    return str(out / "cohort"), manifest


def launch(workdir, cache_dir, *extra):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0")
    cmd = [sys.executable, "-m", "launchers.train", f"--workdir={workdir}", "--config=configs/dpo_tiny.py",
           "--config.steps=6", "--config.checkpoint_every=2", "--config.data.eval_fraction=0.0",
           "--config.tensorboard=False", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.heavy
@pytest.mark.slow
def test_killed_dpo_run_resumes_to_the_same_adapter(tmp_path, cohort):
    cohort_dir, manifest = cohort
    cache = str(tmp_path / "jax_cache")
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
    data = ["--config.data.source=pairs", f"--config.data.pairs={cohort_dir}", "--config.data.expected_pairs=48"]

    done = launch(straight, cache, *data)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"sha256 {manifest['sha256']}" in done.stderr  # the cohort was verified at start

    killed = launch(broken, cache, *data, "--debug_kill_after_step=3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    ckpt = RunCheckpoints(broken, async_save=False)
    assert ckpt.latest_step() == 2
    ckpt.close()
    ref_path = os.path.join(broken, dpo_task.REF_CACHE)
    ref_mtime = os.stat(ref_path).st_mtime_ns

    resumed = launch(broken, cache, *data)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 2)" in resumed.stderr and "loaded from" in resumed.stderr
    assert os.stat(ref_path).st_mtime_ns == ref_mtime  # the reference cache was reused, not recomputed

    a, a_meta = load_adapter(straight, step=6)
    b, b_meta = load_adapter(broken, step=6)
    assert a_meta["step"] == b_meta["step"] == 6 and sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    assert any(np.abs(a[n]).max() > 0 for n in a if n.endswith("lora_B"))  # it trained
    a_m, b_m = read_metrics(straight), read_metrics(broken)
    assert [r["step"] for r in b_m] == list(range(1, 7))
    for key in ("loss", "preference_accuracy", "reward_margin", "chosen_logps", "ref_chosen_logps"):
        assert [r[key] for r in b_m] == [r[key] for r in a_m], key
    stats = json.load(open(os.path.join(broken, dpo_task.DATA_STATS)))
    assert stats["cohort"]["sha256"] == manifest["sha256"] and stats["train_pairs"] == 48


def test_tampered_cohort_fails_at_start_naming_the_file(tmp_path, cohort, untrained):
    cohort_dir, manifest = cohort
    c = tiny_config("dpo", source="pairs", pairs=cohort_dir, eval_fraction=0.0)
    model, mesh = untrained
    task = DPOTask(resolve_config(c), model, mesh)  # intact: accepted, every pair used
    assert len(task.train) == 48 and task.manifest["sha256"] == manifest["sha256"]

    copy = tmp_path / "cohort"
    copy.mkdir()
    for name in ("manifest.json", "pairs.jsonl"):
        (copy / name).write_bytes((open(os.path.join(cohort_dir, name), "rb")).read())
    raw = bytearray((copy / "pairs.jsonl").read_bytes())
    at = raw.index(b'"prompt_ids": [') + len(b'"prompt_ids": [')
    raw[at] = ord("2") if raw[at] != ord("2") else ord("3")  # one digit of one token id: still valid JSON
    (copy / "pairs.jsonl").write_bytes(bytes(raw))
    mismatch = r"cohort/pairs\.jsonl: sha256 .* does not match"
    # through the launcher's entry point: refused before any training step or checkpoint
    workdir = tmp_path / "run"
    c.data.pairs = str(copy)
    with pytest.raises(CohortError, match=mismatch):
        run_training(c, str(workdir))
    assert not (workdir / "checkpoints").exists()
    c.data.pairs = str(copy / "pairs.jsonl")  # the pairs file of a cohort is verified too
    with pytest.raises(CohortError, match=mismatch):
        DPOTask(resolve_config(c), model, mesh)
    c.data.pairs, c.data.expected_pairs = cohort_dir, 50
    with pytest.raises(ValueError, match="holds 48 pairs; data.expected_pairs=50"):
        DPOTask(resolve_config(c), model, mesh)


# ------------------------------------------------------------------------------------------ config family, plug-in


def test_family_config_reproduces_the_users_runs():
    from configs import dpo as family
    from jaxrl.algorithms.run import build_model as build
    expect = {  # run: (model preset, start, lr, beta, lora rank/alpha, max length, pairs)
        "9b_tuned": ("9b", "m0", 5e-7, 0.1, (16, 32.0), 2560, 1000),
        "4b_high_lr": ("4b", "m0", 1e-5, 0.01, (16, 32.0), 2048, 1000),
        "4b_base_final": ("4b", "base", 1e-6, 0.1, (16, 32.0), 6144, 1000),
        "4b_m0_clean": ("4b", "m0", 1e-6, 0.05, (16, 32.0), 2048, 433),
        "9b_m0_clean": ("9b", "m0", 5e-7, 0.1, (16, 32.0), 2560, 245),
    }
    for run, (model, start, lr, beta, lora, max_length, pairs) in expect.items():
        c = family.get_config(f"run={run}")
        assert (c.start, c.optimizer.learning_rate, c.dpo.beta, (c.lora.rank, c.lora.alpha), c.data.max_length,
                c.data.expected_pairs) == (start, lr, beta, lora, max_length, pairs), run
        assert c.run == run and c.algorithm == "dpo" and c.steps == 125 and c.checkpoint_every == 4
        assert c.batch.micro_batch_size * c.batch.grad_accum == 8 and c.dpo.loss_type == "sigmoid"
    c = family.get_config("run=m0_initial,model=9b,lora=r32,lr=5e-6,mb=2,loss=sigmoid+sft,max_length=6144")
    assert (c.lora.rank, c.lora.alpha, c.optimizer.learning_rate, c.batch.micro_batch_size, c.batch.grad_accum,
            c.dpo.loss_type, c.remat, c.dpo.beta) == (32, 64.0, 5e-6, 2, 4, "sigmoid,sft", "auto", 0.05)
    with pytest.raises(ValueError, match="unknown override key 'learning_rate'"):
        family.get_config("learning_rate=1e-6")
    with pytest.raises(ValueError, match=r"lora='r8'"):
        family.get_config("lora=r8")
    with pytest.raises(ValueError, match="mb=3 must divide"):
        family.get_config("mb=3")
    # the placeholders must be set: an empty model_path stops before anything is built or trained
    c = family.get_config("run=4b_base_final")
    c.model_path = ""
    with pytest.raises(ValueError, match="model_path is empty"):
        build(resolve_config(c))


def test_plugin_loss_from_the_config_is_registered_and_used(tmp_path, untrained):
    from jaxrl.algorithms import plugins
    from jaxrl.algorithms.plugins import PluginError
    (tmp_path / "losses.py").write_text(
        "import jax\n\ndef t_twice_sigmoid(p):\n    return -2.0 * jax.nn.log_sigmoid(p.beta * p.delta)\n")
    (tmp_path / "bad.py").write_text("def t_scalar(p):\n    return p.delta.sum()\n")
    c = tiny_config("dpo")
    model, mesh = untrained

    def task_of(c):  # what run_training does: plug-ins (dpo.plugin, the deprecated alias, included), then the task
        resolved = resolve_config(c)
        load_run_plugins(resolved)
        return DPOTask(resolved, model, mesh)

    try:
        c.dpo.plugin, c.dpo.loss_type = f"{tmp_path}/losses.py:t_twice_sigmoid", "t_twice_sigmoid"
        task = task_of(c)
        assert task.objective.loss_types == ("t_twice_sigmoid",)
        rng = np.random.default_rng(0)
        c_, r_, rc, rr = (rng.normal(-20, 3, 16) for _ in range(4))
        summary = dpo_task.preference_summary(c_, r_, rc, rr, task.objective)
        z = 0.1 * ((c_ - rc) - (r_ - rr))
        np.testing.assert_allclose(summary["loss"], np.mean(2 * np.logaddexp(0, -z)), rtol=1e-5)
        c.dpo.plugin, c.dpo.loss_type = f"{tmp_path}/bad.py:t_scalar", "t_scalar"
        with pytest.raises(PluginError, match="t_scalar"):
            task_of(c)
        c.dpo.plugin, c.dpo.loss_type = "", "sigmoid,nope"
        with pytest.raises(ValueError, match="dpo.loss_type"):
            task_of(c)
    finally:
        for name in ("t_twice_sigmoid", "t_scalar"):
            plugins.unregister("dpo_loss", name)


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired", "sigmoid,aot"])
def test_losses_that_sort_across_pairs_refuse_a_micro_batch_of_one(loss_type, untrained):
    """aot / aot_unpaired sort the pairs of a micro-batch: one pair sorts to itself, so at micro-batch 1 they are
    plain smoothed sigmoid DPO. Refused, naming both keys; from 2 pairs on they run, with a warning that the
    update depends on the micro-batch size."""
    model, mesh = untrained
    c = tiny_config("dpo")
    c.dpo.loss_type, c.dpo.label_smoothing = loss_type, 0.1
    c.batch.micro_batch_size, c.batch.grad_accum = 1, 8
    with pytest.raises(ValueError, match=r"dpo.loss_type.*aot.*batch.micro_batch_size=1"):
        DPOTask(resolve_config(c), model, mesh)
    c.batch.micro_batch_size = 4
    with pytest.warns(UserWarning, match="depends on batch.micro_batch_size"):
        task = DPOTask(resolve_config(c), model, mesh)
    assert "aot" in task.objective.loss_types[-1]
    # The fact behind the refusal: sorting one pair is the identity, so at b = 1 aot is smoothed sigmoid DPO.
    c_, r_, rc, rr = (np.array([x], np.float32) for x in (-18.0, -23.0, -20.0, -21.0))
    z = 0.1 * ((c_ - r_) - (rc - rr))
    for name in ("aot", "aot_unpaired"):
        one = dpo_lib.dpo_loss(c_, r_, rc, rr, loss_type=name, beta=0.1, label_smoothing=0.1)
        np.testing.assert_allclose(one, 0.9 * np.logaddexp(0, -z) + 0.1 * np.logaddexp(0, z), rtol=1e-6)


def test_a_data_set_smaller_than_one_batch_is_named_with_a_warning(untrained, tmp_path):
    """One pair for a global batch of 8 (4 x 2): every step would train on that pair 8 times. Allowed (a smoke
    run), but said: the file, its size and the batch; a data set that fills the batch says nothing."""
    import warnings

    model, mesh = untrained
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"pair_id": "p0", "prompt_ids": [5, 6, 7], "chosen_ids": [8, 9],
                                 "rejected_ids": [10, 11]}) + "\n")
    c = tiny_config("dpo")
    c.data.source, c.data.pairs, c.data.eval_fraction = "pairs", str(pairs), 0.0
    with pytest.warns(UserWarning) as caught:
        DPOTask(resolve_config(c), model, mesh)
    assert [str(w.message) for w in caught if "global batch" in str(w.message)] == [
        f"data.pairs={pairs}: 1 training pair for a global batch of 8 (batch.micro_batch_size x batch.grad_accum): "
        "every step repeats each pair about 8 times"]
    c.data.source, c.data.synthetic_pairs = "synthetic", 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DPOTask(resolve_config(c), model, mesh)
