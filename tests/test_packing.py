"""Packed sequences (issue 31): several sequences in one row compute exactly what each computes alone in its own
padded row -- the ops (conv, chunked Gated DeltaNet, attention), the model's per-token log-probs and LoRA
gradients, the DPO objective and the SFT objective -- and the packer keeps its fixed set of row lengths."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.algorithms.dpo_task import DPOObjective, pack_pairs
from jaxrl.data import packing
from jaxrl.models import lora, qwen35
from jaxrl.models.lora import LoRAParam
from jaxrl.ops.attention import causal_attention
from jaxrl.ops.conv import causal_depthwise_conv
from jaxrl.ops.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from jaxrl.ops.logprobs import token_logprobs
from jaxrl.train.objective import NextToken

QUICK = {"xla_backend_optimization_level": 0}
TOL = 1e-5  # fp32: packed and padded differ only in the order of float sums


def _segments(lengths, total):
    """[1, total] ids 1, 1, 2, 2, 2, ... per length, 0 on the rest."""
    seg = np.zeros((1, total), np.int32)
    pos = 0
    for i, n in enumerate(lengths, 1):
        seg[0, pos:pos + n] = i
        pos += n
    return jnp.asarray(seg)


def _spans(lengths):
    starts = np.cumsum([0, *lengths[:-1]])
    return [slice(int(s), int(s) + n) for s, n in zip(starts, lengths)]


# ------------------------------------------------------------------------------------------------ ops


def _unpack(x, lengths, width):
    """[1, total, ...] packed -> [len(lengths), width, ...], each sequence alone in a zero-padded row."""
    rows = [jnp.pad(x[0, span], ((0, width - (span.stop - span.start)),) + ((0, 0),) * (x.ndim - 2))
            for span in _spans(lengths)]
    return jnp.stack(rows)


@pytest.mark.parametrize("chunk", [4, 64])
def test_chunked_gated_delta_rule_resets_the_state_at_every_sequence_start(chunk):
    """Sequences starting mid-chunk, spanning chunks, one token long: each equals the token-by-token recurrence
    run on it alone (state from zero), and the final state is the last sequence's. The references run as one
    batch of zero-padded rows (g = 0, beta = 0 after a sequence leave its state as it is)."""
    rng = np.random.default_rng(0)
    lengths = [5, 11, 3, 9, 1, 7, 4]
    total, width = sum(lengths), max(lengths)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, v = r(1, total, 2, 8), r(1, total, 2, 8), r(1, total, 4, 6)
    g = -3.0 * jnp.exp(r(1, total, 4))  # strong decays: the per-sequence sums must not lose precision
    beta = jax.nn.sigmoid(r(1, total, 4))
    o, final = jax.jit(chunk_gated_delta_rule, static_argnames="chunk_size")(
        q, k, v, g, beta, chunk_size=chunk, segment_ids=_segments(lengths, total))
    alone, finals = jax.jit(recurrent_gated_delta_rule)(*(_unpack(x, lengths, width) for x in (q, k, v, g, beta)))
    for i, span in enumerate(_spans(lengths)):
        np.testing.assert_allclose(o[0, span], alone[i, :span.stop - span.start], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(final[0], finals[-1], atol=TOL, rtol=TOL)


def test_conv_window_never_crosses_a_sequence_start():
    rng = np.random.default_rng(1)
    lengths = [2, 6, 1, 5]
    x = jnp.asarray(rng.standard_normal((1, sum(lengths), 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)
    y, _ = causal_depthwise_conv(x, w, segment_ids=_segments(lengths, sum(lengths)))
    alone, _ = causal_depthwise_conv(_unpack(x, lengths, 6), w)
    for i, span in enumerate(_spans(lengths)):
        np.testing.assert_array_equal(y[0, span], alone[i, :span.stop - span.start])


def test_attention_stays_inside_each_sequence():
    rng = np.random.default_rng(2)
    lengths = [3, 7, 2]
    total = sum(lengths) + 4  # trailing padding, as packed rows have
    q = jnp.asarray(rng.standard_normal((1, total, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, total, 2, 8)), jnp.float32) for _ in range(2))
    attend = jax.jit(causal_attention, static_argnums=(4, 5, 6))
    o = attend(q, k, v, jnp.asarray([sum(lengths)]), 0.3, "xla", 4, _segments(lengths, total))
    alone = attend(*(_unpack(x, lengths, 7) for x in (q, k, v)), jnp.asarray(lengths), 0.3, "xla", None)
    for i, span in enumerate(_spans(lengths)):
        np.testing.assert_allclose(o[0, span], alone[i, :span.stop - span.start], atol=TOL, rtol=TOL)


# ------------------------------------------------------------------------------------------------ the packer


def test_row_lengths_are_a_fixed_ladder_and_first_fit_places_every_sequence():
    assert packing.row_lengths(2048, 64) == (512, 768, 1024, 1280, 1536, 2048)
    assert packing.row_lengths(100, 64) == (64, 100)
    lengths = [30, 5, 22, 17, 9, 40, 3]
    placed = packing.first_fit(lengths, 3, 45)
    assert sorted(i for row in placed for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 45 for row in placed)
    assert packing.first_fit(lengths, 2, 45) is None
    row_len, rows = packing.plan([lengths, [44, 44, 44]], 3, (32, 45, 64))
    assert row_len == 45 and len(rows) == 2


# ------------------------------------------------------------------------------------------------ the model


def _model(seed=0, chunk=8):
    """Tiny Qwen3.5 with both layer kinds (Gated DeltaNet, attention), fp32, GDN chunks of `chunk` tokens so
    sequences start mid-chunk and span chunks, LoRA on every projection with a random B (a fresh adapter's B is
    zero, and so would be every gradient but B's)."""
    cfg = qwen35.tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), gdn_chunk_size=chunk)
    model = qwen35.Qwen35(cfg, rngs=nnx.Rngs(seed))
    lora.apply_lora(model, "all-linear", rank=4, alpha=8.0, seed=seed)
    rng = np.random.default_rng(seed)
    for _, adapter in lora.iter_lora(model):
        adapter.lora_B[...] = jnp.asarray(0.05 * rng.standard_normal(adapter.lora_B.shape), jnp.float32)
    return model


