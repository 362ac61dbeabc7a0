"""The rollouts of online GRPO / PPO: prompts -> samples from the current policy -> rewards, as fixed-shape arrays
(`Sampled`), through the one generation path (`jaxrl.rollout.collect.Collector` over a rollout backend).

    rollouts = Rollouts(config, model, mesh, prompts_per_rollout=20, sampling=config.grpo)
    rollouts.open(workdir, policy)      # the backend: this process's engine on the live policy, or servers
    sampled = rollouts.run(policy, rollout=7)
    rollouts.close()

Sequence layout (every rollout row, fixed shapes so the train step compiles once):

    input_ids      [N, P + C]   prompt left-padded into columns [0, P), completion right-padded into [P, P + C)
    attention_mask [N, P + C]   1 on real tokens
    completion_mask [N, C]      1 on generated tokens (the stop token included); the loss mask starts from it

P = `data.max_prompt_len`, C = `max_new_tokens` (the algorithm block's). Completion token t (column P + t) is
predicted by the hidden state of column P + t - 1 (jaxrl/algorithms/online/passes.py).

Prompts of rollout r are a function of (seed, r) and sampling keys of (seed, r, prompt id), so a rollout made from
the same parameters is bit-identical (what resume relies on: jaxrl/algorithms/online/task.py). Row i of prompt g
is keyed by (`sample_seed(r)`, the prompt's group id, i) on every backend: the in-process engine, or servers
(`rollout_backend` server | vllm, jaxrl.backends.pool), whose requests pack that key into their seed; the JAX
server (`launchers.serve`) then draws the in-process engine's very tokens. Before each rollout the backend gets
the policy (`RolloutBackend.update_weights`: the engine samples with the trainer's arrays; servers are sent the
adapter and report its digest, which must be the trainer's).

Partial rollouts (`partial_rollouts`, servers only): the task publishes each policy version itself (`publish`, at
every rollout's first step; the servers reload it in place under the rows in flight) and `run` sends no adapter.
Each token comes back with the digest that sampled it, mapped to the version that published it: `Sampled.
token_versions`. Several rollouts may run at once, one thread each (the collector's timings and `last_sync` are
per thread).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx

from jaxrl.algorithms.online.prompts import make_prompt_source, make_reward
from jaxrl.backends import JaxBackend, Policy, RolloutBackend, SamplingParams
from jaxrl.backends.pool import AdapterSyncError, make_pool, policy_adapter
from jaxrl.generation.buckets import MIN_PROMPT_BUCKET
from jaxrl.generation.sampling import SEED_BITS
from jaxrl.rollout.collect import Collector
from jaxrl.utils.train_config import TrainConfig


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
    episode: dict = dataclasses.field(default_factory=dict)  # episode/* metrics (jaxrl/algorithms/online/episodes.py)
    # episodes: [N, C] float32, each turn's environment reward at that turn's last sampled token (a row sums to its
    # `rewards`; 0 for a failed episode): where PPO's GAE gives them (jaxrl/algorithms/ppo_task.py); None otherwise
    turn_rewards: Optional[np.ndarray] = None
    # partial rollouts: [N, C] int32, the policy version (the rollout whose first step published it) that sampled
    # each completion token, -1 past the end; None when every token of the rollout has one version
    token_versions: Optional[np.ndarray] = None


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


class Rollouts:
    """Prompts -> samples from the current policy -> rewards, as `Sampled` arrays (module docstring).
    rollout_backend jax: a `JaxBackend` on the live policy, `rollout_batch_size` slots (0: one per row of the
    rollout) at one prompt length for the whole run (its programs compile once). server | vllm: a pool of servers
    (jaxrl.backends.pool), the adapters it serves written below the run's workdir."""

    def __init__(self, config: TrainConfig, model, mesh, *, prompts_per_rollout: int, sampling):
        """`sampling`: the algorithm's block (GRPOConfig, PPOConfig): num_generations, max_new_tokens,
        temperature, top_p, top_k, rollout_batch_size and the rollout backend's settings."""
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
        self.block = sampling
        self.backend_name = sampling.rollout_backend
        self.model_path, self.dtype = config.model_path, config.dtype
        self.lora_rank, self.lora_dropout = config.lora.rank, config.lora.dropout
        self.collector: Optional[Collector] = None
        self.live = bool(sampling.partial_rollouts)  # module docstring, 'Partial rollouts'
        self.published: dict[str, int] = {}  # partial rollouts: adapter digest -> the newest version published with it
        self._local = threading.local()
        if self.backend_name != "jax":
            where = f"{config.algorithm}.rollout_backend={self.backend_name!r}"
            if not config.model_path:
                raise ValueError(f"{where} samples on servers of the run's base model: set model_path to the HF folder "
                                 f"they serve (a model_preset model exists only in this process)")
            if jax.process_count() > 1:
                raise ValueError(f"{where}: server rollouts run from a single trainer process; this run has "
                                 f"{jax.process_count()} (use rollout_backend='jax' on several hosts)")

    def prompt_length(self) -> int:
        """The one prompt length of every rollout's programs: the longest prompt the data can give, rounded up to a
        multiple of MIN_PROMPT_BUCKET (so nearby data sets share programs), never per rollout."""
        longest = self.source.longest()
        return -(-longest // MIN_PROMPT_BUCKET) * MIN_PROMPT_BUCKET

    def open(self, workdir: str, model) -> None:
        """Makes the backend (once; the task's setup calls it). `model`: the live policy (the Trainer's current
        model), not the model the task factory saw: the jax backend keeps its model, and the trainer's copy of the
        frozen base (resharded) is the one that must stay alive. Server backends write the adapters they serve
        below `workdir`."""
        if self.collector is not None:
            return
        length = self.prompt_length()
        if self.backend_name == "jax":
            backend: RolloutBackend = JaxBackend(model=model, dtype=None, batch_size=self.batch_size,
                                                 max_prompt_len=length, prompt_buckets=(length,),
                                                 stop_ids=self.stop_ids, pad_id=self.pad_id, mesh=self.mesh)
        else:
            backend = make_pool(self.block, model_path=self.model_path, dtype=self.dtype, seed=self.seed,
                                workdir=workdir, stop_ids=self.stop_ids, max_prompt_len=length,
                                max_new_tokens=self.max_new_tokens, lora_rank=self.lora_rank)
        self.collector = Collector(backend, self.reward, tokenizer=self.source.tokenizer, stop_ids=self.stop_ids)

    def sample_seed(self, rollout: int, draw: int = 0) -> int:
        """The sampling seed of rollout r (extra draw `draw`), in [0, 2**SEED_BITS): the range a server request's
        seed packs beside the group id and sample index (`jaxrl.generation.sampling.request_seed`), so every
        backend keys row i of a prompt by (sample_seed, group id, i)."""
        return (self.seed * 1_000_003 + rollout * 7919 + draw * 104_729 + 17) % 2 ** SEED_BITS

    def close(self) -> None:
        """Server backends: unload this run's adapter from the servers and stop a vLLM the run started (after the
        run's last rollout); the next `open` connects again."""
        if self.collector is not None and self.backend_name != "jax":
            self.collector.backend.close()
            self.collector = None

    @property
    def last_sync(self) -> dict:
        """The adapter sync of this thread's last `run` (server backends): its digests and servers."""
        return getattr(self._local, "sync", {})

    @last_sync.setter
    def last_sync(self, value: dict) -> None:
        self._local.sync = value

    def sync(self, policy: Policy) -> tuple[Optional[str], float]:
        """Makes the backend sample from `policy` (`_policy`); sets `last_sync` and returns (the digest the servers
        report serving, None for the jax backend; seconds)."""
        t0 = time.perf_counter()
        backend = self.collector.backend
        served = backend.update_weights(policy)
        self.last_sync, seconds = {}, time.perf_counter() - t0
        if served is not None:  # servers: the digest they report serving, which must be the trainer's
            self.last_sync = {"rollout/adapter_digest": policy.adapter().digest(), "rollout/served_digest": served,
                              "rollout/servers": float(len(backend.backends))}
        return served, seconds

    def publish(self, model, rollout: int) -> dict:
        """Partial rollouts: serves `model` as version `rollout` (the parameters at that rollout's first step) in
        place under the rows in flight; returns its metrics (digests, `time/adapter_sync_s`)."""
        if self.collector is None:
            raise RuntimeError("Rollouts.publish before open(workdir, model) (the task's setup opens it)")
        policy = self._policy(model, rollout)
        # known before any server serves it: a row may come back with it as soon as the first server loaded it
        self.published[policy.adapter().digest()] = rollout
        served, seconds = self.sync(policy)
        return {**self.last_sync, "rollout/published_version": float(rollout), "time/adapter_sync_s": seconds}

    def token_versions(self, samples, width: int) -> np.ndarray:
        """[N, width] int32: the published version of each sample's tokens (from their digests), -1 past the end.
        A digest this run never published (another process reloaded the adapter) is an AdapterSyncError."""
        out = np.full((len(samples), width), -1, np.int32)
        published = dict(self.published)  # the trainer thread adds versions meanwhile
        for i, s in enumerate(samples):
            digests = s.token_digests or []
            unknown = {d for d in digests if d not in published}
            if unknown or len(digests) != len(s.tokens):
                raise AdapterSyncError(
                    f"prompt {s.prompt_index} sample {s.sample_index}: tokens sampled by adapter digest(s) "
                    f"{sorted(map(str, unknown))} that this run never published (published: "
                    f"{sorted(published.values())}), or without a version per token; another process "
                    "reloaded the run's adapter on a server")
            out[i, :min(len(digests), width)] = [published[d] for d in digests[:width]]
        return out

    def _policy(self, model, rollout: int) -> Policy:
        """The policy of rollout r; its adapter (a host copy) is made once, and only if a backend asks for it."""
        return Policy(f"r{rollout}", nnx.state(model), functools.cache(lambda: policy_adapter(model,
                                                                                              self.lora_dropout)))

    def run(self, model, rollout: int, draw: int = 0) -> Sampled:
        """Rollout `rollout`'s samples from `model` (the policy now); `draw` >= 1: one of its extra draws
        (`PromptSource.extra_prompts`, its own sampling seed), what GRPO's dynamic sampling adds."""
        if self.collector is None:
            raise RuntimeError("Rollouts.run before open(workdir, model) (the task's setup opens it)")
        prompts, problems, group_ids = (self.source.prompts(rollout, self.prompts_per_rollout) if draw == 0 else
                                        self.source.extra_prompts(rollout, draw, self.prompts_per_rollout))
        if self.live:  # the task published the versions (module docstring, 'Partial rollouts')
            if not self.published:
                raise RuntimeError("partial rollouts: Rollouts.run before any version was published")
            served, seconds, self.last_sync = None, 0.0, {}
        else:
            served, seconds = self.sync(self._policy(model, rollout))
        samples = self.collector.collect(prompts, group_ids, problems,
                                         self.sampling.replace(seed=self.sample_seed(rollout, draw)))
        arrays = to_arrays(prompts, [s.tokens for s in samples], [s.logprobs for s in samples],
                           [s.prompt_index for s in samples], self.max_prompt_len, self.max_new_tokens, self.pad_id)
        rewards = np.asarray([np.nan if s.result.masked else float(getattr(s.result, self.reward_field))
                              for s in samples], np.float32)
        return Sampled(**arrays, lengths=np.asarray([len(s.tokens) for s in samples], np.int32),
                       truncated=np.asarray([s.truncated for s in samples], bool), rewards=rewards,
                       strict=np.asarray([float(s.result.strict) for s in samples], np.float32),
                       prompt_lengths=np.asarray([len(prompts[s.prompt_index]) for s in samples], np.int32),
                       times={**self.collector.last_times, **({"adapter_sync_s": seconds} if served else {})},
                       adapter=dict(self.last_sync),
                       token_versions=self.token_versions(samples, self.max_new_tokens) if self.live else None)


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
