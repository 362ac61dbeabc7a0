"""Sweep specs: which config every point starts from, what varies, and the resolved config of each point.

A sweep config is a Python file with `get_sweep()` (or `get_sweep(arg)` for `file.py:arg`) returning a dict:

    {
      "base": "configs/dpo_tiny.py[:args]",       # the config every point starts from (as for launchers.train)
      "axes": {"dpo.beta": [0.05, 0.1],          # grid axes: the cartesian product, any config key
               "dpo.loss_type": ["sigmoid", "ipo"]},
      "zip": [{"batch.micro_batch_size": [1, 2, 4, 8],      # keys varied together: ONE axis (equal lengths);
               "batch.grad_accum": [8, 4, 2, 1]}],          # or {("k1", "k2"): [(v1, v2), ...]}
      "cases": {"probe": {"default": {"optimizer.learning_rate": 1e-6, "lora.rank": 16},    # named variants:
                          "capacity": {"optimizer.learning_rate": 1e-6, "lora.rank": 32}}}, # one axis "probe"
      "seeds": [0, 1],                           # the axis "seed" (config.seed), varied fastest
      "fixed": {"steps": 16},                    # set on every point
      "evaluate": {"problems": "heldout.jsonl", "steps": [4, 16], "max_new_tokens": 8192},   # optional:
                                                 # launchers.evaluate flags, run on each point's checkpoints
      "baseline": {"dpo.beta": 0.1},             # the comparison's baseline (a selector, see compare.py)
      "prepare": [["python", "-m", "launchers.demo", "--workdir=/tmp/d", "--until=warm_up"]],   # optional:
                                                 # commands run in order before any point trains (they must skip
                                                 # what exists: they run on every call); "python" is the runner's
      "name": "...", "description": "...",
    }

Keys are dotted config keys (`optimizer.learning_rate`). A key `arg:NAME` sets NAME=value in the base config's
argument string instead (`configs/dpo.py:...,mb=2`), for family configs whose get_config derives several values
from one argument. New keys are refused (a typo would otherwise be a silent no-op) except inside the open blocks
`model_overrides`, `compile_options` and `reward` (constructor kwargs); values are type-checked by ml_collections.

Points are the product of the axes in the order given (axes, zip groups, cases, then seeds), the last varying
fastest. Each has a readable name (`dpo.beta=0.05,dpo.loss_type=sigmoid,seed=0`) and a filesystem-safe slug with
a short hash of its values (`beta=0.05__loss_type=sigmoid__seed=0__1a2b3c4d`): the slug depends only on the
point's own values, so adding a value to an axis later keeps every existing point's folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import itertools
import json
import os
import re
from typing import Any, Mapping, Optional, Sequence

import ml_collections

from jaxrl.algorithms.plugins import absolute_paths
from jaxrl.algorithms import config as run_config
from jaxrl.algorithms.tasks import registered
from jaxrl.utils.typed_config import ConfigKeyError, plain_mapping
from jaxrl.utils.registry import import_file

SPEC_KEYS = ("base", "axes", "zip", "cases", "seeds", "fixed", "evaluate", "baseline", "prepare", "name",
             "description")
OPEN_BLOCKS = ("model_overrides", "compile_options", "reward")  # blocks whose keys are free-form
ADDABLE = ("plugins",)  # top-level keys a sweep may add to configs that predate them
ARG_PREFIX = "arg:"
SEED = "seed"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class SweepError(ValueError):
    """A sweep config that cannot be expanded; the message names the sweep file and the key."""


# ---------------------------------------------------------------------------------------------- values


def fmt(value: Any) -> str:
    """The label of a value in names, slugs and tables: exact (repr for floats), short."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "+".join(fmt(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _jsonable(value: Any) -> Any:
    value = plain_mapping(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def short_key(key: str) -> str:
    """`optimizer.learning_rate` -> `learning_rate`; `arg:mb` -> `mb`; a zip axis `a.x+b.y` -> `x+y`."""
    return "+".join(k[len(ARG_PREFIX):] if k.startswith(ARG_PREFIX) else k.rsplit(".", 1)[-1]
                    for k in key.split("+"))


_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]+")


