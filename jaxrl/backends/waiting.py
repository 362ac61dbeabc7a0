"""Waiting for servers without hanging the run: the requests of a rollout (or an evaluation) sent to one or more
servers, each server with its own number in flight, while the caller's thread watches them.

    results = send_all(jobs, concurrency={"http://a": 64, "http://b": 64}, progress_every_s=30, what="rollout")

Each job is (server, rows, call): `call()` sends one request and returns its answer. What the watching thread does
that a thread pool's `map` does not:

  * a progress line every `progress_every_s` while requests are out: rows answered / rows sent, per server (a
    server that stopped answering shows as the one whose count does not move);
  * SIGINT / SIGTERM honoured while waiting (`jaxrl.utils.interrupt`: the launchers install it): on the main
    thread the wait stops at once and `Interrupted` is raised, the rollout in flight is dropped (nothing of it was
    written) and the caller (the Trainer) keeps its last finished step, from which a resume samples the same
    rollout again. On another thread (an overlapped rollout sampled while the trainer trains) the wait goes on
    while the servers answer, so the rollout lands in the buffer store and a resume stays bit-exact, and stops once
    no request has been answered for STALLED_S (a hung server);
  * the first error of any request raised at once (the others are left to their daemon threads: a hung request
    cannot keep the process from exiting, as a thread pool's workers, joined at exit, would).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Mapping, Sequence

from absl import logging

from jaxrl.utils import interrupt

POLL_S = 0.2  # how often the waiting thread looks at the signal flag
STALLED_S = 10.0  # off the main thread, a signal stops the wait once no request was answered for this long


def send_all(jobs: Sequence[tuple[str, int, Callable[[], object]]], *, concurrency: Mapping[str, int],
             progress_every_s: float = 30.0, what: str = "requests") -> list:
    """The answers of `jobs` in order (module docstring). Raises the first request's error, or Interrupted."""
    results: list = [None] * len(jobs)
    if not jobs:
        return results
    lock = threading.Condition()
    state = {"left": len(jobs), "error": None}
    sent, answered = collections.Counter(), collections.Counter()
    queues: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    for i, (server, rows, _) in enumerate(jobs):
        queues[server].append(i)
        sent[server] += rows

    def worker(server: str) -> None:
        while True:
            with lock:
                if state["error"] is not None or not queues[server]:
                    return
                i = queues[server].popleft()
            try:
                value = jobs[i][2]()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                with lock:
                    if state["error"] is None:
                        state["error"] = e
                    lock.notify_all()
                return
            with lock:
                results[i] = value
                answered[server] += jobs[i][1]
                state["answered_at"] = time.monotonic()
                state["left"] -= 1
                lock.notify_all()

    for server, queue in queues.items():
        for k in range(max(1, min(int(concurrency.get(server, 1)), len(queue)))):
            threading.Thread(target=worker, args=(server,), daemon=True, name=f"jaxrl-request-{k}").start()
    start = last = state["answered_at"] = time.monotonic()
    patience = 0.0 if threading.current_thread() is threading.main_thread() else STALLED_S
    with lock:
        while state["left"] and state["error"] is None:
            lock.wait(POLL_S)
            if interrupt.requested() is not None and time.monotonic() - state["answered_at"] >= patience:
                state["error"] = interrupt.Interrupted(
                    interrupt.requested(), f"stopped while waiting for the servers ({what}: "
                    f"{progress(sent, answered)}); the rollout in flight is dropped")
                break
            now = time.monotonic()
            if progress_every_s and now - last >= progress_every_s and state["left"]:
                last = now
                logging.info("%s: waiting %.0f s: %s", what, now - start, progress(sent, answered))
        error = state["error"]
    if error is not None:
        raise error
    return results


def progress(sent: Mapping[str, int], answered: Mapping[str, int]) -> str:
    """"http://a 296/512 rows, http://b 512/512 rows": rows answered of rows sent, per server."""
    return ", ".join(f"{server} {answered.get(server, 0)}/{rows} rows answered" for server, rows in sent.items())
