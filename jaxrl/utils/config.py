"""Typed config blocks: one default per key, in one place, and unknown keys rejected with the nearest valid name.

    OPTIMIZER = Block("optimizer", learning_rate=Key(1e-6, float, "peak learning rate"), ...)
    OPTIMIZER.resolve(config.get("optimizer"))   # {key: value}: the defaults overlaid with the keys given
    schema = Schema(TOP_KEYS, {"optimizer": OPTIMIZER, ...})
    schema.resolve(config)                       # fills a ConfigDict in place (missing keys and blocks get their
                                                 # defaults), checks every key and type; returns it
    schema.defaults()                            # the whole default config as a plain dict

A wrong key is a `ConfigKeyError` naming it and the nearest valid one ("unknown config key 'dpo.betta'; did you
mean 'dpo.beta'?"); a value of the wrong type one naming the key and the type expected. Types are checked
loosely where configs legitimately differ: an int is a float, a list is a tuple (JSON has no tuples), a
ConfigDict is a dict. No jax here: configs import this module.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterable, Mapping, Optional

import ml_collections

from jaxrl.utils.registry import nearest

__all__ = ["ANY", "Block", "ConfigKeyError", "Key", "Schema", "to_plain", "unknown_key_error"]

ANY = None  # Key(types=ANY): any value


class ConfigKeyError(ValueError):
    """A config key that does not exist, or a value of the wrong type; the message names the key."""


def to_plain(value: Any) -> Any:
    """ConfigDicts (and tuples inside them) as plain Python: dicts and lists, as config.json holds them."""
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


class Block:
    """A named set of keys (a nested ConfigDict such as `config.optimizer`). `extra`: keys beyond these are
    allowed (and checked by whoever reads them, e.g. a reward's constructor arguments)."""

    def __init__(self, name: str, keys: Mapping[str, Key], *, extra: bool = False, doc: str = ""):
        self.name, self.keys, self.extra, self.doc = name, dict(keys), extra, doc

    def __repr__(self) -> str:
        return f"Block({self.name!r}, {sorted(self.keys)})"

    def defaults(self) -> dict:
        return {k: copy.deepcopy(v.default) for k, v in self.keys.items()}

    def check(self, value: Any, where: Optional[str] = None) -> None:
        """ConfigKeyError for an unknown key (unless `extra`) or a value of the wrong type."""
        where = self.name if where is None else where
        for key, v in _items(value):
            if key in self.keys:
                self.keys[key].check(f"{where}.{key}", v)
            elif not self.extra:
                raise unknown_key_error(where, key, self.keys)

    def resolve(self, value: Any, where: Optional[str] = None) -> dict:
        """The block as a plain dict: the defaults overlaid with the keys `value` (a ConfigDict, a dict or None)
        gives, after `check`."""
        self.check(value, where)
        out = self.defaults()
        out.update({k: to_plain(v) for k, v in _items(value)})
        return out

    def extras(self, value: Any) -> dict:
        """The keys of `value` that are not keys of this block (those an `extra` block passes on)."""
        return {k: to_plain(v) for k, v in _items(value) if k not in self.keys}


def _items(value: Any):
    if value is None:
        return []
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        raise ConfigKeyError(f"expected a block of keys, got {type(value).__name__} {value!r}")
    return list(value.items())


class Schema:
    """The keys of a whole config: top-level keys and nested blocks."""

    def __init__(self, keys: Mapping[str, Key], blocks: Mapping[str, Block]):
        self.keys, self.blocks = dict(keys), dict(blocks)

    def defaults(self) -> dict:
        out = {k: copy.deepcopy(v.default) for k, v in self.keys.items()}
        out.update({name: block.defaults() for name, block in self.blocks.items()})
        return out

    def config_dict(self) -> ml_collections.ConfigDict:
        """The default config as a ConfigDict (what configs/base.py returns)."""
        return ml_collections.ConfigDict(self.defaults())

    def resolve(self, config, *, strict: bool = True):
        """Fill `config` (a ConfigDict) in place: every missing key and block gets its default; every key and
        type is checked (`strict`: a top-level key that is neither a key nor a block is an error). Returns it."""
        for key, value in list(_items(config)):
            if key in self.keys:
                self.keys[key].check(key, value)
            elif key in self.blocks:
                self.blocks[key].check(value, key)
            elif strict:
                raise unknown_key_error("", key, list(self.keys) + list(self.blocks))
        for key, spec in self.keys.items():
            if key not in config:
                config[key] = _value(copy.deepcopy(spec.default))
        for name, block in self.blocks.items():
            if config.get(name, None) is None:
                config[name] = ml_collections.ConfigDict(block.defaults())
            else:
                for key, spec in block.keys.items():
                    if key not in config[name]:
                        config[name][key] = _value(copy.deepcopy(spec.default))
        return config


def _value(v: Any) -> Any:
    if isinstance(v, Mapping):
        return ml_collections.ConfigDict(dict(v))
    return v

