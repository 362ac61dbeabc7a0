"""The types every generation backend shares: sampling parameters, one completion, one servable model."""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional, Protocol, Sequence

MODEL_KINDS = ("base", "adapter", "hf")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample: `n` completions per prompt of at most `max_new_tokens` tokens.

    temperature 0 = greedy; top_p in (0, 1]; top_k 0 = off. `seed` with the group id and sample index keys every
    sample. Invalid values raise ValueError naming the field (checked at construction, before any work).
    """

    n: int = 1
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        problems = []
        if int(self.n) < 1:
            problems.append(f"n (samples per prompt) must be >= 1, got {self.n}")
        if int(self.max_new_tokens) < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(float(self.temperature)) and float(self.temperature) >= 0.0):
            problems.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if problems:
            raise ValueError("; ".join(problems))

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class Generation:
    """One completion: generated ids (up to and including the stop token) and "stop" | "length".

    logprobs: log-probability of each generated token under the sampled model (temperature 1, unfiltered) when
    the backend provides them (the jax backend always does), else None.
    """

    tokens: list[int]
    finish_reason: str
    prompt_index: int
    sample_index: int
    logprobs: Optional[list[float]] = None


@dataclasses.dataclass
class ModelSpec:
    """One model a backend can serve.

    kind: "base" (the base folder), "adapter" (base + a trainer adapter checkpoint or a PEFT folder at `path`),
      "hf" (a full HF folder at `path`, e.g. a merged export).
    step: optimizer step of a checkpoint (results.json "step"; the name is usually `step_<step>`).
    """

    name: str
    kind: str
    path: Optional[str] = None
    step: Optional[int] = None

    def __post_init__(self):
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"model {self.name!r}: kind must be one of {MODEL_KINDS}, got {self.kind!r}")
        if self.kind != "base" and not self.path:
            raise ValueError(f"model {self.name!r}: kind {self.kind!r} needs a path")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"model name {self.name!r} is not usable as a file name")


class GenerationBackend(Protocol):
    """What every backend provides (see the module docstring)."""

    name: str

    def load(self, spec: ModelSpec, adapter=None) -> None: ...

    def loaded_digest(self) -> Optional[str]: ...

    def served_fingerprint(self) -> Optional[str]: ...

    def generate(self, prompts: Sequence[Sequence[int]], group_ids: Sequence[int], sampling: SamplingParams, *,
                 params=None) -> list[Generation]: ...

    def close(self) -> None: ...



def chunked_stream(backend, prompts: Sequence[Sequence[int]], group_ids: Sequence[int], sampling: SamplingParams,
                   prompts_per_call: int) -> Iterator[tuple[int, list[Generation]]]:
    """`stream` for a backend that generates a call at a time: `prompts_per_call` prompts per `generate` call,
    yielded prompt by prompt in order."""
    for start in range(0, len(prompts), max(1, prompts_per_call)):
        gens = backend.generate(prompts[start:start + prompts_per_call], group_ids[start:start + prompts_per_call],
                                sampling)
        by_prompt: list[list[Generation]] = [[] for _ in prompts[start:start + prompts_per_call]]
        for g in gens:
            by_prompt[g.prompt_index].append(g)
            g.prompt_index += start
        for k, rows in enumerate(by_prompt):
            yield start + k, rows
