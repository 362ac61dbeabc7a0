"""Online-RL plumbing shared by the GRPO and PPO trainers: prompts -> Sampler -> rewards -> fixed-shape arrays,
the mapping of rollouts onto train steps, teacher-forced passes over completions, and the rollout buffer on disk.

Sequence layout (every rollout row, fixed shapes so the train step compiles once):

    input_ids      [N, P + C]   prompt left-padded into columns [0, P), completion right-padded into [P, P + C)
    attention_mask [N, P + C]   1 on real tokens
    completion_mask [N, C]      1 on generated tokens (the stop token included); the loss mask starts from it

P = `data.max_prompt_len`, C = `max_new_tokens` (the algorithm block's). Completion token t (column P + t) is
predicted by the hidden state of column P + t - 1, so every per-token array of the algorithms is [N, C]:
`completion_hidden` slices hidden[:, P-1 : P+C-1] and never computes log-probs over the prompt.

Rollouts and train steps (the Trainer's unit is one optimizer update per step): a rollout of N rows is made when
one is due and then served as U = N / B_global minibatches (B_global = batch.micro_batch_size x
batch.grad_accum), `iterations` times over (GRPO num_iterations, PPO epochs), so rollout r covers train steps
[r*S, (r+1)*S) with S = iterations x U. Within a rollout, pass i serves its rows in a permutation seeded by
(seed, r, i). `trainer.current_model()` at the rollout's first step is the behaviour policy.

Resume: prompts of rollout r are a function of (seed, r), sampling keys of (seed, r, prompt id), so a rollout made
from the same parameters is bit-identical. A run resumed at a rollout boundary therefore regenerates it from the
restored parameters; a run resumed in the middle of a rollout (S > 1) needs the rollout as it was: each rollout
with S > 1 is written atomically to `<workdir>/rollouts/<r>.npz` before it is trained on, and buffers no kept
checkpoint can need are deleted at each checkpoint. The task's state_dict (JSON, saved with every checkpoint)
holds the rollout index, that file's name and the algorithm's host state (PPO's KL coefficient).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import time
from typing import Optional, Sequence

import numpy as np
from absl import logging
from flax import nnx

from jaxrl.data.chat import chat_stop_ids, encode_prompts, load_tokenizer
from jaxrl.data.problems import load_problems
from jaxrl.data.stream import epoch_stream
from jaxrl.models.lora import adapters_disabled
from jaxrl.ops.logprobs import token_logprobs
from jaxrl.parallel.distributed import is_main_process
from jaxrl.rewards import get_reward
from jaxrl.rewards.toy import TokenTask
from jaxrl.rollout.backends import JaxBackend, SamplingParams
from jaxrl.rollout.collect import Collector
from jaxrl.rollout.keys import problem_key
from jaxrl.train import inference
from jaxrl.utils.io import atomic_write_bytes
from jaxrl.utils.schema import ONLINE_DATA, REWARD

ROLLOUT_DIR = "rollouts"

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


# ------------------------------------------------------------------------------------------------- forward passes


def completion_hidden(model, input_ids, attention_mask, completion_len: int):
    """[b, C, H]: the hidden state that predicts each completion token (columns P-1 ... P+C-2)."""
    hidden, _ = model.hidden_states(input_ids, attention_mask)
    prompt_len = input_ids.shape[1] - completion_len
    return hidden[:, prompt_len - 1:-1]


def completion_logprobs(model, hidden, input_ids, completion_len: int, *, chunk_size: int, temperature: float,
                        entropy: bool):
    """(logp [b, C], entropy [b, C] or None) of the completion tokens at `temperature` (chunked over the vocab)."""
    targets = input_ids[:, input_ids.shape[1] - completion_len:]
    logp, ent = token_logprobs(hidden, model.head_weight(), targets, chunk_size=chunk_size, temperature=temperature,
                               return_entropy=True) if entropy else (
        token_logprobs(hidden, model.head_weight(), targets, chunk_size=chunk_size, temperature=temperature), None)
    return logp, ent


def _pass(graphdef, state, input_ids, attention_mask, *, completion_len, adapters, temperature, chunk_size,
          values):
    model = nnx.merge(graphdef, state)
    if adapters:
        h = completion_hidden(model, input_ids, attention_mask, completion_len)
    else:
        with adapters_disabled(model):
            h = completion_hidden(model, input_ids, attention_mask, completion_len)
    logp, _ = completion_logprobs(model, h, input_ids, completion_len, chunk_size=chunk_size,
                                  temperature=temperature, entropy=False)
    out = {"logp": logp}
    if values:
        out["values"] = model.value_head(h)
    return out


def teacher_forced(model, arrays: dict, *, completion_len: int, adapters: bool, batch_size: int,
                   temperature: float = 1.0, chunk_size: int = 512, values: bool = False, mesh=None,
                   compile_options: Optional[dict] = None) -> dict[str, np.ndarray]:
    """{"logp": [N, C] (+ "values": [N, C])} of every row of `arrays` (input_ids, attention_mask) under `model`
    with its adapters on or off: one jitted program, `batch_size` rows per call (jaxrl.train.inference)."""
    program = inference.jit_program(_pass, ("graphdef", "completion_len", "adapters", "temperature", "chunk_size",
                                            "values"), compile_options, mesh)
    graphdef, state = nnx.split(model)
    out = inference.map_batches(
        lambda b: program(graphdef, state, b["input_ids"], b["attention_mask"], completion_len=completion_len,
                          adapters=adapters, temperature=float(temperature), chunk_size=chunk_size, values=values),
        arrays, ("input_ids", "attention_mask"), batch_size=batch_size, mesh=mesh)
    mask = np.asarray(arrays["completion_mask"]) > 0
    # Padding positions hold whatever the model computed there; zero them so buffers are clean.
    return {k: np.where(mask, v, 0.0).astype(np.float32) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------- schedule


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Rollout r serves train steps [r*S, (r+1)*S), S = iterations x minibatches (module docstring)."""

    rows: int  # N per rollout
    global_batch: int  # B_global per train step
    iterations: int  # passes over each rollout (GRPO num_iterations, PPO epochs)
    seed: int

    def __post_init__(self):
        if self.iterations < 1:
            raise ValueError(f"the number of passes over a rollout must be >= 1, got {self.iterations}")

    @property
    def minibatches(self) -> int:
        return self.rows // self.global_batch

    @property
    def steps_per_rollout(self) -> int:
        return self.iterations * self.minibatches

    def locate(self, step: int) -> tuple[int, int, int]:
        """(rollout, pass, minibatch) of 0-based train step `step`."""
        r, within = divmod(step, self.steps_per_rollout)
        i, u = divmod(within, self.minibatches)
        return r, i, u

    def rows_of(self, rollout: int, iteration: int, minibatch: int) -> np.ndarray:
        """Row indices of one minibatch: rows in a permutation seeded by (seed, rollout, pass)."""
        if self.minibatches == 1:
            return np.arange(self.rows)
        perm = np.random.default_rng([self.seed, rollout, iteration, 3571]).permutation(self.rows)
        return perm[minibatch * self.global_batch:(minibatch + 1) * self.global_batch]


