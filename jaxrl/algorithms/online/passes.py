"""The teacher-forced passes of online GRPO / PPO over a rollout's completions, by role, each computed once:

    passes = RolloutPasses(policy, arrays, temperature=1.0, batch_size=8, chunk_size=512, mesh=mesh)
    passes.logp(Role.REFERENCE)   # adapters off (or the adapters of the last reference reset, `reference=`), at
                                  # the sampling temperature (the KL penalty's reference)
    passes.logp(Role.OLD)         # the behaviour policy (adapters on) at the sampling temperature: the ratio's
                                  # denominator when it is recomputed, and PPO's values (`passes.values()`)
    passes.logp(Role.MISMATCH)    # the behaviour policy at temperature 1, what the sampler's log-probs are
                                  # compared with (rollout correction, `mismatch/*`); at temperature 1 it IS the
                                  # OLD pass, never computed twice

All are the one pass of jaxrl.models.teacher_forced over the sequence layout of jaxrl/algorithms/online/
rollouts.py (completion token t, column P + t, is predicted by the hidden state of column P + t - 1, so every
per-token array is [N, C] and nothing is computed over the prompt), run by one jitted program `batch_size` rows a
call (jaxrl.parallel.batched_forward). `policy_forward` is the same pass inside the losses' jitted step.

Packed rows (jaxrl/algorithms/online/layout.py): with a `layout`, the rollout's rows are packed per call of
`batch_size` rows when the layout's rule says it pays, and a train batch that carries `completion_index` is
packed; either way the pass returns the same [N, C] arrays (`completion_layout` gives the pass its arguments).
Shared prefixes (layout "shared_prefix": the batch carries `prefix_rows` [N, n]): padded rows, each group's
prompt computed once per call (jaxrl/algorithms/online/shared_prefix.py); the same [N, C] arrays again.
"""

from __future__ import annotations

import enum
import time
from typing import Optional

import numpy as np
from flax import nnx

from jaxrl.algorithms.online.layout import PACKED_KEYS, SHARED_KEYS, is_packed, is_shared, model_inputs
from jaxrl.models.teacher_forced import completion_start, next_token_logprobs
from jaxrl.parallel import batched_forward


class Role(enum.Enum):
    REFERENCE = "ref"
    OLD = "old"
    MISMATCH = "mismatch"


def completion_inputs(batch: dict, width: int) -> tuple[tuple, dict]:
    """((input_ids, attention_mask), keyword arguments of `next_token_logprobs`) that select a batch's C = `width`
    completion tokens: the columns after the prompt (padded rows), or the packed rows as the model computes them
    with their segments and `completion_index` (jaxrl/algorithms/online/layout.py)."""
    if is_packed(batch):
        ids, mask, segments = model_inputs(batch)
        return (ids, mask), {"segment_ids": segments, "positions": batch["completion_index"]}
    if is_shared(batch):  # each group's prompt once: `prefix_rows` [b, n] carries n
        return (batch["input_ids"], batch["attention_mask"]), {
            "start": completion_start(batch["input_ids"], width), "prefix_group": batch["prefix_rows"].shape[-1]}
    return (batch["input_ids"], batch["attention_mask"]), {"start": completion_start(batch["input_ids"], width)}


def completion_pass(model, batch: dict, max_new_tokens: int, *, chunk_size: int, temperature: float,
                    entropy: bool = False, adapters: bool = True):
    """The teacher-forced pass over the completion columns of `batch` (input_ids, attention_mask; packed rows:
    PACKED_KEYS): (hidden [b, C, H], logp [b, C], entropy or None)."""
    args, layout = completion_inputs(batch, max_new_tokens)
    out = next_token_logprobs(model, *args, temperature=temperature, chunk_size=chunk_size, entropy=entropy,
                              adapters=adapters, **layout)
    return out.hidden, out.logp, out.entropy


def policy_forward(model, micro_batch, *, chunk_size: int, temperature: float, entropy: bool):
    """(hidden [b, C, H], logp [b, C], entropy or None) of a GRPO/PPO micro-batch's completion tokens (padded or
    packed rows): the forward both objectives start from (PPO's value head reads the same hidden states)."""
    return completion_pass(model, micro_batch, micro_batch["completion_mask"].shape[1], chunk_size=chunk_size,
                           temperature=temperature, entropy=entropy)


def _pass(graphdef, state, batch, *, max_new_tokens, adapters, temperature, chunk_size, values):
    model = nnx.merge(graphdef, state)
    hidden, logp, _ = completion_pass(model, batch, max_new_tokens, chunk_size=chunk_size, temperature=temperature,
                                      adapters=adapters)
    out = {"logp": logp}
    if values:
        out["values"] = model.value_head(hidden)
    return out


