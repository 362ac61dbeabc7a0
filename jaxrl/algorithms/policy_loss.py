"""Policy losses of the online algorithms (GRPO, PPO): one registry of per-token loss terms, as verl's
`register_policy_loss`, that an aggregation (`grpo.token_weights`: sequence_mean, token_mean, dr_grpo) reduces.

    @POLICY_LOSSES.register("ppo_clip", info=ClipOptions)
    def ppo_clip(x: PolicyLossInputs, o: ClipOptions) -> PolicyLossTerms: ...

A loss is a pure, jit-able function of the micro-batch's per-token log-probs (`logp`, with gradient), the ratio's
denominator (`old_logp`: the behaviour policy's, or the proximal policy's under the decoupled off-policy loss), the
advantages, the loss mask, the behaviour weights (`weights`: the rollout correction's, or the decoupled loss's
proximal / behaviour ratio; None when there are none) and its own options. It returns the per-token loss ([b, T],
or [b, 1] for a per-sequence term, broadcast over the sequence's tokens) and per-token metrics (averaged over the
loss tokens by the caller). Built-ins declare their options as a frozen dataclass (`info`), filled from the
algorithm block's clip keys (`common_options`: epsilon_low / epsilon_high, delta, dual_clip, log_ratio_clamp,
importance_sampling_level) and its `policy_loss_options`; a plug-in (kind `policy_loss`,
jaxrl.algorithms.plugins) receives those as a plain dict.

==============  ======================================================================  =============================
name            per-token loss (r = exp(clamp(logp - old_logp)), A the advantage)        peer (verl core_algos.py)
==============  ======================================================================  =============================
``ppo_clip``    ``-min(r A, clip(r, 1-el, 1+eh) A)``; `delta` caps r (INTELLECT-2),     ``vanilla``
                `dual_clip` caps the loss of A < 0 at -A c; `importance_sampling_level`
                = sequence uses the sequence's geometric-mean ratio (GSPO)
``gspo``        ``ppo_clip`` with the sequence's ratio on each token, the gradient       ``gspo``
                reaching each token alone (GSPO-token)
``cispo``       ``-sg(clip(r, 1-el, 1+eh)) A logp``: the clipped ratio weights a         ``cispo``
                REINFORCE term, so no token's gradient is ever dropped (MiniMax-M1)
``sapo``        ``-A (4/tau) sigmoid(tau (r - 1))``, tau = tau_pos (A > 0) / tau_neg:    ``sapo``
                a smooth gate instead of a hard clip (Qwen's SAPO)
``gmpo``        per sequence ``-mean_t(A) exp(mean_t(clip_sgn(log r)))``: the           ``geo_mean``
                geometric mean of the token ratios, each log-ratio clipped to
                [-el, eh] on the side that the advantage's sign makes binding (GMPO)
``kl_cov``      ``-r A``, plus ``kl_cov_coef |log r|`` on the top ``kl_cov_ratio`` of    ``kl_cov``
                tokens by cov(A, logp) (Cui et al., "The entropy mechanism of RL")
``clip_cov``    ``max(-r A, -clip(r) A)``, detached (loss 0) on a random                 ``clip_cov``
                ``clip_cov_ratio`` of the tokens whose cov(A, logp) lies in
                (clip_cov_lb, clip_cov_ub) and that the clip left free
==============  ======================================================================  =============================

Behaviour weights multiply the per-token loss of every built-in (verl: `pg_losses * rollout_is_weights`), except
``gmpo``, whose per-sequence term takes their per-sequence geometric mean (verl's geo_mean does the same): so each
composes with the rollout correction and with the decoupled off-policy loss. The log-ratio is clamped to
+-log_ratio_clamp before every exp, so every loss is finite at any ratio (verl clamps vanilla, sapo and cispo at 20
and gspo above at 10, and leaves geo_mean, kl_cov and clip_cov unclamped, where an extreme ratio gives inf).
``kl_cov`` and ``clip_cov`` pick their tokens within each micro-batch, as verl does: they are the only losses whose
value depends on how the global batch is split. Aggregation is the block's (`aggregation`): verl aggregates gspo and
sapo as seq-mean-token-mean (`sequence_mean`) and geo_mean as a mean over sequences (`sequence_mean` too, as the
term is constant over a sequence's tokens); other aggregations weight the sequences otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxrl.algorithms.grpo_config import IMPORTANCE_SAMPLING_LEVELS
from jaxrl.utils.registry import Registry

__all__ = ["COMMON_KEYS", "ClipCovOptions", "ClipOptions", "KLCovOptions", "POLICY_LOSSES", "PolicyLossInputs",
           "PolicyLossTerms", "RatioClipOptions", "SAPOOptions", "clamp_log_ratio", "clip_fraction",
           "clipped_surrogate", "importance_log_weights", "masked_mean", "masked_var", "masked_whiten",
           "policy_loss_terms", "resolve_options", "token_log_ratio"]


def _f32(x):
    return jnp.asarray(x, jnp.float32)


# ------------------------------------------------------------------------------------------------- masked statistics


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """``sum(x * mask) / max(sum(mask), 1)`` (masked entries never leak, even NaN)."""
    m = jnp.asarray(mask) > 0
    return jnp.sum(jnp.where(m, _f32(x), 0.0), axis=axis) / jnp.maximum(jnp.sum(m, axis=axis), 1)


def masked_var(x: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Variance of the masked entries (all axes), Bessel-corrected by default (TRL ``masked_var``)."""
    mean = masked_mean(x, mask)
    var = masked_mean((_f32(x) - mean) ** 2, mask)
    if unbiased:
        n = jnp.sum(jnp.asarray(mask) > 0).astype(jnp.float32)
        var = var * n / jnp.maximum(n - 1.0, 1.0)
    return var


