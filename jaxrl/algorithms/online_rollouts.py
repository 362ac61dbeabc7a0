"""The rollout engine of online GRPO / PPO: prompts -> samples from the current policy -> rewards, as fixed-shape
arrays (`Sampled`) through the one generation path (`jaxrl.rollout.collect.Collector` over a `JaxBackend`).

Sequence layout (every rollout row, fixed shapes so the train step compiles once):

    input_ids      [N, P + C]   prompt left-padded into columns [0, P), completion right-padded into [P, P + C)
    attention_mask [N, P + C]   1 on real tokens
    completion_mask [N, C]      1 on generated tokens (the stop token included); the loss mask starts from it

P = `data.max_prompt_len`, C = `max_new_tokens` (the algorithm block's). Completion token t (column P + t) is
predicted by the hidden state of column P + t - 1 (`jaxrl.algorithms.completion_passes`).

Prompts of rollout r are a function of (seed, r) and sampling keys of (seed, r, prompt id), so a rollout made from
the same parameters is bit-identical (what resume relies on: `jaxrl.algorithms.online_task`). Row i of prompt g
is keyed by (`sample_seed(r)`, the prompt's group id, i) on every backend: the in-process jax sampler, or servers
(`rollout_backend` server | vllm, `jaxrl.algorithms.server_rollouts`), whose requests pack that key into their
seed; the JAX server (`launchers.serve`) then draws the jax backend's very tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx

from jaxrl.algorithms import server_rollouts
from jaxrl.data.chat import chat_stop_ids, encode_prompts, load_tokenizer
from jaxrl.data.problems import load_problems
from jaxrl.data.stream import epoch_stream
from jaxrl.rewards import get_reward
from jaxrl.rewards.toy import TokenTask
from jaxrl.rollout.backends import JaxBackend, SamplingParams
from jaxrl.rollout.backends.openai_client import SEED_BITS
from jaxrl.rollout.collect import Collector
from jaxrl.rollout.keys import problem_key
from jaxrl.rollout.sampler import MIN_PROMPT_BUCKET
from jaxrl.utils.train_config import OnlineDataConfig, RewardConfig, TrainConfig

# ------------------------------------------------------------------------------------------------- prompts


class PromptSource:
    """Prompts of rollout r: `prompts(r, count) -> (ids, problems, group_ids)` (a function of (seed, r)).
    `tokenizer` decodes completions for the reward (None: token-id text, `jaxrl.rewards.toy.token_text`).
    `longest()`: the most tokens any rollout's prompt can have (the sampler's one prompt length)."""

    tokenizer = None

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
        return ids, problems, [problem_key(p["id"]) for p in problems]

    def extra_prompts(self, rollout: int, draw: int, count: int):
        seed = int(np.random.SeedSequence([self.seed, rollout, draw, 6761]).generate_state(1)[0])
        ids, problems = self.task.prompts(seed, rollout, count)
        for j, p in enumerate(problems):
            p["id"] = f"token_task/{rollout}/draw{draw}/{j}"
        return ids, problems, [problem_key(p["id"]) for p in problems]

    def longest(self) -> int:
        return self.task.prompt_len


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

    def longest(self) -> int:
        return max(len(p) for p in self.ids)

    def indices(self, rollout: int, count: int) -> np.ndarray:
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
        return [self.ids[i] for i in idx], problems, [problem_key(p.id) for p in problems]


def make_prompt_source(data: OnlineDataConfig, model, *, seed: int, model_path: str, max_new_tokens: int
                       ) -> tuple[PromptSource, tuple[int, ...], int]:
    """(prompt source, stop ids, pad id) from a run's `data` block (and the tokenizer of data.tokenizer, else
    model_path). `max_new_tokens`: the completion cap the token task scores when data.score_tokens is 0."""
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
        prompts = ProblemPrompts(data.problems, tokenizer, enable_thinking=data.enable_thinking,
                                 max_prompt_len=data.max_prompt_len, on_overlong=data.on_overlong, seed=seed)
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
    times: dict  # sample_s, score_s (server backends: adapter_sync_s)
    # server backends: the trainer's adapter digest and the one the servers reported serving for this rollout
    adapter: dict = dataclasses.field(default_factory=dict)


def to_arrays(prompts: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]], logprobs, prompt_indices,
              max_prompt_len: int, max_new_tokens: int, pad_id: int) -> dict[str, np.ndarray]:
    """Prompt-left-padded / completion-right-padded arrays of the module docstring."""
    n = len(tokens)
    ids = np.full((n, max_prompt_len + max_new_tokens), pad_id, np.int32)
    attn = np.zeros((n, max_prompt_len + max_new_tokens), np.int32)
    cmask = np.zeros((n, max_new_tokens), np.float32)
    blogp = np.zeros((n, max_new_tokens), np.float32)
    for i in range(n):
        p = np.asarray(prompts[prompt_indices[i]], np.int32)
        c = np.asarray(tokens[i], np.int32)[:max_new_tokens]
        ids[i, max_prompt_len - len(p):max_prompt_len] = p
        ids[i, max_prompt_len:max_prompt_len + len(c)] = c
        attn[i, max_prompt_len - len(p):max_prompt_len + len(c)] = 1
        cmask[i, :len(c)] = 1.0
        blogp[i, :len(c)] = np.asarray(logprobs[i], np.float32)[:len(c)]
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": cmask, "behaviour_logp": blogp}


class RolloutEngine:
    """Prompts -> samples from the current policy -> rewards, as `Sampled` arrays, through the one generation path
    (`jaxrl.rollout.collect.Collector`). rollout_backend jax: over a `JaxBackend` holding the policy: continuous
    batching over `rollout_batch_size` slots (0: one per row of the rollout) at one prompt length for the whole run;
    its programs compile once and the policy's current weights are an argument of every call. server | vllm: over a
    `server_rollouts.ServerPool`, the policy's adapter sent to every server (and its digest checked) before each
    rollout; those need the run's workdir (`attach_workdir`, from the task's setup) for the adapter folders."""

    def __init__(self, config: TrainConfig, model, mesh, *, prompts_per_rollout: int, sampling):
        """`sampling`: the algorithm's block (GRPOConfig, PPOConfig): num_generations, max_new_tokens,
        temperature, top_p, top_k, rollout_batch_size, rollout_backend, rollout_servers, rollout_backend_kwargs."""
        self.max_new_tokens, self.num_generations = sampling.max_new_tokens, sampling.num_generations
        self.source, self.stop_ids, self.pad_id = make_prompt_source(
            config.data, model, seed=config.seed, model_path=config.model_path, max_new_tokens=self.max_new_tokens)
        self.reward, self.reward_field = make_reward(config.reward)
        self.max_prompt_len = config.data.max_prompt_len
        self.prompts_per_rollout = prompts_per_rollout
        self.rows = prompts_per_rollout * self.num_generations
        self.seed = config.seed
        self.sampling = SamplingParams(n=self.num_generations, max_new_tokens=self.max_new_tokens,
                                       temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                       seed=0)
        self.mesh = mesh
        self.batch_size = sampling.rollout_batch_size or self.rows
        self.collector: Optional[Collector] = None
        self.block = sampling
        self.backend_name = getattr(sampling, "rollout_backend", "jax")
        self.model_path, self.dtype = config.model_path, config.dtype
        self.lora_rank, self.lora_dropout = config.lora.rank, config.lora.dropout
        self.workdir: Optional[str] = None
        self.last_sync: dict = {}  # the adapter sync of the last run (server backends)
        if self.backend_name != "jax":
            where = f"{config.algorithm}.rollout_backend={self.backend_name!r}"
            if not config.model_path:
                raise ValueError(f"{where} samples on servers of the run's base model: set model_path to the HF folder "
                                 f"they serve (a model_preset model exists only in this process)")
            if jax.process_count() > 1:
                raise ValueError(f"{where}: server rollouts run from a single trainer process; this run has "
                                 f"{jax.process_count()} (use rollout_backend='jax' on several hosts)")

    def attach_workdir(self, workdir: str) -> None:
        """The run's workdir: server backends write the adapter versions they serve below it."""
        self.workdir = workdir

    def prompt_length(self) -> int:
        """The one prompt length of every rollout's sampler programs: the longest prompt the data can give,
        rounded up to a multiple of MIN_PROMPT_BUCKET (so nearby data sets share programs), never per rollout."""
        longest = self.source.longest()
        return -(-longest // MIN_PROMPT_BUCKET) * MIN_PROMPT_BUCKET

    def collector_for(self, model) -> Collector:
        """Built at the first rollout from the live policy (the Trainer's current model), not from the model the
        task factory saw: the backend keeps its model, and the trainer's copy of the frozen base (resharded) is
        the one that must stay alive. Later rollouts pass the current weights; nothing recompiles: every rollout
        runs at one prompt length (`prompt_length`) and one slot count."""
        if self.collector is None:
            length = self.prompt_length()
            if self.backend_name == "jax":
                backend = JaxBackend(model=model, dtype=None, batch_size=self.batch_size, max_prompt_len=length,
                                     prompt_buckets=(length,), stop_ids=self.stop_ids, pad_id=self.pad_id,
                                     mesh=self.mesh)
            else:
                if self.workdir is None:
                    raise RuntimeError("server rollouts need the run's workdir: call attach_workdir (the task's setup "
                                       "does) before the first rollout")
                backend = server_rollouts.make_pool(
                    self.block, model_path=self.model_path, dtype=self.dtype, seed=self.seed, workdir=self.workdir,
                    stop_ids=self.stop_ids, max_prompt_len=length, max_new_tokens=self.max_new_tokens,
                    lora_rank=self.lora_rank)
            self.collector = Collector(backend, self.reward, tokenizer=self.source.tokenizer, stop_ids=self.stop_ids)
        return self.collector

    def sample_seed(self, rollout: int, draw: int = 0) -> int:
        """The sampling seed of rollout r (extra draw `draw`), in [0, 2**SEED_BITS): the range a server request's
        seed packs beside the group id and sample index (`openai_client.request_seed`), so every backend keys row i
        of a prompt by (sample_seed, group id, i)."""
        return (self.seed * 1_000_003 + rollout * 7919 + draw * 104_729 + 17) % 2 ** SEED_BITS

    def release(self) -> None:
        """Server backends: unload this run's adapter from the servers and stop a vLLM the run started (after the
        run's last rollout); the next `run` connects again."""
        if self.collector is not None and self.backend_name != "jax":
            self.collector.backend.close()
            self.collector = None

    def run(self, model, rollout: int, draw: int = 0) -> Sampled:
        """Rollout `rollout`'s samples; `draw` >= 1: one of its extra draws (`PromptSource.extra_prompts`, its own
        sampling seed), what GRPO's dynamic sampling adds."""
        prompts, problems, group_ids = (self.source.prompts(rollout, self.prompts_per_rollout) if draw == 0 else
                                        self.source.extra_prompts(rollout, draw, self.prompts_per_rollout))
        collector = self.collector_for(model)
        params, self.last_sync = None, {}
        if self.backend_name == "jax":
            params = nnx.state(model)
        else:  # the policy's adapter to every server, checked (the same adapter again: checked only)
            self.last_sync = collector.backend.sync(server_rollouts.policy_adapter(model, self.lora_dropout),
                                                    f"r{rollout}")
        samples = collector.collect(prompts, group_ids, problems,
                                    self.sampling.replace(seed=self.sample_seed(rollout, draw)), params=params)
        arrays = to_arrays(prompts, [s.tokens for s in samples], [s.logprobs for s in samples],
                           [s.prompt_index for s in samples], self.max_prompt_len, self.max_new_tokens, self.pad_id)
        rewards = np.asarray([np.nan if s.result.masked else float(getattr(s.result, self.reward_field))
                              for s in samples], np.float32)
        return Sampled(**arrays, lengths=np.asarray([len(s.tokens) for s in samples], np.int32),
                       truncated=np.asarray([s.truncated for s in samples], bool), rewards=rewards,
                       strict=np.asarray([float(s.result.strict) for s in samples], np.float32),
                       prompt_lengths=np.asarray([len(prompts[s.prompt_index]) for s in samples], np.int32),
                       times={**collector.last_times, **{k[len("time/"):]: v for k, v in self.last_sync.items()
                                                         if k.startswith("time/")}},
                       adapter={k: v for k, v in self.last_sync.items() if not k.startswith("time/")})


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
