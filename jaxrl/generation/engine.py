"""The engine: continuous batching over pools of decode slots, the one scheduler of rollouts, evaluation, online
training and serving (its device programs: jaxrl/generation/programs.py).

    engine = Engine(model, slots=64, prompt_buckets=(512,), generation_buckets=(4096,), eos_token_ids=(eos,))
    engine.set_params(params)       # the weights of the rows admitted from now on (None: the model's)
    ticket = engine.submit(Request(prompt_ids, group_id=g, sample_index=i, seed=s, temperature=1.0))
    engine.run()                    # or engine.step() per round (a server's thread: jaxrl/serve/loop.py)
    ticket.wait().tokens, .logprobs, .finish_reason

How it schedules (on the host, between rounds; nothing in Python per token):

  * placement: a row's pool is (its prompt bucket, its max_new_tokens' generation bucket, its stop-id width),
    the static shapes of a pool's programs and caches (prompt width + cap positions per slot). A row rather
    joins a pool that holds rows of its sampling mode and prompt width with a cap and stop width at least its own
    and a free slot (the smallest cap first): a step costs every slot of a pool, so rows of mixed caps fill one
    pool instead of several half-empty ones, and a row's sample does not depend on its pool's cap. A rollout
    has one pool (one prompt bucket, one cap); a server's pools open as its requests need them, and a pool's
    caches are freed whenever it has no rows.
  * admission: at a round end a pool's free slots take its waiting rows, K per insert (`insert_sizes`), the rows
    of a prompt copying its one prefill whichever insert they move in with. A pool runs one sampling mode at a
    time (greedy, top-k, top-p are static parts of its programs): a row of another mode waits until it drains.
  * rounds: every pool with rows decodes a round of at most `round_steps` steps, which ends early once enough of
    its slots are free for the rows waiting (`_refill_at`) or, nothing waiting, once its rows fit a smaller slot
    count. Between rounds the host reads which slots finished (a few bytes) and collects their rows.
  * shrink (`shrink=True`): once nothing waits, a pool's running rows move to half its slots as soon as they fit
    (halvings, down to slots / MAX_SHRINK: a round and a shrink program per size), so a rollout's tail does not pay
    for empty slots: a decode step's bytes are the weights plus every slot's caches.

Sessions (`Request.session`, a multi-turn episode): a session row's slot is *held* after it finishes, its caches
kept (the rounds of the other rows leave its state as it was), and the session's next request, whose prompt
extends the held row's prompt + tokens, continues in that slot: only the new ids (the held row's last token, then
what was appended) are fed, by `programs.extend` in chunks of EXTEND_WIDTHS, K rows per program; its first token
is sampled with its own key at index 0, as a fresh row's. Session rows go to pools of their own whose cap is the
session's `session_tokens` (every turn and every appended token after the first prompt). A request that cannot
continue (its prompt does not extend the held tokens, the rest would not fit, another sampling mode runs) frees the
held slot and starts fresh; held slots are given up to rows waiting for a slot (the longest held first), and
`set_params` / `release` end every session. `end_session(key)` frees a slot whose episode is over.

Randomness (jaxrl.generation.sampling): a row's key comes from (seed, group id, sample index), never the slot,
pool, round or batch, so a row's tokens are the same whatever it was scheduled with; the few floating-point sums
whose length differs between two schedules (the decode attention reads a prefix of the cache sized by the longest
row in flight) may differ in the last bit, which can flip a choice only at a near-tie of two logits within that
rounding. Every decision above depends on the engine's own state and the requests, never on time, so the same
requests give the same schedule and the same log-probabilities to the last bit.

Weights (`set_params`): the decode weight copies are made once per weight version (`Qwen35.decode_weights`: each
LoRA adapter's A stacked under its projection's weight, so one product gives both, and [in, out] copies on the CPU);
the adapter is computed exactly as unfused (the policy the trainer holds), never merged (a bf16 merge would erase
small updates). By default weights change only while no row is in flight. `set_params(..., in_flight=True)` swaps
them under running rows at a round end (partial rollouts, PipelineRL's in-flight update): each row keeps its caches
(the KV and DeltaNet states its prefix wrote under the old weights) and samples its next token with the new ones.
Every token's log-prob is the probability the sampler drew it with, so a loss that weights tokens by their behaviour
policy (the decoupled objective) stays exact; `Completion.token_versions` names the version of each token. (AReaL
instead re-prefills a row's prompt and prefix under the new weights: its caches are then the new policy's, at the cost
of a prefill of every running row per swap, up to prompt + cap tokens each, paid while the trainer waits; the mixed
cache is what the sampler really conditioned on, so we keep it and record it.)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from typing import Callable, Hashable, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.generation import programs
from jaxrl.generation.buckets import pick_bucket
from jaxrl.generation.placement import Weights, data_parallel_size
from jaxrl.generation.sampling import SamplingMode, sampling_mode

__all__ = ["Cancelled", "Completion", "DEFAULT_ROUND_STEPS", "Engine", "Request", "Ticket", "insert_sizes", "program_bound",
           "prompts_per_rows", "shapes_of", "shrink_ladder", "stop_width", "weights_key"]

# Decode steps per round of an engine that takes requests while it runs (a server): a request that arrives while
# every slot runs waits for the round to end. A call that knows all its rows up front lets a round run to the cap.
DEFAULT_ROUND_STEPS = 16
# The insert size K (`insert_sizes`): a round end (a host round trip) and an insert per K freed slots, and on
# average K / 2 slots waiting for their refill. K is slots / INSERT_FRACTION; at least MIN_INSERT_ROWS (or a
# quarter of fewer slots: with few slots a step costs about the same whatever its rows do); and at least
# slots * TURNOVER_STEPS / cap: rows of at most `cap` tokens free a slot every cap / 2 steps or so, and a round
# costs about as much as a few decode steps, so short generations refill in bigger groups.
INSERT_FRACTION = 16
MIN_INSERT_ROWS = 4
TURNOVER_STEPS = 32
MAX_SHRINK = 16
# Stop ids per row are a traced operand padded to the pool's width, a multiple of this; a row with more goes to
# a pool STOP_WIDTH_FACTOR times as wide (one more set of programs).
STOP_WIDTH = 8
STOP_WIDTH_FACTOR = 4
# The widths of an extension chunk (a held row continued by what an environment appended): the smallest that
# holds every waiting continuation's rest, a longer one fed in several chunks. Two widths, so two programs; a
# session pool's caches have the largest width spare (a chunk's padding is written too).
EXTEND_WIDTHS = (16, 128)


def stop_width(count: int, smallest: int = STOP_WIDTH) -> int:
    """The stop-id width of a row with `count` stop ids: smallest x 4^k."""
    width = max(int(smallest), 1)
    while width < count:
        width *= STOP_WIDTH_FACTOR
    return width


def shrink_ladder(slots: int, multiple: int = 1) -> tuple[int, ...]:
    """The smaller slot counts a drained pool moves to: slots / 2, / 4, ... down to slots / MAX_SHRINK (and no
    smaller than `multiple`, the data-parallel size), each a multiple of `multiple`. Halvings: a step's cost grows
    with its slots (the per-row caches are most of the bytes it moves), and a row waits at most until the running
    ones fit half the slots; / MAX_SHRINK bounds the programs (one round and one shrink per size)."""
    out, size = [], slots
    while size % 2 == 0 and size // 2 >= max(multiple, slots // MAX_SHRINK) and (size // 2) % multiple == 0:
        size //= 2
        out.append(size)
    return tuple(out)


def prompts_per_rows(rows: int, samples_per_prompt: int, multiple: int = 1) -> int:
    """The prompts of an insert of `rows` rows whose prompts have n samples each: ceil(rows / n), rounded up to the
    smallest of rows / 8, rows / 2 and rows that holds it (a static size of the prefill and insert programs: a
    ladder, so calls of other n reuse them) and is a multiple of `multiple` (the data-parallel size). An insert
    whose rows would need more prompts stops at a prompt boundary; the next one takes the rest."""
    need = -(-rows // max(1, samples_per_prompt))
    ladder = sorted({rows} | {rows // d for d in (8, 2) if rows % d == 0 and (rows // d) % multiple == 0})
    fits = [u for u in ladder if u >= need and u % multiple == 0]
    return fits[0] if fits else -(-rows // multiple) * multiple


def insert_sizes(slots: int, samples_per_prompt: int, multiple: int = 1, cap: Optional[int] = None
                 ) -> tuple[int, int]:
    """(K, U): rows moved in per insert (INSERT_FRACTION, MIN_INSERT_ROWS, TURNOVER_STEPS with the rows' `cap`;
    a multiple of `multiple`, at most `slots`) and the prompts its prefill holds (`prompts_per_rows`)."""
    rows = max(1, slots // INSERT_FRACTION, min(MIN_INSERT_ROWS, slots // 4))
    if cap:
        rows = max(rows, -(-slots * TURNOVER_STEPS // cap))
    rows = min(slots, -(-rows // multiple) * multiple)
    return rows, prompts_per_rows(rows, samples_per_prompt, multiple)


def program_bound(start_sizes: Sequence[int], prompt_lengths: int, multiple: int = 1, shrink: bool = True) -> int:
    """The most engine programs one (model structure, sampling mode, cap, samples per prompt) can compile when
    calls start at the slot counts `start_sizes` with `prompt_lengths` prompt lengths: per prompt length and start
    size, a prefill and an insert (K rows), a round per slot count the rows can run at and, when they shrink, a
    shrink per slot count; and one weight preparation."""
    sizes = set(start_sizes)
    if shrink:
        for s in start_sizes:
            sizes.update(shrink_ladder(s, multiple))
    return prompt_lengths * (2 * len(start_sizes) + len(sizes) * (2 if shrink else 1)) + 1


def token_versions(spans: Sequence[tuple], n: int) -> np.ndarray:
    """[n] int64: the version of each of a row's n tokens from its (first token index, version) spans."""
    out = np.empty((n,), np.int64)
    for k, (start, version) in enumerate(spans):
        end = spans[k + 1][0] if k + 1 < len(spans) else n
        out[start:end] = version
    return out


