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

from jaxrl.backends.flags import LEGACY_KEYS, backend_spec
from jaxrl.backends.options import ServerOptions, VLLMLaunchOptions
from jaxrl.backends.settings import BackendContext, JaxRollout, ServerRollout, VLLMRollout
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
    # from other flags: --adapters / --models, --references NAME=HF_DIR; the backend option blocks from one flag per
    # key, --server_<key> / --vllm_<key>: jaxrl.backends.flags), whose defaults are the blocks' own
    assert set(dataclass_flags.flag_names(cls)) | {"models", "references", "server", "vllm"} >= \
        {f.name for f in dataclasses.fields(cls)}
    assert (cfg.server, cfg.vllm) == (ServerOptions(), VLLMLaunchOptions())


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


# ------------------------------------------------------------------------------- the backends' option flags


def parsed_with(name: str, *args: str):
    """The config launchers.<name> builds from its required flags and `args`."""
    _, module, required = LAUNCHERS[name]
    values = flags.FlagValues()
    holders = module.define_flags(values)
    values([name] + [f"--{k}={v}" for k, v in required.items()] + list(args))
    return module.build_config(holders)


@pytest.mark.parametrize("name", LAUNCHERS)
def test_one_flag_per_key_of_the_backends_option_blocks(name):
    """--server_<key> for every ServerOptions key, --vllm_<key> for every VLLMLaunchOptions key (made from the
    blocks: a key added there is a flag here), with the block's default and doc."""
    from jaxrl.utils.typed_config import keys_of
    _, module, _ = LAUNCHERS[name]
    values = flags.FlagValues()
    module.define_flags(values)
    for prefix, cls in (("server_", ServerOptions), ("vllm_", VLLMLaunchOptions)):
        for key, k in keys_of(cls).items():
            assert prefix + key in module.NAMES
            flag = values[prefix + key]
            assert flag.default == (list(k.default) if isinstance(k.default, tuple) else k.default), flag.name
            assert not k.doc or k.doc in flag.help
    assert {"server_url", "vllm_max_lora_rank", "backend_kwargs"} <= set(module.NAMES)


VLLM_FLAGS = ("--backend=vllm", "--vllm_python=/venvs/vllm", "--vllm_tensor_parallel_size=2",
              "--vllm_gpu_memory_utilization=0.5", "--vllm_extra_args=--enforce-eager",
              "--vllm_extra_args=--max-num-seqs=8", "--vllm_max_loras=2", "--vllm_max_lora_rank=32",
              "--server_concurrency=7", "--server_progress_every_s=0")
VLLM_JSON = {"python": "/venvs/vllm", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5,
             "extra_args": ["--enforce-eager", "--max-num-seqs=8"], "max_loras": 2, "max_lora_rank": 32,
             "concurrency": 7, "progress_every_s": 0}


@pytest.mark.parametrize("name", LAUNCHERS)
def test_the_backend_flags_make_the_typed_spec_and_the_deprecated_json_the_same_one(name):
    cfg = parsed_with(name, *VLLM_FLAGS)
    want = VLLMRollout((), ServerOptions(concurrency=7, progress_every_s=0.0), VLLMLaunchOptions(
        python="/venvs/vllm", tensor_parallel_size=2, gpu_memory_utilization=0.5,
        extra_args=("--enforce-eager", "--max-num-seqs=8"), max_loras=2))
    assert backend_spec(cfg) == want and cfg.vllm_max_lora_rank == 32
    with pytest.warns(FutureWarning) as caught:
        assert parsed_with(name, "--backend=vllm", f"--backend_kwargs={json.dumps(VLLM_JSON)}") == cfg
    [warning] = caught  # one warning, naming every new flag
    assert str(warning.message) == f"--backend_kwargs is deprecated: give {' '.join(VLLM_FLAGS[1:])} instead"
    # a key given both ways with the same value is the same setting
    with pytest.warns(FutureWarning, match="give --server_concurrency=7 instead"):
        assert parsed_with(name, *VLLM_FLAGS, '--backend_kwargs={"concurrency": 7}') == cfg
    # the server backends and the jax backend
    url = "http://127.0.0.1:8000"
    assert backend_spec(parsed_with(name, "--backend=server", f"--server_url={url}/", "--server_concurrency=3")) == \
        ServerRollout((url,), ServerOptions(concurrency=3))
    assert backend_spec(parsed_with(name, "--backend=vllm", f"--server_url={url}")) == VLLMRollout((url,))
    with pytest.warns(FutureWarning, match="give --server_url="):
        assert backend_spec(parsed_with(name, "--backend=server", f'--backend_kwargs={{"url": "{url}"}}')) == \
            ServerRollout((url,))
    assert backend_spec(parsed_with(name)) == JaxRollout()