class RolloutPasses:
    """The passes of one rollout by role (module docstring). `values`: the OLD pass also reads the value head
    (PPO). Results are [N, C] float32, zero off the completion mask. `timings()`: `time/<role>_logp_s` of every
    role, the seconds its pass took (0 for a pass not run, or one another role's run served). `layout`: an
    OnlineLayout (jaxrl/algorithms/online/layout.py) that decides once per rollout whether its passes run on
    packed rows; `layout_metrics()` its `layout/pass_*` counters ({} without one, or before any pass ran)."""

    def __init__(self, policy, arrays: dict, *, temperature: float, batch_size: int, chunk_size: int = 512,
                 mesh=None, compile_options: Optional[dict] = None, values: bool = False, reference=None,
                 layout=None):
        self.policy, self.arrays, self.layout = policy, arrays, layout
        self._laid_out: Optional[tuple[dict, dict]] = None
        self.reference = reference  # a model whose adapters are the reference (a reset); None: the adapters off
        self.temperature, self.batch_size, self.chunk_size = float(temperature), int(batch_size), int(chunk_size)
        self.mesh, self.compile_options, self.with_values = mesh, compile_options, bool(values)
        self._done: dict[tuple, dict] = {}
        self.seconds = {role: 0.0 for role in Role}

    def _key(self, role: Role) -> tuple:
        """(model, adapters, temperature) of a role: the pass's identity (MISMATCH at temperature 1 is OLD's)."""
        if role is Role.REFERENCE:
            if self.reference is not None:
                return "reference", True, self.temperature
            return "policy", False, self.temperature
        return "policy", True, (1.0 if role is Role.MISMATCH else self.temperature)

    def _run(self, role: Role) -> dict:
        key = self._key(role)
        if key not in self._done:
            t0 = time.perf_counter()
            which, adapters, temperature = key
            model = self.reference if which == "reference" else self.policy
            out = teacher_forced(model, self._arrays(), adapters=adapters, temperature=temperature,
                                 batch_size=self.batch_size, chunk_size=self.chunk_size, mesh=self.mesh,
                                 compile_options=self.compile_options, values=self.with_values and adapters)
            # packed rows come in whole groups: the empty rows that completed the last one go
            self._done[key] = {k: v[:len(self.arrays["input_ids"])] for k, v in out.items()}
            self.seconds[role] = time.perf_counter() - t0
        return self._done[key]

    def _arrays(self) -> dict:
        """The rollout's arrays in the layout its passes use (chosen at the first pass, the same for all)."""
        if self.layout is None:
            return self.arrays
        if self._laid_out is None:
            group = batched_forward.pass_batch_size(self.batch_size, len(self.arrays["input_ids"]), self.mesh)
            self._laid_out = self.layout.apply(self.arrays, group, where="pass")
        return self._laid_out[0]

    def layout_metrics(self) -> dict[str, float]:
        return {} if self._laid_out is None else dict(self._laid_out[1])

    def timings(self) -> dict[str, float]:
        return {f"time/{role.value}_logp_s": seconds for role, seconds in self.seconds.items()}

    def logp(self, role: Role) -> np.ndarray:
        return self._run(role)["logp"]

    def values(self) -> np.ndarray:
        """The value head over the OLD pass's hidden states (PPO)."""
        return self._run(Role.OLD)["values"]


def teacher_forced(model, arrays: dict, *, adapters: bool, batch_size: int, temperature: float = 1.0,
                   chunk_size: int = 512, values: bool = False, mesh=None, compile_options: Optional[dict] = None,
                   max_new_tokens: Optional[int] = None) -> dict[str, np.ndarray]:
    """{"logp": [N, C] (+ "values": [N, C])} of every row of `arrays` (input_ids, attention_mask, completion_mask;
    packed rows: also segment_ids and completion_index, packed per call of `batch_size` rows) under `model` with
    its adapters on or off: one jitted program, `batch_size` rows per call. C: the completion mask's width
    (`max_new_tokens`, when given, must be it)."""
    program = batched_forward.jit_program(_pass, ("graphdef", "max_new_tokens", "adapters", "temperature",
                                                  "chunk_size", "values"), compile_options, mesh)
    graphdef, state = nnx.split(model)
    width = np.asarray(arrays["completion_mask"]).shape[1]
    if max_new_tokens is not None and int(max_new_tokens) != width:
        raise ValueError(f"max_new_tokens={max_new_tokens}, but the completion mask is {width} wide")
    max_new_tokens = width
    keys = (PACKED_KEYS if is_packed(arrays) else SHARED_KEYS if is_shared(arrays)
            else ("input_ids", "attention_mask"))
    out = batched_forward.map_batches(
        lambda b: program(graphdef, state, b, max_new_tokens=max_new_tokens,
                          adapters=adapters, temperature=float(temperature), chunk_size=chunk_size, values=values),
        arrays, keys, batch_size=batch_size, mesh=mesh)
    mask = np.asarray(arrays["completion_mask"]) > 0
    # Padding positions hold whatever the model computed there; zero them so buffers are clean.
    return {k: np.where(mask, v, 0.0).astype(np.float32) for k, v in out.items()}
