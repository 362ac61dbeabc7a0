"""The generation engine (jaxrl.generation) against the samples it drew when the static sampler it replaced was
still there to compare with (tests/golden.py: the same tokens for the same keys, fp32; greedy, top-p and top-k),
through the sampler interface (`sample` and `stream`), the request API a server uses (requests joining between
rounds, their own caps, stop ids and sampling modes) and every consumer (offline rollouts, evaluation, online
GRPO/PPO rollouts, a resumed rollout); and its compiled programs, counted against their bound.

The tolerance: tokens and finish reasons must be identical. Log-probabilities agree to 1e-5: a decode step's
attention reads a cache prefix sized by the longest row in flight, which differs between two schedules, so a sum
may round differently in the last bit (a token choice could flip only at an exact near-tie of two logits; none
occurs in these tests).
"""

import json
import threading
import time

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxrl.models import qwen35
from jaxrl.models.qwen35.config import tiny  # not qwen35.tiny: the tiny.py submodule shadows it once imported
from jaxrl.generation import TRACE_COUNTS, Engine, Request, Sampler, engine_programs
from jaxrl.generation.engine import insert_sizes, prompts_per_rows, shrink_ladder
import golden
# test_generation_path's fixture `env` (a tiny container, its tokenizer, four problems), here as `generation_env`
from test_generation_path import env as generation_env  # noqa: F401

MAX_NEW = 24
# Stop ids making lengths skewed (roughly geometric, mean ~10 tokens) on the near-uniform 256-way random model,
# so rows finish at very different steps and the engine refills and shrinks.
STOPS = tuple(range(100, 124))
SETTINGS = dict(max_new_tokens=MAX_NEW, prompt_buckets=(32,), batch_size=8, eos_token_ids=STOPS)
ENGINE = dict(prompt_buckets=(32,), generation_buckets=(MAX_NEW,), eos_token_ids=STOPS)


@pytest.fixture(scope="module")
def model():
    return qwen35.init_model(tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention")),
                             seed=0)


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 250, size=n).tolist() for n in lengths]


def test_insert_and_shrink_sizes():
    """K = slots / 16 rows per insert (at least 4, or a quarter of fewer slots; at least slots * 32 / cap); the
    prompts its prefill holds: ceil(K / n) rounded up the ladder K / 8, K / 2, K (so calls of other n share the
    programs); halvings down to slots / 16; every size a multiple of the data-parallel size."""
    assert insert_sizes(64, 8) == (4, 2) and insert_sizes(64, 1) == (4, 4) and insert_sizes(8, 4) == (2, 1)
    assert insert_sizes(160, 8) == (10, 5) and insert_sizes(160, 8, multiple=8) == (16, 8)
    assert insert_sizes(2, 1) == (1, 1) and insert_sizes(16, 3) == (4, 2)
    assert insert_sizes(160, 8, cap=4096) == (10, 5) and insert_sizes(64, 8, cap=256) == (8, 1)
    assert insert_sizes(64, 8, cap=8) == (64, 8)  # short generations: refilled all at once
    assert prompts_per_rows(64, 8) == 8 and prompts_per_rows(12, 8) == 6 and prompts_per_rows(16, 8, multiple=8) == 8
    assert prompts_per_rows(8, 4) == prompts_per_rows(8, 2) == 4 and prompts_per_rows(8, 1) == 8
    assert shrink_ladder(64) == (32, 16, 8, 4) and shrink_ladder(160) == (80, 40, 20, 10)
    assert shrink_ladder(64, multiple=8) == (32, 16, 8) and shrink_ladder(8, multiple=8) == ()


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, 0), (1.0, 0.9, 0), (0.8, 1.0, 20)],
                         ids=["greedy", "top_p", "top_k"])
