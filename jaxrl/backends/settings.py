"""The settings the backends own: how a run reaches its rollout servers (`ServerOptions`), the vLLM it may start
(`VLLMLaunchOptions`), and the choice of where rollouts are sampled, as a typed union whose members build their
backend (`JaxRollout | ServerRollout | VLLMRollout`, each `build(context) -> RolloutBackend`).

    block.rollout_spec                    # an algorithm block's choice (RolloutBackendSettings: rollout_backend,
                                          # rollout_servers, rollout_server.*, rollout_vllm.*) as its typed member
    backend = spec.build(BackendContext(base_dir=..., stop_ids=..., max_prompt_len=..., max_new_tokens=...))

Every place that samples (online rollouts, offline rollouts, evaluation) builds its backend here, from a spec: the
spec is made from an algorithm block's keys or from a launcher's flags (jaxrl.backends.flags), never from a loose
dict. The teachers of distillation choose among the same three (`TEACHER_BACKENDS`) with the same server options.

No jax here: configs import this module (the classes a member builds are imported when it builds them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import warnings
from typing import Any, ClassVar, Optional, Sequence

from jaxrl.backends.options import DEFAULT_MAX_LORA_RANK, ServerOptions, VLLMLaunchOptions
from jaxrl.backends.scorers import SCORER_SPECS
from jaxrl.utils.registry import resolve
from jaxrl.utils.typed_config import Block, block, complete_block, defaults_of, keys_of, setting, unknown_key_error

logger = logging.getLogger(__name__)

__all__ = ["BackendContext", "JaxRollout", "ROLLOUT_BACKENDS", "ROLLOUT_SPECS", "RolloutBackendSettings",
           "RolloutSpec", "SERVED_TEACHERS", "ServerOptions", "ServerRollout", "TEACHER_BACKENDS",
           "VLLMLaunchOptions", "VLLMRollout", "check_server_urls", "server_url"]


def server_url(url: Any) -> str:
    """A server's base URL as runs record it (no trailing '/')."""
    return str(url).rstrip("/")


def check_server_urls(where: str, urls: Sequence[str]) -> None:
    """ValueError naming `where` (a config key) for a URL that is not a base URL or a server listed twice."""
    bad = [u for u in urls if not re.match(r"https?://[^/]+", u)]
    if bad:
        raise ValueError(f"{where}: {bad} are not base URLs (http://host:port)")
    if len(set(urls)) != len(urls):
        raise ValueError(f"{where} lists a server twice: {list(urls)}")


# ------------------------------------------------------------------------------------------------ the specs


@dataclasses.dataclass(frozen=True)
class BackendContext:
    """What a backend is built for: the base model and the rows it samples. `model`: a built model to sample with
    (the live policy of a training run, or a given base; the jax backend only); `run_dir`: a training run's workdir
    (servers then form a pool that serves the trainer's adapter versions from below it: jaxrl.backends.pool);
    `out_dir`: where an offline run's adapters are exported for a server, and a started vLLM logs."""

    base_dir: Optional[str]
    stop_ids: tuple
    max_prompt_len: int
    max_new_tokens: int
    pad_id: Optional[int] = None
    model: Any = None
    dtype: Optional[str] = "bfloat16"
    seed: int = 0
    batch_size: int = 64
    prompt_buckets: Optional[tuple] = None
    mesh: Any = None
    out_dir: Optional[str] = None
    run_dir: Optional[str] = None
    lora_rank: int = DEFAULT_MAX_LORA_RANK  # the LoRA rank a started vLLM enables from the start (0: none until
    # an adapter is loaded); a training run: its lora.rank
    partial: bool = False  # training: rows continue under each new version (partial rollouts)
    keep_versions: int = 1  # training: the newest versions' PEFT folders kept
    check_install: bool = True  # a vLLM the run starts: check its environment has vLLM first (tests: False)


class RolloutSpec:
    """A member of the rollout backend union: `name` (what `rollout_backend` / --backend say) and `build`."""

    name: ClassVar[str] = ""

    @classmethod
    def of(cls, *, urls: tuple, options: ServerOptions, launch: VLLMLaunchOptions) -> "RolloutSpec":
        """The member from a block's keys (rollout_servers, rollout_server.*, rollout_vllm.*), each member taking
        what it uses."""
        raise NotImplementedError

    def build(self, context: BackendContext):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class JaxRollout(RolloutSpec):
    """This process's engine (jaxrl.backends.jax_backend), on `context.model` or the base loaded from base_dir."""

    name: ClassVar[str] = "jax"

    @classmethod
    def of(cls, *, urls: tuple, options: ServerOptions, launch: VLLMLaunchOptions) -> "JaxRollout":
        return cls()

    def build(self, context: BackendContext):
        backend = resolve("jaxrl.backends.jax_backend:JaxBackend")
        return backend(context.base_dir, model=context.model, dtype=context.dtype, batch_size=context.batch_size,
                       max_prompt_len=context.max_prompt_len, prompt_buckets=context.prompt_buckets,
                       stop_ids=context.stop_ids, pad_id=context.pad_id, mesh=context.mesh)


