"""The Task contract: what an algorithm gives the Trainer, and the phases in which the Trainer calls it.

    task.setup(context)                  # once, before the first step this run trains (after a resume too):
                                         # workdir-dependent preparation (DPO: reference log-probs)
    for step in steps to train:
        if task.needs_rollout(step):     # online algorithms (GRPO, PPO)
            task.rollout(step, policy)   # sample the rollout this step trains on from the current policy
        task.batch(step)                 # the global batch: {key: np.ndarray [B_global, ...]} | (arrays, metrics)
        if task.resets_optimizer(step):  # the Adam moments start over (online: a reference reset)
            ...
        ... the jitted update ...
        task.on_checkpoint(step, policy) # at each checkpoint, before its state is saved: e.g. held-out evaluation;
                                         # a dict is logged
        task.on_saved(steps)             # after saves have landed (and Orbax pruned the states past
                                         # keep_checkpoints): `steps`, the training states on disk now

A task subclasses `Task`: `objective` and `batch` are its own; every other phase has a default that does nothing,
which a task overrides where it has work (the Trainer calls every phase, it never asks what a task has):

    objective: Objective                 # jaxrl.train.objective (normalisers + loss, the micro-batch contract)
    trainable                            # nnx filter of the trained variables (default LoRAParam)
    state_dict() / load_state_dict(d)    # the data position (JSON), saved with every training state
    num_tokens(batch) -> int             # for tokens/s; default sum(attention_mask) or input_ids.size

`policy` is the model as the Trainer holds it now (adapters with their current parameters). A task never sees
the Trainer: what it may need of the run is in its `TaskContext`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional

import numpy as np

from jaxrl.models.lora import LoRAParam


@dataclasses.dataclass(frozen=True)
class TaskContext:
    """What a task may use of the run it is part of."""

    workdir: str
    mesh: Any  # jax.sharding.Mesh
    current_policy: Callable[[], Any]  # -> the policy model as trained so far
    checkpoint_steps: Callable[[], list]  # -> the steps whose full training state is on disk now
    keep_checkpoints: Optional[int]  # full training states kept (None: all)


class Task(abc.ABC):
    """The base of every algorithm's task (module docstring)."""

    objective: Any = None  # the Objective of the jitted step (every task sets it)
    trainable: Any = LoRAParam

    def setup(self, context: TaskContext) -> None:
        """Before the first step this run trains."""

    def needs_rollout(self, step: int) -> bool:
        """Whether train step `step` trains on a rollout this task does not hold yet."""
        return False

    def rollout(self, step: int, policy) -> None:
        """Makes the rollout train step `step` trains on (only called when `needs_rollout(step)`)."""
        raise NotImplementedError(f"{type(self).__name__} makes no rollouts")

    def resets_optimizer(self, step: int) -> bool:
        """Whether the optimizer's Adam moments start over before step `step`'s update (online: a reference reset
        with `ref_reset_optimizer`); a function of the step alone, so a resumed run resets where the first did."""
        return False

    @abc.abstractmethod
    def batch(self, step: int):
        """The global batch of train step `step`: {key: array [B_global, ...]} or (arrays, host metrics)."""

    def on_checkpoint(self, step: int, policy) -> Optional[dict]:
        """After the checkpoint of step `step`; a dict returned is logged at that step."""
        return None

    def on_saved(self, steps: list) -> None:
        """After checkpoints have landed: `steps` are the training states on disk now (those past keep_checkpoints
        already deleted). A task deletes here what it kept for states that are gone (online: rollout buffers)."""

    def state_dict(self) -> Optional[dict]:
        """The data position (JSON), saved with every training state; None: the step count is the position."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restores `state_dict()`'s record from a checkpoint."""

    def num_tokens(self, batch: dict) -> int:
        """Tokens of a global batch (tokens/s): the attention mask's ones, else every input id."""
        if "attention_mask" in batch:
            return int(np.sum(np.asarray(batch["attention_mask"]) != 0))
        if "input_ids" in batch:
            return int(np.asarray(batch["input_ids"]).size)
        return 0
