"""THE generation path of every consumer: token-id prompts -> a backend -> one decoding of texts -> scoring.

    collector = Collector(backend, reward, tokenizer=tok, stop_ids=stop_ids)
    samples = collector.collect(prompt_ids, [problem_key(p.id) for p in problems], problems,
                                SamplingParams(n=8, max_new_tokens=4096, temperature=1.0, seed=0))
    samples[i].text, samples[i].result.partial, samples[i].tokens, samples[i].logprobs, samples[i].finish_reason

Offline rollouts (`jaxrl.rollout.runner`), online GRPO/PPO (`jaxrl.algorithms.online`) and evaluation
(`jaxrl.evaluation.runner`) all go through `Collector`, so training and evaluation score the same text for the
same tokens. The text of a completion is the stopping rule's (`jaxrl.generation.stopping.completion_text`: the
final stop id dropped, special tokens skipped; the rewards strip reasoning themselves).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

from jaxrl.backends.base import Generation, RolloutBackend, SamplingParams
from jaxrl.generation.stopping import completion_text
from jaxrl.rewards.base import RewardResult, close_reward


@dataclasses.dataclass
class Sample:
    """One decoded, scored completion of prompt `prompt_index` (an index into the prompts given to collect)."""

    prompt_index: int
    sample_index: int
    tokens: list[int]  # generated ids, up to and including the stop token
    finish_reason: str  # "stop" | "length"
    text: str  # completion_text(tokens)
    result: RewardResult
    logprobs: Optional[list[float]] = None  # per generated token under the sampled model (when the backend has them)
    token_digests: Optional[list] = None  # per generated token, the adapter digest that sampled it (when reported)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class Collector:
    """A backend, a reward and the decoding rule, used together (module docstring).

    `last_times` holds the seconds of the last `collect` call of the calling thread: {"sample_s", "score_s"}
    (partial rollouts collect several rollouts at once, one thread each). Scoring is one call at a time: a reward
    (a verifier's sandbox pool) is not shared between threads.
    """

    def __init__(self, backend: RolloutBackend, reward, *, tokenizer: Any = None, stop_ids: Sequence[int] = ()):
        self.backend, self.reward, self.tokenizer = backend, reward, tokenizer
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self._local = threading.local()
        self._score_lock = threading.Lock()

    @property
    def last_times(self) -> dict[str, float]:
        return getattr(self._local, "times", {})

    @last_times.setter
    def last_times(self, value: dict[str, float]) -> None:
        self._local.times = value

    def decode(self, tokens: Sequence[int]) -> str:
        return completion_text(self.tokenizer, tokens, self.stop_ids)

    def generate(self, prompts: Sequence[Sequence[int]], group_ids: Sequence[int],
                 sampling: SamplingParams) -> list[Generation]:
        if len(prompts) != len(group_ids):
            raise ValueError(f"{len(prompts)} prompts but {len(group_ids)} group ids")
        if not prompts:
            return []
        return self.backend.generate(prompts, group_ids, sampling)

    def score(self, generations: Sequence[Generation], problems: Sequence[Any],
              texts: Optional[Sequence[str]] = None) -> list[Sample]:
        """Decodes and scores generations; `problems[g.prompt_index]` is what generation g answers. `texts`: their
        decoded texts, when the caller has them (`decode` of the same tokens)."""
        texts = [self.decode(g.tokens) for g in generations] if texts is None else list(texts)
        results = []
        if generations:
            with self._score_lock:
                results = self.reward.score(texts, [problems[g.prompt_index] for g in generations],
                                            truncated=[g.finish_reason for g in generations])
        return [Sample(g.prompt_index, int(g.sample_index), list(g.tokens), g.finish_reason, text, result,
                       g.logprobs, g.token_digests) for g, text, result in zip(generations, texts, results)]

    def collect(self, prompts: Sequence[Sequence[int]], group_ids: Sequence[int], problems: Sequence[Any],
                sampling: SamplingParams, *,
                wanted: Optional[Callable[[int, int], bool]] = None) -> list[Sample]:
        """Samples `sampling.n` completions of every prompt, decodes and scores them; prompt-major order.

        group_ids: the key of each prompt's random stream (`jaxrl.rollout.keys.problem_key` of its problem id).
        wanted(prompt_index, sample_index): keep only these samples (a resumed run skips what is on disk;
          the others are still drawn, since all of a prompt's samples are decoded together, but not scored).
        """
        if len(problems) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(problems)} problems")
        t0 = time.perf_counter()
        gens = self.generate(prompts, group_ids, sampling)
        if wanted is not None:
            gens = [g for g in gens if wanted(g.prompt_index, g.sample_index)]
        t1 = time.perf_counter()
        samples = self.score(gens, problems)
        self.last_times = {"sample_s": t1 - t0, "score_s": time.perf_counter() - t1}
        return samples

    def stream(self, prompts: Sequence[Sequence[int]], group_ids: Sequence[int], problems: Sequence[Any],
               sampling: SamplingParams, *, chunk: int,
               wanted: Optional[Callable[[int, int], bool]] = None) -> Iterator[tuple[int, list[Sample]]]:
        """`collect` over all prompts as one stream: (first prompt index, samples) of `chunk` prompts at a time, in
        prompt order, each chunk scored once it is whole while the backend goes on with the next prompts where it
        can (`JaxBackend.stream`). Sample prompt indices refer to `prompts`."""
        if len(problems) != len(prompts) or len(group_ids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts, {len(group_ids)} group ids, {len(problems)} problems")
        if not prompts:
            return
        gens: list[Generation] = []
        start = 0
        t0 = time.perf_counter()
        for j, rows in self.backend.stream(prompts, group_ids, sampling, prompts_per_call=chunk):
            gens.extend(g for g in rows if wanted is None or wanted(g.prompt_index, g.sample_index))
            if j + 1 - start < chunk and j + 1 < len(prompts):
                continue
            t1 = time.perf_counter()
            samples = self.score(gens, problems)
            self.last_times = {"sample_s": t1 - t0, "score_s": time.perf_counter() - t1}
            yield start, samples
            gens, start, t0 = [], j + 1, time.perf_counter()

    def close(self) -> None:
        """Closes the reward (its sandboxes: a plug-in reward may hold none) and the backend."""
        close_reward(self.reward)
        self.backend.close()
