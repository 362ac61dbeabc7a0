"""LoRA adapters in memory and in the trainer's checkpoint folders: one form for every adapter this project
reads, and attaching it to the JAX model.

    params, meta = load_adapter(path, step=None)  # a workdir, its checkpoints/, adapters/ or adapters/<step>
    adapter = read_trainer_adapter(path, step)    # the same as an Adapter (PEFT folders: jaxrl.models.peft)
    attach(model, adapter)                        # in place; replaces whatever adapters the model carried
    detach(model)                                 # back to the bare base model
    adapter.delta(module)                         # s * B @ A, [out, in] fp32: what a merge adds to the base weight

Names are ours (`layers.0.linear_attn.in_proj_qkv.lora.lora_A` [r, in], `...lora_B` [out, r]), fp32, exactly
PEFT's tensors under another name (docs/design/qwen35-architecture.md §6), so every conversion is a rename.

Checkpoint layout (written by jaxrl.train.checkpoints): `<workdir>/checkpoints/adapters/<step>/{adapter,meta}`, and
with `ema.decay` set the EMA of the factors beside it, `<workdir>/checkpoints/ema/<step>/{adapter,meta}` (the same
format: every reader here takes either). Averaged adapters (jaxrl.export.average) are PEFT folders under
`<workdir>/averages/<name>/`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxrl.models import lora
from jaxrl.models.lora import ALL_LINEAR

CHECKPOINTS = "checkpoints"
ADAPTERS = "adapters"
EMA = "ema"  # checkpoints/ema/<step>: the EMA of the LoRA factors at that step (TrainConfig.ema)
AVERAGES = "averages"  # <workdir>/averages/<name>: averaged adapters of the run (launchers.export --average)
ADAPTER_TREES = (ADAPTERS, EMA)  # the folders of checkpoints/ that hold one adapter per step


class CheckpointNotFound(FileNotFoundError):
    """No adapter / state checkpoint where one was asked for; names the folder."""


A_SUFFIX = ".lora.lora_A"
B_SUFFIX = ".lora.lora_B"


class AdapterError(ValueError):
    """An adapter that cannot be read, exported or attached faithfully; the message names the file and key."""


@dataclasses.dataclass
class Adapter:
    """LoRA factors of one adapter plus what is needed to rebuild and describe it.

    params: {our factor name: fp32 array}; every module has both `A` [r, in] and `B` [out, r].
    modules: module paths (`layers.3.self_attn.q_proj`), in model order.
    step: optimizer step of a trainer checkpoint (None for a PEFT folder or an average).
    source: where it was read from (for error messages and provenance records).
    average: what an averaged adapter averages, None for one checkpoint: {"kind": "mean", "steps", "weights",
      ...} (jaxrl.export.average; kept in jaxrl_export.json) or {"kind": "ema", "decay", "step", "over"} (an EMA
      checkpoint, from its meta).
    """

    params: dict[str, np.ndarray]
    rank: int
    alpha: float
    use_rslora: bool = False
    dropout: float = 0.0
    step: Optional[int] = None
    source: str = ""
    model_path: str = ""
    kind: str = "trainer"  # "trainer" | "peft" | "average"
    average: Optional[dict] = None

    def __post_init__(self):
        self.params = {k: np.asarray(v, np.float32) for k, v in self.params.items()}
        self.validate()

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def modules(self) -> list[str]:
        mods = {k[: -len(A_SUFFIX)] for k in self.params if k.endswith(A_SUFFIX)}
        return sorted(mods, key=module_sort_key)

    def factors(self, module: str) -> tuple[np.ndarray, np.ndarray]:
        return self.params[module + A_SUFFIX], self.params[module + B_SUFFIX]

    def delta(self, module: str) -> np.ndarray:
        """`scale * B @ A` in fp32, [out, in] (PEFT `get_delta_weight`)."""
        a, b = self.factors(module)
        return (np.float32(self.scale) * (b @ a)).astype(np.float32)

    def digest(self) -> str:
        """sha256 over (name, shape, fp32 bytes) of every factor in name order, plus rank, alpha and rsLoRA:
        two adapters with equal digests compute the same thing."""
        h = hashlib.sha256(f"r={self.rank};alpha={self.alpha!r};rslora={self.use_rslora}".encode())
        for name in sorted(self.params):
            value = np.ascontiguousarray(self.params[name], np.float32)
            h.update(f"{name}:{value.shape}".encode())
            h.update(value.tobytes())
        return h.hexdigest()

    def validate(self) -> None:
        where = self.source or "adapter"
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise AdapterError(f"{where}: rank must be a positive integer, got {self.rank!r}")
        if not self.params:
            raise AdapterError(f"{where}: no LoRA factors")
        for name in self.params:
            if not (name.endswith(A_SUFFIX) or name.endswith(B_SUFFIX)):
                raise AdapterError(f"{where}: {name!r} is not a LoRA factor name (expected '<module>{A_SUFFIX}' "
                                   f"or '<module>{B_SUFFIX}')")
        for module in {n.rsplit(".lora.", 1)[0] for n in self.params}:
            for suffix in (A_SUFFIX, B_SUFFIX):
                if module + suffix not in self.params:
                    raise AdapterError(f"{where}: module {module!r} has no {suffix[1:]} factor")
            a, b = self.params[module + A_SUFFIX], self.params[module + B_SUFFIX]
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != self.rank or b.shape[1] != self.rank:
                raise AdapterError(f"{where}: {module}: lora_A {a.shape} / lora_B {b.shape} are not [r, in] / "
                                   f"[out, r] with r = {self.rank}")
            if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
                raise AdapterError(f"{where}: {module}: non-finite values in the LoRA factors")


def module_sort_key(path: str) -> tuple:
    """Model order: by layer number, then by name (so layers.10 follows layers.9)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def module_names(modules) -> list[str]:
    """The distinct last components (`q_proj`, ...) of module paths, in ALL_LINEAR order."""
    names = {m.rsplit(".", 1)[-1] for m in modules}
    return [n for n in ALL_LINEAR if n in names] + sorted(names - set(ALL_LINEAR))


