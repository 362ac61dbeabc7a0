"""Programs compiled ahead of their first call, on a thread of their own, so the serve loop never compiles in line.

    compiler = Compiler(on_ready=wake_the_loop)
    compiler.ready({key: compile_it, ...})   # True once every program is compiled; else queues the missing ones
    compiler.compile_all(programs)           # the start-up warm-up: queue them, wait, log "k/N"

A program is compiled by `jit(...).lower(shapes).compile()` (`Engine.pool_programs`, `loop.score_programs`): jax
fills the very caches the serving call then looks in, and XLA's compile releases the GIL, so the serve loop keeps
stepping the compiled shapes meanwhile. A program whose compile fails counts as ready: its first call then compiles
it in line and answers its own error. `inline_compiles()` counts the XLA compiles the serve loop's thread ran itself
(each one stalled every request), read from jax's compile events.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Hashable

import jax

logger = logging.getLogger(__name__)

SERVE_THREAD = "jaxrl-serve-loop"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_COMPILES_BY_THREAD: collections.Counter = collections.Counter()


def _count_compile(event: str, _duration: float, **_kwargs) -> None:
    if event == _BACKEND_COMPILE:
        _COMPILES_BY_THREAD[threading.current_thread().name] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def inline_compiles() -> int:
    """XLA compiles run on the serve loop's thread in this process (each one stalled every request)."""
    return _COMPILES_BY_THREAD[SERVE_THREAD]


class Compiler:
    """One thread compiling the programs asked for, oldest first (module docstring). Thread safe."""

    def __init__(self, on_ready: Callable[[], None] = lambda: None):
        self.on_ready = on_ready
        self._cond = threading.Condition()
        self._done: set = set()
        self._queue: collections.OrderedDict[Hashable, Callable[[], object]] = collections.OrderedDict()
        self._running = 0
        self._stop = False
        self.stats = collections.Counter()  # compiled, failed, seconds (float)
        self._thread = threading.Thread(target=self._work, name="jaxrl-serve-compiler", daemon=True)
        self._thread.start()

    def ready(self, programs: dict[Hashable, Callable[[], object]]) -> bool:
        """Whether every program of `programs` (key -> the call that compiles it) is compiled; those that are not
        are queued (once)."""
        with self._cond:
            missing = [key for key in programs if key not in self._done]
            for key in missing:
                if key not in self._queue:
                    self._queue[key] = programs[key]
            if missing:
                self._cond.notify_all()
            return not missing

    @property
    def compiling(self) -> int:
        """Programs queued or being compiled now."""
        with self._cond:
            return len(self._queue) + self._running

    def compile_all(self, programs: dict[Hashable, Callable[[], object]], what: str) -> int:
        """Queues `programs` and waits until each is compiled, logging the progress; returns how many were not
        compiled before."""
        with self._cond:
            todo = [key for key in programs if key not in self._done]
        total, step = len(todo), max(1, len(todo) // 10)
        logger.info("compiling %d programs of %s", total, what)
        start = time.monotonic()
        self.ready({key: programs[key] for key in todo})
        with self._cond:
            logged = 0
            while True:
                done = sum(key in self._done for key in todo)
                if done - logged >= step or done == total:
                    logger.info("compiling %d programs ... %d/%d (%.1f s)", total, done, total,
                                time.monotonic() - start)
                    logged = done
                if done == total:
                    return total
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._queue:
                    self._cond.wait()
                if self._stop:
                    return
                key, compile_it = self._queue.popitem(last=False)
                self._running += 1
            start = time.perf_counter()
            try:
                compile_it()
                outcome = "compiled"
            except Exception:  # noqa: BLE001 - its first call compiles it in line and answers the error
                logger.exception("compiling %s ahead of time failed", key[0] if isinstance(key, tuple) else key)
                outcome = "failed"
            with self._cond:
                self._running -= 1
                self._done.add(key)
                self.stats[outcome] += 1
                self.stats["seconds"] += time.perf_counter() - start
                self._cond.notify_all()
            self.on_ready()
