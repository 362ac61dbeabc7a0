"""The prompts of online GRPO / PPO rollouts and their reward: rollout r's prompts are a function of (seed, r), so a
rollout made again from the same parameters is the same (what resume relies on).

    source, stop_ids, pad_id = make_prompt_source(config.data, model, seed=..., model_path=..., max_new_tokens=...)
    ids, problems, group_ids = source.prompts(rollout, count)
    reward, field = make_reward(config.reward)
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from absl import logging

from jaxrl.data.chat import chat_stop_ids, encode_prompts, load_tokenizer
from jaxrl.data.problems import load_problems
from jaxrl.data.stream import epoch_stream
from jaxrl.rewards import get_reward
from jaxrl.rewards.toy import TokenTask
from jaxrl.rollout.keys import group_keys
from jaxrl.algorithms.online.difficulty import Difficulty
from jaxrl.algorithms.online.settings import OnlineDataConfig
from jaxrl.rewards.settings import RewardConfig


class PromptSource:
    """Prompts of rollout r: `prompts(r, count) -> (ids, problems, group_ids)` (a function of (seed, r), and with
    the curriculum of the record before it). `tokenizer` decodes completions for the reward (None: token-id text,
    `jaxrl.rewards.toy.token_text`). `longest()`: the most tokens any rollout's prompt can have (the sampler's one
    prompt length). `difficulty`: each prompt's record, for a pool (None for the token task)."""

    tokenizer = None
    difficulty: Optional[Difficulty] = None
    pool: list = []

    def prompts(self, rollout: int, count: int):
        raise NotImplementedError

    def extra_prompts(self, rollout: int, draw: int, count: int):
        """`count` more prompts for rollout r's extra draw `draw` >= 1 (GRPO dynamic sampling): a function of
        (seed, r, draw), so a resumed run redraws them."""
        raise NotImplementedError(f"{type(self).__name__} has no extra draws (grpo.dynamic_sampling)")

    def longest(self) -> int:
        raise NotImplementedError


class TokenTaskPrompts(PromptSource):
    def __init__(self, task: TokenTask, seed: int):
        self.task, self.seed = task, seed

    def prompts(self, rollout: int, count: int):
        ids, problems = self.task.prompts(self.seed, rollout, count)
        return ids, problems, group_keys(p["id"] for p in problems)

    def extra_prompts(self, rollout: int, draw: int, count: int):
        seed = int(np.random.SeedSequence([self.seed, rollout, draw, 6761]).generate_state(1)[0])
        ids, problems = self.task.prompts(seed, rollout, count)
        for j, p in enumerate(problems):
            p["id"] = f"token_task/{rollout}/draw{draw}/{j}"
        return ids, problems, group_keys(p["id"] for p in problems)

    def longest(self) -> int:
        return self.task.prompt_len


