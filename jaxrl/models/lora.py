"""LoRA adapters for the Flax Qwen3.5 model, in the PEFT convention (docs/design/qwen35-architecture.md §6).

    from jaxrl.models import lora
    report = lora.apply_lora(model, targets="all-linear", rank=16, alpha=32)   # attaches adapters in place
    graphdef, trainable, frozen = lora.split_lora(model)                      # nnx.split by LoRAParam
    with lora.adapters_disabled(model):                                       # the base (reference) policy
        ref_logits = model(ids)

Math (PEFT `lora.Linear`): `y = W x + s * B (A dropout(x))` with `A [r, in]` (kaiming-uniform, PEFT's
`a=sqrt(5)`, i.e. U(-1/sqrt(in), 1/sqrt(in))), `B [out, r]` (zeros, so an untrained adapter changes nothing),
`s = alpha / r`, or `alpha / sqrt(r)` with rsLoRA. A and B are stored exactly as PEFT stores
`lora_A.weight` / `lora_B.weight`, so export is the rename `<module>.lora.lora_A` -> `<module>.lora_A.weight`.

Adapters are kept in fp32. They compute in the input's dtype with fp32 accumulation: in a bf16 model the two
adapter matmuls take bf16 operands (the factors are rounded to bf16 for the product, the rank-r hidden too) and
accumulate in fp32; in an fp32 model everything is fp32, PEFT's arithmetic. The result is cast to the base output
dtype before it is added.

Targets (`apply_lora(targets=...)`), matched against module paths such as `layers.3.self_attn.q_proj`:
  * `"all-linear"`: the 12 language-tower projections (ALL_LINEAR), never `lm_head`;
  * a list / tuple of names, or a comma-separated string of names (`"q_proj,v_proj"`): PEFT's list rule, a
    module matches when its path equals a name or ends with `"." + name` (so `"self_attn.q_proj"` works);
  * any other string is a regular expression, PEFT's rule: `re.fullmatch` on the module path. PEFT regexes
    written for the HF container (`.*language_model.*\\.(q_proj|...)`) also work: the path is tried as is, then
    with the HF tower prefixes `model.language_model.` and `model.` in front.
Every name of a list must match at least one module, and a regex must match something; otherwise the error
names `lora.targets` and lists the valid module names.

Dropout follows PEFT (on the adapter's input only, scaled by 1/(1-p)) and is active only inside
`lora_dropout(model, key)`, so evaluation, generation and the reference pass are deterministic.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Iterator, Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrl.models.qwen35.layers import Linear
from jaxrl.models.settings import LoRAConfig
from jaxrl.utils.tree import dotted

# The 12 projections of the Qwen3.5 language tower (PEFT's `all-linear` minus the vision tower and lm_head).
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
              "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")
# Tried in front of our module paths when a regex target does not match them as they are.
_HF_TOWER_PREFIXES = ("model.language_model.", "model.")


class LoRAError(ValueError):
    """A LoRA configuration that cannot be applied; the message names the config key."""


class LoRAParam(nnx.Param):
    """A trainable LoRA factor. `nnx.split(model, LoRAParam, ...)` separates trainables from the frozen base."""


class LoRADropoutKey(nnx.Variable):
    """The PRNG key (raw uint32[2]) of one adapter's dropout; set per step by `lora_dropout`, never trained."""