def test_the_engine_samples_its_golden_rows(model, temperature, top_p, top_k):
    """24 rows through 8 slots: the engine refills finished slots and shrinks as the rollout drains; every sample
    is the golden one, whether the rows are all submitted at once (`sample`) or fed as they go (`stream`)."""
    prompts = prompts_of([5, 30, 12, 17, 9, 25])
    sampling = dict(n=4, temperature=temperature, top_p=top_p, top_k=top_k, seed=5, group_ids=[3, 1, 4, 1, 5, 9])
    name = f"engine_t{temperature}_p{top_p}_k{top_k}"
    # 2 rows per refill (the default for so short a cap refills all 8 slots at once)
    out = Sampler(model, shrink=True, insert_rows=2, **SETTINGS).sample(prompts, **sampling)
    golden.check_rows(name, out.tokens, out.logprobs, out.finish_reasons)
    streamed = [c for _, rows in Sampler(model, insert_rows=2, **SETTINGS).stream(prompts, **sampling) for c in rows]
    golden.check_rows(name, [c.tokens for c in streamed], [c.logprobs for c in streamed],
                      [c.finish_reason for c in streamed])
    lengths = [len(t) for t in out.tokens]
    assert min(lengths) < max(lengths) and "stop" in out.finish_reasons  # rows end apart: the engine refills
    assert out.stats["inserts"] > 3 and out.stats["shrinks"] >= 1
    assert out.stats["generated_tokens"] == sum(lengths)
    # each prompt prefilled once for its 4 samples, though they move in 2 at a time
    assert out.stats["prefilled_prompts"] == len(prompts)
    # shrinking: fewer slot-steps than the decode steps at all 8 slots would take
    assert out.stats["slot_steps"] < 8 * out.stats["decode_steps"]


@pytest.mark.slow
def test_requests_join_free_slots_with_their_own_settings(model):
    """The server-facing API: requests submitted while others are in flight join at the next round, from another
    thread too (the rounds run on a thread of their own, as a server's serve loop runs them: jaxrl/serve/loop.py);
    a request's own cap, stop ids and sampling mode (a greedy one waits until the sampled rows drain) give exactly
    what a sampler call gives for its key, and the golden rows."""
    engine = Engine(model, slots=4, insert_rows=1, **ENGINE)
    prompts = prompts_of([7, 19, 30, 4, 11], seed=3)
    sampled = dict(seed=11, temperature=1.0, top_p=0.9)
    first = [engine.submit(Request(p, group_id=j, sample_index=1, **sampled)) for j, p in enumerate(prompts)]
    engine.step()
    assert not engine.idle
    later = {
        "capped": engine.submit(Request(prompts[0], group_id=0, sample_index=0, max_new_tokens=5, **sampled)),
        "stops": engine.submit(Request(prompts[1], group_id=1, sample_index=0, stop_ids=(7, 8), **sampled)),
        "greedy": engine.submit(Request(prompts[2], group_id=2, sample_index=0)),
    }
    stop = threading.Event()

    def rounds():  # a server's device thread: a round while there is work; a failing round fails every waiter
        while not stop.is_set():
            if engine.idle:
                time.sleep(0.005)
                continue
            try:
                engine.step()
            except Exception as e:  # noqa: BLE001 - the waits below raise it instead of timing out
                engine.fail_all(e)

    worker = threading.Thread(target=rounds)
    worker.start()
    try:
        extra = engine.submit(Request(prompts[3], group_id=3, sample_index=0, **sampled))
        done = {name: t.wait(timeout=600) for name, t in later.items()}
        firsts = [t.wait(timeout=600) for t in first]
        extra_done = extra.wait(timeout=600)
    finally:
        stop.set()
        worker.join()
    assert engine.idle
    golden.check_rows("engine_requests", *zip(*[(c.tokens, c.logprobs, c.finish_reason) for c in
                                                firsts + [extra_done] + [done[k] for k in sorted(done)]]))

    ref = Sampler(model, **SETTINGS).sample(prompts, n=2, group_ids=range(5), **{k: sampled[k] for k in
                                                                                 ("seed", "temperature", "top_p")})
    for j, c in enumerate(firsts):
        assert (c.tokens, c.finish_reason) == (ref.tokens[2 * j + 1], ref.finish_reasons[2 * j + 1])
        np.testing.assert_allclose(c.logprobs, ref.logprobs[2 * j + 1], atol=1e-5)
    assert (extra_done.tokens, extra_done.finish_reason) == (ref.tokens[6], ref.finish_reasons[6])
    full = ref.tokens[0]  # the capped request: the same row, cut at its own cap
    assert done["capped"].tokens == full[:5]
    assert done["capped"].finish_reason == ("stop" if len(full) <= 5 and ref.finish_reasons[0] == "stop"
                                            else "length")
    own_stops = Sampler(model, **{**SETTINGS, "eos_token_ids": (7, 8)}).sample(
        prompts[1:2], n=1, group_ids=[1], **{k: sampled[k] for k in ("seed", "temperature", "top_p")})
    assert (done["stops"].tokens, done["stops"].finish_reason) == (own_stops.tokens[0], own_stops.finish_reasons[0])
    greedy = Sampler(model, **SETTINGS).sample(prompts[2:3], group_ids=[2])
    assert (done["greedy"].tokens, done["greedy"].finish_reason) == (greedy.tokens[0], greedy.finish_reasons[0])
    with pytest.raises(ValueError, match="prompt_len=32"):
        engine.submit(Request(list(range(2, 40))))
    with pytest.raises(ValueError, match="max_new_tokens=25"):
        engine.submit(Request(prompts[0], max_new_tokens=MAX_NEW + 1))


