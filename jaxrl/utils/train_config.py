"""The training config, typed: every key with its one default, resolved once into frozen dataclasses.

    config = default_config("dpo")        # a ConfigDict of every key a DPO run reads (what configs/base.py returns)
    run = resolve(config)                 # -> TrainConfig: missing keys at their defaults, every key and type
                                          #    checked, values validated; run.dpo.beta is a float
    run.to_json()                         # what config.json holds (every key, plain JSON values)
    complete(config)                      # the same dict without building the dataclasses (sweeps)

Family files (configs/*.py, `get_config()` with presets and `--config.key=value`) stay the user's interface: a
ConfigDict. `jaxrl.algorithms.run.run_training` resolves it here once and passes the `TrainConfig` down; nothing
below reads a raw dict. A wrong key anywhere is a ConfigKeyError naming it and the nearest valid key.

An algorithm registered by a user (`jaxrl.algorithms.tasks.register_task(name, blocks={...})`) may declare its own
blocks as config dataclasses (fields made with `jaxrl.utils.typed_config.setting`); without them its `data` block
is taken as it is. No jax here: configs import this module.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import warnings
from typing import Any, Mapping, Optional

import ml_collections

from jaxrl.utils.seeds import seed_problem
from jaxrl.utils.typed_config import (ConfigKeyError, block, build_block, complete_block, defaults_of, keys_of,
                                      setting, to_plain, unknown_key_error)

__all__ = ["ALGORITHMS", "AGGREGATIONS", "BatchConfig", "DPOConfig", "DPODataConfig", "DistillConfig", "EMAConfig", "GRPOConfig",
           "LoggingConfig", "LoRAConfig", "MeshConfig", "OnlineDataConfig", "OptimizerConfig", "OptimizerConfigError",
           "PPOConfig", "RewardConfig", "SCALE_REWARDS", "SCHEDULES", "SFTDataConfig", "TrainConfig", "complete",
           "default_config", "default_of", "resolve"]

# The choices of the keys that take one of a fixed set, in one place (the code that acts on them imports them).
SCHEDULES = ("linear", "constant_with_warmup", "cosine", "constant")
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sequence_mean", "token_mean", "dr_grpo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
REWARD_SCORES = ("partial", "strict")
ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ROLLOUT_BACKENDS = ("jax", "server", "vllm")
OFF_POLICY_LOSSES = ("behaviour", "decoupled")  # the ratio of updates on rollouts sampled ahead (max_staleness)
WANDB_MODES = ("", "online", "offline", "disabled")
DISTILL_LOSSES = ("reverse_kl", "jsd", "forward_kl_topk")
TEACHER_BACKENDS = ("jax", "server", "vllm")
SERVED_TEACHERS = ("server", "vllm")  # teacher backends that score over HTTP (teacher_servers)


class OptimizerConfigError(ValueError):
    """An `optimizer.*` config value we cannot use; names the key."""


def _at_least(where: str, keys: Mapping[str, int], obj) -> None:
    for key, minimum in keys.items():
        value = getattr(obj, key)
        if value < minimum:
            raise ValueError(f"{where}.{key} must be >= {minimum}, got {value}")


# ------------------------------------------------------------------------------------------------ the core


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = setting("adamw", doc="only adamw")
    learning_rate: float = setting(1e-6, doc="peak learning rate")
    schedule: str = setting("linear", doc="linear | constant_with_warmup | cosine | constant")
    warmup_steps: int = setting(0, doc="takes precedence over warmup_ratio when > 0")
    warmup_ratio: float = setting(0.0)
    weight_decay: float = setting(0.0)
    b1: float = setting(0.9)
    b2: float = setting(0.999)
    eps: float = setting(1e-8)
    max_grad_norm: float = setting(1.0, doc="global-norm clipping; <= 0 disables")

    def __post_init__(self):
        if self.name != "adamw":
            raise OptimizerConfigError(f"optimizer.name={self.name!r}; only 'adamw' is implemented")
        if self.schedule not in SCHEDULES:
            raise OptimizerConfigError(f"optimizer.schedule={self.schedule!r}; choose one of {SCHEDULES}")
        if not self.learning_rate >= 0:
            raise OptimizerConfigError(f"optimizer.learning_rate must be >= 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise OptimizerConfigError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps == 0 and not 0.0 <= self.warmup_ratio <= 1.0:
            raise OptimizerConfigError(f"optimizer.warmup_ratio must be in [0, 1], got {self.warmup_ratio}")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = setting(16)
    alpha: float = setting(32.0)
    targets: Any = setting("all-linear", (str, list, tuple), "'all-linear' | 'q_proj,v_proj,...' | a regex over "
                           "module paths")
    use_rslora: bool = setting(False)
    dropout: float = setting(0.0)
    allow_vllm_unpackable: bool = setting(False, doc="allow targets vLLM 0.33 cannot serve (in_proj_z without "
                                          "in_proj_qkv); refused by default (docs/guides/vllm.md)")


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: int = setting(1, doc="rows per forward/backward (a step: micro_batch_size x grad_accum rows)")
    grad_accum: int = setting(8, doc="micro-batches summed into one update")

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step."""
        return self.micro_batch_size * self.grad_accum


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    shape: tuple = setting((1, -1, 1), tuple, "(data, fsdp, tensor); -1 takes the remaining devices")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Where a run's metrics go besides metrics.jsonl (and TensorBoard): Weights & Biases (jaxrl.train.wandb_log)."""

    wandb_project: str = setting("", doc="W&B project: metrics lines, config and artefact paths mirrored to W&B "
                                 "(process 0; the wandb extra); '' = off")
    wandb_entity: str = setting("", doc="W&B team or user; '' = the account's default")
    wandb_run_name: str = setting("", doc="'' = the workdir's folder name")
    wandb_group: str = setting("", doc="W&B group of the run")
    wandb_tags: tuple = setting((), tuple, "W&B tags of the run")
    wandb_mode: str = setting("", doc="'' (WANDB_MODE, else online) | online | offline (local files; `wandb sync` "
                              "uploads them) | disabled", choices=WANDB_MODES)
    wandb_dir: str = setting("", doc="folder of the W&B run files ('' = the workdir)")



