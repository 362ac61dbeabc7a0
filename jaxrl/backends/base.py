"""The interface every generation backend implements (`RolloutBackend`) and the types they share: one completion,
one servable model, one version of a trainer's policy.

    backend.load(ModelSpec("step_28", "adapter", path), adapter)   # evaluation: a model by its files
    backend.update_weights(policy)                                  # online training: the trainer's current policy
    gens = backend.generate(prompts, group_ids, SamplingParams(n=8, max_new_tokens=4096, temperature=1.0))
    for j, gens_j in backend.stream(prompts, group_ids, sampling, prompts_per_call=8): ...
    backend.generate_rows(rows, sampling, then=next_turn, session_tokens=E)   # rows, and the rows they lead to
    backend.close()

Rows are prompt-major (prompt j -> rows j*n ... j*n+n-1). `tokens` are the generated ids up to and including the
stop token; `finish_reason` is "stop" (a stop id ended it) or "length" (the cap did). Sample keys derive from
(seed, group id, sample index) on every backend (jaxrl.generation.sampling), so a sample does not depend on its
batch, its server or the backend that drew it.

Rows that lead to more rows (the turns of multi-turn episodes, jaxrl.environments.runner) go through
`generate_rows`: each `RowRequest` carries its tokens so far, its key and, for a row whose next turn will continue
it, its `session`. The jax backend keeps such a row's slot with its caches and feeds only what the next request
appends; a server prefills the whole history again. Either way the tokens are the same (the keys are the rows').
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence

from jaxrl.generation.sampling import SamplingParams

MODEL_KINDS = ("base", "adapter", "hf")


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
    # the adapter digest (None: the base) each generated token was sampled with, when the backend reports it
    # (a JAX server asked for `return_token_versions`: several digests when the adapter was reloaded mid-row)
    token_digests: Optional[list] = None


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


@dataclasses.dataclass(frozen=True)
class Policy:
    """A trainer's policy at one version, as backends take it: the in-memory weights (the jax backend samples
    with these very arrays) and its LoRA adapter (a host copy, made only for a backend that sends it to servers;
    its digest is what they must report serving)."""

    version: str  # names the served adapter (e.g. "r7": the weights of rollout 7)
    params: Any  # nnx.State of the policy model (trained and frozen variables)
    adapter: Callable[[], Any]  # -> jaxrl.models.adapters.Adapter


@dataclasses.dataclass(frozen=True)
class RowRequest:
    """One row for `RolloutBackend.generate_rows`: its tokens so far (`prompt`: a first prompt, or a session's whole
    history) and its sample key (seed, `group_id`, `sample_index`). `session`: the row's next turn will continue it
    (jax: its slot and caches are kept; servers prefill again); `prompt_key`: rows of one prompt that share its
    prefill, the K first turns of a problem keyed as one prompt x K samples (sample indices 0 .. K-1)."""

    prompt: tuple
    group_id: int
    sample_index: int = 0
    session: Optional[Hashable] = None
    prompt_key: Optional[Hashable] = None


# What `generate_rows` calls when a row finishes: its next row (the same session), or None when it ends there.
NextRow = Callable[[RowRequest, Generation], Optional[RowRequest]]


class RolloutBackend(abc.ABC):
    """What every backend provides (module docstring). `batch_size`: rows a caller hands one `generate` call (the
    engine's slots several times over, a server's requests in flight); `name`: jax | server | vllm."""

    name: str = ""
    batch_size: int = 64

    @abc.abstractmethod
    def load(self, spec: ModelSpec, adapter=None) -> None:
        """Makes `spec` (base, base + adapter, or an HF folder) the model `generate` samples from."""

    @abc.abstractmethod
    def update_weights(self, policy: Policy) -> Optional[str]:
        """Makes `policy` what `generate` samples from; returns the adapter digest the backend reports serving (a
        server's, read back from it), or None where the backend samples with the given arrays themselves."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], group_ids: Sequence[int],
                 sampling: SamplingParams) -> list[Generation]:
        """`sampling.n` generations of every prompt, prompt-major."""

    def stream(self, prompts: Sequence[Sequence[int]], group_ids: Sequence[int], sampling: SamplingParams, *,
               prompts_per_call: int) -> Iterator[tuple[int, list[Generation]]]:
        """(prompt index, its generations) for every prompt, in order: by default `generate` calls of
        `prompts_per_call` prompts; the jax backend streams every prompt through one engine."""
        yield from chunked_stream(self, prompts, group_ids, sampling, prompts_per_call)

    def generate_rows(self, rows: Sequence[RowRequest], sampling: SamplingParams, *, then: NextRow,
                      session_tokens: int = 0) -> dict:
        """Generates every row (`sampling.n` is ignored: one generation a row), calling `then(row, generation)` on
        this thread as each finishes; the row it returns is generated too. `session_tokens` > 0: rows with a
        `session` continue from turn to turn (at most that many tokens after their first prompt) where the backend
        keeps rows live. Returns {"sample_s": the seconds spent generating}.

        Here (a backend that generates a call at a time, over a wire): in waves, each wave one `generate` call per
        group of rows sharing a prompt (n = K) and one for the rest (n = 1), the rows a wave leads to forming the
        next; every session's history is prefilled again."""
        pending, seconds = list(rows), 0.0
        while pending:
            t0 = time.perf_counter()
            generations = generate_wave(self, pending, sampling)
            seconds += time.perf_counter() - t0
            pending = [nxt for row, gen in zip(pending, generations)
                       for nxt in (then(row, gen),) if nxt is not None]
        return {"sample_s": seconds}

    def fleet_metrics(self) -> dict[str, float]:
        """A fleet of servers (jaxrl.backends.pool): `fleet/servers_up` and `fleet/rows_resent` since this thread's
        last call; {} for a backend of one engine."""
        return {}

    def loaded_digest(self) -> Optional[str]:
        """Digest of the LoRA adapter the loaded model carries, read back from where it is served (None: none)."""
        return None

    def served_fingerprint(self) -> Optional[str]:
        """The fingerprint of a served merged export (jaxrl_export.json), where the backend serves one."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Frees what the backend holds (a server it started stops; an adapter it loaded is unloaded)."""



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


