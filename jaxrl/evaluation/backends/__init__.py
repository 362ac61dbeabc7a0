"""Generation backends of the evaluator: `jax` (the in-process Sampler, default) and `vllm` (optional).

A backend turns token-id prompts into completions for the model it currently holds:

    backend.load(spec, adapter)      # spec: runner.ModelSpec; adapter: jaxrl.models.adapters.Adapter or None
    rows = backend.generate(prompts, group_ids, n=..., max_new_tokens=..., temperature=..., top_p=..., top_k=...,
                            seed=...)                # [Generation], prompt-major: prompt j -> rows j*n ... j*n+n-1
    backend.loaded_digest()          # digest of the adapter the backend really runs with (None: none)
    backend.close()

Sample keys derive from (seed, group id, sample index) on the jax backend, so a sample does not depend on its
batch, a resumed evaluation redraws exactly what was missing, and every model draws sample i of a prompt from the
same random stream (common random numbers: the paired differences between models are less noisy).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Generation:
    """One completion: generated ids (up to and including the stop token) and "stop" | "length"."""

    tokens: list[int]
    finish_reason: str
    prompt_index: int
    sample_index: int


BACKENDS = ("jax", "vllm")


def make_backend(name: str, **kwargs):
    """`JaxBackend(**kwargs)` or `VLLMBackend(**kwargs)` (the latter imports vllm only when it loads a model)."""
    if name == "jax":
        from jaxrl.evaluation.backends.jax_backend import JaxBackend
        return JaxBackend(**kwargs)
    if name == "vllm":
        from jaxrl.evaluation.backends.vllm_backend import VLLMBackend
        return VLLMBackend(**kwargs)
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
