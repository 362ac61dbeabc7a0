"""The generation-backend flags that launchers.rollout and launchers.evaluate share, defined once.

    holders = define_backend_flags()          # --backend, --server_url, --backend_kwargs
    name, kwargs = backend_options(holders)   # after absl parsed them; UsageError on bad values
"""

from __future__ import annotations

import json

from absl import app, flags

from jaxrl.rollout.backends import BACKENDS

# (name, absl kind, default, [enum values,] help), as jaxrl.evaluation.cli.FLAGS
BACKEND_FLAGS = (
    ("backend", "enum", "jax", list(BACKENDS), "jax (in-process sampler), vllm (starts vllm serve 0.33 from its "
     "own environment, adapters as LoRA, or --server_url of a running vLLM; docs/vllm.md) or server (any "
     "OpenAI-compatible server at --server_url, e.g. launchers.serve)."),
    ("server_url", "string", None, "URL of a running server (--backend=server, or vllm)."),
    ("backend_kwargs", "string", "{}", "JSON options of the backend (vllm: python, tensor_parallel_size, "
     "data_parallel_size, gpu_memory_utilization, max_lora_rank, extra_args; server: concurrency)."),
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
