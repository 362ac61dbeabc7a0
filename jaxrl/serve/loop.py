"""The serve loop: the one thread of a server that touches the device. It takes the requests' rows to the engine
(jaxrl/generation/engine.py, which places, admits and decodes them: serving adds no scheduling of its own),
switches the model the engine generates with when an adapter is asked for, and scores sequences (`echo`, top-k
log-probs) between rounds.

    loop = ServeLoop(model, registry, slots=32, prompt_buckets=..., generation_buckets=..., max_pending_rows=8192)
    future = loop.generate("dpo28", [Request(...), ...])     # concurrent.futures.Future -> [Completion], in order
    future = loop.score("base", [ids, ...], top_k=5)         # -> [Scores]
    loop.warm_up(["base"])                                   # compile the configured buckets' programs first
    loop.stats(), loop.close()

Models: one model (the base or one adapter) generates at a time. A job names its model; when the oldest waiting
job names another one, or the same name now holds other weights (an adapter reloaded in place: another registry
entry), no more rows go to the engine until it drains; then the registry attaches the adapter to the held model
(its digest read back from the parameters) and the engine takes a snapshot of the held model's weights
(`Engine.set_params`: the decode copies made once). Scoring runs with the adapter it names attached to the held
model; the engine decodes with its snapshot, whatever the held model carries meanwhile.

Partial rollouts: a request that allows it (`generate(..., partial=True)`, the `partial_rollout` extension field)
does not hold its adapter's weights for its whole rows. When the adapter it names is reloaded in place while its rows
run, and every request with rows in the engine allows it, the engine switches to the new weights at the next round
end with the rows in flight (`Engine.set_params(in_flight=True)`: no drain; the rows keep their caches and sample
their next tokens with the new adapter). Each engine weight version is one registry entry, so a token's version
names the digest it was sampled with (`digest_of`); with any other request in the engine the switch waits for a
drain, as without partial rollouts.

Compiles (no request waits for another's): the loop never compiles in line. `warm_up` compiles the programs of
the configured buckets before the server listens (WARMUP_MODES, WARMUP_TOP_K). Afterwards a job's programs (the
engine's pool programs of its rows' shapes, `Engine.pool_programs`; the scoring programs of its batches) are looked
up before it is admitted; a job with one not compiled stays queued while the compiler's thread (jaxrl/serve/
compiler.py) compiles them ahead of time (`jit(...).lower(shapes).compile()`, which fills the caches the call then
finds and releases the GIL in XLA), and the loop goes on admitting the later jobs whose programs are compiled and
stepping the engine; the job goes once they are. The smallest design that keeps one thread on the device: nothing
runs beside the loop but XLA's compiler, and a job is only reordered past jobs that wait for a compile. A loop
driven by its caller (`start=False`) compiles in line (`compile_ahead`), so its turns stay a function of the requests.

What stays bounded: `max_pending_rows` rows admitted and not answered (`Overloaded` beyond, HTTP 503; a lone
request is always admitted), the engine's programs by its buckets. A request whose client went away is cancelled
(`cancel`): it stops counting against the bound at once, its queued rows are dropped and its rows in the engine
leave their slots at the end of the round in flight (`Engine.cancel`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.generation.buckets import batch_buckets, length_buckets, pick_bucket
from jaxrl.generation.engine import (DEFAULT_ROUND_STEPS, Cancelled, Completion, Engine, Request, Ticket, shapes_of,
                                     weights_key)
from jaxrl.generation.placement import Weights
from jaxrl.generation.programs import TRACE_COUNTS
from jaxrl.generation.sampling import sampling_mode
from jaxrl.models.teacher_forced import Head, next_token_logprobs
from jaxrl.serve.compiler import SERVE_THREAD, Compiler, inline_compiles
from jaxrl.serve.registry import AdapterRegistry

logger = logging.getLogger(__name__)

# Rows moved into free slots per insert (the engine's K; also the prompts its prefill holds): an insert is padded
# to K rows, and a server's requests arrive a few at a time, so a rollout-sized K would copy mostly padding at every
# round end. More rows waiting take several inserts at one round end.
INSERT_ROWS = 4
# Stop ids per row: 16 hold EOS, the chat stop ids and a few one-token stop strings; more go to a pool 4x as wide.
MIN_STOP_WIDTH = 16
# top-k log-probs compile one scoring program per bucket; a request's k is rounded up to one of these, or over 20
# (launchers.serve --max_logprobs above vLLM's default) to a power of two, at most the vocabulary
TOP_K_BUCKETS = (1, 5, 20)
# (program, static key) -> traces of the scoring program
SCORE_TRACES: collections.Counter = collections.Counter()
# The sampling modes the start-up warm-up compiles every pool for: greedy (evaluation, lm-eval) and plain
# temperature sampling (rollouts, chat); top-p < 1 and top-k rows compile their programs on first use (in the
# background). Their (temperature, top_p, top_k).
WARMUP_MODES = ((0.0, 1.0, 0), (1.0, 1.0, 0))
# The top-k buckets the warm-up compiles the scoring programs of (every sequence length and batch bucket): 0 (echo,
# prompt log-probs of the tokens alone) and 1 (lm-eval's loglikelihood asks logprobs=1); larger k compile on use.
WARMUP_TOP_K = (0, 1)
# Models whose weight shapes the loop remembers (a registry entry each: an adapter reloaded in place is a new one)
SHAPES_KEPT = 8
COUNTERS = ("rounds", "inserts", "decode_steps", "slot_steps", "generated_tokens")


class Overloaded(RuntimeError):
    """More rows wait than the server admits (`max_pending_rows`): HTTP 503, retry later."""


class ShuttingDown(RuntimeError):
    """The server is closing: HTTP 503."""


@dataclasses.dataclass
class Scores:
    """Teacher-forced log-probs of one sequence: log p(x_t | x_<t) for t = 1 .. L-1, and each position's top k."""

    logprobs: np.ndarray  # [L - 1] fp32
    top_ids: np.ndarray  # [L - 1, k] int32, most likely first
    top_logprobs: np.ndarray  # [L - 1, k] fp32
    ranks: Optional[np.ndarray] = None  # [L - 1] int32 (k > 0): each token's rank, 1 = most likely (vLLM's rank)


