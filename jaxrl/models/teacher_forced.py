"""The one teacher-forced pass: the log-probability a model gives each next token of given sequences, computed the
way training computes it (`Qwen35.hidden_states` over the whole sequence, then the chunked `token_logprobs`, never
[B, T, V] at once). Every consumer computes it here: the training objectives, DPO's reference pass, online RL's
reference / old / mismatch passes (jaxrl/algorithms/online/passes.py) and the server's scoring (`echo`, top-k
log-probs).

    out = next_token_logprobs(model, ids, mask, start=P - 1)      # logp[:, t] = log p(ids[t + start + 1] | ...)
    out.logp [B, T - 1 - start], out.entropy (entropy=True), out.top_logp / out.top_ids / out.rank (top_k > 0), out.hidden

Positions: the hidden state at position t predicts token t + 1, so the pass over positions [start, T - 1) gives
the log-probs of tokens [start + 1, T): start 0 scores every token but the first (a server's echo, SFT, DPO);
start P - 1 scores a completion that starts at column P (online RL: nothing is computed over the prompt).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax

from jaxrl.models.lora import adapters_disabled
from jaxrl.ops.logprobs import token_logprobs


class TeacherForced(NamedTuple):
    logp: jax.Array  # [B, L] fp32, L = T - 1 - start
    hidden: jax.Array  # [B, L, H]: the hidden states that predict them (a value head reads them)
    entropy: Optional[jax.Array] = None  # [B, L] fp32
    top_logp: Optional[jax.Array] = None  # [B, L, k] fp32, most likely first
    top_ids: Optional[jax.Array] = None  # [B, L, k] int32
    rank: Optional[jax.Array] = None  # [B, L] int32 (top_k > 0): the token's rank, 1 = most likely (vLLM's)


def next_token_logprobs(model, input_ids: jax.Array, attention_mask: jax.Array, *, start: int = 0,
                        temperature: float = 1.0, chunk_size: int = 512, entropy: bool = False, top_k: int = 0,
                        segment_ids: Optional[jax.Array] = None, adapters: bool = True) -> TeacherForced:
    """The pass of the module docstring over input_ids / attention_mask [B, T]. adapters False: with the model's
    LoRA adapters disabled (the reference policy). segment_ids: packed rows (`Qwen35.hidden_states`)."""
    def forward():
        hidden, _ = model.hidden_states(input_ids, attention_mask, segment_ids=segment_ids)
        return hidden[:, start:-1]

    if adapters:
        hidden = forward()
    else:
        with adapters_disabled(model):
            hidden = forward()
    targets = input_ids[:, start + 1:]
    head = model.head_weight()
    if top_k:
        logp, top_logp, top_ids, rank = token_logprobs(hidden, head, targets, chunk_size=chunk_size,
                                                       temperature=temperature, top_k=top_k)
        return TeacherForced(logp, hidden, top_logp=top_logp, top_ids=top_ids, rank=rank)
    if entropy:
        logp, ent = token_logprobs(hidden, head, targets, chunk_size=chunk_size, temperature=temperature,
                                   return_entropy=True)
        return TeacherForced(logp, hidden, entropy=ent)
    return TeacherForced(token_logprobs(hidden, head, targets, chunk_size=chunk_size, temperature=temperature),
                         hidden)