def masked_whiten(x: jax.Array, mask: jax.Array, shift_mean: bool = True, eps: float = 1e-8) -> jax.Array:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries; with ``shift_mean=False`` the mean is added back
    (only the scale changes; TRL's choice for rewards). Masked positions are 0 in the output."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (_f32(x) - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(jnp.asarray(mask) > 0, out, 0.0)


# ------------------------------------------------------------------------------------------------- primitives


def token_log_ratio(logp: jax.Array, old_logp: jax.Array) -> jax.Array:
    """``log pi_theta - log pi_old`` per token, ``[B, T]`` float32."""
    return _f32(logp) - _f32(old_logp)


def importance_log_weights(logp: jax.Array, old_logp: jax.Array, mask: jax.Array, level: str = "token"):
    """Log importance weights: ``[B, T]`` (token) or ``[B, 1]`` (sequence, GSPO: the masked mean of the token
    log-ratios, so the sequence ratio is the geometric mean of the token ratios)."""
    lr = token_log_ratio(logp, old_logp)
    if level == "token":
        return lr
    if level == "sequence":
        return masked_mean(lr, mask, axis=-1)[:, None]
    raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}; got {level!r}")


def clamp_log_ratio(log_ratio: jax.Array, bound: float | None) -> jax.Array:
    """``clip(log_ratio, -bound, bound)`` in float32 (``bound`` None: unchanged). Inside the window the value and
    its gradient are the input's bit for bit; outside, the gradient is 0 (verl clamps to +-20 before ``exp``)."""
    lr = _f32(log_ratio)
    return lr if bound is None else jnp.clip(lr, -bound, bound)


def _per_token(advantages: jax.Array) -> jax.Array:
    a = _f32(advantages)
    return a[:, None] if a.ndim == 1 else a


def clipped_surrogate(
    log_ratio: jax.Array,
    advantages: jax.Array,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
) -> jax.Array:
    """PPO/GRPO clipped policy loss per token: ``-min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)``.

    ``log_ratio`` ``[B, T]`` or ``[B, 1]``; ``advantages`` ``[B]`` or ``[B, T]``; returns the broadcast shape
    (unmasked; aggregation applies the mask). ``delta`` (INTELLECT-2): the unclipped ratio is also capped at
    delta, bounding the loss for negative advantages. ``dual_clip`` (verl ``clip_ratio_c``, > 1): for A < 0 the
    loss is capped at ``-A * dual_clip``. ``log_ratio_clamp`` (verl: 20): the log-ratio is clamped to +-clamp
    before ``exp``, so a token whose probability grew by e^100 gives a finite loss and gradient instead of
    ``exp(100) = inf`` in float32 (with A < 0 the loss -rho A would be +inf); :func:`clamp_log_ratio`.
    """
    eh = epsilon_low if epsilon_high is None else epsilon_high
    a = _per_token(advantages)
    rho = jnp.exp(clamp_log_ratio(log_ratio, log_ratio_clamp))
    rho_clipped = jnp.clip(rho, 1.0 - epsilon_low, 1.0 + eh)
    if delta is not None:
        rho = jnp.minimum(rho, delta)
    loss = -jnp.minimum(rho * a, rho_clipped * a)
    if dual_clip is not None:
        loss = jnp.where(a < 0, jnp.minimum(loss, -a * dual_clip), loss)
    return loss