@pytest.mark.slow
def test_row_caps_cut_each_row_where_its_cap_says(model):
    """Per-row caps (the benchmark's truncation pattern, a server's max_tokens): each row is the uncapped row cut
    at its cap ("length"), unless it stopped before."""
    prompts = prompts_of([6, 21], seed=4)
    caps = [1, 3, 24, 7, 12, 24, 2, 9]
    sampling = dict(n=4, temperature=1.0, seed=2)
    ref = Sampler(model, **SETTINGS).sample(prompts, **sampling)
    out = Sampler(model, **SETTINGS).sample(prompts, row_caps=caps, **sampling)
    golden.check_rows("engine_row_caps", out.tokens, out.logprobs, out.finish_reasons)
    for tokens, reason, full, full_reason, cap in zip(out.tokens, out.finish_reasons, ref.tokens,
                                                      ref.finish_reasons, caps):
        assert tokens == full[:cap]
        assert reason == (full_reason if len(full) <= cap else "length")


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_programs_compile_once_and_stay_within_the_bound():
    """A call compiles at most `program_bound()` programs; later calls with new prompts (same prompt length),
    seeds, sampling values and weights trace no new prefill, insert or weight preparation, and stay within the
    bound."""
    # a model structure of its own: the jit caches hold nothing of it yet
    model = qwen35.init_model(tiny(vocab_size=255, num_hidden_layers=2,
                                   layer_types=("linear_attention", "full_attention")), seed=0)
    sampler = Sampler(model, shrink=True, **SETTINGS)
    before = engine_programs()
    sampler.sample(prompts_of([5, 9, 30]), n=4, temperature=1.0, top_p=0.9, seed=1)
    assert 0 < engine_programs() - before <= sampler.program_bound()
    once = {k: v for k, v in TRACE_COUNTS.items() if k[0] in ("engine_prefill", "engine_insert", "engine_prepare")}
    new_weights = jax.tree.map(lambda x: x * 1.01, nnx.state(model))
    sampler.sample(prompts_of([12, 3, 31], seed=9), n=4, temperature=0.6, top_p=0.5, seed=8, params=new_weights)
    assert {k: v for k, v in TRACE_COUNTS.items() if k[0] in ("engine_prefill", "engine_insert",
                                                               "engine_prepare")} == once
    assert engine_programs() - before <= sampler.program_bound()


# ---------------------------------------------------------------------------------------------------------------
# Every consumer samples the golden rows


