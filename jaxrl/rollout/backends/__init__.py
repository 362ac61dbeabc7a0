"""Generation backends: token-id prompts in, completions out, for whatever model a backend holds.

    backend = make_backend("jax", base_dir=HF_DIR, stop_ids=stop_ids, ...)
    backend.load(ModelSpec("step_28", "adapter", "run/checkpoints/adapters/28"), adapter)
    gens = backend.generate(prompts, group_ids, SamplingParams(n=8, max_new_tokens=4096, temperature=1.0))
    gens[i].tokens, gens[i].logprobs, gens[i].finish_reason, gens[i].prompt_index, gens[i].sample_index

Rows are prompt-major (prompt j -> rows j*n ... j*n+n-1). `tokens` are the generated ids up to and including the
stop token; `finish_reason` is "stop" (a stop id ended it) or "length" (the cap did). Sample keys derive from
(seed, group id, sample index) on the jax backend, so a sample does not depend on its batch.

Backends: `jax` (this process's Sampler; the default, and what online training uses with explicit weights) and
`vllm` (optional, GPU). Every consumer (offline rollouts, online GRPO/PPO, evaluation) reaches a backend through
`jaxrl.rollout.collect.Collector`, which decodes and scores the completions the one same way.
"""

from __future__ import annotations

from jaxrl.rollout.backends.base import MODEL_KINDS, Generation, GenerationBackend, ModelSpec, SamplingParams
from jaxrl.rollout.backends.jax_backend import JaxBackend
from jaxrl.rollout.backends.vllm_backend import VLLMBackend

BACKENDS = ("jax", "vllm")
_CLASSES = {"jax": JaxBackend, "vllm": VLLMBackend}

__all__ = ["BACKENDS", "MODEL_KINDS", "Generation", "GenerationBackend", "JaxBackend", "ModelSpec", "SamplingParams",
           "VLLMBackend", "make_backend"]


def make_backend(name: str, **kwargs) -> GenerationBackend:
    """`JaxBackend(**kwargs)` or `VLLMBackend(**kwargs)` (the vllm backend imports vllm only when it starts)."""
    if name not in _CLASSES:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return _CLASSES[name](**kwargs)
