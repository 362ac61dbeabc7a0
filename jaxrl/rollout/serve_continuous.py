"""The engine behind `launchers.serve` (jaxrl/rollout/server.py): continuous batching, new requests join free slots.

    engine = ContinuousServeEngine(model, activate=server.attach_model, version=server.served, slots=32,
                                   max_model_len=8192, max_prompt_len=4096)
    future = engine.submit(GenerateRows(model="base", prompts=[ids], groups=[g], samples=[0], max_tokens=[64],
                                        stop_ids=(eos,), temperature=1.0, top_p=1.0, top_k=0, seed=5))
    rows = future.result()          # [RowOutput(tokens, logprobs, finish_reason)], one per row
    scores = engine.submit(ScoreRows(model="base", sequences=[ids], top_k=5)).result()   # [RowScores]

The `Engine` protocol of jaxrl/rollout/serve_engine.py (submit -> Future, stats, close), so the HTTP layer is the
one the static `BatchingEngine` had.

How it runs: generation goes through `jaxrl.rollout.engine.Engine` (its module docstring): `slots` rows decode at
once in rounds of at most `round_steps` steps, and at every round end the slots whose rows finished take waiting
rows (a prefill of the newcomers into those slots; the other rows go on where they were). So a request that
arrives while others decode starts at the next round end, not when they are done, and a row stops at its own
max_tokens (the static engine decodes every row of a batch to the batch's generation bucket). One worker thread
does all the work, a turn at a time (`step`): the scoring requests waiting, then the waiting rows handed to the
engines, then one round of every engine with rows.

Why several Engines: an Engine's prompt width and cap are static shapes (its caches hold prompt width + cap
positions per slot, its programs are compiled for them), and one sized for the longest prompt and the whole
context would hold caches of max_prompt_len + max_model_len positions for every slot. So a row goes to the
*lane* of (its prompt bucket, its max_tokens' generation bucket, its stop-id width): one Engine each, made when
the first such row comes, all stepped by the one worker, round after round. The buckets are the static engine's
(`prompt_buckets`, `generation_buckets`), so a row is padded to the prompt width the static path pads it to. A
lane's caches are freed whenever it has no rows (its next row allocates them again). A row rather joins a lane
that already decodes rows of its sampling mode and prompt width, with a cap and stop width at least its own and
a free slot (the smallest such cap first): a step costs every slot of a lane whatever its rows, so requests of
mixed max_tokens fill one lane instead of running several half empty ones (a row's sample does not depend on its
lane's cap).

Rows: row r of a GenerateRows is `engine.Request(prompt, group_id, sample_index, seed, max_new_tokens=max_tokens[r],
stop_ids, temperature, top_p, top_k)`, keyed by its own (seed, group, sample) and nothing else, so it is the
static path's sample token for token (the engine's 'Randomness'; tests/test_serve_continuous.py). A row whose
sampling mode (greedy; top-k or top-p on or off: a static part of the programs) differs from the rows decoding in
its lane waits until they finish.

Adapters: one model (the base or one adapter) generates at a time, in every lane. When the model changes, the
worker calls `activate(name)` (the server attaches the adapter to the held model and checks its digest read back
from the parameters) and the lanes take a snapshot of the held model's weights (`Engine.set_params`, the other
lanes sharing its decode copies: `share_params`); a snapshot changes only while no lane has rows. So when the
oldest waiting request names another model, or the same name now holds other weights (`version(name)` is
another object: an adapter reloaded in place), no more rows are handed to the lanes until they drain; then the
switch. Scoring runs on the worker between rounds with the adapter it names attached (the lanes decode with
their snapshot, not with whatever the held model carries), as the static engine scores (`score_rows`).

What stays bounded: programs per lane and sampling mode (a fill and a refill insert, a round; one weight
preparation per model structure); lanes by the buckets; `max_pending_rows` rows admitted and not answered
(`Overloaded` beyond, HTTP 503).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Callable, Optional, Sequence

from jaxrl.rollout.engine import DEFAULT_ROUND_STEPS, Engine, Request, Ticket
from jaxrl.rollout.sampler import default_batch_buckets, default_prompt_buckets, pick_bucket
from jaxrl.rollout.sampling import sampling_mode
from jaxrl.rollout.serve_engine import (GenerateRows, RowOutput, ScoreRows, ShuttingDown, Work, admit_rows,
                                        compiled_programs, generation_buckets, length_buckets, score_rows,
                                        top_k_bucket)

logger = logging.getLogger(__name__)

# Stop ids per row are a traced operand padded to the lane's width: 16 holds EOS, the chat stop ids and a few
# one-token stop strings; a request with more goes to a lane 4x as wide (one more set of programs).
MIN_STOP_WIDTH = 16
# Rows moved into free slots per insert (the engine's K; also the prompts its prefill holds): an insert's prefill
# is padded to K prompts, and a server's requests arrive a few at a time, so a rollout-sized K (slots / 16, or all
# slots for short caps: `engine.insert_sizes`) would prefill mostly padding at every round end. More rows waiting
# take several inserts at one round end.
SERVE_INSERT_ROWS = 4
# Engine counters summed into `stats()`.
COUNTERS = ("rounds", "inserts", "decode_steps", "slot_steps", "generated_tokens")


def stop_width(count: int) -> int:
    width = MIN_STOP_WIDTH
    while width < count:
        width *= 4
    return width


@dataclasses.dataclass(eq=False)
class _Job:
    work: Work
    future: concurrent.futures.Future
    rows: list  # RowOutput per row as they finish
    left: int  # rows not finished
    over: bool = False  # answered (result or error): later rows of it are dropped


class ContinuousServeEngine:
    """Continuous batching behind the server (module docstring).

    activate(model_name): makes the held model carry that model's adapter (the server's registry attaches it; it
      may raise, failing the requests that name it). Called on the worker thread.
    version(model_name): an object that is another one whenever that name's weights change (the server: its
      registry entry); raising fails the requests that name it (an unknown model). Default: names never change.
    slots: rows decoded at once per lane (the server's --batch_size); also rows per scoring call.
    round_steps: decode steps per round at most: a request that arrives while every slot of its lane decodes
      waits up to this many steps for a round end.
    start: run the worker thread (False: the caller calls `step()`, which is what the worker calls).
    """

    def __init__(self, model, *, activate: Callable[[str], None], max_model_len: int, max_prompt_len: int,
                 slots: int = 32, prompt_buckets: Optional[Sequence[int]] = None,
                 gen_buckets: Optional[Sequence[int]] = None, pad_id: Optional[int] = None,
                 max_pending_rows: int = 8192, round_steps: int = DEFAULT_ROUND_STEPS,
                 score_chunk_size: int = 512, version: Optional[Callable[[str], object]] = None,
                 insert_rows: int = SERVE_INSERT_ROWS, start: bool = True):
        self.model, self.activate = model, activate
        self.version = version or (lambda name: None)
        self.max_model_len, self.max_prompt_len = int(max_model_len), int(max_prompt_len)
        self.slots, self.round_steps = int(slots), int(round_steps)
        self.insert_rows = max(1, min(int(insert_rows), self.slots))
        self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets)) if prompt_buckets else \
            default_prompt_buckets(self.max_prompt_len)
        buckets = sorted({int(b) for b in gen_buckets}) if gen_buckets else list(generation_buckets(self.max_model_len))
        if buckets[-1] < self.max_model_len:  # every max_tokens the context allows has a bucket
            buckets.append(self.max_model_len)
        self.gen_buckets = tuple(buckets)
        self.score_buckets = length_buckets(self.max_model_len)
        self.score_batch_buckets = default_batch_buckets(self.slots)
        self.pad_id = pad_id
        self.max_pending_rows = int(max_pending_rows)
        self.score_chunk_size = int(score_chunk_size)
        self.lanes: dict[tuple, Engine] = {}  # (prompt width, cap, stop width) -> its Engine
        self._weights: Optional[Engine] = None  # the lane holding the generating model's snapshot
        self._active: Optional[tuple] = None  # (model name, version) the lanes generate with
        self._tickets: dict[Ticket, tuple] = {}  # a row handed to a lane -> (its job, its index, lane, mode)
        self._held: dict[tuple, collections.Counter] = {}  # lane -> its rows not yet answered, by sampling mode
        self._generate: collections.deque[_Job] = collections.deque()
        self._score: collections.deque[_Job] = collections.deque()
        self._pending_rows = 0  # admitted and not yet answered (queued, in a lane, scoring)
        self._cond = threading.Condition()
        self._stop = False
        self._served = collections.Counter()
        self._worker = None
        if start:
            self._worker = threading.Thread(target=self._work, name="jaxrl-serve-engine", daemon=True)
            self._worker.start()

    # ------------------------------------------------------------------------------------------------ the API
    def submit(self, work: Work) -> concurrent.futures.Future:
        """Queues `work`; its Future resolves to [RowOutput] / [RowScores] (one per row). Raises Overloaded or
        ShuttingDown at once (nothing queued) when it cannot be taken."""
        rows = len(work)
        job = _Job(work, concurrent.futures.Future(), [None] * rows, rows)
        if not rows:  # nothing to queue (no row would ever answer it)
            job.future.set_result([])
            return job.future
        with self._cond:
            admit_rows(self, rows)
            (self._generate if isinstance(work, GenerateRows) else self._score).append(job)
            self._cond.notify_all()
        return job.future

    def stats(self) -> dict:
        lanes = list(self.lanes.values())
        with self._cond:
            queued = sum(len(j.work) for j in self._generate) + sum(len(j.work) for j in self._score)
            waiting = queued + sum(lane.queued for lane in lanes)
            out = {"rows_waiting": waiting, "rows_running": self._pending_rows - waiting,
                   "requests_waiting": len(self._generate) + len(self._score),
                   "compiled_programs": compiled_programs(), "lanes": len(lanes),
                   "rows_generated": self._served["generate"], "rows_scored": self._served["score"]}
        for name in COUNTERS:
            out[name] = sum(lane.stats[name] for lane in lanes)
        return out

    def close(self, timeout_s: float = 60.0) -> None:
        """Refuses queued work (ShuttingDown), lets the rows in the lanes finish (up to `timeout_s`), stops the
        worker."""
        with self._cond:
            self._stop = True
            refused = list(self._generate) + list(self._score)
            self._generate.clear()
            self._score.clear()
            self._cond.notify_all()
        for job in refused:
            self._fail(job, ShuttingDown("the server is shutting down"))
        if self._worker is not None and self._worker.is_alive() and threading.current_thread() is not self._worker:
            self._worker.join(timeout_s)

    # --------------------------------------------------------------------------------------------- the worker
    def busy(self) -> bool:
        """Some lane has rows (in a slot or queued for one)."""
        return any(not lane.idle for lane in list(self.lanes.values()))

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._generate and not self._score and not self.busy():
                    self._cond.wait()
                if self._stop and not self.busy():
                    return
            try:
                self.step()
            except BaseException as e:  # noqa: BLE001 - a bug of this loop: answer everyone, keep serving
                logger.exception("the serving engine's turn failed")
                self._fail_everything(e)

    def step(self) -> None:
        """One turn of the worker: the waiting scoring requests (up to `slots` rows), the waiting rows handed to
        their lanes (as far as the generating model allows), one round of every lane with rows."""
        self._run_scoring()
        self._admit()
        for key, lane in list(self.lanes.items()):
            if lane.idle:
                continue
            try:
                done = lane.step()
            except BaseException as e:  # noqa: BLE001 - its rows' requests get the error; other lanes go on
                logger.exception("the serving engine's lane %s failed", key)
                self._drop_lane(key, e)
                continue
            for ticket in done:
                self._deliver(ticket)
            if lane.idle:
                lane.release()  # no rows: free its caches until its next row

    def _run_scoring(self) -> None:
        with self._cond:
            if not self._score:
                return
            key = _score_key(self._score[0].work)
            taken, rows, rest = [], 0, collections.deque()
            for job in self._score:
                if _score_key(job.work) == key and (not taken or rows + len(job.work) <= self.slots):
                    taken.append(job)
                    rows += len(job.work)
                else:
                    rest.append(job)
            self._score = rest
        try:
            self.activate(taken[0].work.model)
            results = score_rows(self.model, [j.work for j in taken], pad_id=self.pad_id, batch_size=self.slots,
                                 length_buckets=self.score_buckets, batch_buckets=self.score_batch_buckets,
                                 chunk_size=self.score_chunk_size)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting requests
            logger.exception("scoring %d requests failed", len(taken))
            for job in taken:
                self._fail(job, e)
            return
        for job, result in zip(taken, results):
            self._answer(job, result, "score")

    def _admit(self) -> None:
        """Hands the waiting generation requests' rows to their lanes, oldest first, while the generating model
        is theirs; a request of another model waits until every lane is idle, then the model switches."""
        while True:
            with self._cond:
                if not self._generate:
                    return
                job = self._generate[0]
            work = job.work
            try:
                version = self.version(work.model)
                keys = [self._lane_key(p, cap, work.stop_ids) for p, cap in zip(work.prompts, work.max_tokens)]
                if self._active is None or self._active[0] != work.model or self._active[1] is not version:
                    if self.busy():
                        return  # the lanes drain first: one model per snapshot
                    self._switch(work.model, version, keys[0])
                mode = sampling_mode(float(work.temperature), float(work.top_p), int(work.top_k),
                                     int(self.model.config.vocab_size))
                with self._cond:
                    self._generate.popleft()
                for r, (prompt, own) in enumerate(zip(work.prompts, keys)):
                    key = self._place(own, mode)
                    ticket = self._lane(key).submit(Request(
                        prompt, group_id=int(work.groups[r]), sample_index=int(work.samples[r]), seed=int(work.seed),
                        max_new_tokens=int(work.max_tokens[r]), temperature=float(work.temperature),
                        top_p=float(work.top_p), top_k=int(work.top_k), stop_ids=tuple(work.stop_ids)))
                    self._tickets[ticket] = (job, r, key, mode)
                    self._held.setdefault(key, collections.Counter())[mode] += 1
            except BaseException as e:  # noqa: BLE001 - this request's error (unknown model, a bad row)
                with self._cond:
                    if self._generate and self._generate[0] is job:
                        self._generate.popleft()
                self._fail(job, e)

    def _lane_key(self, prompt: Sequence[int], max_tokens: int, stop_ids: Sequence[int]) -> tuple:
        return (pick_bucket(len(prompt), self.prompt_buckets, "prompt length"),
                pick_bucket(int(max_tokens), self.gen_buckets, "max_tokens"), stop_width(len(stop_ids)))

    def _place(self, own: tuple, mode) -> tuple:
        """The lane of a row whose own lane is `own` (module docstring, 'Why several Engines')."""
        prompt_len, cap, width = own
        best = None
        for key, held in self._held.items():
            if (key[0] == prompt_len and key[1] >= cap and key[2] >= width and set(held) == {mode}
                    and sum(held.values()) < self.slots and (best is None or key[1:] < best[1:])):
                best = key
        return best or own

    def _lane(self, key: tuple) -> Engine:
        lane = self.lanes.get(key)
        if lane is None:
            prompt_len, cap, width = key
            lane = self.lanes[key] = Engine(self.model, slots=self.slots, prompt_len=prompt_len,
                                            max_new_tokens=cap, pad_token_id=self.pad_id,
                                            insert_rows=self.insert_rows, prompts_per_insert=self.insert_rows,
                                            round_steps=self.round_steps,
                                            shrink_sizes=(), stop_width=width)
            if self._weights is not None:
                lane.share_params(self._weights)
        return lane

    def _switch(self, name: str, version, key: tuple) -> None:
        """Every lane (all idle) generates with model `name` from now on."""
        self._active, self._weights = None, None
        lane = self._lane(key)
        self.activate(name)
        lane.set_params(None)  # a snapshot of what the held model carries now
        self._weights = lane
        for other in self.lanes.values():
            if other is not lane:
                other.share_params(lane)
        self._active = (name, version)

    def _deliver(self, ticket: Ticket) -> None:
        job, r, key, mode = self._tickets.pop(ticket)
        held = self._held[key]
        held[mode] -= 1
        if not held[mode]:
            del held[mode]
            if not held:
                del self._held[key]
        if job.over:
            return
        c = ticket.completion
        job.rows[r] = RowOutput(list(c.tokens), [float(x) for x in c.logprobs], c.finish_reason)
        job.left -= 1
        if job.left == 0:
            self._answer(job, job.rows, "generate")

    def _drop_lane(self, key: tuple, error: BaseException) -> None:
        """A lane whose round failed: its requests get the error; the lane is made again by its next row."""
        self.lanes.pop(key, None)
        self._held.pop(key, None)
        for ticket, (job, _, lane_key, _) in list(self._tickets.items()):
            if lane_key == key:
                del self._tickets[ticket]
                self._fail(job, error)

    def _fail_everything(self, error: BaseException) -> None:
        with self._cond:
            jobs = list(self._generate) + list(self._score)
            self._generate.clear()
            self._score.clear()
        jobs += [entry[0] for entry in self._tickets.values()]
        self._tickets.clear()
        self._held.clear()
        self.lanes.clear()
        self._active = self._weights = None
        for job in jobs:
            self._fail(job, error)

    def _answer(self, job: _Job, result, kind: str) -> None:
        with self._cond:
            if job.over:
                return
            job.over = True
            self._pending_rows -= len(job.work)
            self._served[kind] += len(job.work)
        job.future.set_result(result)

    def _fail(self, job: _Job, error: BaseException) -> None:
        with self._cond:
            if job.over:
                return
            job.over = True
            self._pending_rows -= len(job.work)
        job.future.set_exception(error)


def _score_key(work: ScoreRows) -> tuple:
    return work.model, top_k_bucket(work.top_k)