class _Row:
    """A golden row, as a consumer's samples are compared with it."""

    def __init__(self, row: dict):
        self.tokens, self.logprobs, self.finish_reason = row["tokens"], row["logprobs"], row["finish_reason"]
        self.truncated = self.finish_reason == "length"


def golden_samples(name: str, problems, n: int) -> dict:
    """{(problem id, sample index): golden row} of `n` samples of each problem."""
    rows = golden.keyed_rows(name, [(p.id, i) for p in problems for i in range(n)])
    return {key: _Row(row) for key, row in rows.items()}


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_rollouts_evaluation_and_online_rollouts_sample_the_golden_rows(generation_env, temperature):
    """Offline rollouts, evaluation and online GRPO rollouts (all on the engine) against the golden rows of their
    keys (seed, problem key, sample index): the same tokens and finish reasons, sample for sample."""
    env = generation_env
    from jaxrl.algorithms.online.rollouts import Rollouts
    from jaxrl.algorithms.run import resolve_config
    from jaxrl.data.problems import load_problems
    from jaxrl.evaluation.runner import EvalConfig, Evaluator
    from jaxrl.rollout.runner import RolloutConfig, run_rollouts
    from test_generation_path import CAP, N, REWARD

    tok = env["tokenizer"]
    problems = load_problems(env["problems"])
    seed = 17
    ref = golden_samples(f"consumers_t{temperature}", problems, N)
    assert any(s.finish_reason == "stop" for s in ref.values())
    assert temperature == 0 or len({len(s.tokens) for s in ref.values()}) > 1  # sampled rows end apart

    tag = f"t{temperature}"
    common = dict(max_new_tokens=CAP, max_prompt_len=192, prompt_buckets=(192,), temperature=temperature,
                  seed=seed, dtype="float32", progress=False)
    out = env["root"] / f"engine_rollouts_{tag}.jsonl"
    run_rollouts(RolloutConfig(problems=env["problems"], model=env["model_dir"], out=str(out), num_samples=N,
                               reward=REWARD, batch_size=4, save_logprobs=True, **common),
                 model=env["model"], tokenizer=tok)
    for r in map(json.loads, out.read_text().splitlines()):
        s = ref[(r["problem_id"], r["sample_index"])]
        assert (r["token_ids"], r["finish_reason"]) == (s.tokens, s.finish_reason)
        np.testing.assert_allclose(r["logprobs"], s.logprobs, atol=1e-5)

    ev = Evaluator(EvalConfig(problems=env["problems"], base=env["model_dir"], out=str(env["root"] / f"ev_{tag}"),
                              num_samples=N, reward=REWARD, batch_size=4, n_resamples=200, **common),
                   model=env["model"], tokenizer=tok)
    try:
        evaluated = ev.sample_model("base")
    finally:
        ev.close()
    assert len(evaluated) == len(ref)
    for r in evaluated:
        s = ref[(r["problem_id"], r["sample_index"])]
        assert (r["completion_tokens"], r["finish_reason"]) == (len(s.tokens), s.finish_reason)
        assert r["completion"] == ev.collector.decode(s.tokens)

    config = resolve_config(ml_collections.ConfigDict({
        "seed": 0, "model_path": env["model_dir"], "algorithm": "grpo",
        "data": {"source": "problems", "problems": env["problems"], "max_prompt_len": 192},
        "grpo": {"max_new_tokens": CAP, "num_generations": N, "temperature": temperature, "top_p": 1.0},
        "reward": {"name": REWARD, "score": "partial"}}))
    rollouts = Rollouts(config, env["model"], None, prompts_per_rollout=len(problems), sampling=config.grpo)
    rollouts.open(str(env["root"]), env["model"])
    sampled = rollouts.run(env["model"], 0)
    _, rollout_problems, _ = rollouts.source.prompts(0, len(problems))
    online_ref = golden_samples(f"online_t{temperature}", rollout_problems, N)
    for j, problem in enumerate(rollout_problems):
        for i in range(N):
            row, s = j * N + i, online_ref[(problem.id, i)]
            n = int(sampled.lengths[row])
            assert sampled.input_ids[row, 192:192 + n].tolist() == s.tokens
            assert bool(sampled.truncated[row]) == s.truncated
            np.testing.assert_allclose(sampled.behaviour_logp[row, :n], s.logprobs, atol=1e-5)