@dataclasses.dataclass(frozen=True)
class EMAConfig:
    """An exponential moving average of the LoRA factors, kept in the training state and written beside each adapter
    checkpoint as its own adapter (checkpoints/ema/<step>; evaluated as ema_<step>)."""

    decay: Optional[float] = setting(
        None, (float, type(None)),
        "None: off. d in [0, 1): after every applied update each LoRA factor's EMA becomes d * ema + (1 - d) * factor "
        "(A and B each; from the initial factors; a skipped update leaves it). Its update B_ema A_ema is not the EMA of "
        "the updates B A (an exact one has no fixed rank: a dense [out, in] fp32 matrix per module); for the exact "
        "mean of checkpoints' updates use launchers.export --average. d = 0 is the last checkpoint itself")

    def __post_init__(self):
        if self.decay is not None and not 0.0 <= self.decay < 1.0:
            raise ValueError(f"ema.decay must be in [0, 1) (or None: off), got {self.decay}")


CORE_BLOCKS = {"optimizer": OptimizerConfig, "lora": LoRAConfig, "batch": BatchConfig, "mesh": MeshConfig,
               "logging": LoggingConfig, "ema": EMAConfig}

# ------------------------------------------------------------------------------------------------ algorithms


@dataclasses.dataclass(frozen=True)
class SFTDataConfig:
    source: str = setting("synthetic", doc="synthetic (arithmetic progressions) | jsonl")
    path: str = setting("", doc="jsonl: one {'input_ids': [...], 'loss_mask': [...]} per line")
    seq_len: int = setting(2048, doc="rows are cut / right-padded to it")
    pack: bool = setting(False, doc="pack a step's sequences end to end into rows of one of the lengths "
                         "seq_len x {1/4, 3/8, 1/2, 5/8, 3/4, 1} (jaxrl.algorithms.sft_task); per-token losses unchanged")


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    loss_type: Any = setting("sigmoid", (str, list, tuple), "a registered loss, or several comma-separated "
                             "('sigmoid,sft' = RPO)")
    loss_weights: tuple = setting((), tuple, "one weight per loss_type; () = all 1")
    beta: float = setting(0.1)
    label_smoothing: float = setting(0.0, doc="robust, exo_pair, aot, aot_unpaired, simpo")
    simpo_gamma: float = setting(0.5, doc="SimPO target margin")
    discopop_tau: float = setting(0.05)
    f_divergence: str = setting("reverse_kl", doc="reverse_kl | forward_kl | js_divergence | alpha_divergence")
    f_alpha: float = setting(0.5)
    plugin: str = setting("", doc="deprecated alias of `plugins` entries of kind dpo_loss: "
                          "'my_losses.py:fn[,other.py:fn2]' (registered by function name)")
    precompute_ref_logps: bool = setting(True, doc="False: a second forward with the adapters off in every step")
    ref_batch_size: int = setting(0, doc="rows per reference / evaluation pass; 0 = batch.micro_batch_size")


@dataclasses.dataclass(frozen=True)
class DPODataConfig:
    source: str = setting("pairs", doc="pairs | synthetic")
    pairs: str = setting("", doc="pairs.jsonl, a frozen cohort folder, or a build folder holding cohort/")
    problems: str = setting("", doc="problems.jsonl supplying `messages` of pairs that have none")
    tokenizer: str = setting("", doc="HF tokenizer folder; '' = model_path")
    max_length: int = setting(2048, doc="prompt + completion tokens of one sequence")
    max_prompt_length: int = setting(0, doc="0 = bounded by max_length only")
    overlong: str = setting("truncate_prompt", doc="truncate_prompt (cut the prompt from the left) | drop")
    min_prompt_tokens: int = setting(64, doc="truncate_prompt keeps at least this many prompt tokens, else the "
                                     "pair is dropped")
    enable_thinking: bool = setting(False, doc="the chat template's generation prompt (as the pairs were sampled)")
    pad_multiple: int = setting(64, doc="sequence-length bucket")
    pack: bool = setting(False, doc="pack each micro-batch's chosen and rejected sequences end to end into as many "
                         "rows as it has pairs, of one of the lengths 2T x {1/4, 3/8, 1/2, 5/8, 3/4, 1} (T: the "
                         "padded length; jaxrl.data.packing); log-probs and loss unchanged")
    eval_fraction: float = setting(0.0, doc="held-out share of the pairs (seeded by pair id), scored at every "
                                   "checkpoint")
    eval_pairs: str = setting("", doc="or a separate held-out pairs file")
    expected_pairs: int = setting(0, doc="> 0: refuse a pair set of any other size (e.g. 1000 for the frozen "
                                  "cohort)")
    synthetic_pairs: int = setting(256, doc="source = synthetic: arithmetic-progression pairs "
                                   "(dpo_data.synthetic_pairs)")
    synthetic_prompt_len: int = setting(6)
    synthetic_completion_len: int = setting(4)
    synthetic_num_tokens: int = setting(0, doc="tokens [2, 2 + n) (0 = the whole vocabulary)")

    def __post_init__(self):
        if self.eval_pairs and self.eval_fraction:
            raise ValueError("set data.eval_pairs or data.eval_fraction, not both")


@dataclasses.dataclass(frozen=True)
class OnlineDataConfig:
    source: str = setting("problems", doc="problems (problems.jsonl + tokenizer + chat template) | token_task "
                          "(synthetic ids)")
    problems: str = setting("", doc="problems.jsonl (jaxrl.data.problems schema)")
    tokenizer: str = setting("", doc="HF tokenizer folder; '' = model_path")
    enable_thinking: bool = setting(False, doc="the chat template's generation prompt")
    max_prompt_len: int = setting(2048, doc="P: prompts are left-padded to it; longer prompts follow on_overlong")
    on_overlong: str = setting("skip", doc="skip (logged and counted) | error; prompts are never cut")
    prompt_len: int = setting(6, doc="source = token_task (the CPU learning task, jaxrl.rewards.toy.TokenTask)")
    num_classes: int = setting(2)
    score_tokens: int = setting(0, doc="completion tokens scored; 0 = all max_new_tokens")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """`name` and `score`; every other key of the block is a keyword argument of the reward's constructor."""

    EXTRA_KEYS = "options"
    name: str = setting("code", doc="jaxrl.rewards.get_reward name or 'module:function'")
    score: str = setting("partial", doc="the RewardResult field that is the scalar reward: partial | strict",
                         choices=REWARD_SCORES)
    options: dict = dataclasses.field(default_factory=dict)  # the reward's constructor arguments