@dataclasses.dataclass(frozen=True)
class ServerRollout(RolloutSpec):
    """OpenAI-compatible servers at `urls` (launchers.serve, or any such server), reached with `options`."""

    name: ClassVar[str] = "server"
    urls: tuple = ()
    options: ServerOptions = ServerOptions()

    @classmethod
    def of(cls, *, urls: tuple, options: ServerOptions, launch: VLLMLaunchOptions) -> "ServerRollout":
        return cls(tuple(urls), options)

    def build(self, context: BackendContext):
        if context.run_dir is not None:
            server = resolve("jaxrl.backends.openai_client:ServerBackend")
            return _pool(self, [server(context.base_dir, url=url, **_pooled(self, context)) for url in self.urls],
                         context)
        if len(self.urls) != 1:
            raise ValueError(f"backend {self.name!r} samples on one server here, got {len(self.urls)} URLs")
        return resolve("jaxrl.backends.openai_client:ServerBackend")(
            context.base_dir, url=self.urls[0], out_dir=context.out_dir, stop_ids=context.stop_ids,
            max_prompt_len=context.max_prompt_len, max_new_tokens=context.max_new_tokens,
            **dataclasses.asdict(self.options))


@dataclasses.dataclass(frozen=True)
class VLLMRollout(RolloutSpec):
    """vLLM 0.33: the running servers at `urls`, or (none) one `vllm serve` started with `launch`."""

    name: ClassVar[str] = "vllm"
    urls: tuple = ()
    options: ServerOptions = ServerOptions()
    launch: VLLMLaunchOptions = VLLMLaunchOptions()

    @classmethod
    def of(cls, *, urls: tuple, options: ServerOptions, launch: VLLMLaunchOptions) -> "VLLMRollout":
        return cls(tuple(urls), options, launch)

    def build(self, context: BackendContext):
        if context.run_dir is not None:
            return _pool(self, self._pooled_servers(context), context)
        if len(self.urls) > 1:
            raise ValueError(f"backend {self.name!r} samples on one server here, got {len(self.urls)} URLs")
        return resolve("jaxrl.backends.vllm_backend:VLLMBackend")(
            context.base_dir, out_dir=context.out_dir, url=self.urls[0] if self.urls else None,
            dtype=context.dtype or "bfloat16", seed=context.seed, max_lora_rank=context.lora_rank,
            stop_ids=context.stop_ids, max_prompt_len=context.max_prompt_len, max_new_tokens=context.max_new_tokens,
            **dataclasses.asdict(self.launch), **dataclasses.asdict(self.options))

    def _pooled_servers(self, context: BackendContext) -> list:
        """A training run's servers: the running vLLMs at `urls`, or one `vllm serve` started at the first
        rollout (as evaluation starts it), its log in the run's workdir."""
        common = _pooled(self, context)
        if self.urls:
            vllm = resolve("jaxrl.backends.vllm_backend:VLLMBackend")
            return [vllm(context.base_dir, url=url, **common) for url in self.urls]
        launcher = resolve("jaxrl.backends.pool:vllm_server")(
            self.launch, model_path=context.base_dir, dtype=context.dtype, seed=context.seed,
            log_path=os.path.join(context.run_dir, "vllm_server.log"), check_install=context.check_install)
        backend = resolve("jaxrl.backends.openai_client:ServerBackend")(
            context.base_dir, launcher=launcher, out_dir=context.run_dir, **common)
        backend.name = self.name
        backend.base_lora_rank = int(context.lora_rank)
        logger.info("rollouts: starting `%s` at the first rollout", launcher.shell_command(
            os.path.abspath(context.base_dir), context.max_prompt_len + context.max_new_tokens, context.lora_rank))
        return [backend]


def _pooled(spec, context: BackendContext) -> dict:
    """The keyword arguments of one server of a training run's pool."""
    return dict(stop_ids=context.stop_ids, max_prompt_len=context.max_prompt_len,
                max_new_tokens=context.max_new_tokens, partial=context.partial,
                **dataclasses.asdict(spec.options))


def _pool(spec, backends: list, context: BackendContext):
    """The servers of a training run as one backend (jaxrl.backends.pool.ServerPool)."""
    logger.info("rollouts: %d %s server(s): %s", len(backends), spec.name,
                ", ".join(b.url or "(started at the first rollout)" for b in backends))
    return resolve("jaxrl.backends.pool:ServerPool")(backends, base_dir=context.base_dir, workdir=context.run_dir,
                                                     partial=context.partial, keep_versions=context.keep_versions)


ROLLOUT_SPECS = {spec.name: spec for spec in (JaxRollout, ServerRollout, VLLMRollout)}
ROLLOUT_BACKENDS = tuple(ROLLOUT_SPECS)
TEACHER_BACKENDS = tuple(SCORER_SPECS)  # a distillation teacher (jaxrl.backends.scorers): this process, or servers
SERVED_TEACHERS = tuple(name for name, spec in SCORER_SPECS.items() if spec.served)  # scoring over HTTP


