"""`algorithm = "ppo"`: its config blocks (`BLOCKS`, registered in jaxrl.algorithms.tasks; the task:
jaxrl.algorithms.ppo_task; the loss: jaxrl.algorithms.ppo). No jax here: configs import this module."""

from __future__ import annotations

import dataclasses

from jaxrl.algorithms.online.settings import OnlineDataConfig, OnlineSettings
from jaxrl.rewards.settings import RewardConfig
from jaxrl.utils.typed_config import at_least, setting

__all__ = ["BLOCKS", "PPOConfig"]


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
        at_least("ppo", {"prompts_per_rollout": 1, "num_generations": 1, "max_new_tokens": 1, "epochs": 1,
                         "minibatches": 1, "critic_warmup_steps": 0}, self)
        if self.init_kl_coef < 0:
            raise ValueError(f"ppo.init_kl_coef must be >= 0, got {self.init_kl_coef}")
        if self.dual_clip and self.dual_clip <= 1.0:
            raise ValueError(f"ppo.dual_clip={self.dual_clip} must exceed 1 (or be 0 = off)")
        super().__post_init__()

    def turn_budget(self) -> tuple[int, int]:
        return self.max_new_tokens, 0  # PPO has no overlong penalty

    def policy_loss_common(self) -> dict:
        # one window, cliprange, on both sides (TRL); a loss's own asymmetric window is not a PPO key
        return {"epsilon_low": self.cliprange, "epsilon_high": self.cliprange, "delta": None,
                "dual_clip": self.dual_clip or None, "log_ratio_clamp": self.log_ratio_clamp or None,
                "importance_sampling_level": "token"}

    @property
    def rows_per_rollout(self) -> int:
        return self.prompts_per_rollout * self.num_generations


# the blocks a run of ppo has, in the order its family config lists them (registered in
# jaxrl.algorithms.tasks)
BLOCKS = {"ppo": PPOConfig, "data": OnlineDataConfig, "reward": RewardConfig}
