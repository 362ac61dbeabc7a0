"""Live-row continuation (the engine's sessions, jaxrl/generation/engine.py): an episode's slot is held between
turns with its caches, and the next turn feeds only what was appended. Proven against the same turns started
fresh (the whole history prefilled), which is what a session saves: the same tokens for the same keys, the same
log-probabilities to rounding (fp32), while the held rows wait through other rows' decode rounds.
"""

import numpy as np
import pytest

from jaxrl.generation import Engine, Request
from jaxrl.models import qwen35
from jaxrl.models.qwen35.config import tiny

STOPS = tuple(range(100, 140))  # rows end after ~6 tokens on average, at different rounds
TURN = 24
BUDGET = 320


@pytest.fixture(scope="module")
def model():
    # both layer kinds: the held rows' attention caches and Gated DeltaNet states must survive other rows' rounds
    return qwen35.init_model(tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention")),
                             seed=0)


def request(prompt, g, session=None, seed=7):
    return Request(prompt, group_id=g, sample_index=0, seed=seed, max_new_tokens=TURN, temperature=1.0,
                   session=session, session_tokens=BUDGET if session is not None else None)


def test_continued_turns_equal_fresh_turns(model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 250, size=n).tolist() for n in (9, 23, 31)]
    # what an environment appends after each turn: shorter than a chunk, one wider chunk, several chunks
    appended = [[rng.integers(2, 250, size=n).tolist() for n in (5, 40, 150)] for _ in prompts]
    live = Engine(model, slots=4, prompt_buckets=(32,), generation_buckets=(BUDGET,), eos_token_ids=STOPS,
                  round_steps=4)
    fresh = Engine(model, slots=4, prompt_buckets=(32, 512), generation_buckets=(TURN,), eos_token_ids=STOPS,
                   round_steps=4)
    history = [list(p) for p in prompts]
    for turn in range(4):
        group = lambda i: 1000 * turn + i  # noqa: E731  each turn its own key, as episodes key them
        tickets = [live.submit(request(h, group(i), session=i)) for i, h in enumerate(history)]
        live.run()  # rows finishing early are held while the others decode
        reference = [fresh.submit(request(h, group(i))) for i, h in enumerate(history)]
        fresh.run()
        for i, (t, r) in enumerate(zip(tickets, reference)):
            got, want = t.wait(), r.wait()
            assert got.tokens == want.tokens, (turn, i)
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-5)
            history[i] += got.tokens
            if turn < 3:
                history[i] += appended[i][turn]
    first = sum(len(p) for p in prompts)
    fed = sum(len(a) + 1 for parts in appended for a in parts)  # each continuation also feeds the last token
    assert live.stats["prefilled_tokens"] == first and live.stats["continued"] == 9
    assert live.stats["extended_tokens"] == fed and live.stats["evicted"] == 0
    assert fresh.stats["prefilled_tokens"] > 3 * first + fed  # the history again each turn
    for i in range(3):
        live.end_session(i)
    assert live.idle and all(pool.empty for pool in live.pools.values())


def test_a_session_that_cannot_continue_starts_fresh(model):
    """A prompt that does not extend the held row's tokens, and a cap that would not fit the slot, start fresh
    (the held slot freed): the same answer as a fresh engine's, nothing continued."""
    prompt = list(range(3, 20))
    live = Engine(model, slots=2, prompt_buckets=(32, 256), generation_buckets=(BUDGET,), eos_token_ids=STOPS)
    first = live.submit(request(prompt, 1, session="a"))
    live.run()
    other = prompt[:-1] + [250] + first.wait().tokens + [5, 6]  # edits the history: not a continuation
    second = live.submit(request(other, 2, session="a"))
    live.run()
    fresh = Engine(model, slots=2, prompt_buckets=(32, 256), generation_buckets=(TURN,), eos_token_ids=STOPS)
    want = fresh.submit(request(other, 2))
    fresh.run()
    assert second.wait().tokens == want.wait().tokens and live.stats["continued"] == 0
    assert live.stats["prefilled_tokens"] == len(prompt) + len(other)


def test_held_slots_give_way_to_waiting_rows(model):
    """More sessions than slots: rows that wait take the held slots (the oldest first); an evicted session's
    continuation starts fresh and still equals a fresh turn."""
    live = Engine(model, slots=2, prompt_buckets=(32, 256), generation_buckets=(BUDGET,), eos_token_ids=STOPS,
                  insert_rows=1, prompts_per_insert=1)
    prompts = [[3 + i, 40, 41, 42] for i in range(3)]
    firsts = [live.submit(request(p, i, session=i)) for i, p in enumerate(prompts)]
    live.run()
    assert live.stats["evicted"] >= 1
    evicted = 0 not in live._sessions  # the first two held slots; one gave way to the third row
    nxt = prompts[0] + firsts[0].wait().tokens + [7, 8, 9]
    again = live.submit(request(nxt, 10, session=0))
    live.run()
    fresh = Engine(model, slots=2, prompt_buckets=(32, 256), generation_buckets=(TURN,), eos_token_ids=STOPS)
    want = fresh.submit(request(nxt, 10))
    fresh.run()
    assert again.wait().tokens == want.wait().tokens
    # continued in place when its slot was still held, else started fresh (its whole prompt prefilled)
    assert live.stats["continued"] == (0 if evicted else 1)
    assert live.stats["prefilled_tokens"] == sum(map(len, prompts)) + (len(nxt) if evicted else 0)


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_sessions_on_a_mesh_equal_sessions_on_one_device(model):
    """The trainer's mesh (rows over data x fsdp): extensions gather and scatter rows of sharded caches; a two-turn
    session equals the same on one device."""
    import jax
    from jaxrl.parallel.mesh import make_mesh
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py fakes 8 CPU devices)")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 250, size=n).tolist() for n in (7, 19)]
    out = []
    for mesh in (None, make_mesh((4, 2, 1))):
        engine = Engine(model, slots=8, prompt_buckets=(32,), generation_buckets=(BUDGET,), eos_token_ids=STOPS,
                        mesh=mesh, round_steps=4)
        first = [engine.submit(request(p, i, session=i)) for i, p in enumerate(prompts)]
        engine.run()
        turns = [p + t.wait().tokens + [9, 8, 7, 6, 5] * 4 for p, t in zip(prompts, first)]
        second = [engine.submit(request(h, 100 + i, session=i)) for i, h in enumerate(turns)]
        engine.run()
        assert engine.stats["continued"] == 2
        out.append([(t.wait().tokens, t.wait().logprobs) for t in first + second])
    for (a, la), (b, lb) in zip(*out):
        assert a == b
        np.testing.assert_allclose(la, lb, atol=2e-5)
