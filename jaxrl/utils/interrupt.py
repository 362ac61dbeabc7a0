"""Stopping on Ctrl-C / SIGTERM at a safe point: a signal sets a flag, the long loops look at it between units of
work (a train step, a batch of samples), finish what they hold, write it, and raise `Interrupted`.

    interrupt.install()                    # the launchers do this (launchers/_main.py); library code never does
    ...
    interrupt.check(lambda: f"after step {n}; rerun to resume")   # raises Interrupted if a signal came

Why a flag and not KeyboardInterrupt: Python raises KeyboardInterrupt at whatever bytecode the main thread runs
next. That can be a gc callback (jax's `_xla_gc_callback`: the exception is printed as "Exception ignored" and
the signal is lost, so the run goes on), the middle of a checkpoint write, or a thread-pool hand-off; and the
interpreter then tears down while XLA computations, Orbax writer threads and tensorstore callbacks are still
running, which is where a process can die on a segmentation fault instead of exiting. With the flag nothing is
raised inside native or library code: the loop stops between steps, waits for pending writes, and exits.

A second signal while the first is being handled means "now": the process exits at once with the same status
(appended files hold whole fsync'ed lines and checkpoints land by rename, so even this loses at most the unit in
flight). Without `install()` (library use, tests), `requested()` is always None and `check()` never raises.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional, Union

__all__ = ["Interrupted", "check", "exit_status", "install", "requested", "reset", "signal_name", "uninstall"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)

_state = {"signum": None, "installed": False, "previous": {}, "raise_now": False}


def exit_status(signum: int) -> int:
    """The shell's status of a process ended by `signum`: 128 + its number (130 SIGINT, 143 SIGTERM)."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Interrupted(KeyboardInterrupt):
    """A signal stopped the work at a safe point; `str()` says where, and how to continue. A KeyboardInterrupt, so
    that `except Exception` blocks let it through as they would Ctrl-C."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = int(signum)
        self.message = message

    @property
    def exit_status(self) -> int:
        return exit_status(self.signum)

    def __str__(self) -> str:
        return self.message


def _handle(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    if _state["signum"] is not None:
        # the second signal: exit now, without unwinding through native code
        sys.stderr.write(f"\n{signal_name(signum)} again: exiting now (the work in flight is lost; what was written "
                         "is kept)\n")
        sys.stderr.flush()
        os._exit(exit_status(_state["signum"]))
    _state["signum"] = signum
    if _state["raise_now"]:
        raise Interrupted(signum, "stopped; every file is either complete or as it was")
    sys.stderr.write(f"\n{signal_name(signum)}: stopping after the current step (send it again to stop now)\n")
    sys.stderr.flush()


def install(raise_now: bool = False) -> None:
    """SIGINT and SIGTERM set the flag from now on (main thread only; idempotent).

    raise_now: also raise Interrupted at once, as Ctrl-C does by default, for commands without a loop that looks
    at the flag (their outputs are written atomically, so stopping anywhere leaves each file complete or as it
    was); the flag still records the signal, so one whose exception was swallowed (e.g. inside a gc callback)
    is seen when the command ends."""
    if threading.current_thread() is not threading.main_thread():
        return
    _state["raise_now"] = raise_now
    if _state["installed"]:
        return
    for sig in SIGNALS:
        _state["previous"][sig] = signal.signal(sig, _handle)
    _state["installed"] = True


def uninstall() -> None:
    """The handlers that were there before `install()`; the flag is cleared."""
    if _state["installed"]:
        for sig, previous in _state["previous"].items():
            signal.signal(sig, previous)
        _state["previous"].clear()
        _state["installed"] = False
    reset()


def reset() -> None:
    _state["signum"] = None


def requested() -> Optional[int]:
    """The number of the signal that asked to stop, or None."""
    return _state["signum"]


def check(message: Union[str, Callable[[], str]] = "stopped") -> None:
    """Raises Interrupted(`message`) when a signal asked to stop; `message` may be a function (called only then)."""
    signum = _state["signum"]
    if signum is not None:
        raise Interrupted(signum, message() if callable(message) else message)