# ------------------------------------------------------------------ the blocks online algorithms share


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """How a run talks to its rollout servers (`<algorithm>.rollout_server.*`; rollout_backend server | vllm)."""

    concurrency: int = setting(64, doc="requests in flight per server (the server batches them)")
    request_timeout_s: float = setting(0.0, doc="seconds one request may take before the rollout fails naming the "
                                       "server (a hung server); 0 = sized from the request: 60 s + 0.1 s per "
                                       "max_tokens")
    progress_every_s: float = setting(30.0, doc="while requests are out, a progress line this often: rows answered "
                                      "/ sent, per server (0 = none)")


@dataclasses.dataclass(frozen=True)
class VLLMLaunchOptions:
    """The `vllm serve` a run starts (`<algorithm>.rollout_vllm.*`; rollout_backend vllm without rollout_servers),
    as evaluation's launcher starts it (jaxrl.backends.vllm_backend.VLLMServer)."""

    python: str = setting("", doc="the vLLM environment: an interpreter or a venv folder; '' = $JAXRL_VLLM_PYTHON, "
                          "else ~/.venvs/vllm")
    tensor_parallel_size: int = setting(1)
    data_parallel_size: int = setting(1, doc="engine replicas behind one API server")
    gpu_memory_utilization: float = setting(0.90)
    extra_args: tuple = setting((), tuple, "more `vllm serve` arguments, appended verbatim")
    startup_timeout_s: float = setting(1800.0, doc="seconds to wait for the server to answer")
    max_loras: int = setting(1, doc="adapters resident at once")


@dataclasses.dataclass(frozen=True)
class SettingsBlock:
    """Base of blocks composed from shared parts: each part checks its keys in `__post_init__` and hands on to the
    next (cooperative), naming them under the block's `NAME`."""

    NAME = ""

    def __post_init__(self):
        pass


@dataclasses.dataclass(frozen=True)
class SamplingSettings(SettingsBlock):
    """How rollouts are sampled and scored in batches."""

    temperature: float = setting(1.0)
    top_p: float = setting(1.0)
    top_k: int = setting(0)
    rollout_batch_size: int = setting(0, doc="sampler rows per compiled call; 0 = the whole rollout")
    logprob_batch_size: int = setting(8, doc="rows per teacher-forced pass (reference, old log-probs, values)")

    def __post_init__(self):
        # an infinite temperature divides every logit to 0 (uniform sampling, with an overflow warning from the
        # sampler) and a negative one inverts the distribution: neither is a setting anyone means
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"{self.NAME}.temperature must be a finite number >= 0 (0 = greedy), got "
                             f"{self.temperature}")
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class PolicyLossSettings(SettingsBlock):
    """The parts of a clipped policy loss every online algorithm has."""

    entropy_coef: float = setting(0.0)
    log_entropy: bool = setting(True, doc="the `entropy` metric (one more reduction over the vocab per chunk)")
    log_ratio_clamp: float = setting(20.0, doc="the policy log-ratio is clamped to +-this before exp (verl), so an "
                                     "off-policy ratio (overlap, several passes) cannot overflow; 0 = off")

    def __post_init__(self):
        if self.log_ratio_clamp < 0:
            raise ValueError(f"{self.NAME}.log_ratio_clamp must be >= 0 (0 = off), got {self.log_ratio_clamp}")
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionSettings(SettingsBlock):
    """Importance weights for the sampler's numerics differing from the trainer's
    (jaxrl.algorithms.online.correction)."""

    rollout_correction: str = setting("none", doc="none | token_truncate | token_mask | sequence_truncate | "
                                      "sequence_mask (sequence: the geometric mean of the token ratios); weights the "
                                      "policy loss only", choices=ROLLOUT_CORRECTIONS)
    rollout_correction_min: float = setting(0.0, doc="lower bound of the weights; 0 = none")
    rollout_correction_max: float = setting(3.0, doc="upper bound of the weights (TRL's vLLM IS default)")

    def __post_init__(self):
        lo, hi = self.rollout_correction_min, self.rollout_correction_max
        if not (0.0 <= lo < 1.0 < hi):  # a weight of 1 (no mismatch) is always kept as it is
            raise ValueError(f"{self.NAME}.rollout_correction_min={lo} and rollout_correction_max={hi} must satisfy "
                             f"0 <= min < 1 < max")
        super().__post_init__()


def _server_url(url: Any) -> str:
    return str(url).rstrip("/")


