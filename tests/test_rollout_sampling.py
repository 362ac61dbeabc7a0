"""Sampler semantics on a tiny random model: seeds, independence of samples, finish reasons at the cap and at
EOS, compilation once per bucket, sampling filters, and input errors."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxrl.models import qwen35
from jaxrl.models.qwen35.config import tiny  # not qwen35.tiny: the tiny.py submodule shadows it once imported
from jaxrl.generation import TRACE_COUNTS, Sampler, sample_tokens, sampling_mode
from jaxrl.generation.sampling import row_keys, token_keys

MAX_NEW = 8


@pytest.fixture(scope="module")
def model():
    # 2 layers (Gated DeltaNet + attention): both cache kinds at half the compile time of the 4-layer tiny.
    return qwen35.init_model(tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention")),
                             seed=0)


def make_sampler(model, **kw):
    kw = {"max_new_tokens": MAX_NEW, "prompt_buckets": (32, 64), "batch_size": 8, **kw}
    return Sampler(model, **kw)


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 250, size=n).tolist() for n in lengths]


@pytest.mark.slow
def test_seeds_reproduce_and_differ(model):
    sampler = make_sampler(model)
    prompts = prompts_of([7, 20])
    a = sampler.sample(prompts, n=4, temperature=1.0, top_p=0.95, seed=3)
    b = sampler.sample(prompts, n=4, temperature=1.0, top_p=0.95, seed=3)
    c = sampler.sample(prompts, n=4, temperature=1.0, top_p=0.95, seed=4)
    assert a.tokens == b.tokens
    assert all(np.array_equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    differing = sum(x != y for x, y in zip(a.tokens, c.tokens))
    assert differing >= 6, differing  # 8 rows x 8 tokens from a near-flat 256-way distribution


@pytest.mark.slow
def test_n_samples_independent_and_batch_invariant(model):
    """The n samples of a prompt differ from each other, and a sample depends on (seed, prompt, index) only:
    moving its prompt to another place in the batch gives the same tokens."""
    sampler = make_sampler(model)
    a_prompt, b_prompt = prompts_of([9, 25], seed=1)
    first = sampler.sample([a_prompt, b_prompt], n=4, temperature=1.0, top_p=0.95, seed=11)
    assert first.prompt_indices == [0, 0, 0, 0, 1, 1, 1, 1]
    assert first.sample_indices == [0, 1, 2, 3, 0, 1, 2, 3]
    for j in range(2):
        samples = [tuple(t) for t, p in zip(first.tokens, first.prompt_indices) if p == j]
        assert len(set(samples)) == 4
        assert len({s[0] for s in samples}) >= 3  # first tokens too: not one draw repeated
    swapped = sampler.sample([b_prompt, a_prompt], n=4, temperature=1.0, top_p=0.95, seed=11, group_ids=[1, 0])
    assert swapped.tokens[:4] == first.tokens[4:] and swapped.tokens[4:] == first.tokens[:4]


def expected_with_stops(reference, stops):
    out = []
    for row in reference:
        cut = next((i for i, t in enumerate(row) if t in stops), None)
        out.append((row, "length") if cut is None else (row[:cut + 1], "stop"))
    return out


@pytest.mark.slow
def test_finish_reasons_at_cap_and_at_eos(model):
    """Greedy rows are cut at their first EOS / stop id (kept in the tokens, finish "stop"); a stop id that is the
    very last token allowed (at the cap) is still "stop"; rows without one are "length" with exactly the cap."""
    prompts = prompts_of([3, 12, 30, 31, 7, 8, 20, 25], seed=2)
    reference = make_sampler(model).sample(prompts).tokens
    assert all(len(r) == MAX_NEW for r in reference)
    # A stop id first produced exactly at the cap in one row, and an EOS produced at step 2 in another row.
    cases = [(a, b) for a, ra in enumerate(reference) for b, rb in enumerate(reference)
             if a != b and ra[-1] not in ra[:-1] and rb[2] not in rb[:2] and rb[2] not in ra
             and ra[-1] not in rb[:3]]
    assert cases, reference
    at_cap_row, early_row = cases[0]
    at_cap, early = reference[at_cap_row][-1], reference[early_row][2]
    out = make_sampler(model, eos_token_ids=(early,), stop_token_ids=(at_cap,)).sample(prompts)
    expected = expected_with_stops(reference, {early, at_cap})
    assert list(zip(out.tokens, out.finish_reasons)) == expected
    assert out.finish_reasons[at_cap_row] == "stop" and len(out.tokens[at_cap_row]) == MAX_NEW
    assert out.finish_reasons[early_row] == "stop" and len(out.tokens[early_row]) == 3
    assert out.truncated == [r == "length" for _, r in expected]
    assert [len(lp) for lp in out.logprobs] == [len(t) for t in out.tokens]


@pytest.mark.slow
def test_compiles_once_per_bucket(model):
    """New prompts, lengths within a bucket, seeds, temperatures, top-p, stop ids and batch sizes within a batch
    bucket reuse the compiled programs; a new prompt bucket compiles exactly its prefill, insert and round.
    (A prefill and an insert compile per static count of distinct prompts they hold: 4 for n = 4 or 2, 8 for
    n = 1.)"""
    sampler = make_sampler(model)
    sampler.sample(prompts_of([5, 6]), n=4, temperature=1.0, top_p=0.9, seed=0)  # warm (8 rows, bucket 32)
    sampler.sample(prompts_of([3, 4, 5, 6, 7, 8, 9], seed=3), n=1, temperature=1.0, top_p=0.9, seed=0)
    before = sum(TRACE_COUNTS.values())
    sampler.sample(prompts_of([31, 2], seed=5), n=4, temperature=0.5, top_p=0.7, seed=9)
    sampler.sample(prompts_of([1, 17, 30, 8, 9, 10, 11], seed=6), n=1, temperature=2.0, top_p=0.95, seed=1)
    make_sampler(model, eos_token_ids=(1, 2), stop_token_ids=(7,)).sample(
        prompts_of([4, 4, 4, 4], seed=7), n=2, temperature=1.0, top_p=0.5, seed=2)
    assert sum(TRACE_COUNTS.values()) == before
    sampler.sample(prompts_of([40, 50]), n=4, temperature=1.0, top_p=0.9, seed=0)  # prompt bucket 64
    new = sum(TRACE_COUNTS.values()) - before
    assert new == 3, new
    sampler.sample(prompts_of([33, 64], seed=8), n=4, temperature=0.3, top_p=0.8, seed=4)
    assert sum(TRACE_COUNTS.values()) - before == 3


def _draw(logits, temperature, top_p, top_k, draws, seed=0):
    mode = sampling_mode(temperature, top_p, top_k, logits.shape[-1])
    tiled = jnp.tile(jnp.asarray(logits)[None], (draws, 1))
    keys = token_keys(row_keys(jnp.full(draws, seed, jnp.uint32), jnp.zeros(draws, jnp.uint32), jnp.arange(draws)), 0)
    fn = jax.jit(lambda x, k: sample_tokens(x, k, jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p), mode))
    tokens, logprobs = fn(tiled, keys)
    return np.asarray(tokens), np.asarray(logprobs)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.5, 1.0, 0), (1.0, 1.0, 5),
                                                     (1.0, 0.6, 0), (0.8, 0.9, 4)])
@pytest.mark.slow
def test_sample_tokens_distribution(temperature, top_p, top_k):
    """Draws follow softmax(logits / T) restricted to the top-k, then the top-p nucleus (total variation < 0.03
    over 20k draws), and the returned log-prob is the raw log_softmax of the token."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=40).astype(np.float32) * 1.5
    draws = 20000
    tokens, logprobs = _draw(logits, temperature, top_p, top_k, draws)
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x)
    allowed = np.zeros(40, bool)
    allowed[order[:top_k or 40]] = True
    probs = _softmax(np.where(allowed, x, -np.inf))
    if top_p < 1.0:
        sorted_p = probs[order]
        before = np.cumsum(sorted_p) - sorted_p
        keep = np.zeros(40, bool)
        keep[order[before < top_p]] = True
        probs = _softmax(np.where(keep & allowed, x, -np.inf))
    empirical = np.bincount(tokens, minlength=40) / draws
    assert set(np.flatnonzero(empirical)) <= set(np.flatnonzero(probs))
    assert 0.5 * np.abs(empirical - probs).sum() < 0.03
    raw = np.log(_softmax(logits.astype(np.float64)))
    np.testing.assert_allclose(logprobs, raw[tokens], atol=1e-5)


