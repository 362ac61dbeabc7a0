"""Every setting's default lives once, on its config dataclass field (jaxrl.utils.dataclass_flags): the config a
launcher builds from its flags, given only the required ones, holds the dataclass defaults field for field, and
the launcher's --help lists a flag for every field. rollout and evaluate are checked in this process (their flags
modules define the flags in any FlagValues); every other launcher defines its flags when it is imported, so its
flags are parsed in a fresh interpreter (`PROBE`). Plus the helper's own rules: flag kinds, conversions, and
errors that name the flag."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import subprocess
import sys
from typing import Optional

import pytest
from absl import app, flags

from jaxrl.evaluation import flags as evaluate_flags
from jaxrl.evaluation.runner import EvalConfig
from jaxrl.rollout import flags as rollout_flags
from jaxrl.rollout.runner import RolloutConfig
from jaxrl.utils import dataclass_flags
from jaxrl.utils.dataclass_flags import NOT_A_FLAG, flag_field
from launcher_env import ROOT, launch, launch_env

# (config class, its launcher, the module defining the launcher's flags, the required flags of a run)
LAUNCHERS = {
    "rollout": (RolloutConfig, rollout_flags, {"problems": "p.jsonl", "model": "model_dir", "out": "r.jsonl"}),
    "evaluate": (EvalConfig, evaluate_flags, {"problems": "p.jsonl", "base": "base_dir", "out": "eval_dir"}),
}
# The other launchers: (the settings classes their flags are made from, the required flags of a run)
SETTINGS = {
    "build_pairs": (("jaxrl.data.pairs.PairConfig", "jaxrl.data.pairs.BuildPairsSettings"), {}),
    "compare": (("jaxrl.sweep.flags.CompareSettings",), {"sweep_dir": "runs/sweep"}),
    "convert": (("jaxrl.models.qwen35.flags.ConvertSettings",), {"to": "hf", "src": "src_dir", "out": "out_dir"}),
    "demo": (("jaxrl.demo_settings.DemoRunSettings",), {}),
    "diagnose": (("jaxrl.diagnostics.flags.DiagnoseSettings",), {}),
    "export": (("jaxrl.export.ExportSettings",), {}),
    "import_problems": (("jaxrl.data.importers.ImportSettings", "jaxrl.data.splits.SplitSettings"),
                        {"format": "lcb", "input": ("a.jsonl", "b.jsonl"), "output": "p.jsonl"}),
    "plan": (("jaxrl.evaluation.planning.PlanSettings",), {}),
    "report": (("jaxrl.diagnostics.report.ReportSettings",), {"workdir": "run"}),
    "sweep": (("jaxrl.sweep.flags.SweepSettings",), {}),
    "train": (("jaxrl.train.flags.TrainSettings",), {}),
}
# Every launcher's --verbose (defined when launchers/_main.py is imported) and --compilation_cache (defined by its
# run(), unless the launcher has a flag of that name: sweep's is its own setting)
COMMON = ("jaxrl.utils.logs.LogSettings", "jaxrl.utils.compile_cache.CacheSettings")


def parsed_config(name: str, set_defaults: Optional[dict] = None):
    """The config launchers.<name> builds from a fresh FlagValues parsed with only the required flags."""
    _, module, required = LAUNCHERS[name]
    values = flags.FlagValues()
    holders = module.define_flags(values)
    for flag, value in (set_defaults or {}).items():
        values.set_default(flag, value)
    values([name] + [f"--{k}={v}" for k, v in required.items()])
    return module.build_config(holders)


def field_default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def differing_defaults(cls, cfg) -> list[str]:
    """The flag fields of `cls` with a default whose value in `cfg` differs from it (in value or type)."""
    names = set(dataclass_flags.flag_names(cls))
    out = []
    for field in dataclasses.fields(cls):
        want = field_default(field)
        if field.name in names and want is not dataclasses.MISSING:
            got = getattr(cfg, field.name)
            if (type(got), got) != (type(want), want):
                out.append(field.name)
    return out


@pytest.mark.parametrize("name", LAUNCHERS)
def test_the_launchers_flag_defaults_are_the_config_defaults(name):
    cls, _, required = LAUNCHERS[name]
    cfg = parsed_config(name)
    assert differing_defaults(cls, cfg) == []
    assert {k: getattr(cfg, k) for k in required} == required
    # every field with a default is a flag, except the NOT_A_FLAG ones (evaluate's models and reference rows come
    # from other flags: --adapters / --models, --references NAME=HF_DIR)
    assert set(dataclass_flags.flag_names(cls)) | {"models", "references"} >= {f.name for f in dataclasses.fields(cls)}


def test_a_flag_default_that_differs_from_its_field_is_found():
    """The comparison above fails when a flag's default and its field's default part."""
    assert differing_defaults(RolloutConfig, parsed_config("rollout", {"num_samples": 4})) == ["num_samples"]
    assert differing_defaults(EvalConfig, parsed_config("evaluate", {"mesh_shape": ["1", "1", "1"],
                                                                    "reward_kwargs": '{"timeout_s": 3}'})) == \
        ["reward_kwargs", "mesh_shape"]


def listed_flags(help_text: str) -> set[str]:
    """The flag names of absl help text (`  --name: ...`, `  --[no]name: ...`)."""
    return set(re.findall(r"^\s+--(?:\[no\])?(\w+):", help_text, flags=re.MULTILINE))


def settings_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("name", [*LAUNCHERS, *SETTINGS])
def test_help_lists_a_flag_for_every_config_field(name):
    proc = launch(name, "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = listed_flags(proc.stdout)
    if name in LAUNCHERS:
        cls, module, _ = LAUNCHERS[name]
        assert set(dataclass_flags.flag_names(cls)) <= listed
        assert set(module.NAMES) <= listed  # the flags that are not fields too (--server_url, --coordinator_address)
        classes = COMMON
    else:
        classes = SETTINGS[name][0] + COMMON
    for path in classes:
        assert set(dataclass_flags.flag_names(settings_class(path))) <= listed, path


# Run as `python -c PROBE LAUNCHER CLASSES ARGS`: imports launchers.LAUNCHER (which defines its flags, as
# `python -m` does), parses ARGS, builds each settings class from the parsed flags, and prints every flag field's
# (type name, repr) as JSON.
PROBE = """
import importlib, json, sys
from absl import flags
from jaxrl.utils import dataclass_flags
name, classes, args = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
importlib.import_module("launchers." + name)
flags.FLAGS([name, *args])
out = {}
for path in classes:
    module, _, cls_name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), cls_name)
    cfg = dataclass_flags.config_from_flags(cls, flags.FLAGS)  # FLAGS[name] is the flag, its .value the value
    out[path] = {n: [type(getattr(cfg, n)).__name__, repr(getattr(cfg, n))] for n in dataclass_flags.flag_names(cls)}
