"""`algorithm = "distill"`: its config blocks (`BLOCKS`, registered in jaxrl.algorithms.tasks; the task:
jaxrl.algorithms.distill_task; the losses: jaxrl.algorithms.distill_loss, which takes its choices from here). No
jax here: configs import this module."""

from __future__ import annotations

import dataclasses
import math

from jaxrl.algorithms.online.settings import OnlineDataConfig, SamplingSettings
from jaxrl.backends.scorers import SCORER_SPECS, ScorerSpec
from jaxrl.backends.settings import (SERVED_TEACHERS, TEACHER_BACKENDS, RolloutBackendSettings, ServerOptions,
                                     check_server_urls, server_url)
from jaxrl.rewards.settings import RewardConfig
from jaxrl.utils.typed_config import at_least, block, keys_of, setting

__all__ = ["BLOCKS", "DISTILL_LOSSES", "DistillConfig"]

DISTILL_LOSSES = ("reverse_kl", "jsd", "forward_kl_topk")
_ON_POLICY = ("distillation trains on-policy (one update per rollout, sampled by the policy it updates): it has no "
              "asynchronous keys; remove it")


@dataclasses.dataclass(frozen=True)
class DistillConfig(RolloutBackendSettings, SamplingSettings):
    """On-policy distillation (jaxrl.algorithms.distill_task): the student samples as GRPO does (the sampling and
    rollout backend parts), a frozen teacher scores every completion token. One update per rollout, on-policy:
    prompts_per_step x num_generations = B_global. `temperature` (sampling) is also the divergences' temperature
    (GKD); the teacher's support is `teacher_top_k`, apart from `top_k`, the sampling filter."""

    NAME = "distill"
    # a config.json written when the block still had them (at their defaults) resolves; any other value is refused
    RETIRED_KEYS = {"max_staleness": (0, _ON_POLICY), "off_policy_loss": ("behaviour", _ON_POLICY),
                    "overlap": (False, _ON_POLICY), "partial_rollouts": (False, _ON_POLICY)}
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
        at_least("distill", {"num_generations": 1, "prompts_per_step": 1, "max_new_tokens": 1,
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
        if not (math.isfinite(self.reward_weight) and self.reward_weight >= 0.0):
            raise ValueError(f"distill.reward_weight must be a finite number >= 0 (0 = off), got {self.reward_weight}")
        if self.reward_weight and self.num_generations < 2:
            raise ValueError("distill.reward_weight needs num_generations >= 2 (its advantage is reward - group "
                             "mean)")
        self._check_teacher_servers()
        super().__post_init__()

    @classmethod
    def migrate(cls, values: dict, where: str) -> dict:
        values = super().migrate(values, where)
        return dict(values, teacher_servers=tuple(server_url(u) for u in values["teacher_servers"]))

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
        check_server_urls("distill.teacher_servers", servers)
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

    @property
    def teacher_spec(self) -> ScorerSpec:
        """The teacher_backend choice as its typed member (jaxrl.backends.scorers), its options taken from the
        block; `build(ScorerContext(...))` makes the teacher."""
        return SCORER_SPECS[self.teacher_backend].of(path=self.teacher_path, adapter=self.teacher_adapter,
                                                     urls=self.teacher_servers, options=self.teacher_server)


# the blocks a run of distill has, in the order its family config lists them (registered in
# jaxrl.algorithms.tasks)
BLOCKS = {"distill": DistillConfig, "data": OnlineDataConfig, "reward": RewardConfig}