def clip_fraction(
    log_ratio: jax.Array, advantages: jax.Array, epsilon_low: float = 0.2, epsilon_high: float | None = None
) -> dict[str, jax.Array]:
    """Per-token 0/1 float indicators where the clip binds: ``low`` (rho < 1-eps_low and A < 0), ``high``
    (rho > 1+eps_high and A > 0) and ``region`` (either). Average them with a mask (``masked_mean``)."""
    eh = epsilon_low if epsilon_high is None else epsilon_high
    a = _per_token(advantages)
    rho = jnp.exp(_f32(log_ratio))
    low = (rho < 1.0 - epsilon_low) & (a < 0)
    high = (rho > 1.0 + eh) & (a > 0)
    f = lambda x: x.astype(jnp.float32)  # noqa: E731
    return {"low": f(low), "high": f(high), "region": f(low | high)}


# ------------------------------------------------------------------------------------------------- the interface


class PolicyLossInputs(NamedTuple):
    """What a policy loss reads, per micro-batch (module docstring). `rng`: a key unique to (step, micro-batch),
    for losses that draw (clip_cov)."""

    logp: jax.Array  # [b, T] float32, with gradient
    old_logp: jax.Array  # [b, T]: the ratio's denominator (stop_gradient(logp) on-policy)
    advantages: jax.Array  # [b] or [b, T]
    mask: jax.Array  # [b, T], 1 on loss tokens
    weights: Optional[jax.Array]  # [b, T] behaviour weights, or None
    rng: Optional[jax.Array] = None


class PolicyLossTerms(NamedTuple):
    """A loss's output: `loss` [b, T] (or [b, 1]) per token before aggregation, behaviour weights applied;
    `metrics` {name: [b, T] or [b, 1]} per-token values, averaged over the loss tokens by the caller."""

    loss: jax.Array
    metrics: dict


# The clip keys of the algorithm blocks, passed to every loss (a built-in takes the ones its options declare).
COMMON_KEYS = ("epsilon_low", "epsilon_high", "delta", "dual_clip", "log_ratio_clamp", "importance_sampling_level")


@dataclasses.dataclass(frozen=True)
class RatioClipOptions:
    """The clip window of the ratio and the log-ratio clamp before exp (the block's keys)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    log_ratio_clamp: Optional[float] = 20.0  # None: off


@dataclasses.dataclass(frozen=True)
class ClipOptions(RatioClipOptions):
    """ppo_clip's and gspo's: the window, the caps (None: off) and the ratio's level."""

    delta: Optional[float] = None
    dual_clip: Optional[float] = None
    importance_sampling_level: str = "token"