print(json.dumps(out))
"""


def probe(name: str, *extra: str) -> dict:
    """{settings class: {flag field: [type name, repr]}} of launchers.<name> parsed with its required flags and
    `extra`, in a fresh interpreter."""
    classes, required = SETTINGS[name]
    classes += (COMMON[0],)  # --compilation_cache is defined by run(), which a probe does not call
    args = [f"--{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in required.items()] + list(extra)
    proc = subprocess.run([sys.executable, "-c", PROBE, name, json.dumps(classes), json.dumps(args)], cwd=ROOT,
                          env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def differing_in_probe(name: str, parsed: dict) -> list[str]:
    """The flag fields (class.field) whose parsed value differs from the field's default, in value or type; the
    required flags are compared with the value given."""
    required = SETTINGS[name][1]
    out = []
    for path, values in parsed.items():
        cls = settings_class(path)
        for field in dataclasses.fields(cls):
            if field.name not in values:
                continue
            want = field_default(field)
            if want is dataclasses.MISSING:
                want = required[field.name]
            if values[field.name] != [type(want).__name__, repr(want)]:
                out.append(f"{cls.__name__}.{field.name}")
    return out


@pytest.mark.parametrize("name", SETTINGS)
def test_every_launchers_flag_defaults_are_its_settings_defaults(name):
    parsed = probe(name)
    assert set(parsed) == set(SETTINGS[name][0]) | {COMMON[0]}
    assert differing_in_probe(name, parsed) == []
    # every field is a flag (none of these settings has a NOT_A_FLAG field)
    for path in parsed:
        cls = settings_class(path)
        assert set(parsed[path]) == {f.name for f in dataclasses.fields(cls)}


def test_a_launchers_flag_that_differs_from_its_field_is_found():
    """The comparison above fails when a parsed value and its field's default part."""
    parsed = probe("build_pairs", "--seed=3", "--pairing=all", "--verbose")
    assert differing_in_probe("build_pairs", parsed) == ["PairConfig.pairing", "BuildPairsSettings.seed",
                                                         "LogSettings.verbose"]


def test_listed_flags_reads_absl_help():
    text = ("  --adapter: Optional adapter.\n  --[no]enable_thinking: Thinking.\n    (default: 'false')\n"
            "  --dtype: <bfloat16|float32>: Compute dtype.\n    --not_a_flag_line in help text\n")
    assert listed_flags(text) == {"adapter", "enable_thinking", "dtype"}


# ------------------------------------------------------------------------------------------ the helper itself


