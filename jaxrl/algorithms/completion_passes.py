"""Teacher-forced passes over rollout completions: the forward the GRPO / PPO losses start from, and the batched
reference / old-log-prob / value passes over a whole rollout (the sequence layout of
`jaxrl.algorithms.online_rollouts`: completion token t, column P + t, is predicted by the hidden state of column
P + t - 1, so every per-token array is [N, C] and no log-prob is computed over the prompt).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from flax import nnx

from jaxrl.models.lora import adapters_disabled
from jaxrl.ops.logprobs import token_logprobs
from jaxrl.train import batched_forward


def completion_hidden(model, input_ids, attention_mask, max_new_tokens: int):
    """[b, C, H]: the hidden state that predicts each completion token (columns P-1 ... P+C-2)."""
    hidden, _ = model.hidden_states(input_ids, attention_mask)
    prompt_len = input_ids.shape[1] - max_new_tokens
    return hidden[:, prompt_len - 1:-1]


def completion_logprobs(model, hidden, input_ids, max_new_tokens: int, *, chunk_size: int, temperature: float,
                        entropy: bool):
    """(logp [b, C], entropy [b, C] or None) of the completion tokens at `temperature` (chunked over the vocab)."""
    targets = input_ids[:, input_ids.shape[1] - max_new_tokens:]
    logp, ent = token_logprobs(hidden, model.head_weight(), targets, chunk_size=chunk_size, temperature=temperature,
                               return_entropy=True) if entropy else (
        token_logprobs(hidden, model.head_weight(), targets, chunk_size=chunk_size, temperature=temperature), None)
    return logp, ent


def policy_forward(model, micro_batch, *, chunk_size: int, temperature: float, entropy: bool):
    """(hidden [b, C, H], logp [b, C], entropy or None) of a GRPO/PPO micro-batch's completion tokens: the
    forward both objectives start from (PPO's value head reads the same hidden states)."""
    max_new_tokens = micro_batch["completion_mask"].shape[1]
    ids = micro_batch["input_ids"]
    hidden = completion_hidden(model, ids, micro_batch["attention_mask"], max_new_tokens)
    logp, ent = completion_logprobs(model, hidden, ids, max_new_tokens, chunk_size=chunk_size,
                                    temperature=temperature, entropy=entropy)
    return hidden, logp, ent


def _pass(graphdef, state, input_ids, attention_mask, *, max_new_tokens, adapters, temperature, chunk_size,
          values):
    model = nnx.merge(graphdef, state)
    if adapters:
        h = completion_hidden(model, input_ids, attention_mask, max_new_tokens)
    else:
        with adapters_disabled(model):
            h = completion_hidden(model, input_ids, attention_mask, max_new_tokens)
    logp, _ = completion_logprobs(model, h, input_ids, max_new_tokens, chunk_size=chunk_size,
                                  temperature=temperature, entropy=False)
    out = {"logp": logp}
    if values:
        out["values"] = model.value_head(h)
    return out


def teacher_forced(model, arrays: dict, *, max_new_tokens: int, adapters: bool, batch_size: int,
                   temperature: float = 1.0, chunk_size: int = 512, values: bool = False, mesh=None,
                   compile_options: Optional[dict] = None) -> dict[str, np.ndarray]:
    """{"logp": [N, C] (+ "values": [N, C])} of every row of `arrays` (input_ids, attention_mask) under `model`
    with its adapters on or off: one jitted program, `batch_size` rows per call (jaxrl.train.batched_forward)."""
    program = batched_forward.jit_program(_pass, ("graphdef", "max_new_tokens", "adapters", "temperature", "chunk_size",
                                            "values"), compile_options, mesh)
    graphdef, state = nnx.split(model)
    out = batched_forward.map_batches(
        lambda b: program(graphdef, state, b["input_ids"], b["attention_mask"], max_new_tokens=max_new_tokens,
                          adapters=adapters, temperature=float(temperature), chunk_size=chunk_size, values=values),
        arrays, ("input_ids", "attention_mask"), batch_size=batch_size, mesh=mesh)
    mask = np.asarray(arrays["completion_mask"]) > 0
    # Padding positions hold whatever the model computed there; zero them so buffers are clean.
    return {k: np.where(mask, v, 0.0).astype(np.float32) for k, v in out.items()}
