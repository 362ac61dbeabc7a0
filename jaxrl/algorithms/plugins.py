"""User plug-ins: a DPO loss, a policy loss, an advantage estimator, a KL estimator, a reward or an environment of
your own, checked on example inputs and then used by name from any config. There is one way in, reached from code or
from the config:

    from jaxrl.algorithms import plugins

    @plugins.register("dpo_loss", "margin_dpo")             # in code: checked now, then registered
    def margin_dpo(p):
        return -jax.nn.log_sigmoid(p.beta * p.delta - 0.5)

    plugins.load("kl", "my_kl.py:squared")                  # a "file.py:fn" or "package.module:fn"

    c.plugins = (                                           # the config: loaded by run_training first thing
        {"kind": "dpo_loss", "name": "margin_dpo", "path": "my_losses.py:margin_dpo"},
        "advantage:centered=my_pkg.estimators:centered",    # "kind:name=path:fn"
        "kl:my_kl.py:squared",                              # "kind:path:fn" (name = the function's name)
    )
    c.dpo.loss_type = "margin_dpo"    # or grpo.advantage_estimator=centered, grpo.kl_estimator=squared, reward.name,
                                      # grpo.environment, grpo.policy_loss (jaxrl.algorithms.policy_loss)

Each goes through `_admit`: the name must be free (or held by the same function: a file loaded again on
resume), the kind's check must pass, and only then is the function added to the kind's registry (KINDS), where
the built-ins already are. The checks (`KINDS[kind].check`) run the function on small, well-behaved example
inputs, eagerly, under jax.jit and, for losses and KL estimators, under jax.grad; a wrong signature, a wrong
output shape or dtype, NaN/inf or an exception raises PluginError naming the plug-in (and the config entry,
`plugins[i]`), the expected signature and what was wrong, before any model is loaded.

A DPO loss may declare what it reads, with the keywords of jaxrl.algorithms.dpo.LossSpec (`reference_free`,
`needs_lengths`, `across_pairs`, `label_smoothing`, `f_divergence`), as keyword arguments of `register` / `load`
or as keys of its config entry; undeclared ones take dpo.PLUGIN_SPEC's values.

`python -m jaxrl.algorithms.plugins CONFIG.json` loads a resolved config's plug-ins and checks the objective
names it uses on the CPU (what `launchers.sweep` runs before any point starts). The DPO block's older key
`dpo.plugin` ("file.py:fn,...") is read as entries of kind dpo_loss (`dpo_plugin_entries`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.algorithms import dpo, grpo, kl, policy_loss
from jaxrl.environments.base import Turn, as_environment, check_messages
from jaxrl.environments.limits import STEP_TIMEOUT_S, EnvironmentThread
from jaxrl.environments.registry import ENVIRONMENTS
from jaxrl.rewards.base import RewardResult
from jaxrl.rewards.registry import REWARDS, as_factory, example_problem
from jaxrl.utils.registry import PluginError, Registry, origin_of, resolve
from jaxrl.utils.typed_config import plain_mapping

__all__ = ["KINDS", "Kind", "PluginEntry", "PluginError", "REFERENCES", "absolute_paths", "check_references",
           "dpo_plugin_entries", "get", "load", "load_plugins", "names", "parse_plugins",
           "register", "unregister"]

# ------------------------------------------------------------------------------------------------ the checks


def _check_signature(label: str, fn: Callable, expected: str, n_args: int) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins / C functions: let the call decide
    try:
        sig.bind(*([None] * n_args))
    except TypeError as e:
        raise PluginError(f"{label}: wrong signature {sig}; expected {expected} ({e})") from None


def _call(label: str, expected: str, how: str, fn: Callable, *args):
    try:
        return fn(*args)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised naming the plug-in
        hint = ""
        if "jit" in how or "grad" in how:
            hint = (" Training runs it inside jax.jit and jax.grad: use jnp operations, no Python if/float() on "
                    "array values (jnp.where instead).")
        raise PluginError(f"{label}: raised {type(e).__name__} when called {how} on example inputs; expected "
                          f"{expected}.{hint} Error: {e}") from e


def _check_output(label: str, expected: str, how: str, out: Any, shape: tuple[int, ...]) -> None:
    try:
        arr = np.asarray(out)
    except Exception as e:  # noqa: BLE001
        raise PluginError(f"{label}: returned {type(out).__name__} {how}, not an array; expected {expected}") from e
    if arr.shape != tuple(shape):
        what = "a scalar" if arr.ndim == 0 else f"shape {arr.shape}"
        raise PluginError(f"{label}: returned {what} {how}; expected shape {tuple(shape)} from {expected}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise PluginError(f"{label}: returned dtype {arr.dtype} {how}; expected a floating array from {expected}")
    if not np.all(np.isfinite(arr)):
        bad = int(np.sum(~np.isfinite(arr)))
        raise PluginError(f"{label}: returned {bad} non-finite value(s) (NaN/inf) {how} on well-behaved example "
                          f"inputs: {arr}; expected {expected}")


def _run_checks(label: str, expected: str, fn: Callable, args: tuple, shape: tuple[int, ...],
                grad_argnums: Optional[tuple[int, ...]] = None) -> None:
    """`fn(*args)` eagerly and under jax.jit must give a finite float array of `shape`; with `grad_argnums`
    the gradient of its sum with respect to those arguments must be finite too."""
    out = _call(label, expected, "eagerly", fn, *args)
    _check_output(label, expected, "eagerly", out, shape)
    out_jit = _call(label, expected, "under jax.jit", jax.jit(lambda *a: fn(*a)), *args)
    _check_output(label, expected, "under jax.jit", out_jit, shape)
    if grad_argnums is not None:
        g = _call(label, expected, "under jax.grad", jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=grad_argnums),
                  *args)
        for leaf in jax.tree_util.tree_leaves(g):
            _check_output(label, expected, "as a gradient (jax.grad of its sum)", leaf, leaf.shape)


DPO_LOSS_SIGNATURE = "fn(p: jaxrl.algorithms.dpo.PairInputs) -> per-pair losses, float array of shape [B]"
ADVANTAGE_SIGNATURE = "fn(rewards: float array [N], num_generations: int) -> advantages, float array [N]"
KL_SIGNATURE = "fn(logp: float array [B, T], ref_logp: float array [B, T]) -> per-token KL, float array [B, T]"
ENVIRONMENT_SIGNATURE = ("a class (**environment_options) with reset(problem) -> messages and step(turn: "
                         "jaxrl.environments.base.Turn) -> (messages, reward: float, done: bool); messages: "
                         "[{'role': str, 'content': str}, ...]")
REWARD_SIGNATURE = ("fn(completion: str, problem: jaxrl.data.problems.Problem, **kwargs) -> bool | float in "
                    "[0, 1] | RewardResult, or a Reward class (with score(completions, problems, truncated))")


def _check_dpo_loss(label: str, fn: Callable, options: Mapping[str, bool]) -> None:
    """Three example pairs, as training builds them (no reference log-probs for a reference-free loss): eagerly,
    under jit, and differentiated through the policy log-probs."""
    _check_signature(label, fn, DPO_LOSS_SIGNATURE, 1)
    B = 3
    # Fixed, well-behaved example inputs (numpy: no jax.random compile on the start-up path).
    rng = np.random.default_rng(0)
    chosen, rejected, ref_chosen, ref_rejected = (
        jnp.asarray(-20.0 + 5.0 * rng.standard_normal(B), jnp.float32) for _ in range(4))
    refs = (None, None) if options.get("reference_free") else (ref_chosen, ref_rejected)
    lengths = jnp.array([3.0, 7.0, 12.0])

    def pairs(c, r):
        return dpo.make_pair_inputs(c, r, *refs, beta=0.1, label_smoothing=0.1, chosen_lengths=lengths,
                                    rejected_lengths=lengths + 2.0)

    _run_checks(label, DPO_LOSS_SIGNATURE, fn, (pairs(chosen, rejected),), (B,))
    _run_checks(label, DPO_LOSS_SIGNATURE, lambda c, r: fn(pairs(c, r)), (chosen, rejected), (B,),
                grad_argnums=(0, 1))


def _check_advantage(label: str, fn: Callable, options: Mapping[str, bool]) -> None:
    """Example rewards of 3 groups of 4, eagerly and under jit."""
    _check_signature(label, fn, ADVANTAGE_SIGNATURE, 2)
    G, n_groups = 4, 3
    rewards = jnp.array([0.0, 1.0, 0.5, 1.0, 0.2, 0.2, 0.9, 0.0, 1.0, 0.0, 0.0, 0.25], jnp.float32)
    _run_checks(label, ADVANTAGE_SIGNATURE, lambda r: fn(r, G), (rewards,), (G * n_groups,))


def _check_kl(label: str, fn: Callable, options: Mapping[str, bool]) -> None:
    """Example log-probs [2, 5]: eagerly, under jit and under grad (with respect to logp)."""
    _check_signature(label, fn, KL_SIGNATURE, 2)
    rng = np.random.default_rng(1)
    logp = -3.0 + rng.standard_normal((2, 5))
    ref = jnp.asarray(logp + 0.3 * rng.standard_normal((2, 5)), jnp.float32)
    _run_checks(label, KL_SIGNATURE, fn, (jnp.asarray(logp, jnp.float32), ref), (2, 5), grad_argnums=(0,))


POLICY_LOSS_SIGNATURE = ("fn(x: jaxrl.algorithms.policy_loss.PolicyLossInputs, options: dict) -> (per-token loss, "
                         "float array [b, T] or [b, 1], {metric name: per-token values [b, T] or [b, 1]})")


def _check_policy_loss(label: str, fn: Callable, options: Mapping[str, bool]) -> None:
    """A micro-batch of 3 rows of 5 tokens (one row half masked), off-policy with behaviour weights, the block's
    default clip keys as options: eagerly, under jit and differentiated through logp; the metrics too."""
    _check_signature(label, fn, POLICY_LOSS_SIGNATURE, 2)
    rng = np.random.default_rng(2)
    shape = (3, 5)
    logp = jnp.asarray(-2.0 + 0.5 * rng.standard_normal(shape), jnp.float32)
    old = jnp.asarray(np.asarray(logp) + 0.2 * rng.standard_normal(shape), jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], jnp.float32)
    weights = jnp.asarray(np.exp(0.1 * rng.standard_normal(shape)), jnp.float32)
    opts = {"epsilon_low": 0.2, "epsilon_high": 0.28, "delta": None, "dual_clip": None, "log_ratio_clamp": 20.0,
            "importance_sampling_level": "token"}

    def terms(lp, a):
        out = fn(policy_loss.PolicyLossInputs(lp, old, a, mask, weights, jax.random.PRNGKey(0)), opts)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
            raise PluginError(f"{label}: returned {type(out).__name__}; expected {POLICY_LOSS_SIGNATURE}")
        return out

    advantages = jnp.asarray([1.0, -0.5, 0.25], jnp.float32)
    loss, metrics = _call(label, POLICY_LOSS_SIGNATURE, "eagerly", terms, logp, advantages)
    rows = np.asarray(loss).shape
    if rows not in (shape, (shape[0], 1)):
        raise PluginError(f"{label}: returned a loss of shape {rows}; expected {shape} or {(shape[0], 1)} from "
                          f"{POLICY_LOSS_SIGNATURE}")
    for name, value in metrics.items():
        if np.asarray(value).shape not in (shape, (shape[0], 1)):
            raise PluginError(f"{label}: metric {name!r} has shape {np.asarray(value).shape}; expected per-token "
                              f"values {shape} or {(shape[0], 1)}")
    _run_checks(label, POLICY_LOSS_SIGNATURE, lambda lp, a: terms(lp, a)[0], (logp, advantages), rows,
                grad_argnums=(0,))
    for name in metrics:
        _run_checks(f"{label} metric {name!r}", POLICY_LOSS_SIGNATURE, lambda lp, a, n=name: terms(lp, a)[1][n],
                    (logp, advantages), np.asarray(metrics[name]).shape)


def _check_reward(label: str, target: Any, options: Mapping[str, bool]) -> None:
    """A Reward class must have `score`; a per-sample function must score two example completions of a toy
    problem with one number in [0, 1] each."""
    if isinstance(target, type):
        if not callable(getattr(target, "score", None)):
            raise PluginError(f"{label}: class {target.__name__} has no score(completions, problems, truncated); "
                              f"expected {REWARD_SIGNATURE}")
        return
    _check_signature(label, target, REWARD_SIGNATURE, 2)
    problem = example_problem()
    for completion in ("", "```python\nprint(input())\n```"):
        try:
            value = target(completion, problem)
        except Exception as e:  # noqa: BLE001 - re-raised naming the plug-in
            raise PluginError(f"{label}: raised {type(e).__name__} on the example completion {completion!r} of toy "
                              f"problem {problem.id!r}; expected {REWARD_SIGNATURE}. Error: {e}") from e
        if isinstance(value, RewardResult):
            value = value.partial
        if isinstance(value, bool):
            continue
        if getattr(value, "ndim", 0) != 0 or isinstance(value, (list, tuple, dict, str)):
            raise PluginError(f"{label}: returned {type(value).__name__} {value!r}, not one number; expected "
                              f"{REWARD_SIGNATURE}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise PluginError(f"{label}: returned {type(value).__name__} {value!r}; expected "
                              f"{REWARD_SIGNATURE}") from None
        if not 0.0 <= number <= 1.0:  # also false for NaN
            raise PluginError(f"{label}: returned {number!r} on the example completion {completion!r}; rewards "
                              f"are in [0, 1]: {REWARD_SIGNATURE}")


def _check_environment(label: str, target: Any, options: Mapping[str, bool]) -> None:
    """A class; unless its constructor needs arguments (a run's `environment_options`: `check_environment` then
    runs the example episode with them, before the model loads), one example episode without options."""
    if not isinstance(target, type):
        raise PluginError(f"{label}: {target!r} is not a class; expected {ENVIRONMENT_SIGNATURE}")
    required = [p.name for p in inspect.signature(target).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not required:
        check_environment(label, target, {})


def check_environment(label: str, target: Any, environment_options: Mapping[str, Any]) -> None:
    """One episode of the toy problem: constructed with `environment_options`, reset, then one last turn stepped;
    the messages must be role/content dicts, the reward one finite number, done a bool (PluginError naming
    `label` otherwise). The calls run as a run's do (jaxrl.environments.limits): a plug-in that hangs is refused
    after the default step limit, and a Ctrl-C stops the check at once."""
    problem = example_problem()
    turn = Turn("```python\nprint(input())\n```", (1, 2, 3), "stop", index=0, last=True)
    calls = EnvironmentThread(label, STEP_TIMEOUT_S)
    try:
        env = calls.call("construction", lambda: target(**environment_options))
        check_messages(calls.call("reset", env.reset, problem), "reset")
        out = calls.call("step 0", env.step, turn)
    except Exception as e:  # noqa: BLE001 - re-raised naming the plug-in
        raise PluginError(f"{label}: raised {type(e).__name__} on an example episode of toy problem "
                          f"{problem.id!r}; expected {ENVIRONMENT_SIGNATURE}. Error: {e}") from e
    if not (isinstance(out, tuple) and len(out) == 3):
        raise PluginError(f"{label}: step returned {out!r}; expected {ENVIRONMENT_SIGNATURE}")
    messages, reward, done = out
    try:
        check_messages(messages, "step")
    except ValueError as e:
        raise PluginError(f"{label}: {e}; expected {ENVIRONMENT_SIGNATURE}") from None
    if isinstance(reward, bool) or not isinstance(reward, (int, float, np.floating, np.integer)) or \
            not np.isfinite(float(reward)):
        raise PluginError(f"{label}: step returned reward {reward!r}; expected one finite number")
    if not isinstance(done, (bool, np.bool_)):
        raise PluginError(f"{label}: step returned done={done!r}; expected True or False")
    calls.close()


# ------------------------------------------------------------------------------------------------ the kinds


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of plug-in: where its entries live, what a function of it must be, and how that is checked."""

    registry: Registry  # its built-ins and plug-ins, by name
    signature: str
    check: Callable[[str, Any, Mapping[str, bool]], None]  # (label, fn, options): PluginError when unfit
    used_by: tuple[str, ...]  # the config keys that name an entry of this kind
    options: tuple[str, ...] = ()  # keywords a registration may carry (True / False)


