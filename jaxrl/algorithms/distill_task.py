"""`algorithm = "distill"`: on-policy distillation (GKD, Agarwal et al. 2024; the on-policy distillation recipe) on the
shared training core, its rollouts made as GRPO's are (jaxrl/algorithms/online).

    python -m launchers.train --config=configs/distill.py --workdir=runs/distill \
        --config.distill.teacher_path=/models/Qwen3.5-9B --config.data.problems=problems.jsonl

Each step (one update per rollout, on-policy: prompts_per_step x num_generations = B_global):
  1. rows: round(lmbda x prompts_per_step) prompts sampled by the student, num_generations each, on its rollout
     backend (jax | server | vllm, adapter sync included: `Rollouts`), scored by `config.reward`; the other rows are
     responses of `distill.sft_path` (`SFTResponses`), in a stream seeded by (seed, step) so a resumed run takes the
     same ones;
  2. the teacher (a `Scorer` built from `distill.teacher_spec`, jaxrl.backends.scorers: jaxrl/backends/jax_teacher.py
     in this process, or the servers of `teacher_servers` through jaxrl/backends/teacher_client.py: ours by echo +
     logprobs, vLLM's by prompt_logprobs) scores every completion token: the sampled token's log-prob and its top
     `teacher_top_k` support with the remainder's mass, at `temperature`;
  3. the update (`DistillObjective`): the student's log-probs on that support (the one teacher-forced pass with the
     support head, jaxrl.models.teacher_forced `Head.support`: jaxrl.ops.logprobs.support_logprobs, inside the
     step) and, per completion token, the loss of jaxrl/algorithms/distill_loss.py: reverse_kl as the
     advantage A_t = log p_teacher(x_t) - log p_student(x_t) of a policy-gradient term -A_t * ratio_t (ratio 1 with a
     gradient: computed from the step's own log-probs, so it is exactly on-policy), jsd / forward_kl_topk as the
     divergence itself; plus, with `reward_weight`, -reward_weight x (reward - group mean) x ratio_t. Token mean over
     the global batch (any micro-batch split gives the same update).

Metrics (global token means over completion tokens unless named): `distill/reverse_kl` and
`distill/reverse_kl_max` (KL(student || teacher) per token over the teacher's top-k + remainder: the exact reverse KL
when k = V, a lower bound otherwise), `distill/log_ratio` (the sampled token's student - teacher log-prob: reverse_kl's
one-sample estimate), `distill/student_logp`, `distill/teacher_logp`, `distill/top1_agreement` (student argmax =
teacher argmax), `distill/loss` (the divergence, top-k losses); from the rollout `distill/outside_topk` (student-
sampled tokens outside the teacher's top-k), `distill/student_rows` (their share of the step), `reward/*`,
`completion/*` (student rows), `time/teacher_s`.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.algorithms import distill_loss as dl
from jaxrl.algorithms import grpo as grpo_lib
from jaxrl.algorithms.online.buffer import Schedule
from jaxrl.algorithms.online.layout import OnlineLayout
from jaxrl.algorithms.online.passes import completion_inputs
from jaxrl.algorithms.online.rollouts import Rollouts, sample_metrics
from jaxrl.algorithms.online.task import OnlineTask
from jaxrl.backends.jax_teacher import check_same_vocabulary
from jaxrl.backends.scorers import ScorerContext
from jaxrl.data.stream import epoch_stream, token_rows
from jaxrl.models import qwen35
from jaxrl.models.teacher_forced import Head, next_token_logprobs
from jaxrl.algorithms.config import TrainConfig
from jaxrl.algorithms.distill_config import DistillConfig


@dataclasses.dataclass(frozen=True)
class DistillObjective:
    """The distillation loss of one micro-batch. Batch keys: input_ids, attention_mask [b, P + C]; completion_mask
    [b, C]; teacher_logp, teacher_rest_logp [b, C]; teacher_top_logp, teacher_top_ids [b, C, k]; reward_advantages
    [b] when reward_weight != 0."""

    loss_name: str = DistillConfig.loss
    jsd_beta: float = DistillConfig.jsd_beta
    temperature: float = DistillConfig.temperature
    reward_weight: float = DistillConfig.reward_weight
    chunk_size: int = 512

    def normalisers(self, batch):
        return grpo_lib.global_normalizers(batch["completion_mask"])

    def loss(self, model, mb, normalisers, rng):
        mask = mb["completion_mask"]
        args, layout = completion_inputs(mb, mask.shape[1])  # padded or packed rows
        student = next_token_logprobs(model, *args, temperature=self.temperature, chunk_size=self.chunk_size,
                                      head=Head.support(mb["teacher_top_ids"]), **layout)
        logp, s_top, s_rest, s_argmax = student.logp, student.support_logp, student.rest_logp, student.argmax
        sg = jax.lax.stop_gradient
        t_top, t_rest, t_logp = mb["teacher_top_logp"], mb["teacher_rest_logp"], mb["teacher_logp"]
        ratio = jnp.exp(logp - sg(logp))  # 1, with the gradient of logp: the on-policy policy-gradient term
        advantage = jnp.zeros_like(logp)
        per_token = {}
        if self.loss_name == "reverse_kl":
            advantage = sg(dl.reverse_kl_advantages(logp, t_logp, mask))
            loss_tok = jnp.zeros_like(logp)
        else:
            loss_tok = dl.topk_divergence(self.loss_name, s_top, s_rest, t_top, t_rest, self.jsd_beta)
            per_token["distill/loss"] = sg(loss_tok)
        if self.reward_weight:
            advantage = advantage + self.reward_weight * mb["reward_advantages"][:, None]
        loss_tok = loss_tok - advantage * ratio
        weights = grpo_lib.token_weights(mask, "token_mean", normalisers)
        loss = grpo_lib.aggregate_loss(loss_tok, weights)

        reverse_kl = sg(dl.jsd_topk(s_top, s_rest, t_top, t_rest, 1.0))
        per_token.update({
            "distill/reverse_kl": reverse_kl,
            "distill/log_ratio": sg(logp) - jnp.maximum(t_logp, dl.LOG_FLOOR),
            "distill/student_logp": sg(logp),
            "distill/teacher_logp": jnp.maximum(t_logp, dl.LOG_FLOOR),
            "distill/top1_agreement": (s_argmax == mb["teacher_top_ids"][..., 0]).astype(jnp.float32),
        })
        metrics = grpo_lib.token_metric_contributions(per_token, mask, normalisers)
        # a maximum over the micro-batches (jaxrl.train.step: names ending in `max`); KL >= 0
        metrics["distill/reverse_kl_max"] = jnp.max(jnp.where(mask > 0, reverse_kl, 0.0))
        return loss, metrics


def reward_advantages(rewards: np.ndarray, student_rows: int, num_generations: int) -> np.ndarray:
    """[rows] the verifier reward's group advantage (reward - its group's mean) of the first `student_rows` rows,
    groups of `num_generations`; 0 for the SFT rows after them, for an unscored row (NaN) and for a group with no
    scored member. `reward_weight` times it is added to each token's distillation advantage (DistillObjective)."""
    adv = np.zeros(len(rewards), np.float32)
    group = np.asarray(rewards[:student_rows], np.float32).reshape(-1, num_generations)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmean of an all-NaN group
        adv[:student_rows] = np.nan_to_num((group - np.nanmean(group, 1, keepdims=True)).reshape(-1))
    return adv


