"""The generation-backend settings that offline rollouts and evaluation share, declared once: the backend fields of
RolloutConfig and EvalConfig, the flags of the backends' option blocks (made from jaxrl.backends.options, one flag
per key), the deprecated --backend_kwargs, and the one typed spec both build their backend from.

    backend: str = backend_field()                   # in a config dataclass: --backend=jax|server|vllm
    server_url: Optional[str] = server_url_field()   # --server_url
    server: ServerOptions = server_field()           # --server_concurrency, --server_request_timeout_s, ...
    vllm: VLLMLaunchOptions = vllm_field()           # --vllm_python, --vllm_tensor_parallel_size, ...
    vllm_max_lora_rank: int = max_lora_rank_field()  # --vllm_max_lora_rank
    mesh_shape: ... = mesh_shape_field()             # --mesh_shape (the jax backend)

    define_table(BACKEND_FLAGS)                      # the flags of `server` / `vllm` (not fields), --backend_kwargs
    cfg = config_from_flags(Config, holders, **backend_options(holders))   # after absl parsed them
    check_backend(cfg)                               # app.UsageError naming the flags of a choice they do not fit
    backend = backend_spec(cfg).build(BackendContext(...))   # JaxRollout | ServerRollout | VLLMRollout

Flag names: `--server_<key>` for every key of ServerOptions (how requests reach a server: --backend=server or
vllm), `--vllm_<key>` for every key of VLLMLaunchOptions (the `vllm serve` that --backend=vllm starts without
--server_url), and --vllm_max_lora_rank (the LoRA rank that server starts with). --backend_kwargs (a JSON object,
deprecated) maps its keys onto those flags with one warning naming them: `url` -> --server_url, `max_lora_rank` ->
--vllm_max_lora_rank, a ServerOptions key -> --server_<key>, a VLLMLaunchOptions key -> --vllm_<key>. An unknown key
is a usage error naming the valid ones; a key whose flag is given too with another value is refused.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any, Mapping

from absl import app, flags

from jaxrl.backends.options import DEFAULT_MAX_LORA_RANK, ServerOptions, VLLMLaunchOptions
from jaxrl.backends.settings import (ROLLOUT_BACKENDS, JaxRollout, RolloutSpec, ServerRollout, VLLMRollout,
                                     check_server_urls, server_url)
from jaxrl.utils.dataclass_flags import NOT_A_FLAG, flag_field
from jaxrl.utils.registry import nearest
from jaxrl.utils.typed_config import ConfigKeyError, build_block, keys_of

__all__ = ["BACKEND_FLAGS", "DEFAULT_MAX_LORA_RANK", "LEGACY_KEYS", "OPTION_BLOCKS", "backend_field",
           "backend_options", "backend_spec", "check_backend", "max_lora_rank_field", "mesh_shape_field",
           "parse_mesh_shape", "server_field", "server_url_field", "vllm_field"]

# (config field, option block, flag prefix, what the flags are for): one flag `--<prefix><key>` per key of the block
OPTION_BLOCKS = (
    ("server", ServerOptions, "server_", "--backend=server | vllm"),
    ("vllm", VLLMLaunchOptions, "vllm_", "--backend=vllm without --server_url (the `vllm serve` it starts)"),
)
_ABSL_KINDS = {int: "integer", float: "float", str: "string", bool: "bool", tuple: "multi_string"}


def _option_flags() -> tuple:
    """(name, absl kind, default, help) of every key of the option blocks (jaxrl.utils.dataclass_flags.define_table).
    A tuple key (extra_args) is a repeated flag: one value each (`--vllm_extra_args=--enforce-eager`)."""
    rows = []
    for _, cls, prefix, scope in OPTION_BLOCKS:
        for key, k in keys_of(cls).items():
            kind = _ABSL_KINDS[type(k.default)]
            default = list(k.default) if kind == "multi_string" else k.default
            doc = k.doc or f"`vllm serve --{key.replace('_', '-')}`"
            if kind == "multi_string":
                doc += " (the flag once per argument)"
            rows.append((prefix + key, kind, default, f"{scope}: {doc}."))
    return tuple(rows)


OPTION_FLAGS = _option_flags()
_OPTION_FLAG_NAMES = {row[0] for row in OPTION_FLAGS}
# {old --backend_kwargs key: the flag that replaces it}
LEGACY_KEYS = {"url": "server_url", "max_lora_rank": "vllm_max_lora_rank",
               **{key: prefix + key for _, cls, prefix, _ in OPTION_BLOCKS for key in keys_of(cls)}}
# The flags of launchers.rollout / launchers.evaluate that are not config fields: (name, absl kind, default, help)
BACKEND_FLAGS = OPTION_FLAGS + (
    ("backend_kwargs", "string", None, "Deprecated: a JSON object of backend options; each key is a flag now "
     "(url: --server_url, max_lora_rank: --vllm_max_lora_rank, concurrency: --server_concurrency, python: "
     "--vllm_python, ...: --server_<key> / --vllm_<key>), mapped onto it with a warning."),
)


def parse_mesh_shape(raw: list[str]) -> tuple[int, int, int]:
    """--mesh_shape as three ints (UsageError otherwise; whether the devices fit is checked where the mesh is
    made)."""
    try:
        shape = tuple(int(v) for v in raw)
    except ValueError:
        shape = ()
    if len(shape) != 3 or any(v == 0 or v < -1 for v in shape) or shape.count(-1) > 1:
        raise app.UsageError(f"--mesh_shape={','.join(raw)}: expected data,fsdp,tensor (positive, at most one -1), "
                             "e.g. -1,1,1")
    return shape


# ------------------------------------------------------------------------------------ the config fields


def backend_field() -> Any:
    return flag_field("jax", choices=ROLLOUT_BACKENDS, help=(
        "jax (in-process sampler), vllm (starts vllm serve 0.33 from its own environment, adapters as LoRA, or "
        "--server_url of a running vLLM; docs/guides/vllm.md) or server (any OpenAI-compatible server at --server_url, "
        "e.g. launchers.serve)."))


def server_url_field() -> Any:
    return flag_field(None, help="Base URL of a running server (--backend=server; --backend=vllm: a running vLLM, "
                                 "none started).")


def server_field() -> Any:
    """The ServerOptions of a config: set by the --server_<key> flags (OPTION_FLAGS), not a flag itself."""
    return dataclasses.field(default_factory=ServerOptions, metadata=NOT_A_FLAG)


def vllm_field() -> Any:
    """The VLLMLaunchOptions of a config: set by the --vllm_<key> flags (OPTION_FLAGS), not a flag itself."""
    return dataclasses.field(default_factory=VLLMLaunchOptions, metadata=NOT_A_FLAG)


def max_lora_rank_field() -> Any:
    return flag_field(DEFAULT_MAX_LORA_RANK, bounds=(0, None), help=(
        "--backend=vllm without --server_url: the LoRA rank the started server enables on the base (raised, with a "
        "restart, for a larger adapter; 0: no LoRA until an adapter is loaded)."))


def mesh_shape_field() -> Any:
    return flag_field((-1, 1, 1), parse=parse_mesh_shape, help=(
        "jax backend: data,fsdp,tensor mesh over this process's devices (-1 = the rest). Default: every local "
        "device data-parallel (the rows of each batch split over them; --batch_size rounded up to a multiple); "
        "1,1,1 = one device."))


# ------------------------------------------------------------------------------- flags -> config values


def _typed(flag: str, value: Any) -> Any:
    """The config value of flag `flag` (an option flag, --server_url or --vllm_max_lora_rank) given `value` (a
    parsed flag value, or a --backend_kwargs value); ValueError for a value of the wrong type."""
    if flag == "server_url":
        if value is not None and not isinstance(value, str):
            raise ValueError(f"expected a URL string, got {type(value).__name__}")
        return value
    if flag == "vllm_max_lora_rank":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"expected an integer >= 0, got {value!r}")
        return value
    for _, cls, prefix, _ in OPTION_BLOCKS:
        if flag.startswith(prefix) and flag[len(prefix):] in keys_of(cls):
            key = keys_of(cls)[flag[len(prefix):]]
            try:
                key.check(f"--{flag}", value)
            except ConfigKeyError as e:  # "config key NAME=VALUE: expected int, got str": the part after NAME
                raise ValueError(str(e).split(": ", 1)[-1]) from None
            return key.convert(value)
    raise KeyError(flag)


def _legacy(raw) -> dict:
    """The --backend_kwargs object ({} when not given); UsageError for what is not a JSON object."""
    if raw in (None, ""):
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise app.UsageError(f"--backend_kwargs is not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise app.UsageError("--backend_kwargs must be a JSON object")
    return parsed


def backend_options(holders: Mapping[str, flags.FlagHolder]) -> dict:
    """The backend values of a config (server_url, vllm_max_lora_rank, server, vllm) from the parsed flags, the
    deprecated --backend_kwargs mapped onto them (module docstring; one FutureWarning naming the flags);
    app.UsageError for an unknown key, a value of the wrong type, or a key whose flag is given too with another
    value."""
    names = ("server_url", "vllm_max_lora_rank", *sorted(_OPTION_FLAG_NAMES))
    values = {name: holders[name].value for name in names}
    legacy = _legacy(holders["backend_kwargs"].value)
    for key, raw in legacy.items():
        if key not in LEGACY_KEYS:
            close = nearest(key, LEGACY_KEYS)
            raise app.UsageError(f"--backend_kwargs: unknown key {key!r}" + (f" (did you mean {close!r}?)" if close
                                                                            else "")
                                 + f"; valid keys: {', '.join(LEGACY_KEYS)} (each is a flag now: --server_url, "
                                 "--vllm_max_lora_rank, --server_<key>, --vllm_<key>)")
        flag = LEGACY_KEYS[key]
        try:
            value = _typed(flag, raw)
        except ValueError as e:
            raise app.UsageError(f"--backend_kwargs key {key!r}={raw!r}: {e}; give --{flag} instead") from None
        holder = holders[flag]
        if holder.present and _typed(flag, holder.value) != value:
            raise app.UsageError(f"--backend_kwargs key {key!r}={raw!r} and --{flag}={holder.value!r} disagree; give "
                                 f"--{flag} only")
        values[flag] = value
    if legacy:
        warnings.warn("--backend_kwargs is deprecated: give " + " ".join(
            _flag_text(LEGACY_KEYS[k], v) for k, v in legacy.items()) + " instead", FutureWarning, stacklevel=2)
    out = {"server_url": values["server_url"] or None, "vllm_max_lora_rank": values["vllm_max_lora_rank"]}
    for field, cls, prefix, _ in OPTION_BLOCKS:
        block_values = {key: values[prefix + key] for key in keys_of(cls)}
        try:
            out[field] = build_block(cls, block_values, f"--{prefix}*")
        except (ConfigKeyError, ValueError) as e:
            raise app.UsageError(str(e)) from None
    return out


def _flag_text(flag: str, value: Any) -> str:
    """A --backend_kwargs value as its flag is written (a list: the flag once per item)."""
    if isinstance(value, (list, tuple)):
        return " ".join(f"--{flag}={v}" for v in value)
    return f"--{flag}={value}"


# ---------------------------------------------------------------------------------------------- the spec


def backend_spec(cfg) -> RolloutSpec:
    """The member of the rollout union (jaxrl.backends.settings) that the backend fields of `cfg` (a RolloutConfig
    or EvalConfig) choose, its options taken from them; ValueError naming the flags of a choice they do not fit
    (a server without --server_url, server options for the jax backend, launch options of a vLLM not started)."""
    name = cfg.backend
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"backend must be one of {ROLLOUT_BACKENDS}, got {name!r}")
    urls = (server_url(cfg.server_url),) if cfg.server_url else ()
    check_server_urls("--server_url", urls)
    server_set = [f"--server_{key}" for key in keys_of(ServerOptions)
                  if getattr(cfg.server, key) != getattr(ServerOptions, key)]
    launch_set = [f"--vllm_{key}" for key in keys_of(VLLMLaunchOptions)
                  if getattr(cfg.vllm, key) != getattr(VLLMLaunchOptions, key)]
    if cfg.vllm_max_lora_rank != DEFAULT_MAX_LORA_RANK:
        launch_set.append("--vllm_max_lora_rank")
    if name == JaxRollout.name:
        given = (["--server_url"] if urls else []) + server_set + launch_set
        if given:
            raise ValueError(f"{', '.join(given)}: options of --backend=server or vllm; --backend is 'jax'")
        return JaxRollout()
    if name == ServerRollout.name and not urls:
        raise ValueError("--backend=server needs --server_url")
    if launch_set and (name != VLLMRollout.name or urls):
        raise ValueError(f"{', '.join(launch_set)}: launch options of the vLLM that --backend=vllm starts without "
                         f"--server_url; --backend is {name!r}" + (f" with --server_url={urls[0]}" if urls else ""))
    if name == ServerRollout.name:
        return ServerRollout(urls, cfg.server)
    return VLLMRollout(urls, cfg.server, cfg.vllm)


def check_backend(cfg) -> None:
    """`backend_spec(cfg)` as a launcher's check: app.UsageError naming the flags."""
    try:
        backend_spec(cfg)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
