"""Multi-turn episodes: a policy and an environment (jaxrl/algorithms/environments.py) take turns, and the episode is
ONE token sequence, trained on as it was sampled.

    runner = EpisodeRunner(collector, environment, tokenizer=tok, enable_thinking=False, max_turns=4,
                           max_new_tokens=512, max_episode_tokens=4096)
    episodes = runner.run(problems, group_ids, sampling)      # sampling.n episodes per problem, problem-major
    episodes[i].ids, .mask, .logprobs, .reward, .turns, .truncated, .error

The token-exact rule. An episode's ids are the prompt (the template's render of the environment's first
messages), then each turn's sampled ids exactly as the sampler drew them (mask 1, with the sampler's log-probs),
then each observation as an append-only delta of the chat template (mask 0; `jaxrl.data.chat.turn_delta_ids`:
the closing delimiter of the turn, the new messages, the generation prompt). The conversation is never rendered
again: a template may render history otherwise than it was sampled (Qwen3.5 drops the reasoning of assistant turns
before the last user message; a re-tokenised turn may split differently), and the policy gradient is only right
for the tokens that were sampled, in the context they were sampled in.

Sampling. On the in-process (jax) backend an episode keeps its engine slot from turn to turn (live-row
continuation, `RolloutBackend.session_engine`): its caches stay, and the next turn feeds only what the environment
appended (prefill tokens per episode = its first prompt + its observations, not the history again). Episodes run
independently: whenever a round ends, the episodes whose turn finished take their environment step (in episode
order) and their next turn is submitted before the next round, so no episode waits for the slowest turn of the
others; the schedule is still a function of the requests (no clock), so the tokens are the same every run. Over a
wire (server, vLLM) each turn is one `generate` call whose prompts are the live episodes' ids so far, as token
ids (the history is prefilled again each turn). Both give the same tokens for the same keys: the first turn of
the K episodes of a problem is one prompt x K samples keyed (seed, problem key, i), the keys of a single-turn
rollout; turn t > 0 of episode i is keyed by a group id mixed from (problem key, i, t).

Budgets: a turn is sampled only while the episode's tokens after the prompt plus `max_new_tokens` fit in
`max_episode_tokens`; an episode ends when the environment says done, after `max_turns` turns, when a turn hits
`max_new_tokens` (truncated), or when an observation would not leave room for another turn (truncated: it then
keeps the reward its environment gave so far, as a truncated completion scores 0).

`EpisodeRollouts` is `Rollouts` (jaxrl/algorithms/online/rollouts.py) sampling episodes: the same `Sampled`
arrays, rows [P + E] with E = max_episode_tokens, whose completion mask is the per-token mask.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from typing import Any, Callable, Optional, Sequence

import numpy as np
from absl import logging

from jaxrl.algorithms.environments import ENVIRONMENTS, Turn, check_messages
from jaxrl.algorithms.online.rollouts import Rollouts, Sampled, to_arrays
from jaxrl.backends import JaxBackend, RolloutBackend, SamplingParams
from jaxrl.backends.pool import make_pool
from jaxrl.data.chat import format_chat, turn_delta_ids
from jaxrl.generation.engine import Request
from jaxrl.rollout.collect import Collector


@dataclasses.dataclass
class Episode:
    """One episode of problem `problem_index` (module docstring)."""

    problem_index: int
    sample_index: int
    prompt_ids: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)  # after the prompt: sampled and environment tokens
    mask: list[int] = dataclasses.field(default_factory=list)  # 1 sampled (trained), 0 environment
    logprobs: list[float] = dataclasses.field(default_factory=list)  # the sampler's at sampled tokens, else 0
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

    @property
    def turns(self) -> int:
        return len(self.texts)

    def end(self, *, done: bool = False, truncated: bool = False) -> None:
        self.ended, self.done, self.truncated = True, done, truncated

    def fail(self, where: str, e: BaseException) -> None:
        self.error, self.reward, self.ended = f"{where}: {type(e).__name__}: {e}", float("nan"), True


def turn_group_id(group_id: int, sample_index: int, turn: int) -> int:
    """The group id turn `turn` > 0 of episode `sample_index` is keyed by (module docstring)."""
    return zlib.crc32(f"{int(group_id)}/{int(sample_index)}/{int(turn)}".encode())


class EpisodeRunner:
    """Samples episodes through a `Collector`'s backend (module docstring). `environment`: a factory
    `(**options) -> Environment`, called once per episode."""

    def __init__(self, collector: Collector, environment: Callable[..., Any], *, tokenizer, enable_thinking: bool,
                 max_turns: int, max_new_tokens: int, max_episode_tokens: int, max_prompt_len: int,
                 options: Optional[dict] = None, continue_rows: bool = True):
        if tokenizer is None:
            raise ValueError("episodes need a chat tokenizer (data.source='problems'): observations are messages")
        if max_episode_tokens < max_new_tokens:
            raise ValueError(f"max_episode_tokens={max_episode_tokens} cannot hold one turn of max_new_tokens="
                             f"{max_new_tokens}")
        self.collector, self.environment, self.tokenizer = collector, environment, tokenizer
        self.enable_thinking, self.max_turns = bool(enable_thinking), int(max_turns)
        self.max_new_tokens, self.max_episode_tokens = int(max_new_tokens), int(max_episode_tokens)
        self.max_prompt_len, self.options = int(max_prompt_len), dict(options or {})
        # live-row continuation where the backend has it (False: every turn prefills the history, to compare)
        self.continue_rows = bool(continue_rows)
        self.last_times: dict[str, float] = {}
        self.last_stats: dict[str, float] = {}  # the session engine's counters of the last run (jax backend)

    def _start(self, problem, j: int, i: int, seed: int) -> Episode:
        ep = Episode(j, i, [])
        try:
            ep.env = self.environment(**self.options)
            ep.env.seed = seed
            messages = check_messages(ep.env.reset(problem), "reset")
            ep.prompt_ids = format_chat(self.tokenizer, messages, self.enable_thinking,
                                        tools=getattr(ep.env, "tools", None))
            if len(ep.prompt_ids) > self.max_prompt_len:
                raise ValueError(f"the first prompt has {len(ep.prompt_ids)} tokens, over data.max_prompt_len="
                                 f"{self.max_prompt_len}")
        except Exception as e:  # noqa: BLE001 - the episode fails, the run goes on (module docstring)
            ep.fail("reset", e)
        return ep

    def run(self, problems: Sequence[Any], group_ids: Sequence[int], sampling: SamplingParams) -> list[Episode]:
        """`sampling.n` episodes of every problem, problem-major; `sampling.max_new_tokens` must be this runner's."""
        if int(sampling.max_new_tokens) != self.max_new_tokens:
            raise ValueError(f"sampling.max_new_tokens={sampling.max_new_tokens}, the runner's is "
                             f"{self.max_new_tokens}")
        k = int(sampling.n)
        t_sample = t_env = 0.0
        t0 = time.perf_counter()
        episodes = [self._start(p, j, i, turn_group_id(g, i, 0) ^ int(sampling.seed))
                    for j, (p, g) in enumerate(zip(problems, group_ids)) for i in range(k)]
        t_env += time.perf_counter() - t0
        engine = None
        if self.continue_rows:
            engine = self.collector.backend.session_engine(sampling.replace(n=1), len(episodes),
                                                           self.max_episode_tokens)
        if engine is not None:
            t_sample, t_live_env = self._run_live(engine, episodes, group_ids, sampling, k)
            self.last_times = {"sample_s": t_sample, "score_s": t_env + t_live_env}
            return episodes
        for turn in range(self.max_turns):
            for e in episodes:
                if not e.ended and len(e.ids) + self.max_new_tokens > self.max_episode_tokens:
                    e.end(truncated=True)
            live = [e for e in episodes if not e.ended]
            if not live:
                break
            t0 = time.perf_counter()
            gens = self._sample(live, group_ids, sampling, turn, k)
            t1 = time.perf_counter()
            t_sample += t1 - t0
            for e, g in zip(live, gens):
                self._advance(e, g, turn)
            t_env += time.perf_counter() - t1
        self.last_times = {"sample_s": t_sample, "score_s": t_env}
        return episodes

    def _run_live(self, engine, episodes: list[Episode], group_ids, sampling: SamplingParams, k: int
                  ) -> tuple[float, float]:
        """Every episode through one session engine (module docstring, "Sampling"); (sampling s, environment s)."""
        order = {id(e): n for n, e in enumerate(episodes)}
        shared = {id(e) for _, es in _shared_first_prompts([e for e in episodes if not e.ended], k) for e in es}
        pending: dict[int, tuple[Episode, Any, int]] = {}

        def submit(e: Episode, turn: int) -> None:
            g = group_ids[e.problem_index]
            first = turn == 0 and id(e) in shared
            request = Request(e.prompt_ids + e.ids, group_id=g if first else turn_group_id(g, e.sample_index, turn),
                              sample_index=e.sample_index if first else 0, seed=int(sampling.seed),
                              max_new_tokens=self.max_new_tokens, temperature=float(sampling.temperature),
                              top_p=float(sampling.top_p), top_k=int(sampling.top_k),
                              prompt_key=("problem", e.problem_index) if first else None,
                              session=order[id(e)], session_tokens=self.max_episode_tokens)
            pending[id(e)] = (e, engine.submit(request), turn)

        t_sample = t_env = 0.0
        for e in episodes:
            if not e.ended:
                submit(e, 0)
        while pending:
            t0 = time.perf_counter()
            if engine.idle:
                raise RuntimeError(f"the session engine went idle with {len(pending)} episode turns unfinished")
            engine.step()
            t1 = time.perf_counter()
            for e, ticket, turn in sorted((v for v in pending.values() if v[1].done), key=lambda v: order[id(v[0])]):
                del pending[id(e)]
                self._advance(e, ticket.wait(), turn)
                if e.ended:
                    engine.end_session(order[id(e)])
                else:
                    submit(e, turn + 1)
            t_sample += t1 - t0
            t_env += time.perf_counter() - t1
        self.last_stats = dict(engine.stats)
        engine.release()
        return t_sample, t_env

    def _sample(self, live: list[Episode], group_ids, sampling: SamplingParams, turn: int, k: int):
        """One generation per live episode, in `live` order."""
        if turn == 0:
            # the K episodes of a problem share their first prompt when the environment gave them the same: one
            # prompt x K samples, the single-turn rollout's keys (and one prefill)
            shared = _shared_first_prompts(live, k)
            out: dict[int, Any] = {}
            if shared:
                gens = self.collector.generate([es[0].prompt_ids for _, es in shared],
                                               [group_ids[j] for j, _ in shared], sampling)
                for g in gens:
                    out[id(shared[g.prompt_index][1][g.sample_index])] = g
            rest = [e for e in live if id(e) not in out]
        else:
            out, rest = {}, live
        if rest:
            gens = self.collector.generate([e.prompt_ids + e.ids for e in rest],
                                           [turn_group_id(group_ids[e.problem_index], e.sample_index, turn)
                                            for e in rest],
                                           sampling.replace(n=1))
            for g in gens:
                out[id(rest[g.prompt_index])] = g
        return [out[id(e)] for e in live]

    def _advance(self, e: Episode, g, turn: int) -> None:
        """Append turn `turn`'s generation `g`, ask the environment, append its observation (or end)."""
        tokens = [int(t) for t in g.tokens]
        logprobs = list(g.logprobs) if g.logprobs is not None else [0.0] * len(tokens)
        e.ids += tokens
        e.mask += [1] * len(tokens)
        e.logprobs += [float(x) for x in logprobs[:len(tokens)]]
        text = self.collector.decode(tokens)
        e.texts.append(text)
        capped = g.finish_reason == "length"
        last = (turn + 1 >= self.max_turns or capped
                or len(e.ids) + self.max_new_tokens > self.max_episode_tokens)
        try:
            messages, reward, done = e.env.step(Turn(text, tuple(tokens), g.finish_reason, turn, last))
            reward = float(reward)
            if not math.isfinite(reward):
                raise ValueError(f"reward {reward} is not finite")
            messages = check_messages(messages, "step")
        except Exception as err:  # noqa: BLE001 - the episode fails, the run goes on
            e.fail(f"step {turn}", err)
            return
        e.reward += reward
        e.rewards.append(reward)
        solved = getattr(e.env, "solved", None)
        e.solved = bool(solved) if solved is not None else e.reward >= 1.0
        # an environment may un-solve (a later answer breaks a passing one): only a solve that lasts counts
        e.solved_turn = (e.solved_turn or turn + 1) if e.solved else None
        if done or last:
            e.end(done=bool(done), truncated=capped)
            return
        stop = tokens[-1] if g.finish_reason == "stop" and tokens else None
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


