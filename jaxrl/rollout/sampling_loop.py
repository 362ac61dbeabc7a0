"""The one resumable sampling loop, behind offline rollouts (jaxrl.rollout.runner) and evaluation
(jaxrl.evaluation.runner): the problems shared over processes, only the (problem, sample index) pairs missing on
disk drawn through the Collector, one finished problem appended (flushed, fsync'ed) at a time, and with several
processes the parts merged into the file one process would have written.

    done = ... keys of the records in on_disk(log) ...      # the file and its part files: what is drawn already
    loop = SamplingLoop(log, work, num_samples, done, label="rollouts out.jsonl")   # this process's share
    counts = loop.run(collector, sampling, record, stop_message=lambda counts: "...")
    meta = loop.finish(summary=...)                          # several processes: barrier, process 0 merges, barrier

work: (problem, prompt token ids) of every problem, in the file's order; done: the (problem id, sample index)
pairs already on disk. Process i of n takes every n-th problem (jaxrl.parallel.distributed.share) and appends to
its part file `log.part(i, n)`; a single process appends to `log` itself. Parts left by an interrupted run of
several processes are merged by whichever run finishes next. Interrupted (SIGINT / SIGTERM with
jaxrl.utils.interrupt installed): the batch in flight is written, then Interrupted is raised with the caller's
stop message.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Container, Optional, Sequence

import jax
from tqdm import tqdm

from jaxrl.parallel import distributed
from jaxrl.backends.base import SamplingParams
from jaxrl.rollout.collect import Collector, Sample
from jaxrl.rollout.keys import problem_key
from jaxrl.rollout.writer import ResumableJsonl
from jaxrl.utils import interrupt

__all__ = ["Counts", "ProgressBar", "SamplingLoop", "on_disk"]


def on_disk(log: ResumableJsonl) -> list[ResumableJsonl]:
    """The file and the part files of several processes (this run's, or an interrupted run's): where the samples
    already drawn are."""
    return [log] + log.parts()


@dataclasses.dataclass
class Counts:
    """This process's share, and what one run of the loop wrote of it."""

    total: int  # samples of the share: its problems x num_samples
    resumed: int  # of them, on disk before the run
    written: int = 0  # samples drawn and written by the run
    truncated: int = 0  # of them, cut at max_new_tokens
    generated_tokens: int = 0
    batch_problems: int = 0  # problems of the batch written last
    started: float = 0.0  # time.perf_counter() when the first batch started


@dataclasses.dataclass(frozen=True)
class ProgressBar:
    """A tqdm bar over this process's share. unit "sample": samples, with samples/s and tokens/s, shown even when
    nothing is left to draw (a finished file reads 100%); unit "problem": problems, shown while there is work."""

    desc: str
    unit: str = "sample"

    def __post_init__(self):
        if self.unit not in ("sample", "problem"):
            raise ValueError(f"ProgressBar unit must be 'sample' or 'problem', got {self.unit!r}")


