"""The `plugins` config section: user objectives from the user's own Python files, loaded and checked BEFORE the
model is built, then used by name from any algorithm's config.

    c.plugins = (
        {"kind": "dpo_loss", "name": "margin_dpo", "path": "my_losses.py:margin_dpo"},
        "advantage:centered=my_pkg.estimators:centered",        # "kind:name=path:fn"
        "kl:my_kl.py:squared",                                   # "kind:path:fn" (name = function name)
    )
    c.dpo.loss_type = "margin_dpo"          # or grpo.advantage_estimator=centered, grpo.kl_estimator=squared,
                                            # reward.name=my_reward

Kinds (`jaxrl.algorithms.registry`): `dpo_loss`, `advantage`, `kl` (checked: signature, output shape,
finiteness, under jax.jit and jax.grad) and `reward` (a function `fn(completion, problem, **kwargs) -> bool |
float in [0, 1] | RewardResult` is called on two example completions of a toy problem; a Reward class must have
`score`). Anything wrong raises `jaxrl.utils.registry.PluginError` naming the entry (`plugins[i]`), the file and
what was wrong. The DPO block's `dpo.plugin` ("file.py:fn,...") goes through the same loader
(`dpo_plugin_entries`).

`run_training` calls `load_config_plugins(config)` first thing, so `launchers.train`, the sweep runner and any
script get the same fail-fast behaviour. `python -m jaxrl.algorithms.plugins CONFIG.json` checks a resolved
config's plug-ins on the CPU (what `launchers.sweep` runs before it starts any point).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Optional

from absl import logging

from jaxrl.algorithms import registry
from jaxrl.utils.registry import PluginError

KINDS = registry.kinds()


@dataclasses.dataclass(frozen=True)
class PluginEntry:
    kind: str
    name: str  # "" = the function's own name
    path: str  # "file.py:fn" or "package.module:fn"
    where: str = "plugins"  # for errors: which config entry this is

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "path": self.path}


def _parse_string(text: str, where: str) -> PluginEntry:
    """'kind:name=path:fn' or 'kind:path:fn'."""
    kind, sep, rest = text.partition(":")
    if not sep or not rest:
        raise PluginError(f"{where}={text!r}: expected 'kind:name=path/to/file.py:function' (kinds: "
                          f"{', '.join(KINDS)})")
    name, eq, path = rest.partition("=")
    if not eq:
        name, path = "", rest
    return PluginEntry(kind.strip(), name.strip(), path.strip(), where)


def parse_plugins(value: Any, where: str = "plugins") -> list[PluginEntry]:
    """The entries of a `plugins` section: a list/tuple of dicts {"kind", "name", "path"} or strings; a single
    string may hold several entries separated by ';'. Raises PluginError naming the entry."""
    if value is None or value == "" or value == ():
        return []
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, str):
        value = [s for s in (p.strip() for p in value.split(";")) if s]
    if isinstance(value, dict):
        value = [value]
    out = []
    for i, item in enumerate(value):
        w = f"{where}[{i}]"
        if hasattr(item, "to_dict"):
            item = item.to_dict()
        if isinstance(item, str):
            entry = _parse_string(item, w)
        elif isinstance(item, dict):
            unknown = sorted(set(item) - {"kind", "name", "path"})
            if unknown or "kind" not in item or "path" not in item:
                raise PluginError(f"{w}={item!r}: expected keys 'kind', 'path' and optionally 'name'"
                                  + (f"; unknown keys {unknown}" if unknown else ""))
            entry = PluginEntry(str(item["kind"]), str(item.get("name") or ""), str(item["path"]), w)
        else:
            raise PluginError(f"{w}: expected a dict {{'kind', 'name', 'path'}} or a 'kind:name=path:fn' string, "
                              f"got {type(item).__name__}")
        if entry.kind not in KINDS:
            raise PluginError(f"{w}: unknown plug-in kind {entry.kind!r}; kinds: {', '.join(KINDS)}")
        if ":" not in entry.path:
            raise PluginError(f"{w}: path {entry.path!r} must be 'path/to/file.py:function' or "
                              "'package.module:function'")
        out.append(entry)
    return out


def absolute_paths(value: Any, base_dir: str) -> list[dict]:
    """The section with file paths made absolute (relative ones taken from `base_dir`), as dicts: a resolved
    config then loads the same files from any working directory (sweep points, cluster jobs)."""
    out = []
    for e in parse_plugins(value):
        target, _, attr = e.path.rpartition(":")
        if target.endswith(".py") or "/" in target or os.sep in target:
            target = os.path.abspath(os.path.join(base_dir, os.path.expanduser(target)))
        out.append(dataclasses.replace(e, path=f"{target}:{attr}").to_dict())
    return out


def dpo_plugin_entries(value: Any, where: str = "dpo.plugin") -> list[PluginEntry]:
    """The DPO block's own plug-in key, "my_losses.py:fn[,other.py:fn2]": DPO losses registered under their
    function names (the older spelling of `plugins` entries of kind dpo_loss)."""
    specs = [s.strip() for s in str(value or "").split(",") if s.strip()]
    return [PluginEntry("dpo_loss", "", spec, where) for spec in specs]


# ------------------------------------------------------------------------------------------------ loading


def load_plugins(entries: list[PluginEntry], check: bool = True) -> list[dict]:
    """Import, check and register every entry; returns [{"kind", "name", "path"}] of what was registered."""
    loaded = []
    for e in entries:
        try:
            fn = registry.load_plugin(e.path, kind=e.kind, name=e.name or None, check=check)
        except PluginError as err:
            msg = str(err)
            raise PluginError(msg if msg.startswith(e.where) else f"{e.where}: {msg}") from err
        loaded.append({"kind": e.kind, "name": e.name or fn.__name__, "path": e.path})
    return loaded


def load_config_plugins(config, check: bool = True) -> list[dict]:
    """Load the config's `plugins` section (absent or empty: nothing to do). Call before building the model."""
    value = config.get("plugins", None) if hasattr(config, "get") else None
    entries = parse_plugins(value)
    if not entries:
        return []
    loaded = load_plugins(entries, check=check)
    for p in loaded:
        logging.info("plug-in %s %r loaded from %s", p["kind"], p["name"], p["path"])
    return loaded


