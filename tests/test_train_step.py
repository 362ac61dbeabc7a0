"""The jitted train step: micro-batch / accumulation invariance, optimizer and schedules against torch and
transformers, chunked log-probs against the full softmax."""


import numpy as np
import pytest

import jax
import jax.numpy as jnp

from configs import sft_tiny
from jaxrl.models import lora, qwen35
from jaxrl.ops.logprobs import token_logprobs
from jaxrl.parallel.mesh import make_mesh
from jaxrl.parallel.sharding import nnx_state_shardings
from jaxrl.train.objective import NextToken
from jaxrl.train.optim import OptimizerConfig, make_optimizer, make_schedule
from jaxrl.algorithms.sft_task import synthetic_batch
from jaxrl.models.qwen35.init import init_model_jit
from jaxrl.train.state import ParamCodec, create_train_state
from jaxrl.train.step import jit_train_step, make_train_step, put_batch, split_batch


# Tests compare runs compiled alike, so a low LLVM optimisation level (a quicker compile) changes nothing.
QUICK = {"xla_backend_optimization_level": 0}


def tiny2():
    return qwen35.tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))


def make_parts(seed=0):
    # One Gated DeltaNet layer (the layer where padding could leak across positions), two adapters: a short
    # compile. The split invariance is a property of the summation, not of the model's size.
    model = init_model_jit(qwen35.tiny(num_hidden_layers=1, layer_types=("linear_attention",)), seed=0)
    lora.apply_lora(model, "in_proj_qkv,down_proj", rank=4, alpha=8, seed=seed)
    graphdef, trainable, frozen = lora.split_lora(model)
    codec = ParamCodec(trainable)
    return graphdef, codec, codec.to_flat(trainable), frozen


@pytest.mark.slow
def test_update_does_not_depend_on_the_micro_batch_split():
    """The same 8-row global batch (ragged left padding) as 1 x 8, 8 x 1 and 2 x 4 (micro_batch_size x
    grad_accum): equal loss, gradient norm and parameters after two AdamW steps, within fp32 rounding. A trainer
    that averaged micro-batch losses by count would be off by the factor grad_accum."""
    optimizer = OptimizerConfig(learning_rate=sft_tiny.get_config().optimizer.learning_rate, warmup_steps=0,
                                max_grad_norm=0.05)  # clipping active: it must act on the summed gradient
    graphdef, codec, params, frozen = make_parts()
    tx, schedule = make_optimizer(optimizer, total_steps=10)
    step_fn = make_train_step(NextToken(chunk_size=32), tx, schedule, graphdef, codec)
    mesh = make_mesh((1, 1, 1))
    frozen = jax.device_put(frozen, nnx_state_shardings(frozen, mesh))
    batches = [synthetic_batch(s, batch_size=8, seq_len=16, vocab_size=256, seed=3) for s in range(2)]
    assert batches[0]["attention_mask"].min() == 0  # padding present, so rows hold different token counts

    results = {}
    for mb, accum in [(8, 1), (1, 8), (4, 2)]:
        state = create_train_state(params, tx, seed=0, mesh=mesh)  # the layout the step returns: one compile
        jitted = None
        metrics = []
        for batch in batches:
            split = put_batch(split_batch(batch, accum), mesh)
            jitted = jitted or jit_train_step(step_fn, mesh, state, frozen, split, compiler_options=QUICK)
            state, m = jitted(state, frozen, split)
            metrics.append(jax.device_get(m))
        results[(mb, accum)] = (metrics, jax.device_get(state.params))

    ref_metrics, ref_params = results[(8, 1)]
    assert ref_metrics[0]["grad_norm"] > optimizer.max_grad_norm  # so clipping really acted
    for key, (metrics, params_after) in results.items():
        for m, r in zip(metrics, ref_metrics):
            np.testing.assert_allclose(m["loss"], r["loss"], rtol=2e-6, err_msg=str(key))
            np.testing.assert_allclose(m["grad_norm"], r["grad_norm"], rtol=2e-5, err_msg=str(key))
            np.testing.assert_allclose(m["target_tokens"], r["target_tokens"], err_msg=str(key))
        for name in ref_params:
            np.testing.assert_allclose(params_after[name], ref_params[name], rtol=0, atol=2e-6,
                                       err_msg=f"{key} {name}")
    moved = max(float(np.abs(ref_params[n] - params[n]).max()) for n in params)
    assert moved > 1e-4  # the updates were real


def test_chunked_logprobs_equal_full_softmax_with_gradients():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(3, 7, 16)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(50, 16)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, size=(3, 7)), jnp.int32)
    cot = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)

    def full(h, w):
        logits = jnp.einsum("bth,vh->btv", h, w) / 0.7
        logp = jax.nn.log_softmax(logits, -1)
        ent = -jnp.sum(jnp.exp(logp) * logp, -1)
        return jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], ent

    def chunked(h, w):
        return token_logprobs(h, w, targets, chunk_size=4, temperature=0.7, return_entropy=True)  # 21 rows: padded

    @jax.jit
    def both(h, w):
        outs = []
        for f in (full, chunked):
            (lp, ent), vjp = jax.vjp(f, h, w)
            outs.append((lp, ent) + vjp((cot, cot)))
        return outs

    (lp_f, ent_f, gh_f, gw_f), (lp_c, ent_c, gh_c, gw_c) = jax.device_get(both(hidden, weight))
    for a, b in [(lp_c, lp_f), (ent_c, ent_f), (gh_c, gh_f), (gw_c, gw_f)]:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# lr / learning_rate at optimizer steps 0..20 (20 steps, 3 warm-up), recorded from transformers 5.24