def _row_operands(k: int, width: int) -> tuple:
    """The per-row operands of an insert or an extension of K rows, as padding rows hold them: seeds, group ids,
    sample indices [K] uint32, caps [K] int32, temperature, top_p [K] f32, stop ids [K, width] int32 (-1). The
    caller fills its rows in; their dtypes are the programs' signature (`Engine.pool_programs` compiles with them)."""
    seeds, groups, samples = (np.zeros((k,), np.uint32) for _ in range(3))
    return (seeds, groups, samples, np.ones((k,), np.int32), np.ones((k,), np.float32), np.ones((k,), np.float32),
            np.full((k, width), -1, np.int32))


def weights_key(weights: Weights) -> tuple:
    """What a program compiled for `weights` depends on: their structure and the shapes of their arrays (as one
    string, whose hash is computed once however often a program key holding it is looked up)."""
    return weights.structure, repr([(x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in weights.leaves])


def shapes_of(tree):
    """`tree` with every array as a jax.ShapeDtypeStruct: what `jit(...).lower` compiles a program from without its
    data. A committed array keeps its placement (a call with it looks for a program of that placement); an
    uncommitted one (a program's output on one device) and a numpy array keep none, as their calls do."""
    def shape(x):
        sharding = x.sharding if getattr(x, "committed", False) else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(shape, tree)


# ---------------------------------------------------------------------------------------------------------------
# Requests and their answers


@dataclasses.dataclass(frozen=True)
class Request:
    """One row to generate: `prompt` token ids, keyed by (seed, group_id, sample_index).

    max_new_tokens: this row's cap (<= the engine's largest generation bucket; None = the largest). temperature 0
    = greedy; top_p in (0, 1]; top_k 0 = off. stop_ids: ids that end this row (None: the engine's EOS and stop
    ids). prompt_key: rows with equal keys share one prefill (default: the prompt's tokens).
    """

    prompt: Sequence[int]
    group_id: int = 0
    sample_index: int = 0
    seed: int = 0
    max_new_tokens: Optional[int] = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: Optional[Sequence[int]] = None
    prompt_key: Optional[Hashable] = None
    # called at each round end while the row runs with its tokens so far (a streamed answer); on the engine's
    # thread, so it must only hand them on (the server queues them for its event loop)
    on_tokens: Optional[Callable[[list], None]] = dataclasses.field(default=None, compare=False)
    # A multi-turn session (an episode): the row's slot is held after it finishes, with its caches, and the next
    # request of the same session whose prompt extends this one's prompt + tokens continues in that slot (only
    # the new tokens are fed: `Engine` docstring, "sessions"). session_tokens: the most tokens the session's
    # slot holds after its first prompt (every turn and everything appended between them); its pool's cap.
    session: Optional[Hashable] = None
    session_tokens: Optional[int] = None


@dataclasses.dataclass
class Completion:
    """A finished row: generated ids (up to and including the stop token), their log-probabilities (temperature 1,
    unfiltered) and "stop" | "length" (jaxrl.generation.stopping)."""

    tokens: list[int]
    logprobs: np.ndarray
    finish_reason: str
    # the weight version (`Engine.set_params`) each token was sampled with; one value unless the weights changed
    # while the row ran (in_flight=True)
    token_versions: Optional[np.ndarray] = None


class Cancelled(RuntimeError):
    """The error of a ticket whose row was cancelled (`Engine.cancel`: its caller went away)."""


class Ticket:
    """A submitted request: `wait()` blocks until its completion (or raises the engine's error). The event a
    waiter sleeps on is made only when one waits on an unfinished ticket: a rollout's tickets are read after they
    finished, and making thousands of events per rollout costs more than the host's part of its rounds."""

    _guard = threading.Lock()  # orders a waiter's making of the event against the finishing of the ticket

    def __init__(self, request: Request):
        self.request = request
        self.completion: Optional[Completion] = None
        self.error: Optional[BaseException] = None
        self.done = False
        self.cancelled = False  # Engine.cancel asked for it: its slot is freed at the next round end
        self._event: Optional[threading.Event] = None

    def wait(self, timeout: Optional[float] = None) -> Completion:
        if not self.done:
            with Ticket._guard:
                if self._event is None:
                    self._event = threading.Event()
                if self.done:
                    self._event.set()
            if not self._event.wait(timeout):
                raise TimeoutError(f"request not finished after {timeout} s")
        if self.error is not None:
            raise self.error
        return self.completion

    def _finish(self, completion: Optional[Completion] = None, error: Optional[BaseException] = None) -> None:
        self.completion, self.error = completion, error
        with Ticket._guard:
            self.done = True
            if self._event is not None:
                self._event.set()


@dataclasses.dataclass(eq=False)  # rows are compared by identity (a slot holds one row object)
class _Row:
    """A checked request, in the form the insert program takes it (its arrays, its static mode)."""

    ticket: Ticket
    prompt: np.ndarray
    prompt_key: Hashable
    mode: SamplingMode
    cap: int
    stops: tuple  # its stop ids, sorted
    temperature: float  # 1.0 for greedy rows (unused by the greedy program)
    # sessions: cache slots after the pool's prompt width that hold this row's tokens so far
    used: int = 0
    # a continuation: the ids still to feed into the held slot (the held row's last sampled id first)
    extension: Optional[np.ndarray] = None
    # a finished session row holding its slot: its prompt + generated ids (the last one not yet in the cache)
    sequence: Optional[np.ndarray] = None
    # (first token index, weight version) of each weight version the row sampled with; set at its first round end
    versions: list = dataclasses.field(default_factory=list)
    generated: int = 0  # tokens generated at the last round end (where an in-flight weight swap takes effect)

    @property
    def held(self) -> bool:
        return self.sequence is not None

    @property
    def live(self) -> bool:
        """Decoding in its slot (not held between turns, not waiting for its continuation to be fed)."""
        return self.sequence is None and self.extension is None


class _Pool:
    """The slots of one shape (prompt width P, cap N, stop width W): their device state, which row each slot holds,
    the rows waiting for them, and the prefills their next rows may copy."""

    def __init__(self, key: tuple, slots: int, shrink_sizes: Sequence[int]):
        self.key = key
        self.prompt_len, self.cap, self.stop_width, self.sessions = key
        # a session pool's caches have EXTEND_WIDTHS[-1] spare slots: an extension chunk writes its padding too
        self.cache_len = self.prompt_len + self.cap + (EXTEND_WIDTHS[-1] if self.sessions else 0)
        self.slots = slots
        self.shrink_sizes = tuple(sorted({int(s) for s in shrink_sizes if int(s) < slots}, reverse=True))
        self.size = slots  # the slot count of the state now (shrinks)
        self.state: Optional[programs.SlotState] = None
        self.occupant: list[Optional[_Row]] = [None] * slots
        self.queue: collections.deque[_Row] = collections.deque()
        self.mode: Optional[SamplingMode] = None
        self.prefilled: dict[int, tuple] = {}  # prompt count U -> (prompt keys, caches, logits) of its last prefill
        self.extending: list[_Row] = []  # continuations waiting to be fed into their held slots, in order

    @property
    def running(self) -> int:
        """Rows in slots that are not held (decoding, or about to be continued)."""
        return sum(r is not None and not r.held for r in self.occupant)

    @property
    def held(self) -> int:
        return sum(r is not None and r.held for r in self.occupant)

    @property
    def idle(self) -> bool:
        """Nothing to run: no row waits and every slot is free or held."""
        return not self.queue and self.running == 0

    @property
    def empty(self) -> bool:
        return not self.queue and all(r is None for r in self.occupant)

    def modes(self) -> set:
        return {r.mode for r in self.queue} | {r.mode for r in self.occupant if r is not None}

    def free_state(self) -> None:
        """Frees the device memory of an empty pool (its next row allocates it again)."""
        self.state, self.prefilled, self.size = None, {}, self.slots
        self.occupant = [None] * self.slots
        self.extending = []


# ---------------------------------------------------------------------------------------------------------------
# The engine


class Engine:
    """Continuous batching for one model structure (module docstring).

    Args:
      model: the nnx model (its structure and, unless `set_params` gives others, its weights).
      slots: rows decoded at once per pool (a multiple of the mesh's data x fsdp size).
      prompt_buckets: the prompt widths pools are made for (a longer prompt is refused, never cut).
      generation_buckets: the caps pools are made for; a row's max_new_tokens is rounded up to one (its row still
        ends at its own cap). The largest is the most a request may ask for.
      eos_token_ids, stop_token_ids: the stop ids of a request that names none; pad_token_id: the id of padding.
      insert_rows, prompts_per_insert: K rows per insert and the U prompts its prefill holds (default
        `insert_sizes(slots, 1, cap=the largest generation bucket)`).
      round_steps: decode steps per round at most (rows submitted meanwhile join at round ends).
      shrink: let a pool whose queue is empty move its rows to fewer slots (`shrink_ladder`).
      min_stop_width: the narrowest stop-id width of a pool (default: 8, or the default stop ids' width).
      fuse_adapters: stack LoRA adapters into their projections for decoding (`Qwen35.decode_weights`); False keeps
        them apart (the same numbers, more kernels; to measure the difference).
    """

    def __init__(self, model: nnx.Module, *, slots: int, prompt_buckets: Sequence[int],
                 generation_buckets: Sequence[int], eos_token_ids: Sequence[int] = (),
                 stop_token_ids: Sequence[int] = (), pad_token_id: Optional[int] = None, mesh: Optional[Mesh] = None,
                 insert_rows: Optional[int] = None, prompts_per_insert: Optional[int] = None,
                 round_steps: int = DEFAULT_ROUND_STEPS, shrink: bool = False, min_stop_width: Optional[int] = None,
                 fuse_adapters: bool = True):
        self.model, self.mesh, self.fuse_adapters = model, mesh, bool(fuse_adapters)
        self.vocab_size = int(model.config.vocab_size)
        self.multiple = data_parallel_size(mesh)
        for name, value in (("slots", slots), ("round_steps", round_steps)):
            if int(value) < 1:
                raise ValueError(f"Engine: {name} must be >= 1, got {value}")
        if slots % self.multiple:
            raise ValueError(f"Engine: slots={slots} is not a multiple of the data-parallel size {self.multiple}")
        self.slots, self.round_steps = int(slots), int(round_steps)
        self.prompt_buckets = tuple(sorted({int(b) for b in prompt_buckets}))
        self.generation_buckets = tuple(sorted({int(b) for b in generation_buckets}))
        if not self.prompt_buckets or not self.generation_buckets or min(self.prompt_buckets + self.generation_buckets) < 1:
            raise ValueError("Engine: prompt_buckets and generation_buckets must be positive sizes")
        self.max_new_tokens = self.generation_buckets[-1]
        default_k, default_u = insert_sizes(self.slots, 1, self.multiple, self.max_new_tokens)
        self.insert_rows = int(insert_rows or default_k)
        self.prompts_per_insert = int(prompts_per_insert or min(self.insert_rows, default_u))
        if not 1 <= self.prompts_per_insert <= self.insert_rows <= self.slots:
            raise ValueError(f"Engine: need 1 <= prompts_per_insert ({self.prompts_per_insert}) <= insert_rows "
                             f"({self.insert_rows}) <= slots ({self.slots})")
        if self.prompts_per_insert % self.multiple:
            raise ValueError(f"Engine: prompts_per_insert ({self.prompts_per_insert}) must be a multiple of "
                             f"{self.multiple}")
        self.shrink_sizes = shrink_ladder(self.slots, self.multiple) if shrink else ()
        self.default_stops = self._checked_stops(tuple(eos_token_ids) + tuple(stop_token_ids))
        self.min_stop_width = stop_width(len(self.default_stops), int(min_stop_width or STOP_WIDTH))
        if pad_token_id is None:
            pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.pad_id = int(pad_token_id)
        self._weights: Optional[Weights] = None
        self._decode_weights = None
        self._version = -1
        self.pools: dict[tuple, _Pool] = {}
        self._lock = threading.Lock()
        self._sessions: dict[Hashable, tuple[_Pool, _Row]] = {}  # held rows by session
        self.stats = {"rows": 0, "finished": 0, "generated_tokens": 0, "decode_steps": 0, "slot_steps": 0,
                      "rounds": 0, "inserts": 0, "prefilled_prompts": 0, "prefilled_tokens": 0, "shrinks": 0,
                      "cancelled": 0, "continued": 0, "extensions": 0, "extended_tokens": 0, "evicted": 0}

    # ----------------------------------------------------------------------------------------------- requests
    def _checked_stops(self, ids: Sequence[int]) -> tuple:
        ids = tuple(sorted({int(t) for t in ids}))
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop/eos token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _check(self, request: Request, ticket: Ticket, continuing: bool = False) -> tuple[_Row, tuple]:
        """The row of a request and its own pool key; ValueError for a request this engine cannot take (a
        continuation's prompt may be longer than the prompt buckets: only its new tokens are fed)."""
        prompt = np.asarray(request.prompt, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError("the prompt is empty")
        if prompt.size > self.prompt_buckets[-1] and not continuing:
            raise ValueError(f"the prompt has {prompt.size} tokens, over the engine's prompt_len="
                             f"{self.prompt_buckets[-1]} (prompts are never cut)")
        if prompt.min() < 0 or prompt.max() >= self.vocab_size:
            raise ValueError(f"the prompt has token ids outside [0, {self.vocab_size})")
        cap = self.max_new_tokens if request.max_new_tokens is None else int(request.max_new_tokens)
        if not 1 <= cap <= self.max_new_tokens:
            raise ValueError(f"max_new_tokens={cap} is outside [1, {self.max_new_tokens}] (the engine's cap)")
        if not 0 <= int(request.seed) < 2 ** 32:
            raise ValueError(f"seed must be in [0, 2**32), got {request.seed}")
        mode = sampling_mode(float(request.temperature), float(request.top_p), int(request.top_k), self.vocab_size)
        stops = self.default_stops if request.stop_ids is None else self._checked_stops(request.stop_ids)
        prompt_key = request.prompt_key if request.prompt_key is not None else ("tokens", prompt.tobytes())
        row = _Row(ticket, prompt.astype(np.int32), prompt_key, mode, cap, stops,
                   float(request.temperature) if request.temperature > 0 else 1.0)
        room = cap
        if request.session is not None:
            room = int(request.session_tokens or 0)
            if not cap <= room <= self.max_new_tokens:
                raise ValueError(f"session_tokens={request.session_tokens} must hold the row's max_new_tokens={cap} "
                                 f"and be at most the engine's cap {self.max_new_tokens}")
        if continuing:
            return row, ()
        own = (pick_bucket(prompt.size, self.prompt_buckets, "prompt length"),
               pick_bucket(room, self.generation_buckets, "max_new_tokens"),
               stop_width(len(stops), self.min_stop_width), request.session is not None)
        return row, own

    def _place(self, row: _Row, own: tuple) -> _Pool:
        """The pool a row waits for (module docstring, 'placement'). Under the lock."""
        prompt_len, cap, width, sessions = own
        best = None
        for pool in self.pools.values():
            if (pool.prompt_len == prompt_len and pool.cap >= cap and pool.stop_width >= width
                    and pool.sessions == sessions
                    and pool.modes() == {row.mode} and len(pool.queue) + pool.running + pool.held < pool.slots
                    and (best is None or pool.key[1:] < best.key[1:])):
                best = pool
        if best is not None:
            return best
        if own not in self.pools:
            self.pools[own] = _Pool(own, self.slots, self.shrink_sizes)
        return self.pools[own]

    def submit(self, request: Request) -> Ticket:
        """Queues a request (thread safe); it joins free slots at the next round (or, continuing a held session,
        its own slot). ValueError for a bad request."""
        ticket = Ticket(request)
        with self._lock:
            held = self._sessions.pop(request.session, None) if request.session is not None else None
            if held is not None:
                row, _ = self._check(request, ticket, continuing=True)
                if self._continue(*held, row):
                    return ticket
                self._free_held(*held)
            row, own = self._check(request, ticket)
            self._place(row, own).queue.append(row)
        return ticket

    def shape_of(self, request: Request) -> tuple[tuple, SamplingMode]:
        """(pool key, sampling mode) of a fresh row of `request`: the static shapes of the programs it runs
        (`pool_programs`); ValueError for a request this engine refuses. Thread safe (reads only)."""
        row, own = self._check(request, Ticket(request))
        return own, row.mode

    def pool_programs(self, weights: Weights, key: tuple, mode: SamplingMode) -> dict[tuple, Callable[[], None]]:
        """The programs a pool of `key` (prompt width, cap, stop width, sessions) runs rows of `mode` with, under
        weights shaped like `weights` (`Weights(structure, shapes_of(leaves))`), as {program key: a call compiling
        it}. Each call compiles ahead of time (`jit(...).lower(shapes).compile()`: nothing runs, nothing is
        allocated) into the caches the engine's own call then finds, so it may run on another thread while this
        one steps. Keys name what a program depends on, so pools of one shape share them. At the pool's full slot
        count; a session pool's extensions and a shrunk pool's programs are not among them (compiled at their first
        call)."""
        pool = _Pool(key, self.slots, ())
        structure, leaves, mesh, pad = weights.structure, weights.leaves, self.mesh, self.pad_id
        k, u = self.insert_rows, self.prompts_per_insert
        fingerprint = (weights_key(weights), mesh)
        ids = jax.ShapeDtypeStruct((u, pool.prompt_len), np.int32)

        def outputs(lowered) -> object:  # a program's outputs as the next program's operands
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=x.sharding if mesh is not None else None),
                                lowered.out_info)

        def prepared():
            return outputs(programs.prepare.lower(structure, leaves, fuse_adapters=self.fuse_adapters))

        def state():
            return outputs(programs.init_state.lower(structure, leaves, slots=pool.size, cache_len=pool.cache_len,
                                                     max_new_tokens=pool.cap, stop_width=pool.stop_width, pad_id=pad,
                                                     mesh=mesh))

        def prefilled():
            return outputs(programs.prefill.lower(structure, leaves, ids, ids, mesh=mesh))

        def insert():
            fresh, logits = prefilled()
            rows = jax.ShapeDtypeStruct((k,), np.int32)
            programs.insert.lower(state(), fresh, logits, rows, rows, *shapes_of(_row_operands(k, pool.stop_width)),
                                  mode=mode, pad_id=pad, mesh=mesh).compile()

        def decode_round():
            scalar = jax.ShapeDtypeStruct((), np.int32)
            programs.decode_round.lower(structure, leaves, prepared(), state(),
                                        jax.ShapeDtypeStruct((pool.size,), np.bool_), scalar, scalar, mode=mode,
                                        pad_id=pad, mesh=mesh, holds=pool.sessions).compile()

        state_key = (pool.size, pool.cache_len, pool.cap, pool.stop_width)
        return {("engine_prepare", fingerprint, self.fuse_adapters):
                    lambda: programs.prepare.lower(structure, leaves, fuse_adapters=self.fuse_adapters).compile(),
                ("engine_init_state", fingerprint, state_key, pad):
                    lambda: programs.init_state.lower(structure, leaves, slots=pool.size, cache_len=pool.cache_len,
                                                      max_new_tokens=pool.cap, stop_width=pool.stop_width,
                                                      pad_id=pad, mesh=mesh).compile(),
                ("engine_prefill", fingerprint, ids.shape):
                    lambda: programs.prefill.lower(structure, leaves, ids, ids, mesh=mesh).compile(),
                ("engine_insert", fingerprint, state_key, pad, k, u, mode): insert,
                ("engine_round", fingerprint, state_key, pad, mode, pool.sessions): decode_round}

    def _continue(self, pool: _Pool, held: _Row, row: _Row) -> bool:
        """Puts `row` in `held`'s slot as a continuation when it can be one (under the lock): its prompt extends the
        held row's prompt + tokens, the rest fits the slot's cache with room for the row's cap, and the pool runs
        the row's sampling mode and stop width. Otherwise the caller frees the slot and the row starts fresh (its
        whole prompt prefilled: the same tokens, more work)."""
        seq = held.sequence
        if (row.prompt.size <= seq.size or not np.array_equal(row.prompt[:seq.size], seq)
                or row.mode != pool.mode or len(row.stops) > pool.stop_width):
            return False
        extension = row.prompt[seq.size - 1:]  # the held row's last sampled id is not in its cache yet
        if held.used + extension.size + row.cap - 1 > pool.cap:
            return False
        slot = next(b for b, r in enumerate(pool.occupant) if r is held)
        row.used, row.extension = held.used, extension
        pool.occupant[slot] = row
        pool.extending.append(row)
        self.stats["continued"] += 1
        return True

    def _free_held(self, pool: _Pool, held: _Row) -> None:
        for b, r in enumerate(pool.occupant):
            if r is held:
                pool.occupant[b] = None

    def end_session(self, session: Hashable) -> None:
        """Frees a session's held slot (thread safe; nothing if it holds none): its episode is over."""
        with self._lock:
            held = self._sessions.pop(session, None)
            if held is not None:
                self._free_held(*held)

    def _end_sessions(self) -> None:
        with self._lock:
            for pool, held in self._sessions.values():
                self._free_held(pool, held)
            self._sessions = {}

    def cancel(self, tickets: Sequence[Ticket]) -> None:
        """Stops rows whose caller went away (thread safe): a queued row leaves its queue now; a row in a slot stops
        at the end of the round in flight (its slot is then free for the next row). Each ticket finishes with a
        `Cancelled` error, counted in stats["cancelled"]; a finished ticket is left as it is."""
        with self._lock:
            for ticket in tickets:
                ticket.cancelled = True
            for pool in self.pools.values():
                pool.extending = [row for row in pool.extending if not row.ticket.cancelled]
                gone = [row for row in pool.queue if row.ticket.cancelled]
                if gone:
                    pool.queue = collections.deque(row for row in pool.queue if not row.ticket.cancelled)
                    for row in gone:
                        self._drop(row)

    def _drop(self, row: _Row) -> None:
        if not row.ticket.done:
            self.stats["cancelled"] += 1
            row.ticket._finish(error=Cancelled("the request was cancelled"))

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        with self._lock:
            return all(pool.idle for pool in self.pools.values())

    @property
    def queued(self) -> int:
        """Rows submitted and not yet in a slot."""
        with self._lock:
            return sum(len(pool.queue) for pool in self.pools.values())

    @property
    def running(self) -> int:
        """Rows in slots (not counting held sessions)."""
        return sum(pool.running for pool in list(self.pools.values()))

    # ------------------------------------------------------------------------------------------------ weights
    def set_params(self, params=None, version: Optional[int] = None, in_flight: bool = False) -> int:
        """The weights of every row from now on (`Weights.of`: None = the model's current ones); their decode
        copies are made here, once. Returns their version: `version`, or the previous one + 1 (the first is 0), the
        value `Completion.token_versions` carries for each token sampled with them.

        in_flight: rows in flight keep running and sample their next token with these weights (module docstring,
        'Weights'); False refuses while rows are in flight. Either way a held session ends (its next turn starts
        fresh). Call it between steps, from the thread that steps."""
        if self.running and not in_flight:
            raise RuntimeError("Engine.set_params while rows are in flight would mix two policies in one row; "
                               "wait until the engine is idle, or pass in_flight=True (partial rollouts)")
        self._end_sessions()  # a held row's caches are the old weights': its continuation starts fresh
        weights = Weights.of(self.model, params, self.mesh)
        decode = programs.prepare(weights.structure, weights.leaves, fuse_adapters=self.fuse_adapters)
        version = self._version + 1 if version is None else int(version)
        with self._lock:
            self._weights, self._decode_weights, self._version = weights, decode, version
            for pool in self.pools.values():
                pool.prefilled = {}  # prefixes of the old weights: a row admitted from now on is prefilled anew
                for row in pool.occupant:
                    if row is None or not row.live:  # a continuation still being fed: versioned when it runs
                        continue
                    if row.versions and row.versions[-1][0] == row.generated:
                        row.versions[-1] = (row.generated, version)  # no token sampled with the previous ones
                    else:
                        row.versions.append((row.generated, version))
        return version

    @property
    def version(self) -> int:
        """The version of the weights rows sample with now (-1 before the first `set_params`)."""
        return self._version

    def release(self) -> None:
        """Frees every pool's device memory (the caches); the next row allocates them again."""
        if self.running:
            raise RuntimeError("Engine.release while rows are in flight")
        self._end_sessions()
        with self._lock:
            for pool in self.pools.values():
                pool.free_state()
            self.pools = {key: pool for key, pool in self.pools.items() if pool.queue}

    # ------------------------------------------------------------------------------------------------ running
    def run(self) -> None:
        """Steps until nothing is queued or in flight."""
        while not self.idle:
            self.step()

    def fail_all(self, error: BaseException) -> None:
        """Every row queued or in flight fails with `error`; the pools are emptied (their caches freed)."""
        with self._lock:
            pools, self.pools, self._sessions = list(self.pools.values()), {}, {}
        for pool in pools:
            for row in [r for r in pool.occupant if r is not None and not r.held] + list(pool.queue):
                row.ticket._finish(error=error)

    def step(self) -> list[Ticket]:
        """One round of every pool with rows (free slots refilled from its queue first); returns the tickets of
        the rows that finished. A pool left without rows frees its caches."""
        if self._weights is None:
            self.set_params(None)
        done = []
        with self._lock:
            pools = [pool for pool in self.pools.values() if not pool.idle]
        for pool in pools:
            done += self._step_pool(pool)
            with self._lock:
                if pool.empty and pool.state is not None:
                    pool.free_state()
        return done

    def _step_pool(self, pool: _Pool) -> list[Ticket]:
        done = []
        for b, row in enumerate(pool.occupant):  # cancelled rows leave their slots (the round masks them out)
            if row is not None and not row.held and row.ticket.cancelled:
                pool.occupant[b] = None
                self._drop(row)
                done.append(row.ticket)
        self._extend(pool)
        self._admit(pool)
        if not any(r is not None and r.live for r in pool.occupant):
            return done
        weights, version = self._weights, self._version
        live = np.asarray([r is not None and r.live for r in pool.occupant])
        pool.state, status, outputs = programs.decode_round(
            weights.structure, weights.leaves, self._decode_weights, pool.state, live, np.int32(self.round_steps),
            np.int32(self._want_free(pool) + pool.held), mode=pool.mode, pad_id=self.pad_id, mesh=self.mesh,
            holds=pool.sessions)
        if outputs is None:  # one device: the state's own buffers
            outputs = (pool.state.tokens, pool.state.logprobs)
        running, generated, stopped, steps = np.asarray(jax.device_get(status))
        steps = int(steps[0])
        self.stats["rounds"] += 1
        self.stats["decode_steps"] += steps
        self.stats["slot_steps"] += steps * pool.size
        finished = [b for b, row in enumerate(pool.occupant) if row is not None and row.live and not running[b]]
        streamed = [b for b, row in enumerate(pool.occupant)
                    if row is not None and running[b] and row.ticket.request.on_tokens is not None]
        for b, row in enumerate(pool.occupant):
            if row is not None and row.live:
                if not row.versions:  # admitted this round, with these weights (its first token included)
                    row.versions.append((0, version))
                row.generated = int(generated[b])
        if finished or streamed:  # the token buffers come to the host only when someone reads them
            tokens, logprobs = jax.device_get(outputs)
        for b in streamed:
            pool.occupant[b].ticket.request.on_tokens(tokens[b, :int(generated[b])].tolist())
        if finished:
            for b in finished:
                n = int(generated[b])
                row, pool.occupant[b] = pool.occupant[b], None
                session = row.ticket.request.session
                if session is not None:  # held with its caches until its continuation or end_session
                    row.used += n - 1  # every token but the last was fed back
                    row.sequence = np.concatenate([row.prompt, tokens[b, :n].astype(np.int32)])
                    pool.occupant[b] = row
                    with self._lock:
                        self._sessions[session] = (pool, row)
                self.stats["generated_tokens"] += n
                self.stats["finished"] += 1
                row.ticket._finish(Completion(tokens[b, :n].tolist(), np.asarray(logprobs[b, :n], np.float32),
                                              "stop" if stopped[b] else "length", token_versions(row.versions, n)))
                done.append(row.ticket)
        self._maybe_shrink(pool)
        return done

    def _want_free(self, pool: _Pool) -> int:
        """Free slots at which a pool's round hands back (held slots not counted: the caller adds them): enough for
        its waiting rows while they can move in; in a session pool, once K more rows finished their turn (their
        environment steps and continuations wait for the round end); a smaller slot count's worth once nothing
        waits and the state can shrink; else never (the round runs its steps)."""
        with self._lock:
            waiting = len(pool.queue)
            head_fits = waiting and pool.queue[0].mode == pool.mode
        if head_fits:
            return min(self._refill_at(pool), waiting)
        if pool.sessions:
            live = sum(r is not None and r.live for r in pool.occupant)
            return pool.size - live - pool.held + min(self.insert_rows, live)
        if not waiting:
            smaller = [s for s in pool.shrink_sizes if s < pool.size]
            if smaller:
                return pool.size - smaller[0]
        return pool.size + 1

    def _refill_at(self, pool: _Pool) -> int:
        """Free slots a round waits for before refilling them while rows wait: K (one insert's rows), or more when
        rows finish fast. A round end (a host round trip and an insert) costs about a decode step; waiting for F
        free slots leaves about F / 2 of them idle for F / r steps (r rows finish per step), so the cost per step
        is about F / (2 x slots) + r / F, least at F = sqrt(2 x slots x r). Short rows (several finishing every
        step) raise F past K, and a round end then moves several inserts' rows in; long rows keep F = K. r is
        counted, not timed, so the schedule (and every log-prob) stays a function of the requests."""
        k = self.insert_rows
        rate = self.stats["finished"] / max(self.stats["decode_steps"], 1)
        best = math.sqrt(2 * pool.size * rate)
        return max(k, min(pool.size // 2, -(-int(best) // k) * k))

    def _maybe_shrink(self, pool: _Pool) -> None:
        with self._lock:
            if pool.queue:
                return
        # One ladder step at a time (each step is one program: a program per ladder pair would be quadratic).
        while True:
            occupied = [b for b, r in enumerate(pool.occupant) if r is not None]
            smaller = [s for s in pool.shrink_sizes if s < pool.size]
            if not occupied or not smaller or len(occupied) > smaller[0]:
                return
            size = smaller[0]
            free = [b for b, r in enumerate(pool.occupant) if r is None]
            keep = occupied + free[:size - len(occupied)]
            pool.state = programs.shrink(pool.state, np.asarray(keep, np.int32), mesh=self.mesh)
            pool.occupant = [pool.occupant[b] for b in keep]
            pool.size = size
            self.stats["shrinks"] += 1

    def _extend(self, pool: _Pool) -> None:
        """Feeds the continuations waiting in a pool's held slots: K rows per extension program, each a chunk of at
        most EXTEND_WIDTHS[-1] of its ids (the smallest width that holds every row's rest); a row whose ids are
        all fed samples its next turn's first token and runs from the next round."""
        while pool.extending:
            rows = pool.extending[:self.insert_rows]
            rest = max(row.extension.size for row in rows)
            width = next((w for w in EXTEND_WIDTHS if w >= rest), EXTEND_WIDTHS[-1])
            k = self.insert_rows
            ids = np.full((k, width), self.pad_id, np.int32)
            mask = np.zeros((k, width), np.int32)
            where = np.full((k,), pool.size, np.int32)
            final = np.zeros((k,), bool)
            seeds, groups, samples, caps, temperature, top_p, stops = _row_operands(k, pool.stop_width)
            for i, row in enumerate(rows):
                request = row.ticket.request
                part, row.extension = row.extension[:width], row.extension[width:]
                ids[i, :part.size], mask[i, :part.size] = part, 1
                where[i] = next(b for b, r in enumerate(pool.occupant) if r is row)
                final[i] = row.extension.size == 0
                row.used += part.size
                seeds[i], groups[i], samples[i] = (int(request.seed), int(request.group_id) % 2 ** 32,
                                                   int(request.sample_index) % 2 ** 32)
                caps[i], temperature[i], top_p[i] = row.cap, row.temperature, request.top_p
                stops[i, :len(row.stops)] = row.stops
                self.stats["extended_tokens"] += int(part.size)
            pool.state = programs.extend(self._weights.structure, self._weights.leaves, pool.state, where, ids, mask,
                                         final, seeds, groups, samples, caps, temperature, top_p, stops,
                                         mode=pool.mode, pad_id=self.pad_id, mesh=self.mesh)
            self.stats["extensions"] += 1
            for row in rows:
                if row.extension.size == 0:
                    row.extension = None  # it decodes from the next round
                    self.stats["rows"] += 1
            with self._lock:
                pool.extending = [row for row in pool.extending if row.extension is not None]

    def _evict(self, pool: _Pool, count: int) -> None:
        """Frees `count` held slots of a pool (the longest held first) for rows that wait: a held row whose
        continuation comes later then starts fresh (the same tokens, its whole prompt prefilled)."""
        with self._lock:
            for session, (where, row) in list(self._sessions.items()):
                if count <= 0:
                    return
                if where is pool:
                    del self._sessions[session]
                    self._free_held(pool, row)
                    self.stats["evicted"] += 1
                    count -= 1

    def _admit(self, pool: _Pool) -> None:
        """Moves a pool's waiting rows into its free slots, K at a time (fewer when fewer wait): one insert program
        (and one prefill program) for every refill, an empty pool filled by as many inserts as it takes. Held
        sessions give their slots up when rows wait and too few are free."""
        if pool.queue and pool.held:
            free = sum(r is None for r in pool.occupant)
            self._evict(pool, min(self.insert_rows, len(pool.queue)) - free)
        while True:
            free = [b for b, r in enumerate(pool.occupant) if r is None]
            with self._lock:
                if not pool.queue or not free:
                    return
                if len(free) == pool.size:  # nothing in flight: the head's sampling mode runs next
                    pool.mode = pool.queue[0].mode
                if pool.queue[0].mode != pool.mode or len(free) < min(self.insert_rows, len(pool.queue)):
                    return
                rows, keys = [], set()
                while pool.queue and len(rows) < min(self.insert_rows, len(free)):
                    head = pool.queue[0]
                    if head.mode != pool.mode or (head.prompt_key not in keys and
                                                  len(keys) == self.prompts_per_insert):
                        break
                    keys.add(head.prompt_key)
                    rows.append(pool.queue.popleft())
            self._insert(pool, rows, free[:len(rows)])

    def _insert(self, pool: _Pool, rows: list[_Row], slots: list[int]) -> None:
        """One insert program moving `rows` into `slots` (padded to K rows) from U prefilled prompts: the last
        prefill when it holds every row's prompt (the next rows of a prompt whose first rows moved in before: n
        samples of a prompt are prefilled once, not once per insert), else a prefill of the rows' prompts."""
        k, u, weights = self.insert_rows, self.prompts_per_insert, self._weights
        if pool.state is None:
            pool.state = programs.init_state(weights.structure, weights.leaves, slots=pool.size,
                                             cache_len=pool.cache_len, max_new_tokens=pool.cap,
                                             stop_width=pool.stop_width, pad_id=self.pad_id, mesh=self.mesh)
        keys, fresh, logits = pool.prefilled.get(u, ((), None, None))
        if not all(row.prompt_key in keys for row in rows):
            keys, fresh, logits = pool.prefilled[u] = self._prefill(pool, rows, u)
        position = {key: j for j, key in enumerate(keys)}
        source = np.zeros((k,), np.int32)
        where = np.full((k,), pool.size, np.int32)  # out of range: a padding row, dropped
        seeds, groups, samples, caps, temperature, top_p, stops = _row_operands(k, pool.stop_width)
        for i, (row, slot) in enumerate(zip(rows, slots)):
            request = row.ticket.request
            source[i], where[i] = position[row.prompt_key], slot
            seeds[i], groups[i], samples[i] = (int(request.seed), int(request.group_id) % 2 ** 32,
                                               int(request.sample_index) % 2 ** 32)
            caps[i], temperature[i], top_p[i] = row.cap, row.temperature, request.top_p
            stops[i, :len(row.stops)] = row.stops
            pool.occupant[slot] = row
        pool.state = programs.insert(pool.state, fresh, logits, source, where, seeds, groups, samples, caps,
                                     temperature, top_p, stops, mode=pool.mode, pad_id=self.pad_id, mesh=self.mesh)
        self.stats["inserts"] += 1
        self.stats["rows"] += len(rows)

    def _prefill(self, pool: _Pool, rows: list[_Row], u: int) -> tuple:
        """(prompt keys, caches, last logits) of the distinct prompts of `rows`, padded to u prompts."""
        width = pool.prompt_len
        ids = np.full((u, width), self.pad_id, np.int32)
        mask = np.zeros((u, width), np.int32)
        mask[:, -1] = 1  # padding prompts get one (pad) token so every prompt row has a real last position
        keys: list = []
        for row in rows:
            if row.prompt_key not in keys:
                j = len(keys)
                keys.append(row.prompt_key)
                ids[j, width - len(row.prompt):] = row.prompt
                mask[j] = 0
                mask[j, width - len(row.prompt):] = 1
                self.stats["prefilled_tokens"] += len(row.prompt)
        self.stats["prefilled_prompts"] += len(keys)
        return (tuple(keys), *programs.prefill(self._weights.structure, self._weights.leaves, ids, mask,
                                               mesh=self.mesh))