def _sequences(rng, n, vocab, low=2, high=23):
    return [rng.integers(2, vocab, size=int(rng.integers(low, high))).astype(np.int32) for _ in range(n)]


def _padded(seqs, width):
    ids = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return ids, mask


def _logps_program(graphdef):
    @partial(jax.jit, compiler_options=QUICK)
    def run(lora_state, rest, ids, mask, segments, weights):
        def total(lora_state):
            model = nnx.merge(graphdef, lora_state, rest)
            hidden, _ = model.hidden_states(ids, mask, segment_ids=segments)
            logp = token_logprobs(hidden[:, :-1], model.head_weight(), ids[:, 1:], chunk_size=64)
            keep = mask[:, 1:] * mask[:, :-1]
            if segments is not None:
                keep = keep * (segments[:, 1:] == segments[:, :-1])
            logp = jnp.where(keep > 0, logp, 0.0)
            return jnp.sum(logp * weights), logp
        return jax.value_and_grad(total, has_aux=True)(lora_state)
    return run


def test_packed_rows_give_each_sequence_its_padded_logprobs_and_lora_gradients():
    """Nine sequences of 2-22 tokens in three packed rows vs nine padded rows: every target token's log-prob,
    and the LoRA gradients of a weighted sum of them, agree within 1e-5 (fp32)."""
    model = _model()
    graphdef, lora_state, rest = nnx.split(model, LoRAParam, ...)
    rng = np.random.default_rng(3)
    seqs = _sequences(rng, 9, model.config.vocab_size)
    pad_ids, pad_mask = _padded(seqs, 24)
    rows = packing.first_fit([len(s) for s in seqs], 3, 72)
    packed = packing.pack_rows([{"input_ids": s} for s in seqs], rows, 72)
    # the same random weight on each sequence's target tokens in both layouts
    token_w = [rng.standard_normal(len(s) - 1).astype(np.float32) for s in seqs]
    pad_w = np.zeros((len(seqs), 23), np.float32)
    for i, w in enumerate(token_w):
        pad_w[i, :len(w)] = w
    packed_w = np.zeros((3, 71), np.float32)
    where = {}  # sequence -> (row, first column)
    for r, members in enumerate(rows):
        pos = 0
        for i in members:
            where[i] = (r, pos)
            packed_w[r, pos:pos + len(token_w[i])] = token_w[i]
            pos += len(seqs[i])

    run = _logps_program(graphdef)
    (loss_p, logp_p), grads_p = run(lora_state, rest, packed["input_ids"], packed["attention_mask"],
                                    packed["segment_ids"], packed_w)
    (loss_u, logp_u), grads_u = run(lora_state, rest, pad_ids, pad_mask, None, pad_w)
    for i, s in enumerate(seqs):
        r, pos = where[i]
        np.testing.assert_allclose(logp_p[r, pos:pos + len(s) - 1], logp_u[i, :len(s) - 1], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(loss_p, loss_u, atol=TOL, rtol=TOL)
    flat_p, flat_u = jax.tree.leaves(grads_p), jax.tree.leaves(grads_u)
    assert len(flat_p) == len(flat_u) > 0
    for gp, gu in zip(flat_p, flat_u):
        np.testing.assert_allclose(gp, gu, atol=TOL, rtol=TOL)
    assert max(float(jnp.max(jnp.abs(g))) for g in flat_u) > 1e-3  # the comparison is not of zeros


def test_segment_ids_refused_with_a_cache():
    model = qwen35.Qwen35(qwen35.tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention")),
                          rngs=nnx.Rngs(0))
    ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="training passes"):
        model.hidden_states(ids, cache_length=8, segment_ids=jnp.ones((1, 4), jnp.int32))


