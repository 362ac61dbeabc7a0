"""`algorithm = "grpo"`: its config blocks (`BLOCKS`, registered in jaxrl.algorithms.tasks; the task:
jaxrl.algorithms.grpo_task; the loss: jaxrl.algorithms.grpo, which takes its choices from here). No jax here:
configs import this module."""

from __future__ import annotations

import dataclasses

from jaxrl.algorithms.online.settings import OnlineDataConfig, OnlineSettings
from jaxrl.rewards.settings import RewardConfig
from jaxrl.utils.typed_config import at_least, setting

__all__ = ["AGGREGATIONS", "BLOCKS", "GRPOConfig", "IMPORTANCE_SAMPLING_LEVELS", "SCALE_REWARDS"]

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sequence_mean", "token_mean", "dr_grpo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# the built-in estimators that read the loss mask and the KL in the reward (jaxrl.algorithms.grpo.TOKEN_LEVEL)
TOKEN_LEVEL_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


@dataclasses.dataclass(frozen=True)
class GRPOConfig(OnlineSettings):
    NAME = "grpo"
    num_generations: int = setting(8, doc="K samples per prompt (a group)")
    prompts_per_step: int = setting(20, doc="prompts per rollout (= per optimizer step when N = B_global)")
    max_new_tokens: int = setting(4096, doc="the completion cap")
    num_iterations: int = setting(1, doc="passes over each rollout (TRL num_iterations, 'mu')")
    scale_rewards: str = setting("group", doc="group | batch | none (Dr. GRPO)", choices=SCALE_REWARDS)
    advantage_estimator: str = setting("grpo", doc="grpo (honours scale_rewards) | rloo | dr_grpo | "
                                       "grpo_batch_std | pass_at_k (verl grpo_passk; PKPO below the group size: "
                                       "pass_at_k_k) | reinforce_plus_plus | "
                                       "reinforce_plus_plus_baseline (token-level, whitened over the rollout) | "
                                       "a plug-in")
    pass_at_k_k: int = setting(0, doc="k of advantage_estimator='pass_at_k': 0 = the group size (verl's "
                               "grpo_passk: the best sample only); 2..num_generations - 1: PKPO's k - 1 leave-one-out "
                               "transform (every sample its average gain to the best of k)")
    kl_in_reward: float = setting(0.0, doc="> 0: this times the KL to the reference (k1 of the behaviour "
                                  "log-probs) is taken from each token's reward (REINFORCE++: OpenRLHF init_kl_coef, "
                                  "verl use_kl_in_reward); for the reinforce_plus_plus estimators")
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
    replay_groups: int = setting(0, doc="> 0: a group whose rewards all agree is replaced by a kept group of an "
                                 "earlier rollout whose rewards differed (newest first, at most this many per "
                                 "rollout; TRL PR #4060; the step is then off-policy: the ratio corrects the "
                                 "staleness); jaxrl.algorithms.online.replay")
    replay_max_age: int = setting(4, doc="replay_groups: kept groups at most this many rollouts old")

    def __post_init__(self):
        at_least("grpo", {"num_generations": 1, "prompts_per_step": 1, "max_new_tokens": 1, "num_iterations": 1,
                          "max_extra_draws": 0}, self)
        if not self.kl_in_reward >= 0:
            raise ValueError(f"grpo.kl_in_reward must be >= 0 (0 = off), got {self.kl_in_reward}")
        if self.kl_in_reward and self.advantage_estimator not in TOKEN_LEVEL_ESTIMATORS:
            raise ValueError(f"grpo.kl_in_reward puts the KL in each token's reward: it needs a token-level "
                             f"advantage_estimator ({' | '.join(TOKEN_LEVEL_ESTIMATORS)}), got "
                             f"{self.advantage_estimator!r}")
        if self.pass_at_k_k and not (self.advantage_estimator == "pass_at_k"
                                     and 2 <= self.pass_at_k_k <= self.num_generations):
            raise ValueError(f"grpo.pass_at_k_k={self.pass_at_k_k} is the k of advantage_estimator='pass_at_k' "
                             f"(got {self.advantage_estimator!r}): 0 (the group size) or 2..num_generations "
                             f"({self.num_generations})")
        at_least("grpo", {"replay_groups": 0, "replay_max_age": 1}, self)
        if self.replay_groups and self.max_staleness:
            raise ValueError(f"grpo.replay_groups replays groups of the rollouts before this one: it needs "
                             f"grpo.max_staleness=0 (got {self.max_staleness})")
        if self.delta and self.delta <= 1.0 + self.epsilon_high:
            raise ValueError(f"grpo.delta={self.delta} must exceed 1 + grpo.epsilon_high (or be 0 = off)")
        if self.ref_reset_every and self.beta == 0.0 and not self.kl_in_reward:
            raise ValueError(f"grpo.ref_reset_every={self.ref_reset_every} resets a reference nothing reads: "
                             "grpo.beta=0 and grpo.kl_in_reward=0 (set one, or ref_reset_every=0)")
        super().__post_init__()

    def turn_budget(self) -> tuple[int, int]:
        return self.max_new_tokens, self.overlong_buffer

    def advantage_options(self) -> dict:
        """The keyword options of the advantage estimator (jaxrl.algorithms.grpo.compute_advantages)."""
        return {"k": self.pass_at_k_k} if self.advantage_estimator == "pass_at_k" and self.pass_at_k_k else {}

    def policy_loss_common(self) -> dict:
        return {"epsilon_low": self.epsilon_low, "epsilon_high": self.epsilon_high, "delta": self.delta or None,
                "dual_clip": None, "log_ratio_clamp": self.log_ratio_clamp or None,
                "importance_sampling_level": self.importance_sampling_level}

    @property
    def rows_per_rollout(self) -> int:
        return self.prompts_per_step * self.num_generations


# the blocks a run of grpo has, in the order its family config lists them (registered in
# jaxrl.algorithms.tasks)
BLOCKS = {"grpo": GRPOConfig, "data": OnlineDataConfig, "reward": RewardConfig}
