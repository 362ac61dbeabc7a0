"""One scoring path (issue 47): every teacher-forced pass goes through jaxrl.models.teacher_forced.next_token_logprobs,
and each pass routed there gives, bit for bit, what its hand-rolled formula gave: the SFT objective, DPO's policy and
reference passes (padded and packed rows), the distillation student's support pass, the in-process teacher's top-k
support and a server's top-k scoring. The old formulas are written out here as they were (`old_*`), on a tiny fp32
model with LoRA adapters that move its outputs: each old and new pair lowers to the same program (StableHLO text),
and values and gradients are compared with assert_array_equal."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.algorithms import dpo_task
from jaxrl.algorithms.distill_task import DistillObjective
from jaxrl.backends.base import Scorer
from jaxrl.backends.jax_teacher import JaxTeacher, teacher_pass
from jaxrl.data import dpo_data, packing
from jaxrl.models import lora, qwen35
from jaxrl.models.lora import LoRAParam, adapters_disabled
from jaxrl.models.teacher_forced import Head, completion_start, next_token_logprobs
from jaxrl.ops.logprobs import support_logprobs, token_logprobs, topk_support
from jaxrl.parallel import batched_forward
from jaxrl.train.objective import NextToken, target_mask

QUICK = {"xla_backend_optimization_level": 0}
CHUNK = 16  # several chunks per pass, the last one padded
P, C = 6, 8


@pytest.fixture(scope="module")
def model():
    """Tiny Qwen3.5 (both layer kinds), fp32, LoRA on every projection with a random B (the adapters change the
    log-probs, so a pass with them off is told from one with them on)."""
    cfg = qwen35.tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), gdn_chunk_size=8)
    m = qwen35.Qwen35(cfg, rngs=nnx.Rngs(0))
    lora.apply_lora(m, "all-linear", rank=4, alpha=8.0, seed=0)
    rng = np.random.default_rng(0)
    for _, adapter in lora.iter_lora(m):
        adapter.lora_B[...] = jnp.asarray(0.05 * rng.standard_normal(adapter.lora_B.shape), jnp.float32)
    return m


def _same(a, b):
    """Two pytrees of arrays equal bit for bit (and not trivially: some leaf is non-zero)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(np.abs(np.asarray(x, np.float64)).max() > 0 for x in la)