# ---------------------------------------------------------------------------------------------- axes & points


@dataclasses.dataclass(frozen=True)
class Axis:
    """One varied dimension. `labels[i]` names value i; `settings[i]` is what value i sets ({config key: value})."""

    name: str  # table column: the config key, "seed", the case axis name, or "k1+k2" for a zip group
    kind: str  # grid | zip | cases | seed
    labels: tuple
    settings: tuple  # of dicts
    raw: tuple  # the values as given (numbers stay numbers: the x of the plots)

    @property
    def keys(self) -> tuple:
        return tuple(dict.fromkeys(k for s in self.settings for k in s))


@dataclasses.dataclass(frozen=True)
class Point:
    index: int
    labels: dict  # axis name -> label
    values: dict  # axis name -> raw value (JSON)
    settings: dict  # config key (or arg:NAME) -> value, from every axis
    name: str  # "dpo.beta=0.05,dpo.loss_type=sigmoid,seed=0"
    slug: str  # folder name

    def to_dict(self) -> dict:
        return {"index": self.index, "slug": self.slug, "name": self.name, "labels": self.labels,
                "values": _jsonable(self.values), "settings": _jsonable(self.settings)}


def point_slug(labels: dict, settings: dict, max_len: int = 96) -> str:
    """`beta=0.05__loss_type=sigmoid__seed=0__<hash8>`; the hash covers every label and setting exactly."""
    digest = hashlib.sha1(json.dumps({"labels": labels, "settings": _jsonable(settings)}, sort_keys=True,
                                     default=repr).encode()).hexdigest()[:8]
    shorts = [short_key(a) for a in labels]
    parts = []
    for (axis, label), short in zip(labels.items(), shorts):
        key = short if shorts.count(short) == 1 else axis  # ambiguous short names keep the full key
        parts.append(f"{key}={label}")
    readable = _UNSAFE.sub("_", "__".join(parts)).strip("._")[:max_len]
    return f"{readable}__{digest}" if readable else digest


# ---------------------------------------------------------------------------------------------- spec


def _values(where: str, values: Any) -> list:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values:
        raise SweepError(f"{where}: expected a non-empty list of values, got {values!r}")
    return list(values)


@dataclasses.dataclass
class SweepSpec:
    path: str  # the sweep file
    arg: str
    base: str  # "configs/X.py[:args]"
    axes: list  # [Axis]
    fixed: dict
    evaluate: Optional[dict]
    baseline: Optional[dict]
    name: str
    description: str
    prepare: tuple = ()  # commands (argv lists) run before any point: what the base config reads

    @property
    def where(self) -> str:
        return self.path + (f":{self.arg}" if self.arg else "")

    # ------------------------------------------------------------------------------------------- points
    def points(self) -> list[Point]:
        out = []
        for i, combo in enumerate(itertools.product(*[range(len(a.labels)) for a in self.axes])):
            labels, values, settings = {}, {}, {}
            for axis, j in zip(self.axes, combo):
                labels[axis.name] = axis.labels[j]
                values[axis.name] = axis.raw[j]
                settings.update(axis.settings[j])
            name = ",".join(f"{a}={lab}" for a, lab in labels.items()) or "base"
            out.append(Point(i, labels, values, settings, name, point_slug(labels, settings)))
        slugs = [p.slug for p in out]
        if len(set(slugs)) != len(slugs):  # equal labels from different values: refuse rather than merge folders
            dup = sorted({s for s in slugs if slugs.count(s) > 1})
            raise SweepError(f"{self.where}: points share the folder names {dup}")
        return out

    # ------------------------------------------------------------------------------------------- configs
    def resolve(self, point: Point) -> dict:
        """The point's full config as JSON (base + fixed + the point's settings), checked key by key."""
        args = [(k[len(ARG_PREFIX):], v) for k, v in {**self.fixed, **point.settings}.items()
                if k.startswith(ARG_PREFIX)]
        config = load_config(self.base, args, where=self.where, rel_to=os.path.dirname(self.path))
        for key, value in {**self.fixed, **point.settings}.items():
            if not key.startswith(ARG_PREFIX):
                set_key(config, key, value, where=f"{self.where} ({point.name})")
        try:  # every key at its default where the base config has none, as the trainer will write it
            # a registered algorithm's blocks are known: any other key is a typo; a user's "pkg.module:factory" is
            # not imported here, so its blocks are taken as they are
            name = config.get("algorithm", None)
            algorithm = registered(name or run_config.TrainConfig.algorithm)
            resolved = run_config.complete(config, algorithm, strict=name is not None and algorithm is not None)
        except ConfigKeyError as e:
            raise SweepError(f"{self.where} ({point.name}): {e}") from None
        if resolved.get("plugins"):
            resolved["plugins"] = absolute_paths(resolved["plugins"], os.getcwd())
        return resolved


    def to_dict(self) -> dict:
        return {"sweep": self.where, "name": self.name, "description": self.description, "base": self.base,
                "axes": [{"name": a.name, "kind": a.kind, "labels": list(a.labels), "keys": list(a.keys),
                          "values": _jsonable(list(a.raw))} for a in self.axes],
                "fixed": _jsonable(self.fixed), "evaluate": _jsonable(self.evaluate),
                "baseline": _jsonable(self.baseline), "prepare": [list(c) for c in self.prepare]}