class LoRA(nnx.Module):
    """One adapter: `__call__(x [..., in]) -> s * B A x  [..., out]` (fp32 result, x's dtype operands).

    Attributes: `lora_A: LoRAParam [r, in]`, `lora_B: LoRAParam [out, r]`, `scale` (float), `enabled` (bool,
    read at trace time by `Linear`), `dropout` (float), `dropout_active` (bool, set by `lora_dropout`).
    """

    def __init__(self, in_features: int, out_features: int, *, rank: int, alpha: float,
                 use_rslora: bool = False, dropout: float = 0.0, key: Optional[jax.Array] = None,
                 lora_A: Optional[jax.Array] = None):
        if not isinstance(rank, int) or rank <= 0:
            raise LoRAError(f"lora.rank must be a positive integer, got {rank!r}")
        if not (0.0 <= dropout < 1.0):
            raise LoRAError(f"lora.dropout must be in [0, 1), got {dropout!r}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.alpha = float(alpha)
        self.use_rslora = bool(use_rslora)
        self.scale = self.alpha / (math.sqrt(rank) if use_rslora else rank)
        if lora_A is None:
            lora_A = kaiming_uniform(key, rank, in_features)
        if tuple(lora_A.shape) != (rank, in_features):
            raise LoRAError(f"lora_A has shape {tuple(lora_A.shape)}; expected (rank, in) = {(rank, in_features)}")
        self.lora_A = LoRAParam(jnp.asarray(lora_A, jnp.float32))
        self.lora_B = LoRAParam(jnp.zeros((out_features, rank), jnp.float32))
        self.enabled = True
        self.dropout = float(dropout)
        self.dropout_active = False
        self.dropout_key = LoRADropoutKey(jnp.zeros((2,), jnp.uint32)) if dropout > 0 else nnx.data(None)

    @staticmethod
    def compute_dtype(input_dtype) -> jnp.dtype:
        """The operand dtype of the adapter's products for inputs of `input_dtype` (module docstring); a decode
        program that stacks A under the base weight (`Linear.decode_weights`) rounds it the same way."""
        return jnp.dtype(input_dtype) if jnp.dtype(input_dtype) in (jnp.bfloat16, jnp.float16) else jnp.dtype(
            jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        compute = self.compute_dtype(x.dtype)
        x = x.astype(compute)
        if self.dropout_active and self.dropout > 0:
            key = jax.random.wrap_key_data(self.dropout_key[...])
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0.0).astype(compute)
        return low_rank_product(x, self.lora_A[...].astype(compute), (self.lora_B[...] * self.scale).astype(compute))

    def delta_weight(self) -> jax.Array:
        """`s * B @ A`, [out, in] fp32: what a merge adds to the base weight (PEFT `get_delta_weight`)."""
        return self.scale * (self.lora_B[...] @ self.lora_A[...])


@jax.custom_vjp
def low_rank_product(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """(x A^T) B^T for x [..., in], A [r, in], B [out, r], all in one dtype: fp32 result, fp32 accumulation.

    The backward is written out so that each factor's gradient contracts over the tokens with the thin [N, r]
    operand transposed (dA = dh^T x, dB = (h^T dy)^T) rather than the wide [N, in] / [N, out] one: left to
    itself XLA rewrites dB as dy^T h and, on the CPU, copies dy transposed first (the largest cost of a LoRA
    step there). An optimization barrier keeps the [r, out] product from being rewritten.
    """
    h = jnp.einsum("...i,ri->...r", x, a, preferred_element_type=jnp.float32)
    return jnp.einsum("...r,or->...o", h.astype(x.dtype), b, preferred_element_type=jnp.float32)


def _low_rank_fwd(x, a, b):
    h = jnp.einsum("...i,ri->...r", x, a, preferred_element_type=jnp.float32).astype(x.dtype)
    h = checkpoint_name(h, "lora_hidden")
    return jnp.einsum("...r,or->...o", h, b, preferred_element_type=jnp.float32), (x, a, b, h)


def _low_rank_bwd(residuals, d_out):
    x, a, b, h = residuals
    d_out = d_out.astype(x.dtype)
    d_h = jnp.einsum("...o,or->...r", d_out, b, preferred_element_type=jnp.float32).astype(x.dtype)
    batch = "".join(chr(ord("A") + i) for i in range(x.ndim - 1))  # the token dimensions, contracted
    d_b_t = jax.lax.optimization_barrier(
        jnp.einsum(f"{batch}r,{batch}o->ro", h, d_out, preferred_element_type=jnp.float32))
    d_a = jax.lax.optimization_barrier(
        jnp.einsum(f"{batch}r,{batch}i->ri", d_h, x, preferred_element_type=jnp.float32))
    d_x = jnp.einsum("...r,ri->...i", d_h, a, preferred_element_type=jnp.float32)
    return d_x.astype(x.dtype), d_a.astype(a.dtype), d_b_t.T.astype(b.dtype)


low_rank_product.defvjp(_low_rank_fwd, _low_rank_bwd)


def kaiming_uniform(key: jax.Array, rank: int, in_features: int) -> jax.Array:
    """PEFT's A init, `kaiming_uniform_(a=sqrt(5))` on [r, in]: U(-1/sqrt(in), 1/sqrt(in)), fp32."""
    bound = 1.0 / math.sqrt(in_features)
    return jax.random.uniform(key, (rank, in_features), jnp.float32, -bound, bound)


# ---------------------------------------------------------------------------------------------------------------
# Targeting

def linears(model: nnx.Module) -> list[tuple[str, Linear]]:
    """Every `Linear` of the model with its dotted path, in graph order."""
    return [(dotted(p), m) for p, m in nnx.iter_modules(model) if isinstance(m, Linear)]


def _parse_targets(targets) -> tuple[str, Union[tuple[str, ...], re.Pattern]]:
    """-> ("all-linear", names), ("names", names) or ("regex", compiled)."""
    if isinstance(targets, str):
        if targets == "all-linear":
            return "all-linear", ALL_LINEAR
        if re.fullmatch(r"[\w.]+(\s*,\s*[\w.]+)*", targets):
            return "names", tuple(t.strip() for t in targets.split(","))
        try:
            return "regex", re.compile(targets)
        except re.error as e:
            raise LoRAError(f"lora.targets={targets!r} is neither 'all-linear', a name list nor a valid regular "
                            f"expression: {e}") from e
    if isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) for t in targets):
        return "names", tuple(targets)
    raise LoRAError(f"lora.targets must be 'all-linear', a list of module names or a regex string; got {targets!r}")