def compiled_programs() -> int:
    """Distinct engine and scoring programs traced in this process."""
    return len(TRACE_COUNTS) + len(SCORE_TRACES)


def top_k_bucket(k: int, vocab_size: int = 0) -> int:
    if not k:
        return 0
    if k <= TOP_K_BUCKETS[-1]:
        return pick_bucket(int(k), TOP_K_BUCKETS, "top log-probs")
    bucket = 1 << (int(k) - 1).bit_length()
    return min(bucket, vocab_size) if vocab_size else bucket


# ---------------------------------------------------------------------------------------------------------------
# Scoring: the one teacher-forced pass (jaxrl.models.teacher_forced) with the top k of each position


def _score(graphdef, params, ids: jax.Array, mask: jax.Array, *, top_k: int, chunk_size: int):
    """ids, mask [B, T] (right-padded) -> logp [B, T-1] of ids[:, 1:], top values / ids [B, T-1, top_k]."""
    SCORE_TRACES[("score", ids.shape, top_k)] += 1
    out = next_token_logprobs(nnx.merge(graphdef, params), ids, mask, chunk_size=chunk_size,
                              head=Head.top_k(top_k) if top_k else Head.logp())
    if not top_k:
        empty = jnp.zeros(out.logp.shape + (0,))
        return out.logp, empty, empty.astype(jnp.int32), jnp.zeros(out.logp.shape, jnp.int32)
    return out.logp, out.top_logp, out.top_ids, out.rank


_score_program = jax.jit(_score, static_argnames=("graphdef", "top_k", "chunk_size"))