# ------------------------------------------------------------------------------------------------ DPO and SFT


def _pairs(rng, n, vocab):
    """Pre-tokenised pairs with ragged prompts and completions (a spread like the pair builder's, scaled down)."""
    tok = lambda k: rng.integers(2, vocab, size=int(k)).tolist()  # noqa: E731
    return [{"pair_id": str(i), "prompt_ids": tok(rng.integers(2, 12)), "chosen_ids": tok(rng.integers(1, 14)),
             "rejected_ids": tok(rng.integers(1, 14))} for i in range(n)]


@partial(jax.jit, static_argnames=("objective", "graphdef"), compiler_options=QUICK)
def _dpo_loss_and_grads(objective, graphdef, lora_state, rest, batch):
    def loss(lora_state):
        return objective.loss(nnx.merge(graphdef, lora_state, rest), batch, objective.normalisers(batch),
                              jax.random.key(0))
    return jax.value_and_grad(loss, has_aux=True)(lora_state)


def test_dpo_loss_metrics_and_gradients_packed_equal_padded():
    """Six pairs of ragged lengths, padded ([12, T]) vs packed (six rows of one of the fixed lengths): the RPO
    loss (sigmoid + sft) with the reference from a second forward with the adapters off, every metric and the LoRA
    gradients agree within 1e-5, and the rows are fuller. (The precomputed reference: the heavy training test.)"""
    from jaxrl.data import dpo_data
    model = _model(seed=1)
    graphdef, lora_state, rest = nnx.split(model, LoRAParam, ...)
    rng = np.random.default_rng(4)
    seqs = dpo_data.build_sequences(dpo_data.pretokenized_pairs(_pairs(rng, 6, model.config.vocab_size)),
                                    dpo_data.SequenceConfig(max_length=32, pad_multiple=8, min_prompt_tokens=1))
    index = np.arange(6)
    padded = {k: v[index] for k, v in seqs.arrays.items()}
    width = seqs.arrays["chosen_input_ids"].shape[1]
    lengths = packing.row_lengths(2 * width, 8)
    packed = pack_pairs(seqs.arrays, index, 6, lengths, pad_id=0)
    assert packed["input_ids"].shape[0] == 6 and packed["input_ids"].shape[1] in lengths
    assert packing.fill_ratio(packed["attention_mask"]) > packing.fill_ratio(
        np.stack([padded["chosen_attention_mask"], padded["rejected_attention_mask"]]))

    objective = DPOObjective(loss_types=("sigmoid", "sft"), beta=0.1, reference="adapters_off", chunk_size=64)
    (loss_p, metrics_p), grads_p = _dpo_loss_and_grads(objective, graphdef, lora_state, rest, packed)
    (loss_u, metrics_u), grads_u = _dpo_loss_and_grads(objective, graphdef, lora_state, rest, padded)
    np.testing.assert_allclose(loss_p, loss_u, atol=TOL, rtol=TOL)
    assert set(metrics_p) == set(metrics_u)
    for name in metrics_u:
        np.testing.assert_allclose(metrics_p[name], metrics_u[name], atol=TOL, rtol=TOL, err_msg=name)
    for gp, gu in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_u)):
        np.testing.assert_allclose(gp, gu, atol=TOL, rtol=TOL)