# Config keys that name a registered objective (kind); "sft" is the DPO trainer's own term, "module:attr" a reward
# imported on use.
REFERENCES = (("dpo.loss_type", "dpo_loss"), ("grpo.advantage_estimator", "advantage"),
              ("grpo.kl_estimator", "kl"), ("ppo.kl_estimator", "kl"), ("reward.name", "reward"))


def check_references(cfg: dict) -> None:
    """Every objective a resolved config names (REFERENCES) exists -- built in, or loaded from `plugins` /
    `dpo.plugin` first -- so a typo fails before any model is loaded. PluginError naming the key otherwise."""
    load_plugins(dpo_plugin_entries((cfg.get("dpo") or {}).get("plugin")))
    for key, kind in REFERENCES:
        block, leaf = key.split(".")
        value = (cfg.get(block) or {}).get(leaf) if isinstance(cfg.get(block), dict) else None
        if value in (None, ""):
            continue
        names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if str(n).strip()]
        known = set(registry.names(kind))
        if kind == "reward":
            missing = [n for n in names if ":" not in n and n not in known]
        else:
            missing = [n for n in names if n not in known and not (kind == "dpo_loss" and n == "sft")]
        if missing:
            raise PluginError(f"{key}={value!r}: no {kind} named {', '.join(repr(m) for m in missing)}; known: "
                              f"{', '.join(sorted(known))}. A function of your own: add it to `plugins` "
                              f"({{'kind': {kind!r}, 'name': ..., 'path': 'file.py:fn'}})")


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m jaxrl.algorithms.plugins CONFIG.json [...]`: check the plug-ins of resolved configs and the objective
    names they refer to (check_references); exit 2 with the PluginError message on stderr when one is unfit."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m jaxrl.algorithms.plugins CONFIG.json [CONFIG.json ...]", file=sys.stderr)
        return 1
    for path in argv:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        try:
            loaded = load_plugins(parse_plugins(cfg.get("plugins")), check=True)
            check_references(cfg)
        except PluginError as e:
            print(f"PluginError: {path}: {e}", file=sys.stderr, flush=True)
            return 2
        for p in loaded:
            print(f"ok: {p['kind']} {p['name']!r} ({p['path']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
