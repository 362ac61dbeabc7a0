"""The rollout engine of online GRPO / PPO: prompts -> samples from the current policy -> rewards, as fixed-shape
arrays (`Sampled`) through the one generation path (`jaxrl.rollout.collect.Collector` over a `JaxBackend`).

Sequence layout (every rollout row, fixed shapes so the train step compiles once):

    input_ids      [N, P + C]   prompt left-padded into columns [0, P), completion right-padded into [P, P + C)
    attention_mask [N, P + C]   1 on real tokens
    completion_mask [N, C]      1 on generated tokens (the stop token included); the loss mask starts from it

P = `data.max_prompt_len`, C = `max_new_tokens` (the algorithm block's). Completion token t (column P + t) is
predicted by the hidden state of column P + t - 1 (`jaxrl.algorithms.completion_passes`).

Prompts of rollout r are a function of (seed, r) and sampling keys of (seed, r, prompt id), so a rollout made from
the same parameters is bit-identical (what resume relies on: `jaxrl.algorithms.online_task`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
from absl import logging
from flax import nnx

from jaxrl.data.chat import chat_stop_ids, encode_prompts, load_tokenizer
from jaxrl.data.problems import load_problems
from jaxrl.data.stream import epoch_stream
from jaxrl.rewards import get_reward
from jaxrl.rewards.toy import TokenTask
from jaxrl.rollout.backends import JaxBackend, SamplingParams
from jaxrl.rollout.collect import Collector
from jaxrl.rollout.keys import problem_key
from jaxrl.utils.schema import ONLINE_DATA, REWARD

# ------------------------------------------------------------------------------------------------- prompts


class PromptSource:
    """Prompts of rollout r: `prompts(r, count) -> (ids, problems, group_ids)` (a function of (seed, r)).
    `tokenizer` decodes completions for the reward (None: token-id text, `jaxrl.rewards.toy.token_text`)."""

    tokenizer = None

    def prompts(self, rollout: int, count: int):
        raise NotImplementedError


class TokenTaskPrompts(PromptSource):
    def __init__(self, task: TokenTask, seed: int):
        self.task, self.seed = task, seed

    def prompts(self, rollout: int, count: int):
        ids, problems = self.task.prompts(self.seed, rollout, count)
        return ids, problems, [problem_key(p["id"]) for p in problems]


class ProblemPrompts(PromptSource):
    """problems.jsonl -> chat-templated prompt ids; rollout r takes positions r*count ... of the stream of
    epoch-wise seeded permutations of the (kept) problems."""

    def __init__(self, path: str, tokenizer, *, enable_thinking: bool, max_prompt_len: int, on_overlong: str,
                 seed: int):
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
        logging.info("%s: %d problems (%d skipped as over-long)", path, len(self.problems), self.skipped)

    def indices(self, rollout: int, count: int) -> np.ndarray:
        return epoch_stream(len(self.problems), rollout * count, count, seed=self.seed, salt=7817)

    def prompts(self, rollout: int, count: int):
        idx = self.indices(rollout, count)
        problems = [self.problems[i] for i in idx]
        return [self.ids[i] for i in idx], problems, [problem_key(p.id) for p in problems]


def make_prompt_source(config, model) -> tuple[PromptSource, tuple[int, ...], int]:
    """(prompt source, stop ids, pad id) from `config.data` (and the tokenizer of data.tokenizer / model_path)."""
    data = ONLINE_DATA.resolve(config.get("data", None), "data")
    source = data["source"]
    seed = int(config.seed)
    max_prompt_len = int(data["max_prompt_len"])
    eos = model.config.eos_token_id
    eos = (eos,) if isinstance(eos, int) else tuple(eos or ())
    pad = model.config.pad_token_id
    pad = 0 if pad is None else int(pad)
    if source == "token_task":
        prompt_len = int(data["prompt_len"])
        if prompt_len > max_prompt_len:
            raise ValueError(f"data.prompt_len={prompt_len} exceeds data.max_prompt_len={max_prompt_len}")
        score_tokens = int(data["score_tokens"]) or int(max_new_tokens_of(config))
        task = TokenTask(vocab_size=int(model.config.vocab_size), prompt_len=prompt_len,
                         num_classes=int(data["num_classes"]), score_tokens=score_tokens)
        return TokenTaskPrompts(task, seed), eos, pad
    if source == "problems":
        tok_dir = data["tokenizer"] or config.model_path
        if not tok_dir:
            raise ValueError("data.source='problems' needs a tokenizer: set data.tokenizer or model_path")
        tokenizer = load_tokenizer(tok_dir)
        prompts = ProblemPrompts(data["problems"], tokenizer,
                                 enable_thinking=bool(data["enable_thinking"]),
                                 max_prompt_len=max_prompt_len,
                                 on_overlong=data["on_overlong"], seed=seed)
        if tokenizer.pad_token_id is not None:
            pad = int(tokenizer.pad_token_id)
        return prompts, chat_stop_ids(tokenizer, model.config.eos_token_id), pad
    raise ValueError(f"data.source={source!r}; choose 'problems' or 'token_task'")


def max_new_tokens_of(config) -> int:
    block = config.get(config.algorithm, None) if isinstance(config.get("algorithm", None), str) else None
    return int(block.get("max_new_tokens")) if block is not None and "max_new_tokens" in block else 0


def make_reward(config):
    """(Reward, field) from `config.reward`: `name`, `score` (partial | strict), the rest constructor kwargs."""
    spec = REWARD.resolve(config.get("reward", None), "reward")
    name, field = spec.pop("name"), spec.pop("score")
    if field not in ("partial", "strict"):
        raise ValueError(f"reward.score={field!r}; choose 'partial' or 'strict'")
    try:
        return get_reward(name, **spec), field
    except TypeError as e:
        raise ValueError(f"reward.name={name!r} does not take the keys {sorted(spec)} of config.reward: {e}") from e


# ------------------------------------------------------------------------------------------------- rollouts


@dataclasses.dataclass
class Sampled:
    """One rollout's samples as fixed-shape arrays (rows prompt-major: prompt j -> rows j*n ... j*n+n-1)."""

    input_ids: np.ndarray  # [N, P + C] int32
    attention_mask: np.ndarray  # [N, P + C] int32
    completion_mask: np.ndarray  # [N, C] float32, 1 on generated tokens
    behaviour_logp: np.ndarray  # [N, C] float32, the sampler's log-probs (temperature 1), 0 past the end
    lengths: np.ndarray  # [N] int32 completion tokens
    truncated: np.ndarray  # [N] bool: hit max_new_tokens without a stop token
    rewards: np.ndarray  # [N] float32; NaN where the reward masked the sample (RewardResult.masked)
    strict: np.ndarray  # [N] float32 0/1
    prompt_lengths: np.ndarray  # [N] int32
    times: dict  # sample_s, score_s


