"""absl flags made from a config dataclass: each setting's name, type, default and help are declared once, on its
field, and both the launcher's flags and the config it builds from them follow from that declaration.

    @dataclasses.dataclass
    class Config:
        out: str = flag_field(help="Output file.")                                  # required: flag default None
        num_samples: int = flag_field(8, help="Samples per problem.")
        dtype: str = flag_field("bfloat16", help="Compute dtype.", choices=("bfloat16", "float32"))
        buckets: tuple[int, ...] = flag_field((), help="Prompt lengths.")          # --buckets=32,64
        filters: list[str] = flag_field(default_factory=list, help="A filter.")     # --filters=a --filters=b
        options: dict = flag_field(default_factory=dict, help="JSON options.")     # --options='{"a": 1}'
        specs: list = dataclasses.field(default_factory=list, metadata=NOT_A_FLAG)

    holders = define_flags(Config, flag_values)        # {field name: FlagHolder}
    cfg = config_from_flags(Config, holders, specs=[...])   # after parsing; keyword values are taken as given

Flag kinds by field type: str -> DEFINE_string, int -> DEFINE_integer, float -> DEFINE_float, bool -> DEFINE_bool,
a field with `choices` -> DEFINE_enum, tuple[X, ...] -> DEFINE_list (items converted to X), list[X] -> DEFINE_multi_X
(a flag given once per value; X str, int or float), dict -> DEFINE_string holding a JSON object; Optional[X] is X
with None allowed. A field's `parse` (flag value -> field value, raising app.UsageError) replaces the conversion.
Every field is a flag unless its metadata is NOT_A_FLAG.

`define_flags(..., mark_required=True)` makes absl refuse a missing required flag while it parses (absl's own
message), for a launcher whose users have seen that message; otherwise `check_required` / `config_from_flags` say
"--NAME is required".

Flags that are not config fields are defined from a table of (name, kind, default, [enum values,] help) with
`define_table`. This module disclaims its flag definitions (absl's key flags): a flag belongs to the module that
calls `define_flags` / `define_table`, so a launcher that adopts that module's key flags lists them in --help.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Callable, Mapping, Optional, Sequence

from absl import app, flags

__all__ = ["NOT_A_FLAG", "check_required", "config_from_flags", "define_flags", "define_table", "flag_field",
           "flag_names", "required_names"]

flags.disclaim_key_flags()  # the flags defined below belong to the module that asks for them (docstring)

NOT_A_FLAG = types.MappingProxyType({"flag": False})  # metadata of a config field that no flag sets
_ITEM_NAMES = {int: "integers", float: "numbers"}  # for "--x: expected integers, got ..."
_MULTI_KINDS = {str: "multi_string", int: "multi_integer", float: "multi_float"}  # list[X] fields


def flag_field(default: Any = dataclasses.MISSING, *, help: str,  # noqa: A002 (the word absl uses)
               default_factory: Any = dataclasses.MISSING, choices: Optional[Sequence[str]] = None,
               parse: Optional[Callable[[Any], Any]] = None, bounds: Optional[tuple] = None) -> Any:
    """A dataclass field that is also a flag: its default, its help text, its enum `choices`, `parse` (the
    flag value -> the field value, for a value that needs more than the conversion of its type) and `bounds`
    ((lowest, highest) allowed, either None = open; an integer or float flag, checked by absl while it parses).
    Without a default (and default_factory) the field is required and its flag defaults to None."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "parse": parse,
                "bounds": bounds}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class _FlagSpec:
    name: str
    kind: str  # string | integer | float | bool | enum | list | multi | json
    default: Any  # the field's default as the flag holds it (None for a required field)
    required: bool
    help: str
    choices: Optional[tuple] = None
    item: Optional[type] = None  # list and multi flags: the type of the items
    parse: Optional[Callable[[Any], Any]] = None
    bounds: Optional[tuple] = None  # integer and float flags: (lower_bound, upper_bound) for absl


_KINDS = {str: "string", int: "integer", float: "float", bool: "bool", dict: "json"}