@dataclasses.dataclass(frozen=True)
class RolloutBackendSettings(SettingsBlock):
    """Where rollouts are sampled (jaxrl.backends): this process, or OpenAI-compatible servers."""

    rollout_backend: str = setting("jax", doc="where rollouts are sampled: jax (this process) | server (the "
                                   "OpenAI-compatible servers at rollout_servers, e.g. launchers.serve) | vllm (vLLM "
                                   "0.33 from its own environment: started by the run, or the running servers at "
                                   "rollout_servers); before each rollout the adapter goes to every server",
                                   choices=ROLLOUT_BACKENDS)
    rollout_servers: tuple = setting((), tuple, "base URLs of the rollout servers (server: one or more; vllm: none = "
                                     "start one); each rollout's prompts are split over them")
    rollout_server: ServerOptions = block(ServerOptions, "server | vllm: how requests go to the servers")
    rollout_vllm: VLLMLaunchOptions = block(VLLMLaunchOptions, "vllm without rollout_servers: the server the run "
                                            "starts")
    rollout_backend_kwargs: dict = setting({}, dict, "deprecated: its keys go to rollout_server (concurrency, "
                                           "request_timeout_s) and rollout_vllm (the launch options), with a warning")
    max_staleness: int = setting(0, doc="rollouts sampled ahead of training, on the servers, while the trainer "
                                 "trains: a step trains on samples at most this many policy versions old (0 = "
                                 "synchronous; 1 = overlap); needs rollout_backend server | vllm")
    off_policy_loss: str = setting("behaviour", doc="the ratio of an update on rollouts sampled ahead: behaviour "
                                   "(clipped against the behaviour policy's log-probs) | decoupled (AReaL's decoupled "
                                   "PPO: clipped against the proximal policy, the parameters at the rollout's first "
                                   "step, with the behaviour policy entering as a truncated importance weight "
                                   "proximal / sampler by the rollout_correction mode, token_truncate when none); "
                                   "decoupled needs max_staleness >= 1", choices=OFF_POLICY_LOSSES)
    overlap: bool = setting(False, doc="alias of max_staleness=1 (sample rollout r+1 on the servers while rollout r "
                            "trains, off-policy by one rollout, corrected with the behaviour policy's log-probs)")
    partial_rollouts: bool = setting(False, doc="rows in flight continue under each new policy version: the "
                                     "trainer reloads its adapter in place on the servers (one name for the run) at "
                                     "every rollout's first step, and up to max_staleness rollouts run on the servers "
                                     "at once (each token records the version that sampled it); needs "
                                     "rollout_backend='server' (launchers.serve), max_staleness >= 1 and "
                                     "off_policy_loss='decoupled'")

    @classmethod
    def migrate(cls, values: dict, where: str) -> dict:
        """A completed block with server URLs normalised (no trailing '/') and the deprecated
        `rollout_backend_kwargs` moved into the typed blocks (an option set both ways must agree)."""
        values = dict(values, rollout_servers=tuple(_server_url(u) for u in values["rollout_servers"]))
        if values["overlap"]:  # the alias: one rollout ahead
            if int(values["max_staleness"]) not in (0, 1):
                raise ValueError(f"{where}.overlap is max_staleness=1 and {where}.max_staleness is "
                                 f"{values['max_staleness']}: set {where}.max_staleness only")
            values["max_staleness"] = 1
        legacy = values["rollout_backend_kwargs"]
        if not legacy:
            return values
        homes = {name: "rollout_server" for name in keys_of(ServerOptions)}
        homes.update({name: "rollout_vllm" for name in keys_of(VLLMLaunchOptions)})
        for name in legacy:
            if name not in homes:
                raise unknown_key_error(f"{where}.rollout_backend_kwargs", name, homes)
        warnings.warn(f"{where}.rollout_backend_kwargs is deprecated: set "
                      + ", ".join(f"{where}.{homes[k]}.{k}" for k in legacy) + " instead", FutureWarning,
                      stacklevel=2)
        moved = {home: dict(values[home]) for home in ("rollout_server", "rollout_vllm")}
        for name, value in legacy.items():
            block_class = ServerOptions if homes[name] == "rollout_server" else VLLMLaunchOptions
            typed = complete_block(block_class, {name: value}, f"{where}.{homes[name]}")[name]
            current, default = moved[homes[name]][name], defaults_of(block_class)[name]
            if current != default and current != typed:
                raise ValueError(f"{where}.rollout_backend_kwargs.{name}={value!r} and {where}.{homes[name]}.{name}="
                                 f"{current!r} disagree; set {where}.{homes[name]}.{name} only")
            moved[homes[name]][name] = typed
        return dict(values, **moved, rollout_backend_kwargs={})

    def __post_init__(self):
        where, backend, servers = self.NAME, self.rollout_backend, self.rollout_servers
        bad = [u for u in servers if not re.match(r"https?://[^/]+", u)]
        if bad:
            raise ValueError(f"{where}.rollout_servers: {bad} are not base URLs (http://host:port)")
        if len(set(servers)) != len(servers):
            raise ValueError(f"{where}.rollout_servers lists a server twice: {list(servers)}")
        changed = [f"{where}.{name}.{key}" for name, cls in (("rollout_server", ServerOptions),
                                                             ("rollout_vllm", VLLMLaunchOptions))
                   for key in keys_of(cls) if getattr(getattr(self, name), key) != getattr(cls, key)]
        if backend == "jax" and (servers or changed):
            raise ValueError(f"{where}.rollout_servers / {', '.join(changed) or 'rollout_server / rollout_vllm'} are "
                             f"for rollout_backend='server' or 'vllm'; {where}.rollout_backend is 'jax'")
        if backend == "server" and not servers:
            raise ValueError(f"{where}.rollout_backend='server' needs {where}.rollout_servers: the base URLs of "
                             "running servers (e.g. python -m launchers.serve --allowed_lora_roots=<workdir>)")
        launch = [key for key in changed if ".rollout_vllm." in key]
        if launch and (backend != "vllm" or servers):
            raise ValueError(f"{', '.join(launch)}: launch options of the vLLM a run starts (rollout_backend='vllm' "
                             f"without rollout_servers); {where}.rollout_backend is {backend!r}"
                             + (f" with rollout_servers {list(servers)}" if servers else ""))
        if self.max_staleness < 0:
            raise ValueError(f"{where}.max_staleness must be >= 0 (0 = synchronous), got {self.max_staleness}")
        if self.off_policy_loss == "decoupled" and not self.max_staleness:
            raise ValueError(f"{where}.off_policy_loss='decoupled' corrects updates on rollouts sampled ahead of "
                             f"training: it needs {where}.max_staleness >= 1")
        if self.partial_rollouts and (backend != "server" or not self.max_staleness
                                      or self.off_policy_loss != "decoupled"):
            raise ValueError(f"{where}.partial_rollouts continues rows across policy versions: it needs "
                             f"{where}.rollout_backend='server' (launchers.serve reports each token's version; got "
                             f"{backend!r}), {where}.max_staleness >= 1 (got {self.max_staleness}) and "
                             f"{where}.off_policy_loss='decoupled' (a row's tokens have several behaviour policies; "
                             f"got {self.off_policy_loss!r})")
        if self.max_staleness and backend == "jax":
            raise ValueError(f"{where}.max_staleness={self.max_staleness} (or overlap) samples rollouts on the servers "
                             f"while the trainer trains: it needs {where}.rollout_backend='server' or 'vllm' (the "
                             "jax sampler shares the trainer's devices)")
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class EpisodeSettings(SettingsBlock):
    """Multi-turn episodes (jaxrl/algorithms/online/episodes.py, docs/guides/episodes.md): each row is a policy and
    an environment taking turns."""

    environment: str = setting("", doc="'' = single-turn; else an environment (code_feedback, python_tool, or an "
                               "`environment` plug-in): each row is an episode of up to max_turns turns")
    environment_options: dict = setting({}, dict, "keyword arguments of the environment (code_feedback: "
                                        "public_tests, feedback_chars, score, turn_cost, reward_tests and the "
                                        "verifier's; python_tool: output_chars, tool_timeout_s, score, turn_cost and "
                                        "the verifier's)")
    max_turns: int = setting(4, doc="sampled turns per episode at most")
    max_episode_tokens: int = setting(8192, doc="E: the tokens an episode may add after its prompt (every turn and "
                                      "observation); training rows are data.max_prompt_len + E wide")

    def __post_init__(self):
        if self.environment:
            _at_least(self.NAME, {"max_turns": 1}, self)
            cap = getattr(self, "max_new_tokens", 0)
            if self.max_episode_tokens < cap:
                raise ValueError(f"{self.NAME}.max_episode_tokens={self.max_episode_tokens} must hold one turn of "
                                 f"{self.NAME}.max_new_tokens={cap}")
            if getattr(self, "overlong_buffer", 0) > 0:
                raise ValueError(f"{self.NAME}.overlong_buffer penalises one completion's length; with "
                                 f"{self.NAME}.environment set the budget is max_episode_tokens (set it to 0)")
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class OnlineSettings(EpisodeSettings, RolloutBackendSettings, RolloutCorrectionSettings, PolicyLossSettings,
                     SamplingSettings):
    """The keys GRPO and PPO share, each declared once in its part (sampling, policy loss, rollout correction,
    rollout backend, episodes); an online algorithm's block adds its own keys after them."""


