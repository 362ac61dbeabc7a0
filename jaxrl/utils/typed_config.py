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
ConfigDict is a dict. A key made with `choices=` takes one of them (the one home of those choices).

Blocks that derive from `Block` may say more about themselves: `EXTRA_KEYS` names a field that keeps the keys the
class does not declare (the reward's constructor arguments); `RETIRED_KEYS` lists keys a block no longer has,
accepted (and dropped) at their old default so that a config.json written before still resolves, refused with the
reason otherwise; `migrate(values, where)` gets the completed values before they are used (a deprecated key moved
to its new home). A `Block` composed of parts (`class GRPOConfig(SamplingSettings, ...)`) names itself in `NAME`,
and each part checks its own keys in a cooperative `__post_init__` (each calls `super().__post_init__()`).
Blocks of a user's algorithm may be plain dataclasses: they then have none of these. No jax here: configs import
this module.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, ClassVar, Iterable, Mapping, Optional

import ml_collections

from jaxrl.utils.registry import nearest

__all__ = ["ANY", "Block", "ConfigKeyError", "Key", "at_least", "block", "block_json", "build_block", "check_finite",
           "complete_block",
           "defaults_of", "is_block", "is_config_dict", "keys_of", "plain_mapping", "setting", "to_plain",
           "unknown_key_error", "without_retired"]

ANY = None  # setting(types=ANY): any value
_KEY = "jaxrl_key"  # dataclasses.field metadata: the field's Key


class ConfigKeyError(ValueError):
    """A config key that does not exist, or a value of the wrong type; the message names the key."""


@dataclasses.dataclass(frozen=True)
class Block:
    """Base of config blocks (module docstring): what a block may say about its keys beyond their fields."""

    NAME: ClassVar[str] = ""  # the block's name in messages (a block composed of parts: grpo, ppo, ...)
    EXTRA_KEYS: ClassVar[Optional[str]] = None  # the field that keeps undeclared keys
    RETIRED_KEYS: ClassVar[Mapping[str, tuple]] = {}  # key -> (its old default, why it is gone)

    @classmethod
    def migrate(cls, values: dict, where: str) -> dict:
        """The completed values, deprecated keys moved to their homes (a subclass's; here: as they are)."""
        return values

    def __post_init__(self):
        # the end of the parts' cooperative checks: after their own (whose messages say more), no float setting
        # may be NaN or infinite -- a NaN passes every `x < lo` check and would reach the run
        if self.NAME:
            check_finite(self, self.NAME)


def check_finite(obj, where: str) -> None:
    """ValueError naming `where.key` for the first float setting of the block `obj` that is NaN or infinite."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name, None)
        if _KEY in f.metadata and isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where}.{f.name} must be a finite number, got {value}")


def _block_protocol(cls) -> tuple[Optional[str], Mapping[str, tuple]]:
    """(EXTRA_KEYS, RETIRED_KEYS) of a block class: a `Block`'s own, none for a plain dataclass (a user's)."""
    if isinstance(cls, type) and issubclass(cls, Block):
        return cls.EXTRA_KEYS, cls.RETIRED_KEYS
    return None, {}


def at_least(where: str, minimums: Mapping[str, int], obj) -> None:
    """ValueError naming `where.key` for the first of `minimums` ({key: lowest value}) that `obj` holds below it."""
    for key, minimum in minimums.items():
        value = getattr(obj, key)
        if value < minimum:
            raise ValueError(f"{where}.{key} must be >= {minimum}, got {value}")


def is_config_dict(value: Any) -> bool:
    """Whether `value` is an ml_collections ConfigDict (a family file's config, or a block of one)."""
    return isinstance(value, ml_collections.ConfigDict)


def plain_mapping(value: Any) -> Any:
    """A ConfigDict as the plain dict it holds; anything else as it is."""
    return value.to_dict() if is_config_dict(value) else value


def to_plain(value: Any) -> Any:
    """ConfigDicts and config dataclasses (and tuples inside them) as plain Python: dicts and lists, as
    config.json holds them."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    value = plain_mapping(value)
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
        if is_config_dict(self.default) or isinstance(self.default, Mapping):
            out.append(Mapping)
        return tuple(out)

    def check(self, name: str, value: Any) -> None:
        accepted = self.accepted()
        if accepted is None or (value is None and (self.default is None or type(None) in accepted)):
            return
        if is_config_dict(value) and any(t in (dict, Mapping) for t in accepted):
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
    extra, _ = _block_protocol(cls)
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
    value = plain_mapping(value)
    if not isinstance(value, Mapping):
        raise ConfigKeyError(f"config key {where}: expected a block of keys, got {type(value).__name__} {value!r}")
    return list(value.items())


def complete_block(cls, value: Any, where: str) -> dict:
    """The block `value` (a mapping or None) as plain Python with every key: the defaults of `cls` overlaid with
    the keys given, each checked (ConfigKeyError for an unknown key unless the class keeps extra keys, or a
    value of the wrong type; a retired key at anything but its old default). Key order: the class's, then extra
    keys as given."""
    keys = keys_of(cls)
    extra, retired = _block_protocol(cls)
    out = defaults_of(cls)
    for key, v in _items(value, where):
        if key in retired and key not in keys:
            old_default, why = retired[key]
            if to_plain(v) != to_plain(old_default):
                raise ConfigKeyError(f"config key {where}.{key}={v!r}: {why}")
            continue  # a config.json written when the block still had it, at its default: nothing to keep
        if key in keys and keys[key].block:
            out[key] = complete_block(keys[key].block, v, f"{where}.{key}")
        elif key in keys:
            keys[key].check(f"{where}.{key}", v)
            out[key] = keys[key].convert(v)
        elif extra:
            out[key] = to_plain(v)
        else:
            raise unknown_key_error(where, key, keys)
    return cls.migrate(out, where) if isinstance(cls, type) and issubclass(cls, Block) else out


def without_retired(cls, values: Mapping[str, Any]) -> dict:
    """A block's keys as an earlier version wrote them, less the keys `cls` has retired (its RETIRED_KEYS)."""
    _, retired = _block_protocol(cls)
    return {k: v for k, v in values.items() if k not in retired}


def block_json(value: Any) -> dict:
    """A built block as config.json holds it: plain values, its extra keys (EXTRA_KEYS) beside the declared ones,
    as the config gives them."""
    plain = to_plain(value)
    extra, _ = _block_protocol(type(value))
    if extra:
        plain.update(plain.pop(extra))
    return plain


def build_block(cls, value: Any, where: str):
    """`cls` from the block `value` (complete_block, then the class's own validation in __post_init__)."""
    values = complete_block(cls, value, where)
    extra, _ = _block_protocol(cls)
    keys = keys_of(cls)
    kwargs = {k: build_block(keys[k].block, v, f"{where}.{k}") if keys[k].block else v
              for k, v in values.items() if k in keys}
    if extra:
        kwargs[extra] = {k: v for k, v in values.items() if k not in keys}
    built = cls(**kwargs)
    check_finite(built, where)  # a block without a NAME is named here
    return built
