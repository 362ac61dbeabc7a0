"""DPO-family preference losses: pure, jit-compatible, float32.

Definitions follow TRL's ``DPOTrainer._compute_loss`` (trl 1.16) and ``docs/design/algorithms.md`` section 2.1; SimPO
follows TRL's ``CPOTrainer.cpo_loss``. Notation per pair i of the batch (all ``[B]``):

* ``chosen_logps`` = sum over the chosen completion's tokens of log pi_theta; ``rejected_logps`` likewise;
  ``ref_*_logps`` the same under the reference policy.
* ``r_w = chosen_logps - ref_chosen_logps`` and ``r_l`` likewise (``chosen_logratios``, ``rejected_logratios``).
* f-divergence score ``s = f(r)``: reverse_kl ``r`` (standard DPO), forward_kl ``1 - exp(-r)``, js_divergence
  ``log 2 + log sigmoid(r)``, alpha_divergence ``(exp((alpha-1) r) - 1) / (alpha-1)`` (exponent clamped at 80).
  Every form is 0 at r = 0; only ``delta = s_w - s_l`` enters the losses that accept a transform.
* ``|y|`` = number of completion tokens (``chosen_lengths``), clamped to >= 1.

A loss is a function of a :class:`PairInputs` returning per-pair losses ``[B]``, registered in ``LOSSES`` with the
:class:`LossSpec` of what it reads. The built-ins below register themselves with ``_builtin_loss``; a user's loss
comes in through ``jaxrl.algorithms.plugins`` (``plugins.register("dpo_loss", name)`` or a ``plugins`` config
entry), which checks it on example pairs first. Either way ``dpo_loss(..., loss_type=name)`` then uses it.

Micro-batch contract of :func:`combined_dpo_loss` (the trainer sums micro-batch contributions; pass the
normalisers of the whole accumulated batch):

    contribution = sum_k w_k * sum_i loss_k[i] / num_pairs  +  w_sft * sum_{chosen tokens} (-logp) / num_chosen_tokens

Summed over micro-batches this is exactly TRL's full-batch ``sum_k w_k * mean_i loss_k[i]`` with the SFT term a
token mean over the whole batch. ``aot`` / ``aot_unpaired`` sort across the pairs they are given, so they see
only their micro-batch (as in TRL, where they sort within a device batch): their update depends on the
micro-batch size, and at one pair per micro-batch they are plain smoothed sigmoid DPO (the DPO trainer refuses
that).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxrl.utils.registry import Registry

__all__ = [
    "PairInputs",
    "DPOInputs",
    "LossSpec",
    "LOSSES",
    "PLUGIN_SPEC",
    "loss_spec",
    "make_pair_inputs",
    "f_divergence_scores",
    "dpo_loss",
    "combined_dpo_loss",
    "sft_loss",
    "sequence_logps",
    "chosen_rewards",
    "rejected_rewards",
    "reward_margin",
    "preference_accuracy",
    "F_DIVERGENCES",
    "LOSS_TYPES",
]

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


class PairInputs(NamedTuple):
    """Everything a per-pair loss may read. Arrays are ``[B]`` float32; hyper-parameters are scalars.

    Built by :func:`make_pair_inputs`; a loss function takes one ``PairInputs`` and returns ``[B]``.
    ``chosen_lengths`` / ``rejected_lengths`` are None when the caller gave no lengths.
    """

    chosen_logps: jax.Array  # [B] sum of policy log-probs over the chosen completion
    rejected_logps: jax.Array  # [B]
    ref_chosen_logps: jax.Array  # [B] (zeros for reference-free use)
    ref_rejected_logps: jax.Array  # [B]
    chosen_logratios: jax.Array  # [B] r_w = chosen_logps - ref_chosen_logps
    rejected_logratios: jax.Array  # [B] r_l
    chosen_scores: jax.Array  # [B] s_w = f(r_w), the f-divergence score
    rejected_scores: jax.Array  # [B] s_l
    delta: jax.Array  # [B] s_w - s_l
    chosen_lengths: jax.Array | None  # [B] completion tokens, >= 1
    rejected_lengths: jax.Array | None  # [B]
    beta: jax.Array | float
    label_smoothing: jax.Array | float
    gamma: jax.Array | float  # SimPO target margin
    discopop_tau: jax.Array | float


class LossSpec(NamedTuple):
    """What a loss reads, for argument checks: TRL's rules on which losses accept what. A plug-in declares these
    as keywords of its registration (``plugins.register("dpo_loss", name, reference_free=True)`` or the same keys
    in its `plugins` config entry); undeclared ones take the values of :data:`PLUGIN_SPEC`."""

    label_smoothing: bool = False  # reads label_smoothing (others warn if it is set)
    f_divergence: bool = False  # valid with a non-reverse_kl score transform
    reference_free: bool = False  # ignores the reference log-probs
    needs_lengths: bool = False  # needs chosen_lengths / rejected_lengths
    across_pairs: bool = False  # couples the pairs it is given (sorts them): depends on the micro-batch size


# A loss registered without a spec (a plug-in that declares nothing) may read anything in PairInputs: label
# smoothing and f-divergences are allowed for it; it needs the reference log-probs, and it does not need lengths.
PLUGIN_SPEC = LossSpec(label_smoothing=True, f_divergence=True)

LOSSES = Registry("dpo_loss", hint="A loss of your own: a `plugins` entry of kind dpo_loss (jaxrl.algorithms.plugins)")


def _builtin_loss(name: str, **spec) -> Callable:
    """Decorator registering one of this module's losses as ``loss_type=name`` with its :class:`LossSpec`
    (unchecked: the built-ins are tested against TRL instead)."""

    def deco(fn):
        LOSSES.add(name, fn, info=LossSpec(**spec))
        return fn

    return deco


def loss_spec(name: str) -> LossSpec:
    """What loss ``name`` reads; a helpful KeyError for an unknown name."""
    spec = LOSSES.info(name)
    return PLUGIN_SPEC if spec is None else spec


# ------------------------------------------------------------------------------------------------- inputs


def f_divergence_scores(logratios: jax.Array, f_divergence: str = "reverse_kl", f_alpha: float = 0.5) -> jax.Array:
    """Score transform f(r) of f-DPO (Wang et al. 2023), TRL's normalisation (f(0) = 0). [B] -> [B] float32."""
    r = jnp.asarray(logratios, jnp.float32)
    if f_divergence == "reverse_kl":
        return r
    if f_divergence == "forward_kl":
        return -jnp.expm1(-r)  # 1 - exp(-r)
    if f_divergence == "js_divergence":
        return math.log(2.0) + jax.nn.log_sigmoid(r)
    if f_divergence == "alpha_divergence":
        if abs(f_alpha - 1.0) < 1e-6:  # the alpha -> 1 limit is reverse KL
            return r
        # Clamp so exp stays finite in float32 (TRL clamps at 80 for fp32/bf16).
        t = jnp.minimum((f_alpha - 1.0) * r, 80.0)
        return jnp.expm1(t) / (f_alpha - 1.0)
    raise ValueError(f"unknown f_divergence {f_divergence!r}; choose one of {F_DIVERGENCES}")


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def make_pair_inputs(
    chosen_logps: jax.Array,
    rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array | None = None,
    ref_rejected_logps: jax.Array | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_lengths: jax.Array | None = None,
    rejected_lengths: jax.Array | None = None,
    gamma: float = 0.5,
    discopop_tau: float = 0.05,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
) -> PairInputs:
    """Derive log-ratios, f-scores and delta from sequence log-prob sums ``[B]``. Missing refs count as 0."""
    cl, rl = _f32(chosen_logps), _f32(rejected_logps)
    batch_shape = cl.shape
    if cl.ndim != 1 or rl.shape != batch_shape:
        raise ValueError(f"chosen_logps and rejected_logps must both be [B]; got {cl.shape} and {rl.shape}")
    rcl = jnp.zeros_like(cl) if ref_chosen_logps is None else _f32(ref_chosen_logps)
    rrl = jnp.zeros_like(rl) if ref_rejected_logps is None else _f32(ref_rejected_logps)
    if rcl.shape != batch_shape or rrl.shape != batch_shape:
        raise ValueError(f"reference log-probs must be [B]={batch_shape}; got {rcl.shape} and {rrl.shape}")

    def lengths(x, what):
        if x is None:
            return None
        x = _f32(x)
        if x.shape != batch_shape:
            raise ValueError(f"{what} must be [B]={batch_shape}; got {x.shape}")
        return jnp.maximum(x, 1.0)  # TRL clamps to >= 1: an empty completion must not divide by zero

    r_w, r_l = cl - rcl, rl - rrl
    s_w = f_divergence_scores(r_w, f_divergence, f_alpha)
    s_l = f_divergence_scores(r_l, f_divergence, f_alpha)
    return PairInputs(
        chosen_logps=cl, rejected_logps=rl, ref_chosen_logps=rcl, ref_rejected_logps=rrl,
        chosen_logratios=r_w, rejected_logratios=r_l, chosen_scores=s_w, rejected_scores=s_l, delta=s_w - s_l,
        chosen_lengths=lengths(chosen_lengths, "chosen_lengths"),
        rejected_lengths=lengths(rejected_lengths, "rejected_lengths"),
        beta=beta, label_smoothing=label_smoothing, gamma=gamma, discopop_tau=discopop_tau,
    )


