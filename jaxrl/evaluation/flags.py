"""The command-line flags of `python -m launchers.evaluate`, defined once: one per EvalConfig field (its name, type,
default and help are declared on the field; jaxrl.utils.dataclass_flags makes the flag), the flags that choose the
models and the protocol (below), --server_url and the distributed flags. The sweep runner checks a sweep's
`evaluate` block against NAMES.

    holders = define_flags()                    # {name: absl FlagHolder}
    cfg = build_config(holders, selection)      # after absl parsed them; app.UsageError naming the flag
    NAMES                                       # every flag name
"""

from __future__ import annotations

import json
import os
from typing import Optional

from absl import app, flags

from jaxrl.evaluation.analysis import sampling_warning
from jaxrl.evaluation.runner import BASE, EvalConfig, ModelSpec, checkpoint_specs
from jaxrl.parallel.distributed import FLAGS as DISTRIBUTED_FLAGS
from jaxrl.rollout.backends.flags import SERVER_FLAGS, backend_options
from jaxrl.utils import dataclass_flags

__all__ = ["NAMES", "build_config", "define_flags"]

# The flags that are not EvalConfig fields (the models, the protocol, re-sampling; --server_url joins
# --backend_kwargs, shared with launchers.rollout; --coordinator_address, ... shared with launchers.train):
# (name, absl kind, default, [enum values,] help)
_OTHER_FLAGS = (
    ("checkpoints", "string", None, "A run workdir: evaluate its adapter checkpoints."),
    ("steps", "list", [], "Only these checkpoint steps (default: every one in --checkpoints)."),
    ("adapters", "list", [], "NAME=PATH,...: PEFT folders or adapter checkpoints (on --base)."),
    ("models", "list", [], "NAME=HF_DIR,...: full HF folders (e.g. merged exports)."),
    ("resample_max_new_tokens", "integer", 0, "Re-run truncated samples at this larger cap and write "
     "termination.json (0 = off)."),
    ("role", "enum", "explore", ["explore", "select"], "explore: every claim is exploratory; select: record the best "
     "model on --select_metric in <out>/selection.json (dev split)."),
    ("select_metric", "enum", "partial_reward_mean", ["partial_reward_mean", "strict_rate"], "Metric the best model "
     "is selected on (--role=select)."),
    ("confirm", "string", None, "A selection.json (or its folder): evaluate base and the selected model once on this "
     "other split; its comparison is the confirmatory claim."),
) + SERVER_FLAGS + DISTRIBUTED_FLAGS
NAMES = dataclass_flags.flag_names(EvalConfig) + tuple(f[0] for f in _OTHER_FLAGS)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, flags.FlagHolder]:
    """Defines every flag of launchers.evaluate in `flag_values`; returns their holders by name."""
    holders = dataclass_flags.define_flags(EvalConfig, flag_values)
    holders.update(dataclass_flags.define_table(_OTHER_FLAGS, flag_values))
    return holders


def _named(values, flag):
    out = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep:
            name, path = os.path.basename(v.rstrip("/")), v
        if not name or not path:
            raise app.UsageError(f"--{flag}: expected NAME=PATH, got {v!r}")
        out.append((name, path))
    return out


def _default_base(workdir):
    cfg_path = os.path.join(workdir, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            path = json.load(f).get("model_path")
        if path:
            return path
    raise app.UsageError(f"--base is required ({cfg_path} names no model_path)")


def _config(holders: dict, problems: str, base: str, out: str, models: list, baseline: str) -> EvalConfig:
    """EvalConfig of the flags (sampling, reward, backend, statistics) for these models."""
    _, backend_kwargs = backend_options(holders)  # --backend_kwargs with --server_url joined in
    return dataclass_flags.config_from_flags(EvalConfig, holders, problems=problems, base=base, out=out,
                                             models=models, baseline=baseline, backend_kwargs=backend_kwargs)


def build_config(holders: dict, selection: Optional[dict] = None) -> EvalConfig:
    """The EvalConfig of the parsed flags: the models of --checkpoints / --adapters / --models, or base and the
    model of a selection (--confirm, `protocol.read_selection`); app.UsageError for a missing or bad value."""
    if not holders["problems"].value:
        raise app.UsageError("--problems is required")
    refused = sampling_warning(holders["temperature"].value, holders["num_samples"].value)
    if refused:
        raise app.UsageError(refused)
    if selection is not None:
        return _confirmation_config(holders, selection)
    workdir = holders["checkpoints"].value
    base = holders["base"].value or (_default_base(workdir) if workdir else None)
    if not base:
        raise app.UsageError("--base is required without --checkpoints")
    out = holders["out"].value or (os.path.join(workdir, "eval") if workdir else None)
    if not out:
        raise app.UsageError("--out is required without --checkpoints")
    if holders["steps"].value and not workdir:
        raise app.UsageError("--steps needs --checkpoints")
    try:
        steps = [int(s) for s in holders["steps"].value]
    except ValueError:
        raise app.UsageError(f"--steps: expected integers, got {','.join(holders['steps'].value)}") from None
    models = checkpoint_specs(workdir, steps) if workdir else []
    models += [ModelSpec(n, "adapter", p) for n, p in _named(holders["adapters"].value, "adapters")]
    models += [ModelSpec(n, "hf", p) for n, p in _named(holders["models"].value, "models")]
    return _config(holders, holders["problems"].value, base, out, models, holders["baseline"].value)


def _confirmation_config(holders: dict, selection: dict) -> EvalConfig:
    """Base + the selected model, as the selection recorded them; the problems are --problems (held-out)."""
    if holders["checkpoints"].value or holders["adapters"].value or holders["models"].value or \
            holders["steps"].value:
        raise app.UsageError("--confirm evaluates the selected model only; drop --checkpoints/--steps/--adapters/"
                             "--models")
    if not holders["out"].value:
        raise app.UsageError("--out is required with --confirm")
    model = selection["model"]
    source = model.get("source") or {}
    if selection["baseline"] != BASE or not source.get("path"):
        raise app.UsageError(f"{selection['path']}: can only confirm a model selected against {BASE!r} with a "
                             "recorded source")
    base = holders["base"].value or selection.get("base")
    if not base:
        raise app.UsageError("--base is required (the selection does not record the base folder)")
    spec = ModelSpec(model["name"], source["kind"], source["path"], step=model.get("step"))
    return _config(holders, holders["problems"].value, base, holders["out"].value, [spec], BASE)
