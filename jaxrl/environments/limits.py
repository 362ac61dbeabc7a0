"""Environment calls that cannot hang the run: every call an episode makes to its environment (construct and
`reset`, then each `step`) runs on a daemon thread while the sampling thread waits for it with a deadline.

    calls = EnvironmentThread("CodeFeedback", limit_s=600.0)
    messages, reward, done = calls.call("step 2", env.step, turn)   # EnvironmentTimeout past the limit

Why a thread: a Python function that never returns cannot be stopped from outside (no exception can be raised
into a thread that sits in C code, `time.sleep` or a blocking read), so the caller stops *waiting* for it instead.
At the deadline the call is abandoned: it goes on running on its daemon thread (which cannot keep the process from
exiting), its environment object is not used again (the runner fails that episode), and the next call starts a
fresh thread. Calls run one at a time, in order, on one thread per sampling thread: an environment is constructed,
reset and stepped on the same thread (one that holds a thread-bound resource, e.g. an sqlite connection, works as
it did on the sampling thread), but not on the main thread (an environment cannot install signal handlers; the
built-in environments run programs in sandbox subprocesses with their own time limits).

While it waits, the sampling thread
  * logs a progress line every `progress_every_s` (the call, how long it has run, the limit);
  * honours SIGINT / SIGTERM (`jaxrl.utils.interrupt`, as the server waits of jaxrl.backends.waiting do): on the
    main thread it raises `Interrupted` at once (the Trainer keeps its last finished step; the rollout in flight
    is dropped and a resume samples it again); on another thread (a rollout sampled ahead) it lets a call that is
    running normally finish, so the rollout can land, and raises once the call has run STALLED_S.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any, Callable, Optional

from absl import logging

from jaxrl.backends.waiting import POLL_S, STALLED_S
from jaxrl.utils import interrupt

__all__ = ["EnvironmentThread", "EnvironmentTimeout", "PROGRESS_EVERY_S", "STEP_TIMEOUT_S", "check_step_timeout"]

# The default limit of one environment call. The slowest legitimate call of a built-in environment is a final
# scoring on a problem's hidden tests by a program that times out on every one of them: ~100 tests x 6 s over a
# 2-worker sandbox is ~300 s (and the sandbox is shared: a call may queue behind another episode's batch). Twice
# that still stops a hung plug-in within minutes, and the progress line says what the run waits for meanwhile.
STEP_TIMEOUT_S = 600.0
PROGRESS_EVERY_S = 30.0  # a line while one environment call runs longer than this


class EnvironmentTimeout(TimeoutError):
    """An environment call did not return within its limit (the episode fails; the run goes on)."""


def check_step_timeout(where: str, value: float) -> None:
    """ValueError naming `where` unless `value` is a finite number >= 0 (0 = no limit)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where} must be a finite number of seconds >= 0 (0 = no limit), got {value!r}")


class _Call:
    """One call handed to the environment thread, and what it gave."""

    def __init__(self, fn: Callable[..., Any], args: tuple):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - raised again on the waiting thread
            self.error = e
        finally:
            self.done.set()


def _serve(calls: "queue.SimpleQueue[Optional[_Call]]") -> None:
    while True:
        call = calls.get()
        if call is None:  # closed (or abandoned: then this comes after the hung call, if it ever returns)
            return
        call.run()


class EnvironmentThread:
    """The environment calls of one sampling thread, in order, on a daemon thread (module docstring). `name`: the
    environment, as errors and progress lines name it; `limit_s`: the limit of one call (0 = none)."""

    def __init__(self, name: str, limit_s: float = STEP_TIMEOUT_S, progress_every_s: float = PROGRESS_EVERY_S):
        self.name, self.limit_s, self.progress_every_s = name, float(limit_s), float(progress_every_s)
        self._calls: "queue.SimpleQueue[Optional[_Call]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the environment thread: its value, or its exception raised here. EnvironmentTimeout past
        the limit, Interrupted on a signal (module docstring); either way the thread is abandoned."""
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._calls,), daemon=True,
                                            name=f"jaxrl-environment-{self.name}")
            self._thread.start()
        pending = _Call(fn, args)
        self._calls.put(pending)
        self._wait(what, pending)
        if pending.error is not None:
            raise pending.error
        return pending.value

    def _wait(self, what: str, pending: _Call) -> None:
        start = last = time.monotonic()
        patience = 0.0 if threading.current_thread() is threading.main_thread() else STALLED_S
        while not pending.done.wait(POLL_S):
            now = time.monotonic()
            signum = interrupt.requested()
            if signum is not None and now - start >= patience:
                self._abandon()
                raise interrupt.Interrupted(signum, f"stopped while waiting for environment {self.name!r} ({what} "
                                            f"had run {now - start:.0f} s); the rollout in flight is dropped")
            if self.limit_s and now - start >= self.limit_s:
                self._abandon()
                raise EnvironmentTimeout(
                    f"environment {self.name!r}: {what} did not return within step_timeout_s={self.limit_s:g} s (left "
                    f"running on an abandoned thread; this episode's environment is not used again)")
            if self.progress_every_s and now - last >= self.progress_every_s:
                last = now
                limit = f"step_timeout_s={self.limit_s:g}" if self.limit_s else "no step_timeout_s"
                logging.info("environment %r: waiting for %s, running %.0f s (%s)", self.name, what, now - start,
                             limit)

    def _abandon(self) -> None:
        """Leaves the hung call to its thread, which ends if the call ever returns; the next call gets a new one."""
        self._calls.put(None)
        self._calls, self._thread = queue.SimpleQueue(), None

    def close(self) -> None:
        """Ends the thread once its calls are done (a later `call` starts another)."""
        if self._thread is not None:
            self._abandon()
