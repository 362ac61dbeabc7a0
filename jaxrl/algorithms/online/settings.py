"""The parts of the online algorithms' blocks that jaxrl/algorithms/online owns, each declaring its keys once: the
data (`OnlineDataConfig`, the `data.*` block), how rollouts are sampled (`SamplingSettings`), the policy loss's
common keys (`PolicyLossSettings`), the reference's resets (`ReferenceSettings`), the rollout correction
(`RolloutCorrectionSettings`) and the asynchronous policy
(`AsyncSettings`: sampling ahead, partial rollouts, the off-policy loss; the rollout controller acts on it). GRPO and
PPO compose all of them with the backends' and the environments' parts (`OnlineSettings`); distillation composes
the sampling and the backend only (it trains on-policy).

    class GRPOConfig(OnlineSettings):  NAME = "grpo"; num_generations: int = setting(8, ...)

No jax here: configs import this module.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrl.backends.settings import JaxRollout, RolloutBackendSettings, ServerRollout
from jaxrl.environments.settings import EpisodeSettings
from jaxrl.utils.typed_config import Block, setting

__all__ = ["AsyncPolicy", "AsyncSettings", "OFF_POLICY_LOSSES", "OnlineDataConfig", "OnlineSettings",
           "PolicyLossSettings", "ROLLOUT_CORRECTIONS", "SAMPLERS", "ReferenceSettings", "RolloutCorrectionSettings",
           "SamplingSettings"]

ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
OFF_POLICY_LOSSES = ("behaviour", "decoupled")  # the ratio of updates on rollouts sampled ahead (max_staleness)
SAMPLERS = ("uniform", "curriculum")  # how an online run's prompts are drawn (data.sampler)


@dataclasses.dataclass(frozen=True)
class OnlineDataConfig(Block):
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
    sampler: str = setting("uniform", doc="uniform (the epoch stream of the problems) | curriculum (prompts whose "
                           "last curriculum_window groups were all solved or all failed are set aside for "
                           "curriculum_set_aside rollouts, then revisited; jaxrl.algorithms.online.difficulty)",
                           choices=SAMPLERS)
    curriculum_window: int = setting(1, doc="the groups of a prompt, most recent first, that decide whether it is too "
                                     "easy or too hard (each prompt's record is kept with either sampler)")
    curriculum_set_aside: int = setting(8, doc="rollouts a too easy or too hard prompt is left out before it is "
                                        "revisited")
    curriculum_solved: float = setting(1.0, doc="a group whose mean reward is at least this counts as solved")
    curriculum_failed: float = setting(0.0, doc="a group whose mean reward is at most this counts as failed")

    def __post_init__(self):
        if self.curriculum_window < 1 or self.curriculum_set_aside < 1:
            raise ValueError(f"data.curriculum_window={self.curriculum_window} and data.curriculum_set_aside="
                             f"{self.curriculum_set_aside} must be >= 1")
        if not self.curriculum_failed < self.curriculum_solved:
            raise ValueError(f"data.curriculum_failed={self.curriculum_failed} must be below data.curriculum_solved="
                             f"{self.curriculum_solved}")
        if self.sampler == "curriculum" and self.source != "problems":
            raise ValueError(f"data.sampler='curriculum' sets prompts of a pool aside: it needs data.source="
                             f"'problems' (got {self.source!r}, whose prompts are new every rollout)")
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class SamplingSettings(Block):
    """How rollouts are sampled and scored in batches."""

    temperature: float = setting(1.0)
    top_p: float = setting(1.0)
    top_k: int = setting(0)
    rollout_batch_size: int = setting(0, doc="sampler rows per compiled call; 0 = the whole rollout")
    logprob_batch_size: int = setting(8, doc="rows per teacher-forced pass (reference, old log-probs, values)")
    layout: str = setting("auto", doc="rows of the teacher-forced passes and the train step: auto (per batch, the "
                          "layout computing the fewest row tokens if at most 0.8 of the padded ones: packed for rows "
                          ">= 1024 tokens, shared_prefix for prompts >= 256 columns shared by aligned groups; else "
                          "padded; logged with the reason) | padded | packed (jaxrl/algorithms/online/layout.py) | "
                          "shared_prefix (each group's prompt computed once, its completions continuing from the "
                          "prompt's caches: jaxrl/algorithms/online/shared_prefix.py)",
                          choices=("auto", "padded", "packed", "shared_prefix"))

    def __post_init__(self):
        # an infinite temperature divides every logit to 0 (uniform sampling, with an overflow warning from the
        # sampler) and a negative one inverts the distribution: neither is a setting anyone means
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"{self.NAME}.temperature must be a finite number >= 0 (0 = greedy), got "
                             f"{self.temperature}")
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class PolicyLossSettings(Block):
    """The policy loss every online algorithm has: which one (jaxrl.algorithms.policy_loss, where the names are
    checked once the plug-ins are loaded), its own options, and the parts they all share. The block that composes
    this part says what its clip keys are (`policy_loss_common`)."""

    policy_loss: str = setting("ppo_clip", doc="the policy term: ppo_clip (the clipped surrogate) | gspo | cispo | "
                               "sapo | gmpo | kl_cov | clip_cov | a policy_loss plug-in (docs/guides/ablations.md)")
    policy_loss_options: dict = setting({}, dict, "the policy loss's own options (sapo: tau_pos, tau_neg; kl_cov: "
                                        "kl_cov_ratio, kl_cov_coef; clip_cov: clip_cov_ratio, clip_cov_lb, "
                                        "clip_cov_ub; a plug-in: its own); the clip window stays the block's keys")
    entropy_coef: float = setting(0.0)
    log_entropy: bool = setting(True, doc="the `entropy` metric (one more reduction over the vocab per chunk)")
    log_ratio_clamp: float = setting(20.0, doc="the policy log-ratio is clamped to +-this before exp (verl), so an "
                                     "off-policy ratio (overlap, several passes) cannot overflow; 0 = off")

    def policy_loss_common(self) -> dict:
        """The block's clip keys under the policy losses' names (jaxrl.algorithms.policy_loss.COMMON_KEYS; None =
        off)."""
        raise NotImplementedError(f"{type(self).__name__} composes PolicyLossSettings: it must define "
                                  "policy_loss_common()")

    def __post_init__(self):
        if self.log_ratio_clamp < 0:
            raise ValueError(f"{self.NAME}.log_ratio_clamp must be >= 0 (0 = off), got {self.log_ratio_clamp}")
        if not self.policy_loss or not isinstance(self.policy_loss, str):
            raise ValueError(f"{self.NAME}.policy_loss must name a policy loss, got {self.policy_loss!r}")
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionSettings(Block):
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


@dataclasses.dataclass(frozen=True)
class ReferenceSettings(Block):
    """The KL anchor of a long run (jaxrl.algorithms.online.reference)."""

    ref_reset_every: int = setting(0, doc="> 0: every this many rollouts the reference becomes the policy that "
                                   "samples that rollout (its adapters, kept in <workdir>/reference/), logged as "
                                   "reference/reset; 0 = the base model throughout")
    ref_reset_optimizer: bool = setting(False, doc="with ref_reset_every: at each reset the optimizer's Adam moments "
                                        "(and their bias-correction count) start over, logged as optimizer/reset; "
                                        "the learning-rate schedule goes on")

    def __post_init__(self):
        if self.ref_reset_every < 0:
            raise ValueError(f"{self.NAME}.ref_reset_every must be >= 0 (0 = never), got {self.ref_reset_every}")
        if self.ref_reset_optimizer and not self.ref_reset_every:
            raise ValueError(f"{self.NAME}.ref_reset_optimizer=True needs {self.NAME}.ref_reset_every > 0 (the "
                             "moments start over at the reference's resets)")
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class AsyncPolicy:
    """How far rollouts run ahead of training, as the rollout controller takes it (made once from the block:
    `AsyncSettings.async_policy`). `max_staleness` k: rollouts sampled ahead (0 = synchronous); `partial`: rows
    in flight continue under each new version; `decoupled`: the off-policy loss is AReaL's decoupled objective."""

    max_staleness: int = 0
    partial: bool = False
    decoupled: bool = False

    @property
    def ahead(self) -> bool:
        """Whether any rollout is sampled ahead of training (k > 0)."""
        return self.max_staleness > 0


