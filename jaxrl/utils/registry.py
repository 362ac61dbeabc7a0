"""Named registries and the one resolver of "module:attr" / "file.py:attr" references.

Every registry of the project is a `Registry`: the DPO losses, advantage and KL estimators, rewards and trainers.

    KL_ESTIMATORS = Registry("kl")
    @KL_ESTIMATORS.register("k1")
    def kl_k1(logp, ref_logp): ...
    KL_ESTIMATORS.get("k1"); KL_ESTIMATORS.names(); "k1" in KL_ESTIMATORS

    obj = resolve("package.module:attr")        # or "path/to/file.py:attr"; PluginError naming what is wrong
    __getattr__ = lazy_exports(__name__, {"Thing": "package.module"})   # a package's names, imported on use

A registry adds what it is given, unchecked: it is how a module lists its own built-ins. User plug-ins come in
through `jaxrl.algorithms.plugins`, which checks them on example inputs first. An entry may carry `info` for its
users (a DPO loss: the LossSpec of what it reads). `lazy={name: "module:attr"}` names entries resolved on first
use, so a registry can list heavy built-ins without importing them.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from typing import Any, Callable, Iterable, Mapping, Optional

__all__ = ["PluginError", "Registry", "import_file", "lazy_exports", "nearest", "origin_of", "resolve"]


class PluginError(ValueError):
    """A plug-in could not be imported, or failed its check on example inputs."""


def nearest(name: str, candidates: Iterable[str]) -> Optional[str]:
    """The candidate closest to `name` (difflib), None when nothing is close: for "did you mean" hints."""
    found = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=1, cutoff=0.6)
    return found[0] if found else None


def _is_file(target: str) -> bool:
    return target.endswith(".py") or os.sep in target or "/" in target


def import_file(path: str, prefix: str = "jaxrl_plugin"):
    """The module of a Python file (a plug-in, a config or sweep file) under a stable name unique to the file,
    kept in sys.modules so its own dataclasses, pickling and relative look-ups work, and a re-load (resume)
    replaces rather than duplicates it. ImportError when the file cannot be loaded as a module."""
    path = os.path.abspath(os.path.expanduser(path))
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    stem = re.sub(r"[^A-Za-z0-9_]", "_", os.path.splitext(os.path.basename(path))[0])
    modname = f"{prefix}_{stem}_{digest}"
    mspec = importlib.util.spec_from_file_location(modname, path)
    if mspec is None or mspec.loader is None:
        raise ImportError(f"{path}: cannot import")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[modname] = module
    try:
        mspec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(modname, None)
        raise
    return module


def resolve(spec: str, *, callable_only: bool = True) -> Any:
    """The object `spec` names: "package.module:attr" or "path/to/file.py:attr" (a path is taken from the
    working directory). Any failure (no such file or module, an import error inside it, no such attribute, not
    callable) raises PluginError naming the spec."""
    if not isinstance(spec, str) or ":" not in spec:
        raise PluginError(f"plug-in {spec!r}: expected 'path/to/file.py:function' or 'package.module:function'")
    target, attr = spec.rsplit(":", 1)
    if not attr.isidentifier():
        raise PluginError(f"plug-in {spec!r}: {attr!r} is not a function name")
    try:
        if _is_file(target):
            path = os.path.abspath(os.path.expanduser(target))
            if not os.path.isfile(path):
                raise PluginError(f"plug-in {spec!r}: file {path} does not exist")
            module = import_file(path)
        else:
            module = importlib.import_module(target)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the plug-in named
        raise PluginError(f"plug-in {spec!r}: importing {target} failed: {type(e).__name__}: {e}") from e
    try:
        obj = getattr(module, attr)
    except AttributeError:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise PluginError(f"plug-in {spec!r}: {target} defines no {attr!r}; it has: {', '.join(public)}") from None
    if callable_only and not callable(obj):
        raise PluginError(f"plug-in {spec!r}: {attr} is a {type(obj).__name__}, not a function")
    return obj


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module-level `__getattr__` (PEP 562) that imports `exports[name]` (a module) on first use of
    `name`: a package whose settings module must stay light (configs import it without jax) can still offer its
    heavy classes at the top (`from jaxrl.backends import JaxBackend`)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__


def origin_of(obj: Any) -> str:
    """Where `obj` is defined, "module:qualname": the same for a module imported again (a plug-in file re-loaded
    on resume), so a registry can tell a re-registration from a clash."""
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


class Registry:
    """Entries of one kind by name (module docstring). `hint` ends the error for an unknown name."""

    def __init__(self, kind: str, *, lazy: Optional[Mapping[str, str]] = None, hint: str = ""):
        self.kind, self.hint = kind, hint
        self._lazy = dict(lazy or {})  # name -> "module:attr", resolved (and registered) on first use
        self._entries: dict[str, Any] = {}
        self._origins: dict[str, str] = {}
        self._info: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self.names())} entries)"

    def register(self, name: str, *, info: Any = None) -> Callable:
        """Decorator: ``@registry.register("name")`` adds the object under `name` and returns it unchanged."""

        def deco(obj):
            self.add(name, obj, info=info)
            return obj

        return deco

    def add(self, name: str, obj: Any, *, overwrite: bool = False, origin: Optional[str] = None,
            info: Any = None) -> Any:
        """Add `obj` as `name`. Taking a name held by an entry from elsewhere is a KeyError unless `overwrite`;
        the same origin again (a module imported twice) replaces the entry."""
        if not callable(obj):
            raise TypeError(f"{self.kind} {name!r}: {obj!r} is not callable")
        where = origin or origin_of(obj)
        have = self.origin(name)
        if have is not None and not overwrite and have != where:
            raise KeyError(f"{self.kind} {name!r} is already registered (from {have}); pick another name")
        self._lazy.pop(name, None)
        self._entries[name] = obj
        self._origins[name] = where
        self._info[name] = info
        return obj

    def get(self, name: str) -> Any:
        """The entry registered as `name`; a KeyError lists what exists and the nearest name."""
        if name not in self._entries and name in self._lazy:
            spec = self._lazy[name]
            self.add(name, resolve(spec), origin=spec)
        try:
            return self._entries[name]
        except KeyError:
            close = nearest(name, self.names())
            raise KeyError(f"unknown {self.kind} {name!r}" + (f" (did you mean {close!r}?)" if close else "") +
                           f"; registered: {', '.join(self.names()) or '(none)'}" +
                           (f". {self.hint}" if self.hint else "")) from None

    def info(self, name: str) -> Any:
        """The `info` the entry was added with (None when none); a KeyError for an unknown name."""
        self.get(name)
        return self._info.get(name)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(set(self._entries) | set(self._lazy)))

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._lazy

    def origin(self, name: str) -> Optional[str]:
        """Where the entry `name` comes from ("module:qualname" or its lazy "module:attr"), None if absent."""
        return self._origins.get(name) or self._lazy.get(name)

    def unregister(self, name: str) -> None:
        """Remove `name` (no error if absent); for tests and interactive sessions."""
        for table in (self._entries, self._origins, self._info, self._lazy):
            table.pop(name, None)