class SamplingLoop:
    """See the module docstring. `label` names the run in its barriers (e.g. "rollouts out.jsonl")."""

    def __init__(self, log: ResumableJsonl, work: Sequence[tuple[Any, Sequence[int]]], num_samples: int,
                 done: Container[tuple[str, int]], *, label: str):
        self.log, self.num_samples, self.done, self.label = log, num_samples, done, label
        self.processes, self.index = jax.process_count(), jax.process_index()
        self.mine = [work[j] for j in distributed.share(len(work))]
        self.todo = [(p, prompt) for p, prompt in self.mine if any(not self.is_done(p.id, i)
                                                                    for i in range(num_samples))]
        self.counts = Counts(total=len(self.mine) * num_samples,
                             resumed=sum(self.is_done(p.id, i) for p, _ in self.mine for i in range(num_samples)))
        self.writer = log if self.processes == 1 else log.part(self.index, self.processes)
        self._position = {str(p.id): j for j, (p, _) in enumerate(work)}

    def is_done(self, problem_id: str, sample_index: int) -> bool:
        return (problem_id, sample_index) in self.done

    def key(self, record: dict) -> tuple[str, int]:
        """The identity of a record: (problem id, sample index)."""
        return str(record["problem_id"]), int(record["sample_index"])

    def order(self, record: dict) -> tuple[int, int]:
        """The position of a record in the file: its problem's position in `work`, then its sample index."""
        return self._position[str(record["problem_id"])], int(record["sample_index"])

    def run(self, collector: Collector, sampling: SamplingParams, record: Callable[[Sample, Any, Sequence[int]], dict],
            *, stop_message: Callable[[Counts], str], prepare: Optional[Callable[[], None]] = None,
            progress: Optional[ProgressBar] = None, on_batch: Optional[Callable[[Counts], None]] = None,
            stream: Optional[Callable[..., Any]] = None) -> Counts:
        """Draws and appends what this process's share lacks; returns the counts.

        record(sample, problem, prompt ids): the line written for a sample. A batch written together is the
        problems of the backend's `batch_size` samples (the stream goes on past it). prepare(): called once before
        the first batch, only when there is something to draw (e.g. loading the model). on_batch(counts): after
        each written batch. stream: what draws the samples, with `Collector.stream`'s signature and yield
        (default `collector.stream`; evaluation over episodes passes its episode stream, whose samples are
        episodes: the loop reads their prompt_index, sample_index, tokens and truncated only)."""
        counts = self.counts
        self.writer.start()
        bar = None
        try:
            if self.todo and prepare is not None:
                prepare()
            if progress is not None and (self.todo or progress.unit == "sample"):
                bar = self._open_bar(progress)
            per_batch = max(1, collector.backend.batch_size // self.num_samples)
            counts.started = time.perf_counter()
            todo = self.todo
            draw = stream if stream is not None else collector.stream
            batches = draw([prompt for _, prompt in todo], [problem_key(p.id) for p, _ in todo],
                                      [p for p, _ in todo], sampling, chunk=per_batch,
                                      wanted=lambda j, i: not self.is_done(todo[j][0].id, i))
            for b, samples in batches:
                chunk = todo[b:b + per_batch]
                for s in samples:
                    s.prompt_index -= b
                by_problem: list[list[dict]] = [[] for _ in chunk]
                for s in samples:
                    problem, prompt = chunk[s.prompt_index]
                    by_problem[s.prompt_index].append(record(s, problem, prompt))
                # One problem's samples at a time, fsync'ed: a kill loses at most the problems of the batch in
                # flight, never a half-written record (a torn line is cut on resume).
                for records in by_problem:
                    self.writer.append(records)
                counts.written += len(samples)
                counts.truncated += sum(s.truncated for s in samples)
                counts.generated_tokens += sum(len(s.tokens) for s in samples)
                counts.batch_problems = len(chunk)
                if bar is not None:
                    self._update_bar(bar, progress, counts, len(samples), len(chunk))
                if on_batch is not None:
                    on_batch(counts)
                interrupt.check(lambda: stop_message(counts))
        finally:
            self.writer.close()
            if bar is not None:
                bar.close()
        return counts

    def _open_bar(self, progress: ProgressBar) -> tqdm:
        if progress.unit == "sample":
            total, initial = self.counts.total, self.counts.resumed
        else:
            total, initial = len(self.mine), len(self.mine) - len(self.todo)
        return tqdm(total=total, initial=initial, unit=progress.unit, desc=progress.desc, dynamic_ncols=True)

    @staticmethod
    def _update_bar(bar: tqdm, progress: ProgressBar, counts: Counts, samples: int, problems: int) -> None:
        if progress.unit == "problem":
            bar.update(problems)
            return
        bar.update(samples)
        elapsed = max(time.perf_counter() - counts.started, 1e-9)
        bar.set_postfix({"samples/s": f"{counts.written / elapsed:.2f}",
                         "tokens/s": f"{counts.generated_tokens / elapsed:.1f}"})

    def finish(self, *, summary: Optional[dict] = None,
               merged_summary: Optional[Callable[[list[dict], int], dict]] = None,
               keep: Optional[Callable[[dict], bool]] = None,
               validate: Optional[Callable[[dict], None]] = None) -> Optional[dict]:
        """Brings every part into the file, in problem order (`log.merge_parts`; keep / validate as there).

        One process: parts left by an interrupted run of several are merged. Several: each process's part is
        finished, then after a barrier process 0 merges them, then a second barrier. summary: recorded in the
        meta file of what this process wrote (the file, or its part); without it the meta files keep status
        "running". merged_summary(the parts' meta records, records in the merged file): the merged file's summary
        (several processes). Returns the file's meta record when a summary is given."""
        log = self.log
        if self.processes == 1:
            if log.parts():
                log.merge_parts(self.key, self.order, keep=keep, validate=validate)
            if summary is None:
                log.close()
                return None
            return log.finish(summary)
        if summary is not None:
            self.writer.finish(summary)
        distributed.barrier(f"{self.label}: parts written")
        if self.index == 0 and log.parts():
            parts = [json.loads(log.part(i, self.processes).meta_path.read_text())
                     for i in range(self.processes)] if merged_summary is not None else []
            log.merge_parts(self.key, self.order, keep=keep, validate=validate)
            if merged_summary is None:
                log.close()
            else:
                log.finish(merged_summary(parts, len(log.read())))
        distributed.barrier(f"{self.label}: merged")
        return json.loads(log.meta_path.read_text()) if summary is not None else None
