"""`algorithm = "ppo"`: PPO with a value head and online rollouts on the shared training core (jaxrl.train).

    python -m launchers.train --config=configs/ppo.py:model=4b,kl=0.05 --workdir=runs/ppo_4b \
        --config.model_path=/models/Qwen3.5-4B --config.data.problems=problems.jsonl

The value function is `ValueHead` (Linear H -> 1, zero-initialised) on the policy's final hidden state, attached
as `model.value_head` and trained alongside the LoRA factors (the task's `trainable` filter); it is part of the
training state (checkpoints, resume) but not of the adapter artifacts or the PEFT export.

Each rollout (jaxrl/algorithms/online): `prompts_per_rollout` prompts x `num_generations` samples from the
current policy -> scores (`config.reward`) -> one teacher-forced pass with the adapters on (old log-probs at the
sampling temperature, old values) and one with them off (reference log-probs) -> per-token rewards
`-kl_coef * KL_t` (`kl_estimator` k1 | k3) plus the score at the last completion token -> optional reward
whitening (scale only) -> GAE (`gamma`, `lam`) -> advantage whitening over the rollout. The rollout is then
trained on for `epochs` passes of `minibatches` minibatches (each one global batch, one optimizer update), so
N = minibatches x B_global. The KL coefficient starts at `init_kl_coef` and, with `adaptive_kl`, follows the
Ziegler et al. controller (`kl_target`, `kl_horizon`; updated after each rollout from the mean over sequences
of each sequence's token-mean KL, as verl and OpenRLHF; n_steps = N); it is host state saved with every
checkpoint.

Episodes (`environment` set; jaxrl/environments/runner.py): each row is a multi-turn episode, its
completion columns (`max_episode_tokens` wide) every turn's sampled tokens (mask 1) and every observation (mask 0).
Environment tokens are not actions: they get no KL reward, no value target, no advantage and no loss, and GAE
skips them (`ppo.gae` passes its carry through a masked position), so the chain runs from a turn's last sampled
token to the next turn's first with one gamma/lambda step, and V there reads the state after the observation (the
observation is the environment's transition). Each turn's environment reward (a `turn_cost`, the final score) is
given at that turn's last sampled token (`Sampled.turn_rewards`): a cost paid at turn k is in the returns of turns
<= k only, and the final score at the episode's last sampled token, as a completion's. Metrics `episode/*` as
GRPO's.

Objective (`PPOObjective`, the micro-batch contract): `ppo.ppo_loss` = the policy term `policy_loss`
(jaxrl.algorithms.policy_loss; default `ppo_clip`, the clipped policy loss with `cliprange` on both sides; the
others as in GRPO, with `policy_loss_options`) + `vf_coef` x clipped value loss (`cliprange_value`, 0 =
unclipped), token means over the global batch. The log-ratio is clamped to +-`log_ratio_clamp` (20, verl) before
`exp`: an unclamped ratio of a token whose probability grew by e^89 overflows float32, and with A < 0 the loss -rho A is +inf. `dual_clip` (> 1, verl's
`clip_ratio_c`) caps the loss of A < 0 tokens at -A dual_clip. `rollout_correction` weights the policy term as in
GRPO (jaxrl.algorithms.grpo_task, trainer side: the teacher-forced pass above, at temperature 1). In the first
`critic_warmup_steps` train steps only the value head trains (the LoRA factors get no gradient, so Adam leaves them
where they are: the first rollouts' returns then meet a critic that has fit them). A NaN/inf loss or gradient skips
the update (the training core's non-finite masking, counted in `skipped_updates`).

Metrics per step: from the loss `pg_loss`, `vf_loss`, `clip_fraction`, `vf_clip_fraction`, `approx_kl` (to the
behaviour policy), `ratio`, `entropy`; from the rollout `reward/*`, `completion/*`, `advantage/*` (before
whitening), `value/mean`, `return/mean`, `explained_variance` (old values vs returns), `rollout/kl` (token mean
of the KL estimate to the reference), `rollout/kl_sequence` (its per-sequence sum, averaged),
`rollout/kl_sequence_mean` (its per-sequence mean, averaged: what the adaptive controller steers), `kl_coef` (the
coefficient the rollout used), `mismatch/*` (as GRPO's), `critic_warmup` (1 in a warm-up step) when
critic_warmup_steps > 0; maxima over the step's tokens `ratio/max` (the clamped ratio) and `value/abs_max`; and on
the rollout's first step `time/{sample_s,score_s,policy_pass_s,ref_logp_s,mismatch_logp_s,rollout_s}`.
"""

