"""A run's config, typed: composed of the settings each part of jaxrl owns, resolved once into frozen dataclasses.

    algorithm = get_algorithm("dpo")      # jaxrl.algorithms.tasks: the registered Algorithm (blocks, labels, task)
    config = default_config(algorithm)    # a ConfigDict of every key a DPO run reads (what configs/base.py returns)
    run = resolve(config, algorithm)      # -> TrainConfig: missing keys at their defaults, every key and type
                                          #    checked, values validated; run.dpo.beta is a float
    run.to_json()                         # what config.json holds (every key, plain JSON values)
    complete(config, algorithm)           # the same dict without building the dataclasses (sweeps)

Who declares what (each next to the code that acts on it, and composed here, above all of them):

    top level   algorithm (here), the model's keys (jaxrl.models.settings.ModelSettings), the run's keys
                (jaxrl.train.settings.RunSettings), plugins (here), the family configs' labels (the algorithm's)
    optimizer, batch, logging, ema    jaxrl.train.settings          lora    jaxrl.models.settings
    mesh                              jaxrl.parallel.settings
    the algorithm's blocks            its `Algorithm`: data, dpo | grpo | ppo | distill, reward
                                      (jaxrl.rewards.settings), or a user algorithm's own

An algorithm's block is composed of parts its owners declare: GRPO's of the sampling, policy-loss, rollout-correction
and asynchronous parts (jaxrl.algorithms.online.settings), the rollout backend's (jaxrl.backends.settings) and the
episodes' (jaxrl.environments.settings). An `Algorithm` (declared here, registered by name in
jaxrl.algorithms.tasks) says which blocks a run of it has; built-in algorithms declare theirs as a user's algorithm
does (`register_task(name, blocks=...)`), and nothing here lists them. Family files (configs/*.py, `get_config()` with
presets and `--config.key=value`) stay the user's interface: a ConfigDict. `jaxrl.algorithms.run.run_training`
resolves it once and passes the `TrainConfig` down; nothing below reads a raw dict. A wrong key anywhere is a
ConfigKeyError naming it and the nearest valid key; a key a block no longer has is accepted at its old default
(a config.json written before resolves) and otherwise refused with the reason.

No jax here: configs import this module.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Union

import ml_collections

from jaxrl.models.settings import LoRAConfig, ModelSettings
from jaxrl.parallel.settings import MeshConfig
from jaxrl.train.settings import TRAIN_BLOCKS, RunSettings
from jaxrl.utils.registry import resolve as resolve_reference
from jaxrl.utils.typed_config import (Block, ConfigKeyError, block_json, build_block, complete_block, is_config_dict,
                                      keys_of, setting, to_plain, unknown_key_error, without_retired)

__all__ = ["Algorithm", "CORE_BLOCKS", "LABELS", "OPEN_DATA", "TrainConfig", "complete", "default_config",
           "default_of", "resolve"]

# the blocks every run has, in config.json's order
CORE_BLOCKS = {"optimizer": TRAIN_BLOCKS["optimizer"], "lora": LoRAConfig, "batch": TRAIN_BLOCKS["batch"],
               "mesh": MeshConfig, "logging": TRAIN_BLOCKS["logging"], "ema": TRAIN_BLOCKS["ema"]}
# Labels the family configs (configs/dpo.py, grpo.py, ppo.py) record in config.json; no code reads them. Which of
# them a run has is its algorithm's (`Algorithm.labels`).
LABELS = {
    "run": "the family config's named run (configs/dpo.py run=...)",
    "start": "which weights model_path points to (base | m0)",
    "probe": "the family config's named probe (configs/grpo.py probe=...)",
}


OPEN_DATA = {"data": None}  # the blocks of an algorithm that declares none: its `data` block taken as it is


@dataclasses.dataclass(frozen=True, eq=False)
class Algorithm:
    """What an algorithm brings to a run: its name, the config blocks it reads ({name: config dataclass whose fields
    are `jaxrl.utils.typed_config.setting`s, or None: taken as it is}), the family-config labels it records in
    config.json (`labels`, of LABELS; no code reads them) and its task factory (`build`: the factory, or its
    "module:attr", resolved on first use). Calling it builds the task: `algorithm(config, model, mesh)`."""

    name: str
    blocks: Mapping[str, Any]
    build: Union[str, Callable]
    labels: tuple = ()

    @functools.cached_property
    def factory(self) -> Callable:
        return resolve_reference(self.build) if isinstance(self.build, str) else self.build

    def __call__(self, config, model, mesh):
        return self.factory(config, model, mesh)


def open_algorithm(name: str) -> Algorithm:
    """An algorithm that declares no blocks (a user's factory named by "module:attr", not imported here)."""
    return Algorithm(name, dict(OPEN_DATA), name)


@dataclasses.dataclass(frozen=True)
class AlgorithmChoice(Block):
    """The first key of every run: which algorithm trains (jaxrl.algorithms.tasks)."""

    algorithm: str = setting("sft", doc="a registered algorithm: sft | dpo | grpo | ppo | distill | "
                             "'pkg.module:factory'")


@dataclasses.dataclass(frozen=True)
class TrainConfig(RunSettings, ModelSettings, AlgorithmChoice):
    """A run's whole config (module docstring). The core reads the top-level keys and `optimizer`, `lora`, `batch`,
    `mesh`, `logging`, `ema`; each algorithm its own blocks, held in `blocks` and read as attributes
    (`config.grpo`, `config.data`, `config.reward`; `config.block(name)`: None when the run has no such block).
    `labels`: the label keys its algorithm records in config.json."""

    plugins: Any = setting((), (tuple, list, str, dict), "user objectives loaded and checked before the model is "
                           "built (jaxrl.algorithms.plugins): {'kind', 'name', 'path'} entries or "
                           "'kind:name=file.py:fn'")
    run: str = setting("", doc=LABELS["run"])
    start: str = setting("", doc=LABELS["start"])
    probe: str = setting("", doc=LABELS["probe"])
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    blocks: dict = dataclasses.field(default_factory=dict)  # the algorithm's blocks, by name
    labels: tuple = ()  # the labels (of LABELS) the algorithm records

    def __post_init__(self):
        bad = self.run_problems() + self.model_problems()
        if bad:
            raise ValueError("config: " + "; ".join(bad))
        super().__post_init__()

    def __getattr__(self, name: str) -> Any:
        # only called when `name` is not a field: one of the algorithm's blocks
        blocks = self.__dict__.get("blocks")
        if blocks is None or name.startswith("__") or name not in blocks:
            raise AttributeError(f"{type(self).__name__} has no key {name!r} and no block {name!r} (the blocks of "
                                 f"algorithm {self.__dict__.get('algorithm')!r}: {sorted(blocks or ())}; "
                                 f"config.block(name) is None for a block the run does not have)")
        return blocks[name]

    def restate(self, written: dict) -> dict:
        """A config.json an earlier version wrote, as this version writes the same settings (the keys this run's
        blocks retired dropped): what a resumed run compares its config with (jaxrl.train.loop)."""
        out = dict(written)
        for name, value in self.blocks.items():
            if value is not None and isinstance(out.get(name), dict):
                out[name] = without_retired(type(value), out[name])
        return out

    def block(self, name: str) -> Any:
        """An algorithm block by name (`data`, `dpo`, ..., or a user algorithm's declared block); None if absent."""
        return self.blocks.get(name)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        """Every key as plain JSON values: what config.json holds (and what `resolve` reads back)."""
        out = {k: to_plain(getattr(self, k)) for k in _TOP_KEYS}
        out.update({k: getattr(self, k) for k in self.labels})
        out.update({name: to_plain(getattr(self, name)) for name in CORE_BLOCKS})
        for name in _json_order(self.blocks):
            if self.blocks[name] is not None:
                out[name] = block_json(self.blocks[name])
        return out


_TOP_KEYS = tuple(k for k in keys_of(TrainConfig) if k not in LABELS and k not in CORE_BLOCKS
                  and k not in TRAIN_BLOCKS and k not in ("blocks", "labels"))


def _json_order(names) -> list:
    """config.json's order of an algorithm's blocks: data, the algorithm's own, the reward."""
    names = list(names)
    return ([n for n in names if n == "data"] + [n for n in names if n not in ("data", "reward")]
            + [n for n in names if n == "reward"])


def default_of(key: str) -> Any:
    """The default of a top-level key."""
    return keys_of(TrainConfig)[key].default


def _top_items(config: Any) -> list:
    if config is None:
        return []
    if is_config_dict(config):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ConfigKeyError(f"a config is a block of keys, got {type(config).__name__}")
    return list(config.items())


def complete(config: Any, algorithm: Optional[Algorithm] = None, *, strict: bool = True) -> dict:
    """`config` (a ConfigDict or mapping) as plain JSON with every key of its algorithm at its default where
    missing, each key and type checked: what config.json holds. `algorithm`: the run's (its blocks and labels;
    None: one that declares none, `open_algorithm`); `strict`: a top-level key nobody reads is an error."""
    items = dict(_top_items(config))
    name = items.get("algorithm") or TrainConfig.algorithm
    top_keys = keys_of(TrainConfig)
    top_keys["algorithm"].check("algorithm", name)
    algorithm = algorithm if algorithm is not None else open_algorithm(name)
    own, labels = dict(algorithm.blocks), tuple(algorithm.labels)
    valid = list(_TOP_KEYS) + list(labels) + list(CORE_BLOCKS) + list(own)
    out = {}
    for key in _TOP_KEYS + labels:
        if key in items:
            top_keys[key].check(key, items[key])
            out[key] = to_plain(top_keys[key].convert(items[key]))
        else:
            out[key] = to_plain(top_keys[key].default)
    out["algorithm"] = name
    for block_name, cls in CORE_BLOCKS.items():
        out[block_name] = to_plain(complete_block(cls, items.get(block_name), block_name))
    for block_name, cls in own.items():
        value = items.get(block_name)
        if cls is None:
            out[block_name] = to_plain(value) if value is not None else {}
        else:
            out[block_name] = to_plain(complete_block(cls, value, block_name))
    for key in items:
        if key in valid:
            continue
        if strict:
            raise unknown_key_error("", key, valid)
        out[key] = to_plain(items[key])  # a block of an algorithm whose declared blocks are not known here
    return out


def resolve(config: Any, algorithm: Optional[Algorithm] = None) -> TrainConfig:
    """The TrainConfig of `config` (a ConfigDict, a mapping such as a config.json, or a TrainConfig, returned as
    it is) for a run of `algorithm` (as in `complete`): `complete`, then every block built and validated.
    ConfigKeyError / ValueError naming the key."""
    if isinstance(config, TrainConfig):
        return config
    full = complete(config, algorithm)
    algorithm = algorithm if algorithm is not None else open_algorithm(full["algorithm"])
    kwargs = {k: full[k] for k in _TOP_KEYS}
    kwargs.update({k: full[k] for k in algorithm.labels})
    kwargs["plugins"] = _frozen(full["plugins"])
    kwargs.update({name: build_block(cls, full[name], name) for name, cls in CORE_BLOCKS.items()})
    blocks = {name: full[name] if cls is None else build_block(cls, full[name], name)
              for name, cls in algorithm.blocks.items()}
    return TrainConfig(**kwargs, blocks=blocks, labels=tuple(algorithm.labels))


def _frozen(value: Any) -> Any:
    """Lists as tuples (the dataclass is frozen; config.json writes them back as lists)."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def default_config(algorithm: Algorithm) -> ml_collections.ConfigDict:
    """Every key a run of `algorithm` reads, at its default (what configs/base.py returns for a built-in one)."""
    if any(cls is None for cls in algorithm.blocks.values()):
        raise ValueError(f"default_config: algorithm {algorithm.name!r} takes a block as it is "
                         f"({[n for n, cls in algorithm.blocks.items() if cls is None]}): it has no defaults")
    values = {k: to_plain(v.default) if isinstance(v.default, dict) else _config_value(v)
              for k, v in keys_of(TrainConfig).items() if k in _TOP_KEYS or k in algorithm.labels}
    values["algorithm"] = algorithm.name
    for name, cls in {**CORE_BLOCKS, **algorithm.blocks}.items():
        values[name] = {k: _config_value(key) for k, key in keys_of(cls).items()}
    return ml_collections.ConfigDict(values)


def _config_value(key) -> Any:
    """A key's default as a ConfigDict holds it: a None default of an optional float (`ema.decay`) or bool
    (`scan_layers`) as a typed placeholder, so that `--config.ema.decay=0.99` can set it (ml_collections refuses to
    override a plain None); a nested block as the dict of its keys."""
    if key.block:
        return {k: _config_value(sub) for k, sub in keys_of(key.block).items()}
    types = key.types if isinstance(key.types, tuple) else (key.types,)
    given = [t for t in types if t is not type(None)]
    if key.default is None and len(given) == 1 and given[0] in (int, float, str, bool):
        return ml_collections.config_dict.placeholder(given[0])
    return copy.deepcopy(key.default)
