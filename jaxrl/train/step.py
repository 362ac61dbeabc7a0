"""The jitted train step: gradient accumulation over micro-batches, one optax update, non-finite masking.

    step_fn = make_train_step(objective, optimizer, schedule, graphdef, codec)
    jitted = jit_train_step(step_fn, mesh, state, frozen, batch)          # explicit shardings, donated state
    state, metrics = jitted(state, frozen, batch)                          # batch leaves [n_micro, mb, ...]

Inside one step (all on device, no host round trip):
  1. normalisers = objective.normalisers(batch reshaped to [n_micro * mb, ...]) -- the whole global batch;
  2. `lax.scan` over the n_micro micro-batches: loss_sum, grads and metric sums are *summed* (never averaged by
     count), so by the objective's contract the result is the full-batch loss and gradient for any split;
  3. finite = isfinite(loss) and every gradient finite; per-group flags say which groups (module names:
     q_proj, in_proj_qkv, ...) went non-finite;
  4. optax update (clipping, AdamW), then `jnp.where(finite, new, old)` on parameters and optimizer state, and
     the counters: a skipped step leaves parameters, optimizer state and schedule position bit-identical and
     bumps `nonfinite_total` / `nonfinite_consecutive`;
  5. with `ema_decay` d (config `ema.decay`): each LoRA factor's EMA becomes `d * ema + (1 - d) * new factor`
     (fp32; d = 0 gives the factor bit for bit), only when the update was applied.

Metrics (device scalars, replicated): loss, grad_norm (before clipping), update_norm (0 when skipped),
lora_norm (after the step), learning_rate (of this step's update), update_skipped, loss_finite,
nonfinite_total, nonfinite_consecutive, finite/<group> per parameter group, plus the objective's metric sums
(its metrics named `.../max` or `..._max` are maxima over the micro-batches instead, `..._min` minima:
`reduction_of`).

Fault injection (tests): with `fault_injection=True` the step takes a 4th argument `fault = {"loss": f32[],
"grad": f32[]}` added to the loss and to the gradients of `fault_group` (all groups when None) right after
accumulation; zeros leave the step's results unchanged.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl.models.lora import lora_dropout
from jaxrl.parallel import sharding as shd
from jaxrl.train.state import ParamCodec, TrainState

STEP_METRICS = ("loss", "grad_norm", "update_norm", "lora_norm", "learning_rate", "update_skipped",
                "loss_finite", "nonfinite_total", "nonfinite_consecutive")


def param_group(name: str) -> str:
    """The group of a trainable parameter for non-finite diagnostics: the module the adapter sits on
    (`layers.1.self_attn.q_proj.lora.lora_A` -> `q_proj`), else the top-level module (`value_head`)."""
    parts = name.split(".")
    if "lora" in parts and parts.index("lora") > 0:
        return parts[parts.index("lora") - 1]
    return parts[0]


def split_batch(batch: dict, n_micro: int) -> dict:
    """Host-side: every leaf [B_global, ...] -> [n_micro, B_global // n_micro, ...]; micro-batch m holds rows
    m*mb ... m*mb + mb - 1."""
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.ndim == 0 or value.shape[0] % n_micro:
            raise ValueError(f"batch[{key!r}] has leading dim {value.shape[:1]}, not a multiple of "
                             f"batch.grad_accum={n_micro}")
        out[key] = value.reshape((n_micro, value.shape[0] // n_micro) + value.shape[1:])
    return out


def merge_micro(batch):
    """[n_micro, mb, ...] -> [n_micro * mb, ...] (inside jit; free)."""
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)


def make_micro_loss(objective, graphdef, codec: ParamCodec) -> Callable:
    """loss(params_flat, frozen, micro_batch, normalisers, rng) -> (loss_sum, metric_sums)."""

    def micro_loss(params, frozen, micro_batch, normalisers, rng):
        model = nnx.merge(graphdef, codec.to_state(params), frozen)
        k_dropout, k_objective = jax.random.split(rng)
        with lora_dropout(model, k_dropout):
            loss, metrics = objective.loss(model, micro_batch, normalisers, k_objective)
        return jnp.asarray(loss, jnp.float32), {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}

    return micro_loss


def is_max_metric(name: str) -> bool:
    """An objective metric reduced with max over micro-batches instead of summed: its name ends in `max`
    (`ratio/max`, `value/abs_max`). A maximum cannot be an additive share; the accumulator starts at 0, so such a
    metric must be >= 0 (a magnitude)."""
    return name == "max" or name.endswith(("/max", "_max"))


def is_min_metric(name: str) -> bool:
    """An objective metric reduced with min over micro-batches (its name ends in `min`; the accumulator starts at
    +inf, so a step whose micro-batches all report +inf, nothing to take the minimum of, reports +inf)."""
    return name == "min" or name.endswith(("/min", "_min"))


def _reduce(name: str):
    return jnp.maximum if is_max_metric(name) else jnp.minimum if is_min_metric(name) else jnp.add


def accumulate_gradients(micro_loss: Callable, objective, params: dict, frozen, batch, step_rng):
    """(loss, grads, metric_sums): sums over the micro-batches of `batch` (leaves [n_micro, mb, ...])."""
    normalisers = objective.normalisers(merge_micro(batch))
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    n_micro = jax.tree.leaves(batch)[0].shape[0]
    first = jax.tree.map(lambda x: x[0], batch)
    _, metric_shapes = jax.eval_shape(micro_loss, params, frozen, first, normalisers, step_rng)

    def body(carry, xs):
        loss_acc, grad_acc, metric_acc = carry
        index, micro_batch = xs
        (loss, metrics), grads = grad_fn(params, frozen, micro_batch, normalisers,
                                         jax.random.fold_in(step_rng, index))
        grad_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_acc, grads)
        metric_acc = {k: _reduce(k)(metric_acc[k], v) for k, v in metrics.items()}
        return (loss_acc + loss, grad_acc, metric_acc), None

    init = (jnp.zeros((), jnp.float32), jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            {k: jnp.full(m.shape, jnp.inf if is_min_metric(k) else 0.0, jnp.float32) for k, m in metric_shapes.items()})
    (loss, grads, metrics), _ = jax.lax.scan(body, init, (jnp.arange(n_micro), batch))
    return loss, grads, metrics


def _all_finite(arrays) -> jax.Array:
    flags = [jnp.all(jnp.isfinite(a)) for a in arrays]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def ema_update(ema: dict, params: dict, decay: float) -> dict:
    """`decay * ema + (1 - decay) * params` per entry of `ema`, in fp32. Written as a sum of two products (not
    `ema + (1 - decay) * (params - ema)`) so that decay 0 returns `params` exactly: 0 * ema + 1 * p == p."""
    keep, take = jnp.float32(decay), jnp.float32(1.0 - decay)
    return {n: keep * e + take * params[n] for n, e in ema.items()}


def make_train_step(objective, optimizer: optax.GradientTransformation, schedule: Callable, graphdef,
                    codec: ParamCodec, *, fault_injection: bool = False, fault_group: Optional[str] = None,
                    ema_decay: Optional[float] = None) -> Callable:
    """The pure step function `(state, frozen, batch[, fault]) -> (state, metrics)`; see the module docstring.
    `ema_decay`: None leaves `state.ema` as it is (empty when the state was made without EMA)."""
    micro_loss = make_micro_loss(objective, graphdef, codec)
    groups: dict[str, list[str]] = {}
    for name in codec.names:
        groups.setdefault(param_group(name), []).append(name)
    if fault_group is not None and fault_group not in groups:
        raise ValueError(f"fault_group={fault_group!r}; groups are {sorted(groups)}")

    def step(state: TrainState, frozen, batch, fault=None):
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        loss, grads, obj_metrics = accumulate_gradients(micro_loss, objective, state.params, frozen, batch,
                                                        step_rng)
        if fault_injection:
            loss = loss + fault["loss"]
            grads = {n: (g + fault["grad"] if fault_group in (None, param_group(n)) else g)
                     for n, g in grads.items()}

        group_finite = {g: _all_finite([grads[n] for n in names]) for g, names in groups.items()}
        loss_finite = jnp.isfinite(loss)
        finite = loss_finite & jnp.all(jnp.stack(list(group_finite.values())))

        updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731  bitwise old values on a skip
        params = jax.tree.map(keep, new_params, state.params)
        opt_state = jax.tree.map(keep, new_opt_state, state.opt_state)
        ema = state.ema
        if ema_decay is not None and ema:
            ema = jax.tree.map(keep, ema_update(ema, params, ema_decay), ema)
        skipped = jnp.logical_not(finite).astype(jnp.int32)
        new_state = TrainState(
            step=state.step + 1, opt_step=state.opt_step + (1 - skipped), params=params, opt_state=opt_state,
            rng=state.rng, nonfinite_total=state.nonfinite_total + skipped,
            nonfinite_consecutive=jnp.where(finite, 0, state.nonfinite_consecutive + 1).astype(jnp.int32), ema=ema)

        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "update_norm": jnp.where(finite, optax.tree.norm(updates), 0.0),
            "lora_norm": optax.tree.norm(params),
            "learning_rate": schedule(state.opt_step),
            "update_skipped": skipped,
            "loss_finite": loss_finite,
            "nonfinite_total": new_state.nonfinite_total,
            "nonfinite_consecutive": new_state.nonfinite_consecutive,
        }
        for g, flag in group_finite.items():
            metrics[f"finite/{g}"] = flag
        for k, v in obj_metrics.items():
            if k in metrics:
                raise ValueError(f"objective metric {k!r} collides with a trainer metric; rename it")
            metrics[k] = v
        return new_state, metrics

    return step


def batch_shardings(batch: dict, mesh) -> dict:
    """Shardings of a split batch; raises when micro_batch_size does not divide over data x fsdp."""
    shards = shd.batch_shards(mesh)
    out = {}
    for key, value in batch.items():
        if value.ndim < 2:
            raise ValueError(f"batch[{key!r}] must be [n_micro, micro_batch_size, ...], got shape {value.shape}")
        if value.shape[1] % shards:
            raise ValueError(f"batch.micro_batch_size={value.shape[1]} must be a multiple of data x fsdp = "
                             f"{shards} (mesh.shape={tuple(mesh.devices.shape)}); batch[{key!r}] has shape "
                             f"{value.shape}")
        out[key] = shd.micro_batch_sharding(mesh, value.ndim)
    return out


def jit_train_step(step_fn: Callable, mesh, state: TrainState, frozen, batch: dict, *,
                   fault_injection: bool = False, donate: bool = True, compiler_options: Optional[dict] = None):
    """`jax.jit` of `step_fn` with explicit in/out shardings for this state, frozen base and batch layout
    (`compiler_options`: XLA debug options, e.g. {"xla_backend_optimization_level": 0} for quick test compiles)."""
    state_sh = shd.train_state_shardings(state, mesh)
    frozen_sh = shd.nnx_state_shardings(frozen, mesh)
    batch_sh = batch_shardings(batch, mesh)
    in_sh = (state_sh, frozen_sh, batch_sh)
    if fault_injection:
        in_sh = in_sh + ({"loss": shd.replicated(mesh), "grad": shd.replicated(mesh)},)
    return jax.jit(step_fn, in_shardings=in_sh, out_shardings=(state_sh, shd.replicated(mesh)),
                   donate_argnums=(0,) if donate else (), compiler_options=compiler_options)


def put_batch(batch: dict, mesh) -> dict:
    """Host numpy split batch -> global jax Arrays with the micro-batch sharding (each process fills only its
    own shards, from the same global numpy batch)."""
    shardings = batch_shardings(batch, mesh)
    return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
            for k, v in batch.items()}
