"""Typed config blocks: frozen dataclasses whose fields carry their one default, the types a value may have and
what it means; a mapping (a ConfigDict from a family file and `--config.key=value` flags, a config.json read back)
is checked against them key by key and turned into the dataclass once.

    @dataclasses.dataclass(frozen=True)
    class OptimizerConfig:
        learning_rate: float = setting(1e-6, doc="peak learning rate")
        schedule: str = setting("linear", doc="linear | cosine | ...")

    @dataclasses.dataclass(frozen=True)
    class GRPOConfig(SamplingSettings):          # shared keys are inherited: declared once, in one block
        rollout_server: ServerOptions = block(ServerOptions, "...")   # a nested block: grpo.rollout_server.*

    OptimizerConfig.learning_rate                # the default, as on any dataclass
    keys_of(OptimizerConfig)                     # {name: Key}: default, accepted types, meaning
    defaults_of(OptimizerConfig)                 # {name: default}
    complete_block(OptimizerConfig, value, "optimizer")   # the defaults overlaid with `value`'s keys, checked
    build_block(OptimizerConfig, value, "optimizer")      # -> OptimizerConfig(...), validated in __post_init__

A wrong key is a `ConfigKeyError` naming it and the nearest valid one ("unknown config key 'dpo.betta'; did you
mean 'dpo.beta'?"); a value of the wrong type one naming the key and the type expected. Types are checked
loosely where configs legitimately differ: an int is a float, a list is a tuple (JSON has no tuples), a
ConfigDict is a dict. A key made with `choices=` takes one of them (the one home of those choices). A block whose
class names an `EXTRA_KEYS` field keeps the keys it does not declare there (the reward's constructor arguments); one
with a `migrate(values, where)` classmethod has its completed values passed through it before they are used (a
deprecated key moved to its new home). No jax here: configs import this module.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable, Mapping, Optional

from jaxrl.utils.registry import nearest

__all__ = ["ANY", "ConfigKeyError", "Key", "block", "build_block", "complete_block", "defaults_of", "is_block",
           "keys_of", "setting", "to_plain", "unknown_key_error"]

ANY = None  # setting(types=ANY): any value
_KEY = "jaxrl_key"  # dataclasses.field metadata: the field's Key


class ConfigKeyError(ValueError):
    """A config key that does not exist, or a value of the wrong type; the message names the key."""


def to_plain(value: Any) -> Any:
    """ConfigDicts and config dataclasses (and tuples inside them) as plain Python: dicts and lists, as
    config.json holds them."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


def unknown_key_error(where: str, key: str, valid: Iterable[str]) -> ConfigKeyError:
    """The error for `key` of block `where` ("" = top level) that is none of `valid`."""
    valid = sorted(valid)
    name = f"{where}.{key}" if where else key
    close = nearest(key, valid)
    hint = f"; did you mean {(f'{where}.' if where else '') + close!r}?" if close else ""
    return ConfigKeyError(f"unknown config key {name!r}{hint} (valid keys{f' of {where}' if where else ''}: "
                          f"{', '.join(valid)})")


