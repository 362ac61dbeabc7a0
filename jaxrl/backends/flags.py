"""The generation-backend settings that offline rollouts and evaluation share, declared once: the fields `backend`,
`backend_kwargs` and `mesh_shape` of RolloutConfig and EvalConfig (their flags are made from the fields,
jaxrl.utils.dataclass_flags), the --server_url flag, and the checks of their values.

    backend: str = backend_field()                 # in a config dataclass; likewise backend_kwargs_field(),
    mesh_shape: ... = mesh_shape_field()           # mesh_shape_field()
    define_table(SERVER_FLAGS)                     # --server_url (not a config field: it joins backend_kwargs)
    name, kwargs = backend_options(holders)        # after absl parsed them; UsageError on bad values
"""

from __future__ import annotations

import json
from typing import Any

from absl import app, flags

from jaxrl.backends import BACKENDS
from jaxrl.utils.dataclass_flags import flag_field

__all__ = ["SERVER_FLAGS", "backend_field", "backend_kwargs_field", "backend_options", "mesh_shape_field",
           "parse_mesh_shape"]

# (name, absl kind, default, help), for jaxrl.utils.dataclass_flags.define_table
SERVER_FLAGS = (
    ("server_url", "string", None, "URL of a running server (--backend=server, or vllm)."),
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


def backend_field() -> Any:
    return flag_field("jax", choices=BACKENDS, help=(
        "jax (in-process sampler), vllm (starts vllm serve 0.33 from its own environment, adapters as LoRA, or "
        "--server_url of a running vLLM; docs/guides/vllm.md) or server (any OpenAI-compatible server at --server_url, "
        "e.g. launchers.serve)."))


def backend_kwargs_field() -> Any:
    return flag_field(default_factory=dict, help=(
        "JSON options of the backend (vllm: python, tensor_parallel_size, data_parallel_size, "
        "gpu_memory_utilization, max_lora_rank, extra_args; server: concurrency)."))


def mesh_shape_field() -> Any:
    return flag_field((-1, 1, 1), parse=parse_mesh_shape, help=(
        "jax backend: data,fsdp,tensor mesh over this process's devices (-1 = the rest). Default: every local "
        "device data-parallel (the rows of each batch split over them; --batch_size rounded up to a multiple); "
        "1,1,1 = one device."))


def backend_options(holders: dict[str, flags.FlagHolder]) -> tuple[str, dict]:
    """(backend name, its keyword options) from the parsed flags; UsageError for a server backend without a URL."""
    try:
        kwargs = json.loads(holders["backend_kwargs"].value)
    except json.JSONDecodeError as e:
        raise app.UsageError(f"--backend_kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise app.UsageError("--backend_kwargs must be a JSON object")
    if holders["server_url"].value:
        kwargs["url"] = holders["server_url"].value
    backend = holders["backend"].value
    if backend == "server" and "url" not in kwargs:
        raise app.UsageError("--backend=server needs --server_url")
    return backend, kwargs