@dataclasses.dataclass
class Toy:
    out: str = flag_field(help="Output file.")
    buckets: tuple[int, ...] = flag_field((8, 16), help="Prompt lengths.")
    options: dict = flag_field(default_factory=dict, help="JSON options.")
    mode: str = flag_field("fast", choices=("fast", "exact"), help="Mode.")
    cap: Optional[int] = flag_field(None, help="Cap (none by default).")
    rate: float = flag_field(0.5, help="Rate.")
    loud: bool = flag_field(False, help="Loud.")
    specs: list = dataclasses.field(default_factory=list, metadata=NOT_A_FLAG)


def toy(*args: str, **given):
    values = flags.FlagValues()
    holders = dataclass_flags.define_flags(Toy, values)
    values(["toy", *args])
    return values, dataclass_flags.config_from_flags(Toy, holders, **given)


def test_flags_take_the_kind_default_and_help_of_their_field():
    values, cfg = toy("--out=o", "--buckets=4,32", "--options={\"a\": [1]}", "--mode=exact", "--cap=3", "--loud")
    assert cfg == Toy(out="o", buckets=(4, 32), options={"a": [1]}, mode="exact", cap=3, rate=0.5, loud=True)
    assert dataclass_flags.flag_names(Toy) == ("out", "buckets", "options", "mode", "cap", "rate", "loud")
    assert [values[n].flag_type() for n in dataclass_flags.flag_names(Toy)] == [
        "string", "comma separated list of strings", "string", "string enum", "int", "float", "bool"]
    assert values["buckets"].default == ["8", "16"] and values["options"].default == "{}"
    assert values["out"].default is None and values["cap"].default is None
    assert values["mode"].help == "<fast|exact>: Mode." and values["rate"].help == "Rate."
    _, defaults = toy("--out=o")
    assert defaults == Toy(out="o")


def test_given_values_replace_flags_and_fill_the_fields_without_one():
    _, cfg = toy(specs=["x"], out="given")
    assert cfg.specs == ["x"] and cfg.out == "given"


@pytest.mark.parametrize("args, message", [
    ((), "--out is required"),
    (("--out=",), "--out is required"),
    (("--out=o", "--buckets=8,x"), "--buckets: expected integers, got 8,x"),
    (("--out=o", "--options={"), "--options: not JSON (Expecting property name enclosed in double quotes at "
                                 "column 2)"),
    (("--out=o", "--options=[1]"), "--options: expected a JSON object, got [1]"),
    (("--out=o", "--buckets=x", "--options=[1]"), "--buckets: expected integers, got x; --options: expected a JSON "
                                                  "object, got [1]"),
])
def test_bad_values_are_usage_errors_naming_the_flag(args, message):
    with pytest.raises(app.UsageError) as e:
        toy(*args)
    assert str(e.value) == message


def test_a_launcher_value_check_of_a_field_runs_as_its_parse():
    with pytest.raises(app.UsageError, match=re.escape("--mesh_shape=0,1,1: expected data,fsdp,tensor")):
        parsed_config("rollout", {"mesh_shape": ["0", "1", "1"]})


def test_a_field_without_help_or_kind_is_refused_when_flags_are_made():
    @dataclasses.dataclass
    class NoHelp:
        seed: int = 0

    @dataclasses.dataclass
    class NoKind:
        when: object = flag_field(None, help="A moment.")

    with pytest.raises(TypeError, match=r"NoHelp.seed: a config field needs help text"):
        dataclass_flags.define_flags(NoHelp, flags.FlagValues())
    with pytest.raises(TypeError, match=r"NoKind.when: no flag kind"):
        dataclass_flags.define_flags(NoKind, flags.FlagValues())


@dataclasses.dataclass
class Repeated:
    out: str = flag_field(help="Output file.")
    filters: list[str] = flag_field(default_factory=list, help="A filter (repeatable).")
    ids: list[int] = flag_field(default_factory=list, help="An id (repeatable).")


def test_a_list_field_is_a_flag_given_once_per_value():
    values = flags.FlagValues()
    holders = dataclass_flags.define_flags(Repeated, values)
    values(["r", "--out=o", "--filters=a>1", "--filters=b==2", "--ids=3", "--ids=4"])
    assert dataclass_flags.config_from_flags(Repeated, holders) == Repeated(out="o", filters=["a>1", "b==2"],
                                                                              ids=[3, 4])
    assert values["filters"].default == [] and values["ids"].default == []
    values.unparse_flags()
    values(["r", "--out=o"])
    assert dataclass_flags.config_from_flags(Repeated, holders) == Repeated(out="o")


def test_required_fields_can_be_refused_by_absl_while_it_parses():
    values = flags.FlagValues()
    dataclass_flags.define_flags(Repeated, values, mark_required=True)
    assert dataclass_flags.required_names(Repeated) == ("out",)
    with pytest.raises(flags.IllegalFlagValueError, match="Flag --out must have a value other than None"):
        values(["r"])