def _name_matches(path: str, name: str) -> bool:
    return path == name or path.endswith("." + name)


def _regex_matches(path: str, pattern: re.Pattern) -> bool:
    return any(pattern.fullmatch(prefix + path) for prefix in ("",) + _HF_TOWER_PREFIXES)


def resolve_targets(model: nnx.Module, targets) -> list[str]:
    """Module paths of the `Linear`s that `targets` selects (see the module docstring); raises LoRAError when a
    name or the regex matches nothing, or when `lm_head` is selected."""
    kind, spec = _parse_targets(targets)
    paths = [p for p, _ in linears(model)]
    valid = sorted({p.rsplit(".", 1)[-1] for p in paths if p != "lm_head"})
    if kind == "all-linear":  # a preset: whichever of the 12 projections this model has
        chosen = [p for p in paths if p.rsplit(".", 1)[-1] in spec]
        if not chosen:
            raise LoRAError("lora.targets='all-linear' matches no module of this model")
    elif kind == "names":
        if "lm_head" in spec:
            raise LoRAError("lora.targets: lm_head cannot carry an adapter (the chunked log-prob path reads the "
                            "head weight directly); valid names: " + ", ".join(valid))
        chosen = []
        for name in spec:
            hits = [p for p in paths if _name_matches(p, name)]
            if not hits:
                raise LoRAError(f"lora.targets: {name!r} matches no module of this model; valid names: "
                                + ", ".join(valid))
            chosen.extend(hits)
        chosen = [p for p in paths if p in set(chosen)]  # graph order, no duplicates
    else:
        chosen = [p for p in paths if _regex_matches(p, spec)]
        if not chosen:
            raise LoRAError(f"lora.targets: the regex {spec.pattern!r} matches no module path (paths look like "
                            f"{paths[0]!r}, also tried with the prefixes {list(_HF_TOWER_PREFIXES)}); valid "
                            f"names: " + ", ".join(valid))
        if "lm_head" in chosen:
            raise LoRAError(f"lora.targets: the regex {spec.pattern!r} selects lm_head, which cannot carry an "
                            "adapter (the chunked log-prob path reads the head weight directly)")
    return chosen


