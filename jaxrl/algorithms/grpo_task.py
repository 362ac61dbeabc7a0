"""`algorithm = "grpo"`: GRPO with online rollouts on the shared training core (jaxrl.train).

    python -m launchers.train --config=configs/grpo.py:model=4b,run=4b_base --workdir=runs/grpo_4b \
        --config.model_path=/models/Qwen3.5-4B --config.data.problems=problems.jsonl

Each rollout (`jaxrl.algorithms.online`): `prompts_per_step` prompts -> `num_generations` samples each from the
current policy (one held Sampler) -> rewards (`config.reward`) -> optional DAPO overlong penalty -> group-relative
advantages (`scale_rewards` group | batch | none, or a registered `advantage_estimator`) -> optional masking of
truncated completions and of zero-variance groups -> reference log-probs with the adapters off (one jitted pass,
skipped when beta = 0) -> old log-probs. The rollout is then trained on for `num_iterations` passes of
N / B_global minibatches (N = prompts_per_step x num_generations, B_global = micro_batch_size x grad_accum),
one optimizer update each.

Old log-probs (the ratio's denominator): with a single update per rollout (num_iterations = 1 and N = B_global)
the update is on-policy and the ratio is `exp(logp - stop_gradient(logp))` = 1 exactly (TRL). Otherwise the
sampler's behaviour log-probs (same weights, decode path; equal to a teacher-forced pass to ~1e-5 in fp32), or,
with `recompute_old_logprobs` (forced when temperature != 1: the sampler reports untempered log-probs; and when
the compute dtype is not float32: in bf16 the decode drifts by ~1e-2), a teacher-forced pass at the sampling
temperature right after sampling.

Objective (`GRPOObjective`, micro-batch contract of jaxrl.train.objective): per completion token
clipped surrogate (`epsilon_low`, `epsilon_high`, optional two-sided `delta`) + beta x KL(`kl_estimator`: k1 | k2
| k3 (the stable expm1 form) | ...) to the precomputed reference, aggregated by `aggregation` (sequence_mean =
TRL grpo, token_mean = dapo, dr_grpo) with normalisers of the whole global batch, so any micro-batch split gives
the same update.

Metrics per step: from the loss (global token means) `policy_loss`, `ratio`, `ratio_abs_dev` (|ratio - 1|),
`clip_fraction/{low,high,region}`, `kl` (beta > 0), `entropy`; from the rollout the step trains on
`reward/{mean,std,min,max,strict_rate,masked_fraction}`, `zero_variance_groups` (fraction of groups),
`advantage/{mean,std,min,max,abs_mean}`, `completion/{length_mean,length_min,length_max,truncation_rate}`,
`rollout/kl_ref` (token-mean KL of the behaviour policy to the reference, beta > 0), `loss_tokens_fraction`;
on the step that made the rollout `time/{sample_s,score_s,ref_logp_s,old_logp_s,rollout_s}` (the trainer's
`step_time_s` includes them: update time = step_time_s - time/rollout_s).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxrl.algorithms import grpo as grpo_lib
from jaxrl.algorithms import kl as kl_lib
from jaxrl.algorithms import completion_passes, online_rollouts, online_task
from jaxrl.utils.train_config import GRPOConfig, TrainConfig


@dataclasses.dataclass(frozen=True)
class GRPOObjective:
    """GRPO loss of one micro-batch. Batch keys: input_ids, attention_mask [b, P+C]; completion_mask (the loss
    mask), advantages [b]; sequence_mask [b] (1 = counts in num_sequences); ref_logp [b, C] when beta != 0;
    old_logp [b, C] unless on-policy."""

    max_new_tokens: int  # the completion cap: Dr. GRPO's L_max
    aggregation: str = "sequence_mean"
    beta: float = 0.0
    kl_estimator: str = "k3"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: Optional[float] = None
    importance_sampling_level: str = "token"
    temperature: float = 1.0
    entropy: bool = True
    entropy_coef: float = 0.0
    chunk_size: int = 512

    def normalisers(self, batch):
        return grpo_lib.global_normalizers(batch["completion_mask"], self.max_new_tokens,
                                           sequence_mask=batch["sequence_mask"])

    def loss(self, model, micro_batch, normalisers, rng):
        mask = micro_batch["completion_mask"]
        h, logp, ent = completion_passes.policy_forward(model, micro_batch, chunk_size=self.chunk_size,
                                                        temperature=self.temperature,
                                                        entropy=self.entropy or bool(self.entropy_coef))
        loss, metrics = grpo_lib.grpo_loss(
            logp, micro_batch.get("old_logp"), micro_batch["advantages"], mask, normalisers,
            ref_logp=micro_batch.get("ref_logp"), beta=self.beta, kl_estimator=self.kl_estimator,
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, delta=self.delta,
            importance_sampling_level=self.importance_sampling_level, aggregation=self.aggregation,
            entropies=ent, entropy_coef=self.entropy_coef)
        old = jax.lax.stop_gradient(logp) if micro_batch.get("old_logp") is None else micro_batch["old_logp"]
        dev = jnp.abs(jnp.exp(jax.lax.stop_gradient(logp) - old) - 1.0)
        metrics.update(grpo_lib.token_metric_contributions({"ratio_abs_dev": dev}, mask, normalisers))
        return loss, metrics


def advantages_of(rewards: np.ndarray, num_generations: int, estimator: str, scale_rewards: str) -> np.ndarray:
    if estimator == "grpo":
        return np.asarray(grpo_lib.group_advantages(rewards, num_generations, scale_rewards), np.float32)
    if scale_rewards != "group":
        raise ValueError(f"grpo.scale_rewards={scale_rewards!r} applies to advantage_estimator='grpo' only; "
                         f"grpo.advantage_estimator={estimator!r} defines its own scaling")
    return np.asarray(grpo_lib.compute_advantages(rewards, num_generations, estimator), np.float32)


class GRPOTask(online_task.OnlineTask):
    def __init__(self, config: TrainConfig, model, mesh):
        grpo: GRPOConfig = config.grpo
        self.grpo = grpo
        kl_lib.kl(jnp.zeros((1, 1)), jnp.zeros((1, 1)), grpo.kl_estimator)  # unknown estimator: error now
        if grpo.num_generations < 2:
            logging.warning("grpo.num_generations=1: every group has zero variance and zero advantage")
        global_batch = config.batch.global_batch
        online_task.check_rows(grpo.rows_per_rollout, global_batch, "grpo.prompts_per_step x grpo.num_generations")
        super().__init__(config, online_task.Schedule(grpo.rows_per_rollout, global_batch, grpo.num_iterations,
                                                      config.seed))
        self.on_policy = self.schedule.steps_per_rollout == 1
        # The sampler's log-probs match a teacher-forced pass to ~1e-6 in float32 only; in bf16 its KV-cache
        # decode drifts, so the first update's ratio would not be 1.
        compute_dtype = jnp.dtype(getattr(model, "dtype", None) or config.dtype)
        low_precision = compute_dtype != jnp.float32
        self.recompute = grpo.recompute_old_logprobs or grpo.temperature != 1.0 or low_precision
        if self.recompute and not grpo.recompute_old_logprobs and not self.on_policy:
            why = (f"grpo.temperature={grpo.temperature}: the sampler reports untempered log-probs"
                   if grpo.temperature != 1.0 else f"dtype={compute_dtype.name}: the sampler's log-probs drift")
            logging.info("old log-probs are recomputed teacher-forced (%s)", why)
        self.chunk_size = config.logprob_chunk_size
        self.objective = GRPOObjective(
            max_new_tokens=grpo.max_new_tokens, aggregation=grpo.aggregation, beta=grpo.beta,
            kl_estimator=grpo.kl_estimator, epsilon_low=grpo.epsilon_low, epsilon_high=grpo.epsilon_high,
            delta=grpo.delta or None, importance_sampling_level=grpo.importance_sampling_level,
            temperature=grpo.temperature, entropy=grpo.log_entropy, entropy_coef=grpo.entropy_coef,
            chunk_size=self.chunk_size)
        self.train_keys = ("input_ids", "attention_mask", "completion_mask", "advantages", "sequence_mask") + (
            ("ref_logp",) if grpo.beta != 0.0 else ()) + (() if self.on_policy else ("old_logp",))
        self.engine = online_rollouts.RolloutEngine(config, model, mesh, prompts_per_rollout=grpo.prompts_per_step,
                                                    sampling=grpo)
        self.mesh = mesh

    def make_rollout(self, rollout: int, policy):
        grpo, group = self.grpo, self.grpo.num_generations
        s = self.engine.run(policy, rollout)
        metrics = online_rollouts.sample_metrics(s, grpo.max_new_tokens)
        metrics.update({"time/" + k: v for k, v in s.times.items()})
        rewards = s.rewards.copy()
        if grpo.overlong_buffer > 0:
            pen = np.asarray(grpo_lib.overlong_penalty(s.lengths, grpo.max_new_tokens, grpo.overlong_buffer,
                                                       grpo.overlong_penalty))
            rewards = rewards + pen
            metrics["reward/overlong_penalty"] = float(pen.mean())
        adv = advantages_of(rewards, group, grpo.advantage_estimator, grpo.scale_rewards)
        zero_var = np.asarray(grpo_lib.zero_variance_groups(rewards, group))
        metrics["zero_variance_groups"] = float(zero_var.reshape(-1, group)[:, 0].mean())
        metrics.update({"advantage/mean": float(adv.mean()), "advantage/std": float(adv.std()),
                        "advantage/min": float(adv.min()), "advantage/max": float(adv.max()),
                        "advantage/abs_mean": float(np.abs(adv).mean())})

        mask = s.completion_mask.copy()
        mask[np.isnan(s.rewards)] = 0.0  # masked by the reward (truncation policy "mask"): no gradient
        if grpo.mask_truncated:
            mask[s.truncated] = 0.0
        seq = np.ones(len(rewards), np.float32)
        if grpo.drop_zero_variance_groups:
            mask[zero_var] = 0.0
            seq[zero_var] = 0.0
        metrics["loss_tokens_fraction"] = float(mask.sum() / max(s.completion_mask.sum(), 1.0))

        arrays = {"input_ids": s.input_ids, "attention_mask": s.attention_mask, "completion_mask": s.completion_mask}
        buffer = {"input_ids": s.input_ids, "attention_mask": s.attention_mask, "completion_mask": mask,
                  "advantages": adv, "sequence_mask": seq}
        common = dict(max_new_tokens=grpo.max_new_tokens, batch_size=grpo.logprob_batch_size,
                      chunk_size=self.chunk_size, mesh=self.mesh, compile_options=self.compile_options,
                      temperature=grpo.temperature)
        t0 = time.perf_counter()
        if grpo.beta != 0.0:  # the reference at the sampling temperature, like the policy's log-probs
            buffer["ref_logp"] = completion_passes.teacher_forced(policy, arrays, adapters=False, **common)["logp"]
        t1 = time.perf_counter()
        metrics["time/ref_logp_s"] = t1 - t0
        old = s.behaviour_logp if grpo.temperature == 1.0 else None  # the sampler's are untempered
        if not self.on_policy and self.recompute:
            old = completion_passes.teacher_forced(policy, arrays, adapters=True, **common)["logp"]
        metrics["time/old_logp_s"] = time.perf_counter() - t1
        if not self.on_policy:
            buffer["old_logp"] = old
        if grpo.beta != 0.0 and old is not None:
            kl = np.asarray(kl_lib.kl(old, buffer["ref_logp"], grpo.kl_estimator, mask=s.completion_mask))
            metrics["rollout/kl_ref"] = float((kl * s.completion_mask).sum() / max(s.completion_mask.sum(), 1.0))
        return buffer, metrics


def build_grpo(config: TrainConfig, model, mesh) -> GRPOTask:
    return GRPOTask(config, model, mesh)
