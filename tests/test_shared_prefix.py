"""Shared prefixes (issue 51 item 2, jaxrl/algorithms/online/shared_prefix.py): each group's prompt computed once
and its completions continued from the prompt's caches (attention keys / values, Gated DeltaNet conv window and
recurrent state) give the padded layout's per-token log-probs and values, and a GRPO, PPO or distillation step's
loss, metrics and every LoRA (and value-head) gradient, within float32 rounding; the prompt tokens a pass computes
are G x P, not N x P."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.algorithms.distill_task import DistillObjective
from jaxrl.algorithms.grpo_task import GRPOObjective
from jaxrl.algorithms.online.layout import OnlineLayout, is_shared, prefix_group
from jaxrl.algorithms.online.passes import teacher_forced
from jaxrl.algorithms.ppo_task import TRAINABLE, PPOObjective
from jaxrl.models import lora, qwen35
from jaxrl.models.teacher_forced import shared_prefix_hidden
from tests.test_packed_online import QUICK, TOL, _model, _step, ppo_targets, teacher_support

P, C = 12, 10  # prompt columns (left-padded), completion columns (right-padded)
N, MB = 8, 4  # rows, rows per micro-batch


def _rows(rng, vocab, n, episodes=False):
    """Prompt-major rollout rows: N / n prompts of varied lengths (1 token, all P columns, ...), each sampled n
    times with completions of varied lengths (empty, full); episodes: observations inside the completion."""
    ids = np.zeros((N, P + C), np.int32)
    attn = np.zeros_like(ids)
    mask = np.zeros((N, C), np.float32)
    prompts = [1, P, 5, 9, 3, 7, 2, 11]
    completions = [C, 4, 0, C, 1, 6, 8, 3]
    for i, c in enumerate(completions):
        p = prompts[i // n]
        if i % n == 0:
            prompt = rng.integers(2, vocab, p)
        ids[i, P - p:P] = prompt
        ids[i, P:P + c] = rng.integers(2, vocab, c)
        attn[i, P - p:P + c] = 1
        mask[i, :c] = 1.0
        if episodes and c > 4:
            mask[i, 2:4] = 0.0
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": mask}


def _shared(batch, group=MB, n=None):
    out, metrics = OnlineLayout("shared_prefix", width=C).apply(batch, group)
    assert is_shared(out) and metrics["layout/shared_prefix"] == 1
    if n is not None:
        assert out["prefix_rows"].shape == (N, n) and metrics["layout/prefix_group"] == n
    return out


def test_prefix_group_counters_and_fallback():
    """n is found in the rows (the largest divisor of the call's rows whose aligned blocks share a prompt); the
    counters count each group's prompt once; rows that share no prompt stay padded."""
    rng = np.random.default_rng(0)
    batch = _rows(rng, 64, 4)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    assert prefix_group(ids, attn, C, 8) == 4 and prefix_group(ids, attn, C, 4) == 4
    assert prefix_group(ids, attn, C, 2) == 2  # a call of 2 rows: groups of 2 inside it
    _, padded = OnlineLayout("padded", width=C).apply(batch, 8)
    out, shared = OnlineLayout("shared_prefix", width=C).apply(batch, 8, where="pass")
    assert out["prefix_rows"].shape == (N, 4) and all(out[k] is batch[k] for k in batch)
    groups = attn[::4, :P]
    assert shared["layout/pass_prompt_tokens"] == groups.sum() == 1 + P  # G x P, not N x P
    assert padded["layout/prompt_tokens"] == 4 * groups.sum()
    assert shared["layout/pass_row_tokens"] == 2 * P + N * C < padded["layout/row_tokens"] == N * (P + C)
    real = groups.sum() + attn[:, P:].sum()
    assert shared["layout/pass_padding_tokens"] == shared["layout/pass_row_tokens"] - real
    # every row its own prompt: padded, said so
    lone = _rows(rng, 64, 1)
    out, m = OnlineLayout("shared_prefix", width=C).apply(lone, 4)
    assert not is_shared(out) and out is lone and m["layout/shared_prefix"] == 0 and m["layout/prefix_group"] == 1
    assert m["layout/row_tokens"] == N * (P + C)
    # a permuted minibatch (several minibatches per rollout): no aligned block shares a prompt
    perm = {k: v[[0, 4, 1, 5, 2, 6, 3, 7]] for k, v in batch.items()}
    assert prefix_group(perm["input_ids"], perm["attention_mask"], C, 4) == 1
    # auto leaves prompts of 12 columns padded (MIN_SHARED_PROMPT)
    out, m = OnlineLayout("auto", width=C).apply(batch, 8)
    assert not is_shared(out) and m["layout/shared_prefix"] == 0 and m["layout/prefix_group"] == 1


def _lengths_rows(rng, groups, n, prompt, width, low):
    """Prompt-major rows (ids and mask only) of `groups` prompts of `prompt` tokens, each sampled n times with
    completions of low..width tokens."""
    rows = groups * n
    ids = np.zeros((rows, prompt + width), np.int32)
    attn = np.zeros_like(ids)
    for g in range(groups):
        shared = rng.integers(2, 100, prompt)
        for i in range(g * n, g * n + n):
            c = int(rng.integers(low, width + 1))
            ids[i, :prompt], attn[i, :prompt + c] = shared, 1
            ids[i, prompt:prompt + c] = rng.integers(2, 100, c)
    return {"input_ids": ids, "attention_mask": attn}


def test_auto_weighs_padded_packed_and_shared_prefix():
    """auto takes the layout computing the fewest row tokens when at most 0.8 of padded: shared_prefix for the
    prompt-heavy step (prompts of 512, completions of 64-256, groups of 8), padded where prompts are short, and
    padded or packed when the rows share no prompt; the reason names every candidate's share."""
    rng = np.random.default_rng(9)
    heavy = _lengths_rows(rng, 2, 8, 512, 256, 64)
    plan = OnlineLayout("auto", width=256, name="grpo").plan(heavy["attention_mask"], 8, heavy["input_ids"])
    assert plan.shared == 8 and not plan.packed
    assert plan.counters["row_tokens"] == 2 * 512 + 16 * 256 and plan.counters["prompt_tokens"] == 2 * 512
    assert plan.reason.startswith("shared_prefix: ") and "shared_prefix (n=8) 0.42" in plan.reason
    assert "short of 1024" in plan.reason  # packed not weighed: rows of 768
    out, m = OnlineLayout("auto", width=256).apply(heavy, 8)
    assert is_shared(out) and m["layout/shared_prefix"] == 1 and m["layout/prefix_group"] == 8
    # the same rows split in micro-batches of 4: half a group each, its prompt computed twice per step
    assert OnlineLayout("auto", width=256).plan(heavy["attention_mask"], 4, heavy["input_ids"]).shared == 4
    # short prompts: (2 x 32 + 16 x 256) / (16 x 288) = 0.90 > 0.8: padded
    short = _lengths_rows(rng, 2, 8, 32, 256, 64)
    plan = OnlineLayout("auto", width=256).plan(short["attention_mask"], 8, short["input_ids"])
    assert not plan.shared and not plan.packed and "prompts of 32 columns are short of 256" in plan.reason
    # prompts of 256 under completions of 2,048: (2 x 256 + 16 x 2,048) / (16 x 2,304) = 0.90; packed 1.00: padded
    long = _lengths_rows(rng, 2, 8, 256, 2048, 1900)
    plan = OnlineLayout("auto", width=2048).plan(long["attention_mask"], 8, long["input_ids"])
    assert not plan.shared and not plan.packed and plan.reason.startswith("padded: ")
    assert "shared_prefix (n=8) 0.90" in plan.reason and "packed (" in plan.reason
    # the users' shape, one micro-batch of 4 rows of one prompt of 2,048 and completions of 256-4,096: 0.75
    users = _lengths_rows(rng, 1, 4, 2048, 4096, 4096)
    plan = OnlineLayout("auto", width=4096).plan(users["attention_mask"], 4, users["input_ids"])
    assert plan.shared == 4 and "shared_prefix (n=4) 0.75" in plan.reason
    # rows that share no prompt (a permuted minibatch): shared_prefix not possible
    perm = {k: v[[0, 8, 1, 9, 2, 10, 3, 11]] for k, v in heavy.items()}
    plan = OnlineLayout("auto", width=256).plan(perm["attention_mask"], 8, perm["input_ids"])
    assert not plan.shared and "no aligned block of rows shares a prompt" in plan.reason


def test_a_pass_computes_each_prompt_once(monkeypatch):
    """What the model computes, read off its calls: the prompts [G, P] once, continued by the completions [N, C],
    and no whole-row pass."""
    model = _model()
    batch = _shared(_rows(np.random.default_rng(1), model.config.vocab_size, 4), 8, 4)
    shapes, rows = [], []
    real_branched, real_hidden = qwen35.Qwen35.branched_hidden_states, qwen35.Qwen35.hidden_states

    def branched(self, prompt_ids, prompt_mask, branch_ids, *args, **kw):
        shapes.append((tuple(prompt_ids.shape), tuple(branch_ids.shape)))
        return real_branched(self, prompt_ids, prompt_mask, branch_ids, *args, **kw)

    def hidden(self, input_ids, *args, **kw):
        rows.append(tuple(input_ids.shape))
        return real_hidden(self, input_ids, *args, **kw)

    monkeypatch.setattr(qwen35.Qwen35, "branched_hidden_states", branched)
    monkeypatch.setattr(qwen35.Qwen35, "hidden_states", hidden)
    teacher_forced(model, batch, adapters=True, batch_size=8, compile_options=QUICK)
    assert shapes == [((2, P), (N, C))] and rows == []


@pytest.mark.slow  # compiles the padded and the shared-prefix program
def test_shared_passes_give_the_padded_logprobs_and_values():
    """Reference (adapters off) and old (with values) passes, per call of 8 rows (two groups of 4) and of 4
    (one group): the padded numbers on every completion token."""
    model = _model()
    batch = _rows(np.random.default_rng(2), model.config.vocab_size, 4)
    on = batch["completion_mask"] > 0
    for adapters, values, calls in ((False, False, 8), (True, True, 4)):
        kw = dict(adapters=adapters, values=values, batch_size=calls, temperature=0.7, chunk_size=64,
                  compile_options=QUICK)
        want = teacher_forced(model, batch, **kw)
        got = teacher_forced(model, _shared(batch, calls, 4), **kw)
        for key in want:
            np.testing.assert_allclose(got[key][on], want[key][on], rtol=TOL, atol=TOL, err_msg=key)
            assert np.all(got[key][~on] == 0)


def _same_step(objective, model, batch, trainable=lora.LoRAParam):
    """The step over padded rows and over shared-prefix rows (groups of 2, two per micro-batch of MB)."""
    loss_u, met_u, g_u = _step(objective, model, batch, trainable)
    loss_s, met_s, g_s = _step(objective, model, _shared(batch, MB, 2), trainable)
    np.testing.assert_allclose(loss_s, loss_u, rtol=TOL, atol=1e-7)
    assert set(met_s) == set(met_u)
    for name in met_u:
        np.testing.assert_allclose(met_s[name], met_u[name], rtol=TOL, atol=1e-6, err_msg=name)
    assert len(g_s) == len(g_u) > 0
    scale = max(float(np.abs(g).max()) for g in g_u)
    assert scale > 1e-4
    for gs, gu in zip(g_s, g_u):  # relative to the largest entry: float32 sums in another order
        np.testing.assert_allclose(gs, gu, rtol=1e-4, atol=TOL * scale)
    return loss_u, met_u


def _grpo_batch(model, rng, episodes=False):
    batch = _rows(rng, model.config.vocab_size, 2, episodes)
    kw = dict(batch_size=N, temperature=0.7, chunk_size=64, compile_options=QUICK)
    ref = teacher_forced(model, batch, adapters=False, **kw)["logp"]
    old = teacher_forced(model, batch, adapters=True, **kw)["logp"]
    mask = batch["completion_mask"]
    batch.update(advantages=rng.standard_normal(N).astype(np.float32),
                 sequence_mask=np.ones(N, np.float32), ref_logp=ref,
                 old_logp=(old + 0.3 * rng.standard_normal(old.shape) * mask).astype(np.float32))
    return batch


@pytest.mark.slow  # compiles the padded and the shared-prefix step
@pytest.mark.parametrize("episodes", [False, True], ids=["single_turn", "multi_turn"])
def test_grpo_step_shared_prefix_equals_padded(episodes):
    """GRPO (sequence_mean, KL to the reference, clipped off-policy ratio, entropy): loss, metrics, every LoRA
    gradient (the prompts' through the summed branches)."""
    model = _model()
    batch = _grpo_batch(model, np.random.default_rng(3), episodes)
    objective = GRPOObjective(max_new_tokens=C, aggregation="sequence_mean", beta=0.1, temperature=0.7,
                              epsilon_low=0.2, epsilon_high=0.28, entropy=True, chunk_size=64)
    _, metrics = _same_step(objective, model, batch)
    assert metrics["clip_fraction/region"] > 0


@pytest.mark.slow  # compiles the padded and the shared-prefix step
def test_ppo_step_shared_prefix_equals_padded():
    """PPO: policy and value loss from the same hidden states; LoRA and value-head gradients."""
    model = _model()
    rng = np.random.default_rng(4)
    batch = ppo_targets(_grpo_batch(model, rng), rng)
    _same_step(PPOObjective(temperature=0.7, cliprange_value=0.2, chunk_size=64), model, batch, TRAINABLE)


@pytest.mark.slow  # compiles the padded and the shared-prefix step
def test_distill_step_shared_prefix_equals_padded():
    """Distillation's student pass on the teacher's support (jsd): loss, metrics, gradients."""
    model = _model()
    rng = np.random.default_rng(5)
    batch = teacher_support(_rows(rng, model.config.vocab_size, 2), rng, model.config.vocab_size)
    _same_step(DistillObjective(loss_name="jsd", temperature=0.7, chunk_size=64), model, batch)


@pytest.mark.slow  # a rollout through the real task, twice
def test_grpo_task_routes_the_shared_prefix_layout(tmp_path):
    """The real GRPO task (tiny config, 4 prompts x 4 samples, one minibatch per rollout) with its layout set to
    shared_prefix: the rollout passes and the train batch find groups of 4; the reference log-probs and the step's
    gradients are the padded task's."""
    from conftest import first_batch, tiny_config
    from jaxrl.algorithms.run import build_model, resolve_config
    from jaxrl.algorithms.tasks import get_task_factory
    from jaxrl.parallel.mesh import make_mesh
    from jaxrl.train.loop import Trainer
    from jaxrl.train.step import accumulate_gradients, make_micro_loss, split_batch

    out = {}
    for name in ("padded", "shared_prefix"):
        cfg = tiny_config("grpo", num_generations=4, prompts_per_step=4, beta=0.1)
        cfg.batch.micro_batch_size, cfg.batch.grad_accum = 8, 2
        cfg = resolve_config(cfg)
        model = build_model(cfg)
        task = get_task_factory("grpo")(cfg, model, make_mesh((1, 1, 1)))
        task.layout = OnlineLayout(name, width=task.layout.width, pad_id=task.layout.pad_id, name="grpo")
        trainer = Trainer(cfg, model, task, str(tmp_path / name), mesh=make_mesh((1, 1, 1)))
        batch, host = first_batch(trainer)
        params = dict(jax.device_get(trainer.state.params))
        rng = np.random.default_rng(0)
        for key in sorted(params):
            if key.endswith("lora_B"):
                params[key] = rng.standard_normal(params[key].shape).astype(np.float32) * 0.3
        objective = task.objective
        split = split_batch(batch, 2)
        f = jax.jit(lambda p, b: accumulate_gradients(make_micro_loss(objective, trainer.graphdef, trainer.codec),
                                                      objective, p, trainer.frozen, b, jax.random.key(0)),
                    compiler_options=QUICK)
        out[name] = batch, host, jax.device_get(f(params, split))
    (b_pad, h_pad, (loss_pad, g_pad, _)), (b_sh, h_sh, (loss_sh, g_sh, _)) = out["padded"], out["shared_prefix"]
    assert "prefix_rows" not in b_pad and b_sh["prefix_rows"].shape == (16, 4)
    assert h_sh["layout/prefix_group"] == h_sh["layout/pass_prefix_group"] == 4
    assert h_sh["layout/prompt_tokens"] * 4 == h_pad["layout/prompt_tokens"]
    np.testing.assert_array_equal(b_sh["input_ids"], b_pad["input_ids"])
    np.testing.assert_allclose(b_sh["ref_logp"], b_pad["ref_logp"], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(loss_sh, loss_pad, rtol=TOL, atol=1e-7)
    scale = max(float(np.abs(g).max()) for g in g_pad.values())
    assert scale > 1e-4 and set(g_sh) == set(g_pad)
    for key in g_pad:
        np.testing.assert_allclose(g_sh[key], g_pad[key], rtol=1e-4, atol=TOL * scale, err_msg=key)


def test_continuation_attention_equals_the_cache_attention_and_its_gradient():
    """The training form of continuing a prefix (query blocks that read keys up to their last query, each block
    recomputed in the backward) gives the one-block cache attention's outputs and input gradients: blocks of 3 over
    7 queries (a short last block), left-padded prefixes, padded continuation slots."""
    from jaxrl.ops import attention as attn
    rng = np.random.default_rng(7)
    batch, heads, kv, hd, start, width = 3, 4, 2, 8, 5, 7
    slots = start + width + 2  # two slots past the call: never visible
    q = jnp.asarray(rng.standard_normal((batch, width, heads, hd)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, kv, slots, hd)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, kv, slots, hd)), jnp.float32)
    valid = np.ones((batch, slots), bool)
    valid[0, :3] = False  # a left-padded prefix
    valid[1, start + 5:] = False  # a continuation padded at its end
    valid = jnp.asarray(valid)
    q_slots = start + jnp.arange(width)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

    blocked = lambda q, k, v: attn.continuation_attention(q, k, v, valid, start, 0.3, block_size=3)  # noqa: E731
    whole = lambda q, k, v: attn.cache_attention(q, k, v, valid, q_slots, 0.3)  # noqa: E731
    np.testing.assert_allclose(blocked(q, k, v), whole(q, k, v), rtol=1e-6, atol=1e-6)
    got = jax.grad(loss(blocked), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(got[1][:, :, start + width:]).max()) == 0  # slots past the call get no gradient
    # what the backward keeps: each block recomputes its scores ([.., 3, s] at a time), none is saved
    text = str(jax.make_jaxpr(jax.grad(loss(blocked)))(q, k, v))
    assert text.count("remat2[") == 3