def _rollout_rows(n, vocab, seed):
    """Rows in the rollout layout: prompts left-padded into P columns, completions right-padded into C."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((n, P + C), np.int32)
    attn = np.zeros((n, P + C), np.int32)
    cmask = np.zeros((n, C), np.float32)
    for i in range(n):
        p, c = int(rng.integers(2, P + 1)), int(rng.integers(1, C + 1))
        ids[i, P - p:P + c] = rng.integers(2, vocab, p + c)
        attn[i, P - p:P + c] = 1
        cmask[i, :c] = 1
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": cmask}


@partial(jax.jit, static_argnames=("fn", "graphdef"), compiler_options=QUICK)
def _value_and_grad(fn, graphdef, lora_state, rest, batch):
    """(fn(model, batch), its gradient in the LoRA parameters); fn returns (scalar, aux)."""
    return jax.value_and_grad(lambda s: fn(nnx.merge(graphdef, s, rest), batch), has_aux=True)(lora_state)


def _text(lowered) -> str:
    """The StableHLO of a lowered program, but for its module's name (the jitted function's)."""
    return re.sub(r"^module @\S+", "module", lowered.as_text())


def _compare(model, old, new, batch):
    """old and new (model, batch) -> (scalar, aux): one program (their lowered StableHLO texts, value and gradient,
    are the same) and the same numbers."""
    graphdef, lora_state, rest = nnx.split(model, LoRAParam, ...)
    program = lambda fn: _text(_value_and_grad.lower(fn, graphdef, lora_state, rest, batch))  # noqa: E731
    assert program(old) == program(new)
    _same(_value_and_grad(old, graphdef, lora_state, rest, batch), _value_and_grad(new, graphdef, lora_state, rest,
                                                                                   batch))


def test_completion_start_is_the_offset_the_passes_computed():
    ids = jnp.zeros((3, P + C), jnp.int32)
    assert completion_start(ids, C) == ids.shape[1] - C - 1 == P - 1


# ------------------------------------------------------------------------------------------------ SFT


def old_sft_loss(model, mb):
    """NextToken.loss as it was (jaxrl/train/objective.py before issue 47)."""
    normalisers = NextToken().normalisers(mb)
    ids = mb["input_ids"]
    hidden, _ = model.hidden_states(ids, mb.get("attention_mask"), segment_ids=mb.get("segment_ids"))
    logp = token_logprobs(hidden[:, :-1], model.head_weight(), ids[:, 1:], chunk_size=CHUNK)
    mask = target_mask(mb)
    weights = mask / normalisers["num_tokens"]
    loss = -jnp.sum(jnp.where(weights != 0, logp * weights, 0.0))
    return loss, {"nll": loss, "target_tokens": jnp.sum(mask != 0).astype(jnp.float32)}


def new_sft_loss(model, mb):
    objective = NextToken(chunk_size=CHUNK)
    return objective.loss(model, mb, objective.normalisers(mb), None)


@pytest.mark.heavy  # two value-and-gradient programs: ~30 s on two busy cores, the fast tier's budget (CI runs it)
@pytest.mark.parametrize("packed", [False, True])
def test_the_sft_objective_is_its_hand_rolled_formula_bit_for_bit(model, packed):
    rng = np.random.default_rng(1)
    ids = rng.integers(2, model.config.vocab_size, (4, 16)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, 11:], mask[1, :5] = 0, 0  # right- and left-padded rows
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": (rng.random(ids.shape) < 0.7) * mask}
    if packed:
        batch["segment_ids"] = np.repeat(np.array([[1] * 7 + [2] * 6 + [0] * 3]), 4, 0).astype(np.int32)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    _compare(model, old_sft_loss, new_sft_loss, batch)
    # the token log-probs themselves: the pass alone
    graphdef, state = nnx.split(model)

    def old(s):
        m = nnx.merge(graphdef, s)
        hidden, _ = m.hidden_states(batch["input_ids"], batch["attention_mask"], segment_ids=batch.get("segment_ids"))
        return token_logprobs(hidden[:, :-1], m.head_weight(), batch["input_ids"][:, 1:], chunk_size=CHUNK)

    def new(s):
        return next_token_logprobs(nnx.merge(graphdef, s), batch["input_ids"], batch["attention_mask"],
                                   segment_ids=batch.get("segment_ids"), chunk_size=CHUNK).logp

    _same(jax.jit(old, compiler_options=QUICK)(state), jax.jit(new, compiler_options=QUICK)(state))


# ------------------------------------------------------------------------------------------------ DPO


def old_pair_token_logps(model, batch):
    both = {k: jnp.concatenate([dpo_task._rows(batch, "chosen")[k], dpo_task._rows(batch, "rejected")[k]])
            for k in ("input_ids", "attention_mask", "loss_mask")}
    ids = both["input_ids"]
    hidden, _ = model.hidden_states(ids, both["attention_mask"])
    logp = token_logprobs(hidden[:, :-1], model.head_weight(), ids[:, 1:], chunk_size=CHUNK)
    return logp, target_mask(both)


def old_packed_sequence_sums(model, batch):
    ids, seg = batch["input_ids"], batch["segment_ids"]
    pairs = ids.shape[0]
    hidden, _ = model.hidden_states(ids, batch["attention_mask"], segment_ids=seg)
    logp = token_logprobs(hidden[:, :-1], model.head_weight(), ids[:, 1:], chunk_size=CHUNK)
    keep = target_mask(batch) > 0
    index = batch["sequence_index"][:, 1:].reshape(-1)
    sums = jax.ops.segment_sum(jnp.where(keep, logp, 0.0).reshape(-1), index, num_segments=2 * pairs)
    counts = jax.ops.segment_sum(keep.astype(jnp.float32).reshape(-1), index, num_segments=2 * pairs)
    return sums[0::2], counts[0::2], sums[1::2], counts[1::2]


def old_pair_sequence_logps(model, batch):
    if dpo_task.is_packed(batch):
        c, _, r, _ = old_packed_sequence_sums(model, batch)
        return c, r
    logp, mask = old_pair_token_logps(model, batch)
    sums, _ = dpo_task.dpo_lib.sequence_logps(logp, mask)
    b = sums.shape[0] // 2
    return sums[:b], sums[b:]


def old_dpo_passes(model, batch):
    """The policy pass, then the reference pass as DPOObjective ran it (adapters_disabled around the policy's
    function); the loss: a scalar with every policy log-prob in its gradient."""
    policy = old_pair_sequence_logps(model, batch)
    with adapters_disabled(model):
        reference = old_pair_sequence_logps(model, batch)
    tokens = None if dpo_task.is_packed(batch) else old_pair_token_logps(model, batch)
    return jnp.sum(policy[0]) - 0.5 * jnp.sum(policy[1]), (policy, reference, tokens)


def new_dpo_passes(model, batch):
    policy = dpo_task.pair_sequence_logps(model, batch, CHUNK)
    reference = dpo_task.pair_sequence_logps(model, batch, CHUNK, adapters=False)
    tokens = None if dpo_task.is_packed(batch) else dpo_task.pair_token_logps(model, batch, CHUNK)
    return jnp.sum(policy[0]) - 0.5 * jnp.sum(policy[1]), (policy, reference, tokens)


@pytest.mark.slow  # two value-and-gradient programs of three passes each: ~30 s on two busy cores
@pytest.mark.heavy  # kept out of the fast tier's 10 minutes (CI runs it)
@pytest.mark.parametrize("packed", [False, True])
def test_dpos_policy_and_reference_passes_are_their_hand_rolled_formulas_bit_for_bit(model, packed):
    rng = np.random.default_rng(4)
    tok = lambda k: rng.integers(2, model.config.vocab_size, size=int(k)).tolist()  # noqa: E731
    pairs = [{"pair_id": str(i), "prompt_ids": tok(rng.integers(2, 10)), "chosen_ids": tok(rng.integers(1, 10)),
              "rejected_ids": tok(rng.integers(1, 10))} for i in range(4)]
    seqs = dpo_data.build_sequences(dpo_data.pretokenized_pairs(pairs),
                                    dpo_data.SequenceConfig(max_length=24, pad_multiple=8, min_prompt_tokens=1))
    index = np.arange(4)
    if packed:
        width = seqs.arrays["chosen_input_ids"].shape[1]
        batch = dpo_task.pack_pairs(seqs.arrays, index, 4, packing.row_lengths(2 * width, 8), pad_id=0)
    else:
        batch = {k: v[index] for k, v in seqs.arrays.items()}
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    _compare(model, old_dpo_passes, new_dpo_passes, batch)
    # the reference is the adapters-off pass: not the policy's
    _, (policy, reference, _) = new_dpo_passes(model, batch)
    assert np.abs(np.asarray(policy[0]) - np.asarray(reference[0])).max() > 1e-4


# ------------------------------------------------------------------------------------------------ distillation


def _distill_batch(model, seed=2, k=5):
    arrays = _rollout_rows(4, model.config.vocab_size, seed)
    rng = np.random.default_rng(seed)
    top_ids = np.stack([rng.permutation(model.config.vocab_size)[:k] for _ in range(4 * C)]).reshape(4, C, k)
    return {**{name: jnp.asarray(v) for name, v in arrays.items()},
            "teacher_top_ids": jnp.asarray(top_ids, jnp.int32)}


def old_student(model, mb, temperature):
    """DistillObjective.loss's student pass as it was (distill_task.py before issue 47)."""
    mask, ids = mb["completion_mask"], mb["input_ids"]
    start = ids.shape[1] - mask.shape[1] - 1
    hidden, _ = model.hidden_states(ids, mb["attention_mask"])
    return support_logprobs(hidden[:, start:-1], model.head_weight(), ids[:, start + 1:], mb["teacher_top_ids"],
                            chunk_size=CHUNK, temperature=temperature)