from __future__ import annotations

import dataclasses
import threading
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from jaxrl.algorithms import grpo as grpo_lib
from jaxrl.algorithms import kl as kl_lib
from jaxrl.algorithms import ppo as ppo_lib
from jaxrl.algorithms.config import TrainConfig
from jaxrl.algorithms.online import correction
from jaxrl.algorithms.online.buffer import Schedule
from jaxrl.algorithms.online.controller import proximal_pass
from jaxrl.algorithms.online.layout import OnlineLayout, keeps_groups
from jaxrl.algorithms.online.passes import RolloutPasses, Role, policy_forward
from jaxrl.algorithms.online.rollouts import Rollouts, sample_metrics
from jaxrl.algorithms.online.task import OnlineTask
from jaxrl.algorithms.policy_loss import resolve_options
from jaxrl.algorithms.ppo_config import PPOConfig
from jaxrl.models.lora import LoRAParam


def _lr_scaled(x: jax.Array, scale: float) -> jax.Array:
    """Value `scale * x`, gradient with respect to x as if it were x itself. Under Adam (whose step per parameter is
    about the learning rate whatever the gradient's size) the effective parameter `scale * x` then moves `scale`
    times faster: a learning-rate multiplier for one module that leaves the gradient (and so the global-norm
    clipping of all the others) untouched."""
    return x + (scale - 1.0) * jax.lax.stop_gradient(x)


class ValueHead(nnx.Module):
    """Scalar value of each position, [..., H] -> [...], fp32:

        V = lr_scale * (weight . h / sqrt(H) + bias)          (through `_lr_scaled`)

    `lr_scale` = ppo.value_learning_rate / optimizer.learning_rate: the head learns at its own rate (LLM rates such
    as 1e-6 would leave a fresh head at its initial value for a whole run). The 1/sqrt(H) makes the weight act on a
    unit-RMS state, so Adam's noise-driven drift of H weights (each about the learning rate per step) moves V as
    little as the drift of the one bias, instead of sqrt(H) times more. Zero-initialised: the first values are 0
    and attaching the head changes nothing."""

    def __init__(self, hidden_size: int, lr_scale: float = 1.0):
        self.weight = nnx.Param(jnp.zeros((1, hidden_size), jnp.float32))  # [out, in] like every Linear
        self.bias = nnx.Param(jnp.zeros((1,), jnp.float32))
        self.lr_scale = float(lr_scale)

    def __call__(self, h: jax.Array) -> jax.Array:
        w, b = _lr_scaled(self.weight[...], self.lr_scale), _lr_scaled(self.bias[...], self.lr_scale)
        inv = 1.0 / float(np.sqrt(w.shape[-1]))
        return (jnp.einsum("...h,oh->...o", h.astype(jnp.float32), w) * inv + b)[..., 0]


def attach_value_head(model, lr_scale: float = 1.0) -> ValueHead:
    """`model.value_head` (created once; an existing head keeps its weights and takes this lr_scale)."""
    if getattr(model, "value_head", None) is None:
        model.value_head = ValueHead(int(model.config.hidden_size), lr_scale)
    model.value_head.lr_scale = float(lr_scale)
    return model.value_head


TRAINABLE = nnx.Any(LoRAParam, nnx.PathContains("value_head"))