class _Interrupted(Exception):
    pass


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_an_interrupted_rollout_resumes_to_the_same_samples(generation_env):
    """A rollout stopped after its first written batch, then rerun: the file holds every sample once, each the
    golden one for its key (the resumed part is drawn by problem key, not by position)."""
    env = generation_env
    from jaxrl.data.problems import load_problems
    from jaxrl.rollout.runner import RolloutConfig, run_rollouts
    from test_generation_path import CAP, N, REWARD

    out = env["root"] / "interrupted.jsonl"
    # 2 slots on one device: the backend takes 8 rows per collect call (collect_factor 4): two problems, two calls
    cfg = RolloutConfig(problems=env["problems"], model=env["model_dir"], out=str(out), num_samples=N,
                        reward=REWARD, batch_size=2, save_logprobs=True, max_new_tokens=CAP, max_prompt_len=192,
                        prompt_buckets=(192,), temperature=1.0, seed=23, dtype="float32", progress=False,
                        mesh_shape=None)

    def stop_after_first(counts):
        raise _Interrupted

    with pytest.raises(_Interrupted):
        run_rollouts(cfg, model=env["model"], tokenizer=env["tokenizer"], on_batch=stop_after_first)
    written = len(out.read_text().splitlines())
    assert 0 < written < 4 * N
    meta = run_rollouts(cfg, model=env["model"], tokenizer=env["tokenizer"])
    assert meta["samples_resumed"] == written and meta["samples_written"] == 4 * N - written

    ref = golden_samples("resumed_rollout", load_problems(env["problems"]), N)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["problem_id"], r["sample_index"]) for r in records) == sorted(ref)
    for r in records:
        s = ref[(r["problem_id"], r["sample_index"])]
        assert (r["token_ids"], r["finish_reason"]) == (s.tokens, s.finish_reason)