def new_student(model, mb, temperature):
    ids = mb["input_ids"]
    out = next_token_logprobs(model, ids, mb["attention_mask"], start=completion_start(ids, mb["completion_mask"]
                                                                                        .shape[1]),
                              temperature=temperature, chunk_size=CHUNK, head=Head.support(mb["teacher_top_ids"]))
    return out.logp, out.support_logp, out.rest_logp, out.argmax


def _student_loss(pass_fn, temperature):
    def loss(model, mb):
        logp, on, rest, argmax = pass_fn(model, mb, temperature)
        w = mb["completion_mask"]
        return jnp.sum(logp * w) + 0.3 * jnp.sum(on * w[..., None]) - 0.7 * jnp.sum(rest * w), (logp, on, rest, argmax)
    return loss


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_distill_students_support_pass_is_its_hand_rolled_formula_bit_for_bit(model, temperature):
    mb = _distill_batch(model)
    _compare(model, _student_loss(old_student, temperature), _student_loss(new_student, temperature), mb)


def old_distill_loss(objective):
    """DistillObjective.loss as it was (distill_task.py before issue 47), its student pass hand-rolled."""
    from jaxrl.algorithms import distill_loss as dl
    from jaxrl.algorithms import grpo as grpo_lib

    def loss_fn(model, mb):
        normalisers = objective.normalisers(mb)
        mask = mb["completion_mask"]
        logp, s_top, s_rest, s_argmax = old_student(model, mb, objective.temperature)
        sg = jax.lax.stop_gradient
        t_top, t_rest, t_logp = mb["teacher_top_logp"], mb["teacher_rest_logp"], mb["teacher_logp"]
        ratio = jnp.exp(logp - sg(logp))
        advantage = jnp.zeros_like(logp)
        per_token = {}
        if objective.loss_name == "reverse_kl":
            advantage = sg(dl.reverse_kl_advantages(logp, t_logp, mask))
            loss_tok = jnp.zeros_like(logp)
        else:
            loss_tok = dl.topk_divergence(objective.loss_name, s_top, s_rest, t_top, t_rest, objective.jsd_beta)
            per_token["distill/loss"] = sg(loss_tok)
        loss_tok = loss_tok - advantage * ratio
        weights = grpo_lib.token_weights(mask, "token_mean", normalisers)
        loss = grpo_lib.aggregate_loss(loss_tok, weights)
        reverse_kl = sg(dl.jsd_topk(s_top, s_rest, t_top, t_rest, 1.0))
        per_token.update({
            "distill/reverse_kl": reverse_kl,
            "distill/log_ratio": sg(logp) - jnp.maximum(t_logp, dl.LOG_FLOOR),
            "distill/student_logp": sg(logp),
            "distill/teacher_logp": jnp.maximum(t_logp, dl.LOG_FLOOR),
            "distill/top1_agreement": (s_argmax == mb["teacher_top_ids"][..., 0]).astype(jnp.float32),
        })
        metrics = grpo_lib.token_metric_contributions(per_token, mask, normalisers)
        metrics["distill/reverse_kl_max"] = jnp.max(jnp.where(mask > 0, reverse_kl, 0.0))
        return loss, metrics
    return loss_fn