def _shared_first_prompts(live: Sequence[Episode], k: int) -> list[tuple[int, list[Episode]]]:
    """(problem index, its K episodes) for the problems whose K episodes all start from the same prompt: their
    first turns are one prompt x K samples (one prefill), keyed as a single-turn rollout's."""
    by_problem: dict[int, list[Episode]] = {}
    for e in live:
        by_problem.setdefault(e.problem_index, []).append(e)
    return [(j, es) for j, es in by_problem.items()
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


class EpisodeRollouts(Rollouts):
    """`Rollouts` whose rows are episodes (module docstring): `sampling.environment` (a name of
    jaxrl.algorithms.environments.ENVIRONMENTS or a plug-in), `environment_options`, `max_turns`,
    `max_episode_tokens` (E: the row width after the prompt)."""

    def __init__(self, config, model, mesh, *, prompts_per_rollout: int, sampling):
        super().__init__(config, model, mesh, prompts_per_rollout=prompts_per_rollout, sampling=sampling)
        if self.source.tokenizer is None:
            raise ValueError(f"{config.algorithm}.environment={sampling.environment!r} needs data.source='problems' "
                             "(a chat tokenizer: observations are messages)")
        self.environment = ENVIRONMENTS.get(sampling.environment)
        self.options = dict(sampling.environment_options)
        self.max_turns, self.max_episode_tokens = int(sampling.max_turns), int(sampling.max_episode_tokens)
        self.enable_thinking = config.data.enable_thinking
        self.runner: Optional[EpisodeRunner] = None
        self.last_episodes: list[Episode] = []

    def open(self, workdir: str, model) -> None:
        """The backend, for prompts up to P + E - max_new_tokens tokens (the last turn's history)."""
        if self.collector is not None:
            return
        longest = self.prompt_length() + self.max_episode_tokens - self.max_new_tokens
        if self.backend_name == "jax":
            backend: RolloutBackend = JaxBackend(model=model, dtype=None, batch_size=self.batch_size,
                                                 max_prompt_len=longest, stop_ids=self.stop_ids, pad_id=self.pad_id,
                                                 mesh=self.mesh)
        else:
            backend = make_pool(self.block, model_path=self.model_path, dtype=self.dtype, seed=self.seed,
                                workdir=workdir, stop_ids=self.stop_ids, max_prompt_len=longest,
                                max_new_tokens=self.max_new_tokens, lora_rank=self.lora_rank)
        self.collector = Collector(backend, self.reward, tokenizer=self.source.tokenizer, stop_ids=self.stop_ids)
        self.runner = EpisodeRunner(self.collector, self.environment, tokenizer=self.source.tokenizer,
                                    enable_thinking=self.enable_thinking, max_turns=self.max_turns,
                                    max_new_tokens=self.max_new_tokens, max_episode_tokens=self.max_episode_tokens,
                                    max_prompt_len=self.max_prompt_len, options=self.options)

    def run(self, model, rollout: int, draw: int = 0) -> Sampled:
        if self.collector is None:
            raise RuntimeError("EpisodeRollouts.run before open(workdir, model) (the task's setup opens it)")
        _, problems, group_ids = (self.source.prompts(rollout, self.prompts_per_rollout) if draw == 0 else
                                  self.source.extra_prompts(rollout, draw, self.prompts_per_rollout))
        served, seconds = self.sync(self._policy(model, rollout))
        episodes = self.runner.run(problems, group_ids, self.sampling.replace(seed=self.sample_seed(rollout, draw)))
        for e in episodes:
            if e.error:
                logging.warning("rollout %d: episode %d of problem %s failed: %s", rollout, e.sample_index,
                                getattr(problems[e.problem_index], "id", e.problem_index), e.error)
        self.last_episodes = episodes
        return episodes_to_sampled(episodes, self.max_prompt_len, self.max_episode_tokens, self.pad_id,
                                   times={**self.runner.last_times, **({"adapter_sync_s": seconds} if served else {})},
                                   adapter=dict(self.last_sync))


def turn_reward_row(e: Episode, width: int) -> np.ndarray:
    """[width]: the reward of each turn's step at that turn's last sampled token (the end of the turn's run of mask
    1s), 0 elsewhere; the row sums to `e.reward`."""
    row = np.zeros(width, np.float32)
    ends = [i for i, m in enumerate(e.mask) if m and (i + 1 == len(e.mask) or not e.mask[i + 1])]
    for k, reward in enumerate(e.rewards):
        if ends:  # a turn of no tokens has no run of its own: its reward joins the last one's
            row[ends[min(k, len(ends) - 1)]] += reward
    return row


def episodes_to_sampled(episodes: Sequence[Episode], max_prompt_len: int, max_episode_tokens: int, pad_id: int,
                        times: dict, adapter: Optional[dict] = None) -> Sampled:
    """The rollout arrays of episodes (jaxrl/algorithms/online/rollouts.py layout, C = max_episode_tokens): the
    completion mask is the per-token mask, the behaviour log-probs 0 at environment tokens. A failed episode keeps
    its prompt and whatever it sampled, reward NaN (masked from the loss)."""
    # a failed reset has no prompt: one pad token keeps its row a real sequence (an all-padding row's attention
    # has nothing to attend to); its reward is NaN and its mask 0, so it trains nothing
    prompts = [e.prompt_ids or [pad_id] for e in episodes]
    arrays = to_arrays(prompts, [e.ids for e in episodes], [e.logprobs for e in episodes], range(len(episodes)),
                       max_prompt_len, max_episode_tokens, pad_id)
    turn_rewards = np.zeros_like(arrays["completion_mask"])
    for i, e in enumerate(episodes):
        arrays["completion_mask"][i, :len(e.mask)] = np.asarray(e.mask, np.float32)
        if e.error is None:
            turn_rewards[i] = turn_reward_row(e, max_episode_tokens)
    return Sampled(**arrays, turn_rewards=turn_rewards,
                   lengths=np.asarray([sum(e.mask) for e in episodes], np.int32),
                   truncated=np.asarray([e.truncated for e in episodes], bool),
                   rewards=np.asarray([e.reward for e in episodes], np.float32),
                   strict=np.asarray([float(e.solved) for e in episodes], np.float32),
                   prompt_lengths=np.asarray([len(p) for p in prompts], np.int32), times=dict(times),
                   adapter=dict(adapter or {}), episode=episode_metrics(episodes))
