"""`algorithm = "grpo"`: GRPO with online rollouts on the shared training core (jaxrl.train).

    python -m launchers.train --config=configs/grpo.py:model=4b,run=4b_base --workdir=runs/grpo_4b \
        --config.model_path=/models/Qwen3.5-4B --config.data.problems=problems.jsonl

Each rollout (jaxrl/algorithms/online): `prompts_per_step` prompts -> `num_generations` samples each from the
current policy (on its rollout backend) -> rewards (`config.reward`) -> optional DAPO overlong penalty -> group-relative
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

Rollout correction (`rollout_correction`; TRL's vLLM importance-sampling correction, verl `rollout_correction`):
the sampler and the trainer compute the same policy with different numerics (a KV-cache decode, or a serving
engine, against a teacher-forced pass: rounding apart in float32, a real gap in bfloat16), so each rollout compares
the sampler's log-probs with the trainer's for the behaviour parameters at temperature 1 (the sampler's are
untempered): w = exp(trainer - sampler) per token, or the geometric mean of those ratios per sequence, truncated
to or masked outside [`rollout_correction_min`, `rollout_correction_max`], multiplies the policy term
(jaxrl/algorithms/online/correction.py). The trainer side is the MISMATCH pass (jaxrl/algorithms/online/passes.py:
the recomputed old log-probs when those are at temperature 1), or, in an on-policy step at temperature 1, the
step's own forward (the weights and the `mismatch/*` metrics computed inside the step): never a second pass of
the same parameters. The comparison is made whatever the mode, for the `mismatch/*` metrics.

Episodes (`environment` set; jaxrl/environments/runner.py): each row is a multi-turn episode of a policy
and an environment, one token sequence whose completion columns (`max_episode_tokens` wide) hold every turn's
sampled tokens (completion mask 1) and every observation (mask 0); the reward is the episode's, the advantages are
per episode within groups of `num_generations` episodes of a problem, and the loss runs over the sampled tokens of
every turn. Extra metrics `episode/{turns_mean,truncated_fraction,tokens_mean,sampled_tokens_mean,failed_fraction,
solved_fraction}`; completion/* count an episode's sampled tokens.

Dynamic sampling (`dynamic_sampling`, off by default): extra draws until `prompts_per_step` groups have reward
signal, at most `max_extra_draws` (`GRPOTask.sample`). Replay (`replay_groups`, off by default): groups without a
signal replaced by kept groups of earlier rollouts that had one (jaxrl.algorithms.online.replay; `replay/*`).

Objective (`GRPOObjective`, micro-batch contract of jaxrl.train.objective): per completion token the policy
term `policy_loss` (jaxrl.algorithms.policy_loss: `ppo_clip`, the clipped surrogate with `epsilon_low`,
`epsilon_high`, optional two-sided `delta`, by default; `gspo`, `cispo`, `sapo`, `gmpo`, `kl_cov`, `clip_cov` or a
plug-in, with `policy_loss_options`) + beta x KL(`kl_estimator`: k1 | k2 | k3 (the stable expm1 form) | ...) to the
precomputed reference, aggregated by `aggregation` (sequence_mean = TRL grpo, token_mean = dapo, dr_grpo) with
normalisers of the whole global batch, so any micro-batch split gives the same update (`kl_cov` and `clip_cov`
excepted: they pick tokens within a micro-batch, as verl). Token-level advantage estimators (`reinforce_plus_plus`,
`reinforce_plus_plus_baseline`) give [N, C] advantages from the loss mask, with `kl_in_reward` the KL (k1 of the
behaviour log-probs to the reference) in each token's reward. `ref_reset_every`: every that many rollouts the
reference becomes the policy that samples the rollout (jaxrl.algorithms.online.reference; `reference/reset`,
`reference/rollout` in the metrics).

Metrics per step: from the loss (global token means) `policy_loss`, `ratio`, `ratio_abs_dev` (|ratio - 1|),
`clip_fraction/{low,high,region}` (the loss's own: `ppo_clip`'s), `kl` (beta > 0), `entropy`; from the rollout the
step trains on `reward/{mean,std,min,max,strict_rate,masked_fraction}`, `zero_variance_groups` (fraction of groups),
`advantage/{mean,std,min,max,abs_mean}`, `completion/{length_mean,length_min,length_max,truncation_rate}`,
`rollout/kl_ref` (token-mean KL of the behaviour policy to the reference, beta > 0), `loss_tokens_fraction`,
`mismatch/{logp_abs_mean,logp_abs_max,kl_k3,is_weight_mean,is_weight_min,is_weight_max}` and
`mismatch/clipped_fraction` (truncate modes) or `mismatch/masked_fraction` (mask modes) (`grpo.rollout_correction`),
with dynamic sampling `dynamic_sampling/{extra_draws,drawn_groups,signal_rate,signal_groups,cap_reached}` (reward/*
and completion/* then describe the rollout's own prompts, draw 0; advantage/* and zero_variance_groups the groups
trained on); on the step that made the rollout
`time/{sample_s,score_s,ref_logp_s,old_logp_s,mismatch_logp_s,rollout_s}` (the trainer's `step_time_s` includes
them: update time = step_time_s - time/rollout_s).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxrl.algorithms import grpo as grpo_lib
from jaxrl.algorithms import kl as kl_lib
from jaxrl.algorithms.config import TrainConfig
from jaxrl.algorithms.grpo_config import GRPOConfig
from jaxrl.algorithms.online import correction
from jaxrl.algorithms.online.buffer import Schedule, check_rows
from jaxrl.algorithms.online.controller import proximal_pass
from jaxrl.algorithms.online.layout import OnlineLayout, keeps_groups
from jaxrl.algorithms.online.passes import RolloutPasses, Role, policy_forward
from jaxrl.algorithms.online.replay import GroupReplay
from jaxrl.algorithms.online.rollouts import Rollouts, Sampled, sample_metrics
from jaxrl.algorithms.online.task import OnlineTask
from jaxrl.algorithms.policy_loss import resolve_options


class StepNormalisers(NamedTuple):
    """The global-batch constants of a GRPO step: the loss's, and the generated tokens of the batch's rows (the
    in-step mismatch metrics' denominator; None when they are not computed in the step)."""

    loss: grpo_lib.Normalizers
    rollout_tokens: Optional[jax.Array]


@dataclasses.dataclass(frozen=True)
class GRPOObjective:
    """GRPO loss of one micro-batch. Batch keys: input_ids, attention_mask [b, P+C]; completion_mask (the loss
    mask), advantages [b]; sequence_mask [b] (1 = counts in num_sequences); ref_logp [b, C] when beta != 0;
    old_logp [b, C] unless on-policy; is_weights [b, C] (the rollout correction) unless it is none or computed in
    the step; behaviour_logp [b, C] (the sampler's) with `mismatch_in_step`. Defaults are the `grpo` block's
    (`of` builds one from a run's block)."""

    max_new_tokens: int  # the completion cap: Dr. GRPO's L_max
    aggregation: str = GRPOConfig.aggregation
    beta: float = GRPOConfig.beta
    kl_estimator: str = GRPOConfig.kl_estimator
    epsilon_low: float = GRPOConfig.epsilon_low
    epsilon_high: float = GRPOConfig.epsilon_high
    delta: Optional[float] = GRPOConfig.delta or None  # 0 in the config: off
    log_ratio_clamp: Optional[float] = GRPOConfig.log_ratio_clamp or None
    importance_sampling_level: str = GRPOConfig.importance_sampling_level
    temperature: float = GRPOConfig.temperature
    entropy: bool = GRPOConfig.log_entropy
    entropy_coef: float = GRPOConfig.entropy_coef
    chunk_size: int = 512
    # An on-policy step at temperature 1: the rollout correction's trainer side is this step's own forward
    # (module docstring), so its weights and the mismatch/* metrics are computed here.
    mismatch_in_step: bool = False
    rollout_correction: str = GRPOConfig.rollout_correction
    rollout_correction_min: Optional[float] = GRPOConfig.rollout_correction_min or None
    rollout_correction_max: float = GRPOConfig.rollout_correction_max
    policy_loss: str = GRPOConfig.policy_loss
    policy_loss_options: Any = None  # policy_loss.resolve_options of the block; None: ppo_clip's from the fields

    @classmethod
    def of(cls, grpo: GRPOConfig, *, chunk_size: int, mismatch_in_step: bool = False) -> "GRPOObjective":
        # episodes: the completion columns are the episode's (jaxrl/algorithms/online/rollouts.py)
        width = grpo.max_episode_tokens if grpo.environment else grpo.max_new_tokens
        return cls(max_new_tokens=width, aggregation=grpo.aggregation, beta=grpo.beta,
                   kl_estimator=grpo.kl_estimator, epsilon_low=grpo.epsilon_low, epsilon_high=grpo.epsilon_high,
                   delta=grpo.delta or None, log_ratio_clamp=grpo.log_ratio_clamp or None,
                   importance_sampling_level=grpo.importance_sampling_level, temperature=grpo.temperature,
                   entropy=grpo.log_entropy, entropy_coef=grpo.entropy_coef, chunk_size=chunk_size,
                   mismatch_in_step=mismatch_in_step, rollout_correction=grpo.rollout_correction,
                   rollout_correction_min=grpo.rollout_correction_min or None,
                   rollout_correction_max=grpo.rollout_correction_max, policy_loss=grpo.policy_loss,
                   policy_loss_options=resolve_options(grpo.policy_loss, grpo.policy_loss_common(),
                                                       grpo.policy_loss_options, grpo.NAME))

    def normalisers(self, batch):
        loss = grpo_lib.global_normalizers(batch["completion_mask"], self.max_new_tokens,
                                           sequence_mask=batch["sequence_mask"])
        rollout_tokens = (jnp.sum(jnp.asarray(batch["rollout_mask"]) > 0).astype(jnp.float32)
                          if self.mismatch_in_step else None)
        return StepNormalisers(loss, rollout_tokens)

    def loss(self, model, micro_batch, normalisers, rng):
        mask = micro_batch["completion_mask"]
        h, logp, ent = policy_forward(model, micro_batch, chunk_size=self.chunk_size, temperature=self.temperature,
                                      entropy=self.entropy or bool(self.entropy_coef))
        weights, mismatch = micro_batch.get("is_weights"), {}
        if self.mismatch_in_step:
            weights, mismatch = correction.in_step(
                logp, micro_batch["behaviour_logp"], micro_batch["rollout_mask"], normalisers.rollout_tokens,
                self.rollout_correction, self.rollout_correction_min, self.rollout_correction_max)
        loss, metrics = grpo_lib.grpo_loss(
            logp, micro_batch.get("old_logp"), micro_batch["advantages"], mask, normalisers.loss,
            ref_logp=micro_batch.get("ref_logp"), beta=self.beta, kl_estimator=self.kl_estimator,
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, delta=self.delta,
            importance_sampling_level=self.importance_sampling_level, aggregation=self.aggregation,
            sampling_weights=weights, entropies=ent, entropy_coef=self.entropy_coef,
            log_ratio_clamp=self.log_ratio_clamp, policy_loss=self.policy_loss,
            policy_loss_options=self.policy_loss_options, rng=rng)
        metrics.update(mismatch)
        old = jax.lax.stop_gradient(logp) if micro_batch.get("old_logp") is None else micro_batch["old_logp"]
        dev = jnp.abs(jnp.exp(grpo_lib.clamp_log_ratio(jax.lax.stop_gradient(logp) - old, self.log_ratio_clamp)) - 1.0)
        metrics.update(grpo_lib.token_metric_contributions({"ratio_abs_dev": dev}, mask, normalisers.loss))
        return loss, metrics


def advantages_of(rewards: np.ndarray, num_generations: int, estimator: str, scale_rewards: str, *,
                  mask: Optional[np.ndarray] = None, kl_penalty: Optional[np.ndarray] = None,
                  options: Optional[dict] = None) -> np.ndarray:
    """The rollout's advantages: [N], or [N, C] for a token-level estimator (which reads the loss `mask` and the
    per-token `kl_penalty`, grpo_lib.compute_advantages); `options`: the estimator's (pass_at_k's k)."""
    if estimator == "grpo":
        return np.asarray(grpo_lib.group_advantages(rewards, num_generations, scale_rewards), np.float32)
    if scale_rewards != "group":
        raise ValueError(f"grpo.scale_rewards={scale_rewards!r} applies to advantage_estimator='grpo' only; "
                         f"grpo.advantage_estimator={estimator!r} defines its own scaling")
    return np.asarray(grpo_lib.compute_advantages(rewards, num_generations, estimator, mask=mask,
                                                  kl_penalty=kl_penalty, options=options), np.float32)


class GRPOTask(OnlineTask):
    def __init__(self, config: TrainConfig, model, mesh):
        grpo: GRPOConfig = config.grpo
        self.grpo = grpo
        kl_lib.kl(jnp.zeros((1, 1)), jnp.zeros((1, 1)), grpo.kl_estimator)  # unknown estimator: error now
        if grpo.num_generations < 2:
            logging.warning("grpo.num_generations=1: every group has zero variance and zero advantage")
        global_batch = config.batch.global_batch
        check_rows(grpo.rows_per_rollout, global_batch, "grpo.prompts_per_step x grpo.num_generations")
        rollouts = Rollouts(config, model, mesh, prompts_per_rollout=grpo.prompts_per_step, sampling=grpo,
                            episodes=grpo if grpo.environment else None, async_policy=grpo.async_policy)
        whole = grpo.num_generations if keeps_groups(grpo.layout, config.data.max_prompt_len) else 1
        super().__init__(config, Schedule(grpo.rows_per_rollout, global_batch, grpo.num_iterations, config.seed, whole),
                         rollouts, grpo.async_policy, proximal_pass(grpo, config, mesh), grpo.ref_reset_every,
                         grpo.ref_reset_optimizer)
        # replayed rows were sampled by older policies: with replay every step is off-policy (old log-probs kept)
        self.on_policy = self.schedule.steps_per_rollout == 1 and not grpo.replay_groups
        self.replay = (GroupReplay(groups=grpo.replay_groups, max_age=grpo.replay_max_age,
                                   group=grpo.num_generations) if grpo.replay_groups else None)
        # The sampler's log-probs match a teacher-forced pass to ~1e-6 in float32 only; in bf16 its KV-cache
        # decode drifts, so the first update's ratio would not be 1.
        compute_dtype = jnp.dtype(model.dtype)
        low_precision = compute_dtype != jnp.float32
        # A rollout correction compares the trainer's log-probs with the sampler's, so the ratio's denominator must
        # be the trainer's too (TRL recomputes them whenever its vLLM correction is on).
        corrected = grpo.rollout_correction != "none"
        self.recompute = grpo.recompute_old_logprobs or grpo.temperature != 1.0 or low_precision or corrected
        if self.recompute and not grpo.recompute_old_logprobs and not self.on_policy:
            why = (f"grpo.temperature={grpo.temperature}: the sampler reports untempered log-probs"
                   if grpo.temperature != 1.0 else f"dtype={compute_dtype.name}: the sampler's log-probs drift"
                   if low_precision else f"grpo.rollout_correction={grpo.rollout_correction}")
            logging.info("old log-probs are recomputed teacher-forced (%s)", why)
        if corrected and grpo.temperature != 1.0:
            logging.warning("grpo.rollout_correction=%s at temperature %s: the sampler reports untempered log-probs "
                            "(as vLLM does by default), so the weights are those of the untempered distributions",
                            grpo.rollout_correction, grpo.temperature)
        # An on-policy step at temperature 1 is the MISMATCH pass itself: the correction happens in the step.
        self.mismatch_in_step = self.on_policy and grpo.temperature == 1.0
        self.chunk_size = config.logprob_chunk_size
        self.objective = GRPOObjective.of(grpo, chunk_size=self.chunk_size, mismatch_in_step=self.mismatch_in_step)
        self.train_keys = ("input_ids", "attention_mask", "completion_mask", "advantages", "sequence_mask") + (
            ("ref_logp",) if grpo.beta != 0.0 else ()) + (() if self.on_policy else ("old_logp",)) + (
            ("behaviour_logp", "rollout_mask") if self.mismatch_in_step else
            ("is_weights",) if corrected or self.async_policy.decoupled else ())
        self.mesh = mesh
        self.layout = OnlineLayout(grpo.layout, width=rollouts.width, pad_id=rollouts.pad_id, name=grpo.NAME)
        self.micro_batch_size = config.batch.micro_batch_size

    def setup(self, context) -> None:
        super().setup(context)
        if self.replay is not None:
            self.replay.open(context.workdir)

    def batch(self, step: int):
        """The step's rows in the layout the rule picks (jaxrl/algorithms/online/layout.py), packed per
        micro-batch."""
        out, host = super().batch(step)
        out, counters = self.layout.apply(out, self.micro_batch_size)
        return out, {**host, **counters}

    def shaped_rewards(self, s: Sampled) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """(rewards the advantages come from, DAPO overlong penalty or None): the reward plus that penalty."""
        grpo = self.grpo
        if grpo.overlong_buffer <= 0:
            return s.rewards.copy(), None
        pen = np.asarray(grpo_lib.overlong_penalty(s.lengths, grpo.max_new_tokens, grpo.overlong_buffer,
                                                   grpo.overlong_penalty), np.float32)
        return s.rewards + pen, pen

    def sample(self, rollout: int, policy):
        """(samples, rewards, overlong penalty, metrics) of the groups rollout `rollout` trains on.

        Without dynamic sampling: the rollout's prompt groups. With it (DAPO; verl `filter_groups`, OpenRLHF
        `dynamic_filtering`): groups whose rewards all agree carry no signal, so up to `max_extra_draws` extra draws
        of `prompts_per_step` prompts each (`Rollouts.run(.., draw=d)`, seeded by (seed, rollout, d): a resumed
        run redraws them) are made until `prompts_per_step` groups have signal. The step trains on the first
        `prompts_per_step` of those in draw order; when the cap is reached first, the rest of its groups are the
        earliest groups without signal (advantage 0), so the rollout keeps its shape.
        """
        grpo, group, wanted = self.grpo, self.grpo.num_generations, self.grpo.prompts_per_step
        s = self.rollouts.run(policy, rollout)
        rewards, pen = self.shaped_rewards(s)
        if not grpo.dynamic_sampling:
            return s, rewards, pen, {}
        draws = [(s, rewards, pen)]
        signal = [~np.asarray(grpo_lib.zero_variance_groups(rewards, group)).reshape(-1, group)[:, 0]]
        while sum(int(x.sum()) for x in signal) < wanted and len(draws) <= grpo.max_extra_draws:
            extra = self.rollouts.run(policy, rollout, draw=len(draws))
            r, p = self.shaped_rewards(extra)
            draws.append((extra, r, p))
            signal.append(~np.asarray(grpo_lib.zero_variance_groups(r, group)).reshape(-1, group)[:, 0])
        order = [(d, j) for d, flags in enumerate(signal) for j in np.flatnonzero(flags)][:wanted]
        have = len(order)
        order += [(d, j) for d, flags in enumerate(signal) for j in np.flatnonzero(~flags)][:wanted - have]
        picked = take_groups([d[0] for d in draws], order, group)
        rows = lambda a: np.concatenate([a[d][j * group:(j + 1) * group] for d, j in order])  # noqa: E731
        rewards = rows([d[1] for d in draws])
        pen = None if pen is None else rows([d[2] for d in draws])
        drawn = sum(len(x) for x in signal)
        metrics = {"dynamic_sampling/extra_draws": float(len(draws) - 1),
                   "dynamic_sampling/drawn_groups": float(drawn),
                   "dynamic_sampling/signal_rate": float(sum(int(x.sum()) for x in signal) / drawn),
                   "dynamic_sampling/signal_groups": float(have),
                   "dynamic_sampling/cap_reached": float(have < wanted)}
        if have < wanted:
            logging.warning("rollout %d: %d of %d groups have reward signal after %d extra draws "
                            "(grpo.max_extra_draws); training on them and %d groups without signal", rollout, have,
                            wanted, len(draws) - 1, wanted - have)
        # reward/* and completion/* describe the rollout's own prompts (draw 0), as without dynamic sampling: the
        # groups trained on are chosen by their rewards
        metrics.update(sample_metrics(s, grpo.max_new_tokens, group))
        return picked, rewards, pen, metrics

    def make_rollout(self, rollout: int, policy):
        grpo, group = self.grpo, self.grpo.num_generations
        s, rewards, pen, metrics = self.sample(rollout, policy)
        metrics = {**sample_metrics(s, grpo.max_new_tokens, group), **s.episode, **metrics}
        metrics.update({"time/" + k: v for k, v in s.times.items()})
        if pen is not None:
            metrics["reward/overlong_penalty"] = float(pen.mean())

        mask = s.completion_mask.copy()
        mask[np.isnan(s.rewards)] = 0.0  # masked by the reward (truncation policy "mask"): no gradient
        if grpo.mask_truncated:
            mask[s.truncated] = 0.0
        arrays = {"input_ids": s.input_ids, "attention_mask": s.attention_mask, "completion_mask": s.completion_mask}
        reference, event = self.reference_resets.reference_for(rollout, policy)
        metrics.update(event)
        passes = RolloutPasses(policy, arrays, temperature=grpo.temperature, batch_size=grpo.logprob_batch_size,
                               chunk_size=self.chunk_size, mesh=self.mesh, compile_options=self.compile_options,
                               reference=reference, layout=self.layout)
        # the reference at the sampling temperature, like the policy's log-probs
        ref = passes.logp(Role.REFERENCE) if grpo.beta != 0.0 or grpo.kl_in_reward else None
        old = s.behaviour_logp if grpo.temperature == 1.0 else None  # the sampler's are untempered
        if not self.on_policy and self.recompute:
            old = passes.logp(Role.OLD)
        kl_penalty = None
        if grpo.kl_in_reward:  # REINFORCE++: k1 of the behaviour policy to the reference, in each token's reward
            behaviour = old if old is not None else passes.logp(Role.OLD)
            kl_penalty = grpo.kl_in_reward * np.asarray(kl_lib.kl(behaviour, ref, "k1"))
            metrics["reward/kl_penalty"] = float((kl_penalty * mask).sum() / max(mask.sum(), 1.0))

        adv = advantages_of(rewards, group, grpo.advantage_estimator, grpo.scale_rewards, mask=mask,
                            kl_penalty=kl_penalty, options=grpo.advantage_options())
        zero_var = np.asarray(grpo_lib.zero_variance_groups(rewards, group))
        metrics["zero_variance_groups"] = float(zero_var.reshape(-1, group)[:, 0].mean())
        on = mask > 0 if adv.ndim == 2 else np.ones(adv.shape, bool)  # token-level: over the loss tokens
        scored = adv[on] if on.any() else np.zeros(1, np.float32)
        metrics.update({"advantage/mean": float(scored.mean()), "advantage/std": float(scored.std()),
                        "advantage/min": float(scored.min()), "advantage/max": float(scored.max()),
                        "advantage/abs_mean": float(np.abs(scored).mean())})
        seq = np.ones(len(rewards), np.float32)
        if grpo.drop_zero_variance_groups:
            mask[zero_var] = 0.0
            seq[zero_var] = 0.0
        metrics["loss_tokens_fraction"] = float(mask.sum() / max(s.completion_mask.sum(), 1.0))

        buffer = {"input_ids": s.input_ids, "attention_mask": s.attention_mask, "completion_mask": mask,
                  "advantages": adv, "sequence_mask": seq}
        if grpo.beta != 0.0:
            buffer["ref_logp"] = ref
        if not self.on_policy:
            buffer["old_logp"] = old
        if grpo.beta != 0.0 and old is not None:
            kl = np.asarray(kl_lib.kl(old, buffer["ref_logp"], grpo.kl_estimator, mask=s.completion_mask))
            metrics["rollout/kl_ref"] = float((kl * s.completion_mask).sum() / max(s.completion_mask.sum(), 1.0))
        if self.mismatch_in_step:  # the step's own forward is the trainer side (module docstring)
            buffer["behaviour_logp"], buffer["rollout_mask"] = s.behaviour_logp, s.completion_mask
        else:
            weights, mismatch = correction.rollout_correction(
                passes.logp(Role.MISMATCH), s.behaviour_logp, s.completion_mask, grpo.rollout_correction,
                grpo.rollout_correction_min or None, grpo.rollout_correction_max)
            metrics.update(mismatch)
            if weights is not None:
                buffer["is_weights"] = weights
        metrics.update(passes.timings())
        metrics.update(passes.layout_metrics())
        if self.replay is not None:  # groups without a signal replaced by kept ones that had one
            buffer, replayed = self.replay.apply(rollout, buffer, ~zero_var.reshape(-1, group)[:, 0])
            metrics.update(replayed)
        return buffer, metrics, s


def take_groups(draws: list, order: list, group: int) -> Sampled:
    """The `Sampled` holding groups `order` = [(draw, group index), ...] of `draws` in that order (rows
    prompt-major); per-row arrays are taken, `times` summed over every draw (all of them were sampled)."""
    first, out = draws[0], {}
    for f in dataclasses.fields(first):
        value = getattr(first, f.name)
        if isinstance(value, np.ndarray) and value.ndim >= 1 and len(value) == len(first.rewards):
            out[f.name] = np.concatenate([getattr(draws[d], f.name)[j * group:(j + 1) * group] for d, j in order])
        elif f.name == "times":
            out[f.name] = {k: sum(float(getattr(d, f.name).get(k, 0.0)) for d in draws) for k in value}
        else:
            out[f.name] = value
    return Sampled(**out)


def build_grpo(config: TrainConfig, model, mesh) -> GRPOTask:
    return GRPOTask(config, model, mesh)