KINDS: dict[str, Kind] = {
    "dpo_loss": Kind(dpo.LOSSES, DPO_LOSS_SIGNATURE, _check_dpo_loss, ("dpo.loss_type",), dpo.LossSpec._fields),
    "advantage": Kind(grpo.ADVANTAGES, ADVANTAGE_SIGNATURE, _check_advantage, ("grpo.advantage_estimator",)),
    "kl": Kind(kl.KL_ESTIMATORS, KL_SIGNATURE, _check_kl, ("grpo.kl_estimator", "ppo.kl_estimator")),
    "policy_loss": Kind(policy_loss.POLICY_LOSSES, POLICY_LOSS_SIGNATURE, _check_policy_loss,
                        ("grpo.policy_loss", "ppo.policy_loss")),
    "reward": Kind(REWARDS, REWARD_SIGNATURE, _check_reward, ("reward.name",)),
    "environment": Kind(ENVIRONMENTS, ENVIRONMENT_SIGNATURE, _check_environment,
                        ("grpo.environment", "ppo.environment")),
}

# (config key, kind) of every key that names a registered objective; "sft" is the DPO trainer's own term and a
# reward.name "module:attr" is imported on use.
REFERENCES = tuple((key, kind) for kind, k in KINDS.items() for key in k.used_by)