@pytest.mark.parametrize("loss_name, temperature", [("jsd", 0.7), ("reverse_kl", 1.0)])
def test_the_distill_objective_is_its_hand_rolled_formula_bit_for_bit(model, loss_name, temperature):
    """DistillObjective.loss, its metrics and its gradient against the old objective's lines over the old pass."""
    mb = _distill_batch(model, seed=3)
    k = mb["teacher_top_ids"].shape[-1]
    rng = np.random.default_rng(3)
    t_top = np.sort(np.log(rng.dirichlet(np.ones(k + 1), (4, C))), -1)[..., ::-1].astype(np.float32)
    mb.update({"teacher_top_logp": jnp.asarray(t_top[..., :k]), "teacher_rest_logp": jnp.asarray(t_top[..., k]),
               "teacher_logp": jnp.asarray(t_top[..., 0]) - 0.1})
    objective = DistillObjective(loss_name=loss_name, temperature=temperature, chunk_size=CHUNK)
    new = lambda m, b: objective.loss(m, b, objective.normalisers(b), None)  # noqa: E731
    _compare(model, old_distill_loss(objective), new, mb)


def old_teacher_pass(graphdef, state, input_ids, attention_mask, *, max_new_tokens, k, temperature, chunk_size):
    """jaxrl/algorithms/online/teacher.py `_teacher_pass` as it was."""
    model = nnx.merge(graphdef, state)
    start = input_ids.shape[1] - max_new_tokens - 1
    hidden, _ = model.hidden_states(input_ids, attention_mask)
    logp, top_logp, top_ids, rest = topk_support(hidden[:, start:-1], model.head_weight(), input_ids[:, start + 1:],
                                                 k, chunk_size=chunk_size, temperature=temperature)
    return {"logp": logp, "top_logp": top_logp, "top_ids": top_ids, "rest_logp": rest}


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_the_in_process_teachers_scores_are_its_hand_rolled_formula_bit_for_bit(model, temperature):
    """JaxTeacher.score (a Scorer) against the old `_teacher_pass` through the same batched program: 7 rows, 3 a
    call (the last call padded), every array equal."""
    arrays = _rollout_rows(7, model.config.vocab_size, seed=5)
    arrays["completion_mask"][2, 3:] = 0  # a hole
    teacher = JaxTeacher(model, compile_options=QUICK)
    assert isinstance(teacher, Scorer) and teacher.name == "jax"
    new = teacher.score(arrays, k=6, temperature=temperature, batch_size=3, chunk_size=CHUNK)
    program = batched_forward.jit_program(old_teacher_pass, ("graphdef", "max_new_tokens", "k", "temperature",
                                                             "chunk_size"), QUICK)
    graphdef, state = nnx.split(model)
    out = batched_forward.map_batches(
        lambda b: program(graphdef, state, b["input_ids"], b["attention_mask"], max_new_tokens=C, k=6,
                          temperature=temperature, chunk_size=CHUNK),
        arrays, ("input_ids", "attention_mask"), batch_size=3)
    mask = arrays["completion_mask"] > 0
    old = {name: np.where(mask if v.ndim == 2 else mask[..., None], v, 0.0) for name, v in out.items()}
    old["top_ids"] = old["top_ids"].astype(np.int32)
    old = {name: v if name == "top_ids" else v.astype(np.float32) for name, v in old.items()}
    assert set(new) == set(old) == {"logp", "top_logp", "top_ids", "rest_logp"}
    for name in old:
        assert new[name].dtype == old[name].dtype, name
        np.testing.assert_array_equal(new[name], old[name], err_msg=name)
    # the jitted pass itself, unpadded, before the masking: one program, the same numbers
    batch = {k: jnp.asarray(v) for k, v in arrays.items()}
    static = dict(max_new_tokens=C, k=6, temperature=temperature, chunk_size=CHUNK)
    old_fn, new_fn = (jax.jit(partial(fn, graphdef, **static), compiler_options=QUICK)
                      for fn in (old_teacher_pass, teacher_pass))
    args = (state, batch["input_ids"], batch["attention_mask"])
    assert _text(old_fn.lower(*args)) == _text(new_fn.lower(*args))
    _same(old_fn(*args), new_fn(*args))


