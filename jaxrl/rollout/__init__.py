"""Rollout engine: continuous batching (jaxrl.rollout.engine) over prefill + jitted decode with KV and
linear-attention state caches; the static Sampler is its reference.

    from jaxrl.rollout import generate, ContinuousSampler, Engine, Request
    out = generate(model, prompts, max_new_tokens=64, temperature=0.0, top_p=1.0, n=1, seed=0,
                   eos_token_ids=(eos,))
"""

from jaxrl.rollout.engine import Completion, ContinuousSampler, Engine, Request, Ticket
from jaxrl.rollout.generate import decode_texts, generate
from jaxrl.rollout.sampler import TRACE_COUNTS, GenerationOutput, Sampler
from jaxrl.rollout.sampling import SamplingMode, sample_tokens, sampling_mode

__all__ = ["Completion", "ContinuousSampler", "Engine", "GenerationOutput", "Request", "Sampler", "SamplingMode",
           "TRACE_COUNTS", "Ticket", "decode_texts", "generate", "sample_tokens", "sampling_mode"]