@dataclasses.dataclass(frozen=True)
class PPOObjective:
    """PPO loss of one micro-batch. Batch keys: input_ids, attention_mask [b, P+C]; completion_mask, old_logp,
    old_values, advantages (whitened), returns [b, C]; is_weights [b, C] (the rollout correction) unless it is
    none; policy_on [b] (0 in the critic warm-up steps, else 1) when ppo.critic_warmup_steps > 0. Defaults are the
    `ppo` block's (`of` builds one from a run's block)."""

    cliprange: float = PPOConfig.cliprange
    cliprange_value: float = PPOConfig.cliprange_value
    vf_coef: float = PPOConfig.vf_coef
    temperature: float = PPOConfig.temperature
    value_head_detach: bool = PPOConfig.value_head_detach
    entropy: bool = PPOConfig.log_entropy
    entropy_coef: float = PPOConfig.entropy_coef
    chunk_size: int = 512
    log_ratio_clamp: Optional[float] = PPOConfig.log_ratio_clamp or None  # 0 in the config: off
    dual_clip: Optional[float] = PPOConfig.dual_clip or None
    policy_loss: str = PPOConfig.policy_loss
    policy_loss_options: Any = None  # policy_loss.resolve_options of the block; None: ppo_clip's from the fields

    @classmethod
    def of(cls, ppo: PPOConfig, *, chunk_size: int) -> "PPOObjective":
        return cls(cliprange=ppo.cliprange, cliprange_value=ppo.cliprange_value, vf_coef=ppo.vf_coef,
                   temperature=ppo.temperature, value_head_detach=ppo.value_head_detach, entropy=ppo.log_entropy,
                   entropy_coef=ppo.entropy_coef, chunk_size=chunk_size, log_ratio_clamp=ppo.log_ratio_clamp or None,
                   dual_clip=ppo.dual_clip or None, policy_loss=ppo.policy_loss,
                   policy_loss_options=resolve_options(ppo.policy_loss, ppo.policy_loss_common(),
                                                       ppo.policy_loss_options, ppo.NAME))

    def normalisers(self, batch):
        return grpo_lib.global_normalizers(batch["completion_mask"])

    def loss(self, model, micro_batch, normalisers, rng):
        mask = micro_batch["completion_mask"]
        h, logp, ent = policy_forward(model, micro_batch, chunk_size=self.chunk_size, temperature=self.temperature,
                                      entropy=self.entropy or bool(self.entropy_coef))
        sg = jax.lax.stop_gradient
        if "policy_on" in micro_batch:  # critic warm-up: the same values, but no gradient reaches the LoRA factors
            on = micro_batch["policy_on"] > 0
            h = jnp.where(on[:, None, None], h, sg(h))
            logp = jnp.where(on[:, None], logp, sg(logp))
            ent = None if ent is None else jnp.where(on[:, None], ent, sg(ent))
        values = model.value_head(sg(h) if self.value_head_detach else h)
        return ppo_lib.ppo_loss(
            logp, micro_batch["old_logp"], micro_batch["advantages"], values, micro_batch["old_values"],
            micro_batch["returns"], mask, normalisers, cliprange=self.cliprange,
            cliprange_value=self.cliprange_value or None, vf_coef=self.vf_coef, dual_clip=self.dual_clip,
            log_ratio_clamp=self.log_ratio_clamp, sampling_weights=micro_batch.get("is_weights"), entropies=ent,
            entropy_coef=self.entropy_coef, policy_loss=self.policy_loss,
            policy_loss_options=self.policy_loss_options, rng=rng)


@partial(jax.jit, static_argnames=("estimator", "gamma", "lam", "whiten_rewards", "whiten_advantages"))
def returns_and_advantages(old_logp, ref_logp, values, mask, scores, kl_coef, turn_scores=None, *, estimator, gamma,
                           lam, whiten_rewards, whiten_advantages):
    """The rollout's [N, C] token rewards -> GAE, all on the whole rollout (whitening uses its statistics).
    `scores` [N] land on each row's last sampled token; `turn_scores` [N, C] (episodes: each turn's reward at its
    last sampled token) are added where they are. Returns (advantages (whitened if asked), raw advantages, returns,
    kl [N, C])."""
    rewards, kl = ppo_lib.kl_penalty_rewards(old_logp, ref_logp, mask, scores, kl_coef, estimator)
    if turn_scores is not None:
        rewards = rewards + jnp.where(jnp.asarray(mask) > 0, turn_scores, 0.0)
    if whiten_rewards:
        rewards = ppo_lib.masked_whiten(rewards, mask, shift_mean=False)
    adv, ret = ppo_lib.gae(rewards, values, mask, gamma, lam)
    white = ppo_lib.masked_whiten(adv, mask) if whiten_advantages else adv
    return white, adv, ret, kl


