"""The command-line flags of `python -m launchers.evaluate`, defined once: one per EvalConfig field (its name, type,
default and help are declared on the field; jaxrl.utils.dataclass_flags makes the flag), the flags that choose the
models and the protocol (below), the flags of the backends' option blocks (--server_<key>, --vllm_<key>, the
deprecated --backend_kwargs: jaxrl.backends.flags) and the distributed flags. The sweep runner checks a sweep's
`evaluate` block against NAMES.

    holders = define_flags()                    # {name: absl FlagHolder}
    cfg = build_config(holders, selection)      # after absl parsed them; app.UsageError naming the flag
    NAMES                                       # every flag name
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from absl import app, flags

from jaxrl.evaluation import protocol
from jaxrl.evaluation.analysis import sampling_warning
from jaxrl.evaluation.runner import BASE, EvalConfig, ModelSpec, checkpoint_specs, default_reward_kwargs
from jaxrl.parallel.distributed import FLAGS as DISTRIBUTED_FLAGS
from jaxrl.backends.flags import BACKEND_FLAGS, backend_options, check_backend
from jaxrl.rollout.runner import check_reward_choice
from jaxrl.utils import dataclass_flags

__all__ = ["NAMES", "build_config", "define_flags"]

# The flags that are not EvalConfig fields (the models, the protocol, re-sampling; --server_<key> / --vllm_<key>
# and --backend_kwargs, shared with launchers.rollout; --coordinator_address, ... shared with launchers.train):
# (name, absl kind, default, [enum values,] help)
_OTHER_FLAGS = (
    ("checkpoints", "string", None, "A run workdir: evaluate its adapter checkpoints (step_<N>), EMA adapters "
     "(ema_<N>) and averaged adapters (RUN/averages/<name>)."),
    ("steps", "list", [], "Only these candidates of --checkpoints: step numbers, ema_<N> (EMA adapters), names of "
     "averaged adapters under RUN/averages/ (default: every one the run holds)."),
    ("adapters", "list", [], "NAME=PATH,...: PEFT folders or adapter checkpoints (on --base)."),
    ("models", "list", [], "NAME=HF_DIR,...: full HF folders (e.g. merged exports)."),
    ("references", "list", [], "NAME=HF_DIR,...: full HF folders shown as reference rows (a distillation's "
     "teacher): scored and compared with the baseline, but outside the simultaneous family and never selected; "
     "`teacher` alone: the distill.teacher_path of the --checkpoints run."),
    ("resample_max_new_tokens", "integer", 0, "Re-run truncated samples at this larger cap and write "
     "termination.json (0 = off)."),
    ("role", "enum", "explore", ["explore", "select"], "explore: every claim is exploratory; select: record the best "
     "model on --select_metric in <out>/selection.json (dev split)."),
    ("select_metric", "enum", "partial_reward_mean", ["partial_reward_mean", "strict_rate"], "Metric the best model "
     "is selected on (--role=select)."),
    ("confirm", "string", None, "A selection.json (or its folder): evaluate base and the selected model once on this "
     "other split, with the selection's settings (reward, caps, dtype, sampling, seed: a flag contradicting them is "
     "refused); its comparison is the confirmatory claim."),
    ("withdraw", "string", None, "The --out of a confirmation run by mistake: withdraw it (kept in the ledger, marked "
     "withdrawn; its claim becomes exploratory), so the model can be confirmed again. Needs --reason."),
    ("reason", "string", "", "Why the confirmation is withdrawn (--withdraw); recorded in the ledger."),
) + BACKEND_FLAGS + DISTRIBUTED_FLAGS
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
    cfg = dataclass_flags.config_from_flags(EvalConfig, holders, problems=problems, base=base, out=out,
                                            models=models, baseline=baseline, **backend_options(holders))
    check_backend(cfg)
    return cfg


def build_config(holders: dict, selection: Optional[dict] = None) -> EvalConfig:
    """The EvalConfig of the parsed flags: the models of --checkpoints / --adapters / --models, or base and the
    model of a selection (--confirm, `protocol.read_selection`); app.UsageError for a missing or bad value."""
    if not holders["problems"].value:
        raise app.UsageError("--problems is required")
    if selection is not None:
        # judged on the settings the confirmation takes from its selection, after a flag contradicting them was
        # named: --num_samples=8 against a selection sampled at temperature 1 is a contradiction of its
        # num_samples, not a greedy run (the flag's default temperature, 0, is not what would run)
        cfg = _confirmation_config(holders, selection)
        _refuse_greedy_repeats(cfg.temperature, cfg.num_samples)
    else:
        _refuse_greedy_repeats(holders["temperature"].value, holders["num_samples"].value)
        cfg = _models_config(holders)
    check_reward_choice(cfg.reward, cfg.reward_kwargs)  # an unknown reward or option: a usage error, here
    return cfg


def _refuse_greedy_repeats(temperature: float, num_samples: int) -> None:
    refused = sampling_warning(temperature, num_samples)
    if refused:
        raise app.UsageError(refused)


def _models_config(holders: dict) -> EvalConfig:
    """The models of --checkpoints / --adapters / --models with the flags' settings."""
    workdir = holders["checkpoints"].value
    base = holders["base"].value or (_default_base(workdir) if workdir else None)
    if not base:
        raise app.UsageError("--base is required without --checkpoints")
    out = holders["out"].value or (os.path.join(workdir, "eval") if workdir else None)
    if not out:
        raise app.UsageError("--out is required without --checkpoints")
    if holders["steps"].value and not workdir:
        raise app.UsageError("--steps needs --checkpoints")
    models = checkpoint_specs(workdir, holders["steps"].value) if workdir else []
    models += [ModelSpec(n, "adapter", p) for n, p in _named(holders["adapters"].value, "adapters")]
    models += [ModelSpec(n, "hf", p) for n, p in _named(holders["models"].value, "models")]
    references = [ModelSpec(n, "hf", p) for n, p in _references(holders["references"].value, workdir)]
    cfg = _config(holders, holders["problems"].value, base, out, models + references, holders["baseline"].value)
    return dataclasses.replace(cfg, references=tuple(s.name for s in references))


