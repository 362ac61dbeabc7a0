"""The Task contract: what an algorithm gives the Trainer, and the phases in which the Trainer calls it.

    task.setup(context)                  # once, before the first step this run trains (after a resume too):
                                         # workdir-dependent preparation (DPO: reference log-probs)
    for step in steps to train:
        if task.needs_rollout(step):     # online algorithms only (GRPO, PPO)
            task.rollout(step, policy)   # sample the rollout this step trains on from the current policy
        task.batch(step)                 # the global batch: {key: np.ndarray [B_global, ...]} | (arrays, metrics)
        ... the jitted update ...
        task.on_checkpoint(step, policy) # after each checkpoint: e.g. held-out evaluation; a dict is logged

Only `objective` and `batch` are required; every other member is optional:

    objective: Objective                 # jaxrl.train.objective (normalisers + loss, the micro-batch contract)
    trainable                            # nnx filter of the trained variables (default LoRAParam)
    state_dict() / load_state_dict(d)    # the data position (JSON), saved with every training state
    num_tokens(batch) -> int             # for tokens/s; default sum(attention_mask) or input_ids.size

`policy` is the model as the Trainer holds it now (adapters with their current parameters). A task never sees
the Trainer: what it may need of the run is in its `TaskContext`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional


@dataclasses.dataclass(frozen=True)
class TaskContext:
    """What a task may use of the run it is part of."""

    workdir: str
    mesh: Any  # jax.sharding.Mesh
    current_policy: Callable[[], Any]  # -> the policy model as trained so far
    checkpoint_steps: Callable[[], list]  # -> the steps whose full training state is on disk now
    keep_checkpoints: Optional[int]  # full training states kept (None: all)