def _kind(kind: str) -> Kind:
    if kind not in KINDS:
        raise PluginError(f"unknown plug-in kind {kind!r}; kinds: {', '.join(KINDS)}")
    return KINDS[kind]


def _admit(kind: str, name: str, obj: Any, label: str, options: Mapping[str, Any]) -> None:
    """The one way in (module docstring): name free or held by this same function, options known, the kind's
    check passed; then added to the kind's registry (a reward as a factory, a DPO loss with its LossSpec)."""
    k = _kind(kind)
    if not isinstance(name, str) or not name.strip() or any(c in name for c in ",: \t"):
        raise PluginError(f"{label}: {name!r} is not a usable name (non-empty, without ',', ':' or spaces)")
    unknown = sorted(set(options) - set(k.options))
    if unknown:
        raise PluginError(f"{label}: unknown option(s) {unknown}; a {kind} plug-in takes "
                          f"{', '.join(k.options) if k.options else 'none'}")
    not_bool = sorted(key for key, value in options.items() if not isinstance(value, bool))
    if not_bool:
        raise PluginError(f"{label}: option(s) {not_bool} must be True or False")
    origin = origin_of(obj)
    have = k.registry.origin(name)
    if have is not None and have != origin:
        raise PluginError(f"{label}: the name {name!r} is already taken by {have}; choose another name")
    k.check(label, obj, options)
    # a reward as a factory; an environment with the protocol's attributes at their defaults (`as_environment`)
    entry = as_factory(obj) if kind == "reward" else as_environment(obj) if kind == "environment" else obj
    info = dpo.PLUGIN_SPEC._replace(**options) if kind == "dpo_loss" else None
    k.registry.add(name, entry, origin=origin, info=info)