def check_rows(rows: int, global_batch: int, what: str) -> None:
    if rows % global_batch:
        raise ValueError(f"{what} = {rows} rows per rollout is not a multiple of the global batch "
                         f"batch.micro_batch_size x batch.grad_accum = {global_batch}; each rollout is served as "
                         f"whole global batches")


# ------------------------------------------------------------------------------------------------- the buffer


def _npz_bytes(arrays: dict, meta: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays, __meta__=np.asarray(json.dumps(meta)))
    return buf.getvalue()


class RolloutStore:
    """`<workdir>/rollouts/<r>.npz`: written atomically (temp file + rename, fsync'd) by the main process."""

    def __init__(self, workdir: str):
        self.dir = os.path.join(workdir, ROLLOUT_DIR)

    def path(self, rollout: int) -> str:
        return os.path.join(self.dir, f"{rollout}.npz")

    def save(self, rollout: int, arrays: dict, meta: dict) -> str:
        if is_main_process():
            atomic_write_bytes(self.path(rollout), _npz_bytes(arrays, meta))
        return os.path.basename(self.path(rollout))

    def load(self, rollout: int) -> Optional[tuple[dict, dict]]:
        path = self.path(rollout)
        if not os.path.exists(path):
            return None
        with np.load(path) as f:
            arrays = {k: np.asarray(f[k]) for k in f.files if k != "__meta__"}
            meta = json.loads(str(f["__meta__"]))
        return arrays, meta

    def prune(self, keep_from: int) -> list[int]:
        """Delete buffers of rollouts < keep_from; returns them."""
        if not is_main_process() or not os.path.isdir(self.dir):
            return []
        gone = []
        for name in os.listdir(self.dir):
            m = re.fullmatch(r"(\d+)\.npz", name)
            if m and int(m.group(1)) < keep_from:
                os.remove(os.path.join(self.dir, name))
                gone.append(int(m.group(1)))
        return sorted(gone)


# ------------------------------------------------------------------------------------------------- the task base