def _grid_axis(key: str, values: list) -> Axis:
    return Axis(key, "grid", tuple(fmt(v) for v in values), tuple({key: v} for v in values), tuple(values))


def _zip_axis(where: str, group: Any) -> Axis:
    if isinstance(group, dict) and group and all(isinstance(k, tuple) for k in group):
        if len(group) != 1:
            raise SweepError(f"{where}: give one ('k1', 'k2'): [(v1, v2), ...] entry per zip group")
        (keys, rows), = group.items()
        rows = _values(where, rows)
        if any(not isinstance(r, (list, tuple)) or len(r) != len(keys) for r in rows):
            raise SweepError(f"{where}: every row of {keys} must have {len(keys)} values")
        cols = {k: [r[i] for r in rows] for i, k in enumerate(keys)}
    elif isinstance(group, dict) and group:
        cols = {k: _values(f"{where}[{k!r}]", v) for k, v in group.items()}
    else:
        raise SweepError(f"{where}: a zip group is {{'key': [values], 'other.key': [values]}}, got {group!r}")
    lengths = {k: len(v) for k, v in cols.items()}
    if len(set(lengths.values())) != 1:
        raise SweepError(f"{where}: zipped lists must have equal lengths, got {lengths}")
    keys = list(cols)
    n = len(cols[keys[0]])
    rows = [tuple(cols[k][i] for k in keys) for i in range(n)]
    return Axis("+".join(keys), "zip", tuple("+".join(fmt(v) for v in r) for r in rows),
                tuple(dict(zip(keys, r)) for r in rows), tuple(r[0] for r in rows))  # plots: x = the first key


def _cases_axis(where: str, name: str, cases: Any) -> Axis:
    if not isinstance(cases, dict) or not cases:
        raise SweepError(f"{where}: expected {{'label': {{'config.key': value, ...}}, ...}}, got {cases!r}")
    for label, settings in cases.items():
        if not isinstance(settings, dict):
            raise SweepError(f"{where}[{label!r}]: expected a dict of config key -> value, got {settings!r}")
    labels = tuple(str(k) for k in cases)
    return Axis(name, "cases", labels, tuple(dict(v) for v in cases.values()), labels)

def as_today(config: dict) -> dict:
    """A point's config.json as this code resolves it: the keys added since it was written at their defaults (a key
    the code gained is not a change of the point's config); the config unchanged where it no longer resolves (its
    differences are then listed as they are)."""
    try:
        name = config.get("algorithm")
        return run_config.complete(config, registered(name or run_config.TrainConfig.algorithm), strict=False)
    except (ConfigKeyError, ValueError, TypeError):
        return config



