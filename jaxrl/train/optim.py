"""Optimizer and learning-rate schedules from the config (`optimizer.*`), through optax.

    tx, schedule = make_optimizer(config.optimizer, total_steps=config.steps)

`tx` = [clip_by_global_norm(max_grad_norm)] -> AdamW(schedule, b1, b2, eps, weight_decay). The schedule is a
function of the optimizer's own step count (updates actually applied; a skipped non-finite step does not move
it), with the formulas of transformers' `get_*_schedule_with_warmup` so runs match the users' earlier stack:

  linear                 s < w: s / w;   else max(0, (T - s) / (T - w))
  constant_with_warmup   s < w: s / w;   else 1
  cosine                 s < w: s / w;   else max(0, 0.5 (1 + cos(pi * p))),  p = (s - w) / (T - w)
  constant               1

times `learning_rate`; s = updates applied so far (the first update uses s = 0, so with warmup its rate is 0,
as in transformers), w = warmup steps (`warmup_steps`, or ceil(warmup_ratio * T) when warmup_steps is 0),
T = `steps`. AdamW is optax's (decoupled decay, torch.optim.AdamW's update rule).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jaxrl.train.settings import SCHEDULES, OptimizerConfig, OptimizerConfigError

__all__ = ["OptimizerConfig", "OptimizerConfigError", "SCHEDULES", "make_optimizer", "make_schedule",
           "reset_adam_moments", "warmup_steps"]


def warmup_steps(opt: OptimizerConfig, total_steps: int) -> int:
    if opt.warmup_steps:
        return opt.warmup_steps
    return math.ceil(opt.warmup_ratio * total_steps)


def make_schedule(opt: OptimizerConfig, total_steps: int) -> Callable:
    """learning rate as a function of the optimizer step count s (int array or int) -> fp32 scalar."""
    name, lr = opt.schedule, opt.learning_rate
    w = warmup_steps(opt, total_steps)
    total = int(total_steps)

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = s / max(1.0, float(w))
        if name == "constant":
            factor = jnp.ones_like(s)
        elif name == "constant_with_warmup":
            factor = jnp.where(s < w, warm, 1.0)
        elif name == "linear":
            factor = jnp.where(s < w, warm, jnp.maximum(0.0, (total - s) / max(1.0, float(total - w))))
        else:  # cosine, num_cycles = 0.5
            progress = (s - w) / max(1.0, float(total - w))
            factor = jnp.where(s < w, warm, jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * progress))))
        return (lr * factor).astype(jnp.float32)

    return schedule


def make_optimizer(opt: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, Callable]:
    """(gradient transformation, schedule) of an `optimizer` block (its values are validated where it is built:
    jaxrl.train.settings.OptimizerConfig): learning_rate, schedule, warmup_steps / warmup_ratio,
    weight_decay, b1, b2, eps, max_grad_norm (<= 0 disables clipping)."""
    schedule = make_schedule(opt, total_steps)
    parts = []
    if opt.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(opt.max_grad_norm))
    parts.append(optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay))
    return optax.chain(*parts), schedule


def reset_adam_moments(state):
    """`state` (a TrainState) with every Adam state of its optimizer started over (first and second moments and
    their bias-correction count at 0, as `optax.adam`'s init leaves them; every other part of the optimizer, the
    learning-rate schedule's count included, as it was). New buffers in the old ones' shardings: the jitted step
    donates the state."""
    def fresh(node):
        if isinstance(node, optax.ScaleByAdamState):
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), node)
        return node

    return state._replace(opt_state=jax.tree.map(fresh, state.opt_state,
                                                 is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState)))