def _without_none(tp: Any) -> Any:
    """X of Optional[X] (or X | None); other types unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _spec(cls: type, field: dataclasses.Field, tp: Any) -> _FlagSpec:
    where = f"{cls.__name__}.{field.name}"
    if not field.metadata.get("help"):
        raise TypeError(f"{where}: a config field needs help text (flag_field(..., help=...)) or "
                        f"metadata=NOT_A_FLAG")
    tp = _without_none(tp)
    item = None
    if field.metadata.get("choices"):
        kind = "enum"
    elif typing.get_origin(tp) is tuple:
        items = {a for a in typing.get_args(tp) if a is not Ellipsis}
        if len(items) != 1:
            raise TypeError(f"{where}: a tuple flag needs one item type (tuple[int, ...]), got {tp}")
        kind, item = "list", items.pop()
    elif typing.get_origin(tp) is list:
        items = typing.get_args(tp)
        if len(items) != 1 or items[0] not in _MULTI_KINDS:
            raise TypeError(f"{where}: a repeated flag needs one item type, str, int or float (list[str]), got "
                            f"{tp}")
        kind, item = "multi", items[0]
    elif tp in _KINDS:
        kind = _KINDS[tp]
    else:
        raise TypeError(f"{where}: no flag kind for type {tp}; use str, int, float, bool, tuple[X, ...], list[X], "
                        f"dict, Optional of one of them, or metadata=NOT_A_FLAG")
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        default = None
    if default is not None and kind == "list":
        default = [str(v) for v in default]  # as a command line gives them
    elif default is not None and kind == "multi":
        default = list(default)
    elif default is not None and kind == "json":
        default = json.dumps(default)
    required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    bounds = field.metadata.get("bounds")
    if bounds is not None and kind not in ("integer", "float"):
        raise TypeError(f"{where}: bounds are for integer and float flags, not {kind}")
    return _FlagSpec(field.name, kind, default, required, field.metadata["help"], field.metadata.get("choices"),
                     item, field.metadata.get("parse"), bounds)


def _specs(cls: type) -> list[_FlagSpec]:
    hints = typing.get_type_hints(cls)
    return [_spec(cls, f, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("flag", True)]


def flag_names(cls: type) -> tuple[str, ...]:
    """The flag names of the config dataclass `cls` (its fields, less the NOT_A_FLAG ones)."""
    return tuple(s.name for s in _specs(cls))


def required_names(cls: type) -> tuple[str, ...]:
    """The flag names of the required fields of the config dataclass `cls` (no default)."""
    return tuple(s.name for s in _specs(cls) if s.required)


def define_flags(cls: type, flag_values: flags.FlagValues = flags.FLAGS, *,
                 mark_required: bool = False) -> dict[str, flags.FlagHolder]:
    """Defines a flag for every field of the config dataclass `cls` (module docstring); returns the holders.
    `mark_required`: absl refuses a command line without the required ones while it parses."""
    holders = {}
    for s in _specs(cls):
        kind = {"json": "string", "multi": _MULTI_KINDS.get(s.item)}.get(s.kind, s.kind)
        extra = (list(s.choices),) if s.kind == "enum" else ()
        bounded = {"lower_bound": s.bounds[0], "upper_bound": s.bounds[1]} if s.bounds else {}
        holders[s.name] = getattr(flags, f"DEFINE_{kind}")(s.name, s.default, *extra, s.help,
                                                           flag_values=flag_values, **bounded)
    if mark_required and required_names(cls):
        flags.mark_flags_as_required(required_names(cls), flag_values=flag_values)
    return holders


def define_table(table: Sequence[tuple], flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, flags.FlagHolder]:
    """Defines the flags of a table of (name, absl kind, default, [enum values,] help); returns the holders."""
    holders = {}
    for name, kind, default, *rest in table:
        holders[name] = getattr(flags, f"DEFINE_{kind}")(name, default, *rest, flag_values=flag_values)
    return holders


def check_required(cls: type, holders: Mapping[str, flags.FlagHolder], given: Sequence[str] = ()) -> None:
    """app.UsageError "--NAME is required" for the first required field of `cls` (less the `given` ones) whose
    flag has no value."""
    for s in _specs(cls):
        if s.required and s.name not in given and holders[s.name].value in (None, ""):
            raise app.UsageError(f"--{s.name} is required")


def _convert(s: _FlagSpec, value: Any) -> Any:
    """The field value of flag value `value`; app.UsageError naming the flag."""
    if value is None:
        return None
    if s.parse is not None:
        return s.parse(value)
    if s.kind == "list":
        try:
            return tuple(s.item(v) for v in value)
        except ValueError:
            raise app.UsageError(f"--{s.name}: expected {_ITEM_NAMES.get(s.item, s.item.__name__)}, got "
                                 f"{','.join(value)}") from None
    if s.kind == "multi":
        return list(value)  # absl converted the items
    if s.kind == "json":
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise app.UsageError(f"--{s.name}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(parsed, dict):
            raise app.UsageError(f"--{s.name}: expected a JSON object, got {value}")
        return parsed
    return value


def config_from_flags(cls: type, holders: Mapping[str, flags.FlagHolder], **given: Any) -> Any:
    """An instance of the config dataclass `cls` from parsed flags: each field from its flag's value (converted to
    the field's type), or from `given` where named there (and the fields that are not flags). A required field
    without a value and every value that does not convert are app.UsageError naming the flag; the conversion
    errors of several flags are reported together."""
    check_required(cls, holders, given)
    values, errors = {}, []
    for s in _specs(cls):
        if s.name in given:
            continue
        try:
            values[s.name] = _convert(s, holders[s.name].value)
        except app.UsageError as e:
            errors.append(str(e))
    if errors:
        raise app.UsageError("; ".join(errors))
    return cls(**values, **given)