def apply_lora(model: nnx.Module, targets="all-linear", rank: int = 16, alpha: float = 32.0,
               use_rslora: bool = False, dropout: float = 0.0, seed: int = 0) -> dict:
    """Attach a fresh adapter (B = 0) to every selected `Linear`, in place; returns `lora_targets_report`.

    Adapter i (graph order among the selected modules) draws its A from `fold_in(key(seed), i)`: the same seed
    and targets give the same adapters.
    """
    chosen = set(resolve_targets(model, targets))
    selected = [(path, linear) for path, linear in linears(model) if path in chosen]
    for path, linear in selected:
        if linear.lora is not None:
            raise LoRAError(f"{path} already carries an adapter; apply_lora was called twice")
    if not isinstance(rank, int) or rank <= 0:
        raise LoRAError(f"lora.rank must be a positive integer, got {rank!r}")
    fan_ins = tuple(linear.in_features for _, linear in selected)

    def init_all(root):  # one compiled program for every A, instead of one eager op per module
        return [kaiming_uniform(jax.random.fold_in(root, i), rank, n) for i, n in enumerate(fan_ins)]

    factors = jax.jit(init_all)(jax.random.key(seed))
    for (path, linear), a in zip(selected, factors):
        linear.lora = LoRA(linear.in_features, linear.out_features, rank=rank, alpha=alpha, use_rslora=use_rslora,
                           dropout=dropout, lora_A=a)
    return lora_targets_report(model)


# vLLM 0.33 fuses a GDN layer's in_proj_qkv and in_proj_z into one in_proj_qkvz layer; an adapter of that layer is
# split by `expand_packed_lora` (vllm/lora/layers/column_parallel_linear.py:265-318), which gives a missing leading
# in_proj_qkv all four output slices (:290) and then raises "Cannot determine how to split lora_b" on the in_proj_z
# factor (:303-308) when the adapter is activated. Every other partial group (q/k/v, gate/up, b/a, qkv without z)
# packs. {module: the module of the same layer it needs}.
VLLM_REQUIRES = {"in_proj_z": "in_proj_qkv"}


def vllm_unpackable(paths) -> list[str]:
    """Messages for the targeted module paths vLLM 0.33 cannot pack (see VLLM_REQUIRES); [] when it can."""
    chosen = set(paths)
    out = []
    for path in paths:
        prefix, _, name = path.rpartition(".")
        need = VLLM_REQUIRES.get(name)
        if need and f"{prefix}.{need}" not in chosen:
            out.append(f"{path} without {prefix}.{need}")
    return out


def apply_lora_from_config(model: nnx.Module, lora: LoRAConfig, seed: int = 0) -> dict:
    """`apply_lora` from a run's `lora` block (jaxrl.models.settings.LoRAConfig).

    Refuses (LoRAError) targets whose adapter vLLM 0.33 could not serve (`vllm_unpackable`), before any training,
    unless `lora.allow_vllm_unpackable` is true (the adapter still works in jaxrl and PEFT).
    """
    targets = tuple(lora.targets) if isinstance(lora.targets, (list, tuple)) else lora.targets
    unpackable = vllm_unpackable(resolve_targets(model, targets))
    if unpackable and not lora.allow_vllm_unpackable:
        raise LoRAError(f"lora.targets={lora.targets!r}: vLLM 0.33 cannot serve this adapter ({len(unpackable)} "
                        f"module(s), e.g. {unpackable[0]}: it packs in_proj_z only together with in_proj_qkv). "
                        "Add in_proj_qkv to lora.targets, drop in_proj_z, or set lora.allow_vllm_unpackable=True "
                        "if the adapter will never be served by vLLM")
    return apply_lora(model, targets=targets, rank=lora.rank, alpha=lora.alpha, use_rslora=lora.use_rslora,
                      dropout=lora.dropout, seed=seed)