# `get_scheduler(name, SGD, num_warmup_steps=3, num_training_steps=20)` stepped after every update (its usual
# use). Golden values instead of a live call: importing transformers.optimization is slow.
HF_SCHEDULES = {
    "linear": [0.0, 0.3333333333, 0.6666666667, 1.0, 0.9411764706, 0.8823529412, 0.8235294118, 0.7647058824,
               0.7058823529, 0.6470588235, 0.5882352941, 0.5294117647, 0.4705882353, 0.4117647059, 0.3529411765,
               0.2941176471, 0.2352941176, 0.1764705882, 0.1176470588, 0.05882352941, 0.0],
    "cosine": [0.0, 0.3333333333, 0.6666666667, 1.0, 0.9914865498, 0.9662361147, 0.9251085679, 0.8695044586,
               0.8013173182, 0.7228691779, 0.636831495, 0.5461341797, 0.4538658203, 0.363168505, 0.2771308221,
               0.1986826818, 0.1304955414, 0.07489143214, 0.0337638853, 0.008513450158, 0.0],
    "constant_with_warmup": [0.0, 0.3333333333, 0.6666666667] + [1.0] * 18,
}


@pytest.mark.parametrize("name", sorted(HF_SCHEDULES))
def test_schedules_match_transformers(name):
    total, warmup, lr = 20, 3, 2e-5
    opt_cfg = OptimizerConfig(learning_rate=lr, schedule=name, warmup_steps=warmup)
    ours = np.asarray(make_schedule(opt_cfg, total)(jnp.arange(total + 1)))
    np.testing.assert_allclose(ours / lr, HF_SCHEDULES[name], rtol=1e-6, atol=1e-9)
    ratio = OptimizerConfig(learning_rate=lr, schedule=name, warmup_steps=0, warmup_ratio=0.1)
    assert np.asarray(make_schedule(ratio, total)(jnp.arange(4)))[1] == pytest.approx(lr / 2)  # ceil(2.0) = 2


def test_adamw_with_clipping_matches_torch():
    """Three steps of our optimizer (clip_by_global_norm + AdamW, weight decay) against torch's
    clip_grad_norm_ + torch.optim.AdamW on the same gradients."""
    import torch
    opt_cfg = OptimizerConfig(learning_rate=1e-2, schedule="constant", warmup_steps=0, weight_decay=0.1, b1=0.9,
                              b2=0.99, eps=1e-8, max_grad_norm=0.5)
    tx, _ = make_optimizer(opt_cfg, total_steps=10)
    rng = np.random.default_rng(0)
    params = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    grads = [{k: (rng.normal(size=v.shape) * s).astype(np.float32) for k, v in params.items()} for s in (1, 0.01, 3)]

    update = jax.jit(lambda g, st, p: tx.update(g, st, p))
    p = {k: jnp.asarray(v) for k, v in params.items()}
    st = tx.init(p)
    for g in grads:
        u, st = update({k: jnp.asarray(v) for k, v in g.items()}, st, p)
        p = jax.tree.map(lambda a, b: a + b, p, u)

    tp = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params.items()}
    topt = torch.optim.AdamW(list(tp.values()), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for g in grads:
        for k, v in tp.items():
            v.grad = torch.from_numpy(g[k].copy())
        torch.nn.utils.clip_grad_norm_(list(tp.values()), 0.5)
        topt.step()
    for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), tp[k].detach().numpy(), rtol=1e-5, atol=1e-6)


def test_sft_jsonl_rows_masks_and_epoch_order(tmp_path):
    from jaxrl.algorithms.sft_task import JsonlTokens
    path = tmp_path / "tokens.jsonl"
    path.write_text('{"input_ids": [5, 6, 7]}\n\n{"input_ids": [8, 9, 10, 11, 12], "loss_mask": [0, 0, 1, 1, 1]}\n'
                    '{"input_ids": [13]}\n')
    data = JsonlTokens(str(path), seq_len=4, seed=0)
    first_epoch = data.rows(0, 3)
    assert sorted(first_epoch["input_ids"][:, 0].tolist()) == [5, 8, 13]  # every row once per epoch
    row = first_epoch["input_ids"].tolist().index([8, 9, 10, 11])  # cut to seq_len
    assert first_epoch["loss_mask"][row].tolist() == [0, 0, 1, 1]
    row = first_epoch["input_ids"][:, 0].tolist().index(5)
    assert first_epoch["attention_mask"][row].tolist() == [1, 1, 1, 0]  # right padding is masked
    np.testing.assert_array_equal(data.rows(1, 2)["input_ids"], first_epoch["input_ids"][1:])  # by position
    assert data.rows_cut == 1
    lost = tmp_path / "lost.jsonl"  # a row whose targets are all cut away would train on nothing: an error
    lost.write_text('{"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 0, 0, 0, 1, 1]}\n')
    with pytest.raises(ValueError, match=r"lost.jsonl:1: every target token lies beyond data.seq_len=4"):
        JsonlTokens(str(lost), seq_len=4, seed=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1]}\n{"tokens": [2]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        JsonlTokens(str(bad), seq_len=4, seed=0)


def test_registry_resolves_sft_and_names_the_missing_algorithm():
    from jaxrl.algorithms import tasks
    assert tasks.get_task_factory("sft").__name__ == "build_sft"
    assert "sft" in tasks.algorithm_names()
    with pytest.raises(tasks.UnknownAlgorithm, match=r"algorithm='nope' is not a registered algorithm"):
        tasks.get_task_factory("nope")
    assert tasks.get_task_factory("jaxrl.algorithms.sft_task:build_sft") is tasks.get_task_factory("sft")