def test_greedy_is_argmax():
    logits = np.random.default_rng(1).normal(size=(6, 30)).astype(np.float32)
    keys = token_keys(row_keys(jnp.zeros(6, jnp.uint32), jnp.arange(6), jnp.zeros(6)), 0)
    tokens, logprobs = sample_tokens(jnp.asarray(logits), keys, jnp.float32(1), jnp.float32(1),
                                     sampling_mode(0.0, 1.0, 0, 30))
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
    raw = jax.nn.log_softmax(jnp.asarray(logits), -1)
    np.testing.assert_allclose(np.asarray(logprobs), np.asarray(raw)[np.arange(6), logits.argmax(-1)], atol=1e-6)


def test_input_errors(model):
    sampler = make_sampler(model, max_prompt_len=60)
    with pytest.raises(ValueError, match="prompt 1 has 61 tokens, over max_prompt_len=60"):
        sampler.sample([[3] * 5, [3] * 61])
    with pytest.raises(ValueError, match="outside"):
        sampler.sample([[3, 256]])
    with pytest.raises(ValueError, match="empty"):
        sampler.sample([[]])
    with pytest.raises(ValueError, match="temperature"):
        sampler.sample([[3]], temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        sampler.sample([[3]], temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="vocabulary"):
        make_sampler(model, eos_token_ids=(300,))