@pytest.mark.parametrize("args, message", [
    (('--backend=vllm', '--backend_kwargs={"gpu_util": 0.5}'),
     f"--backend_kwargs: unknown key 'gpu_util'; valid keys: {', '.join(LEGACY_KEYS)} (each is a flag now: "
     "--server_url, --vllm_max_lora_rank, --server_<key>, --vllm_<key>)"),
    (('--backend=vllm', '--backend_kwargs={"concurency": 8}'),
     f"--backend_kwargs: unknown key 'concurency' (did you mean 'concurrency'?); valid keys: "
     f"{', '.join(LEGACY_KEYS)} (each is a flag now: --server_url, --vllm_max_lora_rank, --server_<key>, "
     "--vllm_<key>)"),
    (('--backend=vllm', '--server_concurrency=16', '--backend_kwargs={"concurrency": 8}'),
     "--backend_kwargs key 'concurrency'=8 and --server_concurrency=16 disagree; give --server_concurrency only"),
    (('--backend=vllm', '--vllm_max_lora_rank=8', '--backend_kwargs={"max_lora_rank": 64}'),
     "--backend_kwargs key 'max_lora_rank'=64 and --vllm_max_lora_rank=8 disagree; give --vllm_max_lora_rank only"),
    (('--backend=server', '--server_url=http://a:1', '--backend_kwargs={"url": "http://b:2"}'),
     "--backend_kwargs key 'url'='http://b:2' and --server_url='http://a:1' disagree; give --server_url only"),
    (('--backend=vllm', '--backend_kwargs={"data_parallel_size": "8"}'),
     "--backend_kwargs key 'data_parallel_size'='8': expected int, got str; give --vllm_data_parallel_size instead"),
    (('--backend=vllm', '--backend_kwargs=[1]'), "--backend_kwargs must be a JSON object"),
    (('--backend=server',), "--backend=server needs --server_url"),
    (('--server_concurrency=3', '--server_url=http://a:1'),
     "--server_url, --server_concurrency: options of --backend=server or vllm; --backend is 'jax'"),
    (('--backend=vllm', '--server_url=http://a:1', '--vllm_python=/v', '--vllm_max_lora_rank=8'),
     "--vllm_python, --vllm_max_lora_rank: launch options of the vLLM that --backend=vllm starts without "
     "--server_url; --backend is 'vllm' with --server_url=http://a:1"),
    (('--backend=server', '--server_url=localhost:8000'),
     "--server_url: ['localhost:8000'] are not base URLs (http://host:port)"),
])
@pytest.mark.parametrize("name", LAUNCHERS)
def test_backend_flags_that_do_not_fit_are_one_line_usage_errors(name, args, message):
    with pytest.raises(app.UsageError) as e:
        parsed_with(name, *args)
    assert str(e.value) == message


def test_the_vllm_flags_reach_the_server_it_starts(monkeypatch, tmp_path):
    """The launch options of the config (--vllm_*) are the `vllm serve` command of the VLLMBackend built from it:
    nothing starts until a model is loaded, so this needs no vLLM (its install check answers 0.33 here)."""
    from jaxrl.backends import vllm_backend
    monkeypatch.setattr(vllm_backend, "installed_vllm", lambda python: "0.33.0")
    cfg = parsed_with("evaluate", *(a.replace("/venvs/vllm", sys.executable) for a in VLLM_FLAGS))
    backend = backend_spec(cfg).build(BackendContext(str(tmp_path), stop_ids=(1,), max_prompt_len=64,
                                                     max_new_tokens=32, dtype="float32", seed=5,
                                                     out_dir=str(tmp_path), lora_rank=cfg.vllm_max_lora_rank))
    assert isinstance(backend, vllm_backend.VLLMBackend) and backend.url is None
    assert (backend.concurrency, backend.progress_every_s, backend.base_lora_rank) == (7, 0.0, 32)
    command = " ".join(backend.launcher.command(str(tmp_path), 96, max_lora_rank=32))
    for part in (f"{sys.executable} -m vllm.entrypoints.cli.main serve", "--dtype float32", "--seed 5",
                 "--tensor-parallel-size 2", "--gpu-memory-utilization 0.5", "--max-lora-rank 32 --max-loras 2",
                 "--enforce-eager --max-num-seqs=8"):
        assert part in command, part
    # the constructors take no stray keyword (a misspelt option is Python's TypeError, not ignored)
    from jaxrl.backends.jax_backend import JaxBackend
    from jaxrl.backends.openai_client import ServerBackend
    for make, stray in ((vllm_backend.VLLMBackend, "max_lora"), (ServerBackend, "seed"), (JaxBackend, "out_dir")):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{stray}'"):
            make(str(tmp_path), url="http://127.0.0.1:1", **{stray: 8}) if make is not JaxBackend else \
                make(str(tmp_path), **{stray: 8})


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
