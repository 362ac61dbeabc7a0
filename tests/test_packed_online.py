"""Packed online passes (issue 51, jaxrl/algorithms/online/layout.py): the rows of a GRPO, PPO or distillation
step packed end to end give the padded layout's per-token log-probs and values, and a step's loss, metrics and
every LoRA (and value-head) gradient, within float32 rounding; multi-turn rows (observations inside the completion
columns) too. The counters say what each layout computes, and the rule keeps short rows (the tests', the demo's)
padded."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.algorithms.distill_task import DistillObjective
from jaxrl.algorithms.grpo_task import GRPOObjective
from jaxrl.algorithms.online.layout import OnlineLayout, is_packed
from jaxrl.algorithms.online.passes import teacher_forced
from jaxrl.algorithms.ppo_task import TRAINABLE, PPOObjective, attach_value_head
from jaxrl.models import lora, qwen35
from jaxrl.train.step import merge_micro, split_batch

QUICK = {"xla_backend_optimization_level": 0}
TOL = 1e-5  # fp32: the two layouts differ only in the order of float sums
P, C = 12, 10  # prompt columns (left-padded), completion columns (right-padded)
N, MB = 8, 4  # rows, rows per micro-batch (and per pass call): two groups


def _model(seed=0):
    """Tiny Qwen3.5 with both layer kinds, fp32, GDN chunks of 8 (sequences start mid-chunk), LoRA on every
    projection with a random B (a fresh adapter's B is zero, and so would be every gradient but B's), and a value
    head with random weights (PPO's; a fresh one is zero)."""
    cfg = qwen35.tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), gdn_chunk_size=8)
    model = qwen35.Qwen35(cfg, rngs=nnx.Rngs(seed))
    lora.apply_lora(model, "all-linear", rank=4, alpha=8.0, seed=seed)
    rng = np.random.default_rng(seed)
    for _, adapter in lora.iter_lora(model):
        adapter.lora_B[...] = jnp.asarray(0.05 * rng.standard_normal(adapter.lora_B.shape), jnp.float32)
    head = attach_value_head(model)
    head.weight[...] = jnp.asarray(rng.standard_normal(head.weight.shape), jnp.float32)
    return model


def _rows(rng, vocab, episodes=False):
    """Rollout-layout rows of varied lengths (a 1-token prompt, an empty completion, full ones); episodes: runs
    of observation tokens (completion mask 0) between sampled turns."""
    ids = np.zeros((N, P + C), np.int32)
    attn = np.zeros_like(ids)
    mask = np.zeros((N, C), np.float32)
    prompts = [1, P, 5, 3, 9, P, 2, 7]
    completions = [C, 4, 0, C, 1, 6, 8, 3]
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, P - p:P] = rng.integers(2, vocab, p)
        ids[i, P:P + c] = rng.integers(2, vocab, c)
        attn[i, P - p:P + c] = 1
        mask[i, :c] = 1.0
        if episodes and c > 4:
            mask[i, 2:4] = 0.0  # an observation between two turns
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": mask}


def _packed(batch, group=MB):
    out, _ = OnlineLayout("packed", width=C, multiple=4).apply(batch, group)
    assert is_packed(out) and out["input_ids"].size < N * (P + C)  # fewer tokens, several sequences a row
    assert (out["segment_ids"].max(1) > 1).any()
    return out


