"""The one teacher-forced pass: the log-probability a model gives each next token of given sequences, computed the
way training computes it (`Qwen35.hidden_states` over the whole sequence, then a chunked head of
jaxrl.ops.logprobs, never [B, T, V] at once). Every consumer computes it here: the SFT objective
(jaxrl.train.objective.NextToken), DPO's policy and reference passes (jaxrl.algorithms.dpo_task, packed rows
included), online RL's reference / old / mismatch passes (jaxrl/algorithms/online/passes.py), distillation's
student (jaxrl.algorithms.distill_task.DistillObjective) and in-process teacher (jaxrl.backends.jax_teacher), and
the server's scoring (`echo`, top-k log-probs: jaxrl.serve.loop).

    out = next_token_logprobs(model, ids, mask, start=P - 1)      # logp[:, t] = log p(ids[t + start + 1] | ...)
    out.logp [B, T - 1 - start], out.hidden, out.entropy (entropy=True)
    next_token_logprobs(..., head=Head.top_k(k))                  # + top_logp / top_ids [.., k], rank
    next_token_logprobs(..., head=Head.top_k(k, rest=True))       # + top_logp / top_ids [.., k], rest_logp
    next_token_logprobs(..., head=Head.support(ids))              # + support_logp [.., k], rest_logp, argmax

Heads (`Head`), what is read off each position's logits besides the taken token's log-prob:
  Head.logp()                the taken token's log-prob only (the default; `entropy=True` adds the entropy):
                             `token_logprobs`, differentiable (SFT, DPO, online RL);
  Head.top_k(k)              the k most likely tokens and their log-probs, and the taken token's rank (vLLM's):
                             `token_logprobs(top_k=k)`, what a server returns (`top_k=k` says the same);
  Head.top_k(k, rest=True)   a teacher's side of a distillation support: the k most likely, their log-probs and
                             the log-mass of every other token (`topk_support`: the log-softmax after subtracting
                             the max, as the student's side computes it; no rank, no gradient);
  Head.support(ids)          a student's side of it: log-probs at the given ids [B, L, k] (a teacher's top ids),
                             the remainder's log-mass and the argmax (`support_logprobs`, differentiable).
The two top-k forms are not one: the server's numbers are those it has always returned (logits - logsumexp), the
teacher's round as the student's support does (max subtracted first), so the losses compare like with like.

Positions: the hidden state at position t predicts token t + 1, so the pass over positions [start, T - 1) gives
the log-probs of tokens [start + 1, T): start 0 scores every token but the first (a server's echo, SFT, DPO);
start P - 1 scores a completion that starts at column P (online RL, distillation: nothing is computed over the
prompt), `completion_start(input_ids, C)` for a completion of C columns at the end of the row. Packed rows
(jaxrl/algorithms/online/layout.py) instead give `positions` [b, C]: the flat index (row * T + column) of the hidden
state that predicts each token; the pass reads the head at those hidden states only (the token is the one after
it, flat index + 1), so a packed pass returns [b, C] arrays in the padded layout's order, its head over the
completion tokens only, as a padded pass computes it. Shared prefixes (`prefix_group=n`, padded rows whose
consecutive groups of n rows hold one prompt: jaxrl/algorithms/online/shared_prefix.py) compute each group's
prompt once and its n completions from the prompt's caches (`shared_prefix_hidden`); same [b, C] outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxrl.models.lora import adapters_disabled
from jaxrl.ops.logprobs import support_logprobs, token_logprobs, topk_support

HEADS = ("logp", "top_k", "top_k_rest", "support")


@dataclasses.dataclass(frozen=True)
class Head:
    """What a pass reads off each position's logits (module docstring); build one with `Head.logp()`,
    `Head.top_k(k)`, `Head.top_k(k, rest=True)` or `Head.support(ids)`."""

    kind: str = "logp"
    k: int = 0
    ids: Any = None  # Head.support: [B, L, k] int token ids

    def __post_init__(self):
        if self.kind not in HEADS:
            raise ValueError(f"Head kind {self.kind!r}; choose one of {HEADS}")
        if self.kind in ("top_k", "top_k_rest") and self.k < 1:
            raise ValueError(f"Head.top_k needs k >= 1, got {self.k}")
        if self.kind == "support" and self.ids is None:
            raise ValueError("Head.support needs the support's token ids")

    @classmethod
    def logp(cls) -> "Head":
        return cls()

    @classmethod
    def top_k(cls, k: int, *, rest: bool = False) -> "Head":
        return cls("top_k_rest" if rest else "top_k", int(k))

    @classmethod
    def support(cls, ids) -> "Head":
        return cls("support", int(ids.shape[-1]), ids)


class TeacherForced(NamedTuple):
    logp: jax.Array  # [B, L] fp32, L = T - 1 - start
    hidden: jax.Array  # [B, L, H]: the hidden states that predict them (a value head reads them)
    entropy: Optional[jax.Array] = None  # [B, L] fp32 (entropy=True)
    top_logp: Optional[jax.Array] = None  # [B, L, k] fp32, most likely first (Head.top_k)
    top_ids: Optional[jax.Array] = None  # [B, L, k] int32 (Head.top_k)
    rank: Optional[jax.Array] = None  # [B, L] int32 (Head.top_k(k)): the token's rank, 1 = most likely (vLLM's)
    rest_logp: Optional[jax.Array] = None  # [B, L] fp32: log-mass off the support (top_k(k, rest=True), support)
    support_logp: Optional[jax.Array] = None  # [B, L, k] fp32: log-probs at Head.support's ids
    argmax: Optional[jax.Array] = None  # [B, L] int32: the most likely token (Head.support)


def completion_start(input_ids: jax.Array, width: int) -> int:
    """The `start` of a pass over a completion of `width` columns at the end of `input_ids` [B, P + width]: column
    P + t (completion token t) is predicted by column P + t - 1, so start = P - 1."""
    return input_ids.shape[1] - int(width) - 1


def next_token_logprobs(model, input_ids: jax.Array, attention_mask: Optional[jax.Array], *, start: int = 0,
                        temperature: float = 1.0, chunk_size: int = 512, entropy: bool = False,
                        head: Optional[Head] = None, segment_ids: Optional[jax.Array] = None,
                        adapters: bool = True, positions: Optional[jax.Array] = None,
                        prefix_group: Optional[int] = None) -> TeacherForced:
    """The pass of the module docstring over input_ids / attention_mask [B, T]. head: what is read besides the
    taken token's log-prob (default Head.logp()). adapters False: with the model's LoRA adapters disabled (the
    reference policy). segment_ids: packed rows (`Qwen35.hidden_states`). positions [b, L] int: read the tokens
    predicted by these flat hidden-state indices (module docstring) instead of columns [start + 1, T); the
    outputs are then [b, L]. prefix_group n (with `start`, padded rows only): rows g*n .. g*n + n - 1 hold one
    prompt in columns [0, start + 1): it is computed once per group (`shared_prefix_hidden`)."""
    head = Head.logp() if head is None else head
    if entropy and head.kind != "logp":
        raise ValueError(f"next_token_logprobs: entropy=True goes with Head.logp() only, not {head.kind}")

    if prefix_group is not None and (positions is not None or segment_ids is not None):
        raise ValueError("next_token_logprobs: prefix_group is for padded rows, not packed ones")

    def forward():
        if prefix_group is not None:
            return shared_prefix_hidden(model, input_ids, attention_mask, group=prefix_group, start=start)
        hidden, _ = model.hidden_states(input_ids, attention_mask, segment_ids=segment_ids)
        if positions is None:
            return hidden[:, start:-1]
        # gradients reach the packed rows' hidden states through the gather (its transpose is a scatter-add)
        return jnp.take(hidden.reshape(-1, hidden.shape[-1]), positions, axis=0, mode="clip")

    if adapters:
        hidden = forward()
    else:
        with adapters_disabled(model):
            hidden = forward()
    targets = (input_ids[:, start + 1:] if positions is None
               else jnp.take(input_ids.reshape(-1), positions + 1, mode="clip"))
    weight = model.head_weight()
    if head.kind == "top_k":
        logp, top_logp, top_ids, rank = token_logprobs(hidden, weight, targets, chunk_size=chunk_size,
                                                       temperature=temperature, top_k=head.k)
        return TeacherForced(logp, hidden, top_logp=top_logp, top_ids=top_ids, rank=rank)
    if head.kind == "top_k_rest":
        logp, top_logp, top_ids, rest = topk_support(hidden, weight, targets, head.k, chunk_size=chunk_size,
                                                     temperature=temperature)
        return TeacherForced(logp, hidden, top_logp=top_logp, top_ids=top_ids, rest_logp=rest)
    if head.kind == "support":
        logp, on, rest, argmax = support_logprobs(hidden, weight, targets, head.ids, chunk_size=chunk_size,
                                                  temperature=temperature)
        return TeacherForced(logp, hidden, support_logp=on, rest_logp=rest, argmax=argmax)
    if entropy:
        logp, ent = token_logprobs(hidden, weight, targets, chunk_size=chunk_size, temperature=temperature,
                                   return_entropy=True)
        return TeacherForced(logp, hidden, entropy=ent)
    return TeacherForced(token_logprobs(hidden, weight, targets, chunk_size=chunk_size, temperature=temperature),
                         hidden)


def shared_prefix_hidden(model, input_ids: jax.Array, attention_mask: Optional[jax.Array], *, group: int,
                         start: int) -> jax.Array:
    """The hidden states [b, T - 1 - start, H] that predict tokens [start + 1, T) of padded rows input_ids /
    attention_mask [b, T] whose consecutive groups of `group` rows hold one prompt in columns [0, P = start + 1)
    (left-padded, its last column a real token), each group's prompt computed once
    (`Qwen35.branched_hidden_states`: every layer prefills the G = b / group prompts, repeats their keys / values,
    conv windows and recurrent states `group` times and continues them with the b completions [b, C]).
    Completion token 0 is predicted by the prompt's last hidden state (repeated), token t by the continuation's
    hidden state t - 1: the columns a padded pass reads (hidden[:, start:-1]). Differentiable end to end, LoRA as
    in any pass (every projection is the same `Linear`); the prompt's activations get the summed gradient of
    their group's completions through the repeats."""
    batch, total = input_ids.shape
    prompt = int(start) + 1
    if group < 1 or batch % group:
        raise ValueError(f"shared_prefix_hidden: {batch} rows are not whole groups of {group}")
    if not 0 < prompt < total:
        raise ValueError(f"shared_prefix_hidden: start={start} leaves no prompt or no completion in {total} columns")
    mask = jnp.ones((batch, total), jnp.int32) if attention_mask is None else attention_mask
    h_prompt, h_completion = model.branched_hidden_states(input_ids[::group, :prompt], mask[::group, :prompt],
                                                          input_ids[:, prompt:], mask[:, prompt:], group)
    first = jnp.repeat(h_prompt[:, -1:], group, axis=0)
    return jnp.concatenate([first, h_completion[:, :-1]], axis=1)