# ------------------------------------------------------------------ the online algorithms


@dataclasses.dataclass(frozen=True)
class GRPOConfig(OnlineSettings):
    NAME = "grpo"
    num_generations: int = setting(8, doc="K samples per prompt (a group)")
    prompts_per_step: int = setting(20, doc="prompts per rollout (= per optimizer step when N = B_global)")
    max_new_tokens: int = setting(4096, doc="the completion cap")
    num_iterations: int = setting(1, doc="passes over each rollout (TRL num_iterations, 'mu')")
    scale_rewards: str = setting("group", doc="group | batch | none (Dr. GRPO)", choices=SCALE_REWARDS)
    advantage_estimator: str = setting("grpo", doc="grpo (honours scale_rewards) | rloo | dr_grpo | "
                                       "grpo_batch_std | a plug-in")
    epsilon_low: float = setting(0.2)
    epsilon_high: float = setting(0.2, doc="DAPO clip-higher: 0.28")
    delta: float = setting(0.0, doc="> 0: two-sided clipping, the ratio is also capped at delta (INTELLECT-2; e.g. "
                           "4.0)")
    importance_sampling_level: str = setting("token", doc="token | sequence (GSPO)",
                                             choices=IMPORTANCE_SAMPLING_LEVELS)
    beta: float = setting(0.04, doc="KL coefficient; 0 skips the reference pass")
    kl_estimator: str = setting("k3", doc="k1 | k2 | k3 | low_var_kl | abs | k3+ | a plug-in")
    aggregation: str = setting("sequence_mean", doc="sequence_mean (grpo) | token_mean (dapo) | dr_grpo",
                               choices=AGGREGATIONS)
    mask_truncated: bool = setting(False, doc="truncated completions give no gradient (still counted as "
                                   "sequences)")
    drop_zero_variance_groups: bool = setting(False, doc="groups whose rewards are all equal leave the loss and its "
                                              "normalisers")
    overlong_buffer: int = setting(0, doc="> 0: DAPO soft overlong penalty over the last `overlong_buffer` tokens "
                                   "of the cap")
    overlong_penalty: float = setting(1.0, doc="its maximum")
    recompute_old_logprobs: bool = setting(False, doc="teacher-forced old log-probs instead of the sampler's "
                                           "(forced when the compute dtype is not float32 or temperature != 1)")
    dynamic_sampling: bool = setting(False, doc="draw more prompt groups until prompts_per_step of them have "
                                     "rewards that differ (DAPO / verl filter_groups)")
    max_extra_draws: int = setting(4, doc="dynamic_sampling: at most this many extra draws of prompts_per_step "
                                   "prompts per rollout; then the step trains on what it has")

    def __post_init__(self):
        _at_least("grpo", {"num_generations": 1, "prompts_per_step": 1, "max_new_tokens": 1, "num_iterations": 1,
                           "max_extra_draws": 0}, self)
        if self.delta and self.delta <= 1.0 + self.epsilon_high:
            raise ValueError(f"grpo.delta={self.delta} must exceed 1 + grpo.epsilon_high (or be 0 = off)")
        super().__post_init__()

    @property
    def rows_per_rollout(self) -> int:
        return self.prompts_per_step * self.num_generations


@dataclasses.dataclass(frozen=True)
class PPOConfig(OnlineSettings):
    NAME = "ppo"
    prompts_per_rollout: int = setting(32)
    num_generations: int = setting(1, doc="samples per prompt")
    max_new_tokens: int = setting(1024)
    init_kl_coef: float = setting(0.05)
    adaptive_kl: bool = setting(False, doc="TRL: fixed; True: Ziegler et al. (verl / OpenRLHF)")
    kl_target: float = setting(0.1, doc="KL the adaptive controller steers to: the mean over sequences of their "
                               "token-mean KL (verl, OpenRLHF)")
    kl_horizon: float = setting(10000.0)
    kl_estimator: str = setting("k1", doc="k1 | k3 (or any registered kl)")
    gamma: float = setting(1.0)
    lam: float = setting(0.95)
    whiten_rewards: bool = setting(False)
    whiten_advantages: bool = setting(True)
    cliprange: float = setting(0.2)
    cliprange_value: float = setting(0.2, doc="0 = unclipped value loss")
    vf_coef: float = setting(0.1)
    epochs: int = setting(4, doc="passes over each rollout")
    minibatches: int = setting(1, doc="global batches per pass: prompts_per_rollout x num_generations = minibatches "
                               "x B_global")
    value_head_detach: bool = setting(False, doc="True: the value loss trains only the head (no gradient into the "
                                      "LoRA factors)")
    value_learning_rate: float = setting(0.0, doc="the value head's (peak) learning rate; 0 = "
                                         "optimizer.learning_rate")
    dual_clip: float = setting(0.0, doc="> 1: for A < 0 the policy loss is capped at -A * dual_clip (verl "
                               "clip_ratio_c = 3); 0 = off")
    critic_warmup_steps: int = setting(0, doc="train steps at the start in which only the value head trains")

    def __post_init__(self):
        _at_least("ppo", {"prompts_per_rollout": 1, "num_generations": 1, "max_new_tokens": 1, "epochs": 1,
                          "minibatches": 1, "critic_warmup_steps": 0}, self)
        if self.init_kl_coef < 0:
            raise ValueError(f"ppo.init_kl_coef must be >= 0, got {self.init_kl_coef}")
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ValueError(f"ppo.dual_clip={self.dual_clip} must exceed 1 (or be 0 = off)")
        super().__post_init__()

    @property
    def rows_per_rollout(self) -> int:
        return self.prompts_per_rollout * self.num_generations