@pytest.mark.heavy  # compiles a 4-layer scanned, rematerialised step in both layouts (about 25 s)
def test_grpo_step_shared_prefix_scanned_and_rematerialised_equals_padded(monkeypatch):
    """The shared-prefix step as the users' shapes run it: layers scanned over the repeats of the pattern, each
    layer rematerialised ("full": the backward keeps the layer's two inputs, prompts and completions, and
    recomputes the prefill, the repeated caches and the continuation). Same loss, metrics and gradients as the
    padded step under the same settings; the compiled step holds one scan and the checkpoints."""
    cfg = qwen35.tiny(num_hidden_layers=4, layer_types=("linear_attention", "full_attention") * 2, gdn_chunk_size=8)
    model = qwen35.Qwen35(cfg, rngs=nnx.Rngs(11))
    lora.apply_lora(model, "all-linear", rank=4, alpha=8.0, seed=11)
    rng = np.random.default_rng(11)
    for _, adapter in lora.iter_lora(model):
        adapter.lora_B[...] = jnp.asarray(0.05 * rng.standard_normal(adapter.lora_B.shape), jnp.float32)
    model.set_compute(remat="full", scan_layers=True)
    assert model.layer_cycle("full") == (2, "")
    batch = _grpo_batch(model, np.random.default_rng(12))
    objective = GRPOObjective(max_new_tokens=C, aggregation="token_mean", beta=0.05, temperature=1.0,
                              epsilon_low=0.2, epsilon_high=0.2, entropy=False, chunk_size=64)
    _same_step(objective, model, batch)
    shared = _shared(batch, MB, 2)
    ids, mask = (jnp.asarray(shared[k][:MB]) for k in ("input_ids", "attention_mask"))
    graphdef, params, rest = nnx.split(model, lora.LoRAParam, ...)

    def total(params):
        hidden = shared_prefix_hidden(nnx.merge(graphdef, params, rest), ids, mask, group=2, start=P - 1)
        return jnp.sum(hidden ** 2)

    from jaxrl.models.qwen35 import model as model_module
    cycles = []
    real_run = model_module._run_layers

    def run_layers(layers, carry, make_step, cycle):
        cycles.append(cycle)
        return real_run(layers, carry, make_step, cycle)

    monkeypatch.setattr(model_module, "_run_layers", run_layers)
    text = str(jax.make_jaxpr(jax.grad(total))(params))
    assert cycles == [2] and "remat2[" in text  # one scan over the 2 repeats of the block, layers checkpointed