@dataclasses.dataclass(frozen=True)
class SAPOOptions(RatioClipOptions):
    """The gate's temperatures for tokens of positive and negative advantage (verl's actor defaults; the negative
    one steeper, so a negative update fades sooner)."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self):
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            raise ValueError(f"sapo: tau_pos={self.tau_pos} and tau_neg={self.tau_neg} must be > 0")


@dataclasses.dataclass(frozen=True)
class KLCovOptions(RatioClipOptions):
    """The share of a micro-batch's loss tokens that get the |log r| penalty, and its coefficient (verl's actor
    defaults: 0.0002, 0.1; at least one token is picked)."""

    kl_cov_ratio: float = 0.0002
    kl_cov_coef: float = 0.1

    def __post_init__(self):
        if not 0.0 < self.kl_cov_ratio <= 1.0:
            raise ValueError(f"kl_cov: kl_cov_ratio={self.kl_cov_ratio} must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class ClipCovOptions(RatioClipOptions):
    """The share of a micro-batch's loss tokens detached, and the covariance window they are drawn from (verl's
    defaults: 0.0002, (1, 5); at least one token when any qualifies)."""

    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0

    def __post_init__(self):
        if not 0.0 < self.clip_cov_ratio <= 1.0:
            raise ValueError(f"clip_cov: clip_cov_ratio={self.clip_cov_ratio} must be in (0, 1]")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"clip_cov: clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub="
                             f"{self.clip_cov_ub}")


POLICY_LOSSES = Registry("policy_loss", hint="A loss of your own: a `plugins` entry of kind policy_loss "
                                              "(jaxrl.algorithms.plugins)")


def _weighted(loss: jax.Array, weights: Optional[jax.Array]) -> jax.Array:
    return loss if weights is None else loss * _f32(weights)


def _ratio(x: PolicyLossInputs, o: RatioClipOptions) -> tuple[jax.Array, jax.Array]:
    """(clamped token log-ratio, ratio) ``[b, T]``."""
    lr = clamp_log_ratio(token_log_ratio(x.logp, x.old_logp), o.log_ratio_clamp)
    return lr, jnp.exp(lr)


def _clip_terms(x: PolicyLossInputs, o: ClipOptions, log_w: jax.Array) -> PolicyLossTerms:
    pg = clipped_surrogate(log_w, x.advantages, o.epsilon_low, o.epsilon_high, o.delta, o.dual_clip,
                           log_ratio_clamp=o.log_ratio_clamp)
    pg = _weighted(pg, x.weights)
    sg = jax.lax.stop_gradient
    metrics = {"ratio": sg(jnp.exp(clamp_log_ratio(log_w, o.log_ratio_clamp)))}
    clips = clip_fraction(sg(log_w), x.advantages, o.epsilon_low, o.epsilon_high)
    metrics.update({f"clip_fraction/{k}": v for k, v in clips.items()})
    return PolicyLossTerms(pg, metrics)


@POLICY_LOSSES.register("ppo_clip", info=ClipOptions)
def ppo_clip(x: PolicyLossInputs, o: ClipOptions) -> PolicyLossTerms:
    """PPO's clipped surrogate with clip-higher, `delta`, `dual_clip` and the ratio's level (module table). At the
    sequence level the ratio is one [b, 1] term (TRL's GSPO), so behaviour weights reach the gradient summed over
    the sequence; `gspo` keeps each token's own."""
    return _clip_terms(x, o, importance_log_weights(x.logp, x.old_logp, x.mask, o.importance_sampling_level))


@POLICY_LOSSES.register("gspo", info=ClipOptions)
def gspo(x: PolicyLossInputs, o: ClipOptions) -> PolicyLossTerms:
    """GSPO-token (Zheng et al. 2025; verl's gspo): the clipped surrogate of ``s_i,t = sg(s_i) pi_t / sg(pi_t)``,
    whose value is the sequence's ratio s_i (the geometric mean of its token ratios) and whose gradient reaches
    token t alone, as s_i / |y_i| after the sequence mean. Equal to ppo_clip at the sequence level, up to rounding,
    unless behaviour weights differ along a sequence: here each token's gradient takes its own weight."""
    logp = _f32(x.logp)
    seq = importance_log_weights(logp, x.old_logp, x.mask, "sequence")
    return _clip_terms(x, o, logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(seq))


@POLICY_LOSSES.register("cispo", info=RatioClipOptions)
def cispo(x: PolicyLossInputs, o: RatioClipOptions) -> PolicyLossTerms:
    """CISPO (MiniMax-M1, 2025): ``-sg(clip(r, 1-el, 1+eh)) A logp``. The loss's value is a REINFORCE term's
    (log-probs, not ratios): compare CISPO runs' `policy_loss` only with each other."""
    lr, r = _ratio(x, o)
    clipped = jnp.clip(r, 1.0 - o.epsilon_low, 1.0 + o.epsilon_high)
    pg = _weighted(-jax.lax.stop_gradient(clipped) * _per_token(x.advantages) * _f32(x.logp), x.weights)
    sg = jax.lax.stop_gradient
    return PolicyLossTerms(pg, {"ratio": sg(r), "clip_fraction/region": sg((r != clipped).astype(jnp.float32))})


@POLICY_LOSSES.register("sapo", info=SAPOOptions)
def sapo(x: PolicyLossInputs, o: SAPOOptions) -> PolicyLossTerms:
    """SAPO (Gao et al. 2025): a sigmoid gate of the ratio, ``(4/tau) sigmoid(tau (r - 1))``, whose slope at r = 1
    is 1 (an on-policy step is plain policy gradient) and fades smoothly away from it."""
    a = _per_token(x.advantages)
    _, r = _ratio(x, o)
    tau = jnp.where(a > 0, o.tau_pos, o.tau_neg)
    gate = jax.nn.sigmoid(tau * (r - 1.0)) * (4.0 / tau)
    return PolicyLossTerms(_weighted(-gate * a, x.weights), {"ratio": jax.lax.stop_gradient(r)})


@POLICY_LOSSES.register("gmpo", info=RatioClipOptions)
def gmpo(x: PolicyLossInputs, o: RatioClipOptions) -> PolicyLossTerms:
    """GMPO (Zhao et al. 2025; verl's geo_mean): per sequence ``-mean_t(A) exp(mean_t(l_t))`` where l_t is the
    log-ratio clipped to [-el, eh] only where that binds for the advantage's sign (the larger update for A > 0 and
    for A < 0 alike). `epsilon_low` / `epsilon_high` bound the LOG-ratio here (GMPO's recipe: 0.4). A per-sequence
    term [b, 1]; the behaviour weights enter as their per-sequence geometric mean."""
    m = (jnp.asarray(x.mask) > 0).astype(jnp.float32)
    a = jnp.broadcast_to(_per_token(x.advantages), m.shape)
    lr, _ = _ratio(x, o)
    sgn = jnp.sign(a)
    lr_clip = jnp.clip(lr, -o.epsilon_low, o.epsilon_high)
    lr_min = sgn * jnp.minimum(sgn * lr, sgn * lr_clip)
    n = jnp.sum(m, axis=-1, keepdims=True) + 1e-8
    ratio = jnp.exp(jnp.sum(lr_min * m, axis=-1, keepdims=True) / n)
    adv = jnp.sum(a * m, axis=-1, keepdims=True) / n
    pg = -adv * ratio
    if x.weights is not None:
        pg = pg * jnp.exp(jnp.sum(jnp.log(_f32(x.weights) + 1e-10) * m, axis=-1, keepdims=True) / n)
    sg = jax.lax.stop_gradient
    clipped = (lr != lr_clip).astype(jnp.float32)
    return PolicyLossTerms(pg, {"ratio": sg(ratio), "clip_fraction/high": sg(clipped * (a > 0)),
                                "clip_fraction/low": sg(clipped * (a < 0))})


def _covariance(x: PolicyLossInputs) -> tuple[jax.Array, jax.Array]:
    """(cov(A, logp) per token over the micro-batch's loss tokens, the loss-token mask as bool)."""
    valid = jnp.asarray(x.mask) > 0
    logp = jax.lax.stop_gradient(_f32(x.logp))
    a = jnp.broadcast_to(_per_token(x.advantages), logp.shape)
    return (a - masked_mean(a, valid)) * (logp - masked_mean(logp, valid)), valid


def _first_k(priority: jax.Array, eligible: jax.Array, k: jax.Array) -> jax.Array:
    """Bool mask of the (at most) `k` eligible entries of highest `priority` (ties: the earlier index)."""
    flat = jnp.where(eligible, priority, -jnp.inf).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size))
    return (rank < k).reshape(priority.shape) & eligible