def merged_weight(base_value: np.ndarray, adapter: Adapter, module: str,
                  merge_dtype: Optional[str] = None) -> np.ndarray:
    """`W + scale * B @ A` in fp32, cast to `base_value`'s dtype (or to `merge_dtype`, e.g. "float32", which keeps
    a small update that rounding to bf16 would erase: jaxrl.export.merge)."""
    delta = adapter.delta(module)
    if delta.shape != base_value.shape:
        raise AdapterError(f"{adapter.source}: {module}: delta {delta.shape} does not fit the weight "
                           f"{base_value.shape}")
    return (base_value.astype(np.float32) + delta).astype(merge_dtype or base_value.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Trainer checkpoints

def adapter_root(path: str) -> Optional[str]:
    """The folder of per-step adapter checkpoints `path` names: itself when it is an adapters/ or ema/ folder, else
    the adapters/ of a checkpoints/ folder or of a run workdir; None when there is none."""
    path = os.path.abspath(path)
    for candidate in (path, os.path.join(path, ADAPTERS), os.path.join(path, CHECKPOINTS, ADAPTERS)):
        if os.path.basename(candidate) in ADAPTER_TREES and os.path.isdir(candidate):
            return candidate
    return None


def _adapter_root_and_step(path: str, step: Optional[int]) -> tuple[str, Optional[int]]:
    path = os.path.abspath(path)
    base = os.path.basename(path.rstrip("/"))
    if base.isdigit() and os.path.basename(os.path.dirname(path)) in ADAPTER_TREES:
        return os.path.dirname(path), int(base) if step is None else step
    root = adapter_root(path)
    if root is not None:
        return root, step
    raise CheckpointNotFound(f"{path}: not a run workdir, its checkpoints/, adapters/ or ema/ folder, or an adapter "
                             f"step folder (expected .../{CHECKPOINTS}/{ADAPTERS}/<step>)")


def run_folder(path: str) -> str:
    """The run workdir of an adapter checkpoint path (a workdir, its checkpoints/, adapters/ or ema/ folder, or one
    step folder of them): where its averages/ folder lives."""
    root, _ = _adapter_root_and_step(path, None)
    parent = os.path.dirname(root)
    return os.path.dirname(parent) if os.path.basename(parent) == CHECKPOINTS else parent


def load_adapter(path: str, step: Optional[int] = None) -> tuple[dict[str, np.ndarray], dict]:
    """(params {name: np.float32 array}, meta) of one adapter checkpoint; `step` None = the newest there."""
    root, step = _adapter_root_and_step(path, step)
    mgr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True),
                                item_handlers={"adapter": ocp.StandardCheckpointHandler(),
                                               "meta": ocp.JsonCheckpointHandler()})
    try:
        steps = sorted(mgr.all_steps())
        if not steps:
            raise CheckpointNotFound(f"{root}: no complete adapter checkpoint")
        if step is None:
            step = steps[-1]
        if step not in steps:
            raise CheckpointNotFound(f"{root}: no adapter for step {step}; steps present: {steps}")
        # Onto one local device, whatever mesh wrote it: restoring by the saved shardings needs the very devices
        # of the training run (8 GPUs, or two hosts' devices), and an adapter is read on any machine.
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = {name: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device)
                  for name, m in dict(mgr.item_metadata(step)["adapter"]).items()}
        restored = mgr.restore(step, args=ocp.args.Composite(adapter=ocp.args.StandardRestore(target),
                                                             meta=ocp.args.JsonRestore()))
    finally:
        mgr.close()
    params = {k: np.asarray(jax.device_get(v)) for k, v in restored.adapter.items()}
    return params, dict(restored.meta)


