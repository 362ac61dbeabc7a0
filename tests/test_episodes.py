"""Token-exact episodes (jaxrl/environments/runner.py) on a tiny model through the jax rollout backend:
every sampled position holds the sampler's ids and log-probs for that very history, every environment position
the template's delta with mask 0, the teacher-forced pass over the row reproduces the sampler's log-probs, and an
environment that raises fails its episode only."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.environments.base import Environment
from jaxrl.algorithms.online import passes
from jaxrl.algorithms.online.rollouts import episodes_to_sampled
from jaxrl.environments.runner import EpisodeRunner, turn_group_id
from jaxrl.backends import JaxBackend, SamplingParams
from jaxrl.data.chat import chat_stop_ids, load_tokenizer, turn_delta_ids
from jaxrl.data.problems import load_problems
from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
from jaxrl.models import qwen35
from jaxrl.models.qwen35.config import tiny
from jaxrl.rollout.collect import Collector
from jaxrl.rollout.keys import problem_key
from test_evaluate import numpy_init

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "jaxrl" / "assets" / "tasks" / "problems.jsonl"
CAP, TURNS, K, E, P = 12, 3, 3, 160, 192


class Retry(Environment):
    """Asks again after every turn, quoting the turn's length; 0.25 per turn; fails at its first step when its seed
    (a function of the episode's key) is divisible by 3."""

    def reset(self, problem):
        return list(problem.messages)

    def step(self, turn):
        if turn.index == 0 and self.seed % 3 == 0:
            raise RuntimeError("boom")
        return [{"role": "user", "content": f"Turn {turn.index}: {len(turn.token_ids)} tokens. Again."}], 0.25, False


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("episodes")
    records = [json.loads(line) for line in TASKS.read_text().splitlines()[:2]]
    model_dir = str(root / "model")
    cfg = tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
    qwen35.save_pretrained(numpy_init(cfg), model_dir, base_dir=None, layout="container")
    build_tiny_tokenizer(model_dir, [m["content"] for p in records for m in p["messages"]] + ["Turn 0: tokens. Again."])
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = load_tokenizer(model_dir)
    model = qwen35.from_pretrained(model_dir, dtype=jnp.float32)
    # A random model rarely samples <|im_end|>; thirty more stop ids end its turns within the cap, so episodes
    # have several turns (a turn that ends on another stop id is closed by the delta's own <|im_end|>).
    stop_ids = tuple(sorted(set(chat_stop_ids(tok)) | set(range(40, 70))))
    backend = JaxBackend(model=model, dtype=None, batch_size=8, max_prompt_len=P + E - CAP, stop_ids=stop_ids, pad_id=0)
    collector = Collector(backend, None, tokenizer=tok, stop_ids=stop_ids)
    runner = EpisodeRunner(collector, Retry, tokenizer=tok, enable_thinking=False, max_turns=TURNS,
                           max_new_tokens=CAP, max_episode_tokens=E, max_prompt_len=P)
    problems = load_problems(root / "p.jsonl")
    groups = [problem_key(p.id) for p in problems]
    sampling = SamplingParams(n=K, max_new_tokens=CAP, temperature=1.0, seed=11)
    episodes = runner.run(problems, groups, sampling)
    return dict(tok=tok, model=model, backend=backend, episodes=episodes, groups=groups, sampling=sampling,
                stop_ids=stop_ids, stats=dict(runner.last_stats))


def runs(mask):
    """(start, end, value) of the constant runs of a 0/1 list."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


@pytest.mark.slow  # the engine's programs compile for three prompt buckets
def test_sampled_positions_are_the_samplers_and_observations_are_masked_deltas(setup):
    tok, backend, episodes, sampling = setup["tok"], setup["backend"], setup["episodes"], setup["sampling"]
    assert len(episodes) == 2 * K and [(e.problem_index, e.sample_index) for e in episodes] == [
        (j, i) for j in range(2) for i in range(K)]
    assert max(e.turns for e in episodes) >= 2, "the stop ids above should give multi-turn episodes"
    checked = 0
    for e in episodes:
        assert len(e.ids) == len(e.mask) == len(e.logprobs) <= E
        pieces = runs(e.mask)
        turns = [(a, b) for a, b, v in pieces if v == 1]
        observations = [(a, b) for a, b, v in pieces if v == 0]
        assert len(turns) == e.turns and len(observations) == len(e.observations)
        g = setup["groups"][e.problem_index]
        for t, (a, b) in enumerate(turns):
            history = e.prompt_ids + e.ids[:a]
            if t == 0:  # one prompt x K samples: the single-turn rollout's keys
                ref = backend.generate([history], [g], sampling)[e.sample_index]
            else:
                ref = backend.generate([history], [turn_group_id(g, e.sample_index, t)], sampling.replace(n=1))[0]
            assert e.ids[a:b] == list(ref.tokens), (e.problem_index, e.sample_index, t)
            # log-probs to rounding: the reference call runs at another slot count (another program)
            np.testing.assert_allclose(e.logprobs[a:b], ref.logprobs, atol=1e-5, rtol=0)
            checked += 1
        for t, (a, b) in enumerate(observations):
            stop = e.ids[a - 1] if e.ids[a - 1] in setup["stop_ids"] else None
            assert e.ids[a:b] == turn_delta_ids(tok, e.observations[t], False, stop_id=stop)
            assert all(x == 0.0 for x in e.logprobs[a:b])
            assert tok.decode(e.ids[a:b]).count(f"Turn {t}:") == 1
    assert checked >= 2 * K + 2
    # the in-process runner continued every later turn in its slot: each first prompt prefilled once, then only
    # what was appended (the turn's last token and the observation) fed
    stats = setup["stats"]
    assert stats["continued"] == sum(e.turns - 1 for e in episodes) and stats["evicted"] == 0
    assert stats["prefilled_tokens"] == sum(len(episodes[j * K].prompt_ids) for j in range(2))
    assert stats["extended_tokens"] == sum(len(e.ids) - sum(e.mask) + e.turns - 1 for e in episodes)


@pytest.mark.slow
def test_teacher_forced_pass_over_the_rows_reproduces_the_samplers_logprobs(setup):
    """The row is the context each turn was sampled in: the trainer's pass gives the sampler's log-probs at every
    sampled position (float32: to rounding)."""
    s = episodes_to_sampled(setup["episodes"], P, E, 0, times={})
    assert s.input_ids.shape == (2 * K, P + E) and s.completion_mask.shape == (2 * K, E)
    out = passes.teacher_forced(setup["model"], {"input_ids": s.input_ids, "attention_mask": s.attention_mask,
                                                 "completion_mask": s.completion_mask},
                                adapters=True, batch_size=8, temperature=1.0, chunk_size=64)["logp"]
    on = s.completion_mask > 0
    assert on.sum() > 2 * K
    np.testing.assert_allclose(out[on], s.behaviour_logp[on], atol=2e-4)
    # environment tokens are in the rows (attended) but never trained
    env_tokens = (s.attention_mask[:, P:] > 0) & ~on
    assert env_tokens.sum() > 0 and np.all(s.behaviour_logp[env_tokens] == 0)


@pytest.mark.slow
def test_an_environment_that_raises_fails_its_episode_only(setup):
    episodes = setup["episodes"]
    failed = [e for e in episodes if e.error]
    fine = [e for e in episodes if not e.error]
    assert failed and fine, [(e.env.seed % 3, e.turns, e.truncated, e.done) for e in episodes]
    for e in failed:
        assert e.error == "step 0: RuntimeError: boom" and np.isnan(e.reward) and e.turns == 1
    for e in fine:
        assert e.reward == pytest.approx(0.25 * e.turns) and (e.turns == TURNS or e.truncated)
    s = episodes_to_sampled(episodes, P, E, 0, times={})
    assert np.isnan(s.rewards).sum() == len(failed)
    assert s.episode["episode/failed_fraction"] == pytest.approx(len(failed) / len(episodes))
    assert s.episode["episode/turns_mean"] == pytest.approx(np.mean([e.turns for e in episodes]))


class Untyped(Environment):
    """Answers with a truthy string for `done` (episode seed even) or a string reward (odd)."""

    def reset(self, problem):
        return list(problem.messages)

    def step(self, turn):
        if self.seed % 2:
            return [{"role": "user", "content": "Again."}], "0.5", False
        return [{"role": "user", "content": "Again."}], 0.0, "no"


@pytest.mark.slow
def test_an_untyped_step_result_fails_its_episode_instead_of_ending_it(setup):
    """Reproduction (2e1e1a6): a `step` returning done="no" ended the episode as done (any truthy value counted),
    and a reward "0.5" was converted; each now fails its episode, the error kept, the rest of the call unaffected."""
    collector = Collector(setup["backend"], None, tokenizer=setup["tok"], stop_ids=setup["stop_ids"])
    runner = EpisodeRunner(collector, Untyped, tokenizer=setup["tok"], enable_thinking=False, max_turns=TURNS,
                           max_new_tokens=CAP, max_episode_tokens=E, max_prompt_len=P)
    problems = load_problems(TASKS)[:2]
    episodes = runner.run(problems, [problem_key(p.id) for p in problems], setup["sampling"])
    errors = {e.error for e in episodes}
    assert all(e.error and e.turns == 1 and not e.done and np.isnan(e.reward) for e in episodes), errors
    assert any("done is 'no' (str); expected a bool" in x for x in errors)
    assert any("reward is '0.5' (str); expected a number" in x for x in errors)


class Flood(Environment):
    """A program that prints 20 MB."""

    def reset(self, problem):
        return list(problem.messages)

    def step(self, turn):
        return [{"role": "tool", "content": "x" * 20_000_000}], 0.0, False


class Watched:
    """The tokenizer, recording the longest text it was asked to encode."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kw):
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.slow
def test_an_observation_longer_than_the_budget_is_never_tokenised(setup):
    """Reproduction (2e1e1a6): a 20 MB observation was tokenised whole before the token budget was checked (244 s and
    5.1 GB per rollout). Now its length alone ends the episode (truncated): no text longer than the budget's reach
    reaches the tokenizer."""
    watched = Watched(setup["tok"])
    collector = Collector(setup["backend"], None, tokenizer=setup["tok"], stop_ids=setup["stop_ids"])
    runner = EpisodeRunner(collector, Flood, tokenizer=watched, enable_thinking=False, max_turns=TURNS,
                           max_new_tokens=CAP, max_episode_tokens=E, max_prompt_len=P)
    problems = load_problems(TASKS)[:2]
    episodes = runner.run(problems, [problem_key(p.id) for p in problems], setup["sampling"])
    assert all(e.truncated and e.turns == 1 and e.error is None for e in episodes)
    assert watched.longest < 10_000


@pytest.mark.slow  # a real `launchers.serve` process compiles its programs
def test_episodes_through_a_server_are_the_in_process_engines(setup, tmp_path):
    """The server backend (an OpenAI-compatible `launchers.serve` over loopback) takes the episode's ids as its
    prompt each turn: the same episodes, token for token, as the in-process engine (same keys, same slots)."""
    from jaxrl.backends import ModelSpec, ServerBackend
    from serve_fixture import Served
    base = str(Path(setup["tok"].name_or_path))
    server = Served(tmp_path, base, "--batch_size=8", f"--max_prompt_len={P + E - CAP}", f"--max_model_len={P + E}")
    try:
        backend = ServerBackend(base, url=server.url, stop_ids=setup["stop_ids"], max_prompt_len=P + E - CAP,
                                max_new_tokens=CAP)
        backend.load(ModelSpec("base", "base"))
        runner = EpisodeRunner(Collector(backend, None, tokenizer=setup["tok"], stop_ids=setup["stop_ids"]), Retry,
                               tokenizer=setup["tok"], enable_thinking=False, max_turns=TURNS, max_new_tokens=CAP,
                               max_episode_tokens=E, max_prompt_len=P)
        problems = load_problems(Path(base).parent / "p.jsonl")
        served = runner.run(problems, setup["groups"], setup["sampling"])
    finally:
        server.stop()
    assert [e.ids for e in served] == [e.ids for e in setup["episodes"]]
    assert [e.mask for e in served] == [e.mask for e in setup["episodes"]]
    assert [e.error for e in served] == [e.error for e in setup["episodes"]]