class SFTResponses:
    """Rows of an SFT JSON Lines file (`{"input_ids": [...], "loss_mask": [...]}`, the format of data.source =
    jsonl) in the rollout layout: the prompt (tokens before the first loss_mask 1) left-padded into P columns, the
    response (the rest, cut to C tokens) right-padded into C, its loss_mask the completion mask."""

    def __init__(self, path: str, max_prompt_len: int, max_new_tokens: int, pad_id: int, seed: int):
        if not os.path.isfile(path):
            raise ValueError(f"distill.sft_path={path}: no such file (distill.lmbda < 1 takes rows from it)")
        P, C = max_prompt_len, max_new_tokens
        ids, attn, cmask = [], [], []
        for lineno, row, lm in token_rows(path, need_loss_mask=True):
            if len(lm) != len(row) or not any(lm) or lm[0]:
                raise ValueError(f"{path}:{lineno}: loss_mask must be as long as input_ids, start with a prompt "
                                 f"(0s) and mark a response (1s)")
            p = lm.index(1)
            if p > P:
                raise ValueError(f"{path}:{lineno}: a prompt of {p} tokens is longer than data.max_prompt_len={P}")
            i = np.full(P + C, pad_id, np.int32)
            a = np.zeros(P + C, np.int32)
            c = np.zeros(C, np.float32)
            resp = row[p:p + C]
            i[P - p:P], i[P:P + len(resp)] = row[:p], resp
            a[P - p:P + len(resp)] = 1
            c[:len(resp)] = lm[p:p + C]
            ids.append(i), attn.append(a), cmask.append(c)
        if not ids:
            raise ValueError(f"{path}: no rows")
        self.ids, self.attn, self.cmask = np.stack(ids), np.stack(attn), np.stack(cmask)
        self.seed = seed

    def rows(self, rollout: int, count: int) -> dict[str, np.ndarray]:
        """Rollout r's `count` rows: positions [r count, (r + 1) count) of a stream reshuffled each epoch."""
        index = epoch_stream(len(self.ids), rollout * count, count, seed=self.seed, salt=38)
        return {"input_ids": self.ids[index], "attention_mask": self.attn[index],
                "completion_mask": self.cmask[index]}