def read_trainer_adapter(path: str, step: Optional[int] = None) -> Adapter:
    """The adapter checkpoint at `path` (see `load_adapter`) as an Adapter."""
    params, meta = load_adapter(path, step)
    return from_trainer(params, meta, f"{os.path.abspath(path)} (step {meta.get('step')})")


def from_trainer(params: dict, meta: dict, source: str = "") -> Adapter:
    """An Adapter from `load_adapter`'s (params, meta)."""
    spec = meta.get("lora") or {}
    for key in ("rank", "alpha"):
        if key not in spec:
            raise AdapterError(f"{source}: adapter meta has no lora.{key}; cannot rebuild the adapter")
    ema = meta.get("ema")
    adapter = Adapter(params=dict(params), rank=int(spec["rank"]), alpha=float(spec["alpha"]),
                      use_rslora=bool(spec.get("use_rslora", False)), dropout=float(spec.get("dropout", 0.0)),
                      step=meta.get("step"), source=source, model_path=str(meta.get("model_path") or ""),
                      kind="trainer", average={"kind": "ema", **ema} if ema else None)
    listed = spec.get("modules")
    if listed is not None and sorted(listed, key=module_sort_key) != adapter.modules:
        raise AdapterError(f"{source}: meta lists {len(listed)} adapted modules but the checkpoint holds factors "
                           f"for {len(adapter.modules)}; the checkpoint is inconsistent")
    if spec.get("scale") is not None and not math.isclose(float(spec["scale"]), adapter.scale, rel_tol=1e-6):
        raise AdapterError(f"{source}: meta scale {spec['scale']} disagrees with alpha/rank/rsLoRA "
                           f"({adapter.scale})")
    return adapter


