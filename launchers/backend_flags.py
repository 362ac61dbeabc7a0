"""The generation-backend flags that launchers.rollout and launchers.evaluate share (jaxrl.rollout.backends)."""

from __future__ import annotations

import json

from absl import app, flags

BACKEND = flags.DEFINE_enum("backend", "jax", ["jax", "vllm", "server"], "jax (in-process sampler), vllm (starts "
                            "vllm serve 0.33 from its own environment, adapters as LoRA, or --server_url of a "
                            "running vLLM; docs/vllm.md) or server (any OpenAI-compatible server at --server_url, "
                            "e.g. launchers.serve).")
SERVER_URL = flags.DEFINE_string("server_url", None, "URL of a running server (--backend=server, or vllm).")
BACKEND_KWARGS = flags.DEFINE_string("backend_kwargs", "{}", "JSON options of the backend (vllm: python, "
                                     "tensor_parallel_size, data_parallel_size, gpu_memory_utilization, "
                                     "max_lora_rank, extra_args; server: concurrency).")


def backend_options() -> tuple[str, dict]:
    """(backend name, its keyword options) from the flags; UsageError for a server backend without a URL."""
    try:
        kwargs = json.loads(BACKEND_KWARGS.value)
    except json.JSONDecodeError as e:
        raise app.UsageError(f"--backend_kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise app.UsageError("--backend_kwargs must be a JSON object")
    if SERVER_URL.value:
        kwargs["url"] = SERVER_URL.value
    if BACKEND.value == "server" and "url" not in kwargs:
        raise app.UsageError("--backend=server needs --server_url")
    return BACKEND.value, kwargs