def test_weights_swapped_under_running_rows(model):
    """`set_params(in_flight=True)` (partial rollouts): rows running at the swap keep their caches and sample their
    next tokens with the new weights. Before the swap every token and log-prob is the old weights' run (an engine
    that never swapped); after it, each log-prob is the new weights' on a cache whose prefix the old weights wrote
    (a teacher-forced reference that prefills prompt + the tokens before the swap with the old weights and feeds the
    rest with the new ones), and token_versions names the boundary. Neither policy alone gives those log-probs. The
    swap compiles nothing and prefills nothing (AReaL's re-prefill would prefill every running row again)."""
    cap, rounds = 20, 4
    old = nnx.state(model)
    leaves, treedef = jax.tree.flatten(old)
    keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
    new = jax.tree.unflatten(treedef, [x + 0.5 * jax.random.normal(k, x.shape, x.dtype) * jnp.std(x)
                                       if jnp.issubdtype(x.dtype, jnp.floating) and x.size > 1 else x
                                       for x, k in zip(leaves, keys)])
    prompts = prompts_of([6, 13, 9], seed=4)
    settings = dict(slots=4, prompt_buckets=(32,), generation_buckets=(cap,), round_steps=rounds)

    def requests():
        return [Request(p, group_id=j, seed=3, temperature=1.0, max_new_tokens=cap, stop_ids=()) for j, p in
                enumerate(prompts)]

    plain = Engine(model, **settings)
    plain.set_params(old)
    reference = [plain.submit(r) for r in requests()]
    plain.run()
    engine = Engine(model, **settings)
    engine.set_params(old, version=10)
    tickets = [engine.submit(r) for r in requests()]
    engine.step()
    with pytest.raises(RuntimeError, match="in_flight=True"):
        engine.set_params(new)
    boundary = 1 + rounds  # the insert samples token 0; one round of `rounds` steps
    traces = sum(TRACE_COUNTS.values())
    assert engine.set_params(new, in_flight=True) == 11 and engine.version == 11
    engine.run()
    # what the swap cost: no program compiled (same structure), no prompt prefilled again, no extra round
    assert sum(TRACE_COUNTS.values()) == traces
    for name in ("prefilled_prompts", "rounds", "decode_steps"):
        assert engine.stats[name] == plain.stats[name], name

    split = jax.jit(lambda state, ids, cache: nnx.merge(nnx.graphdef(model), state)(ids, cache=cache))

    def mixed_logprobs(prompt, tokens, first, second):
        """log p(tokens[boundary:]) with the prompt and tokens[:boundary - 1] cached by `first`, the rest fed to
        `second` (the engine's swapped row: token boundary - 1 is the new weights' first input)."""
        cache = model.init_cache(1, len(prompt) + cap)
        prefix = np.asarray([list(prompt) + tokens[:boundary - 1]], np.int32)
        _, cache = split(first, prefix, cache)
        logits, _ = split(second, np.asarray([tokens[boundary - 1:-1]], np.int32), cache)
        logp = jax.nn.log_softmax(np.asarray(logits[0], np.float32), axis=-1)
        return np.asarray([logp[t, tok] for t, tok in enumerate(tokens[boundary:])])

    for prompt, ticket, ref in zip(prompts, tickets, reference):
        got, want = ticket.wait(), ref.wait()
        assert len(got.tokens) == cap and got.finish_reason == "length"
        np.testing.assert_array_equal(got.token_versions, [10] * boundary + [11] * (cap - boundary))
        np.testing.assert_array_equal(want.token_versions, [0] * cap)
        assert got.tokens[:boundary] == want.tokens[:boundary]
        np.testing.assert_array_equal(got.logprobs[:boundary], want.logprobs[:boundary])
        assert np.abs(got.logprobs[boundary:] - np.asarray(want.logprobs[boundary:])).max() > 1e-2
        mixed = mixed_logprobs(prompt, got.tokens, old, new)
        np.testing.assert_allclose(got.logprobs[boundary:], mixed, atol=1e-4)
        for first, second in ((old, old), (new, new)):  # the check tells the policies apart
            assert np.abs(mixed_logprobs(prompt, got.tokens, first, second) - mixed).max() > 1e-2


def test_an_in_flight_swap_ends_held_sessions_and_versions_their_next_turn(model):
    """Sessions meet an in-flight swap: a held session ends (its next turn starts fresh, every token of the new
    version) while the row still decoding crosses the swap and is tagged on both sides."""
    engine = Engine(model, slots=2, prompt_buckets=(32,), generation_buckets=(64,), round_steps=4)
    old = nnx.state(model)
    new = jax.tree.map(lambda x: x * 1.01 if jnp.issubdtype(x.dtype, jnp.floating) else x, old)
    engine.set_params(old)
    sampled = dict(seed=2, temperature=1.0, stop_ids=())
    held = engine.submit(Request([5, 6, 7], group_id=0, max_new_tokens=3, session="s", session_tokens=64,
                                 **sampled))
    long = engine.submit(Request([9, 10, 11, 12], group_id=1, max_new_tokens=40, **sampled))
    engine.step()  # the session's turn ends (held), the long row runs on
    assert held.done and not long.done and engine.running == 1
    engine.set_params(new, in_flight=True)
    nxt = engine.submit(Request([5, 6, 7] + held.wait().tokens + [20], group_id=2, max_new_tokens=5, session="s",
                                session_tokens=64, **sampled))
    engine.run()
    assert engine.stats["continued"] == 0  # the held slot was freed by the swap: the next turn started fresh
    np.testing.assert_array_equal(held.wait().token_versions, [0] * 3)
    np.testing.assert_array_equal(nxt.wait().token_versions, [1] * 5)
    np.testing.assert_array_equal(long.wait().token_versions, [0] * 5 + [1] * 35)
    engine.end_session("s")