def write_adapter_checkpoint(workdir: str, step: int, adapter: Adapter, model_config=None) -> str:
    """Writes `adapter` as the trainer's adapter checkpoint `workdir/checkpoints/adapters/<step>` (the format
    `load_adapter` reads), e.g. to evaluate or continue from a PEFT adapter trained
    elsewhere; returns the step folder."""
    root = os.path.join(os.path.abspath(workdir), CHECKPOINTS, ADAPTERS)
    by_name: dict[str, int] = {}
    for m in adapter.modules:
        by_name[m.rsplit(".", 1)[-1]] = by_name.get(m.rsplit(".", 1)[-1], 0) + 1
    meta = {"step": int(step), "model_path": adapter.model_path, "algorithm": "",
            "model": model_config.to_dict() if model_config is not None else None,
            "lora": {"modules": adapter.modules, "by_name": by_name, "rank": adapter.rank, "alpha": adapter.alpha,
                     "scale": adapter.scale, "use_rslora": adapter.use_rslora, "dropout": adapter.dropout},
            "imported_from": adapter.source}
    mgr = ocp.CheckpointManager(root, item_names=("adapter", "meta"),
                                options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False))
    try:
        mgr.save(int(step), args=ocp.args.Composite(adapter=ocp.args.StandardSave(dict(adapter.params)),
                                                    meta=ocp.args.JsonSave(meta)))
        mgr.wait_until_finished()
    finally:
        mgr.close()
    return os.path.join(root, str(int(step)))


def adapter_steps(workdir: str, tree: str = ADAPTERS) -> list[int]:
    """Complete adapter checkpoint steps of a run (a workdir, its checkpoints/ folder, or an adapters/ or ema/
    folder); `tree`: which of the two per-step folders to list, `adapters` or its sibling `ema` (a run without EMA
    checkpoints: [])."""
    root = adapter_root(workdir)
    if root is None:
        raise CheckpointNotFound(f"{os.path.abspath(workdir)}: no {CHECKPOINTS}/{ADAPTERS} folder (not a run "
                                 "workdir)")
    if os.path.basename(root) != tree:
        root = os.path.join(os.path.dirname(root), tree)
        if not os.path.isdir(root):
            return []
    mgr = ocp.CheckpointManager(root, item_names=("adapter", "meta"),
                                options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        return sorted(int(s) for s in mgr.all_steps())
    finally:
        mgr.close()


# ---------------------------------------------------------------------------------------------------------------
# Attaching to the JAX model

def check_against_model(adapter: Adapter, model) -> None:
    """Every adapted module exists in `model` with matching in/out features (an error names the first that
    does not): an adapter for another model shape is refused, never half-applied."""
    linears = dict(lora.linears(model))
    for module in adapter.modules:
        linear = linears.get(module)
        if linear is None or module == "lm_head":
            valid = sorted({p.rsplit(".", 1)[-1] for p in linears if p != "lm_head"})
            raise AdapterError(f"{adapter.source}: module {module!r} is not a projection of this model "
                               f"({model.config.num_hidden_layers} layers; projections: {', '.join(valid)})")
        a, b = adapter.factors(module)
        if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
            raise AdapterError(f"{adapter.source}: {module}: lora_A {a.shape} / lora_B {b.shape} do not fit the "
                               f"model's [{linear.out_features}, {linear.in_features}] weight")


def detach(model) -> None:
    """Removes every adapter: the model computes its base weights again."""
    for linear in dict(lora.linears(model)).values():
        linear.lora = None


def attach(model, adapter: Adapter) -> None:
    """Attaches `adapter` to `model` in place (after removing any adapter it carried); dropout is off (the
    model is for evaluation / export, where PEFT and vLLM never drop)."""
    check_against_model(adapter, model)
    detach(model)
    linears = dict(lora.linears(model))
    for module in adapter.modules:
        a, b = adapter.factors(module)
        linear = linears[module]
        lo = lora.LoRA(linear.in_features, linear.out_features, rank=adapter.rank, alpha=adapter.alpha,
                  use_rslora=adapter.use_rslora, dropout=0.0, lora_A=jnp.asarray(a))
        lo.lora_B[...] = jnp.asarray(b)
        linear.lora = lo


def attached_digest(model) -> Optional[str]:
    """`Adapter.digest()` of what the model carries NOW (read back from its parameters), None without adapters:
    proof of which adapter an evaluation ran with, independent of the files it was read from."""
    adapters = list(lora.iter_lora(model))
    if not adapters:
        return None
    first = adapters[0][1]
    params = {k: np.asarray(v) for k, v in lora.lora_state(model).items()}
    return Adapter(params=params, rank=first.rank, alpha=first.alpha, use_rslora=first.use_rslora,
                   source="attached").digest()
