"""The training state: a pytree of arrays that the jitted step maps to its successor.

    state = init_train_state(params, optimizer, seed, ema=False)
    TrainState(step, opt_step, params, opt_state, rng, nonfinite_total, nonfinite_consecutive, ema)

`params` is a flat `{name: array}` dict of the trainable variables (the LoRA factors, names like
`layers.0.self_attn.q_proj.lora.lora_A`, PEFT layout [r, in] / [out, r], fp32); the optimizer state mirrors it.
Flat string keys keep Orbax checkpoints, sharding rules and PEFT export on one naming. `ParamCodec` converts
between that dict and the `nnx.State` that `nnx.merge` needs.

Counters: `step` counts train steps attempted (= global batches consumed; what `steps` and `checkpoint_every`
count), `opt_step` counts updates applied (the schedule position; a skipped non-finite step leaves it, the
parameters and the optimizer state unchanged). The host-side data position lives beside this state in the
checkpoint (see `checkpoints.py`).

`ema` (config `ema.decay`; {} when off): the exponential moving average of each LoRA factor (`adapter_params`
names), started at the initial factors and moved by the step after every applied update. It is part of the state,
so a resumed run continues it exactly.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl.parallel.sharding import train_state_shardings
from jaxrl.utils.tree import dotted


class TrainState(NamedTuple):
    step: jax.Array  # int32 []: train steps attempted so far
    opt_step: jax.Array  # int32 []: updates applied so far (schedule position)
    params: dict  # {name: fp32 array}: the trainable variables
    opt_state: Any  # optax state over `params`
    rng: jax.Array  # uint32 [2]: raw key data; step k uses fold_in(rng, k)
    nonfinite_total: jax.Array  # int32 []: skipped updates so far
    nonfinite_consecutive: jax.Array  # int32 []: skipped updates in a row, up to and including the last step
    ema: dict  # {name: fp32 array}: the EMA of each LoRA factor ({} without ema.decay)


def is_adapter_param(name: str) -> bool:
    """Whether a trainable parameter is a LoRA factor (what an adapter checkpoint holds; PPO's value head is not)."""
    return ".lora." in f".{name}."


def adapter_params(params: dict) -> dict:
    """The LoRA factors of a flat parameter dict."""
    return {n: v for n, v in params.items() if is_adapter_param(n)}


def init_train_state(params: dict, optimizer: optax.GradientTransformation, seed: int,
                     ema: bool = False) -> TrainState:
    def zero():  # a fresh buffer per counter: the jitted step donates the state, and a buffer shared by two
        return jnp.zeros((), jnp.int32)  # leaves could not be donated twice

    return TrainState(step=zero(), opt_step=zero(), params=dict(params), opt_state=optimizer.init(params),
                      rng=jax.random.key_data(jax.random.key(seed)), nonfinite_total=zero(),
                      nonfinite_consecutive=zero(),
                      ema={n: jnp.copy(v) for n, v in adapter_params(params).items()} if ema else {})


def create_train_state(params: dict, optimizer: optax.GradientTransformation, seed: int, mesh=None,
                       shardings=None, ema: bool = False) -> TrainState:
    """`init_train_state` as one jitted program (no per-leaf eager ops), laid out on `mesh` by the partition
    rules (`jaxrl.parallel.sharding.train_state_shardings`) or by explicit `shardings`. Use this layout for the
    state fed to the jitted step: a state on another layout would make it compile a second time. Parameters are
    copied: the step donates the state, and the caller's arrays (the model's own) must survive that."""
    if shardings is None and mesh is not None:
        abstract = jax.eval_shape(lambda p: init_train_state(p, optimizer, seed, ema), params)
        shardings = train_state_shardings(abstract, mesh)
    fn = jax.jit(lambda p: init_train_state(jax.tree.map(jnp.copy, p), optimizer, seed, ema), out_shardings=shardings)
    return fn(params)


class ParamCodec:
    """Flat {name: array} <-> the nnx.State it came from (same tree structure and Variable types)."""

    def __init__(self, template_state):
        leaves_with_path, self.treedef = jax.tree_util.tree_flatten_with_path(template_state)
        self.names = [dotted(p) for p, _ in leaves_with_path]
        if len(set(self.names)) != len(self.names):
            raise ValueError("ParamCodec: duplicate parameter names in the trainable state")

    def to_flat(self, state) -> dict:
        return dict(zip(self.names, jax.tree.leaves(state)))

    def to_state(self, flat: dict):
        missing = [n for n in self.names if n not in flat]
        if missing:
            raise KeyError(f"ParamCodec: {len(missing)} parameter(s) missing, first {missing[0]!r}")
        return jax.tree_util.tree_unflatten(self.treedef, [flat[n] for n in self.names])