def to_arrays(prompts: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]], logprobs, prompt_indices,
              prompt_len: int, completion_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Prompt-left-padded / completion-right-padded arrays of the module docstring."""
    n = len(tokens)
    ids = np.full((n, prompt_len + completion_len), pad_id, np.int32)
    attn = np.zeros((n, prompt_len + completion_len), np.int32)
    cmask = np.zeros((n, completion_len), np.float32)
    blogp = np.zeros((n, completion_len), np.float32)
    for i in range(n):
        p = np.asarray(prompts[prompt_indices[i]], np.int32)
        c = np.asarray(tokens[i], np.int32)[:completion_len]
        ids[i, prompt_len - len(p):prompt_len] = p
        ids[i, prompt_len:prompt_len + len(c)] = c
        attn[i, prompt_len - len(p):prompt_len + len(c)] = 1
        cmask[i, :len(c)] = 1.0
        blogp[i, :len(c)] = np.asarray(logprobs[i], np.float32)[:len(c)]
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": cmask, "behaviour_logp": blogp}


class RolloutEngine:
    """Prompts -> samples from the current policy -> rewards, as `Sampled` arrays, through the one generation path
    (`jaxrl.rollout.collect.Collector` over a `JaxBackend` holding the policy; its programs compile once per bucket
    and the policy's current weights are an argument of every call)."""

    def __init__(self, config, model, mesh, *, max_new_tokens: int, num_generations: int, prompts_per_rollout: int,
                 temperature: float, top_p: float, top_k: int = 0, rollout_batch_size: int = 0):
        self.source, self.stop_ids, self.pad_id = make_prompt_source(config, model)
        self.reward, self.reward_field = make_reward(config)
        self.prompt_len = int(ONLINE_DATA.resolve(config.get("data", None), "data")["max_prompt_len"])
        self.max_new_tokens, self.n = int(max_new_tokens), int(num_generations)
        self.count = int(prompts_per_rollout)
        self.rows = self.count * self.n
        self.seed = int(config.seed)
        self.sampling = SamplingParams(n=self.n, max_new_tokens=self.max_new_tokens, temperature=float(temperature),
                                       top_p=float(top_p), top_k=int(top_k), seed=0)
        self.mesh = mesh
        self.batch_size = int(rollout_batch_size) or self.rows
        self.collector: Optional[Collector] = None

    def collector_for(self, model) -> Collector:
        """Built at the first rollout from the live policy (`trainer.current_model()`), not from the model the
        task factory saw: the backend keeps its model, and the trainer's copy of the frozen base (resharded) is
        the one that must stay alive. Later rollouts pass the current weights; nothing recompiles."""
        if self.collector is None:
            backend = JaxBackend(model=model, dtype=None, batch_size=self.batch_size, max_prompt_len=self.prompt_len,
                                 stop_ids=self.stop_ids, pad_id=self.pad_id, mesh=self.mesh)
            self.collector = Collector(backend, self.reward, tokenizer=self.source.tokenizer, stop_ids=self.stop_ids)
        return self.collector

    def sample_seed(self, rollout: int) -> int:
        return (self.seed * 1_000_003 + rollout * 7919 + 17) % 2 ** 32

    def run(self, model, rollout: int) -> Sampled:
        prompts, problems, group_ids = self.source.prompts(rollout, self.count)
        collector = self.collector_for(model)
        samples = collector.collect(prompts, group_ids, problems, self.sampling.replace(seed=self.sample_seed(rollout)),
                                    params=nnx.state(model))
        arrays = to_arrays(prompts, [s.tokens for s in samples], [s.logprobs for s in samples],
                           [s.prompt_index for s in samples], self.prompt_len, self.max_new_tokens, self.pad_id)
        rewards = np.asarray([np.nan if s.result.masked else float(getattr(s.result, self.reward_field))
                              for s in samples], np.float32)
        return Sampled(**arrays, lengths=np.asarray([len(s.tokens) for s in samples], np.int32),
                       truncated=np.asarray([s.truncated for s in samples], bool), rewards=rewards,
                       strict=np.asarray([float(s.result.strict) for s in samples], np.float32),
                       prompt_lengths=np.asarray([len(prompts[s.prompt_index]) for s in samples], np.int32),
                       times=dict(collector.last_times))


def sample_metrics(s: Sampled, max_new_tokens: int) -> dict[str, float]:
    """Reward and completion statistics of one rollout (host metrics)."""
    r = s.rewards[~np.isnan(s.rewards)]
    lengths = s.lengths.astype(np.float64)
    return {
        "reward/mean": float(r.mean()) if r.size else float("nan"),
        "reward/std": float(r.std()) if r.size else float("nan"),
        "reward/min": float(r.min()) if r.size else float("nan"),
        "reward/max": float(r.max()) if r.size else float("nan"),
        "reward/strict_rate": float(s.strict.mean()),
        "reward/masked_fraction": float(np.isnan(s.rewards).mean()),
        "completion/length_mean": float(lengths.mean()),
        "completion/length_min": float(lengths.min()),
        "completion/length_max": float(lengths.max()),
        "completion/truncation_rate": float(s.truncated.mean()),
        "completion/clipped_fraction": float((lengths >= max_new_tokens).mean()),
    }
