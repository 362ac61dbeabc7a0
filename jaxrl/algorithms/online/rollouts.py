"""The rollouts of online GRPO / PPO / distillation: prompts -> samples from the current policy -> rewards, as
fixed-shape arrays (`Sampled`), through the one sampling loop (`jaxrl.environments.runner.EpisodeRunner` over a
`jaxrl.rollout.collect.Collector` of the rollout backend): a single-turn rollout is a one-turn episode scored by
the run's reward; with `environment` set every row is a multi-turn episode.

    rollouts = Rollouts(config, model, mesh, prompts_per_rollout=20, sampling=config.grpo, episodes=None)
    rollouts.open(workdir, policy)      # the backend: this process's engine on the live policy, or servers
    rollouts.sync(rollouts.policy(model, 7))   # the backend samples from that policy (servers: its adapter)
    sampled = rollouts.run(policy, rollout=7)
    rollouts.close()

Sequence layout (every rollout row, fixed shapes so the train step compiles once):

    input_ids      [N, P + C]   prompt left-padded into columns [0, P), completion right-padded into [P, P + C)
    attention_mask [N, P + C]   1 on real tokens
    completion_mask [N, C]      1 on generated tokens (the stop token included); the loss mask starts from it

P = `data.max_prompt_len`, C = `max_new_tokens` (the algorithm block's), or for episodes E = `max_episode_tokens`:
an episode's completion columns hold every turn's sampled tokens (mask 1) and every observation (mask 0), its
reward the episode's, with each turn's reward at that turn's last sampled token in `turn_rewards` (PPO's GAE reads
them). Completion token t (column P + t) is predicted by the hidden state of column P + t - 1
(jaxrl/algorithms/online/passes.py).

Prompts of rollout r are a function of (seed, r) and sampling keys of (seed, r, prompt id), so a rollout made from
the same parameters is bit-identical (what resume relies on: jaxrl/algorithms/online/controller.py). Row i of prompt
g is keyed by (`sample_seed(r)`, the prompt's group id, i) on every backend: the in-process engine, or servers
(`rollout_backend` server | vllm, jaxrl.backends.pool), whose requests pack that key into their seed; the JAX
server (`launchers.serve`) then draws the in-process engine's very tokens. Before each rollout the backend gets
the policy (`sync`: the engine samples with the trainer's arrays; servers are sent the adapter and report its
digest, which must be the trainer's). With partial rollouts the rollout controller publishes the versions itself
and `run` sends none; each sampled token then comes back with the digest that sampled it (`Sampled.token_digests`),
which the controller maps to versions. Several rollouts may run at once, one thread each (timings and `last_sync`
are per thread).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx

from jaxrl.algorithms.online.prompts import make_prompt_source, make_reward
from jaxrl.algorithms.online.settings import AsyncPolicy
from jaxrl.algorithms.config import TrainConfig
from jaxrl.backends.base import Policy, RolloutBackend, SamplingParams
from jaxrl.backends.pool import policy_adapter
from jaxrl.backends.settings import BackendContext
from jaxrl.environments.registry import ENVIRONMENTS
from jaxrl.environments.limits import STEP_TIMEOUT_S
from jaxrl.environments.runner import Episode, EpisodeRunner, episode_metrics
from jaxrl.environments.settings import EpisodeSettings
from jaxrl.generation.buckets import MIN_PROMPT_BUCKET
from jaxrl.generation.sampling import SEED_BITS
from jaxrl.rollout.collect import Collector


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
    episode: dict = dataclasses.field(default_factory=dict)  # episode/* metrics (jaxrl.environments.runner)
    # episodes: [N, C] float32, each turn's environment reward at that turn's last sampled token (a row sums to its
    # `rewards`; 0 for a failed episode): where PPO's GAE gives them (jaxrl/algorithms/ppo_task.py); None otherwise
    turn_rewards: Optional[np.ndarray] = None
    # partial rollouts: [N, C] objects, per completion column the adapter digest that sampled its token (None where
    # no token was sampled: an observation, past the end); the rollout controller maps them to versions
    token_digests: Optional[np.ndarray] = None
    # a pool of problems: difficulty/* after this rollout (jaxrl.algorithms.online.difficulty)
    difficulty: dict = dataclasses.field(default_factory=dict)
    # a fleet of servers: fleet/servers_up after this rollout, fleet/rows_resent during it (jaxrl.backends.fleet)
    fleet: dict = dataclasses.field(default_factory=dict)


def no_overlap_reason(backend: str, servers: Sequence[str], platform: str) -> Optional[str]:
    """Why sampling ahead (max_staleness >= 1) cannot overlap rollouts with training here, or None: the rollouts
    run on the hardware the update runs on (servers on this machine while the trainer computes on its CPU cores;
    the in-process sampler is refused with max_staleness by the config), so the two take turns and the
    asynchronous mode only adds its thread and copies."""
    local = [u for u in servers if re.match(r"https?://(127\.\d+\.\d+\.\d+|localhost|\[::1\])(:|/|$)", u)]
    if platform == "cpu" and servers and len(local) == len(servers):
        return ("the rollout servers are on this machine (loopback) and the trainer computes on its CPU: they share "
                "its cores")
    return None


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
    rollout); single-turn rollouts at one prompt length for the whole run (its programs compile once). server |
    vllm: a pool of servers (jaxrl.backends.pool), the adapters it serves written below the run's workdir."""

    def __init__(self, config: TrainConfig, model, mesh, *, prompts_per_rollout: int, sampling,
                 episodes: Optional[EpisodeSettings] = None, async_policy: AsyncPolicy = AsyncPolicy()):
        """`sampling`: the algorithm's block (GRPOConfig, PPOConfig, DistillConfig): num_generations,
        max_new_tokens, temperature, top_p, top_k, rollout_batch_size and the rollout backend's settings;
        `episodes`: the block's episode settings when its rows are multi-turn episodes (environment set);
        `async_policy`: its partial rollouts (module docstring) and the versions they keep."""
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
        self.partial = async_policy.partial  # module docstring: the controller publishes, `run` sends nothing
        # the PEFT folders of the versions a row in flight may still sample with (partial: k + 1)
        self.keep_versions = async_policy.max_staleness + 1 if self.partial else 1
        self.max_staleness = async_policy.max_staleness
        self.episodes = episodes
        self.environment = None
        self.width = self.max_new_tokens  # C: the completion columns of a row
        if episodes is not None:
            if self.source.tokenizer is None:
                raise ValueError(f"{config.algorithm}.environment={episodes.environment!r} needs "
                                 "data.source='problems' (a chat tokenizer: observations are messages)")
            self.environment = ENVIRONMENTS.get(episodes.environment)
            self.width = int(episodes.max_episode_tokens)
        self.enable_thinking = config.data.enable_thinking
        self.collector: Optional[Collector] = None
        self.runner: Optional[EpisodeRunner] = None
        # partial rollouts: called (on the sampling thread) as a rollout's sampling ends (the rollout controller
        # notes the versions published by then)
        self.on_sampled: Optional[Callable[[], None]] = None
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
        """Makes the backend and the sampling loop (once; the task's setup calls it). `model`: the live policy (the
        Trainer's current model), not the model the task factory saw: the jax backend keeps its model, and the
        trainer's copy of the frozen base (resharded) is the one that must stay alive. Server backends write the
        adapters they serve below `workdir`. Episodes take prompts up to P + E - max_new_tokens tokens (the last
        turn's history)."""
        if self.collector is not None:
            return
        length = self.prompt_length()
        if self.episodes is None:
            backend = self.build_backend(workdir, model, length, prompt_buckets=(length,))
        else:
            backend = self.build_backend(workdir, model, length + self.width - self.max_new_tokens)
        self.collector = Collector(backend, self.reward, tokenizer=self.source.tokenizer, stop_ids=self.stop_ids)
        reason = no_overlap_reason(self.backend_name, tuple(self.block.rollout_servers), jax.default_backend())
        if self.max_staleness and reason:
            logging.warning("%s.max_staleness=%d will not make the run faster: %s. Sampling ahead pays only where "
                            "rollouts run on other hardware than the update (docs/guides/vllm.md, 'Sampling ahead')",
                            self.block.NAME, self.max_staleness, reason)
        e = self.episodes
        self.runner = EpisodeRunner(
            self.collector, self.environment, tokenizer=self.source.tokenizer, enable_thinking=self.enable_thinking,
            max_turns=e.max_turns if e is not None else 1, max_new_tokens=self.max_new_tokens,
            max_episode_tokens=self.width, max_prompt_len=self.max_prompt_len,
            options=dict(e.environment_options) if e is not None else None,
            step_timeout_s=e.step_timeout_s if e is not None else STEP_TIMEOUT_S)

    def build_backend(self, workdir: str, model, max_prompt_len: int,
                      prompt_buckets: Optional[tuple] = None) -> RolloutBackend:
        """The run's rollout backend, from its block's spec: the jax engine on `model` (the live policy), or a pool
        of servers that serve the trainer's adapter from below `workdir`."""
        jax_backend = self.backend_name == "jax"
        return self.block.rollout_spec.build(BackendContext(
            self.model_path, stop_ids=tuple(self.stop_ids), max_prompt_len=max_prompt_len,
            max_new_tokens=self.max_new_tokens, pad_id=self.pad_id, model=model,
            dtype=None if jax_backend else self.dtype, seed=self.seed, batch_size=self.batch_size,
            prompt_buckets=prompt_buckets, mesh=self.mesh, run_dir=None if jax_backend else workdir,
            lora_rank=self.lora_rank, partial=self.partial, keep_versions=self.keep_versions))

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
            self.collector = self.runner = None

    @property
    def last_episodes(self) -> list[Episode]:
        """The episodes of this thread's last `run` (for inspection)."""
        return getattr(self._local, "episodes", [])

    @property
    def last_sync(self) -> dict:
        """The adapter sync of this thread's last `sync` (server backends): its digests and servers."""
        return getattr(self._local, "sync", {})

    @last_sync.setter
    def last_sync(self, value: dict) -> None:
        self._local.sync = value

    def policy(self, model, rollout: int) -> Policy:
        """The policy of rollout r; its adapter (a host copy) is made once, and only if a backend asks for it."""
        return Policy(f"r{rollout}", nnx.state(model), functools.cache(lambda: policy_adapter(model,
                                                                                              self.lora_dropout)))

    def sync(self, policy: Policy) -> tuple[Optional[str], float]:
        """Makes the backend sample from `policy`; sets `last_sync` and returns (the digest the servers report
        serving, None for the jax backend; seconds)."""
        if self.collector is None:
            raise RuntimeError("Rollouts.sync before open(workdir, model) (the task's setup opens it)")
        t0 = time.perf_counter()
        backend = self.collector.backend
        served = backend.update_weights(policy)
        self.last_sync, seconds = {}, time.perf_counter() - t0
        if served is not None:  # servers: the digest they report serving, which must be the trainer's
            self.last_sync = {"rollout/adapter_digest": policy.adapter().digest(), "rollout/served_digest": served,
                              "rollout/servers": float(len(backend.backends))}
        return served, seconds

    def run(self, model, rollout: int, draw: int = 0) -> Sampled:
        """Rollout `rollout`'s samples from `model` (the policy now); `draw` >= 1: one of its extra draws
        (`PromptSource.extra_prompts`, its own sampling seed), what GRPO's dynamic sampling adds."""
        if self.collector is None:
            raise RuntimeError("Rollouts.run before open(workdir, model) (the task's setup opens it)")
        prompts, problems, group_ids = (self.source.prompts(rollout, self.prompts_per_rollout) if draw == 0 else
                                        self.source.extra_prompts(rollout, draw, self.prompts_per_rollout))
        if self.partial:  # the controller published the versions (module docstring)
            served, seconds, self.last_sync = None, 0.0, {}
        else:
            served, seconds = self.sync(self.policy(model, rollout))
        sampling = self.sampling.replace(seed=self.sample_seed(rollout, draw))
        self.collector.backend.fleet_metrics()  # start this rollout's count from 0 (a failed one left its own)
        episodes = self.runner.run(problems, group_ids, sampling,
                                   prompts=None if self.environment is not None else prompts)
        if self.on_sampled is not None:
            self.on_sampled()
        self._local.episodes = episodes
        times = {**self.runner.last_times, **({"adapter_sync_s": seconds} if served else {})}
        if self.environment is None:
            sampled = self._single_turn(episodes, prompts, times)
        else:
            for e in episodes:
                if e.error:
                    logging.warning("rollout %d: episode %d of problem %s failed: %s", rollout, e.sample_index,
                                    getattr(problems[e.problem_index], "id", e.problem_index), e.error)
            sampled = episodes_to_sampled(episodes, self.max_prompt_len, self.width, self.pad_id, times=times)
        sampled.adapter = dict(self.last_sync)
        sampled.fleet = self.collector.backend.fleet_metrics()
        record = self.source.difficulty
        if record is not None:  # rows are prompt-major: a group's rows share its problem
            record.record(rollout, [str(problems[e.problem_index].id) for e in episodes], sampled.rewards,
                          self.num_generations)
            sampled.difficulty = record.metrics(rollout, self.source.pool)
        if self.partial:
            sampled.token_digests = np.full((len(episodes), self.width), None, object)
            for i, e in enumerate(episodes):
                sampled.token_digests[i, :min(len(e.digests), self.width)] = e.digests[:self.width]
        return sampled

    def _single_turn(self, episodes: Sequence[Episode], prompts, times: dict) -> Sampled:
        arrays = to_arrays(prompts, [e.tokens for e in episodes], [e.logprobs for e in episodes],
                           [e.problem_index for e in episodes], self.max_prompt_len, self.max_new_tokens, self.pad_id)
        rewards = np.asarray([np.nan if e.result.masked else float(getattr(e.result, self.reward_field))
                              for e in episodes], np.float32)
        return Sampled(**arrays, lengths=np.asarray([len(e.tokens) for e in episodes], np.int32),
                       truncated=np.asarray([e.truncated for e in episodes], bool), rewards=rewards,
                       strict=np.asarray([float(e.result.strict) for e in episodes], np.float32),
                       prompt_lengths=np.asarray([len(prompts[e.problem_index]) for e in episodes], np.int32),
                       times=times)


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
    """The rollout arrays of episodes (the module docstring's layout, C = max_episode_tokens): the completion mask is
    the per-token mask, the behaviour log-probs 0 at environment tokens. A failed episode keeps its prompt and
    whatever it sampled, reward NaN (masked from the loss)."""
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


def sample_metrics(s: Sampled, max_new_tokens: int, group: int = 0) -> dict[str, float]:
    """Reward and completion statistics of one rollout (host metrics), and the pool's difficulty after it. With
    `group` (the rows of a prompt, prompt-major): `reward/group_best_mean`, the mean over prompts of their best
    sample's reward (best-of-`group`: pass@group for a pass/fail reward), what a pass@k estimator trains for."""
    r = s.rewards[~np.isnan(s.rewards)]
    lengths = s.lengths.astype(np.float64)
    best = {}
    if group > 1 and s.rewards.size and s.rewards.size % group == 0:
        per_prompt = s.rewards.reshape(-1, group)
        scored = ~np.isnan(per_prompt).all(axis=1)
        if scored.any():
            best["reward/group_best_mean"] = float(np.nanmax(per_prompt[scored], axis=1).mean())
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
        **best,
        **s.difficulty,
        **s.fleet,
    }