@dataclasses.dataclass(frozen=True)
class DistillConfig(RolloutBackendSettings, SamplingSettings):
    """On-policy distillation (jaxrl.algorithms.distill_task): the student samples as GRPO does (the sampling and
    rollout backend parts), a frozen teacher scores every completion token. One update per rollout, on-policy:
    prompts_per_step x num_generations = B_global. `temperature` (sampling) is also the divergences' temperature
    (GKD); the teacher's support is `teacher_top_k`, apart from `top_k`, the sampling filter."""

    NAME = "distill"
    teacher_path: str = setting("", doc="the teacher: an HF folder with the student's vocabulary and tokenizer "
                                "(required)")
    teacher_adapter: str = setting("", doc="a PEFT adapter folder applied to teacher_path; '' = the folder as it is")
    teacher_backend: str = setting("jax", doc="jax: the teacher in this process, frozen, in `dtype`, sharded over "
                                   "the run's mesh like the policy's base | server: the OpenAI-compatible servers "
                                   "at teacher_servers score the rows (launchers.serve of the teacher folder: echo "
                                   "+ logprobs) | vllm: running `vllm serve` of the teacher at teacher_servers "
                                   "(prompt_logprobs; --max-logprobs >= teacher_top_k); server and vllm: "
                                   "temperature 1 only", choices=TEACHER_BACKENDS)
    teacher_servers: tuple = setting((), tuple, "teacher_backend server | vllm: base URLs of servers of the "
                                     "teacher; a step's rows are split over them")
    teacher_server: ServerOptions = block(ServerOptions, "teacher_backend server | vllm: how requests go to the "
                                          "teacher servers")
    loss: str = setting("reverse_kl", doc="reverse_kl (the sampled token's teacher - student log-prob as a "
                        "per-token advantage) | jsd (GKD generalized JSD, jsd_beta) | forward_kl_topk; the last two "
                        "over the teacher's top-k plus a remainder bucket", choices=DISTILL_LOSSES)
    teacher_top_k: int = setting(16, doc="k of the teacher's support (jsd, forward_kl_topk, and the metrics' "
                                 "top-1 agreement and outside-top-k fraction)")
    jsd_beta: float = setting(0.5, doc="jsd: 0 = forward KL(teacher||student), 1 = reverse KL(student||teacher)")
    lmbda: float = setting(1.0, doc="GKD lambda: the fraction of a step's prompts the student samples (in whole "
                           "groups); the other rows are responses of sft_path (0 = supervised KD)")
    sft_path: str = setting("", doc="lmbda < 1: JSON Lines of {'input_ids', 'loss_mask'} (the SFT format); the "
                            "prompt is the tokens before the first loss_mask 1, the response the rest")
    reward_weight: float = setting(0.0, doc="> 0: the verifier reward's group advantage (reward - group mean) "
                                    "times this is added to the distillation advantage; 0 = pure distillation")
    num_generations: int = setting(4, doc="samples per prompt")
    prompts_per_step: int = setting(20, doc="prompts per step; x num_generations = batch.global_batch")
    max_new_tokens: int = setting(4096, doc="the completion cap (and the SFT responses' width)")

    def __post_init__(self):
        _at_least("distill", {"num_generations": 1, "prompts_per_step": 1, "max_new_tokens": 1,
                              "teacher_top_k": 1}, self)
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"distill.lmbda={self.lmbda} must be in [0, 1] (the student's share of a step's rows)")
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise ValueError(f"distill.jsd_beta={self.jsd_beta} must be in [0, 1]")
        if self.lmbda < 1.0 and not self.sft_path:
            raise ValueError(f"distill.lmbda={self.lmbda} < 1 takes the other rows from distill.sft_path: set it")
        if self.loss == "reverse_kl" and self.lmbda != 1.0:
            raise ValueError(f"distill.loss='reverse_kl' is an on-policy estimator (the student's own samples): it "
                             f"needs distill.lmbda=1, got {self.lmbda}; use loss jsd or forward_kl_topk for a mix")
        if self.reward_weight and self.num_generations < 2:
            raise ValueError("distill.reward_weight needs num_generations >= 2 (its advantage is reward - group "
                             "mean)")
        if self.max_staleness or self.overlap:
            raise ValueError("distill.max_staleness / distill.overlap: distillation trains on-policy (one update per "
                             "rollout, sampled by the policy it updates); leave them at 0 / False")
        self._check_teacher_servers()
        super().__post_init__()

    @classmethod
    def migrate(cls, values: dict, where: str) -> dict:
        values = super().migrate(values, where)
        return dict(values, teacher_servers=tuple(_server_url(u) for u in values["teacher_servers"]))

    def _check_teacher_servers(self):
        servers = self.teacher_servers
        changed = [f"distill.teacher_server.{key}" for key in keys_of(ServerOptions)
                   if getattr(self.teacher_server, key) != getattr(ServerOptions, key)]
        backend = self.teacher_backend
        if backend not in SERVED_TEACHERS:
            if servers or changed:
                raise ValueError(f"distill.teacher_servers / {', '.join(changed) or 'teacher_server'} are for "
                                 f"teacher_backend 'server' | 'vllm'; distill.teacher_backend is {backend!r}")
            return
        if not servers:
            how = "vllm serve <teacher_path> --max-logprobs=<teacher_top_k>" if backend == "vllm" else \
                "python -m launchers.serve --base=<teacher_path> --dtype=float32"
            raise ValueError(f"distill.teacher_backend={backend!r} needs distill.teacher_servers: the base URLs of "
                             f"servers of the teacher ({how})")
        bad = [u for u in servers if not re.match(r"https?://[^/]+", u)]
        if bad:
            raise ValueError(f"distill.teacher_servers: {bad} are not base URLs (http://host:port)")
        if len(set(servers)) != len(servers):
            raise ValueError(f"distill.teacher_servers lists a server twice: {list(servers)}")
        # a server's log-probs are at temperature 1 (vLLM's raw_logprobs, ours alike): the top k of p^(1/T) are the
        # same tokens, but their renormalisation needs the whole vocabulary's mass, which k entries do not carry
        if self.temperature != 1.0:
            raise ValueError(f"distill.teacher_backend={backend!r} scores at temperature 1 (what the servers return); "
                             f"distill.temperature is {self.temperature}: set it to 1.0 or use teacher_backend='jax'")
        if self.teacher_adapter:
            raise ValueError(f"distill.teacher_adapter is applied in this process (teacher_backend='jax'); for "
                             f"teacher_backend={backend!r} serve the merged teacher (launchers.export) as the base")

    @property
    def rows_per_rollout(self) -> int:
        return self.prompts_per_step * self.num_generations


