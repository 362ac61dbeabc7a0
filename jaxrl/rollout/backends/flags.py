"""The generation-backend flags that launchers.rollout and launchers.evaluate share, defined once.

    holders = define_backend_flags()          # --backend, --server_url, --backend_kwargs, --mesh_shape
    name, kwargs = backend_options(holders)   # after absl parsed them; UsageError on bad values
    shape = mesh_shape_of(holders)            # (data, fsdp, tensor) of the jax backend's local mesh
"""

from __future__ import annotations

import json

from absl import app, flags

from jaxrl.rollout.backends import BACKENDS

# (name, absl kind, default, [enum values,] help), as jaxrl.evaluation.flags.FLAGS
BACKEND_FLAGS = (
    ("backend", "enum", "jax", list(BACKENDS), "jax (in-process sampler), vllm (starts vllm serve 0.33 from its "
     "own environment, adapters as LoRA, or --server_url of a running vLLM; docs/vllm.md) or server (any "
     "OpenAI-compatible server at --server_url, e.g. launchers.serve)."),
    ("server_url", "string", None, "URL of a running server (--backend=server, or vllm)."),
    ("backend_kwargs", "string", "{}", "JSON options of the backend (vllm: python, tensor_parallel_size, "
     "data_parallel_size, gpu_memory_utilization, max_lora_rank, extra_args; server: concurrency)."),
    ("mesh_shape", "list", ["-1", "1", "1"], "jax backend: data,fsdp,tensor mesh over this process's devices (-1 = "
     "the rest). Default: every local device data-parallel (the rows of each batch split over them; --batch_size "
     "rounded up to a multiple); 1,1,1 = one device."),
)
NAMES = tuple(f[0] for f in BACKEND_FLAGS)


def define_backend_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, flags.FlagHolder]:
    holders = {}
    for name, kind, default, *rest in BACKEND_FLAGS:
        holders[name] = getattr(flags, f"DEFINE_{kind}")(name, default, *rest, flag_values=flag_values)
    return holders


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


def mesh_shape_of(holders: dict[str, flags.FlagHolder]) -> tuple[int, int, int]:
    """--mesh_shape as three ints (UsageError otherwise; whether the devices fit is checked where the mesh is
    made)."""
    raw = holders["mesh_shape"].value
    try:
        shape = tuple(int(v) for v in raw)
    except ValueError:
        shape = ()
    if len(shape) != 3 or any(v == 0 or v < -1 for v in shape) or shape.count(-1) > 1:
        raise app.UsageError(f"--mesh_shape={','.join(raw)}: expected data,fsdp,tensor (positive, at most one -1), "
                             "e.g. -1,1,1")
    return shape