def score_batches(sizes: Sequence[int], *, batch_size: int, lengths: Sequence[int], batch_sizes: Sequence[int]
                  ) -> list[tuple[int, int, list[int]]]:
    """How sequences of these sizes are scored: (length bucket, batch bucket, the sequences' indices) per call,
    grouped by length bucket, `batch_size` rows per call padded to a batch bucket."""
    by_length: dict = collections.defaultdict(list)
    for i, n in enumerate(sizes):
        by_length[pick_bucket(n, lengths, "sequence length")].append(i)
    return [(length, pick_bucket(len(members[start:start + batch_size]), batch_sizes, "batch"),
             members[start:start + batch_size])
            for length, members in sorted(by_length.items()) for start in range(0, len(members), batch_size)]


def score_programs(weights: Weights, shapes: set[tuple[int, int]], top_k: int, chunk_size: int
                   ) -> dict[tuple, object]:
    """{program key: a call compiling it ahead of time} of the scoring programs of (batch, length) `shapes` and
    top-k bucket `top_k` for weights shaped like `weights` (jaxrl.serve.compiler)."""
    graphdef = weights.structure.graphdef
    params = jax.tree.unflatten(weights.structure.treedef, weights.leaves)
    fingerprint = weights_key(weights)

    def compile_one(shape):
        ids = jax.ShapeDtypeStruct(shape, np.int32)
        return lambda: _score_program.lower(graphdef, params, ids, ids, top_k=top_k, chunk_size=chunk_size).compile()
    return {("score", fingerprint, shape, top_k, chunk_size): compile_one(shape) for shape in sorted(shapes)}


def score_sequences(model, sequences: Sequence[Sequence[int]], top_k: int, *, pad_id: int, batch_size: int,
                    lengths: Sequence[int], batch_sizes: Sequence[int], chunk_size: int) -> list[Scores]:
    """The scores of `sequences` with the held model's current weights: grouped by length bucket, `batch_size` rows
    per call (padded to a batch bucket), the top k of a bucket (`top_k` rounded up) and cut back to `top_k`."""
    k = top_k_bucket(top_k, model.config.vocab_size)
    arrays = [np.asarray(s, np.int32) for s in sequences]
    graphdef, params = nnx.split(model)
    scored: list = [None] * len(arrays)
    for length, size, chunk in score_batches([len(s) for s in arrays], batch_size=batch_size, lengths=lengths,
                                             batch_sizes=batch_sizes):
        ids = np.full((size, length), pad_id, np.int32)
        mask = np.zeros((size, length), np.int32)
        mask[:, 0] = 1  # padding rows hold one token so no row is empty
        for r, i in enumerate(chunk):
            ids[r, :len(arrays[i])] = arrays[i]
            mask[r, :len(arrays[i])] = 1
        logp, values, idx, ranks = jax.device_get(_score_program(graphdef, params, ids, mask, top_k=k,
                                                                 chunk_size=chunk_size))
        for r, i in enumerate(chunk):
            n = len(arrays[i]) - 1
            scored[i] = Scores(np.asarray(logp[r, :n], np.float32), np.asarray(idx[r, :n, :top_k], np.int32),
                               np.asarray(values[r, :n, :top_k], np.float32),
                               np.asarray(ranks[r, :n], np.int32) if k else None)
    return scored


# ---------------------------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass
class _Job:
    model: str
    rows: int
    future: concurrent.futures.Future
    requests: Sequence[Request] = ()  # a generation job's rows
    sequences: Sequence[Sequence[int]] = ()  # a scoring job's
    top_k: int = 0
    partial: bool = False  # its rows may continue under an in-place reload of its adapter (module docstring)
    results: list = dataclasses.field(default_factory=list)
    left: int = 0  # rows not answered
    over: bool = False  # answered (result or error): later rows of it are dropped
    programs: Optional[dict] = None  # the programs it waits for (set once the loop has looked): key -> compile call


@dataclasses.dataclass
class _Shape:
    """A model's weights as its programs take them (shapes only) and the engine programs of its pools."""

    served: object  # its registry entry
    weights: Weights  # of jax.ShapeDtypeStruct leaves
    pools: dict = dataclasses.field(default_factory=dict)  # (pool key, mode) -> {program key: compile call}