def generate_wave(backend, rows: Sequence[RowRequest], sampling: SamplingParams) -> list[Generation]:
    """One generation per row, in row order: the rows sharing a prompt (`prompt_key`, sample indices 0 .. K-1) as
    one prompt of n = K samples (its keys: (seed, group id, i)), every other row as a prompt of its own (n = 1)."""
    groups: dict[Hashable, list[int]] = {}
    for i, row in enumerate(rows):
        if row.prompt_key is not None:
            groups.setdefault(row.prompt_key, []).append(i)
    shared = [members for members in groups.values()
              if [rows[i].sample_index for i in members] == list(range(len(members)))
              and all(rows[i].prompt == rows[members[0]].prompt for i in members)]
    out: list[Optional[Generation]] = [None] * len(rows)
    for k in sorted({len(m) for m in shared}):  # one call per group size (n is a call's)
        batch = [m for m in shared if len(m) == k]
        gens = backend.generate([rows[m[0]].prompt for m in batch], [rows[m[0]].group_id for m in batch],
                                sampling.replace(n=k))
        for g in gens:
            out[batch[g.prompt_index][g.sample_index]] = g
    rest = [i for i, g in enumerate(out) if g is None]
    if rest:
        gens = backend.generate([rows[i].prompt for i in rest], [rows[i].group_id for i in rest],
                                sampling.replace(n=1))
        for g in gens:
            out[rest[g.prompt_index]] = g
    return out


class Scorer(abc.ABC):
    """What every teacher of distillation provides beside `RolloutBackend`: the teacher-forced scores of given
    rows. Members: the model in this process (jaxrl.backends.jax_teacher.JaxTeacher) and OpenAI-compatible or vLLM
    servers (jaxrl.backends.teacher_client: ServerTeacher, VLLMTeacher), each built from its typed spec
    (`JaxTeacherSpec | ServerTeacherSpec | VLLMTeacherSpec`, jaxrl.backends.scorers); `name`: jax | server | vllm.

        scores = scorer.score(arrays, k=16, temperature=1.0, batch_size=8, chunk_size=512)
        # {"logp": [N, C] the taken token's, "top_logp" / "top_ids": [N, C, k] most likely first,
        #  "rest_logp": [N, C] the log-mass of every other token}; zero (ids 0) off the completion mask
        scorer.close()
    """

    name: str = ""

    @abc.abstractmethod
    def score(self, arrays: dict, *, k: int, temperature: float, batch_size: int, chunk_size: int) -> dict:
        """The scores of every row of `arrays` (input_ids, attention_mask [N, P + C], completion_mask [N, C]):
        completion token t (column P + t) as predicted from the columns before it. float32 arrays, top_ids int32.
        batch_size / chunk_size: rows per call and logit rows per chunk of an in-process pass (servers batch on
        their own)."""

    def close(self) -> None:
        """Frees what the scorer holds (nothing by default)."""