class OnlineTask:
    """Task base of GRPO and PPO (the Trainer's `batch` / `state_dict` / `on_checkpoint`), see the module
    docstring. Subclasses implement `make_rollout(rollout, model, trainer) -> (buffer: {key: [N, ...]},
    metrics)` and `train_keys` (the buffer keys a train batch carries), and may keep host state in
    `host_state()` / `load_host_state(d)` (e.g. PPO's KL coefficient)."""

    train_keys: tuple[str, ...] = ()

    def __init__(self, config, schedule: Schedule):
        self.config, self.schedule = config, schedule
        self.compile_options = inference.compile_options(config) or None
        self.buffer: Optional[dict] = None
        self.buffer_rollout = -1
        self.rollout_metrics: dict = {}
        self.loaded_state: dict = {}
        self.store: Optional[RolloutStore] = None
        self.position = 0

    # subclasses -------------------------------------------------------------------------------------------
    def make_rollout(self, rollout: int, model, trainer) -> tuple[dict, dict]:
        raise NotImplementedError

    def host_state(self) -> dict:
        return {}

    def load_host_state(self, state: dict) -> None:
        pass

    # Task ---------------------------------------------------------------------------------------------------
    def _ensure_rollout(self, rollout: int, first_step: bool, trainer) -> dict:
        timing = {}
        if self.buffer is not None and self.buffer_rollout == rollout:
            return timing
        if self.store is None:
            self.store = RolloutStore(trainer.workdir)
        if not first_step:  # resumed inside a rollout: it must be the one the interrupted run trained on
            loaded = self.store.load(rollout)
            if loaded is not None:
                self.buffer, self.rollout_metrics = loaded
                self.buffer_rollout = rollout
                logging.info("resumed inside rollout %d: loaded %s", rollout, self.store.path(rollout))
                return timing
            logging.warning("resumed inside rollout %d but %s is missing; sampling a new rollout from the current "
                            "policy (training goes on, but not bit-identical to an uninterrupted run)", rollout,
                            self.store.path(rollout))
        t0 = time.perf_counter()
        self.buffer, metrics = self.make_rollout(rollout, trainer.current_model(), trainer)
        metrics = {k: float(v) for k, v in metrics.items()}
        self.buffer_rollout = rollout
        timing = {k: v for k, v in metrics.items() if k.startswith("time/")}
        self.rollout_metrics = {k: v for k, v in metrics.items() if not k.startswith("time/")}
        timing["time/rollout_s"] = time.perf_counter() - t0
        if self.schedule.steps_per_rollout > 1:  # a resume inside this rollout will need it
            self.store.save(rollout, self.buffer, self.rollout_metrics)
        return timing

    def batch(self, step: int, trainer):
        r, i, u = self.schedule.locate(step)
        timing = self._ensure_rollout(r, step % self.schedule.steps_per_rollout == 0, trainer)
        rows = self.schedule.rows_of(r, i, u)
        out = {k: self.buffer[k][rows] for k in self.train_keys}
        self.position = step + 1
        host = {**self.rollout_metrics, **timing, "rollout": float(r), "rollout_pass": float(i)}
        return out, host

    def state_dict(self) -> dict:
        return {"position": self.position, "rollout": self.buffer_rollout,
                "steps_per_rollout": self.schedule.steps_per_rollout, **self.host_state()}

    def load_state_dict(self, state: dict) -> None:
        self.loaded_state = dict(state)
        self.position = int(state.get("position", 0))
        old = state.get("steps_per_rollout")
        if old is not None and int(old) != self.schedule.steps_per_rollout:
            raise ValueError(f"the checkpoint was written with {old} train steps per rollout, this config gives "
                             f"{self.schedule.steps_per_rollout} (num_iterations / epochs / minibatches / batch "
                             f"sizes changed); resume with the same values or use a new --workdir")
        self.load_host_state(state)

    def on_checkpoint(self, step: int, trainer) -> None:
        """Delete rollout buffers no kept checkpoint can need (a checkpoint at step s needs rollout s // S only
        when s is inside it)."""
        if self.store is None or self.schedule.steps_per_rollout == 1:
            return None
        keep = trainer.config.keep_checkpoints
        steps = sorted(self._state_steps(trainer))
        if keep is None or not steps:
            return None
        oldest = steps[0]
        self.store.prune(oldest // self.schedule.steps_per_rollout)
        return None

    @staticmethod
    def _state_steps(trainer) -> list[int]:
        state_dir = trainer.ckpt.state_dir
        if not os.path.isdir(state_dir):
            return []
        return [int(d) for d in os.listdir(state_dir) if d.isdigit()]
