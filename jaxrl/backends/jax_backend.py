"""The default backend: our JAX model and the generation engine (`jaxrl.generation`), with adapters attached
unmerged (fused into the base projections for decoding, `Qwen35.decode_weights`).

Two ways to hold a model:
  * from folders (`base_dir`): `load(spec, adapter)` loads the base once and swaps LoRA factors in place when the
    checkpoint changes (no reload); a model given as a full HF folder (`spec.kind == "hf"`) is loaded on its own;
  * a model object (`model=`): an already built base (tests, the demo) or the live policy of online training,
    whose current weights each `update_weights(policy)` hands over (the engine samples with those very arrays;
    nothing recompiles).
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Any, Optional, Sequence

import jax.numpy as jnp
from absl import logging

from jaxrl.backends.base import Generation, ModelSpec, NextRow, Policy, RolloutBackend, RowRequest, SamplingParams
from jaxrl.generation import Sampler
from jaxrl.generation.engine import Request
from jaxrl.generation.programs import engine_programs
from jaxrl.models import qwen35
from jaxrl.models.adapters import attach, attached_digest, detach
from jaxrl.parallel.sharding import batch_shards

DTYPES = ("bfloat16", "float32")
ENGINE_COUNTERS = ("rows", "decode_steps", "slot_steps", "rounds", "inserts", "prefilled_prompts", "prefilled_tokens",
                   "generated_tokens")
SESSION_COUNTERS = ("continued", "extended_tokens", "extensions")  # a session engine's: rows continued in place


def _session_order(row: RowRequest, submitted: int) -> tuple:
    """The order in which rows finished in the same round are handed on: by session (an episode's number), then
    by submission."""
    return (0, row.session, submitted) if isinstance(row.session, int) else (1, 0, submitted)


class JaxBackend(RolloutBackend):
    name = "jax"

    def __init__(self, base_dir: Optional[str] = None, *, dtype: Optional[str] = "bfloat16", batch_size: int = 64,
                 max_prompt_len: int = 4096, prompt_buckets: Optional[Sequence[int]] = None,
                 stop_ids: Sequence[int] = (), pad_id: Optional[int] = None, model=None, mesh=None,
                 collect_factor: int = 4, shrink: Optional[bool] = None):
        """dtype: compute dtype of models loaded from folders; None with `model=` (take the model's own).
        mesh: rows split over its data x fsdp axes, weights placed by the sharding rules; `batch_size` (rows decoded
        at once: the engine's slots) is rounded up to a multiple of data x fsdp.
        prompt_buckets: the prompt lengths the engine's programs are compiled for (default 32, 64, ... up to
        max_prompt_len); a call uses the smallest that holds its longest prompt. One length (a rollout's prompts
        chosen from its data) means one set of programs.
        collect_factor: rows a caller should hand to one `generate` call, in slots (`batch_size`): finished slots
        are refilled only from rows of the same call (`stream` has no such limit). shrink: let a draining call move
        its last rows to fewer slots (more programs, cheaper steps; None: when the cap is at least
        `jaxrl.generation.sampler.SHRINK_MIN_CAP`)."""
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if int(collect_factor) < 1:
            raise ValueError(f"collect_factor must be >= 1, got {collect_factor}")
        if base_dir is None and model is None:
            raise ValueError("JaxBackend needs a base_dir or a model")
        if model is not None and dtype is not None and jnp.dtype(model.dtype) != jnp.dtype(dtype):
            # the cache settings record `dtype`: a model of another dtype would be misdescribed
            raise ValueError(f"the given base model computes in {jnp.dtype(model.dtype).name}, not {dtype}")
        self.base_dir, self.dtype = base_dir, dtype
        self.slots, self.max_prompt_len = int(batch_size), int(max_prompt_len)
        if self.slots < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if mesh is not None:  # every compiled batch splits evenly over the data-parallel devices
            dp = batch_shards(mesh)
            self.slots = -(-self.slots // dp) * dp
        self.shrink = shrink
        self.batch_size = self.slots * int(collect_factor)
        self.prompt_buckets = tuple(prompt_buckets) if prompt_buckets else None
        self.stop_ids, self.pad_id, self.mesh = tuple(int(t) for t in stop_ids), pad_id, mesh
        self._base = model
        self._model = model  # a given model is ready to sample from without load()
        self._params = None  # the weights of `update_weights` (None: the held model's own)
        self._samplers: dict[int, Sampler] = {}
        self.compiled_programs = 0  # engine programs traced by this process when the last call returned
        # the engines' counters (prefilled tokens, decode steps, ...) summed over every generate / stream call
        self.counters: collections.Counter = collections.Counter()

    def _load_folder(self, folder: str):
        return qwen35.from_pretrained(folder, dtype=getattr(jnp, self.dtype or "bfloat16"), mesh=self.mesh)

    def load(self, spec: ModelSpec, adapter=None) -> None:
        """Make `spec` (base, base + adapter, or an HF folder) the model that `generate` samples from."""
        if spec.kind == "hf":
            if adapter is not None:
                raise ValueError(f"model {spec.name!r}: an HF folder takes no adapter")
            self._model = self._load_folder(spec.path)
        else:
            if self._base is None:
                self._base = self._load_folder(self.base_dir)
            detach(self._base)
            if adapter is not None:
                attach(self._base, adapter)
            self._model = self._base
        self._params = None
        self._samplers = {}

    def update_weights(self, policy: Policy) -> None:
        """Samples with `policy.params` from now on (the held model must be the policy's structure: online training
        builds this backend on the live policy). Nothing is copied or checked: these are the arrays sampled with."""
        self._params = policy.params
        return None

    def loaded_digest(self) -> Optional[str]:
        """Digest of the LoRA factors the loaded model carries (read back from its parameters)."""
        return attached_digest(self._model)

    def sampler(self, max_new_tokens: int) -> Sampler:
        """The sampler of this cap (built once per cap; its programs compile once per shape)."""
        if self._model is None:
            raise RuntimeError("JaxBackend: no model loaded (call load() first)")
        if max_new_tokens not in self._samplers:
            self._samplers[max_new_tokens] = Sampler(
                self._model, shrink=self.shrink, max_new_tokens=max_new_tokens, max_prompt_len=self.max_prompt_len,
                prompt_buckets=self.prompt_buckets, batch_size=self.slots, eos_token_ids=self.stop_ids,
                pad_token_id=self.pad_id, mesh=self.mesh)
        return self._samplers[max_new_tokens]

    def _log_programs(self, sampler: Sampler, what: str) -> None:
        programs = engine_programs()
        if programs > self.compiled_programs:
            logging.info("jax backend: %d engine programs compiled in this process (%d by this %s; at most %d per "
                         "model structure, sampling mode and cap)", programs, programs - self.compiled_programs,
                         what, sampler.program_bound())
        self.compiled_programs = programs

    def generate(self, prompts, group_ids, sampling: SamplingParams) -> list[Generation]:
        sampler = self.sampler(int(sampling.max_new_tokens))
        out = sampler.sample(prompts, params=self._params, n=sampling.n, temperature=sampling.temperature,
                             top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed, group_ids=group_ids)
        self._log_programs(sampler, "call")
        self.counters.update({k: v for k, v in sampler.stats.items() if k in ENGINE_COUNTERS})
        return [Generation(list(out.tokens[i]), out.finish_reasons[i], out.prompt_indices[i], out.sample_indices[i],
                           [float(x) for x in out.logprobs[i]]) for i in range(len(out))]

    def generate_rows(self, rows: Sequence[RowRequest], sampling: SamplingParams, *, then: NextRow,
                      session_tokens: int = 0) -> dict:
        """`RolloutBackend.generate_rows`; with `session_tokens` > 0 every row goes through one session engine
        (`Sampler.session_engine`): a row whose next turn continues it keeps its slot with its caches, and that turn
        feeds only what its request appends. Rows run independently: whenever a round ends, the rows that finished
        are handed to `then` (in session order) and the rows it returns join before the next round, so no row waits
        for the slowest turn of the others; the schedule is still a function of the requests (no clock), so the
        tokens are the same every run. The engine's counters of the call come back beside `sample_s`."""
        if session_tokens <= 0:
            return super().generate_rows(rows, sampling, then=then)
        cap = int(sampling.max_new_tokens)
        engine = self.sampler(cap).session_engine(len(rows), session_tokens, params=self._params)
        pending: dict[int, tuple[RowRequest, Any]] = {}  # submission number -> (row, its ticket)
        counter = itertools.count()

        def submit(row: RowRequest) -> None:
            ticket = engine.submit(Request(list(row.prompt), group_id=row.group_id, sample_index=row.sample_index,
                                           seed=int(sampling.seed), max_new_tokens=cap,
                                           temperature=float(sampling.temperature), top_p=float(sampling.top_p),
                                           top_k=int(sampling.top_k), prompt_key=row.prompt_key,
                                           session=row.session, session_tokens=session_tokens))
            pending[next(counter)] = (row, ticket)

        seconds = 0.0
        try:
            for row in rows:
                submit(row)
            while pending:
                t0 = time.perf_counter()
                if engine.idle:
                    raise RuntimeError(f"the session engine went idle with {len(pending)} rows unfinished")
                engine.step()
                seconds += time.perf_counter() - t0
                done = sorted(((k, row, ticket) for k, (row, ticket) in pending.items() if ticket.done),
                              key=lambda item: _session_order(item[1], item[0]))
                for k, row, ticket in done:
                    del pending[k]
                    c = ticket.wait()
                    follow = then(row, Generation(list(c.tokens), c.finish_reason, 0, row.sample_index,
                                                  [float(x) for x in c.logprobs]))
                    if follow is not None:
                        submit(follow)
                    elif row.session is not None:
                        engine.end_session(row.session)
            stats = dict(engine.stats)
        finally:
            engine.release()  # the held sessions and the slots' caches
        self.counters.update({k: v for k, v in stats.items() if k in ENGINE_COUNTERS or k in SESSION_COUNTERS})
        return {"sample_s": seconds, **{f"engine/{k}": float(v) for k, v in stats.items()}}

    def stream(self, prompts, group_ids, sampling: SamplingParams, *, prompts_per_call: int):
        """(prompt index, its `sampling.n` generations) for every prompt, in order, from one engine fed as it goes
        (`Sampler.stream`: one tail for the whole run instead of one per call of `prompts_per_call`)."""
        sampler = self.sampler(int(sampling.max_new_tokens))
        for j, completions in sampler.stream(prompts, params=self._params, n=sampling.n,
                                             temperature=sampling.temperature, top_p=sampling.top_p,
                                             top_k=sampling.top_k, seed=sampling.seed, group_ids=group_ids):
            yield j, [Generation(list(c.tokens), c.finish_reason, j, i, [float(x) for x in c.logprobs])
                      for i, c in enumerate(completions)]
        self._log_programs(sampler, "stream")
        self.counters.update({k: v for k, v in sampler.stats.items() if k in ENGINE_COUNTERS})

    def close(self) -> None:
        self._model = self._base = self._params = None
        self._samplers = {}