class DistillTask(OnlineTask):
    def __init__(self, config: TrainConfig, model, mesh):
        d: DistillConfig = config.distill
        self.d = d
        rows = d.rows_per_rollout
        if rows != config.batch.global_batch:
            raise ValueError(f"distill.prompts_per_step x distill.num_generations = {rows} rows must equal the global "
                             f"batch batch.micro_batch_size x batch.grad_accum = {config.batch.global_batch} "
                             f"(distillation makes one on-policy update per rollout)")
        if d.teacher_top_k > model.config.vocab_size:
            raise ValueError(f"distill.teacher_top_k={d.teacher_top_k} is over the vocabulary of "
                             f"{model.config.vocab_size} tokens: the top k of a distribution cannot hold more")
        self.student_prompts = int(round(d.lmbda * d.prompts_per_step))
        self.student_rows = self.student_prompts * d.num_generations
        # Everything that can refuse the run comes first: no teacher is loaded and nothing written before.
        rollouts = Rollouts(config, model, mesh, prompts_per_rollout=max(self.student_prompts, 1), sampling=d)
        self.sft = (SFTResponses(d.sft_path, config.data.max_prompt_len, d.max_new_tokens, rollouts.pad_id,
                                 config.seed) if self.student_rows < rows else None)
        student_dir = config.data.tokenizer or config.model_path
        check_same_vocabulary(student_dir, model.config.vocab_size, d.teacher_path)
        # a served teacher probes every server here: one that cannot serve refuses the run
        self.teacher = d.teacher_spec.build(ScorerContext(
            width=config.data.max_prompt_len + d.max_new_tokens, top_k=d.teacher_top_k,
            vocab_size=model.config.vocab_size, dtype=config.dtype, mesh=mesh,
            compute={k: getattr(config, k) for k in qwen35.COMPUTE_FIELDS},
            compile_options=dict(config.compile_options) or None))
        super().__init__(config, Schedule(rows, rows, 1, config.seed), rollouts)
        self.chunk_size = config.logprob_chunk_size
        self.objective = DistillObjective(loss_name=d.loss, jsd_beta=d.jsd_beta, temperature=d.temperature,
                                          reward_weight=d.reward_weight, chunk_size=self.chunk_size)
        self.train_keys = ("input_ids", "attention_mask", "completion_mask", "teacher_logp", "teacher_top_logp",
                           "teacher_top_ids", "teacher_rest_logp") + (
            ("reward_advantages",) if d.reward_weight else ())
        self.layout = OnlineLayout(d.layout, width=d.max_new_tokens, pad_id=rollouts.pad_id, name=d.NAME)
        self.micro_batch_size = config.batch.micro_batch_size

    def batch(self, step: int):
        """The step's rows in the layout the rule picks (jaxrl/algorithms/online/layout.py), packed per
        micro-batch: the student's pass. The teacher scores the padded rows (its scorer's own layout)."""
        out, host = super().batch(step)
        out, counters = self.layout.apply(out, self.micro_batch_size)
        return out, {**host, **counters}

    def make_rollout(self, rollout: int, policy):
        d, rows = self.d, self.d.rows_per_rollout
        parts, metrics = [], {}
        rewards = np.full(rows, np.nan, np.float32)
        if self.student_rows:
            s = self.rollouts.run(policy, rollout)
            parts.append({"input_ids": s.input_ids, "attention_mask": s.attention_mask,
                          "completion_mask": s.completion_mask})
            rewards[:self.student_rows] = s.rewards
            metrics.update(sample_metrics(s, d.max_new_tokens))
            metrics.update({"time/" + k: v for k, v in s.times.items()})
        if self.sft is not None:
            parts.append(self.sft.rows(rollout, rows - self.student_rows))
        arrays = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        t0 = time.perf_counter()
        scores = self.teacher.score(arrays, k=d.teacher_top_k, temperature=d.temperature,
                                    batch_size=d.logprob_batch_size, chunk_size=self.chunk_size)
        metrics["time/teacher_s"] = time.perf_counter() - t0
        buffer = dict(arrays, **{"teacher_" + k: v for k, v in scores.items()})
        if d.reward_weight:
            buffer["reward_advantages"] = reward_advantages(rewards, self.student_rows, d.num_generations)
        student = arrays["completion_mask"][:self.student_rows] > 0
        if student.any():
            P = arrays["input_ids"].shape[1] - d.max_new_tokens
            sampled = arrays["input_ids"][:self.student_rows, P:]
            inside = (scores["top_ids"][:self.student_rows] == sampled[..., None]).any(-1)
            metrics["distill/outside_topk"] = float((~inside)[student].mean())
        metrics["distill/student_rows"] = self.student_rows / rows
        return buffer, metrics, None  # synchronous and on-policy: no sampler's data to keep


def build_distill(config: TrainConfig, model, mesh) -> DistillTask:
    return DistillTask(config, model, mesh)
