"""Generation: the one engine every consumer samples with (rollouts, evaluation, online training, serving).

    from jaxrl.generation import Engine, Request, Sampler, SamplingParams, generate

Modules: `sampling` (settings, the token choice, keys, request seeds), `stopping` (the one stopping rule, device
and host sides), `buckets` (the static sizes programs are compiled for), `placement` (rows and weights on the
mesh), `programs` (the device state and compiled programs), `engine` (the scheduler: pools of slots, admission,
rounds), `sampler` (n completions of each prompt of a call; `generate`).
"""

from jaxrl.generation.engine import Completion, Engine, Request, Ticket
from jaxrl.generation.programs import TRACE_COUNTS, engine_programs
from jaxrl.generation.sampler import GenerationOutput, Sampler, completion_texts, generate
from jaxrl.generation.sampling import SamplingMode, SamplingParams, sample_tokens, sampling_mode
from jaxrl.generation.stopping import Finished, StopRule, completion_text

__all__ = ["Completion", "Engine", "Finished", "GenerationOutput", "Request", "Sampler", "SamplingMode",
           "SamplingParams", "StopRule", "TRACE_COUNTS", "Ticket", "completion_text", "completion_texts",
           "engine_programs", "generate", "sample_tokens", "sampling_mode"]