class PPOTask(OnlineTask):
    trainable = TRAINABLE

    def __init__(self, config: TrainConfig, model, mesh):
        ppo: PPOConfig = config.ppo
        self.ppo = ppo
        if ppo.kl_estimator not in ("k1", "k3"):
            kl_lib.kl(jnp.zeros((1, 1)), jnp.zeros((1, 1)), ppo.kl_estimator)  # unknown: a KeyError naming them
        global_batch = config.batch.global_batch
        rows = ppo.rows_per_rollout
        if rows != ppo.minibatches * global_batch:
            raise ValueError(f"ppo.prompts_per_rollout x ppo.num_generations = {rows} rows must equal ppo.minibatches "
                             f"({ppo.minibatches}) x the global batch batch.micro_batch_size x batch.grad_accum "
                             f"({global_batch})")
        rollouts = Rollouts(config, model, mesh, prompts_per_rollout=ppo.prompts_per_rollout, sampling=ppo,
                            episodes=ppo if ppo.environment else None, async_policy=ppo.async_policy)
        whole = ppo.num_generations if keeps_groups(ppo.layout, config.data.max_prompt_len) else 1
        super().__init__(config, Schedule(rows, global_batch, ppo.epochs, config.seed, whole), rollouts,
                         ppo.async_policy, proximal_pass(ppo, config, mesh), ppo.ref_reset_every,
                         ppo.ref_reset_optimizer)
        lr = config.optimizer.learning_rate
        value_lr = ppo.value_learning_rate or lr
        if not (value_lr > 0 and lr > 0):
            raise ValueError(f"ppo.value_learning_rate ({ppo.value_learning_rate}) and optimizer.learning_rate "
                             f"({lr}) must be > 0")
        attach_value_head(model, value_lr / lr)  # follows the optimizer's schedule, scaled
        self.controller = (ppo_lib.AdaptiveKLController(ppo.init_kl_coef, ppo.kl_target, ppo.kl_horizon)
                           if ppo.adaptive_kl else ppo_lib.FixedKLController(ppo.init_kl_coef))
        self.kl_coef = float(self.controller.init())
        self._kl_lock = threading.Lock()
        self.chunk_size = config.logprob_chunk_size
        self.objective = PPOObjective.of(ppo, chunk_size=self.chunk_size)
        weighted = ppo.rollout_correction != "none" or self.async_policy.decoupled
        self.train_keys = ("input_ids", "attention_mask", "completion_mask", "old_logp", "old_values", "advantages",
                           "returns") + (("is_weights",) if weighted else ())
        if ppo.critic_warmup_steps and config.optimizer.weight_decay:
            logging.warning("ppo.critic_warmup_steps=%d with optimizer.weight_decay=%s: the LoRA factors get no "
                            "gradient in the warm-up, but AdamW's decay still shrinks them", ppo.critic_warmup_steps,
                            config.optimizer.weight_decay)
        if ppo.rollout_correction != "none" and ppo.temperature != 1.0:
            logging.warning("ppo.rollout_correction=%s at temperature %s: the sampler reports untempered log-probs "
                            "(as vLLM does by default), so the weights are those of the untempered distributions",
                            ppo.rollout_correction, ppo.temperature)
        self.mesh = mesh
        self.layout = OnlineLayout(ppo.layout, width=rollouts.width, pad_id=rollouts.pad_id, name=ppo.NAME)
        self.micro_batch_size = config.batch.micro_batch_size

    # host state: the KL coefficient -------------------------------------------------------------------------
    def host_state(self) -> dict:
        return {"kl_coef": self.kl_coef}

    def load_host_state(self, state: dict) -> None:
        if "kl_coef" in state:
            self.kl_coef = float(state["kl_coef"])

    def batch(self, step: int):
        out, host = super().batch(step)
        if self.ppo.critic_warmup_steps:  # a per-row flag: the batch is the only per-step input of the update
            on = step >= self.ppo.critic_warmup_steps
            out["policy_on"] = np.full(len(out["input_ids"]), float(on), np.float32)
            host["critic_warmup"] = float(not on)
        # the layout the rule picks, packed per micro-batch (jaxrl/algorithms/online/layout.py)
        out, counters = self.layout.apply(out, self.micro_batch_size)
        return out, {**host, **counters}

    def make_rollout(self, rollout: int, policy):
        ppo = self.ppo
        s = self.rollouts.run(policy, rollout)
        metrics = {**sample_metrics(s, ppo.max_new_tokens), **s.episode}
        metrics.update({"time/" + k: v for k, v in s.times.items()})
        arrays = {"input_ids": s.input_ids, "attention_mask": s.attention_mask, "completion_mask": s.completion_mask}
        reference, event = self.reference_resets.reference_for(rollout, policy)
        metrics.update(event)
        passes = RolloutPasses(policy, arrays, temperature=ppo.temperature, batch_size=ppo.logprob_batch_size,
                               chunk_size=self.chunk_size, mesh=self.mesh, compile_options=self.compile_options,
                               values=True, reference=reference, layout=self.layout)
        # Old log-probs from a teacher-forced pass (the same numerics as the loss) in the pass the values need.
        cur = {"logp": passes.logp(Role.OLD), "values": passes.values()}
        ref = passes.logp(Role.REFERENCE)
        # The sampler-trainer gap (grpo_task's module docstring): at temperature 1 the OLD pass itself.
        is_weights, mismatch = correction.rollout_correction(
            passes.logp(Role.MISMATCH), s.behaviour_logp, s.completion_mask, ppo.rollout_correction,
            ppo.rollout_correction_min or None, ppo.rollout_correction_max)
        metrics.update(mismatch)
        timings = passes.timings()
        metrics.update({"time/policy_pass_s": timings.pop("time/old_logp_s"), **timings})
        metrics.update(passes.layout_metrics())

        masked = np.isnan(s.rewards)  # the reward masked these samples (truncation policy "mask"): no loss
        mask = s.completion_mask * (~masked)[:, None].astype(np.float32)
        scores = np.where(masked, 0.0, s.rewards).astype(np.float32)
        turn_scores = None
        if s.turn_rewards is not None:  # episodes: each turn's reward where that turn ends, not the sum at the end
            turn_scores, scores = s.turn_rewards, np.zeros_like(scores)
        # partial rollouts make rollouts on k producer threads: the coefficient read and its update stay one step
        with self._kl_lock:
            kl_coef = self.kl_coef
            adv, raw_adv, ret, kl = jax.device_get(returns_and_advantages(
                cur["logp"], ref, cur["values"], mask, scores, np.float32(kl_coef), turn_scores,
                estimator=ppo.kl_estimator,
                gamma=ppo.gamma, lam=ppo.lam, whiten_rewards=ppo.whiten_rewards,
                whiten_advantages=ppo.whiten_advantages))
            m = mask > 0
            n_tok = max(int(m.sum()), 1)
            token_kl = float(np.where(m, kl, 0.0).sum() / n_tok)
            lengths = m.sum(-1)
            has_tokens = lengths > 0
            # verl and OpenRLHF: each sequence's token mean, averaged over the sequences (with a token under the loss)
            sequence_kl = float((np.where(m, kl, 0.0).sum(-1)[has_tokens] / lengths[has_tokens]).mean()
                                if has_tokens.any() else 0.0)
            metrics.update({
                "kl_coef": kl_coef,
                "rollout/kl": token_kl,
                "rollout/kl_sequence": float(np.where(m, kl, 0.0).sum(-1).mean()),
                "rollout/kl_sequence_mean": sequence_kl,
                "advantage/mean": float(raw_adv[m].mean()) if m.any() else 0.0,
                "advantage/std": float(raw_adv[m].std()) if m.any() else 0.0,
                "advantage/min": float(raw_adv[m].min()) if m.any() else 0.0,
                "advantage/max": float(raw_adv[m].max()) if m.any() else 0.0,
                "value/mean": float(cur["values"][m].mean()) if m.any() else 0.0,
                "return/mean": float(ret[m].mean()) if m.any() else 0.0,
                "explained_variance": float(ppo_lib.explained_variance(cur["values"], ret, mask)),
            })
            # The controller sees the mean over sequences of each one's token-mean KL (verl, OpenRLHF), so a few long
            # completions do not dominate it; n_steps = samples in the rollout.
            self.kl_coef = float(self.controller.update(np.float32(kl_coef), np.float32(sequence_kl), len(scores)))
            if not np.isfinite(self.kl_coef):
                logging.warning("rollout %d: the KL controller produced %s; keeping %s", rollout, self.kl_coef, kl_coef)
                self.kl_coef = kl_coef
        buffer = {"input_ids": s.input_ids, "attention_mask": s.attention_mask, "completion_mask": mask,
                  "old_logp": cur["logp"], "old_values": cur["values"], "advantages": np.asarray(adv, np.float32),
                  "returns": np.asarray(ret, np.float32)}
        if is_weights is not None:
            buffer["is_weights"] = is_weights
        return buffer, metrics, s


def build_ppo(config: TrainConfig, model, mesh) -> PPOTask:
    return PPOTask(config, model, mesh)
