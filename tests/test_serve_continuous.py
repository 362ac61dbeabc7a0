"""The serve loop of `launchers.serve` (jaxrl/serve/loop.py over the generation engine) against the rows it
answered when the static engine it replaced was still there to compare with (tests/golden.py): the same rows token
for token for the same keys (fp32; greedy and seeded sampling; requests in flight together with different
max_tokens, stop ids, prompt lengths, sampling modes and adapters, through the server's own adapter registry),
and a request that arrives while others decode joins a free slot at the next round end instead of waiting for
them.

Tolerance as tests/test_rollout_engine.py states it: tokens and finish reasons identical, log-probabilities within
1e-5 (a decode step's attention reads a cache prefix whose length differs between two schedules).
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import golden
from serve_fixture import build_base

MAX_LEN = 512
# Stop ids that end a row often on the near-uniform random model (~6% a step), so rows end at different steps;
# 16 of them: one stop-id width (lane) with the rows that carry fewer.
STOPS = tuple(range(100, 116))
GEN_BUCKETS = (64,)  # every cap of the tests up to 64 in one generation bucket: one lane, one set of programs


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import jax.numpy as jnp

    from jaxrl.data.chat import load_tokenizer
    from jaxrl.models.peft import export_peft
    from jaxrl.models import qwen35
    from jaxrl.models.adapters import Adapter
    from jaxrl.models.lora import linears

    root = tmp_path_factory.mktemp("serve_continuous")
    base = build_base(root / "base", max_positions=MAX_LEN)
    model = qwen35.from_pretrained(base, dtype=jnp.float32)
    lin = dict(linears(model))
    adapters = {}
    for name, seed in (("a1", 3), ("a2", 4)):  # one structure (modules, rank): one compiled graph for both
        rng = np.random.default_rng(seed)
        params = {}
        for m in ("layers.0.linear_attn.in_proj_qkv", "layers.1.self_attn.q_proj", "layers.1.mlp.down_proj"):
            params[m + ".lora.lora_A"] = (0.5 * rng.standard_normal((2, lin[m].in_features))).astype(np.float32)
            params[m + ".lora.lora_B"] = (0.5 * rng.standard_normal((lin[m].out_features, 2))).astype(np.float32)
        adapters[name] = str(root / name)
        export_peft(Adapter(params=params, rank=2, alpha=4.0, source=name), adapters[name], base)
    return {"root": root, "base": base, "tok": load_tokenizer(base), "adapters": adapters}


def completion_server(env, prompt_buckets=(32,), **kwargs):
    """A CompletionServer (no HTTP) with a model object of its own (each server attaches adapters to its model),
    4 slots per pool."""
    import jax.numpy as jnp

    from jaxrl.models import qwen35
    from jaxrl.serve.app import CompletionServer
    from jaxrl.serve.settings import ServeLimits
    model = qwen35.from_pretrained(env["base"], dtype=jnp.float32)
    return CompletionServer(env["base"], model=model, tokenizer=env["tok"], batch_size=4, served_model_name="base",
                            limits=ServeLimits(max_model_len=MAX_LEN, max_prompt_len=max(prompt_buckets)),
                            prompt_buckets=prompt_buckets, **{"generation_buckets": GEN_BUCKETS, **kwargs})


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 250, size=n).tolist() for n in lengths]


def rows(model, prompts, groups, samples, caps, stops=STOPS, temperature=1.0, top_p=1.0, top_k=0, seed=5):
    """(model, the engine requests of one server request's rows)."""
    from jaxrl.generation import Request
    return model, [Request(p, group_id=g, sample_index=i, seed=seed, max_new_tokens=cap, temperature=temperature,
                           top_p=top_p, top_k=top_k, stop_ids=tuple(stops))
                   for p, g, i, cap in zip(prompts, groups, samples, caps)]


def answers(loop, works):
    """Every work submitted at once, from threads of their own (requests in flight together); their rows."""
    barrier = threading.Barrier(len(works))

    def one(work):
        barrier.wait()
        return loop.generate(*work).result(timeout=600)

    with ThreadPoolExecutor(len(works)) as pool:
        return list(pool.map(one, works))


def check_golden(name, results):
    """Every row of every request (in request order) against its golden row."""
    flat = [r for rows_ in results for r in rows_]
    golden.check_rows(name, [r.tokens for r in flat], [r.logprobs for r in flat], [r.finish_reason for r in flat])


@pytest.mark.slow
def test_a_request_arriving_while_others_decode_joins_a_free_slot_at_the_next_round_end(env):
    """Two rows of 64 tokens decode in a pool of 4 slots; two requests (24 and 10 tokens) that arrive after their
    first round move into the free slots at that round's end (one insert, while the long rows are in flight) and
    are answered after 3 and 4 rounds, while the long rows still decode. The 10-token row's own generation bucket
    is 16, but it joins the running pool of cap 64 rather than opening a pool of its own. The loop's turns
    (`step`) are driven here one by one, so the counters say exactly where each row is."""
    p = prompts_of([11, 25, 6, 19], seed=1)
    long_rows = rows("base", p[:2], [1, 2], [0, 0], [64, 64], stops=())
    later = [rows("base", p[2:3], [3], [0], [24], stops=()), rows("base", p[3:], [4], [0], [10], stops=())]
    server = completion_server(env, generation_buckets=(16, 64), round_steps=8, start=False)
    loop = server.loop
    try:
        long = loop.generate(*long_rows)
        loop.step()  # the long rows move in (one insert) and decode their first round
        assert (loop.stats()["inserts"], loop.stats()["rounds"], loop.stats()["rows_running"]) == (1, 1, 2)
        short = [loop.generate(*w) for w in later]
        turn, answered_at = 1, [None, None]  # the turn (round) after which each was answered
        while not short[0].done():
            loop.step()
            turn += 1
            answered_at = [t or (turn if f.done() else None) for t, f in zip(answered_at, short)]
        stats = loop.stats()
        # in at the first round end (decode step 8); the last token of 24 at step 8 + 23, of 10 at step 8 + 9:
        # rounds 4 and 3; the long rows (64 tokens: decode step 63) are in flight
        assert not long.done() and answered_at == [4, 3]
        assert (stats["inserts"], stats["rounds"], stats["decode_steps"], stats["rows_running"]) == (2, 4, 32, 2)
        assert list(loop.engine.pools) == [(32, 64, 16, False)]  # (prompt width, cap, stop width, sessions)
        while not long.done():
            loop.step()
        assert loop.stats()["decode_steps"] == 63  # the long rows: their first token from the prefill, 63 decoded
    finally:
        server.close()
    check_golden("serve_join", [f.result() for f in [long] + short])
    assert [len(f.result()[0].tokens) for f in short] == [24, 10]


@pytest.mark.slow
def test_concurrent_requests_get_their_golden_rows_token_for_token(env):
    """Greedy and seeded rows, caps from 1 to 64, stop ids or none, n > 1: all in flight at once in the engine,
    each row its golden one (what the static engine gave for its key)."""
    p = prompts_of([9, 30, 17, 4, 22, 12])
    works = [
        rows("base", [p[0], p[1]], [1, 2], [0, 3], [40, 40]),
        rows("base", [p[2]], [3], [0], [7], temperature=0.0),
        rows("base", [p[3]] * 3, [4] * 3, [0, 1, 2], [13] * 3, seed=9),
        rows("base", [p[4]], [5], [0], [64], stops=()),  # runs to its cap
        rows("base", [p[5], p[0]], [6, 1], [0, 0], [1, 1]),
        rows("base", [p[1]], [2], [1], [50], temperature=0.0),
        rows("base", [p[2], p[3]], [3, 4], [2, 5], [16, 16], stops=(7, 8, 9)),
    ]
    server = completion_server(env)
    try:
        got = answers(server.loop, works)
        stats = server.loop.stats()
    finally:
        server.close()
    check_golden("serve_concurrent", got)
    reasons = [r.finish_reason for g in got for r in g]
    assert "stop" in reasons and "length" in reasons
    assert [len(r.tokens) for r in got[3]] == [64] and [len(r.tokens) for r in got[4]] == [1, 1]
    assert stats["rows_generated"] == sum(len(w[1]) for w in works) and stats["pools"] == 1


@pytest.mark.heavy  # two prompt buckets, four sampling modes, three model structures' programs
def test_adapters_prompt_buckets_and_sampling_modes_give_their_golden_rows(env):
    """Requests for the base and two adapters (one reloaded in place) in flight together, over two prompt buckets
    and every sampling mode: the engine switches its weights only between rows (the pools drain, the server
    attaches the adapter and checks its digest) and every row is its golden one."""
    p = prompts_of([9, 50, 17, 40, 22], seed=2)
    works = [
        rows("a1", [p[0], p[1]], [1, 2], [0, 3], [40, 40], top_p=0.9),
        rows("base", [p[2]], [3], [0], [30], temperature=0.0),
        rows("a2", [p[3]] * 2, [4] * 2, [0, 1], [13] * 2, temperature=0.8, top_k=20, seed=9),
        rows("a1", [p[4]], [5], [0], [64], stops=(), temperature=0.0),
        rows("base", [p[1], p[0]], [6, 1], [0, 1], [20, 20], stops=(7,)),
        rows("a2", [p[2]], [2], [1], [50]),
    ]
    server = completion_server(env, prompt_buckets=(32, 64), generation_buckets=(16, 64))  # a pool per bucket
    try:
        for name, path in env["adapters"].items():
            server.load_adapter(name, path, runtime=False)
        got = answers(server.loop, works)
        # a1 reloaded in place with a2's weights: the next a1 rows are a2's rows (a fresh snapshot of the weights)
        server.load_adapter("a1", env["adapters"]["a2"], load_inplace=True, runtime=False)
        again = server.loop.generate(*rows("a1", [p[2]], [2], [1], [50])).result(timeout=600)
        check_golden("serve_adapters", got + [again])
        assert [r.tokens for r in again] == [r.tokens for r in got[5]]
        assert server.models()["data"][1]["adapter_digest"] == server.models()["data"][2]["adapter_digest"]
    finally:
        server.close()