def register(kind: str, name: Optional[str] = None, **options: bool) -> Callable:
    """Decorator: check ``fn`` on the kind's example inputs, then register it as `name` (default: its own
    name); returns ``fn`` unchanged. A DPO loss may carry LossSpec keywords (module docstring)."""
    _kind(kind)

    def deco(fn):
        label_name = name or getattr(fn, "__name__", "")
        _admit(kind, label_name, fn, f"{kind} plug-in {label_name!r} ({origin_of(fn)})", options)
        return fn

    return deco


def load(kind: str, spec: str, name: Optional[str] = None, **options: bool) -> Any:
    """Import ``spec`` ("path/to/file.py:fn" or "package.module:fn"), check it and register it as `name`
    (default: the function's name), like `register`; returns the function."""
    _kind(kind)
    obj = resolve(spec)
    name = name or getattr(obj, "__name__", "")
    _admit(kind, name, obj, f"{kind} plug-in {name!r} ({spec})", options)
    return obj


def get(kind: str, name: str) -> Callable:
    """The entry registered as `name` (a reward: its factory ``(**kwargs) -> Reward``); KeyError listing the
    names otherwise."""
    return _kind(kind).registry.get(name)


def names(kind: str) -> tuple[str, ...]:
    """Every name of the kind: built-ins and plug-ins."""
    return _kind(kind).registry.names()