def test_sft_loss_packed_equals_padded():
    """NextToken on eight left- and right-padded rows vs the same tokens packed: the same loss and token count."""
    from jaxrl.algorithms.sft_task import pack_token_rows
    model = _model(seed=2)
    rng = np.random.default_rng(5)
    seqs = _sequences(rng, 8, model.config.vocab_size, high=16)
    ids, mask = _padded(seqs, 16)
    ids[::2], mask[::2] = ids[::2, ::-1], mask[::2, ::-1]  # half the rows left-padded (reversed tokens: any ids do)
    loss_mask = (rng.random(ids.shape) < 0.7).astype(np.int32) * mask
    padded = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
    packed = pack_token_rows(padded, packing.row_lengths(16, 4), pad_id=0)
    assert packed["input_ids"].shape[0] == 8 and packed["input_ids"].shape[1] < 16
    objective = NextToken(chunk_size=64)
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda s, b: objective.loss(nnx.merge(graphdef, s), b, objective.normalisers(b), None),
                  compiler_options=QUICK)
    (loss_p, m_p), (loss_u, m_u) = run(state, packed), run(state, padded)
    np.testing.assert_allclose(loss_p, loss_u, atol=TOL, rtol=TOL)
    assert float(m_p["target_tokens"]) == float(m_u["target_tokens"])


@pytest.mark.heavy
def test_dpo_training_packed_equals_padded(tmp_path):
    """The tiny DPO run (2 micro-batches of 4 pairs a step) on ragged pairs, padded and packed: the same loss,
    gradient norm and preference metrics every step, and `fill_ratio` logged every step, higher when packed."""
    import json

    from conftest import tiny_config
    from jaxrl.algorithms.run import run_training
    rng = np.random.default_rng(6)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in _pairs(rng, 24, 256)))
    runs = {}
    for pack in (False, True):
        c = tiny_config("dpo", source="pairs", pairs=str(path), eval_fraction=0.0, pack=pack, max_length=32,
                        pad_multiple=8)
        c.steps, c.checkpoint_every = 3, 3
        runs[pack] = run_training(c, str(tmp_path / f"run_{pack}")).records
    for padded, packed in zip(runs[False], runs[True]):
        for key in ("loss", "grad_norm", "reward_margin", "chosen_logps", "rejected_logps", "chosen_length"):
            np.testing.assert_allclose(packed[key], padded[key], atol=TOL, rtol=TOL, err_msg=key)
        assert packed["fill_ratio"] > padded["fill_ratio"] > 0
        assert packed["tokens"] == padded["tokens"]


def test_sft_task_packs_each_step_and_logs_the_fill_ratio(tmp_path):
    """SFTTask with data.pack on JSON Lines rows: the step's rows come back packed (same tokens, shorter rows of
    the fixed set), with `fill_ratio` beside them; unpacked, the same rows padded and their fill ratio."""
    import json

    from configs import sft_tiny
    from jaxrl.algorithms.sft_task import SFTTask
    from jaxrl.algorithms.run import resolve_config as resolve
    rng = np.random.default_rng(7)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"input_ids": rng.integers(2, 256, int(n)).tolist()}) + "\n"
                            for n in rng.integers(3, 20, 16)))
    batches, tasks = {}, {}
    for pack in (False, True):
        c = sft_tiny.get_config()
        c.data.source, c.data.path, c.data.seq_len, c.data.pack = "jsonl", str(path), 64, pack
        tasks[pack] = SFTTask(resolve(c), vocab_size=256)
        batches[pack] = tasks[pack].batch(0)
    (padded, m_padded), (packed, m_packed) = batches[False], batches[True]
    assert tasks[True].pack_lengths == (16, 24, 32, 40, 48, 64)
    assert packed["input_ids"].shape[0] == padded["input_ids"].shape[0] == 4
    assert packed["input_ids"].shape[1] in tasks[True].pack_lengths[:-1]
    assert sorted(packed["input_ids"][packed["attention_mask"] == 1].tolist()) == sorted(
        padded["input_ids"][padded["attention_mask"] == 1].tolist())
    assert m_packed["fill_ratio"] > m_padded["fill_ratio"] == packing.fill_ratio(padded["attention_mask"])