# ------------------------------------------------------------------------ the keys of an algorithm block


@dataclasses.dataclass(frozen=True)
class RolloutBackendSettings(Block):
    """Where rollouts are sampled (jaxrl.backends): this process, or OpenAI-compatible servers. A part of the blocks
    of the online algorithms; `rollout_spec` is the choice as its typed member."""

    rollout_backend: str = setting("jax", doc="where rollouts are sampled: jax (this process) | server (the "
                                   "OpenAI-compatible servers at rollout_servers, e.g. launchers.serve) | vllm (vLLM "
                                   "0.33 from its own environment: started by the run, or the running servers at "
                                   "rollout_servers); before each rollout the adapter goes to every server",
                                   choices=ROLLOUT_BACKENDS)
    rollout_servers: tuple = setting((), tuple, "base URLs of the rollout servers (server: one or more; vllm: none = "
                                     "start one); each rollout's prompts are split over them")
    rollout_server: ServerOptions = block(ServerOptions, "server | vllm: how requests go to the servers")
    rollout_vllm: VLLMLaunchOptions = block(VLLMLaunchOptions, "vllm without rollout_servers: the server the run "
                                            "starts")
    rollout_backend_kwargs: dict = setting({}, dict, "deprecated: its keys go to rollout_server (concurrency, "
                                           "request_timeout_s) and rollout_vllm (the launch options), with a warning")

    @property
    def rollout_spec(self) -> RolloutSpec:
        """The choice as its typed member (its options taken from the block)."""
        return ROLLOUT_SPECS[self.rollout_backend].of(urls=self.rollout_servers, options=self.rollout_server,
                                                      launch=self.rollout_vllm)

    @classmethod
    def migrate(cls, values: dict, where: str) -> dict:
        """A completed block with server URLs normalised (no trailing '/') and the deprecated
        `rollout_backend_kwargs` moved into the typed blocks (an option set both ways must agree)."""
        values = super().migrate(values, where)
        values = dict(values, rollout_servers=tuple(server_url(u) for u in values["rollout_servers"]))
        legacy = values["rollout_backend_kwargs"]
        if not legacy:
            return values
        homes = {name: "rollout_server" for name in keys_of(ServerOptions)}
        homes.update({name: "rollout_vllm" for name in keys_of(VLLMLaunchOptions)})
        for name in legacy:
            if name not in homes:
                raise unknown_key_error(f"{where}.rollout_backend_kwargs", name, homes)
        warnings.warn(f"{where}.rollout_backend_kwargs is deprecated: set "
                      + ", ".join(f"{where}.{homes[k]}.{k}" for k in legacy) + " instead", FutureWarning,
                      stacklevel=2)
        moved = {home: dict(values[home]) for home in ("rollout_server", "rollout_vllm")}
        for name, value in legacy.items():
            block_class = ServerOptions if homes[name] == "rollout_server" else VLLMLaunchOptions
            typed = complete_block(block_class, {name: value}, f"{where}.{homes[name]}")[name]
            current, default = moved[homes[name]][name], defaults_of(block_class)[name]
            if current != default and current != typed:
                raise ValueError(f"{where}.rollout_backend_kwargs.{name}={value!r} and {where}.{homes[name]}.{name}="
                                 f"{current!r} disagree; set {where}.{homes[name]}.{name} only")
            moved[homes[name]][name] = typed
        return dict(values, **moved, rollout_backend_kwargs={})

    def __post_init__(self):
        where, backend, servers = self.NAME, self.rollout_backend, self.rollout_servers
        check_server_urls(f"{where}.rollout_servers", servers)
        changed = [f"{where}.{name}.{key}" for name, cls in (("rollout_server", ServerOptions),
                                                             ("rollout_vllm", VLLMLaunchOptions))
                   for key in keys_of(cls) if getattr(getattr(self, name), key) != getattr(cls, key)]
        if backend == JaxRollout.name and (servers or changed):
            raise ValueError(f"{where}.rollout_servers / {', '.join(changed) or 'rollout_server / rollout_vllm'} are "
                             f"for rollout_backend='server' or 'vllm'; {where}.rollout_backend is 'jax'")
        if backend == ServerRollout.name and not servers:
            raise ValueError(f"{where}.rollout_backend='server' needs {where}.rollout_servers: the base URLs of "
                             "running servers (e.g. python -m launchers.serve --allowed_lora_roots=<workdir>)")
        launch = [key for key in changed if ".rollout_vllm." in key]
        if launch and (backend != VLLMRollout.name or servers):
            raise ValueError(f"{', '.join(launch)}: launch options of the vLLM a run starts (rollout_backend='vllm' "
                             f"without rollout_servers); {where}.rollout_backend is {backend!r}"
                             + (f" with rollout_servers {list(servers)}" if servers else ""))
        super().__post_init__()