class ProblemPrompts(PromptSource):
    """problems.jsonl -> chat-templated prompt ids; rollout r takes positions r*count ... of the stream of
    epoch-wise seeded permutations of the (kept) problems."""

    def __init__(self, path: str, tokenizer, *, enable_thinking: bool, max_prompt_len: int, on_overlong: str,
                 seed: int, difficulty: Optional[Difficulty] = None, curriculum: bool = False):
        if not path:
            raise ValueError("data.problems is empty: set it to a problems.jsonl (or data.source='token_task')")
        problems = load_problems(path)
        enc = encode_prompts(tokenizer, [p.messages for p in problems], enable_thinking, max_prompt_len,
                             on_overlong=on_overlong, names=[p.id for p in problems])
        for i, n in enc.skipped:
            logging.warning("skipping problem %s: %d prompt tokens > data.max_prompt_len=%d", problems[i].id, n,
                            max_prompt_len)
        if not enc.ids:
            raise ValueError(f"{path}: no problem fits data.max_prompt_len={max_prompt_len}")
        self.problems = [problems[i] for i in enc.kept]
        self.ids = enc.ids
        self.skipped = len(enc.skipped)
        self.tokenizer, self.seed = tokenizer, seed
        # each prompt's record (jaxrl.algorithms.online.difficulty); with the curriculum it also draws the prompts
        self.difficulty, self.curriculum = difficulty, curriculum
        self.pool = [str(p.id) for p in self.problems]
        logging.info("%s: %d problems (%d skipped as over-long)", path, len(self.problems), self.skipped)

    def longest(self) -> int:
        return max(len(p) for p in self.ids)

    def indices(self, rollout: int, count: int) -> np.ndarray:
        if self.curriculum:  # the stream from the record's cursor, prompts set aside skipped
            return self.difficulty.draw(rollout, self.pool, count, seed=self.seed, salt=7817)
        return epoch_stream(len(self.problems), rollout * count, count, seed=self.seed, salt=7817)

    def prompts(self, rollout: int, count: int):
        return self._take(self.indices(rollout, count))

    def extra_prompts(self, rollout: int, draw: int, count: int):
        # Drawn without replacement apart from the epoch stream, which stays as it is: later rollouts see the same
        # prompts with dynamic sampling on or off.
        rng = np.random.default_rng([self.seed, rollout, draw, 6763])
        return self._take(rng.choice(len(self.problems), size=count, replace=count > len(self.problems)))

    def _take(self, idx):
        problems = [self.problems[i] for i in idx]
        return [self.ids[i] for i in idx], problems, group_keys(p.id for p in problems)


def make_prompt_source(data: OnlineDataConfig, model, *, seed: int, model_path: str, max_new_tokens: int
                       ) -> tuple[PromptSource, tuple[int, ...], int]:
    """(prompt source, stop ids, pad id) from a run's `data` block (and the tokenizer of data.tokenizer, else
    model_path). `max_new_tokens`: the completion cap the token task scores when data.score_tokens is 0. A pool of
    problems keeps each prompt's record (`source.difficulty`; the token task's prompts are new every rollout)."""
    eos = model.config.eos_token_id
    eos = (eos,) if isinstance(eos, int) else tuple(eos or ())
    pad = model.config.pad_token_id
    pad = 0 if pad is None else int(pad)
    if data.source == "token_task":
        if data.prompt_len > data.max_prompt_len:
            raise ValueError(f"data.prompt_len={data.prompt_len} exceeds data.max_prompt_len={data.max_prompt_len}")
        task = TokenTask(vocab_size=int(model.config.vocab_size), prompt_len=data.prompt_len,
                         num_classes=data.num_classes, score_tokens=data.score_tokens or max_new_tokens)
        return TokenTaskPrompts(task, seed), eos, pad
    if data.source == "problems":
        tok_dir = data.tokenizer or model_path
        if not tok_dir:
            raise ValueError("data.source='problems' needs a tokenizer: set data.tokenizer or model_path")
        tokenizer = load_tokenizer(tok_dir)
        difficulty = Difficulty(window=data.curriculum_window, set_aside=data.curriculum_set_aside,
                                solved=data.curriculum_solved, failed=data.curriculum_failed)
        prompts = ProblemPrompts(data.problems, tokenizer, enable_thinking=data.enable_thinking,
                                 max_prompt_len=data.max_prompt_len, on_overlong=data.on_overlong, seed=seed,
                                 difficulty=difficulty, curriculum=data.sampler == "curriculum")
        if tokenizer.pad_token_id is not None:
            pad = int(tokenizer.pad_token_id)
        return prompts, chat_stop_ids(tokenizer, model.config.eos_token_id), pad
    raise ValueError(f"data.source={data.source!r}; choose 'problems' or 'token_task'")


def make_reward(reward: RewardConfig):
    """(Reward, field) from a run's `reward` block: `name`, `score` (partial | strict), the rest constructor
    kwargs."""
    try:
        return get_reward(reward.name, **reward.options), reward.score
    except TypeError as e:
        raise ValueError(f"reward.name={reward.name!r} does not take the keys {sorted(reward.options)} of "
                         f"config.reward: {e}") from e