def test_packed_layout_puts_every_completion_token_where_its_index_says():
    """completion_index + 1 is the completion token itself, in both plain and episode rows; the counters."""
    rng = np.random.default_rng(0)
    for episodes in (False, True):
        batch = _rows(rng, 64, episodes)
        out = _packed(batch)
        flat = out["input_ids"].reshape(N // MB, -1)
        real = batch["attention_mask"][:, P:] > 0
        for i in range(N):
            got = flat[i // MB][out["completion_index"][i] + 1]
            np.testing.assert_array_equal(got[real[i]], batch["input_ids"][i, P:][real[i]])
        assert np.count_nonzero(out["attention_mask"]) == np.count_nonzero(batch["attention_mask"])


def test_counters_and_the_rule():
    """Padding tokens per step: packed < padded on a skewed batch; prompt tokens computed are the rows' prompts
    in both layouts; auto keeps short rows (one ladder length) padded and packs long skewed ones."""
    rng = np.random.default_rng(1)
    batch = _rows(rng, 64)
    _, padded = OnlineLayout("padded", width=C, multiple=4).apply(batch, MB)
    _, packed = OnlineLayout("packed", width=C, multiple=4).apply(batch, MB)
    real = np.count_nonzero(batch["attention_mask"])
    assert padded["layout/packed"] == 0 and packed["layout/packed"] == 1
    assert padded["layout/row_tokens"] == N * (P + C) == padded["layout/padding_tokens"] + real
    assert packed["layout/padding_tokens"] < padded["layout/padding_tokens"]
    assert packed["layout/prompt_tokens"] == padded["layout/prompt_tokens"] == batch["attention_mask"][:, :P].sum()
    # the tiny configs' rows (P = 6, C = 8) have a ladder of one length: auto never packs them
    tiny = {"attention_mask": np.ones((64, 14), np.int32), "input_ids": np.ones((64, 14), np.int32)}
    tiny["attention_mask"][:, :3] = 0
    out, m = OnlineLayout("auto", width=8).apply(tiny, 16)
    assert m["layout/packed"] == 0 and out is tiny
    # the users' long tail (rows of 2048 + 4096; half the completions at the cap, the rest short): auto packs
    # the short ones two to a row
    tail = np.zeros((8, 6144), np.int32)
    for i, c in enumerate([4096, 300, 4096, 500, 4096, 200, 4096, 800]):
        tail[i, 2048 - 1200:2048 + c] = 1
    plan = OnlineLayout("auto", width=4096).plan(tail, 8)
    assert plan.packed and plan.rows == 6 and plan.counters["row_tokens"] == 0.75 * tail.size


@pytest.mark.slow  # compiles the padded and the packed program
def test_packed_passes_give_the_padded_logprobs_and_values():
    """The rollout passes (reference with the adapters off, old with values) over packed rows, per call of MB
    rows: the padded numbers on every completion token."""
    model = _model()
    batch = _rows(np.random.default_rng(2), model.config.vocab_size)
    on = batch["completion_mask"] > 0
    for adapters, values in ((False, False), (True, True)):
        kw = dict(adapters=adapters, values=values, batch_size=MB, temperature=0.7, chunk_size=64,
                  compile_options=QUICK)
        want = teacher_forced(model, batch, **kw)
        got = teacher_forced(model, _packed(batch), **kw)
        for key in want:
            np.testing.assert_allclose(got[key][on], want[key][on], rtol=TOL, atol=TOL, err_msg=key)
            assert np.all(got[key][~on] == 0)


def ppo_targets(batch: dict, rng) -> dict:
    """A GRPO batch made PPO's: per-token advantages, old values and returns on the completion tokens instead of
    the reference log-probs and the sequence mask."""
    batch.pop("ref_logp"), batch.pop("sequence_mask")
    mask = batch["completion_mask"]
    shape = mask.shape
    batch.update(advantages=(rng.standard_normal(shape) * mask).astype(np.float32),
                 old_values=(rng.standard_normal(shape) * mask).astype(np.float32),
                 returns=(rng.standard_normal(shape) * mask).astype(np.float32))
    return batch


def teacher_support(batch: dict, rng, vocab: int, k: int = 4) -> dict:
    """A teacher's top-k support on every completion position (ids, sorted log-probs, the rest's log-mass) and its
    log-prob of the taken token: what a distillation step reads."""
    rows, width = batch["completion_mask"].shape
    top = rng.standard_normal((rows, width, k)).astype(np.float32)
    batch.update(teacher_top_ids=rng.integers(0, vocab, (rows, width, k)).astype(np.int32),
                 teacher_top_logp=np.sort(top - 3.0, -1)[..., ::-1].copy(),
                 teacher_rest_logp=np.full((rows, width), -0.2, np.float32),
                 teacher_logp=(-2.0 + 0.5 * rng.standard_normal((rows, width))).astype(np.float32))
    return batch


def _step(objective, model, batch, trainable=lora.LoRAParam):
    """(loss, metrics, gradients) of one step over MB-row micro-batches, summed as jaxrl.train.step does."""
    graphdef, params, rest = nnx.split(model, trainable, ...)
    split = split_batch(batch, len(batch["input_ids"]) // MB)

    @partial(jax.jit, compiler_options=QUICK)
    def run(params, split):
        def total(params):
            m = nnx.merge(graphdef, params, rest)
            norm = objective.normalisers(merge_micro(split))
            loss, metrics = 0.0, {}
            for k in range(split["input_ids"].shape[0]):
                micro = {key: v[k] for key, v in split.items()}
                part, mets = objective.loss(m, micro, norm, jax.random.key(k))
                loss = loss + part
                for name, v in mets.items():
                    metrics[name] = jnp.maximum(metrics.get(name, 0.0), v) if name.endswith("max") else (
                        metrics.get(name, 0.0) + v)
            return loss, metrics
        return jax.value_and_grad(total, has_aux=True)(params)

    (loss, metrics), grads = run(params, jax.tree.map(jnp.asarray, split))
    return float(loss), jax.device_get(metrics), jax.tree.leaves(jax.device_get(grads))


def _same_step(objective, model, batch, trainable=lora.LoRAParam):
    loss_u, met_u, g_u = _step(objective, model, batch, trainable)
    loss_p, met_p, g_p = _step(objective, model, _packed(batch), trainable)
    np.testing.assert_allclose(loss_p, loss_u, rtol=TOL, atol=1e-7)
    assert set(met_p) == set(met_u)
    for name in met_u:
        np.testing.assert_allclose(met_p[name], met_u[name], rtol=TOL, atol=1e-6, err_msg=name)
    assert len(g_p) == len(g_u) > 0
    scale = max(float(np.abs(g).max()) for g in g_u)
    assert scale > 1e-4  # the comparison is not of zeros
    for gp, gu in zip(g_p, g_u):  # relative to the largest entry: float32 sums in another order
        np.testing.assert_allclose(gp, gu, rtol=1e-4, atol=TOL * scale)
    return loss_u, met_u


def _grpo_batch(model, rng, episodes=False):
    batch = _rows(rng, model.config.vocab_size, episodes)
    kw = dict(batch_size=N, temperature=0.7, chunk_size=64, compile_options=QUICK)
    ref = teacher_forced(model, batch, adapters=False, **kw)["logp"]
    old = teacher_forced(model, batch, adapters=True, **kw)["logp"]
    mask = batch["completion_mask"]
    batch.update(advantages=rng.standard_normal(N).astype(np.float32),
                 sequence_mask=np.ones(N, np.float32), ref_logp=ref,
                 old_logp=(old + 0.3 * rng.standard_normal(old.shape) * mask).astype(np.float32))
    return batch


@pytest.mark.slow  # compiles the padded and the packed program
@pytest.mark.parametrize("episodes", [False, True], ids=["single_turn", "multi_turn"])
def test_grpo_step_packed_equals_padded(episodes):
    """GRPO (sequence_mean: per-sequence normalisers; KL to the reference; off-policy ratio with clipping): the
    loss, every metric and every LoRA gradient; multi-turn rows with observations inside the completion."""
    model = _model()
    batch = _grpo_batch(model, np.random.default_rng(3), episodes)
    objective = GRPOObjective(max_new_tokens=C, aggregation="sequence_mean", beta=0.1, temperature=0.7,
                              epsilon_low=0.2, epsilon_high=0.28, entropy=True, chunk_size=64)
    _, metrics = _same_step(objective, model, batch)
    assert metrics["clip_fraction/region"] > 0  # the step is not trivially on-policy


@pytest.mark.slow  # compiles the padded and the packed program
def test_ppo_step_packed_equals_padded():
    """PPO: policy and value loss from the same gathered hidden states; LoRA and value-head gradients."""
    model = _model()
    rng = np.random.default_rng(4)
    batch = ppo_targets(_grpo_batch(model, rng), rng)
    objective = PPOObjective(temperature=0.7, cliprange_value=0.2, chunk_size=64)
    _same_step(objective, model, batch, TRAINABLE)


@pytest.mark.slow  # compiles the padded and the packed program
@pytest.mark.parametrize("loss", ["jsd", "reverse_kl"])
def test_distill_step_packed_equals_padded(loss):
    """Distillation's student pass on the teacher's support (jsd) and reverse_kl: loss, metrics, gradients."""
    model = _model()
    rng = np.random.default_rng(5)
    batch = teacher_support(_rows(rng, model.config.vocab_size), rng, model.config.vocab_size)
    _same_step(DistillObjective(loss_name=loss, temperature=0.7, chunk_size=64), model, batch)