def unregister(kind: str, name: str) -> None:
    """Remove `name` (no error if absent); for tests and interactive sessions."""
    _kind(kind).registry.unregister(name)


# ------------------------------------------------------------------------------------------------ the config


@dataclasses.dataclass(frozen=True)
class PluginEntry:
    """One entry of a config's `plugins` section."""

    kind: str
    name: str  # "" = the function's own name
    path: str  # "file.py:fn" or "package.module:fn"
    options: Mapping[str, bool] = dataclasses.field(default_factory=dict)  # a DPO loss's LossSpec keywords
    where: str = "plugins"  # for errors: which config entry this is

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "path": self.path, **self.options}


def _parse_string(text: str, where: str) -> PluginEntry:
    """'kind:name=path:fn' or 'kind:path:fn'."""
    kind, sep, rest = text.partition(":")
    if not sep or not rest:
        raise PluginError(f"{where}={text!r}: expected 'kind:name=path/to/file.py:function' (kinds: "
                          f"{', '.join(KINDS)})")
    name, eq, path = rest.partition("=")
    if not eq:
        name, path = "", rest
    return PluginEntry(kind.strip(), name.strip(), path.strip(), where=where)


def _parse_dict(item: dict, where: str) -> PluginEntry:
    """{"kind", "path", optionally "name" and the kind's options}."""
    kind = str(item.get("kind", ""))
    allowed = {"kind", "name", "path"} | set(KINDS[kind].options if kind in KINDS else ())
    unknown = sorted(set(item) - allowed)
    if unknown or "kind" not in item or "path" not in item:
        raise PluginError(f"{where}={item!r}: expected keys 'kind', 'path' and optionally 'name'"
                          + (f" and {', '.join(repr(o) for o in KINDS[kind].options)}"
                             if kind in KINDS and KINDS[kind].options else "")
                          + (f"; unknown keys {unknown}" if unknown else ""))
    options = {key: item[key] for key in item if key not in ("kind", "name", "path")}
    return PluginEntry(kind, str(item.get("name") or ""), str(item["path"]), options, where)