@POLICY_LOSSES.register("kl_cov", info=KLCovOptions)
def kl_cov(x: PolicyLossInputs, o: KLCovOptions) -> PolicyLossTerms:
    """KL-Cov (Cui et al. 2025): ``-r A``, and ``+ kl_cov_coef |log r|`` on the max(1, floor(ratio n)) loss tokens
    of highest cov(A, logp) in the micro-batch: the tokens that drive entropy down are held near the old policy."""
    cov, valid = _covariance(x)
    k = jnp.maximum(1, jnp.floor(jnp.sum(valid) * o.kl_cov_ratio).astype(jnp.int32))
    picked = _first_k(cov, valid, k)
    lr, r = _ratio(x, o)
    a = _per_token(x.advantages)
    pg = -a * r + jnp.where(picked, o.kl_cov_coef * jnp.abs(lr), 0.0)
    sg = jax.lax.stop_gradient
    return PolicyLossTerms(_weighted(pg, x.weights), {"ratio": sg(r), "kl_cov/picked": picked.astype(jnp.float32)})


@POLICY_LOSSES.register("clip_cov", info=ClipCovOptions)
def clip_cov(x: PolicyLossInputs, o: ClipCovOptions) -> PolicyLossTerms:
    """Clip-Cov (Cui et al. 2025): the clipped surrogate, with max(1, floor(ratio n)) tokens drawn at random
    (`rng`) among the loss tokens the clip left free whose cov(A, logp) lies in (lb, ub) detached (loss 0)."""
    cov, valid = _covariance(x)
    lr, r = _ratio(x, o)
    a = _per_token(x.advantages)
    pg1 = -a * r
    pg2 = -a * jnp.clip(r, 1.0 - o.epsilon_low, 1.0 + o.epsilon_high)
    clipped_by_ppo = (pg2 > pg1) & valid
    eligible = valid & ~clipped_by_ppo & (cov > o.clip_cov_lb) & (cov < o.clip_cov_ub)
    k = jnp.maximum(1, jnp.floor(jnp.sum(valid) * o.clip_cov_ratio).astype(jnp.int32))
    rng = jax.random.PRNGKey(0) if x.rng is None else x.rng
    detached = _first_k(jax.random.uniform(rng, cov.shape), eligible, k)
    pg = jnp.where(detached, 0.0, jnp.maximum(pg1, pg2))
    sg = jax.lax.stop_gradient
    return PolicyLossTerms(_weighted(pg, x.weights), {
        "ratio": sg(r), "clip_fraction/region": clipped_by_ppo.astype(jnp.float32),
        "clip_cov/detached": detached.astype(jnp.float32)})


