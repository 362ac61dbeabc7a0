"""The training core every algorithm runs on: LoRA state, optimizer, the jitted step, checkpoints, metrics.

    from jaxrl.train import Trainer, run_training, register_trainer, Objective, NextToken
    run_training(config, workdir)                 # build model + LoRA + task from config, train, resume by itself

Modules: objective (the loss protocol, next-token), optim (AdamW + schedules), state (TrainState), step (the
jitted step), checkpoints (Orbax layout), metrics (jsonl, TensorBoard, progress), loop (Trainer), registry
(algorithms by name), sft (the next-token task).
"""

from jaxrl.train.objective import NextToken, Objective, target_mask
from jaxrl.train.registry import get_trainer, register_trainer, trainer_names
from jaxrl.train.state import ParamCodec, TrainState, init_train_state

__all__ = ["NextToken", "NonFiniteError", "Objective", "ParamCodec", "Trainer", "TrainState", "get_trainer",
           "init_train_state", "register_trainer", "run_training", "target_mask", "trainer_names"]


def __getattr__(name):
    # The loop pulls in Orbax and tensorboardX; import it only when asked for.
    if name in ("Trainer", "run_training", "NonFiniteError", "RunResult"):
        from jaxrl.train import loop
        return getattr(loop, name)
    raise AttributeError(name)