@dataclasses.dataclass(frozen=True)
class AsyncSettings(RolloutBackendSettings):
    """Rollouts sampled ahead of training on the servers (jaxrl.algorithms.online.controller): composed only by the
    algorithms that honour it (GRPO, PPO), over the backend part it needs (servers sample while the trainer
    trains). `overlap` is an alias of max_staleness=1."""

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

    @property
    def async_policy(self) -> AsyncPolicy:
        return AsyncPolicy(int(self.max_staleness), bool(self.partial_rollouts),
                           bool(self.max_staleness) and self.off_policy_loss == "decoupled")

    @classmethod
    def migrate(cls, values: dict, where: str) -> dict:
        """The backend's migration, then the alias: overlap is max_staleness=1."""
        values = super().migrate(values, where)
        if values["overlap"]:
            if int(values["max_staleness"]) not in (0, 1):
                raise ValueError(f"{where}.overlap is max_staleness=1 and {where}.max_staleness is "
                                 f"{values['max_staleness']}: set {where}.max_staleness only")
            values = dict(values, max_staleness=1)
        return values

    def __post_init__(self):
        super().__post_init__()  # the backend's own checks first: these read its choice
        where, backend = self.NAME, self.rollout_backend
        if self.max_staleness < 0:
            raise ValueError(f"{where}.max_staleness must be >= 0 (0 = synchronous), got {self.max_staleness}")
        if self.off_policy_loss == "decoupled" and not self.max_staleness:
            raise ValueError(f"{where}.off_policy_loss='decoupled' corrects updates on rollouts sampled ahead of "
                             f"training: it needs {where}.max_staleness >= 1")
        if self.partial_rollouts:
            unmet = [need for ok, need in (
                (backend == ServerRollout.name, f"{where}.rollout_backend='server' (launchers.serve reports each "
                                                f"token's version; got {backend!r})"),
                (self.max_staleness >= 1, f"{where}.max_staleness >= 1 (got {self.max_staleness})"),
                (self.off_policy_loss == "decoupled", f"{where}.off_policy_loss='decoupled' (a row's tokens have "
                                                      f"several behaviour policies; got {self.off_policy_loss!r})"))
                if not ok]
            if unmet:
                raise ValueError(f"{where}.partial_rollouts continues rows across policy versions: it needs "
                                 + " and ".join(unmet))
        if self.max_staleness and backend == JaxRollout.name:
            raise ValueError(f"{where}.max_staleness={self.max_staleness} (or overlap) samples rollouts on the servers "
                             f"while the trainer trains: it needs {where}.rollout_backend='server' or 'vllm' (the "
                             "jax sampler shares the trainer's devices)")


@dataclasses.dataclass(frozen=True)
class OnlineSettings(EpisodeSettings, AsyncSettings, RolloutCorrectionSettings, ReferenceSettings,
                     PolicyLossSettings, SamplingSettings):
    """The keys GRPO and PPO share, each declared once in its part (sampling, policy loss, rollout correction,
    rollout backend and the asynchronous policy over it, episodes); an online algorithm's block adds its own keys
    after them."""
