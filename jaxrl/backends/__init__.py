"""Generation backends behind one interface (`RolloutBackend`: load / update_weights / generate / stream / close):
token-id prompts in, completions out, for whatever model a backend holds.

    backend = make_backend("jax", base_dir=HF_DIR, stop_ids=stop_ids, ...)
    backend.load(ModelSpec("step_28", "adapter", "run/checkpoints/adapters/28"), adapter)
    gens = backend.generate(prompts, group_ids, SamplingParams(n=8, max_new_tokens=4096, temperature=1.0))
    gens[i].tokens, gens[i].logprobs, gens[i].finish_reason, gens[i].prompt_index, gens[i].sample_index

Backends: `jax` (this process's engine, jaxrl.generation; the default, and what online training uses with the
live policy unless `grpo.rollout_backend` / `ppo.rollout_backend` names servers), `vllm` (vLLM 0.33 in its own
environment, started as `vllm serve`, adapters served unmerged as LoRA; or a running vLLM at `url`), `server`
(any OpenAI-compatible completions server at `url`, e.g. `python -m launchers.serve`), and a pool of servers
(jaxrl.backends.pool: online training's rollouts on several servers). Every consumer (offline rollouts, online
GRPO/PPO, evaluation) reaches a backend through `jaxrl.rollout.collect.Collector`, which decodes and scores the
completions the one same way.
"""

from __future__ import annotations

from jaxrl.backends.base import MODEL_KINDS, Generation, ModelSpec, Policy, RolloutBackend, SamplingParams
from jaxrl.backends.jax_backend import JaxBackend
from jaxrl.backends.openai_client import ServerBackend, ServerError
from jaxrl.backends.vllm_backend import VLLMBackend
from jaxrl.utils.train_config import ROLLOUT_BACKENDS

BACKENDS = ROLLOUT_BACKENDS  # the config's choices (jaxrl.utils.train_config)
_CLASSES = {"jax": JaxBackend, "vllm": VLLMBackend, "server": ServerBackend}

__all__ = ["BACKENDS", "MODEL_KINDS", "Generation", "JaxBackend", "ModelSpec", "Policy", "RolloutBackend",
           "SamplingParams", "ServerBackend", "ServerError", "VLLMBackend", "make_backend"]


def make_backend(name: str, **kwargs) -> RolloutBackend:
    """`JaxBackend`, `VLLMBackend` or `ServerBackend` with `kwargs` (each takes what it needs and ignores the
    rest, so one set of arguments serves all three; no backend imports vLLM)."""
    if name not in _CLASSES:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return _CLASSES[name](**kwargs)