def parse_plugins(value: Any, where: str = "plugins") -> list[PluginEntry]:
    """The entries of a `plugins` section: a list/tuple of dicts {"kind", "name", "path"} or strings; a single
    string may hold several entries separated by ';'. Raises PluginError naming the entry."""
    if value is None or value == "" or value == ():
        return []
    value = plain_mapping(value)
    if isinstance(value, str):
        value = [s for s in (p.strip() for p in value.split(";")) if s]
    if isinstance(value, dict):
        value = [value]
    out = []
    for i, item in enumerate(value):
        w = f"{where}[{i}]"
        item = plain_mapping(item)
        if isinstance(item, str):
            entry = _parse_string(item, w)
        elif isinstance(item, dict):
            entry = _parse_dict(item, w)
        else:
            raise PluginError(f"{w}: expected a dict {{'kind', 'name', 'path'}} or a 'kind:name=path:fn' string, "
                              f"got {type(item).__name__}")
        if entry.kind not in KINDS:
            raise PluginError(f"{w}: unknown plug-in kind {entry.kind!r}; kinds: {', '.join(KINDS)}")
        if ":" not in entry.path:
            raise PluginError(f"{w}: path {entry.path!r} must be 'path/to/file.py:function' or "
                              "'package.module:function'")
        out.append(entry)
    return out


