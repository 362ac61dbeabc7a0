"""Generation backends behind one interface (`RolloutBackend`: load / update_weights / generate / stream / close):
token-id prompts in, completions out, for whatever model a backend holds.

    backend = JaxRollout().build(BackendContext(HF_DIR, stop_ids=stop_ids, max_prompt_len=..., max_new_tokens=...))
    backend.load(ModelSpec("step_28", "adapter", "run/checkpoints/adapters/28"), adapter)
    gens = backend.generate(prompts, group_ids, SamplingParams(n=8, max_new_tokens=4096, temperature=1.0))
    gens[i].tokens, gens[i].logprobs, gens[i].finish_reason, gens[i].prompt_index, gens[i].sample_index

Backends: `jax` (this process's engine, jaxrl.generation; the default, and what online training uses with the
live policy unless `grpo.rollout_backend` / `ppo.rollout_backend` names servers), `vllm` (vLLM 0.33 in its own
environment, started as `vllm serve`, adapters served unmerged as LoRA; or a running vLLM at `url`), `server`
(any OpenAI-compatible completions server at `url`, e.g. `python -m launchers.serve`), and a pool of servers
(jaxrl.backends.pool: online training's rollouts on several servers). Each is built from its typed spec
(`JaxRollout | ServerRollout | VLLMRollout`, jaxrl.backends.settings), made from an algorithm block or a launcher's
flags. Every consumer (offline rollouts, online GRPO/PPO, evaluation) reaches a backend through
`jaxrl.rollout.collect.Collector`, which decodes and scores the completions the one same way.

The names below are imported on first use: `jaxrl.backends.settings` (configs import it) stays free of jax.
"""

from __future__ import annotations

from jaxrl.utils.registry import lazy_exports

_EXPORTS = {
    "MODEL_KINDS": "jaxrl.backends.base", "Generation": "jaxrl.backends.base", "ModelSpec": "jaxrl.backends.base",
    "Policy": "jaxrl.backends.base", "RolloutBackend": "jaxrl.backends.base", "SamplingParams": "jaxrl.backends.base",
    "JaxBackend": "jaxrl.backends.jax_backend",
    "ServerBackend": "jaxrl.backends.openai_client", "ServerError": "jaxrl.backends.openai_client",
    "VLLMBackend": "jaxrl.backends.vllm_backend",
    "BackendContext": "jaxrl.backends.settings", "ROLLOUT_BACKENDS": "jaxrl.backends.settings",
    "ROLLOUT_SPECS": "jaxrl.backends.settings",
    "Scorer": "jaxrl.backends.base", "SCORER_SPECS": "jaxrl.backends.scorers",
    "ScorerContext": "jaxrl.backends.scorers",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
