"""The objective protocol every algorithm implements, and the next-token (SFT) objective.

Micro-batch contract (shared with `jaxrl.algorithms`): one optimizer step sees a *global* batch (every leaf
`[B_global, ...]`, B_global = batch.micro_batch_size * batch.grad_accum). Inside the jitted step

    normalisers = objective.normalisers(global_batch)                  # once, over the whole global batch
    for each micro-batch mb (leaves [micro_batch_size, ...]):
        loss_sum, metric_sums = objective.loss(model, mb, normalisers, rng_i)
    loss = sum of loss_sum;  grads = sum of d loss_sum / d params;  metrics = sum of metric_sums

so `loss_sum` must be the micro-batch's *additive share* of the full-batch loss (per-token losses times weights
built from the global normalisers, e.g. mask / total_active_tokens), never a mean over the micro-batch. Then the
update does not depend on how the batch is split (1 x 8, 2 x 4, 8 x 1) beyond float rounding. Metrics follow the
same rule: return additive shares (divide by a global normaliser inside) so that their sum is the global value.

`model` is the policy with the adapters on; `with jaxrl.models.lora.adapters_disabled(model): ...` gives the
reference policy (the base weights) inside the same function. `rng` is a PRNG key unique to (step, micro-batch).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol

import jax
import jax.numpy as jnp

from jaxrl.models.teacher_forced import next_token_logprobs

Batch = Mapping[str, jax.Array]


class Objective(Protocol):
    """What an algorithm gives the trainer. Both methods are traced inside the jitted step."""

    def normalisers(self, batch: Batch) -> Any:
        """Global-batch constants (a pytree of scalars) from the whole batch, leaves [B_global, ...]."""

    def loss(self, model, micro_batch: Batch, normalisers: Any, rng: jax.Array
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss_sum: fp32 scalar, metric_sums: {name: fp32 scalar}) of one micro-batch, leaves [b, ...]."""


def target_mask(batch: Batch) -> jax.Array:
    """[B, T-1] fp32 weights of the next-token targets: position t predicts token t+1.

    Keys: `input_ids [B, T]`; optional `attention_mask [B, T]` (1 = real token; left or right padding);
    optional `loss_mask [B, T]` aligned with input_ids (1 where the token is a target, e.g. completion tokens
    only); optional `loss_weights [B, T]` (per-token weights, aligned like loss_mask); optional `segment_ids
    [B, T]` (packed rows, jaxrl.data.packing).
    A target counts only when both it and the token predicting it are real, and of the same sequence.
    """
    ids = batch["input_ids"]
    attn = batch.get("attention_mask")
    attn = jnp.ones(ids.shape, jnp.float32) if attn is None else attn.astype(jnp.float32)
    mask = attn[:, 1:] * attn[:, :-1]
    if batch.get("loss_mask") is not None:
        mask = mask * batch["loss_mask"][:, 1:].astype(jnp.float32)
    if batch.get("loss_weights") is not None:
        mask = mask * batch["loss_weights"][:, 1:].astype(jnp.float32)
    if batch.get("segment_ids") is not None:  # the first token of a packed sequence is not the previous one's target
        seg = batch["segment_ids"]
        mask = mask * (seg[:, 1:] == seg[:, :-1]).astype(jnp.float32)
    return mask


@dataclasses.dataclass(frozen=True)
class NextToken:
    """Token-weighted cross-entropy: loss = sum_{b,t} -log p(x_{t+1} | x_<=t) w_{b,t} / sum(w) over the global
    batch (every target token weighs the same, whichever micro-batch holds it).

    Metrics (additive shares): `nll` (= loss), `target_tokens` (count in the micro-batch; sums to the global
    count). Log-probs are the one teacher-forced pass (`jaxrl.models.teacher_forced.next_token_logprobs`: the
    chunked `token_logprobs`, never [B, T, V] at once). Packed rows (a `segment_ids` key, SFT's data.pack) give
    every sequence's tokens the log-probs of its padded row, so the loss is the padded batch's.
    """

    chunk_size: int = 512

    def normalisers(self, batch: Batch) -> dict[str, jax.Array]:
        return {"num_tokens": jnp.maximum(jnp.sum(target_mask(batch)), 1.0)}

    def loss(self, model, micro_batch: Batch, normalisers, rng):
        logp = next_token_logprobs(model, micro_batch["input_ids"], micro_batch.get("attention_mask"),
                                   segment_ids=micro_batch.get("segment_ids"), chunk_size=self.chunk_size).logp
        mask = target_mask(micro_batch)
        weights = mask / normalisers["num_tokens"]
        # jnp.where keeps a padded position's garbage (even inf) out of the sum; a NaN *weight* still propagates.
        loss = -jnp.sum(jnp.where(weights != 0, logp * weights, 0.0))
        return loss, {"nll": loss, "target_tokens": jnp.sum(mask != 0).astype(jnp.float32)}