def _lengths(p: PairInputs, name: str):
    if p.chosen_lengths is None or p.rejected_lengths is None:
        raise ValueError(f"loss_type={name!r} is length-normalised: pass chosen_lengths and rejected_lengths ([B])")
    return p.chosen_lengths, p.rejected_lengths


def _smoothed_sigmoid(z, eps):
    """-(1-eps) log sigmoid(z) - eps log sigmoid(-z): cDPO-style label smoothing."""
    return -(1.0 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)


# ------------------------------------------------------------------------------------------------- losses
# Each: PairInputs -> [B] float32. Comments give the paper / TRL reference.


@_builtin_loss("sigmoid", f_divergence=True)
def sigmoid_loss(p: PairInputs) -> jax.Array:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * delta). Not label-smoothed (TRL >= 1.x: use robust)."""
    return -jax.nn.log_sigmoid(p.beta * p.delta)


@_builtin_loss("hinge", f_divergence=True)
def hinge_loss(p: PairInputs) -> jax.Array:
    """SLiC (Zhao et al. 2023): max(0, 1 - beta * delta)."""
    return jax.nn.relu(1.0 - p.beta * p.delta)


@_builtin_loss("ipo", f_divergence=True, needs_lengths=True)
def ipo_loss(p: PairInputs) -> jax.Array:
    """IPO (Azar et al. 2023, eq. 17), length-normalised as TRL: (s_w/|y_w| - s_l/|y_l| - 1/(2 beta))^2."""
    lw, ll = _lengths(p, "ipo")
    return (p.chosen_scores / lw - p.rejected_scores / ll - 1.0 / (2.0 * p.beta)) ** 2


@_builtin_loss("exo_pair", f_divergence=True, label_smoothing=True)
def exo_pair_loss(p: PairInputs) -> jax.Array:
    """EXO-pref (Ji et al. 2024, eq. 16): KL(softmax(beta*s) || [1-eps, eps]) over {chosen, rejected}; eps > 0."""
    z = p.beta * p.delta
    eps = p.label_smoothing
    return jax.nn.sigmoid(z) * (jax.nn.log_sigmoid(z) - jnp.log1p(-eps)) + jax.nn.sigmoid(-z) * (
        jax.nn.log_sigmoid(-z) - jnp.log(eps)
    )


@_builtin_loss("nca_pair")
def nca_pair_loss(p: PairInputs) -> jax.Array:
    """NCA (Chen et al. 2024): -log sig(beta r_w) - 1/2 log sig(-beta r_w) - 1/2 log sig(-beta r_l)."""
    cw, cl = p.beta * p.chosen_logratios, p.beta * p.rejected_logratios
    return -jax.nn.log_sigmoid(cw) - 0.5 * jax.nn.log_sigmoid(-cw) - 0.5 * jax.nn.log_sigmoid(-cl)


@_builtin_loss("robust", f_divergence=True, label_smoothing=True)
def robust_loss(p: PairInputs) -> jax.Array:
    """rDPO (Chowdhury et al. 2024): [-(1-eps) log sig(z) + eps log sig(-z)] / (1 - 2 eps), z = beta delta."""
    z, eps = p.beta * p.delta, p.label_smoothing
    return (-(1.0 - eps) * jax.nn.log_sigmoid(z) + eps * jax.nn.log_sigmoid(-z)) / (1.0 - 2.0 * eps)


@_builtin_loss("bco_pair")
def bco_pair_loss(p: PairInputs) -> jax.Array:
    """BCO on pairs (Jung et al. 2024), without the running reward shift: -log sig(beta r_w) - log sig(-beta r_l)."""
    return -jax.nn.log_sigmoid(p.beta * p.chosen_logratios) - jax.nn.log_sigmoid(-p.beta * p.rejected_logratios)


@_builtin_loss("sppo_hard")
def sppo_hard_loss(p: PairInputs) -> jax.Array:
    """SPPO with hard win probabilities (Wu et al. 2024): (r_w - 1/(2 beta))^2 + (r_l + 1/(2 beta))^2."""
    half = 0.5 / p.beta
    return (p.chosen_logratios - half) ** 2 + (p.rejected_logratios + half) ** 2


@_builtin_loss("aot", label_smoothing=True, across_pairs=True)
def aot_loss(p: PairInputs) -> jax.Array:
    """AOT paired (Melnyk et al. 2024): delta = sort_B(pi_w - pi_l) - sort_B(ref_w - ref_l); smoothed sigmoid."""
    d = jnp.sort(p.chosen_logps - p.rejected_logps) - jnp.sort(p.ref_chosen_logps - p.ref_rejected_logps)
    return _smoothed_sigmoid(p.beta * d, p.label_smoothing)


@_builtin_loss("aot_unpaired", label_smoothing=True, across_pairs=True)
def aot_unpaired_loss(p: PairInputs) -> jax.Array:
    """AOT unpaired: delta = sort_B(r_w) - sort_B(r_l); smoothed sigmoid."""
    d = jnp.sort(p.chosen_logratios) - jnp.sort(p.rejected_logratios)
    return _smoothed_sigmoid(p.beta * d, p.label_smoothing)


@_builtin_loss("apo_zero")
def apo_zero_loss(p: PairInputs) -> jax.Array:
    """APO-zero (D'Oosterlinck et al. 2024, eq. 7): (1 - sig(beta r_w)) + sig(beta r_l)."""
    return (1.0 - jax.nn.sigmoid(p.beta * p.chosen_logratios)) + jax.nn.sigmoid(p.beta * p.rejected_logratios)


@_builtin_loss("apo_down")
def apo_down_loss(p: PairInputs) -> jax.Array:
    """APO-down (eq. 8): sig(beta r_w) + (1 - sig(beta (r_w - r_l)))."""
    return jax.nn.sigmoid(p.beta * p.chosen_logratios) + (
        1.0 - jax.nn.sigmoid(p.beta * (p.chosen_logratios - p.rejected_logratios))
    )


@_builtin_loss("discopop", f_divergence=True)
def discopop_loss(p: PairInputs) -> jax.Array:
    """DiscoPOP (Chris Lu et al. 2024, eq. 5): z = beta delta, g = sig(z/tau): (1-g)(-log sig(z)) + g exp(-z)."""
    z = p.beta * p.delta
    g = jax.nn.sigmoid(z / p.discopop_tau)
    return (1.0 - g) * (-jax.nn.log_sigmoid(z)) + g * jnp.exp(-z)


@_builtin_loss("sigmoid_norm", f_divergence=True, needs_lengths=True)
def sigmoid_norm_loss(p: PairInputs) -> jax.Array:
    """Length-normalised DPO: -log sig(beta (s_w/|y_w| - s_l/|y_l|))."""
    lw, ll = _lengths(p, "sigmoid_norm")
    return -jax.nn.log_sigmoid(p.beta * (p.chosen_scores / lw - p.rejected_scores / ll))


@_builtin_loss("simpo", label_smoothing=True, reference_free=True, needs_lengths=True)
def simpo_loss(p: PairInputs) -> jax.Array:
    """SimPO (Meng et al. 2024; TRL CPOTrainer): u = logp_w/|y_w| - logp_l/|y_l| - gamma/beta, no reference;
    -(1-eps) log sig(beta u) - eps log sig(-beta u)."""
    lw, ll = _lengths(p, "simpo")
    u = p.chosen_logps / lw - p.rejected_logps / ll - p.gamma / p.beta
    return _smoothed_sigmoid(p.beta * u, p.label_smoothing)


LOSS_TYPES = LOSSES.names()  # the built-ins; LOSSES.names() also lists plug-ins once loaded


# ------------------------------------------------------------------------------------------------- entry points


def _check_args(name: str, spec: LossSpec, label_smoothing, f_divergence: str, have_ref: bool):
    if name == "sft":
        raise ValueError("loss_type='sft' needs per-token log-probs: use combined_dpo_loss(DPOInputs(...), ...)")
    if f_divergence not in F_DIVERGENCES:
        raise ValueError(f"unknown f_divergence {f_divergence!r}; choose one of {F_DIVERGENCES}")
    if f_divergence != "reverse_kl" and not spec.f_divergence:
        # The f-DPO reparameterisation leaves a beta*log Z(x) term that only cancels in s_w - s_l.
        ok = [n for n in LOSSES.names() if loss_spec(n).f_divergence]
        raise ValueError(f"f_divergence={f_divergence!r} is not valid for loss_type={name!r}; only for {ok}")
    if not have_ref and not spec.reference_free:
        raise ValueError(f"loss_type={name!r} needs ref_chosen_logps and ref_rejected_logps")
    if isinstance(label_smoothing, (int, float)):  # concrete values only: traced ones are the caller's business
        eps = float(label_smoothing)
        if name == "exo_pair" and not 0.0 < eps < 1.0:
            raise ValueError("exo_pair needs 0 < label_smoothing < 1 (log eps); the EXO paper uses 1e-3")
        if name == "robust" and not 0.0 <= eps < 0.5:
            raise ValueError(f"robust needs 0 <= label_smoothing < 0.5 (divides by 1 - 2 eps); got {eps}")
        if eps != 0.0 and not spec.label_smoothing:
            warnings.warn(
                f"label_smoothing={eps} is ignored by loss_type={name!r} (as in TRL); losses that read it: "
                f"{[n for n in LOSSES.names() if loss_spec(n).label_smoothing]}",
                stacklevel=3,
            )


def _per_pair(name: str, p: PairInputs) -> jax.Array:
    out = LOSSES.get(name)(p)
    out = jnp.asarray(out, jnp.float32)
    if out.shape != p.chosen_logps.shape:
        raise ValueError(f"dpo loss {name!r} returned shape {out.shape}; per-pair losses must be [B]")
    return out


def dpo_loss(
    chosen_logps: jax.Array,
    rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array | None,
    ref_rejected_logps: jax.Array | None,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_lengths: jax.Array | None = None,
    rejected_lengths: jax.Array | None = None,
    *,
    gamma: float = 0.5,
    discopop_tau: float = 0.05,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
) -> jax.Array:
    """Per-pair preference losses ``[B]`` (float32) of one ``loss_type`` (built-in or plug-in).

    Log-prob arguments are sums over completion tokens, ``[B]``. ``chosen_lengths`` / ``rejected_lengths``
    (``[B]`` token counts) are needed by ipo, sigmoid_norm and simpo. simpo is reference-free (refs may be None).
    ``label_smoothing`` is read by robust, exo_pair, aot, aot_unpaired, simpo; ``gamma`` by simpo;
    ``discopop_tau`` by discopop; ``f_divergence`` / ``f_alpha`` transform the log-ratios of the losses that
    admit it (sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, discopop).
    """
    spec = loss_spec(loss_type) if loss_type != "sft" else LossSpec()
    have_ref = ref_chosen_logps is not None and ref_rejected_logps is not None
    _check_args(loss_type, spec, label_smoothing, f_divergence, have_ref)
    if spec.reference_free:
        ref_chosen_logps = ref_rejected_logps = None
    p = make_pair_inputs(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=beta,
        label_smoothing=label_smoothing, chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths,
        gamma=gamma, discopop_tau=discopop_tau, f_divergence=f_divergence, f_alpha=f_alpha,
    )
    return _per_pair(loss_type, p)


# ------------------------------------------------------------------------------------------------- combined


class DPOInputs(NamedTuple):
    """Per-token inputs of :func:`combined_dpo_loss` (needed for the ``sft`` term and the lengths).

    ``*_token_logps`` are the policy log-probs of each completion token (prompt and padding positions are
    ignored through the masks, whatever they hold); reference log-probs are sequence sums (they are typically
    precomputed). Chosen and rejected may have different padded lengths.
    """

    chosen_token_logps: jax.Array  # [B, Tc]
    chosen_mask: jax.Array  # [B, Tc] 1 = chosen completion token
    rejected_token_logps: jax.Array  # [B, Tr]
    rejected_mask: jax.Array  # [B, Tr]
    ref_chosen_logps: jax.Array | None = None  # [B]; None only for reference-free losses
    ref_rejected_logps: jax.Array | None = None  # [B]


def sequence_logps(token_logps: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of masked log-probs ``[B]``, token count ``[B]``) in float32; masked entries never leak (even NaN)."""
    m = jnp.asarray(mask) > 0
    return jnp.sum(jnp.where(m, _f32(token_logps), 0.0), axis=-1), jnp.sum(m, axis=-1).astype(jnp.float32)


def sft_loss(token_logps: jax.Array, mask: jax.Array, num_tokens: jax.Array | float | None = None) -> jax.Array:
    """Token-mean NLL: ``-sum(logp * mask) / num_tokens`` (scalar). ``num_tokens`` defaults to ``sum(mask)``
    (TRL); pass the global count for micro-batch invariance."""
    total, count = sequence_logps(token_logps, mask)
    denom = jnp.maximum(jnp.sum(count), 1.0) if num_tokens is None else _f32(num_tokens)
    return -jnp.sum(total) / denom


def chosen_rewards(chosen_logps, ref_chosen_logps, beta: float = 0.1) -> jax.Array:
    """Implicit DPO reward of the chosen completions: ``beta * (logp - ref_logp)``, [B]."""
    return beta * (_f32(chosen_logps) - _f32(ref_chosen_logps))


def rejected_rewards(rejected_logps, ref_rejected_logps, beta: float = 0.1) -> jax.Array:
    """Implicit DPO reward of the rejected completions, [B]."""
    return beta * (_f32(rejected_logps) - _f32(ref_rejected_logps))


def reward_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float = 0.1):
    """``chosen_rewards - rejected_rewards``, [B]."""
    return chosen_rewards(chosen_logps, ref_chosen_logps, beta) - rejected_rewards(
        rejected_logps, ref_rejected_logps, beta
    )


def preference_accuracy(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float = 0.1):
    """1.0 where the chosen completion has the higher implicit reward (strictly), else 0.0; [B] float32."""
    m = reward_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta)
    return (m > 0).astype(jnp.float32)


def combined_dpo_loss(
    inputs: DPOInputs,
    loss_types: Sequence[str] = ("sigmoid",),
    loss_weights: Sequence[float] | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
    discopop_tau: float = 0.05,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    num_pairs: jax.Array | float | None = None,
    num_chosen_tokens: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TRL's multi-loss objective ``sum_k w_k * mean_batch(loss_k)``; returns (scalar loss, metrics).

    ``loss_types`` may contain ``"sft"`` (token-mean NLL on the chosen completions). RPO:
    ``("sigmoid", "sft"), (1, alpha)``; MPO: ``("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0)``.

    Micro-batching: pass ``num_pairs`` (pairs in the whole accumulated batch) and ``num_chosen_tokens`` (chosen
    completion tokens in the whole accumulated batch); the returned loss is then this micro-batch's additive
    contribution (module docstring). Left as None they default to this batch's own counts (= TRL on one batch).

    Metrics (means over this call's pairs, float32 scalars): ``loss``, ``loss/<type>``, ``chosen_rewards``,
    ``rejected_rewards``, ``reward_margin``, ``preference_accuracy``, ``logps/chosen``, ``logps/rejected``.
    """
    cm, rm = jnp.asarray(inputs.chosen_mask), jnp.asarray(inputs.rejected_mask)
    if inputs.chosen_token_logps.shape != cm.shape or inputs.rejected_token_logps.shape != rm.shape:
        raise ValueError("token log-probs and masks must have equal shapes [B, T]")
    if cm.shape[0] != rm.shape[0]:
        raise ValueError(f"chosen batch {cm.shape[0]} != rejected batch {rm.shape[0]}")
    c_logps, c_len = sequence_logps(inputs.chosen_token_logps, cm)
    r_logps, r_len = sequence_logps(inputs.rejected_token_logps, rm)
    sums = SequenceSums(c_logps, c_len, r_logps, r_len, inputs.ref_chosen_logps, inputs.ref_rejected_logps)
    return combined_dpo_loss_from_sums(
        sums, loss_types, loss_weights, beta=beta, label_smoothing=label_smoothing, gamma=gamma,
        discopop_tau=discopop_tau, f_divergence=f_divergence, f_alpha=f_alpha, num_pairs=num_pairs,
        num_chosen_tokens=num_chosen_tokens)


class SequenceSums(NamedTuple):
    """Per-pair inputs of :func:`combined_dpo_loss_from_sums`: what every loss reads of the tokens (packed rows
    give these directly, `jaxrl.algorithms.dpo_task.packed_sequence_sums`)."""

    chosen_logps: jax.Array  # [B] sum of the chosen completion's token log-probs
    chosen_lengths: jax.Array  # [B] its token count (float32)
    rejected_logps: jax.Array  # [B]
    rejected_lengths: jax.Array  # [B]
    ref_chosen_logps: jax.Array | None = None  # [B]; None only for reference-free losses
    ref_rejected_logps: jax.Array | None = None  # [B]


def combined_dpo_loss_from_sums(
    sums: SequenceSums,
    loss_types: Sequence[str] = ("sigmoid",),
    loss_weights: Sequence[float] | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    gamma: float = 0.5,
    discopop_tau: float = 0.05,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    num_pairs: jax.Array | float | None = None,
    num_chosen_tokens: jax.Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """:func:`combined_dpo_loss` from per-sequence sums and lengths: the same loss and metrics (its `sft` term
    is ``-sum(chosen_logps) / num_chosen_tokens``, what ``sft_loss`` computes from the tokens)."""
    loss_types = tuple(loss_types)
    if not loss_types:
        raise ValueError("loss_types is empty")
    weights = (1.0,) * len(loss_types) if loss_weights is None else tuple(loss_weights)
    if len(weights) != len(loss_types):
        raise ValueError(f"{len(loss_types)} loss_types but {len(weights)} loss_weights")
    c_logps, c_len, r_logps, r_len = (_f32(x) for x in sums[:4])
    have_ref = sums.ref_chosen_logps is not None and sums.ref_rejected_logps is not None
    B = c_logps.shape[0]
    n_pairs = _f32(B) if num_pairs is None else _f32(num_pairs)

    p = make_pair_inputs(
        c_logps, r_logps, sums.ref_chosen_logps, sums.ref_rejected_logps, beta=beta,
        label_smoothing=label_smoothing, chosen_lengths=c_len, rejected_lengths=r_len, gamma=gamma,
        discopop_tau=discopop_tau, f_divergence=f_divergence, f_alpha=f_alpha,
    )
    total = jnp.zeros((), jnp.float32)
    metrics: dict[str, jax.Array] = {}
    for name, w in zip(loss_types, weights):
        if name == "sft":  # sft_loss of the tokens, from their sums
            own = jnp.maximum(jnp.sum(c_len), 1.0)
            total = total + w * (-jnp.sum(c_logps) / (own if num_chosen_tokens is None else _f32(num_chosen_tokens)))
            metrics["loss/sft"] = -jnp.sum(c_logps) / own
            continue
        spec = loss_spec(name)
        _check_args(name, spec, label_smoothing, f_divergence, have_ref)
        q = p
        if spec.reference_free and have_ref:
            # simpo mixed with reference-based losses: it must not see the reference.
            q = make_pair_inputs(
                c_logps, r_logps, beta=beta, label_smoothing=label_smoothing, chosen_lengths=c_len,
                rejected_lengths=r_len, gamma=gamma, discopop_tau=discopop_tau,
            )
        per_pair = _per_pair(name, q)
        total = total + w * jnp.sum(per_pair) / n_pairs
        metrics[f"loss/{name}"] = jnp.mean(per_pair)

    rc, rr = p.ref_chosen_logps, p.ref_rejected_logps
    metrics.update(
        loss=total,
        chosen_rewards=jnp.mean(chosen_rewards(c_logps, rc, beta)),
        rejected_rewards=jnp.mean(rejected_rewards(r_logps, rr, beta)),
        reward_margin=jnp.mean(reward_margin(c_logps, r_logps, rc, rr, beta)),
        preference_accuracy=jnp.mean(preference_accuracy(c_logps, r_logps, rc, rr, beta)),
        **{"logps/chosen": jnp.mean(c_logps), "logps/rejected": jnp.mean(r_logps)},
    )
    return total, metrics