ALGORITHMS = {
    "sft": {"data": SFTDataConfig},
    "dpo": {"dpo": DPOConfig, "data": DPODataConfig},
    "grpo": {"grpo": GRPOConfig, "data": OnlineDataConfig, "reward": RewardConfig},
    "ppo": {"ppo": PPOConfig, "data": OnlineDataConfig, "reward": RewardConfig},
    "distill": {"distill": DistillConfig, "data": OnlineDataConfig, "reward": RewardConfig},
}
# Labels the family configs (configs/dpo.py, grpo.py, ppo.py) record in config.json; no code reads them.
LABELS = {
    "run": "the family config's named run (configs/dpo.py run=...)",
    "start": "which weights model_path points to (base | m0)",
    "probe": "the family config's named probe (configs/grpo.py probe=...)",
}
ALGORITHM_LABELS = {"dpo": ("run", "start"), "grpo": ("run", "start", "probe"), "ppo": ("run", "start"),
                    "distill": ("run", "start")}
OPEN_DATA = None  # the `data` block of an algorithm that declares no blocks: taken as it is

# ------------------------------------------------------------------------------------------------ the run


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A run's whole config. The core reads the top-level keys and `optimizer`, `lora`, `batch`, `mesh`; each
    algorithm its own blocks (`data` and `dpo` | `grpo` | `ppo` | `distill`, `reward`); a user's algorithm its declared
    blocks in `blocks`."""

    algorithm: str = setting("sft", doc="a registered algorithm: sft | dpo | grpo | ppo | distill | "
                             "'pkg.module:factory'")
    model_path: str = setting("", doc="HF folder (container or text-only); empty: random init of `model_preset`")
    model_preset: str = setting("tiny", doc="qwen35.PRESETS key used when model_path is empty")
    model_overrides: dict = setting({}, dict, "Qwen35Config fields replacing the preset's (random init only)")
    model_seed: int = setting(0, doc="init seed of a preset model")
    dtype: str = setting("bfloat16", doc="base weights and compute; LoRA factors are always fp32")
    remat: str = setting("auto", doc="activation rematerialisation of the training forward: auto (the least "
                         "recomputation whose estimated activations fit half the device memory after the weights) | "
                         "none | matmuls (keep projection outputs) | attention (keep attention / GDN outputs) | full "
                         "| dots | dots_no_batch")
    scan_layers: Optional[bool] = setting(None, (bool, type(None)), "training forward: jax.lax.scan over the "
                                          "repeating block of layers (Qwen3.5: three Gated DeltaNet, one attention), "
                                          "one compiled body instead of every layer unrolled. None: scan when the "
                                          "pass rematerialises its layers (the remat policy, after auto's choice, is "
                                          "not none: the 4B and 9B at their training shapes), unrolled when it keeps "
                                          "every activation (remat none: the tiny and benchmark models); True | "
                                          "False: always | never. Layers that do not repeat (or LoRA on some layers "
                                          "only) run unrolled, with one log line; decode is always unrolled")
    gdn_chunk_size: int = setting(0, doc="tokens per chunk of the chunked Gated DeltaNet form (training, prefill); "
                                  "0: auto, the key head dim within 16..64 (64 for the 4B and 9B; 16 for a tiny "
                                  "model)")
    gdn_state_dtype: str = setting("float32", doc="storage dtype of the Gated DeltaNet state in decode caches: "
                                   "float32 | bfloat16 (half the bytes a decode step moves; fp32 math either way; "
                                   "drift in docs/guides/benchmarks.md)")
    attention_implementation: str = setting("auto", doc="full-attention kernel: auto (cudnn on a GPU with "
                                            "bf16/fp16, else xla) | cudnn | xla")
    steps: int = setting(125, doc="train steps (global batches); the schedule's length")
    checkpoint_every: int = setting(4, doc="adapter + training state every N steps (and at the end)")
    keep_checkpoints: Optional[int] = setting(2, (int, type(None)), "full training states kept (adapters are all "
                                              "kept); None: all")
    checkpoint_async: bool = setting(True, doc="write checkpoints in the background")
    seed: int = setting(0, doc="LoRA init, dropout, data order")
    max_consecutive_nonfinite: int = setting(10, doc="stop (with a checkpoint) after this many skipped updates in "
                                             "a row; 0 never")
    log_every: int = setting(1, doc="console log cadence when not on a terminal (metrics.jsonl gets every step)")
    tensorboard: bool = setting(True, doc="TensorBoard event files beside metrics.jsonl")
    logprob_chunk_size: int = setting(512, doc="rows per chunk of the chunked log-prob over the vocab")
    compile_options: dict = setting({}, dict, "XLA options of every jitted program of the run (normally none)")
    plugins: Any = setting((), (tuple, list, str, dict), "user objectives loaded and checked before the model is "
                           "built (jaxrl.algorithms.plugins): {'kind', 'name', 'path'} entries or "
                           "'kind:name=file.py:fn'")
    run: str = setting("", doc=LABELS["run"])
    start: str = setting("", doc=LABELS["start"])
    probe: str = setting("", doc=LABELS["probe"])
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    batch: BatchConfig = dataclasses.field(default_factory=BatchConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    ema: EMAConfig = dataclasses.field(default_factory=EMAConfig)
    data: Any = None  # SFTDataConfig | DPODataConfig | OnlineDataConfig | a user algorithm's block | dict
    dpo: Optional[DPOConfig] = None
    grpo: Optional[GRPOConfig] = None
    ppo: Optional[PPOConfig] = None
    distill: Optional[DistillConfig] = None
    reward: Optional[RewardConfig] = None
    blocks: dict = dataclasses.field(default_factory=dict)  # a user algorithm's other declared blocks, by name

    def __post_init__(self):
        bad = []
        for key, minimum in (("steps", 1), ("batch.micro_batch_size", 1), ("batch.grad_accum", 1),
                             ("checkpoint_every", 1), ("log_every", 1), ("max_consecutive_nonfinite", 0)):
            value = self
            for part in key.split("."):
                value = getattr(value, part)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                bad.append(f"{key} must be an integer >= {minimum}, got {value!r}")
        keep = self.keep_checkpoints
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            bad.append(f"keep_checkpoints must be an integer >= 1 (or None to keep all), got {keep!r}")
        bad += [m for m in (seed_problem(self.seed, "seed"), seed_problem(self.model_seed, "model_seed")) if m]
        if bad:
            raise ValueError("config: " + "; ".join(bad))

    def block(self, name: str) -> Any:
        """An algorithm block by name (`data`, `dpo`, ..., or a user algorithm's declared block)."""
        if name in _ALGORITHM_FIELDS:
            return getattr(self, name)
        return self.blocks.get(name)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        """Every key as plain JSON values: what config.json holds (and what `resolve` reads back)."""
        out = {k: to_plain(getattr(self, k)) for k in _TOP_KEYS}
        out.update({k: getattr(self, k) for k in ALGORITHM_LABELS.get(self.algorithm, ())})
        out.update({name: to_plain(getattr(self, name)) for name in CORE_BLOCKS})
        for name in (*_ALGORITHM_FIELDS, *self.blocks):
            value = self.block(name)
            if value is None:
                continue
            out[name] = _block_json(value)
        return out


def _block_json(value: Any) -> dict:
    plain = to_plain(value)
    extra = getattr(type(value), "EXTRA_KEYS", None)
    if extra:  # the extra keys stand beside the declared ones, as in the config
        plain.update(plain.pop(extra))
    return plain


_ALGORITHM_FIELDS = ("data", "dpo", "grpo", "ppo", "distill", "reward")
_TOP_KEYS = tuple(k for k in keys_of(TrainConfig) if k not in LABELS and k not in CORE_BLOCKS
                  and k not in _ALGORITHM_FIELDS and k != "blocks")


def default_of(key: str) -> Any:
    """The default of a top-level key (e.g. the model's compute settings share them)."""
    return keys_of(TrainConfig)[key].default


def _algorithm_blocks(algorithm: str, blocks: Optional[Mapping[str, Any]]) -> dict:
    """{block name: config dataclass or None (taken as it is)} of a run of `algorithm`."""
    if blocks is not None:
        return dict(blocks)
    return dict(ALGORITHMS.get(algorithm, {"data": OPEN_DATA}))


def _top_items(config: Any) -> list:
    if config is None:
        return []
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ConfigKeyError(f"a config is a block of keys, got {type(config).__name__}")
    return list(config.items())


def complete(config: Any, blocks: Optional[Mapping[str, Any]] = None, *, strict: bool = True) -> dict:
    """`config` (a ConfigDict or mapping) as plain JSON with every key of its algorithm at its default where
    missing, each key and type checked: what config.json holds. `blocks`: the declared blocks of a user's
    algorithm ({name: config dataclass or None}); `strict`: a top-level key nobody reads is an error."""
    items = dict(_top_items(config))
    algorithm = items.get("algorithm") or TrainConfig.algorithm
    top_keys = keys_of(TrainConfig)
    top_keys["algorithm"].check("algorithm", algorithm)
    own = _algorithm_blocks(algorithm, blocks)
    labels = ALGORITHM_LABELS.get(algorithm, ())
    valid_top = [k for k in _TOP_KEYS] + list(labels)
    valid = valid_top + list(CORE_BLOCKS) + list(own)
    out = {}
    for key in _TOP_KEYS + labels:
        if key in items:
            top_keys[key].check(key, items[key])
            out[key] = to_plain(top_keys[key].convert(items[key]))
        else:
            out[key] = to_plain(top_keys[key].default)
    out["algorithm"] = algorithm
    for name, cls in CORE_BLOCKS.items():
        out[name] = to_plain(complete_block(cls, items.get(name), name))
    for name, cls in own.items():
        value = items.get(name)
        if cls is None:
            out[name] = to_plain(value) if value is not None else {}
        else:
            out[name] = to_plain(complete_block(cls, value, name))
    for key in items:
        if key in valid:
            continue
        if strict:
            raise unknown_key_error("", key, valid)
        out[key] = to_plain(items[key])  # a block of an algorithm whose declared blocks are not known here
    return out


def resolve(config: Any, blocks: Optional[Mapping[str, Any]] = None) -> TrainConfig:
    """The TrainConfig of `config` (a ConfigDict, a mapping such as a config.json, or a TrainConfig, returned as
    it is): `complete`, then every block built and validated. ConfigKeyError / ValueError naming the key."""
    if isinstance(config, TrainConfig):
        return config
    full = complete(config, blocks)
    own = _algorithm_blocks(full["algorithm"], blocks)
    kwargs = {k: full[k] for k in _TOP_KEYS}
    kwargs.update({k: full[k] for k in ALGORITHM_LABELS.get(full["algorithm"], ())})
    kwargs["plugins"] = _frozen(full["plugins"])
    kwargs.update({name: build_block(cls, full[name], name) for name, cls in CORE_BLOCKS.items()})
    extra_blocks = {}
    for name, cls in own.items():
        value = full[name] if cls is None else build_block(cls, full[name], name)
        if name in _ALGORITHM_FIELDS:
            kwargs[name] = value
        else:
            extra_blocks[name] = value
    return TrainConfig(**kwargs, blocks=extra_blocks)


def _frozen(value: Any) -> Any:
    """Lists as tuples (the dataclass is frozen; config.json writes them back as lists)."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def default_config(algorithm: str = "sft") -> ml_collections.ConfigDict:
    """Every key a run of the built-in `algorithm` reads, at its default (what configs/base.py returns)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"default_config: algorithm={algorithm!r}; built-in algorithms: {sorted(ALGORITHMS)}")
    values = {k: to_plain(v.default) if isinstance(v.default, dict) else _config_value(v)
              for k, v in keys_of(TrainConfig).items()
              if k in _TOP_KEYS or k in ALGORITHM_LABELS.get(algorithm, ())}
    values["algorithm"] = algorithm
    for name, cls in {**CORE_BLOCKS, **ALGORITHMS[algorithm]}.items():
        values[name] = {k: _config_value(key) for k, key in keys_of(cls).items()}
    return ml_collections.ConfigDict(values)


def _config_value(key) -> Any:
    """A key's default as a ConfigDict holds it: a None default of an optional float (`ema.decay`) or bool
    (`scan_layers`) as a typed placeholder, so that `--config.ema.decay=0.99` can set it (ml_collections refuses to
    override a plain None); a nested block as the dict of its keys."""
    if key.block:
        return {k: _config_value(sub) for k, sub in keys_of(key.block).items()}
    types = key.types if isinstance(key.types, tuple) else (key.types,)
    given = [t for t in types if t is not type(None)]
    if key.default is None and len(given) == 1 and given[0] in (int, float, str, bool):
        return ml_collections.config_dict.placeholder(given[0])
    return copy.deepcopy(key.default)