def test_minibatches_keep_whole_groups_under_a_sharing_layout():
    """Several minibatches per rollout: under a layout that may share prompts, the schedule permutes whole groups
    (each kept in order), so every micro-batch still finds its groups; a uniform split all the same (every row
    once per pass, seeded). Row by row otherwise, as before."""
    from jaxrl.algorithms.online.buffer import Schedule
    from jaxrl.algorithms.online.layout import keeps_groups
    assert keeps_groups("shared_prefix", 8) and keeps_groups("auto", 256)
    assert not keeps_groups("auto", 255) and not keeps_groups("padded", 4096) and not keeps_groups("packed", 4096)
    grouped = Schedule(rows=32, global_batch=8, iterations=2, seed=3, group=4)
    rows = Schedule(rows=32, global_batch=8, iterations=2, seed=3)
    assert grouped.whole_groups and not rows.whole_groups
    for it in range(2):
        served = [grouped.rows_of(0, it, u) for u in range(grouped.minibatches)]
        assert sorted(np.concatenate(served).tolist()) == list(range(32))
        for mb in served:  # whole groups, in order: aligned blocks of 4 consecutive rows of one prompt
            blocks = mb.reshape(-1, 4)
            assert np.all(blocks % 4 == np.arange(4)) and np.all(blocks // 4 == blocks[:, :1] // 4)
    assert not np.array_equal(grouped.rows_of(0, 0, 0), grouped.rows_of(0, 1, 0))  # a new permutation per pass
    assert np.array_equal(rows.rows_of(1, 0, 2), Schedule(32, 8, 2, 3).rows_of(1, 0, 2))  # row-wise: unchanged
    # a global batch that cannot hold whole groups: rows one by one
    assert not Schedule(rows=24, global_batch=6, iterations=1, seed=0, group=4).whole_groups
    # the rows of a grouped minibatch (prompt-major, 4 samples each) in micro-batches of 4: each one prompt
    rng = np.random.default_rng(0)
    rollout = _lengths_rows(rng, 8, 4, 256, 64, 8)
    mb = {k: v[grouped.rows_of(0, 0, 1)] for k, v in rollout.items()}
    plan = OnlineLayout("auto", width=64).plan(mb["attention_mask"], 4, mb["input_ids"])
    assert plan.shared == 4
    shuffled = {k: v[rows.rows_of(0, 0, 1)] for k, v in rollout.items()}
    assert OnlineLayout("auto", width=64).plan(shuffled["attention_mask"], 4, shuffled["input_ids"]).shared < 4