# ------------------------------------------------------------------------------------------------- options


def resolve_options(name: str, common: Mapping[str, Any], options: Mapping[str, Any], where: str) -> Any:
    """The options loss `name` is called with: a built-in's dataclass filled from the block's clip keys (`common`,
    the ones it declares) and `options` (`<where>.policy_loss_options`); a plug-in's dict of both. ValueError
    naming `<where>.policy_loss_options.<key>` for a key the loss does not take, a clip key set there, or a value
    its options refuse; KeyError (listing the losses) for an unknown name."""
    POLICY_LOSSES.get(name)
    options = dict(options or {})
    clash = sorted(set(options) & set(COMMON_KEYS))
    if clash:
        raise ValueError(f"{where}.policy_loss_options sets {clash}: set {', '.join(f'{where}.{k}' for k in clash)}"
                         f" instead (the block's clip keys reach every policy loss)")
    spec = POLICY_LOSSES.info(name)
    if spec is None:  # a plug-in: everything, as a dict
        return {**dict(common), **options}
    fields = {f.name for f in dataclasses.fields(spec)}
    own = sorted(fields - set(COMMON_KEYS))
    # a switch of another loss left on would be silently ignored: refused instead
    ignored = sorted(k for k, v in common.items() if k not in fields and v not in (None, "token"))
    if ignored:
        raise ValueError(f"{where}.policy_loss={name!r} does not read {', '.join(f'{where}.{k}' for k in ignored)} "
                         f"(ppo_clip's and gspo's): leave it off, or choose ppo_clip")
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"{where}.policy_loss_options: {name} takes no {', '.join(map(repr, unknown))}; its "
                         f"options: {', '.join(own) or 'none'}")
    for key, value in options.items():  # a built-in's own options are numbers: a string or NaN fails here, named
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where}.policy_loss_options.{key}={value!r}: {name}'s options are finite numbers")
    try:
        return spec(**{k: v for k, v in common.items() if k in fields}, **options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}.policy_loss_options: {e}") from None


def policy_loss_terms(name: str, x: PolicyLossInputs, options: Any) -> PolicyLossTerms:
    """Loss `name` on `x` with its resolved `options` (`resolve_options`); a plug-in's plain tuple is accepted."""
    fn: Callable = POLICY_LOSSES.get(name)
    out = fn(x, options)
    return out if isinstance(out, PolicyLossTerms) else PolicyLossTerms(*out)