def dpo_plugin_entries(value: Any, where: str = "dpo.plugin") -> list[PluginEntry]:
    """The DPO block's older key, "my_losses.py:fn[,other.py:fn2]", as `plugins` entries: DPO losses registered
    under their function names (``[e.to_dict() for e in ...]`` gives the `plugins` section's dicts)."""
    specs = [s.strip() for s in str(value or "").split(",") if s.strip()]
    return [PluginEntry("dpo_loss", "", spec, where=where) for spec in specs]


def absolute_paths(value: Any, base_dir: str) -> list[dict]:
    """The section with file paths made absolute (relative ones taken from `base_dir`), as dicts: a resolved
    config then loads the same files from any working directory (sweep points, cluster jobs)."""
    out = []
    for e in parse_plugins(value):
        target, _, attr = e.path.rpartition(":")
        if target.endswith(".py") or "/" in target or os.sep in target:
            target = os.path.abspath(os.path.join(base_dir, os.path.expanduser(target)))
        out.append(dataclasses.replace(e, path=f"{target}:{attr}").to_dict())
    return out


def load_plugins(entries: list[PluginEntry]) -> list[dict]:
    """Load, check and register every entry; returns the entries as dicts, with the names they got."""
    loaded = []
    for e in entries:
        try:
            obj = load(e.kind, e.path, e.name or None, **e.options)
        except PluginError as err:
            raise PluginError(f"{e.where}: {err}") from err
        loaded.append(dataclasses.replace(e, name=e.name or obj.__name__).to_dict())
    return loaded


def _config_entries(cfg: Mapping) -> list[PluginEntry]:
    """What a resolved config (a dict, as in config.json) asks for: its `plugins` section, then the older
    `dpo.plugin` key of files written before it became an alias of `plugins`."""
    dpo_block = cfg.get("dpo") if isinstance(cfg.get("dpo"), dict) else {}
    return parse_plugins(cfg.get("plugins")) + dpo_plugin_entries(dpo_block.get("plugin"))


def check_references(cfg: Mapping) -> list[dict]:
    """Load the plug-ins of a resolved config (a dict: `plugins`, and `dpo.plugin` of older config.json files),
    then check that every objective it names (REFERENCES) exists, so a typo fails before any model is loaded.
    Returns what was loaded; PluginError naming the entry or the key otherwise."""
    loaded = load_plugins(_config_entries(cfg))
    for key, kind in REFERENCES:
        block, leaf = key.split(".")
        value = (cfg.get(block) or {}).get(leaf) if isinstance(cfg.get(block), dict) else None
        if value in (None, ""):
            continue
        wanted = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if str(n).strip()]
        known = set(names(kind))
        if kind == "reward":
            missing = [n for n in wanted if ":" not in n and n not in known]
        else:
            missing = [n for n in wanted if n not in known and not (kind == "dpo_loss" and n == "sft")]
        if missing:
            raise PluginError(f"{key}={value!r}: no {kind} named {', '.join(repr(m) for m in missing)}; known: "
                              f"{', '.join(sorted(known))}. A function of your own: add it to `plugins` "
                              f"({{'kind': {kind!r}, 'name': ..., 'path': 'file.py:fn'}})")
    return loaded


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m jaxrl.algorithms.plugins CONFIG.json [...]`: load the plug-ins of resolved configs and check the
    objective names they use (check_references); exit 2 with the PluginError message on stderr when one is
    unfit."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m jaxrl.algorithms.plugins CONFIG.json [CONFIG.json ...]", file=sys.stderr)
        return 1
    for path in argv:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        try:
            loaded = check_references(cfg)
        except PluginError as e:
            print(f"PluginError: {path}: {e}", file=sys.stderr, flush=True)
            return 2
        for p in loaded:
            print(f"ok: {p['kind']} {p['name']!r} ({p['path']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
