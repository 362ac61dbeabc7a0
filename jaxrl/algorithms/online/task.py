"""The task base of online GRPO, PPO and distillation: its Task phases (jaxrl.train.task: setup, needs_rollout /
rollout, batch, on_checkpoint) over the rollouts a `RolloutController` hands it (jaxrl/algorithms/online/
controller.py: made now, sampled ahead, read back after a resume; the asynchronous policy is its business) and the
schedule that maps them onto train steps (jaxrl/algorithms/online/buffer.py). The policy the Trainer holds at a
rollout's first step is the behaviour policy (unless the rollout was sampled ahead).

A subclass makes one rollout's arrays (`make_rollout`) and names the keys a train batch carries (`train_keys`); the
task's state_dict (JSON, saved with every checkpoint) holds the rollout index and the algorithm's host state (PPO's
KL coefficient).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.algorithms.config import TrainConfig
from jaxrl.algorithms.online.buffer import Schedule
from jaxrl.algorithms.online.controller import ProximalPass, RolloutController
from jaxrl.algorithms.online.reference import ReferenceResets
from jaxrl.algorithms.online.rollouts import Rollouts, Sampled
from jaxrl.algorithms.online.settings import AsyncPolicy
from jaxrl.train.task import Task, TaskContext


class OnlineTask(Task):
    """Task base of the online algorithms (module docstring). Subclasses implement `make_rollout(rollout, policy) ->
    (arrays: {key: [N, ...]}, metrics, samples)` (`samples`: the `Sampled` whose rows the arrays are, or None) and
    `train_keys` (the buffer keys a train batch carries), and may keep host state in `host_state()` /
    `load_host_state(d)` (e.g. PPO's KL coefficient). `rollouts` samples them; `proximal`: the decoupled
    objective's pass, when the asynchronous policy has it; `ref_reset_every`: the reference's resets
    (`reference_resets.reference_for(rollout, policy)` gives a rollout's reference model), and with
    `ref_reset_optimizer` the optimizer's moments start over at each (`resets_optimizer`)."""

    train_keys: tuple[str, ...] = ()

    def __init__(self, config: TrainConfig, schedule: Schedule, rollouts: Rollouts,
                 async_policy: AsyncPolicy = AsyncPolicy(), proximal: Optional[ProximalPass] = None,
                 ref_reset_every: int = 0, ref_reset_optimizer: bool = False):
        self.config, self.schedule, self.rollouts = config, schedule, rollouts
        self.async_policy = async_policy
        self.rollout_controller = RolloutController(async_policy, rollouts, schedule, make=self.make_rollout,
                                                    steps=config.steps, proximal=proximal, snapshot=self._snapshot)
        self._on_policy = False
        self.compile_options = dict(config.compile_options) or None
        self.buffer: Optional[dict] = None
        self.buffer_rollout = -1
        self.rollout_metrics: dict = {}
        self.rollout_timing: dict = {}  # time/* of the rollout made for the next batch (logged once)
        self.loaded_state: dict = {}
        self.context: Optional[TaskContext] = None
        self.position = 0
        self.reference_resets = ReferenceResets(ref_reset_every)
        self.ref_reset_optimizer = bool(ref_reset_optimizer)

    # subclasses -------------------------------------------------------------------------------------------
    def make_rollout(self, rollout: int, policy) -> tuple[dict, dict, Optional[Sampled]]:
        raise NotImplementedError

    def host_state(self) -> dict:
        return {}

    def load_host_state(self, state: dict) -> None:
        pass

    @property
    def on_policy(self) -> bool:
        """Whether each rollout gets one update from the very parameters that sampled it (the ratio is then 1
        exactly; a subclass sets it, e.g. GRPO with one minibatch and one pass). Never when sampling ahead: rollout
        r was sampled by the policy of rollout r - 1."""
        return self._on_policy and not self.async_policy.ahead

    @on_policy.setter
    def on_policy(self, value: bool) -> None:
        self._on_policy = bool(value)

    def _snapshot(self, policy):
        """`policy` with copies of its trained variables: the train step donates the state those arrays belong
        to, and the producer must keep the parameters it samples from."""
        graphdef, trained, rest = nnx.split(policy, self.trainable, ...)
        return nnx.merge(graphdef, jax.tree.map(jnp.copy, trained), rest)

    # Task phases --------------------------------------------------------------------------------------------
    def setup(self, context: TaskContext) -> None:
        self.context = context
        self.reference_resets.open(context.workdir)
        self.rollout_controller.open(context.workdir)
        self.rollouts.open(context.workdir, context.current_policy())

    def needs_rollout(self, step: int) -> bool:
        """Whether train step `step` trains on a rollout this task does not hold yet."""
        return self.buffer is None or self.buffer_rollout != self.schedule.locate(step)[0]

    def resets_optimizer(self, step: int) -> bool:
        """With `ref_reset_optimizer`: the first train step of each rollout that resets the reference."""
        r, i, u = self.schedule.locate(step)
        every = self.reference_resets.every
        return self.ref_reset_optimizer and every > 0 and r > 0 and r % every == 0 and i == 0 and u == 0

    def rollout(self, step: int, policy) -> None:
        """Install the rollout train step `step` trains on (the controller's: sampled from `policy`, sampled ahead,
        or read back)."""
        self.buffer, self.rollout_metrics, self.rollout_timing = self.rollout_controller.rollout(step, policy)
        self.buffer_rollout = self.schedule.locate(step)[0]

    def settle(self) -> None:
        """Waits for the rollouts sampled ahead (each lands in the store); raises an error of theirs."""
        self.rollout_controller.settle()

    def batch(self, step: int):
        r, i, u = self.schedule.locate(step)
        if self.buffer_rollout != r:
            raise RuntimeError(f"train step {step} needs rollout {r}; call rollout({step}, policy) first")
        rows = self.schedule.rows_of(r, i, u)
        out = {k: self.buffer[k][rows] for k in self.train_keys}
        self.position = step + 1
        host = {**self.rollout_metrics, **self.rollout_timing, "rollout": float(r), "rollout_pass": float(i),
                **self.rollout_controller.host_metrics(step, r, self.rollout_metrics)}
        self.rollout_timing = {}
        return out, host

    def state_dict(self) -> dict:
        """The data position; when sampling ahead, after the rollouts in flight have landed in the store (a resume
        from this state reads them back: they were sampled from parameters the state no longer holds), with the host
        state they left (PPO's KL coefficient after them)."""
        self.settle()
        record = self.rollouts.source.difficulty
        return {"position": self.position, "rollout": self.buffer_rollout,
                "steps_per_rollout": self.schedule.steps_per_rollout, **self.host_state(),
                **({"difficulty": record.state_dict()} if record is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.loaded_state = dict(state)
        self.position = int(state.get("position", 0))
        old = state.get("steps_per_rollout")
        if old is not None and int(old) != self.schedule.steps_per_rollout:
            raise ValueError(f"the checkpoint was written with {old} train steps per rollout, this config gives "
                             f"{self.schedule.steps_per_rollout} (num_iterations / epochs / minibatches / batch "
                             f"sizes changed); resume with the same values or use a new --workdir")
        self.load_host_state(state)
        if self.rollouts.source.difficulty is not None:  # each prompt's record, as the checkpoint left it
            self.rollouts.source.difficulty.load_state_dict(state.get("difficulty"))

    def on_saved(self, steps: list) -> None:
        """The rollout buffers only pruned checkpoints needed are deleted (RolloutController.prune)."""
        if self.context is not None:
            self.rollout_controller.prune(steps, self.context.keep_checkpoints)
