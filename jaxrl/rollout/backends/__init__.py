"""Generation backends: token-id prompts in, completions out, for whatever model a backend holds.

    backend = make_backend("jax", base_dir=HF_DIR, stop_ids=stop_ids, ...)
    backend.load(ModelSpec("step_28", "adapter", "run/checkpoints/adapters/28"), adapter)
    gens = backend.generate(prompts, group_ids, SamplingParams(n=8, max_new_tokens=4096, temperature=1.0))
    gens[i].tokens, gens[i].logprobs, gens[i].finish_reason, gens[i].prompt_index, gens[i].sample_index

Rows are prompt-major (prompt j -> rows j*n ... j*n+n-1). `tokens` are the generated ids up to and including the
stop token; `finish_reason` is "stop" (a stop id ended it) or "length" (the cap did). Sample keys derive from
(seed, group id, sample index) on every backend (server backends pack them into the request seed,
`openai_client.request_seed`), so a sample does not depend on its batch.

Backends: `jax` (this process's Sampler; the default, and what online training uses with explicit weights unless
`grpo.rollout_backend` / `ppo.rollout_backend` names a server: jaxrl/algorithms/server_rollouts.py),
`vllm` (vLLM 0.33 in its own environment, started as `vllm serve`, adapters served unmerged as LoRA; or a running
vLLM at `url`) and `server` (any OpenAI-compatible completions server at `url`, e.g. `python -m launchers.serve`).
Every consumer (offline rollouts, online GRPO/PPO, evaluation) reaches a backend through
`jaxrl.rollout.collect.Collector`, which decodes and scores the completions the one same way.
"""

from __future__ import annotations

from jaxrl.rollout.backends.base import MODEL_KINDS, Generation, GenerationBackend, ModelSpec, SamplingParams
from jaxrl.rollout.backends.jax_backend import JaxBackend
from jaxrl.rollout.backends.openai_client import ServerBackend, ServerError
from jaxrl.rollout.backends.vllm_backend import VLLMBackend

BACKENDS = ("jax", "vllm", "server")
_CLASSES = {"jax": JaxBackend, "vllm": VLLMBackend, "server": ServerBackend}

__all__ = ["BACKENDS", "MODEL_KINDS", "Generation", "GenerationBackend", "JaxBackend", "ModelSpec", "SamplingParams",
           "ServerBackend", "ServerError", "VLLMBackend", "make_backend"]


def make_backend(name: str, **kwargs) -> GenerationBackend:
    """`JaxBackend`, `VLLMBackend` or `ServerBackend` with `kwargs` (each takes what it needs and ignores the
    rest, so one set of arguments serves all three; no backend imports vLLM)."""
    if name not in _CLASSES:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return _CLASSES[name](**kwargs)
