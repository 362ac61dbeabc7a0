"""The rollout engine against transformers: greedy tokens, EOS stopping, and behaviour log-probabilities.

All prompts run in one left-padded batch (one prompt bucket of 256), with lengths on both sides of the GDN chunk
size (64) so prefill crosses chunk boundaries, and the decode loop continues from the prefill caches.
"""

import copy

import numpy as np
import pytest
import torch

import hf_tiny
import jax.numpy as jnp

from jaxrl.models import qwen35
from jaxrl.generation import generate

LENGTHS = (5, 63, 64, 65, 130, 200)
MAX_NEW = 16
BUCKETS = (256,)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 2-layer tiny container (one Gated DeltaNet layer, one attention layer: both caches, half the compile
    time of the 4-layer one)."""
    folder, hf = hf_tiny.build_container(str(tmp_path_factory.mktemp("hf_rollout")), seed=0, num_hidden_layers=2)
    model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    assert model.config.layer_types == ("linear_attention", "full_attention")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 250, size=n).tolist() for n in LENGTHS]
    return hf, model, prompts


def hf_greedy(hf, prompts, max_new, eos):
    """transformers greedy generate over one left-padded batch; rows cut after their first EOS."""
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id, config.pad_token_id = eos, 0
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, generation_config=config, max_new_tokens=max_new,
                          min_new_tokens=0, do_sample=False)
    rows = []
    for row in out[:, width:].tolist():
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def reference(setup):
    hf, _, prompts = setup
    return hf_greedy(hf, prompts, MAX_NEW, eos=None)


@pytest.mark.slow
def test_greedy_equals_transformers_generate(setup, reference):
    _, model, prompts = setup
    out = generate(model, prompts, max_new_tokens=MAX_NEW, eos_token_ids=(), prompt_buckets=BUCKETS)
    assert out.stats["rounds"] == 1  # every row decoded in one round, whatever its prompt length
    assert out.tokens == reference
    assert out.finish_reasons == ["length"] * len(prompts)
    assert out.truncated == [True] * len(prompts)
    assert all(len(lp) == MAX_NEW for lp in out.logprobs)


@pytest.mark.slow
def test_eos_stops_like_transformers(setup, reference):
    """EOS is a token greedy decoding really produces (row 0, step 6), so stopping is exercised, not assumed."""
    hf, model, prompts = setup
    row0 = reference[0]
    step = next(i for i in range(6, MAX_NEW) if row0[i] not in row0[:i])
    eos = row0[step]
    expected = hf_greedy(hf, prompts, MAX_NEW, eos=eos)
    out = generate(model, prompts, max_new_tokens=MAX_NEW, eos_token_ids=(eos,), prompt_buckets=BUCKETS)
    assert out.tokens == expected
    assert out.tokens[0] == row0[:step + 1] and out.finish_reasons[0] == "stop"
    for tokens, reason in zip(out.tokens, out.finish_reasons):
        assert reason == ("stop" if tokens[-1] == eos else "length")
        assert reason == "stop" or len(tokens) == MAX_NEW


@pytest.mark.slow
def test_sampled_logprobs_equal_teacher_forced_forward(setup, reference):
    """Log-probs returned for sampled tokens (tempered, top-k and top-p filtered sampling) are those of the raw
    model distribution: transformers' teacher-forced forward over prompt + completion, <= 1e-4 in fp32."""
    hf, model, prompts = setup
    eos = reference[0][3]
    out = generate(model, prompts, max_new_tokens=MAX_NEW, temperature=0.7, top_p=0.9, top_k=50, n=2, seed=5,
                   eos_token_ids=(eos,), prompt_buckets=BUCKETS)
    assert out.prompt_indices == [j for j in range(len(prompts)) for _ in range(2)]
    worst = 0.0
    for i, (tokens, logprobs) in enumerate(zip(out.tokens, out.logprobs)):
        prompt = prompts[out.prompt_indices[i]]
        full = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = hf(input_ids=full).logits[0].double()
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        assert len(logprobs) == len(tokens)
        worst = max(worst, float(np.max(np.abs(np.asarray(logprobs, np.float64) - ref.numpy()))))
        assert out.finish_reasons[i] == ("stop" if tokens[-1] == eos else "length")
    assert worst <= 1e-4, worst