def _references(values, workdir) -> list[tuple[str, str]]:
    """(name, folder) of each --references value; `teacher` alone is the --checkpoints run's distillation teacher."""
    out = []
    for v in values:
        if v != "teacher":
            out += _named([v], "references")
            continue
        cfg_path = os.path.join(workdir or "", "config.json")
        if not workdir or not os.path.isfile(cfg_path):
            raise app.UsageError("--references=teacher names the teacher of a distillation run: it needs "
                                 "--checkpoints=RUN (with RUN/config.json); or give --references=teacher=HF_DIR")
        with open(cfg_path) as f:
            run = json.load(f)
        block = run.get("distill") or {}
        if run.get("algorithm") != "distill" or not block.get("teacher_path"):
            raise app.UsageError(f"--references=teacher: {cfg_path} is not a distillation run (algorithm "
                                 f"{run.get('algorithm')!r}, no distill.teacher_path)")
        if block.get("teacher_adapter"):
            raise app.UsageError(f"--references=teacher: the teacher of {cfg_path} is distill.teacher_path + "
                                 f"distill.teacher_adapter; merge it (launchers.export) and pass "
                                 f"--references=teacher=MERGED_DIR")
        out.append(("teacher", block["teacher_path"]))
    return out


def _confirmation_config(holders: dict, selection: dict) -> EvalConfig:
    """Base + the selected model, with the evaluation settings the selection recorded
    (protocol.confirmation_settings); the problems are --problems (held-out). A flag given with another value than
    the selection's is refused (app.UsageError naming it) before anything is read or written."""
    if holders["checkpoints"].value or holders["adapters"].value or holders["models"].value or \
            holders["steps"].value or holders["references"].value:
        raise app.UsageError("--confirm evaluates the selected model only; drop --checkpoints/--steps/--adapters/"
                             "--models/--references")
    if not holders["out"].value:
        raise app.UsageError("--out is required with --confirm")
    model = selection["model"]
    source = model.get("source") or {}
    if selection["baseline"] != BASE or not source.get("path"):
        raise app.UsageError(f"{selection['path']}: can only confirm a model selected against {BASE!r} with a "
                             "recorded source")
    baseline = holders["baseline"]
    if baseline.present and baseline.value != selection["baseline"]:
        # Refused, not honoured: the confirmatory claim is the comparison the selection was made on (the selected
        # model vs its baseline on the selection metric); against another baseline it would test a hypothesis
        # nobody chose on dev, and its interval would not be the confirmation of anything.
        raise app.UsageError(f"--baseline={baseline.value!r} contradicts the selection being confirmed (baseline: "
                             f"{selection['baseline']!r} in {selection['path']}): the confirmatory claim compares "
                             "the selected model with the baseline it was selected against; drop --baseline")
    settings = protocol.confirmation_settings(selection)
    # the base: the selection's folder, or the same weights elsewhere (--base; the fingerprint check refuses others)
    base = holders["base"].value or selection.get("base")
    if not base:
        raise app.UsageError("--base is required (the selection does not record the base folder)")
    for key, want in settings.items():
        holder = holders[key]
        if not holder.present:
            continue
        given = holder.value
        if key == "reward_kwargs":  # a JSON flag; the recorded options include the reward's defaults
            given = {**default_reward_kwargs(settings.get("reward", holders["reward"].value)),
                     **_json_flag(key, given)}
        if protocol.settings_conflicts(selection, {key: given}):
            raise app.UsageError(f"--{key}={holder.value!r} contradicts the selection being confirmed ({key}: "
                                 f"{want!r} in {selection['path']}): a confirmation evaluates with the settings the "
                                 f"model was selected with; drop --{key}")
    spec = ModelSpec(model["name"], source["kind"], source["path"], step=model.get("step"))
    cfg = dataclass_flags.config_from_flags(EvalConfig, holders, **settings, base=base,
                                            problems=holders["problems"].value, out=holders["out"].value,
                                            models=[spec], baseline=BASE, **backend_options(holders))
    check_backend(cfg)
    return cfg


def _json_flag(name: str, value: str) -> dict:
    try:
        parsed = json.loads(value or "{}")
    except json.JSONDecodeError as e:
        raise app.UsageError(f"--{name}: invalid JSON ({e.msg})") from None
    if not isinstance(parsed, dict):
        raise app.UsageError(f"--{name}: expected a JSON object, got {value}")
    return parsed
