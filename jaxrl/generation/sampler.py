"""`n` completions of each prompt of a call, through one engine: what rollouts, evaluation and online training use.

    sampler = Sampler(model, max_new_tokens=4096, max_prompt_len=2048, batch_size=64, eos_token_ids=(eos,))
    out = sampler.sample(prompts, params=..., n=8, temperature=1.0, seed=step)   # GenerationOutput, prompt-major
    for j, completions in sampler.stream(prompts, n=8, ...): ...                 # prompt by prompt, in order

    from jaxrl.generation import generate                                       # the one-call entry point
    out = generate(model, prompts, max_new_tokens=64, temperature=0.0, n=1, seed=0, eos_token_ids=(eos,))

A call runs one Engine (jaxrl/generation/engine.py): its prompt width is the smallest prompt bucket holding the
call's longest prompt, its slot count the smallest batch bucket holding all rows (at most `batch_size`).
`sample` submits every row up front and lets a round run to the cap (all rows are known); its rows move to fewer
slots as the call drains (`shrink`: None = when the cap is at least SHRINK_MIN_CAP). `stream` feeds the engine
as it goes, so the slots freed by finished rows are refilled from the next prompts: a whole run of many prompts
pays for one tail, not one per call. The weights are an argument: a trainer holds one Sampler and passes its
current LoRA parameters each rollout without recompiling (jax caches the programs by their static structure, not
by the Sampler object, so `generate` in a loop does not recompile either).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional, Sequence

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.generation import buckets
from jaxrl.generation.buckets import MIN_PROMPT_BUCKET, pick_bucket
from jaxrl.generation.engine import Completion, Engine, Request, Ticket, insert_sizes, program_bound, prompts_per_rows
from jaxrl.generation.placement import data_parallel_size
from jaxrl.generation.sampling import sampling_mode
from jaxrl.generation.stopping import completion_text

__all__ = ["GenerationOutput", "SHRINK_MIN_CAP", "Sampler", "completion_texts", "generate"]

# A call whose cap is below this never shrinks: the steps a shrink can save (at most the cap) do not pay for
# compiling the smaller slot counts' programs.
SHRINK_MIN_CAP = 128
DEFAULT_BATCH_SIZE = 32


@dataclasses.dataclass
class GenerationOutput:
    """Samples in prompt-major order: row i is sample sample_indices[i] of prompt prompt_indices[i].

    tokens[i]: generated ids, up to and including the stop token. logprobs[i]: [len] f32, log-probability of each
    generated token under the model at temperature 1 without filtering. finish_reasons[i]: "stop" (ended on an
    EOS or stop id) or "length" (hit max_new_tokens: the completion is truncated). stats: the engine's counters.
    """

    tokens: list[list[int]]
    logprobs: list[np.ndarray]
    finish_reasons: list[str]
    prompt_indices: list[int]
    sample_indices: list[int]
    prompt_lengths: list[int]
    max_new_tokens: int
    texts: Optional[list[str]] = None
    stats: dict = dataclasses.field(default_factory=dict)

    @property
    def truncated(self) -> list[bool]:
        return [r == "length" for r in self.finish_reasons]

    @property
    def num_tokens(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def __len__(self) -> int:
        return len(self.tokens)


class Sampler:
    """`sample` / `stream` over the engine (module docstring), with these settings checked once.

    Args:
      model: the nnx model to sample from; each call reads its current structure (adapters attached, enabled or
        disabled) and, unless `params` is given, its current weights.
      max_new_tokens: the generation cap (a static size of the token buffers and the caches).
      max_prompt_len: the longest prompt accepted (a longer one is an error naming it). Default: the largest
        prompt bucket.
      prompt_buckets: prompt widths that get their own programs; default 32, 64, ... up to max_prompt_len.
      batch_size: slots of a call (the largest batch bucket); a call of fewer rows runs at a smaller bucket.
      eos_token_ids, stop_token_ids: ids that end a row (finish_reason "stop"; the id is kept in the tokens).
      pad_token_id: the id written into padding (never attended to).
      mesh: a (data, fsdp, tensor) mesh: rows are split over data x fsdp, parameters placed by the sharding rules.
      insert_rows / round_steps: the engine's K and round length (default: `insert_sizes`, the cap).
      shrink: move a draining `sample` call's rows to fewer slots (None: when the cap is at least SHRINK_MIN_CAP).
      fuse_adapters: the engine's (False: LoRA adapters decoded unfused, to measure what fusing saves).
    """

    def __init__(self, model: nnx.Module, *, max_new_tokens: int, max_prompt_len: Optional[int] = None,
                 prompt_buckets: Optional[Sequence[int]] = None, batch_size: int = DEFAULT_BATCH_SIZE,
                 batch_buckets: Optional[Sequence[int]] = None, eos_token_ids: Sequence[int] = (),
                 stop_token_ids: Sequence[int] = (), pad_token_id: Optional[int] = None,
                 mesh: Optional[Mesh] = None, insert_rows: Optional[int] = None, round_steps: Optional[int] = None,
                 shrink: Optional[bool] = None, fuse_adapters: bool = True):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.max_new_tokens = int(max_new_tokens)
        if prompt_buckets is None:
            if max_prompt_len is None:
                raise ValueError("give max_prompt_len or prompt_buckets")
            prompt_buckets = buckets.prompt_buckets(int(max_prompt_len))
        self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets))
        self.max_prompt_len = int(max_prompt_len) if max_prompt_len is not None else self.prompt_buckets[-1]
        if self.max_prompt_len > self.prompt_buckets[-1]:
            raise ValueError(f"max_prompt_len {self.max_prompt_len} exceeds the largest prompt bucket "
                             f"{self.prompt_buckets[-1]}")
        self.mesh = mesh
        self.multiple = data_parallel_size(mesh)
        if batch_size % self.multiple:
            batch_size += self.multiple - batch_size % self.multiple  # every program's rows split evenly
        self.batch_buckets = (tuple(sorted(batch_buckets)) if batch_buckets
                              else buckets.batch_buckets(batch_size, self.multiple))
        bad = [b for b in self.batch_buckets if b % self.multiple]
        if bad:
            raise ValueError(f"batch buckets {bad} are not multiples of the data-parallel size {self.multiple}")
        self.batch_size = self.batch_buckets[-1]
        ids = tuple(int(t) for t in eos_token_ids) + tuple(int(t) for t in stop_token_ids)
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"stop/eos token id {t} is outside the vocabulary [0, {self.vocab_size})")
        self.stop_ids = tuple(sorted(set(ids)))
        if pad_token_id is None:
            pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.pad_id = int(pad_token_id)
        self.insert_rows = insert_rows
        self.round_steps = int(round_steps) if round_steps else None
        self.shrinks = self.max_new_tokens >= SHRINK_MIN_CAP if shrink is None else bool(shrink)
        self.fuse_adapters = bool(fuse_adapters)
        self.stats: dict = {}  # the engine's counters of the last call

    def program_bound(self) -> int:
        """The most engine programs this sampler can compile per (model structure, sampling mode)."""
        return program_bound(self.batch_buckets, len(self.prompt_buckets), self.multiple, self.shrinks)

    # ------------------------------------------------------------------------------------------------ checks
    def _check_call(self, prompts, n: int, seed: int, temperature: float, top_p: float, top_k: int,
                    group_ids) -> tuple[list[np.ndarray], list[int]]:
        """(prompts as arrays, group ids mod 2^32) of a call, every setting checked before any work."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if not 0 <= int(seed) < 2 ** 32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        sampling_mode(float(temperature), float(top_p), int(top_k), self.vocab_size)
        arrays = []
        for j, p in enumerate(prompts):
            arr = np.asarray(p, dtype=np.int64).reshape(-1)
            if arr.size == 0:
                raise ValueError(f"prompt {j} is empty")
            if arr.size > self.max_prompt_len:
                raise ValueError(f"prompt {j} has {arr.size} tokens, over max_prompt_len={self.max_prompt_len}; "
                                 "shorten it or raise max_prompt_len (prompts are never cut silently)")
            if arr.min() < 0 or arr.max() >= self.vocab_size:
                raise ValueError(f"prompt {j} has token ids outside [0, {self.vocab_size})")
            arrays.append(arr.astype(np.int32))
        if group_ids is None:
            group_ids = range(len(arrays))
        group_ids = [int(g) % 2 ** 32 for g in group_ids]
        if len(group_ids) != len(arrays):
            raise ValueError(f"{len(group_ids)} group_ids for {len(arrays)} prompts")
        return arrays, group_ids

    def _engine(self, arrays: list, n: int, num_rows: int, params, shrink: bool, round_steps: Optional[int]
                ) -> Engine:
        """The Engine of one call: the smallest batch bucket holding its rows, the smallest prompt bucket holding
        its longest prompt, one pool."""
        prompt_len = pick_bucket(max(len(p) for p in arrays), self.prompt_buckets, "prompt length")
        return self._build(num_rows, n, (prompt_len,), self.max_new_tokens, params, shrink, round_steps)

    def session_engine(self, num_rows: int, session_tokens: int, *, params=None) -> Engine:
        """An engine for `num_rows` multi-turn sessions (episodes) of at most `session_tokens` tokens after their
        first prompt: its rows carry `Request.session`, so a turn's slot is held with its caches and the next turn
        feeds only what was appended (jaxrl/generation/engine.py, "sessions"). Every prompt bucket of this sampler
        (a turn that cannot continue, its slot given up, starts fresh with its whole history); a round ends as
        soon as K rows finish their turn, so their environment steps are not kept waiting for the others'."""
        if session_tokens < self.max_new_tokens:
            raise ValueError(f"session_tokens={session_tokens} cannot hold one turn of {self.max_new_tokens}")
        return self._build(num_rows, 1, self.prompt_buckets, int(session_tokens), params, False, self.round_steps)

    def _build(self, num_rows: int, n: int, prompt_buckets: tuple, cap: int, params, shrink: bool,
               round_steps: Optional[int]) -> Engine:
        """An Engine of the smallest batch bucket holding `num_rows` rows (n per prompt), with its weights set."""
        slots = next((b for b in self.batch_buckets if b >= num_rows), self.batch_size)
        rows, prompts = insert_sizes(slots, n, self.multiple, self.max_new_tokens)
        if self.insert_rows:
            rows, prompts = self.insert_rows, prompts_per_rows(self.insert_rows, n, self.multiple)
        engine = Engine(self.model, slots=slots, prompt_buckets=prompt_buckets, generation_buckets=(cap,),
                        eos_token_ids=self.stop_ids, pad_token_id=self.pad_id, mesh=self.mesh, insert_rows=rows,
                        prompts_per_insert=min(rows, prompts), round_steps=round_steps or self.max_new_tokens,
                        shrink=shrink, fuse_adapters=self.fuse_adapters)
        engine.set_params(params)
        return engine

    def _request(self, prompt, group_id: int, sample: int, seed: int, temperature: float, top_p: float, top_k: int,
                 key, cap: Optional[int] = None) -> Request:
        return Request(prompt, group_id=group_id, sample_index=sample, seed=int(seed), max_new_tokens=cap,
                       temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), prompt_key=key)

    # ------------------------------------------------------------------------------------------------ calls
    def sample(self, prompts: Sequence[Sequence[int]], *, params=None, n: int = 1, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0, group_ids: Optional[Sequence[int]] = None,
               row_caps: Optional[Sequence[int]] = None) -> GenerationOutput:
        """`n` samples of every prompt (token-id lists of any lengths up to max_prompt_len), prompt-major.

        params: the weights to sample with: an nnx.State (or a tuple of States from a filtered nnx.split) of a
          model with this sampler's structure; default the held model's current weights.
        group_ids: per prompt, the id its samples' keys derive from (default: the prompt's index).
        row_caps: a cap per row (prompt-major, each <= max_new_tokens; default the cap).
        """
        arrays, group_ids = self._check_call(prompts, n, seed, temperature, top_p, top_k, group_ids)
        num_rows = len(arrays) * n
        if row_caps is not None and len(row_caps) != num_rows:
            raise ValueError(f"{len(row_caps)} row_caps for {num_rows} rows")
        # Every row of a call is known when it starts, so a round need end only when slots are to be refilled or
        # shrunk (the engine's own exits): by default it may run to the cap.
        engine = self._engine(arrays, n, num_rows, params, self.shrinks, self.round_steps)
        tickets = [engine.submit(self._request(arrays[j], group_ids[j], s, seed, temperature, top_p, top_k, j,
                                               None if row_caps is None else int(row_caps[j * n + s])))
                   for j in range(len(arrays)) for s in range(n)]
        engine.run()
        engine.release()
        done = [t.wait() for t in tickets]
        self.stats = dict(engine.stats, slots=engine.slots, prompt_len=engine.prompt_buckets[0])
        return GenerationOutput(tokens=[c.tokens for c in done], logprobs=[c.logprobs for c in done],
                                finish_reasons=[c.finish_reason for c in done],
                                prompt_indices=[r // n for r in range(num_rows)],
                                sample_indices=[r % n for r in range(num_rows)],
                                prompt_lengths=[len(arrays[r // n]) for r in range(num_rows)],
                                max_new_tokens=self.max_new_tokens, stats=self.stats)

    def stream(self, prompts: Sequence[Sequence[int]], *, params=None, n: int = 1, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0, group_ids: Optional[Sequence[int]] = None,
               lookahead: Optional[int] = None) -> Iterator[tuple[int, list[Completion]]]:
        """(prompt index, its n completions) for every prompt, in prompt order, from ONE engine fed as it goes.

        The rows of later prompts are queued while fewer than `lookahead` rows wait (default: twice the slots, so
        the queue outlasts a round's refills: a pool whose queue ran dry would end its rounds to shrink), and a
        slot freed by a finished row is refilled from the next prompts instead of idling until the last rows of
        a batch end. Everything happens between the caller's `next()` calls (no thread): the schedule, and so
        every log-probability, is a function of the inputs alone. One tail per stream, so no shrink ladder (its
        programs would cost more to compile than they save on one tail). `stats` holds the engine's counters
        once the stream is exhausted.
        """
        arrays, group_ids = self._check_call(prompts, n, seed, temperature, top_p, top_k, group_ids)
        if not arrays:
            return
        engine = self._engine(arrays, n, len(arrays) * n, params, shrink=False, round_steps=self.round_steps)
        lookahead = int(lookahead or 2 * engine.slots)
        pending: dict[int, list[Ticket]] = {}
        queued = 0  # prompts whose rows are submitted
        for j in range(len(arrays)):
            while True:
                while queued < len(arrays) and engine.queued < lookahead:
                    pending[queued] = [engine.submit(self._request(arrays[queued], group_ids[queued], s, seed,
                                                                   temperature, top_p, top_k, queued))
                                       for s in range(n)]
                    queued += 1
                if all(t.done for t in pending[j]):
                    break
                if engine.idle:
                    raise RuntimeError(f"the engine went idle with prompt {j}'s rows unfinished")
                engine.step()
            yield j, [t.wait() for t in pending.pop(j)]
        engine.release()
        self.stats = dict(engine.stats, slots=engine.slots, prompt_len=engine.prompt_buckets[0])


def completion_texts(tokenizer: Any, tokens: Sequence[Sequence[int]], stop_ids: Sequence[int]) -> list[str]:
    """Completion texts by the one rule (`jaxrl.generation.stopping.completion_text`)."""
    stop = frozenset(int(t) for t in stop_ids)
    return [completion_text(tokenizer, toks, stop) for toks in tokens]


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def generate(model: nnx.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, n: int = 1, seed: int = 0,
             eos_token_ids: Optional[Sequence[int] | int] = None, stop_token_ids: Sequence[int] = (),
             batch_size: Optional[int] = None, tokenizer: Any = None, *, max_prompt_len: Optional[int] = None,
             prompt_buckets: Optional[Sequence[int]] = None, mesh: Optional[Mesh] = None,
             params=None) -> GenerationOutput:
    """Samples `n` completions for each prompt (lists of token ids, any lengths); prompt-major
    (prompt j -> rows j*n ... j*n+n-1).

    Args:
      eos_token_ids: ids that end a completion; None means the model config's eos_token_id, () means none.
      stop_token_ids: more ids that end a completion (like EOS: finish_reason "stop", the id is kept).
      temperature: 0 = greedy; top_p in (0, 1]; top_k 0 = off.
      batch_size: slots (default 32, or the power of two holding all rows if fewer).
      tokenizer: if given, `texts` holds the decoded completions (`completion_text`).
      max_prompt_len: longest accepted prompt; default: the longest given prompt rounded up to a power of two.
      prompt_buckets: prompt lengths that get their own programs (default 32, 64, ... up to max_prompt_len).
      mesh: shard rows over (data, fsdp) and parameters by the sharding rules.
      params: weights to use instead of the model's current ones (an nnx.State or a tuple of States).
    """
    if eos_token_ids is None:
        eos_token_ids = model.config.eos_token_id
    lengths = [len(p) for p in prompts]
    if not lengths:
        raise ValueError("no prompts given")
    if max_prompt_len is None and prompt_buckets is None:
        # A power of two (>= 32): prompt sets of similar lengths share the bucket ladder and its programs.
        max_prompt_len = max(MIN_PROMPT_BUCKET, 1 << (max(lengths) - 1).bit_length())
    rows = len(prompts) * n
    if batch_size is None:
        batch_size = min(DEFAULT_BATCH_SIZE, 1 << max(rows - 1, 0).bit_length())
    sampler = Sampler(model, max_new_tokens=max_new_tokens, max_prompt_len=max_prompt_len,
                      prompt_buckets=prompt_buckets, batch_size=batch_size, eos_token_ids=_as_ids(eos_token_ids),
                      stop_token_ids=_as_ids(stop_token_ids), mesh=mesh)
    out = sampler.sample(prompts, params=params, n=n, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    if tokenizer is not None:
        out.texts = completion_texts(tokenizer, out.tokens, _as_ids(eos_token_ids) + _as_ids(stop_token_ids))
    return out

