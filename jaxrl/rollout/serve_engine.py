"""What `launchers.serve` (jaxrl/rollout/server.py) asks of an engine, and the static-batch engine.

    engine = BatchingEngine(model, activate=server.attach_model, batch_size=32, max_prompt_len=4096, ...)
    future = engine.submit(GenerateRows(model="base", prompts=[ids], groups=[g], samples=[0], max_tokens=[64],
                                        stop_ids=(eos,), temperature=1.0, top_p=1.0, top_k=0, seed=5))
    rows = future.result()          # [RowOutput(tokens, logprobs, finish_reason)], one per row
    scores = engine.submit(ScoreRows(model="base", sequences=[ids], top_k=5)).result()   # [RowScores]

The HTTP layer talks to an engine only through `submit` (a `concurrent.futures.Future` per request), `stats` and
`close` (the `Engine` protocol). The server's default is the continuous-batching `ContinuousServeEngine`
(jaxrl/rollout/serve_continuous.py: new requests join free decode slots between rounds); `BatchingEngine` here is
the static path it replaced, kept as the reference its tests and benchmark compare against
(`CompletionServer(engine="static")`). Scoring (`score_rows`) is the same in both.

How this one batches: one worker thread takes the oldest request and, for `batch_wait_s`, every later one with the
same key (model, generation bucket, stop ids, sampling settings, seed bits) up to `batch_size` rows, into one
`Sampler.sample` call; a sample does not depend on its batch (its key is its own); a request that arrives while a
batch decodes waits for the whole batch. Scoring requests (teacher-forced log-probs of whole sequences: `echo`,
top-k log-probs) are batched the same way by (model, top-k bucket).

What stays bounded, whatever the requests ask:
  * compiled programs: a request's `max_tokens` is rounded up to one of a few generation lengths
    (`generation_buckets`, default 16, 64, 256, ... up to max_model_len); the sampler runs to the bucket and each
    row is cut at its own `max_tokens` on the host (a row that reaches it ends with finish_reason "length"). Scoring
    programs are keyed by a power-of-two length, a batch bucket and a top-k bucket (1, 5, 20). So many distinct
    `max_tokens` values reuse a handful of programs and the resident memory stays flat. (A row that ends at its
    max_tokens keeps decoding, discarded, until its batch's bucket is full or every row has stopped: up to 4x the
    decode steps of an exact cap; the continuous engine stops rows where they end.)
  * waiting work: `max_pending_rows` rows admitted and not yet answered; a request beyond it is refused at once
    (`Overloaded`, HTTP 503) instead of queueing without end.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from functools import partial
from typing import Callable, Optional, Protocol, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.ops.logprobs import token_logprobs
from jaxrl.ops.matmul import project
from jaxrl.rollout.sampler import TRACE_COUNTS, Sampler, default_batch_buckets, pick_bucket

logger = logging.getLogger(__name__)

# (program, static key) -> traces of the scoring program (as sampler.TRACE_COUNTS for prefill / decode).
SCORE_TRACES: collections.Counter = collections.Counter()
TOP_K_BUCKETS = (1, 5, 20)  # top-k log-probs compile one program per bucket; a request's k is rounded up
MIN_GENERATION_BUCKET = 16
MIN_SCORE_BUCKET = 32
SAMPLERS_KEPT = 32  # Sampler objects (generation bucket x stop ids) kept; their programs are shared by shape


class Overloaded(RuntimeError):
    """More rows wait than the engine admits (`max_pending_rows`): HTTP 503, retry later."""


class ShuttingDown(RuntimeError):
    """The engine is closing: HTTP 503."""


def admit_rows(engine, rows: int) -> None:
    """Admission of a request of `rows` rows, under the engine's lock (both engines: `BatchingEngine`,
    `ContinuousServeEngine`): refused while shutting down, or when it would take the rows waiting or running past
    `max_pending_rows` (a lone request is always admitted); else its rows count as pending."""
    if engine._stop:
        raise ShuttingDown("the server is shutting down")
    if engine._pending_rows and engine._pending_rows + rows > engine.max_pending_rows:
        raise Overloaded(f"the server is overloaded: {engine._pending_rows} rows are waiting or running, and this "
                         f"request adds {rows} (launchers.serve --max_pending_rows={engine.max_pending_rows}); "
                         "retry later")
    engine._pending_rows += rows


@dataclasses.dataclass(frozen=True)
class GenerateRows:
    """Rows sampled in one request: row r continues prompts[r] with the key (seed, groups[r], samples[r])."""

    model: str
    prompts: Sequence[Sequence[int]]
    groups: Sequence[int]
    samples: Sequence[int]
    max_tokens: Sequence[int]  # per row, >= 1
    stop_ids: tuple  # sorted; a row ends on the first of them (kept in its tokens)
    temperature: float
    top_p: float
    top_k: int
    seed: int  # the sampler's seed (uint32)

    def __len__(self) -> int:
        return len(self.prompts)


@dataclasses.dataclass(frozen=True)
class ScoreRows:
    """Teacher-forced log-probs of whole sequences: for each position t >= 1, log p(x_t | x_<t), and the top_k
    most likely tokens there (top_k 0: none)."""

    model: str
    sequences: Sequence[Sequence[int]]
    top_k: int = 0

    def __len__(self) -> int:
        return len(self.sequences)


Work = Union[GenerateRows, ScoreRows]


@dataclasses.dataclass
class RowOutput:
    tokens: list  # generated ids, the stop id included
    logprobs: list  # per token: log-probability at temperature 1, unfiltered (the sampler's)
    finish_reason: str  # "stop" (ended on a stop id) | "length" (reached max_tokens)


@dataclasses.dataclass
class RowScores:
    logprobs: np.ndarray  # [L - 1] fp32: log p(x_t | x_<t) for t = 1 .. L-1
    top_ids: np.ndarray  # [L - 1, k] int32, most likely first
    top_logprobs: np.ndarray  # [L - 1, k] fp32


class Engine(Protocol):
    """What the HTTP layer needs of an engine."""

    def submit(self, work: Work) -> concurrent.futures.Future: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


def generation_buckets(max_model_len: int, smallest: int = MIN_GENERATION_BUCKET) -> tuple[int, ...]:
    """16, 64, 256, ... (x4) below max_model_len, and max_model_len itself."""
    out, b = [], min(smallest, max_model_len)
    while b < max_model_len:
        out.append(b)
        b *= 4
    return tuple(out + [int(max_model_len)])


def length_buckets(max_len: int, smallest: int = MIN_SCORE_BUCKET) -> tuple[int, ...]:
    """32, 64, 128, ... below max_len, and max_len itself (the scoring program's sequence lengths)."""
    out, b = [], min(smallest, max_len)
    while b < max_len:
        out.append(b)
        b *= 2
    return tuple(out + [int(max_len)])


def compiled_programs() -> int:
    """Distinct programs traced in this process by the sampler (prefill, decode) and the scorer."""
    return len(TRACE_COUNTS) + len(SCORE_TRACES)


# ---------------------------------------------------------------------------------------------------------------
# Scoring: the trainer's teacher-forced pass (hidden_states + token_logprobs), plus the top-k of each position

@partial(jax.jit, static_argnames=("graphdef", "top_k", "chunk_size"))
def _score(graphdef, params: tuple, ids: jax.Array, mask: jax.Array, *, top_k: int, chunk_size: int):
    """ids, mask [B, T] (right-padded) -> logp [B, T-1] of ids[:, 1:], top values / ids [B, T-1, top_k]."""
    SCORE_TRACES[("score", ids.shape, top_k)] += 1
    model = nnx.merge(graphdef, *params)
    hidden, _ = model.hidden_states(ids, mask)
    hidden = hidden[:, :-1]
    head = model.head_weight()
    logp = token_logprobs(hidden, head, ids[:, 1:], chunk_size=chunk_size)
    batch, length, width = hidden.shape
    if not top_k:
        empty = jnp.zeros((batch, length, 0))
        return logp, empty, empty.astype(jnp.int32)
    rows = batch * length
    chunk = min(chunk_size, rows)
    n_chunks = -(-rows // chunk)
    h = jnp.concatenate([hidden.reshape(rows, width), jnp.zeros((n_chunks * chunk - rows, width), hidden.dtype)])

    def one_chunk(h_c):  # the same fp32 logits as token_logprobs: [chunk, V] at a time, never [B, T, V]
        logits = project(h_c, head, jnp.float32)
        values, idx = jax.lax.top_k(logits, top_k)
        return values - jax.nn.logsumexp(logits, axis=-1)[:, None], idx.astype(jnp.int32)

    values, idx = jax.lax.map(one_chunk, h.reshape(n_chunks, chunk, width))
    values = values.reshape(-1, top_k)[:rows].reshape(batch, length, top_k)
    idx = idx.reshape(-1, top_k)[:rows].reshape(batch, length, top_k)
    return logp, values, idx


# ---------------------------------------------------------------------------------------------------------------
# The engine

class _RowSampler(Sampler):
    """A Sampler whose rows carry their own sample index (a request names it in its seed), one prompt per row."""

    row_samples: Optional[Sequence[int]] = None

    def plan(self, prompts, n, group_ids):
        batches = super().plan(prompts, n, group_ids)
        if self.row_samples is not None:
            for b in batches:  # n == 1: row r is prompt r
                b.sample_ids[:len(b.rows)] = [self.row_samples[r] % 2 ** 32 for r in b.rows]
        return batches


@dataclasses.dataclass
class _Job:
    work: Work
    key: tuple
    future: concurrent.futures.Future


class BatchingEngine:
    """A queue and one worker thread in front of the static-batch Sampler (module docstring).

    activate(model_name): called on the worker thread before each batch, to make the held model carry that model's
      adapter (the server's registry does the attaching; it may raise to fail the batch's requests).
    """

    def __init__(self, model, *, activate: Callable[[str], None], max_model_len: int, max_prompt_len: int,
                 batch_size: int = 32, prompt_buckets: Optional[Sequence[int]] = None,
                 gen_buckets: Optional[Sequence[int]] = None, pad_id: Optional[int] = None,
                 batch_wait_s: float = 0.005, max_pending_rows: int = 8192, score_chunk_size: int = 512):
        self.model, self.activate = model, activate
        self.max_model_len, self.max_prompt_len = int(max_model_len), int(max_prompt_len)
        self.batch_size = int(batch_size)
        self.prompt_buckets = tuple(prompt_buckets) if prompt_buckets else None
        buckets = sorted({int(b) for b in gen_buckets}) if gen_buckets else list(generation_buckets(self.max_model_len))
        if buckets[-1] < self.max_model_len:  # every max_tokens the context allows has a bucket
            buckets.append(self.max_model_len)
        self.gen_buckets = tuple(buckets)
        self.score_buckets = length_buckets(self.max_model_len)
        self.score_batch_buckets = default_batch_buckets(self.batch_size)
        self.pad_id = pad_id
        self.batch_wait_s, self.max_pending_rows = float(batch_wait_s), int(max_pending_rows)
        self.score_chunk_size = int(score_chunk_size)
        self._samplers: collections.OrderedDict = collections.OrderedDict()
        self._pending: list[_Job] = []
        self._pending_rows = 0  # admitted and not yet answered (queued or running)
        self._cond = threading.Condition()
        self._stop = False
        self._served = collections.Counter()
        self._worker = threading.Thread(target=self._work, name="jaxrl-serve-engine", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------------------------------------ the API
    def generation_bucket(self, max_tokens: int) -> int:
        return pick_bucket(int(max_tokens), self.gen_buckets, "max_tokens")

    def submit(self, work: Work) -> concurrent.futures.Future:
        """Queues `work`; its Future resolves to [RowOutput] / [RowScores] (one per row). Raises Overloaded or
        ShuttingDown at once (nothing queued) when it cannot be taken."""
        if isinstance(work, GenerateRows):
            key = ("generate", work.model, self.generation_bucket(max(work.max_tokens)), tuple(work.stop_ids),
                   float(work.temperature), float(work.top_p), int(work.top_k), int(work.seed))
        else:
            key = ("score", work.model, top_k_bucket(work.top_k))
        rows = len(work)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            admit_rows(self, rows)
            self._pending.append(_Job(work, key, future))
            self._cond.notify_all()
        return future

    def stats(self) -> dict:
        with self._cond:
            waiting = sum(len(j.work) for j in self._pending)
            return {"rows_waiting": waiting, "rows_running": self._pending_rows - waiting,
                    "requests_waiting": len(self._pending), "compiled_programs": compiled_programs(),
                    "samplers": len(self._samplers), "rows_generated": self._served["generate"],
                    "rows_scored": self._served["score"]}

    def close(self, timeout_s: float = 60.0) -> None:
        """Refuses queued work (ShuttingDown), lets the running batch finish (up to `timeout_s`), stops the worker."""
        with self._cond:
            self._stop = True
            for job in self._pending:
                job.future.set_exception(ShuttingDown("the server is shutting down"))
            self._pending = []
            self._cond.notify_all()
        if self._worker.is_alive() and threading.current_thread() is not self._worker:
            self._worker.join(timeout_s)

    # --------------------------------------------------------------------------------------------- the worker
    def _take(self) -> list[_Job]:
        """The oldest job and, within batch_wait_s, every later one with its key (up to batch_size rows)."""
        with self._cond:
            while not self._pending and not self._stop:
                self._cond.wait()
            if self._stop:
                return []
            first_seen = time.monotonic()
            key = self._pending[0].key
            while time.monotonic() - first_seen < self.batch_wait_s and not self._stop:
                if sum(len(j.work) for j in self._pending if j.key == key) >= self.batch_size:
                    break
                self._cond.wait(max(0.0, self.batch_wait_s - (time.monotonic() - first_seen)))
            if self._stop:
                return []
            taken, rows, rest = [], 0, []
            for job in self._pending:
                if job.key == key and (not taken or rows + len(job.work) <= self.batch_size):
                    taken.append(job)
                    rows += len(job.work)
                else:
                    rest.append(job)
            self._pending = rest
            return taken

    def _work(self) -> None:
        while True:
            jobs = self._take()
            if not jobs:
                return
            try:
                self.activate(jobs[0].work.model)
                if jobs[0].key[0] == "generate":
                    results = self._generate([j.work for j in jobs])
                else:
                    results = self._score([j.work for j in jobs])
            except BaseException as e:  # noqa: BLE001 - handed to the waiting requests; the worker goes on
                logger.exception("a batch of %d requests failed", len(jobs))
                results = [e] * len(jobs)
            with self._cond:
                self._pending_rows -= sum(len(j.work) for j in jobs)
            for job, result in zip(jobs, results):
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    self._served[job.key[0]] += len(job.work)
                    job.future.set_result(result)

    def _sampler(self, bucket: int, stop_ids: tuple) -> _RowSampler:
        key = (bucket, stop_ids)
        sampler = self._samplers.pop(key, None)
        if sampler is None:
            sampler = _RowSampler(self.model, max_new_tokens=bucket, max_prompt_len=self.max_prompt_len,
                                  prompt_buckets=self.prompt_buckets, batch_size=self.batch_size,
                                  eos_token_ids=stop_ids, pad_token_id=self.pad_id)
        self._samplers[key] = sampler  # most recently used last
        while len(self._samplers) > SAMPLERS_KEPT:
            self._samplers.popitem(last=False)
        return sampler

    def _generate(self, works: list[GenerateRows]) -> list[list[RowOutput]]:
        first = works[0]
        sampler = self._sampler(self.generation_bucket(max(max(w.max_tokens) for w in works)), first.stop_ids)
        prompts = [list(p) for w in works for p in w.prompts]
        sampler.row_samples = [int(s) for w in works for s in w.samples]
        try:
            out = sampler.sample(prompts, n=1, temperature=first.temperature, top_p=first.top_p, top_k=first.top_k,
                                 seed=first.seed, group_ids=[int(g) for w in works for g in w.groups])
        finally:
            sampler.row_samples = None
        results, k = [], 0
        for w in works:
            rows = []
            for cap in w.max_tokens:
                tokens, lps, reason = list(out.tokens[k]), [float(x) for x in out.logprobs[k]], out.finish_reasons[k]
                if len(tokens) > cap:  # ran past this row's own max_tokens inside a larger bucket
                    tokens, lps, reason = tokens[:cap], lps[:cap], "length"
                rows.append(RowOutput(tokens, lps, reason))
                k += 1
            results.append(rows)
        return results

    def _score(self, works: list[ScoreRows]) -> list[list[RowScores]]:
        return score_rows(self.model, works, pad_id=self.pad_id, batch_size=self.batch_size,
                          length_buckets=self.score_buckets, batch_buckets=self.score_batch_buckets,
                          chunk_size=self.score_chunk_size)


def score_rows(model, works: Sequence[ScoreRows], *, pad_id: Optional[int], batch_size: int,
               length_buckets: Sequence[int], batch_buckets: Sequence[int], chunk_size: int
               ) -> list[list[RowScores]]:
    """The scores of `works` (one model, one top-k bucket) with the held model's current weights: sequences
    grouped by length bucket, `batch_size` rows per `_score` call (padded to a batch bucket)."""
    top_k = top_k_bucket(works[0].top_k)
    sequences = [np.asarray(s, np.int32) for w in works for s in w.sequences]
    graphdef, params = nnx.graphdef(model), (nnx.state(model),)
    pad = pad_id if pad_id is not None else 0
    scored: list = [None] * len(sequences)
    by_bucket: dict = collections.defaultdict(list)
    for i, s in enumerate(sequences):
        by_bucket[pick_bucket(len(s), length_buckets, "sequence length")].append(i)
    for length, members in sorted(by_bucket.items()):
        for start in range(0, len(members), batch_size):
            chunk = members[start:start + batch_size]
            size = pick_bucket(len(chunk), batch_buckets, "batch")
            ids = np.full((size, length), pad, np.int32)
            mask = np.zeros((size, length), np.int32)
            mask[:, 0] = 1  # padding rows hold one token so no row is empty
            for r, i in enumerate(chunk):
                ids[r, :len(sequences[i])] = sequences[i]
                mask[r, :len(sequences[i])] = 1
            logp, values, idx = jax.device_get(_score(graphdef, params, ids, mask, top_k=top_k,
                                                      chunk_size=chunk_size))
            for r, i in enumerate(chunk):
                n = len(sequences[i]) - 1
                scored[i] = RowScores(np.asarray(logp[r, :n], np.float32), np.asarray(idx[r, :n], np.int32),
                                      np.asarray(values[r, :n], np.float32))
    results, k = [], 0
    for w in works:
        rows = []
        for _ in w.sequences:
            s = scored[k]
            rows.append(RowScores(s.logprobs, s.top_ids[:, :w.top_k], s.top_logprobs[:, :w.top_k]))
            k += 1
        results.append(rows)
    return results


def top_k_bucket(k: int) -> int:
    return 0 if not k else pick_bucket(int(k), TOP_K_BUCKETS, "top log-probs")