class ServeLoop:
    """The worker thread of a server (module docstring).

    slots: rows decoded at once per engine pool (the server's --batch_size); also rows per scoring call.
    round_steps: decode steps per round at most: a request that arrives while every slot of its pool decodes
      waits up to this many steps for a round end.
    round_delay_s: seconds slept after every engine round (0: none): a slower accelerator emulated, for tests and
      benchmarks of how rollouts are scheduled around the decode.
    start: run the worker thread (False: the caller calls `step()`, which is what the worker calls).
    compile_ahead: a request whose programs are not compiled waits while the compiler's thread compiles them, and
      the others go on (module docstring); False: its first call compiles them in line, stalling every request.
      Default: with the worker thread (a caller driving `step()` gets turns that depend on the requests alone).
    """

    def __init__(self, model, registry: AdapterRegistry, *, max_model_len: int, prompt_buckets: Sequence[int],
                 generation_buckets: Sequence[int], slots: int = 32, pad_id: Optional[int] = None,
                 max_pending_rows: int = 8192, round_steps: int = DEFAULT_ROUND_STEPS, score_chunk_size: int = 512,
                 round_delay_s: float = 0.0, start: bool = True, compile_ahead: Optional[bool] = None):
        self.model, self.registry = model, registry
        self.round_delay_s = float(round_delay_s)
        self.slots = int(slots)
        self.pad_id = int(pad_id if pad_id is not None else (model.config.pad_token_id or 0))
        self.engine = Engine(model, slots=self.slots, prompt_buckets=prompt_buckets,
                             generation_buckets=generation_buckets, pad_token_id=self.pad_id,
                             insert_rows=min(INSERT_ROWS, self.slots), prompts_per_insert=min(INSERT_ROWS, self.slots),
                             round_steps=round_steps, min_stop_width=MIN_STOP_WIDTH)
        self.score_lengths = length_buckets(max_model_len)
        self.score_batch_sizes = batch_buckets(self.slots)
        self.score_chunk_size = int(score_chunk_size)
        self.max_pending_rows = int(max_pending_rows)
        self._generating = None  # the registry entry the engine's weights are a snapshot of
        self._digests: dict[int, Optional[str]] = {}  # engine weight version -> the adapter digest (None: the base)
        self._tickets: dict[Ticket, tuple[_Job, int]] = {}  # the worker's alone
        self._admitted: dict[int, _Job] = {}  # id(future) -> its job, while its rows are in the engine
        self._sweep = False  # a job in the engine was answered early (cancelled, failed): take its rows out
        self._generate: collections.deque[_Job] = collections.deque()
        self._score: collections.deque[_Job] = collections.deque()
        self._pending_rows = 0  # admitted and not yet answered (queued, in the engine, scoring)
        self._cond = threading.Condition()
        self._stop = False
        self._closing = False  # refuse_new: shutting down, requests in flight go on
        self._served = collections.Counter()
        self._shapes: list[_Shape] = []  # newest first
        self.compiler = Compiler(on_ready=self._wake)
        self.compile_ahead = start if compile_ahead is None else bool(compile_ahead)
        self.warmup = {"programs": 0, "seconds": 0.0}
        self._worker = None
        if start:
            self._worker = threading.Thread(target=self._work, name=SERVE_THREAD, daemon=True)
            self._worker.start()

    # ------------------------------------------------------------------------------------------------ the API
    def generate(self, model: str, requests: Sequence[Request], partial: bool = False) -> concurrent.futures.Future:
        """Queues a request's rows; its Future resolves to their Completions in order (their token_versions are
        engine weight versions: `digest_of`). partial: the rows may continue under an in-place reload of `model`
        (module docstring). Raises Overloaded or ShuttingDown at once (nothing queued) when it cannot be taken."""
        return self._queue(_Job(model, len(requests), concurrent.futures.Future(), requests=list(requests),
                                partial=bool(partial)), self._generate)

    def digest_of(self, version: int) -> Optional[str]:
        """The adapter digest (None: the base) of an engine weight version (a Completion's token_versions)."""
        return self._digests[int(version)]

    def score(self, model: str, sequences: Sequence[Sequence[int]], top_k: int) -> concurrent.futures.Future:
        """Queues sequences to score; the Future resolves to their Scores in order."""
        if top_k > self.model.config.vocab_size:  # fails here, not on the worker
            raise ValueError(f"top {top_k} log-probs of a vocabulary of {self.model.config.vocab_size}")
        return self._queue(_Job(model, len(sequences), concurrent.futures.Future(), sequences=list(sequences),
                                top_k=int(top_k)), self._score)

    def warm_up(self, models: Sequence[str]) -> int:
        """Compiles the programs of the configured buckets for each of `models` (deduplicated by the shapes of their
        weights) before the first request: every prompt bucket x generation bucket at the default stop width for the
        WARMUP_MODES, and the scoring programs of every length and batch bucket for WARMUP_TOP_K. Logs its progress;
        returns the programs compiled (also in `stats()`)."""
        start = time.monotonic()
        programs: dict = {}
        for model in models:
            shape = self._weights_shape(model)
            for prompt_len, cap in itertools.product(self.engine.prompt_buckets, self.engine.generation_buckets):
                for temperature, top_p, top_k in WARMUP_MODES:
                    mode = sampling_mode(temperature, top_p, top_k, self.engine.vocab_size)
                    programs.update(self._programs_of_pool(shape, (prompt_len, cap, self.engine.min_stop_width,
                                                                   False), mode))
            shapes = set(itertools.product(self.score_batch_sizes, self.score_lengths))
            for k in WARMUP_TOP_K:
                programs.update(score_programs(shape.weights, shapes, top_k_bucket(k), self.score_chunk_size))
        compiled = self.compiler.compile_all(programs, f"{len(models)} models' buckets")
        self.warmup["programs"] += compiled
        self.warmup["seconds"] += time.monotonic() - start
        return compiled

    def _queue(self, job: _Job, queue: collections.deque) -> concurrent.futures.Future:
        # running from the start: a waiter that gives up (asyncio.wrap_future cancelled) cannot cancel it, so
        # answering it later never raises InvalidStateError; a request is withdrawn by `cancel` instead
        job.future.set_running_or_notify_cancel()
        if not job.rows:  # nothing to queue (no row would ever answer it)
            job.future.set_result([])
            return job.future
        with self._cond:
            if self._stop or self._closing:
                raise ShuttingDown("the server is shutting down")
            if self._pending_rows and self._pending_rows + job.rows > self.max_pending_rows:
                raise Overloaded(f"the server is overloaded: {self._pending_rows} rows are waiting or running, and "
                                 f"this request adds {job.rows} (launchers.serve --max_pending_rows="
                                 f"{self.max_pending_rows}); retry later")
            self._pending_rows += job.rows
            queue.append(job)
            self._cond.notify_all()
        return job.future

    def cancel(self, future: concurrent.futures.Future) -> int:
        """Cancels the request of `future` (its client disconnected): it fails with `Cancelled` now and no longer
        counts against max_pending_rows; the worker takes its rows out of the engine before its next round (a row in
        a slot stops at the end of the round in flight). Returns the rows cancelled (0: answered already)."""
        with self._cond:
            job = next((j for j in list(self._generate) + list(self._score) if j.future is future), None)
            if job is not None:
                (self._generate if job in self._generate else self._score).remove(job)
            else:
                job = self._admitted.get(id(future))
            if job is None or job.over:
                return 0
            self._served["cancelled"] += job.rows
            self._sweep = True
        self._fail(job, Cancelled("the client disconnected"))
        return job.rows

    def refuse_new(self) -> None:
        """New requests are refused (ShuttingDown) from now on; those admitted go on (a server's grace period)."""
        with self._cond:
            self._closing = True

    def abort(self, error: BaseException) -> None:
        """Answers every request not answered yet with `error` now (the end of a shutdown's grace period); the
        worker takes their rows out of the engine at its next turn. Thread safe."""
        with self._cond:
            jobs = list(self._generate) + list(self._score) + list(self._admitted.values())
            self._generate.clear()
            self._score.clear()
            self._closing = self._sweep = True
            self._cond.notify_all()
        for job in jobs:
            self._fail(job, error)

    def stats(self) -> dict:
        engine = self.engine
        with self._cond:
            queued = sum(j.rows for j in self._generate) + sum(j.rows for j in self._score)
            waiting = queued + engine.queued
            out = {"rows_waiting": waiting, "rows_running": self._pending_rows - waiting,
                   "requests_waiting": len(self._generate) + len(self._score),
                   "compiled_programs": compiled_programs(), "pools": len(engine.pools),
                   "rows_generated": self._served["generate"], "rows_scored": self._served["score"],
                   "rows_cancelled": self._served["cancelled"],
                   "weight_swaps_in_flight": self._served["weight_swaps_in_flight"],
                   "warmup_programs": self.warmup["programs"], "warmup_seconds": self.warmup["seconds"],
                   "programs_compiling": self.compiler.compiling,
                   "programs_compiled_ahead": self.compiler.stats["compiled"],
                   "inline_compiles": inline_compiles()}
        out.update({name: engine.stats[name] for name in COUNTERS})
        out["engine_cancelled"] = engine.stats["cancelled"]
        return out

    def close(self, timeout_s: float = 60.0) -> None:
        """Refuses queued work (ShuttingDown), lets the rows in the engine finish (up to `timeout_s`), stops the
        worker."""
        with self._cond:
            self._stop = True
            refused = list(self._generate) + list(self._score)
            self._generate.clear()
            self._score.clear()
            self._cond.notify_all()
        self.compiler.close()
        for job in refused:
            self._fail(job, ShuttingDown("the server is shutting down"))
        if self._worker is not None and self._worker.is_alive() and threading.current_thread() is not self._worker:
            self._worker.join(timeout_s)

    # --------------------------------------------------------------------------------------------- the worker
    def _wake(self) -> None:
        """A program compiled: a job waiting for it may go now."""
        with self._cond:
            self._cond.notify_all()

    def _runnable(self) -> bool:
        """A queued job the loop has not looked at, or whose programs are compiled. Under the lock."""
        return any(self._may_run(job) for job in itertools.chain(self._generate, self._score))

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._stop and self.engine.idle and not self._runnable():
                    self._cond.wait()
                if self._stop and self.engine.idle:
                    return
            try:
                self.step()
            except BaseException as e:  # noqa: BLE001 - a bug of this loop: answer everyone, keep serving
                logger.exception("the serve loop's turn failed")
                self._fail_everything(e)

    def step(self) -> None:
        """One turn: the waiting scoring requests (up to `slots` rows), the waiting rows handed to the engine (as
        far as the generating model allows), one engine step (a round of every pool with rows)."""
        self._run_scoring()
        self._follow_reload()
        self._admit()
        self._cancel_answered()
        if self.engine.idle:
            return
        try:
            done = self.engine.step()
            if self.round_delay_s:
                time.sleep(self.round_delay_s)
        except BaseException as e:  # noqa: BLE001 - the rows in the engine get the error; the loop goes on
            logger.exception("the generation engine's step failed")
            self.engine.fail_all(e)
            done = []
            for ticket in list(self._tickets):
                if ticket.done:
                    done.append(ticket)
        for ticket in done:
            self._deliver(ticket)

    def _run_scoring(self) -> None:
        """Scores the oldest scoring job whose programs are compiled, with the later ones of its model and top-k
        bucket (up to `slots` rows). A group whose programs are not all compiled stays queued while the compiler's
        thread compiles them; the next step takes the next group."""
        with self._cond:
            taken = self._scoring_group()
        if not taken:
            return
        head = taken[0]
        k = top_k_bucket(head.top_k, self.model.config.vocab_size)
        try:
            if not self._scoring_compiled(taken, k):
                return
            taken = self._take_queued(taken)
            self.registry.attach(head.model)
            scored = score_sequences(self.model, [s for job in taken for s in job.sequences], k,
                                     pad_id=self.pad_id, batch_size=self.slots,
                                     lengths=self.score_lengths, batch_sizes=self.score_batch_sizes,
                                     chunk_size=self.score_chunk_size)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting requests
            logger.exception("scoring %d requests failed", len(taken))
            self._take_queued(taken)
            for job in taken:
                self._fail(job, e)
            return
        at = 0
        for job in taken:  # each job's own k of the bucket's
            mine = scored[at:at + job.rows]
            at += job.rows
            self._answer(job, [Scores(s.logprobs, s.top_ids[:, :job.top_k], s.top_logprobs[:, :job.top_k], s.ranks)
                               for s in mine], "score")

    def _scoring_group(self) -> list[_Job]:
        """The next scoring jobs to run together (`_run_scoring`), still queued. Under the lock."""
        head = next((job for job in self._score if self._may_run(job)), None)
        if head is None:
            return []
        key = (head.model, top_k_bucket(head.top_k))
        taken, rows = [], 0
        for job in self._score:
            if (job.model, top_k_bucket(job.top_k)) == key and self._may_run(job) and \
                    (not taken or rows + job.rows <= self.slots):
                taken.append(job)
                rows += job.rows
        return taken

    def _may_run(self, job: _Job) -> bool:
        """Not known to wait for a program being compiled."""
        return job.programs is None or self._compiled(job.programs)

    def _compiled(self, programs: dict) -> bool:
        """Whether `programs` are compiled (those that are not are queued on the compiler's thread); always, when
        the loop compiles in line."""
        return not self.compile_ahead or self.compiler.ready(programs)

    def _scoring_compiled(self, jobs: list[_Job], top_k: int) -> bool:
        """Whether the scoring programs of `jobs` scored together are compiled; if not, each job waits for them
        (queued on the compiler's thread)."""
        if not self.compile_ahead:
            return True
        weights = self._weights_shape(jobs[0].model).weights
        sizes = [len(s) for job in jobs for s in job.sequences]
        shapes = {(size, length) for length, size, _ in score_batches(
            sizes, batch_size=self.slots, lengths=self.score_lengths, batch_sizes=self.score_batch_sizes)}
        programs = score_programs(weights, shapes, top_k, self.score_chunk_size)
        if self._compiled(programs):
            return True
        for job in jobs:
            job.programs = programs
        return False

    def _take_queued(self, jobs: list[_Job]) -> list[_Job]:
        """Takes `jobs` out of their queue; returns those that were still in it (not cancelled meanwhile)."""
        ids = {id(job) for job in jobs}
        with self._cond:
            present = [job for job in itertools.chain(self._generate, self._score) if id(job) in ids]
            for queue in (self._generate, self._score):
                kept = [job for job in queue if id(job) not in ids]
                if len(kept) != len(queue):
                    queue.clear()
                    queue.extend(kept)
        return present

    def _admit(self) -> None:
        """Hands the waiting generation requests' rows to the engine, oldest first among those whose programs are
        compiled (the others wait while the compiler's thread compiles theirs), while the generating model is
        theirs; a request of another model waits until the engine is idle, then the model switches."""
        while True:
            with self._cond:
                job = next((job for job in self._generate if self._may_run(job)), None)
            if job is None:
                return
            try:
                if not self._generation_compiled(job):
                    continue  # it waits for its programs; the next one may go
                served = self.registry.served(job.model)
                if served is not self._generating:
                    if not self.engine.idle:
                        return  # the engine drains first: one model per snapshot
                    self._generating = None
                    self.registry.attach(job.model)
                    # a snapshot of what the held model carries now
                    self._digests[self.engine.set_params(None)] = served.digest
                    self._generating = served
                if not self._take_queued([job]):
                    continue  # cancelled meanwhile
                with self._cond:
                    self._admitted[id(job.future)] = job
                job.results, job.left = [None] * job.rows, job.rows
                for r, request in enumerate(job.requests):
                    self._tickets[self.engine.submit(request)] = (job, r)
            except BaseException as e:  # noqa: BLE001 - this request's error (unknown model, a bad row)
                self._take_queued([job])
                self._fail(job, e)

    def _generation_compiled(self, job: _Job) -> bool:
        """Whether the engine programs of a generation job's rows are compiled (queued on the compiler's thread if
        not). ValueError for a row the engine refuses."""
        if not self.compile_ahead:
            return True
        if job.programs is None:
            shape = self._weights_shape(job.model)
            programs: dict = {}
            for key, mode in {self.engine.shape_of(request) for request in job.requests}:
                programs.update(self._programs_of_pool(shape, key, mode))
            job.programs = programs
        return self._compiled(job.programs)

    def _weights_shape(self, model: str) -> "_Shape":
        """The shapes of the weights `model` runs with (the held model with its adapter attached), as the programs
        take them; remembered per registry entry (the SHAPES_KEPT newest)."""
        served = self.registry.served(model)
        for shape in self._shapes:
            if shape.served is served:
                return shape
        self.registry.attach(model)
        weights = Weights.of(self.model)
        shape = _Shape(served, Weights(weights.structure, shapes_of(weights.leaves)))
        self._shapes = [shape] + self._shapes[:SHAPES_KEPT - 1]
        return shape

    def _programs_of_pool(self, shape: "_Shape", key: tuple, mode) -> dict:
        if (key, mode) not in shape.pools:
            shape.pools[key, mode] = self.engine.pool_programs(shape.weights, key, mode)
        return shape.pools[key, mode]

    def _follow_reload(self) -> None:
        """Partial rollouts (module docstring): the engine's adapter reloaded in place while only requests that
        allow it have rows in the engine: the new weights from the next round, the rows in flight kept."""
        generating = self._generating
        if generating is None or self.engine.idle:
            return
        try:
            served = self.registry.served(generating.name)
        except Exception:  # noqa: BLE001 - unloaded meanwhile: its rows finish with the weights they have
            return
        if served is generating or not all(job.partial for job, _ in self._tickets.values()):
            return
        self._generating = None
        self.registry.attach(served.name)
        self._digests[self.engine.set_params(None, in_flight=True)] = served.digest
        self._generating = served
        self._served["weight_swaps_in_flight"] += 1

    def _cancel_answered(self) -> None:
        """Takes out of the engine the rows of jobs answered before their last row (a cancelled request, or one
        whose other row failed): they would decode for no one."""
        with self._cond:
            if not self._sweep:
                return
            self._sweep = False
        stale = [t for t, (job, _) in self._tickets.items() if job.over]
        self.engine.cancel(stale)
        for ticket in stale:
            if ticket.done:  # left the engine's queue now (a row in a slot is handed back by its next round)
                self._tickets.pop(ticket)

    def _deliver(self, ticket: Ticket) -> None:
        job, r = self._tickets.pop(ticket)
        if job.over:
            return
        if ticket.error is not None:
            self._fail(job, ticket.error)
            return
        job.results[r] = ticket.completion
        job.left -= 1
        if job.left == 0:
            self._answer(job, job.results, "generate")

    def _fail_everything(self, error: BaseException) -> None:
        with self._cond:
            jobs = list(self._generate) + list(self._score)
            self._generate.clear()
            self._score.clear()
        jobs += [entry[0] for entry in self._tickets.values()]
        self._tickets.clear()
        self._admitted.clear()
        self.engine.fail_all(error)
        self._generating = None
        for job in jobs:
            self._fail(job, error)

    def _answer(self, job: _Job, result: list, kind: str) -> None:
        with self._cond:
            if job.over:
                return
            job.over = True
            self._admitted.pop(id(job.future), None)
            self._pending_rows -= job.rows
            self._served[kind] += job.rows
        job.future.set_result(result)

    def _fail(self, job: _Job, error: BaseException) -> None:
        with self._cond:
            if job.over:
                return
            job.over = True
            if self._admitted.pop(id(job.future), None) is not None:
                self._sweep = True  # its other rows may still be in the engine
            self._pending_rows -= job.rows
        job.future.set_exception(error)


__all__ = ["Completion", "Overloaded", "Scores", "ServeLoop", "ShuttingDown", "compiled_programs", "score_batches",
           "score_programs", "score_sequences", "top_k_bucket"]