# ------------------------------------------------------------------------------------------------ a server's top k


def test_a_servers_top_k_is_its_formula(model):
    """The server's scoring (jaxrl.serve.loop: Head.top_k(k)) is token_logprobs(top_k=k) as the pass computed it
    before; the teacher's form (rest=True) picks the same tokens."""
    ids = jnp.asarray(np.random.default_rng(6).integers(2, model.config.vocab_size, (3, 12)), jnp.int32)
    mask = jnp.ones_like(ids)

    def old(m):
        hidden, _ = m.hidden_states(ids, mask)
        return token_logprobs(hidden[:, :-1], m.head_weight(), ids[:, 1:], chunk_size=CHUNK, top_k=5)

    def new(m, **head):
        out = next_token_logprobs(m, ids, mask, chunk_size=CHUNK, **head)
        return out.logp, out.top_logp, out.top_ids, out.rank

    graphdef, state = nnx.split(model)
    jitted = lambda fn: jax.jit(lambda s: fn(nnx.merge(graphdef, s)), compiler_options=QUICK)  # noqa: E731
    run = lambda fn: jitted(fn)(state)  # noqa: E731
    reference = run(old)
    routed = partial(new, head=Head.top_k(5))
    assert _text(jitted(routed).lower(state)) == _text(jitted(old).lower(state))
    _same(reference, run(routed))
    rest = run(lambda m: next_token_logprobs(m, ids, mask, chunk_size=CHUNK, head=Head.top_k(5, rest=True)))
    np.testing.assert_array_equal(np.asarray(rest.top_ids), np.asarray(reference[2]))
    np.testing.assert_allclose(np.asarray(rest.top_logp), np.asarray(reference[1]), atol=1e-5)
    assert rest.rank is None and reference[3] is not None


def test_the_heads_refuse_what_they_cannot_give(model):
    ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="entropy"):
        next_token_logprobs(model, ids, None, entropy=True, head=Head.top_k(2))
    with pytest.raises(ValueError, match="k >= 1"):
        Head.top_k(0)