def iter_lora(model: nnx.Module) -> Iterator[tuple[str, LoRA]]:
    """(path of the owning Linear, adapter) for every attached adapter, in graph order."""
    for path, m in nnx.iter_modules(model):
        if isinstance(m, LoRA):
            yield dotted(path[:-1]), m


def lora_targets_report(model: nnx.Module) -> dict:
    """Which modules carry adapters: {"modules": [paths], "by_name": {name: count}, "rank", "alpha", "scale",
    "use_rslora", "dropout", "trainable_params", "total_params"}; raises LoRAError when there are none."""
    adapters = list(iter_lora(model))
    if not adapters:
        raise LoRAError("the model carries no LoRA adapter (apply_lora first)")
    by_name: dict[str, int] = {}
    for path, _ in adapters:
        name = path.rsplit(".", 1)[-1]
        by_name[name] = by_name.get(name, 0) + 1
    first = adapters[0][1]
    trainable = sum(a.lora_A.size + a.lora_B.size for _, a in adapters)
    total = sum(v.size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    return {"modules": [p for p, _ in adapters], "by_name": by_name, "rank": first.rank, "alpha": first.alpha,
            "scale": first.scale, "use_rslora": first.use_rslora, "dropout": first.dropout,
            "trainable_params": int(trainable), "total_params": int(total)}


# ---------------------------------------------------------------------------------------------------------------
# Switching, splitting

@contextlib.contextmanager
def adapters_disabled(model: nnx.Module):
    """Within the block every adapter is off: the model computes the base weights exactly (the reference policy),
    without a second copy of them. Works eagerly and inside a traced function (it flips a Python attribute that
    `Linear` reads at trace time); the previous state is restored on exit."""
    adapters = [a for _, a in iter_lora(model)]
    before = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield model
    finally:
        for a, b in zip(adapters, before):
            a.enabled = b


@contextlib.contextmanager
def lora_dropout(model: nnx.Module, key: Optional[jax.Array]):
    """Within the block, adapters with dropout > 0 drop their inputs, adapter i with `fold_in(key, i)`.
    `key` is a typed key or raw uint32[2] data; None (or dropout 0 everywhere) makes this a no-op."""
    adapters = [a for _, a in iter_lora(model) if a.dropout > 0]
    if key is None or not adapters:
        yield model
        return
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    # Fresh Variables rather than writes into the old ones: the old ones may belong to an outer trace (state
    # passed into jit, used under grad), which NNX forbids mutating from the inner one. Restored on exit.
    originals = [a.dropout_key for a in adapters]
    for i, a in enumerate(adapters):
        a.dropout_key = LoRADropoutKey(jax.random.key_data(jax.random.fold_in(key, i)))
        a.dropout_active = True
    try:
        yield model
    finally:
        for a, original in zip(adapters, originals):
            a.dropout_active = False
            a.dropout_key = original


def split_lora(model: nnx.Module, trainable=LoRAParam):
    """`(graphdef, trainable_state, frozen_state)`: `nnx.split(model, trainable, ...)`; `merge` restores it."""
    return nnx.split(model, trainable, ...)


def lora_state(model: nnx.Module) -> dict[str, jax.Array]:
    """Flat {name: array} of every LoRA factor, names like `layers.0.linear_attn.in_proj_qkv.lora.lora_A`."""
    return {dotted(p): v[...] for p, v in nnx.to_flat_state(nnx.state(model, LoRAParam))}


def peft_key(name: str, layout_prefix: str = "base_model.model.model.language_model.") -> str:
    """Our factor name -> the PEFT adapter key (container layout by default; pass "base_model.model.model."
    for a `Qwen3_5ForCausalLM` adapter): `...q_proj.lora.lora_A` -> `...q_proj.lora_A.weight`."""
    module, factor = name.rsplit(".lora.", 1)
    return f"{layout_prefix}{module}.{factor}.weight"