def parse_spec(d: Any, path: str, arg: str = "") -> SweepSpec:
    where = path + (f":{arg}" if arg else "")
    if not isinstance(d, dict):
        raise SweepError(f"{where}: get_sweep() must return a dict, got {type(d).__name__}")
    unknown = sorted(set(d) - set(SPEC_KEYS))
    if unknown:
        raise SweepError(f"{where}: unknown sweep keys {unknown}; known: {', '.join(SPEC_KEYS)}")
    if not d.get("base"):
        raise SweepError(f"{where}: 'base' (the config every point starts from, e.g. 'configs/dpo_tiny.py') is "
                         "required")
    axes: list[Axis] = []
    for key, values in (d.get("axes") or {}).items():
        axes.append(_grid_axis(key, _values(f"{where}: axes[{key!r}]", values)))
    for i, group in enumerate(d.get("zip") or []):
        axes.append(_zip_axis(f"{where}: zip[{i}]", group))
    for name, cases in (d.get("cases") or {}).items():
        axes.append(_cases_axis(f"{where}: cases[{name!r}]", name, cases))
    if d.get("seeds") is not None:
        seeds = _values(f"{where}: seeds", d["seeds"])
        if any(not isinstance(s, int) or isinstance(s, bool) for s in seeds):
            raise SweepError(f"{where}: seeds must be integers, got {seeds}")
        axes.append(Axis(SEED, "seed", tuple(str(s) for s in seeds), tuple({SEED: s} for s in seeds),
                         tuple(seeds)))
    names = [a.name for a in axes]
    if len(set(names)) != len(names):
        raise SweepError(f"{where}: axis names repeat: {names}")
    fixed = dict(d.get("fixed") or {})
    owner: dict[str, str] = {}
    for a in axes:
        for k in a.keys:
            if k in owner and owner[k] != a.name:
                raise SweepError(f"{where}: key {k!r} is varied by two axes ({owner[k]!r} and {a.name!r})")
            owner[k] = a.name
            if k in fixed:
                raise SweepError(f"{where}: key {k!r} is both varied (axis {a.name!r}) and fixed")
    evaluate = d.get("evaluate")
    if evaluate is not None and not isinstance(evaluate, dict):
        raise SweepError(f"{where}: 'evaluate' must be a dict of launchers.evaluate flags, got {evaluate!r}")
    baseline = d.get("baseline")
    if baseline is not None and not isinstance(baseline, (dict, str)):
        raise SweepError(f"{where}: 'baseline' must be a dict {{axis: value}} or a point slug, got {baseline!r}")
    prepare = d.get("prepare") or []
    if not isinstance(prepare, (list, tuple)) or not all(
            isinstance(c, (list, tuple)) and c and all(isinstance(a, str) for a in c) for c in prepare):
        raise SweepError(f"{where}: 'prepare' must be a list of commands, each a non-empty list of strings "
                         f"(argv), got {prepare!r}")
    return SweepSpec(path=path, arg=arg, base=str(d["base"]), axes=axes, fixed=fixed, evaluate=evaluate,
                     baseline=baseline, name=str(d.get("name") or os.path.splitext(os.path.basename(path))[0]),
                     description=str(d.get("description") or ""), prepare=tuple(tuple(c) for c in prepare))


def _find(path: str, rel_to: Sequence[str]) -> str:
    if os.path.isabs(path):
        return path
    for base in rel_to:
        cand = os.path.join(base, path)
        if os.path.exists(cand):
            return os.path.abspath(cand)
    return os.path.abspath(path)


def _import_file(path: str, prefix: str):
    try:
        return import_file(path, prefix)
    except ImportError as e:
        raise SweepError(str(e)) from None


def _call(fn, arg: str, where: str):
    """fn(arg) when an argument was given (as ml_collections' config_flags does), else fn()."""
    if arg:
        return fn(arg)
    try:
        return fn()
    except TypeError as e:
        params = [p for p in inspect.signature(fn).parameters.values() if p.default is p.empty]
        if params:
            raise SweepError(f"{where}: {fn.__name__} needs an argument ({e}); write FILE.py:ARG") from None
        raise


