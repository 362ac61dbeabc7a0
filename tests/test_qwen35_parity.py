"""The JAX Qwen3.5 computes what transformers computes: logits, padding, bf16, gradients."""

import numpy as np
import pytest
import torch

import hf_tiny
from conftest import jitted_forward
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import qwen35

LENGTHS = [1, 37, 64, 150, 300]


def max_rel(ours, ref):
    """max |ours - ref| / max |ref| over the compared entries."""
    return float(np.max(np.abs(np.asarray(ours, np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def container(hf_container):
    folder, hf = hf_container
    return folder, hf, qwen35.from_pretrained(folder, dtype=jnp.float32)


@pytest.fixture(scope="module")
def text(hf_text):
    folder, hf = hf_text
    return folder, hf, qwen35.from_pretrained(folder, dtype=jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_fp32_logits_match_container(container, seq_len):
    _, hf, model = container
    ids = np.random.default_rng(seq_len).integers(2, 250, size=(2, seq_len))
    ref = hf_tiny.hf_logits(hf, ids)
    assert max_rel(jitted_forward(model)(jnp.asarray(ids)), ref) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", [37, 150])
def test_fp32_logits_match_text_only_with_3x_value_heads(text, seq_len):
    folder, hf, model = text
    assert model.config.linear_num_value_heads == 3 * model.config.linear_num_key_heads
    ids = np.random.default_rng(seq_len).integers(2, 250, size=(2, seq_len))
    assert max_rel(jitted_forward(model)(jnp.asarray(ids)), hf_tiny.hf_logits(hf, ids)) <= 1e-4


@pytest.mark.slow
def test_tied_container(tmp_path):
    folder, hf = hf_tiny.build_container(str(tmp_path / "tied"), seed=3, tie=True)
    model = qwen35.from_pretrained(folder)
    assert model.lm_head is None and model.config.tie_word_embeddings
    ids = np.random.default_rng(0).integers(2, 250, size=(1, 40))
    assert max_rel(jitted_forward(model)(jnp.asarray(ids)), hf_tiny.hf_logits(hf, ids)) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [(300, 150, 37, 1), (64, 63, 65, 2)])
def test_left_padding_equals_unpadded(container, lengths):
    """A left-padded batch gives each real token the logits of its unpadded run (and of transformers)."""
    _, hf, model = container
    rng = np.random.default_rng(sum(lengths))
    width = max(lengths)
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros((len(lengths), width), np.int64)
    rows = []
    for i, n in enumerate(lengths):
        row = rng.integers(2, 250, size=n)
        rows.append(row)
        ids[i, width - n:] = row
        mask[i, width - n:] = 1
    batched = np.asarray(jitted_forward(model)(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    ref_batched = hf_tiny.hf_logits(hf, ids, mask)
    for i, (n, row) in enumerate(zip(lengths, rows)):
        single = hf_tiny.hf_logits(hf, row[None])[0]
        assert max_rel(batched[i, width - n:], single) <= 1e-4
        assert max_rel(batched[i, width - n:], ref_batched[i, width - n:]) <= 1e-4


@pytest.mark.slow
def test_bf16_within_reference_bf16_error(hf_container):
    """bf16 JAX vs fp32 HF is no worse than HF's own bf16 vs fp32 (times a small factor)."""
    folder, hf = hf_container
    model = qwen35.from_pretrained(folder, dtype=jnp.bfloat16)
    ids = np.random.default_rng(7).integers(2, 250, size=(2, 150))
    ref32 = hf_tiny.hf_logits(hf, ids)
    import copy
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)  # never cast the shared fixture: bf16 rounding would stick
    ref16 = hf_tiny.hf_logits(hf16, ids)
    ours = np.asarray(jitted_forward(model)(jnp.asarray(ids)).astype(jnp.float32))
    reference_error = max_rel(ref16, ref32)
    our_error = max_rel(ours, ref32)
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    assert our_error <= 2.0 * reference_error, (our_error, reference_error)


@pytest.mark.slow
def test_gradients_match_torch_autograd(hf_container):
    """d(loss)/d(every weight) equals torch autograd on the tiny model (rel <= 1e-3 per tensor)."""
    folder, hf = hf_container
    model = qwen35.from_pretrained(folder)
    rng = np.random.default_rng(11)
    ids = rng.integers(2, 250, size=(2, 70))  # > one GDN chunk
    mask = np.ones_like(ids)
    mask[1, :9] = 0  # left padding in the second row
    weights = rng.normal(size=(2, 70, 256)).astype(np.float32)

    hf.zero_grad()
    logits = hf(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits
    loss_t = (logits * torch.as_tensor(weights) * torch.as_tensor(mask)[..., None]).sum() / 100.0
    loss_t.backward()
    torch_grads = {n: p.grad.numpy() for n, p in hf.named_parameters() if p.grad is not None}

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
        m = nnx.merge(graphdef, params, rest)
        out = m(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
        return jnp.sum(out * weights * mask[..., None]) / 100.0

    loss_j, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    assert abs(float(loss_j) - loss_t.item()) <= 1e-4 * abs(loss_t.item()) + 1e-5
    from jaxrl.models.qwen35.checkpoint import hf_key
    from jaxrl.utils.tree import dotted
    from jaxrl.models.qwen35.config import CONTAINER
    checked = 0
    for path, g in nnx.to_flat_state(grads):
        key = hf_key(dotted(path), CONTAINER)
        ref = torch_grads[key]
        ours = np.asarray(g[...])
        assert ours.shape == ref.shape, key
        scale = np.max(np.abs(ref))
        if scale == 0:
            assert np.max(np.abs(ours)) == 0, key
            continue
        assert np.max(np.abs(ours - ref)) / scale <= 1e-3, key
        checked += 1
    assert checked >= 50  # every text-tower weight (52) + lm_head, minus any with an all-zero gradient