_LOOSE = {float: (float, int), tuple: (tuple, list), list: (list, tuple), dict: (dict, Mapping)}


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: its default, the types its values may have (ANY: any), and what it means."""

    default: Any
    types: Any = ()  # a type, a tuple of types, ANY; () = the type of the default
    doc: str = ""
    choices: tuple = ()  # the values it may take; () = any of its types
    block: Any = None  # a nested block's class (its value is that block's keys)

    def accepted(self) -> Optional[tuple]:
        types = self.types
        if types is ANY:
            return None
        if types == ():
            types = type(self.default)
        types = types if isinstance(types, tuple) else (types,)
        out = []
        for t in types:
            out.extend(_LOOSE.get(t, (t,)))
        if hasattr(self.default, "to_dict") or isinstance(self.default, Mapping):
            out.append(Mapping)
        return tuple(out)

    def check(self, name: str, value: Any) -> None:
        accepted = self.accepted()
        if accepted is None or (value is None and (self.default is None or type(None) in accepted)):
            return
        if hasattr(value, "to_dict") and any(t in (dict, Mapping) for t in accepted):
            return
        if isinstance(value, bool) and bool not in accepted and any(t in (int, float) for t in accepted):
            ok = False  # True is an int to Python, not to a reader of the config
        else:
            ok = isinstance(value, accepted)
        if not ok:
            names = sorted({getattr(t, "__name__", str(t)) for t in accepted})
            raise ConfigKeyError(f"config key {name}={value!r}: expected {' or '.join(names)}, got "
                                 f"{type(value).__name__}")
        if self.choices and value not in self.choices:
            raise ConfigKeyError(f"{name}={value!r}; choose one of {self.choices}")

    def convert(self, value: Any) -> Any:
        """`value` (already checked) in the form the dataclass holds: plain Python, a float where the default is
        a float, a tuple where the default is a tuple."""
        value = to_plain(value)
        types = self.types if isinstance(self.types, tuple) else (self.types,)
        floats = isinstance(self.default, float) or float in types
        if floats and isinstance(value, int) and not isinstance(value, bool):  # 0 from a command line is 0.0
            return float(value)
        if isinstance(self.default, tuple) and isinstance(value, list):
            return tuple(value)
        return value


def setting(default: Any, types: Any = (), doc: str = "", choices: tuple = ()) -> Any:
    """A dataclass field that is a config key: its one default, accepted types (() = the default's type, ANY =
    any), meaning, and the values it may take (`choices`, () = any). Mutable defaults (dicts, lists) are copied
    for every instance."""
    key = Key(default, types, doc, tuple(choices))
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={_KEY: key})
    return dataclasses.field(default=default, metadata={_KEY: key})


def block(cls, doc: str = "") -> Any:
    """A dataclass field that is a nested block of keys (`grpo.rollout_server.concurrency`): `cls`, a config
    block class, at its defaults unless the config sets some of its keys."""
    return dataclasses.field(default_factory=cls, metadata={_KEY: Key(None, cls, doc, block=cls)})


def is_block(cls: Any) -> bool:
    """Whether `cls` is a config block class (a dataclass whose fields are `setting`s)."""
    return isinstance(cls, type) and dataclasses.is_dataclass(cls)


def keys_of(cls) -> dict[str, Key]:
    """{key: Key} of a block class, in field order (the `EXTRA_KEYS` field, not a key itself, left out)."""
    extra = getattr(cls, "EXTRA_KEYS", None)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name == extra or not f.init:
            continue
        key = f.metadata.get(_KEY)
        if key is None:  # a plain dataclass field: its default is its key's default
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore
            key = Key(default)
        out[f.name] = key
    return out


def defaults_of(cls) -> dict:
    """{key: default} of a block class; a nested block's default is the dict of its own defaults."""
    return {k: defaults_of(v.block) if v.block else copy.deepcopy(v.default) for k, v in keys_of(cls).items()}


def _items(value: Any, where: str) -> list:
    if value is None:
        return []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = to_plain(value)
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        raise ConfigKeyError(f"config key {where}: expected a block of keys, got {type(value).__name__} {value!r}")
    return list(value.items())


def complete_block(cls, value: Any, where: str) -> dict:
    """The block `value` (a mapping or None) as plain Python with every key: the defaults of `cls` overlaid with
    the keys given, each checked (ConfigKeyError for an unknown key unless the class keeps extra keys, or a
    value of the wrong type). Key order: the class's, then extra keys as given."""
    keys = keys_of(cls)
    extra = getattr(cls, "EXTRA_KEYS", None)
    out = defaults_of(cls)
    for key, v in _items(value, where):
        if key in keys and keys[key].block:
            out[key] = complete_block(keys[key].block, v, f"{where}.{key}")
        elif key in keys:
            keys[key].check(f"{where}.{key}", v)
            out[key] = keys[key].convert(v)
        elif extra:
            out[key] = to_plain(v)
        else:
            raise unknown_key_error(where, key, keys)
    migrate = getattr(cls, "migrate", None)
    return migrate(out, where) if migrate else out


def build_block(cls, value: Any, where: str):
    """`cls` from the block `value` (complete_block, then the class's own validation in __post_init__)."""
    values = complete_block(cls, value, where)
    extra = getattr(cls, "EXTRA_KEYS", None)
    keys = keys_of(cls)
    kwargs = {k: build_block(keys[k].block, v, f"{where}.{k}") if keys[k].block else v
              for k, v in values.items() if k in keys}
    if extra:
        kwargs[extra] = {k: v for k, v in values.items() if k not in keys}
    return cls(**kwargs)