def load_sweep(spec: str) -> SweepSpec:
    """`path/to/sweep.py[:arg]` -> SweepSpec (relative paths: the working directory, then the repository)."""
    path, _, arg = spec.partition(":")
    full = _find(path, [os.getcwd(), _REPO_ROOT])
    if not os.path.isfile(full):
        raise SweepError(f"sweep config {path!r} not found (looked in {os.getcwd()} and {_REPO_ROOT})")
    module = _import_file(full, "jaxrl_sweep")
    if not hasattr(module, "get_sweep"):
        raise SweepError(f"{full}: defines no get_sweep()")
    return parse_spec(_call(module.get_sweep, arg, full), full, arg)


def parse_sweep_args(arg: str, keys: Sequence[str], where: str) -> dict:
    """'k=v,k2=v2' -> {k: v} for a sweep file's get_sweep(arg); unknown keys are an error naming `where`."""
    out = {}
    for item in (s.strip() for s in (arg or "").split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in keys:
            raise SweepError(f"{where}: argument {item!r}; expected key=value with keys {', '.join(keys)}")
        out[key.strip()] = value.strip()
    return out


# ---------------------------------------------------------------------------------------------- configs


def load_config(base: str, extra_args: Sequence[tuple] = (), where: str = "sweep", rel_to: str = ""):
    """The base ConfigDict of `configs/X.py[:args]`, with `extra_args` (k, v) appended to its argument; a relative
    path is looked up in the working directory, the repository, then `rel_to` (the sweep file's folder)."""
    path, _, arg = base.partition(":")
    full = _find(path, [os.getcwd(), _REPO_ROOT] + ([rel_to] if rel_to else []))
    if not os.path.isfile(full):
        raise SweepError(f"{where}: base config {path!r} not found (looked in {os.getcwd()} and {_REPO_ROOT})")
    if extra_args:
        arg = ",".join([a for a in [arg] if a] + [f"{k}={fmt(v)}" for k, v in extra_args])
    module = _import_file(full, "jaxrl_sweep_base")
    if not hasattr(module, "get_config"):
        raise SweepError(f"{where}: {full} defines no get_config()")
    try:
        return _call(module.get_config, arg, full)
    except SweepError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise SweepError(f"{where}: {base}" + (f" with arguments {arg!r}" if arg else "") + f": {e}") from e


def set_key(config, key: str, value: Any, where: str = "sweep") -> None:
    """`config[key] = value` for a dotted key, refusing unknown keys (with suggestions) and wrong types."""
    parts = key.split(".")
    node = config
    for i, part in enumerate(parts[:-1]):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            _unknown(where, key, ".".join(parts[:i + 1]), node)
        node = node[part]
    if not isinstance(node, ml_collections.ConfigDict):
        raise SweepError(f"{where}: {key!r}: {'.'.join(parts[:-1])} is a {type(node).__name__}, not a block")
    leaf = parts[-1]
    open_block = (len(parts) >= 2 and parts[0] in OPEN_BLOCKS) or (len(parts) == 1 and leaf in ADDABLE)
    if leaf not in node and not open_block:
        _unknown(where, key, key, node)
    current = node.get(leaf) if leaf in node else None
    if isinstance(current, ml_collections.ConfigDict) and isinstance(value, dict):
        for k, v in value.items():  # a block: key by key, so each is checked
            set_key(config, f"{key}.{k}", v, where)
        return
    try:
        node[leaf] = value
    except (TypeError, ValueError) as e:
        raise SweepError(f"{where}: {key}={value!r}: {e}") from None


def _unknown(where: str, key: str, missing: str, node) -> None:
    node = plain_mapping(node)
    known = sorted(node.keys()) if isinstance(node, Mapping) else []
    leaf = missing.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, known, n=3)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else (
        f"; keys there: {', '.join(known)}" if known else "")
    raise SweepError(f"{where}: the base config has no key {missing!r} (setting {key!r}){hint}")
