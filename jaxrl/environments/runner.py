"""Episodes: a policy and an environment (jaxrl/environments/base.py) take turns, and the episode is ONE token
sequence, trained on as it was sampled. A single-turn rollout is a one-turn episode through the same loop, without
an environment: its turn is scored by the collector's reward, all of a call's turns at once.

    runner = EpisodeRunner(collector, environment, tokenizer=tok, enable_thinking=False, max_turns=4,
                           max_new_tokens=512, max_episode_tokens=4096, max_prompt_len=2048)
    episodes = runner.run(problems, group_ids, sampling)      # sampling.n episodes per problem, problem-major
    episodes[i].ids, .mask, .logprobs, .reward, .turns, .truncated, .error
    single = EpisodeRunner(collector, None, tokenizer=tok, enable_thinking=False, max_turns=1, max_new_tokens=C,
                           max_episode_tokens=C, max_prompt_len=P).run(problems, group_ids, sampling, prompts=ids)

The token-exact rule. An episode's ids are the prompt (the template's render of the environment's first
messages), then each turn's sampled ids exactly as the sampler drew them (mask 1, with the sampler's log-probs),
then each observation as an append-only delta of the chat template (mask 0; `jaxrl.data.chat.turn_delta_ids`:
the closing delimiter of the turn, the new messages, the generation prompt). The conversation is never rendered
again: a template may render history otherwise than it was sampled (Qwen3.5 drops the reasoning of assistant turns
before the last user message; a re-tokenised turn may split differently), and the policy gradient is only right
for the tokens that were sampled, in the context they were sampled in.

Sampling: one loop for every backend. The runner hands the backend each episode's first turn as a `RowRequest`
(jaxrl.backends.base) and, whenever a turn finishes, takes the environment's step and hands it the next turn of
that episode (`RolloutBackend.generate_rows`). A row whose next turn will continue it carries its `session`: the jax
backend keeps its slot with its caches, so the next turn feeds only what the environment appended (prefill tokens
per episode = its first prompt + its observations, not the history again), and episodes run independently (no
episode waits for the slowest turn of the others); a server gets each turn's whole history as token ids (a wave of
turns at a time). Every backend gives the same tokens for the same keys: the first turn of the K episodes of a
problem is one prompt x K samples keyed (seed, problem key, i), the keys of a single-turn rollout; turn t > 0 of
episode i is keyed by a group id mixed from (problem key, i, t).

Budgets: a turn is sampled only while the episode's tokens after the prompt plus `max_new_tokens` fit in
`max_episode_tokens`; an episode ends when the environment says done, after `max_turns` turns, when a turn hits
`max_new_tokens` (truncated), or when an observation would not leave room for another turn (truncated: it then
keeps the reward its environment gave so far, as a truncated completion scores 0; an observation with more
characters than the tokens left could hold is not tokenised at all).

Environments that hang: every environment call (construct and `reset`, each `step`) runs on an environment thread
of the sampling thread and is waited for at most `step_timeout_s` (jaxrl/environments/limits.py): past it the
episode fails with an error naming the environment and the limit, its environment object is not used again (the
call is left on an abandoned daemon thread), and the others go on; a progress line every `progress_every_s` while a
call runs long; SIGINT / SIGTERM stop the wait (`Interrupted`: the Trainer keeps its last finished step).

Token versions (partial rollouts): each sampled token keeps the adapter digest the backend reports it was sampled
with (`Episode.digests`; None for observation tokens), so a turn sampled after the trainer published a new policy
carries that version.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from typing import Any, Callable, Optional, Sequence

from jaxrl.backends.base import Generation, RowRequest, SamplingParams
from jaxrl.data.chat import format_chat, turn_delta_ids
from jaxrl.environments.base import Turn, as_environment, check_messages, check_step_result
from jaxrl.environments.limits import PROGRESS_EVERY_S, STEP_TIMEOUT_S, EnvironmentThread, check_step_timeout
from jaxrl.rewards.base import RewardResult
from jaxrl.rollout.collect import Collector

__all__ = ["Episode", "EpisodeRunner", "episode_metrics", "turn_group_id"]


@dataclasses.dataclass
class Episode:
    """One episode of problem `problem_index` (module docstring)."""

    problem_index: int
    sample_index: int
    prompt_ids: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)  # after the prompt: sampled and environment tokens
    mask: list[int] = dataclasses.field(default_factory=list)  # 1 sampled (trained), 0 environment
    logprobs: list[float] = dataclasses.field(default_factory=list)  # the sampler's at sampled tokens, else 0
    digests: list = dataclasses.field(default_factory=list)  # the adapter digest of each sampled token, else None
    texts: list[str] = dataclasses.field(default_factory=list)  # each turn's text
    observations: list[list[dict]] = dataclasses.field(default_factory=list)  # what the environment answered
    reward: float = 0.0  # the sum of the environment's rewards; NaN when the episode failed
    rewards: list[float] = dataclasses.field(default_factory=list)  # what each turn's step gave (evaluation shows it)
    solved: bool = False
    solved_turn: Optional[int] = None  # 1-based turn from which `solved` held to the end (evaluation's within-t)
    done: bool = False  # the environment ended it
    truncated: bool = False  # a turn hit its cap, or the token budget cut it
    error: Optional[str] = None  # the environment's exception: the episode failed
    ended: bool = False
    env: Any = None
    result: Optional[RewardResult] = None  # a single-turn episode: its reward's result
    finish_reason: str = ""  # the last turn's

    @property
    def turns(self) -> int:
        return len(self.texts)

    @property
    def tokens(self) -> list[int]:
        """The sampled tokens of every turn (a single-turn episode: its completion)."""
        return [t for t, m in zip(self.ids, self.mask) if m]

    def end(self, *, done: bool = False, truncated: bool = False) -> None:
        self.ended, self.done, self.truncated = True, done, truncated

    def fail(self, where: str, e: BaseException) -> None:
        self.error, self.reward, self.ended = f"{where}: {type(e).__name__}: {e}", float("nan"), True


def turn_group_id(group_id: int, sample_index: int, turn: int) -> int:
    """The group id turn `turn` > 0 of episode `sample_index` is keyed by (module docstring)."""
    return zlib.crc32(f"{int(group_id)}/{int(sample_index)}/{int(turn)}".encode())


class EpisodeRunner:
    """Samples episodes through a `Collector`'s backend (module docstring). `environment`: a factory
    `(**options) -> Environment`, called once per episode, or None: single-turn episodes of given prompts, scored
    by the collector's reward. `continue_rows`: live-row continuation where the backend has it (False: every turn
    prefills the history, to compare). `step_timeout_s`: the limit of one environment call (0 = none), with a
    progress line every `progress_every_s` while one runs (module docstring). `last_times` / `last_stats` (the
    backend's counters of the last run, e.g. the jax session engine's `engine/*`) are those of the calling
    thread's last `run`."""

    def __init__(self, collector: Collector, environment: Optional[Callable[..., Any]], *, tokenizer,
                 enable_thinking: bool, max_turns: int, max_new_tokens: int, max_episode_tokens: int,
                 max_prompt_len: int, options: Optional[dict] = None, continue_rows: bool = True,
                 step_timeout_s: float = STEP_TIMEOUT_S, progress_every_s: float = PROGRESS_EVERY_S):
        if environment is not None and tokenizer is None:
            raise ValueError("episodes need a chat tokenizer (data.source='problems'): observations are messages")
        if max_episode_tokens < max_new_tokens:
            raise ValueError(f"max_episode_tokens={max_episode_tokens} cannot hold one turn of max_new_tokens="
                             f"{max_new_tokens}")
        # a class given directly (not through the registry) gets the protocol's attributes too
        if isinstance(environment, type):
            environment = as_environment(environment)
        self.collector, self.environment, self.tokenizer = collector, environment, tokenizer
        self.enable_thinking, self.max_turns = bool(enable_thinking), int(max_turns)
        self.max_new_tokens, self.max_episode_tokens = int(max_new_tokens), int(max_episode_tokens)
        self.max_prompt_len, self.options = int(max_prompt_len), dict(options or {})
        self.continue_rows = bool(continue_rows)
        check_step_timeout("step_timeout_s", step_timeout_s)
        self.step_timeout_s, self.progress_every_s = float(step_timeout_s), float(progress_every_s)
        self._local = threading.local()
        # the longest token's text: an observation longer than (tokens left + 1) x this cannot fit, whatever its ids
        self._max_token_chars = (max((len(t) for t in tokenizer.get_vocab()), default=1)
                                 if environment is not None else 1)

    @property
    def last_times(self) -> dict:
        return getattr(self._local, "times", {})

    @property
    def last_stats(self) -> dict:
        return getattr(self._local, "stats", {})

    def _environment_calls(self) -> EnvironmentThread:
        """The calling thread's environment thread: every environment call of its episodes runs there."""
        calls = getattr(self._local, "calls", None)
        if calls is None:
            name = getattr(self.environment, "__name__", type(self.environment).__name__)
            calls = self._local.calls = EnvironmentThread(name, self.step_timeout_s, self.progress_every_s)
        return calls

    def _open(self, ep: Episode, problem, seed: int) -> list[dict]:
        """Episode `ep`'s environment, made and reset (on the environment thread): its first messages."""
        ep.env = self.environment(**self.options)
        ep.env.seed = seed
        return check_messages(ep.env.reset(problem), "reset")

    def _start(self, problem, j: int, i: int, seed: int) -> Episode:
        ep = Episode(j, i, [])
        try:
            messages = self._environment_calls().call("reset", self._open, ep, problem, seed)
            ep.prompt_ids = format_chat(self.tokenizer, messages, self.enable_thinking, tools=ep.env.tools)
            if len(ep.prompt_ids) > self.max_prompt_len:
                raise ValueError(f"the first prompt has {len(ep.prompt_ids)} tokens, over data.max_prompt_len="
                                 f"{self.max_prompt_len}")
        except Exception as e:  # noqa: BLE001 - the episode fails, the run goes on (module docstring)
            ep.fail("reset", e)
        return ep

    def run(self, problems: Sequence[Any], group_ids: Sequence[int], sampling: SamplingParams,
            prompts: Optional[Sequence[Sequence[int]]] = None) -> list[Episode]:
        """`sampling.n` episodes of every problem, problem-major; `sampling.max_new_tokens` must be this runner's.
        Without an environment, `prompts` (one per problem, token ids) are the episodes' first prompts."""
        if int(sampling.max_new_tokens) != self.max_new_tokens:
            raise ValueError(f"sampling.max_new_tokens={sampling.max_new_tokens}, the runner's is "
                             f"{self.max_new_tokens}")
        if (prompts is None) == (self.environment is None):
            raise ValueError("EpisodeRunner.run: prompts are given exactly when there is no environment (single-turn)")
        k = int(sampling.n)
        t0 = time.perf_counter()
        if self.environment is None:
            episodes = [Episode(j, i, list(prompts[j])) for j in range(len(problems)) for i in range(k)]
        else:
            episodes = [self._start(p, j, i, turn_group_id(g, i, 0) ^ int(sampling.seed))
                        for j, (p, g) in enumerate(zip(problems, group_ids)) for i in range(k)]
        t_env = time.perf_counter() - t0
        live = [e for e in episodes if not e.ended]
        shared = {id(e) for es in _shared_first_prompts(live, k) for e in es}
        of_row: dict[int, tuple[Episode, int]] = {}  # id(row) -> (its episode, its turn)
        order = {id(e): n for n, e in enumerate(episodes)}

        def row_of(e: Episode, turn: int) -> RowRequest:
            g = group_ids[e.problem_index]
            first = turn == 0 and id(e) in shared
            row = RowRequest(tuple(e.prompt_ids + e.ids), g if first else turn_group_id(g, e.sample_index, turn),
                             e.sample_index if first else 0,
                             session=order[id(e)] if self.environment is not None else None,
                             prompt_key=("problem", e.problem_index) if first else None)
            of_row[id(row)] = (e, turn)
            return row

        env_seconds = [t_env]

        def then(row: RowRequest, g: Generation) -> Optional[RowRequest]:
            e, turn = of_row.pop(id(row))
            t = time.perf_counter()
            self._advance(e, g, turn)
            env_seconds[0] += time.perf_counter() - t
            return None if e.ended else row_of(e, turn + 1)

        rows = [row_of(e, 0) for e in live]
        session_tokens = self.max_episode_tokens if self.continue_rows and self.environment is not None else 0
        stats = self.collector.backend.generate_rows(rows, sampling.replace(n=1), then=then,
                                                     session_tokens=session_tokens) if rows else {}
        if self.environment is None:
            t = time.perf_counter()
            self._score(episodes, problems)
            env_seconds[0] += time.perf_counter() - t
        self._local.times = {"sample_s": float(stats.get("sample_s", 0.0)), "score_s": env_seconds[0]}
        self._local.stats = {k[len("engine/"):]: v for k, v in stats.items() if k.startswith("engine/")}
        return episodes

    def _advance(self, e: Episode, g: Generation, turn: int) -> None:
        """Append turn `turn`'s generation `g`, ask the environment, append its observation (or end)."""
        tokens = [int(t) for t in g.tokens]
        logprobs = list(g.logprobs) if g.logprobs is not None else [0.0] * len(tokens)
        digests = list(g.token_digests) if g.token_digests is not None else [None] * len(tokens)
        e.ids += tokens
        e.mask += [1] * len(tokens)
        e.logprobs += [float(x) for x in logprobs[:len(tokens)]]
        e.digests += digests[:len(tokens)] + [None] * max(0, len(tokens) - len(digests))
        e.finish_reason = g.finish_reason
        text = self.collector.decode(tokens)
        e.texts.append(text)
        capped = g.finish_reason == "length"
        if self.environment is None:  # single-turn: scored with the others of the call (`_score`)
            e.end(truncated=capped)
            return
        last = (turn + 1 >= self.max_turns or capped
                or len(e.ids) + self.max_new_tokens > self.max_episode_tokens)
        try:
            messages, reward, done = check_step_result(self._environment_calls().call(
                f"step {turn}", e.env.step, Turn(text, tuple(tokens), g.finish_reason, turn, last)))
        except Exception as err:  # noqa: BLE001 - the episode fails, the run goes on
            e.fail(f"step {turn}", err)
            return
        e.reward += reward
        e.rewards.append(reward)
        e.solved = bool(e.env.solved) if e.env.solved is not None else e.reward >= 1.0
        # an environment may un-solve (a later answer breaks a passing one): only a solve that lasts counts
        e.solved_turn = (e.solved_turn or turn + 1) if e.solved else None
        if done or last:
            e.end(done=bool(done), truncated=capped)
            return
        stop = tokens[-1] if g.finish_reason == "stop" and tokens else None
        room = self.max_episode_tokens - len(e.ids) - self.max_new_tokens
        if sum(len(m["content"]) for m in messages) > (room + 1) * self._max_token_chars:
            e.end(truncated=True)  # more text than the tokens left could hold: not tokenised at all (20 MB of output)
            return
        try:
            delta = turn_delta_ids(self.tokenizer, messages, self.enable_thinking, stop_id=stop)
        except Exception as err:  # noqa: BLE001 - a message the template refuses fails this episode
            e.fail(f"observation {turn}", err)
            return
        if len(e.ids) + len(delta) + self.max_new_tokens > self.max_episode_tokens:
            e.end(truncated=True)  # no room for another turn after it: the budget ends the episode
            return
        e.observations.append(messages)
        e.ids += delta
        e.mask += [0] * len(delta)
        e.logprobs += [0.0] * len(delta)
        e.digests += [None] * len(delta)

    def _score(self, episodes: Sequence[Episode], problems: Sequence[Any]) -> None:
        """Single-turn episodes: every completion scored by the collector's reward in one call (problem-major)."""
        generations = [Generation(e.tokens, e.finish_reason, e.problem_index, e.sample_index) for e in episodes]
        for e, sample in zip(episodes, self.collector.score(generations, problems, [e.texts[0] for e in episodes])):
            e.result = sample.result
            e.solved = bool(sample.result.strict)


def _shared_first_prompts(live: Sequence[Episode], k: int) -> list[list[Episode]]:
    """The K episodes of each problem whose K episodes all start from the same prompt: their first turns are one
    prompt x K samples (one prefill), keyed as a single-turn rollout's."""
    by_problem: dict[int, list[Episode]] = {}
    for e in live:
        by_problem.setdefault(e.problem_index, []).append(e)
    return [es for es in by_problem.values()
            if len(es) == k and all(e.prompt_ids == es[0].prompt_ids for e in es)
            and [e.sample_index for e in es] == list(range(k))]


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """episode/* host metrics of one rollout."""
    n = max(1, len(episodes))
    return {"episode/turns_mean": sum(e.turns for e in episodes) / n,
            "episode/truncated_fraction": sum(e.truncated for e in episodes) / n,
            "episode/tokens_mean": sum(len(e.ids) for e in episodes) / n,
            "episode/sampled_tokens_mean": sum(sum(e.mask) for e in episodes) / n,
            "episode/failed_fraction": sum(e.error is not None for e in episodes) / n,
            "episode/solved_fraction": sum(e.solved for e in episodes) / n}
