"""The console's log filters, one home for every entry point (launchers/, the sweep's point subprocesses):

    install_log_filters()        # Orbax's read-only notices dropped (always); what every launcher gets on import
    quiet_libraries(verbose)     # the libraries' INFO records dropped unless verbose (LogSettings: a launcher's
                                 # --verbose, launchers/_main.py), the orphaned reads and late callbacks of a
                                 # failed tensorstore restore, and the libraries' own reports of a full disk (the
                                 # launcher prints one line)

Both act on absl's logger / handler, which Orbax, jax and the project all log through. Warnings and errors always
pass; so do the project's own INFO lines (progress with ETA, "resumed from ...": records whose file is in jaxrl/,
launchers/ or configs/).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Optional

from absl import logging as absl_logging

from jaxrl.utils.dataclass_flags import flag_field
from jaxrl.utils.io import disk_full

_REPO = Path(__file__).resolve().parents[2]
OWN_DIRS = tuple(str(_REPO / d) + os.sep for d in ("jaxrl", "launchers", "configs"))

# Orbax warns, on every checkpoint manager opened with read_only=True (as every evaluation, export and resume of
# an adapter checkpoint does), that a read-only manager will not save, create or clean up: three lines per
# opened checkpoint, dozens per evaluation, and nothing a user can act on.
_ORBAX_READ_ONLY_NOTICES = ("CheckpointManagerOptions.read_only=True, setting ", "Given directory is read only=")


@dataclasses.dataclass(frozen=True)
class LogSettings:
    """How much a launcher run says; its field is every launcher's --verbose (launchers/_main.py, which also prints
    every error's traceback with it; jaxrl.utils.dataclass_flags makes the flag)."""

    verbose: bool = flag_field(False, help="Tracebacks for every error and the libraries' INFO logs (Orbax, jax, "
                               "...).")


def own_file(filename: str) -> bool:
    """Whether a source file is the project's own (jaxrl/, launchers/, configs/)."""
    return os.path.abspath(filename).startswith(OWN_DIRS)


class OrbaxReadOnlyNotices(logging.Filter):
    """Drops Orbax's read-only notices (only those, only from Orbax's own modules); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname.replace("\\", "/"):
            return True
        return not record.getMessage().startswith(_ORBAX_READ_ONLY_NOTICES)


class LibraryInfo(logging.Filter):
    """Drops INFO (and DEBUG) records of code outside the project; warnings and the project's own lines pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or own_file(record.pathname)


class OrphanFutures(logging.Filter):
    """Drops asyncio's "Future/Task exception was never retrieved" records: after Orbax gives up on a damaged
    checkpoint, each tensorstore read it had started in parallel ends in such an orphan, one ERROR record with
    its traceback per array, all repeating the error the restore raised (which names the file)."""

    def filter(self, record: logging.LogRecord) -> bool:
        # asyncio's handler logs the message and then the future's repr on the following lines
        first_line = record.getMessage().split("\n", 1)[0]
        return not (record.name == "asyncio" and first_line.endswith("exception was never retrieved"))


class LibraryDiskFull(logging.Filter):
    """Drops the libraries' records of a full disk: Orbax's background save threads log one ERROR with a
    traceback per file they could not write (dozens per checkpoint), all saying what the launcher's one line says
    (the error the save raised, naming the file). The project's own records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if own_file(record.pathname):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if (exc is not None and disk_full(exc) is not None) or disk_full(Exception(record.getMessage())) is not None:
            _disk["full"] = True
            return False
        return True


_READ_ONLY = OrbaxReadOnlyNotices()
_LIBRARY_INFO = LibraryInfo()
_ORPHAN_FUTURES = OrphanFutures()
_LIBRARY_DISK_FULL = LibraryDiskFull()


def install_log_filters() -> None:
    """Attach the read-only filter to the logger Orbax writes through (absl's); idempotent."""
    # absl's own logger class names the real caller (Orbax's file); a plain logging.getLogger("absl") made
    # before absl is imported would not, and would replace it.
    logger = absl_logging.get_absl_logger()
    if _READ_ONLY not in logger.filters:
        logger.addFilter(_READ_ONLY)


def _closed_loop_callback(unraisable) -> bool:
    """After Orbax gives up on a damaged checkpoint, tensorstore's reads still in flight call back into the
    asyncio loop Orbax already closed: dozens of identical "Event loop is closed" tracebacks, none of which says
    anything about the failure (that is reported, naming the file, by the error the read raised)."""
    exc = unraisable.exc_value
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and tb is not None
            and tb.tb_frame.f_code.co_filename.startswith(os.path.dirname(asyncio.__file__)))


_disk = {"full": False}  # set once a full disk was seen (reported by the launcher or a library's thread)


def note_disk_full() -> None:
    """The disk is full: what the libraries' threads and exit handlers fail on from now on is its consequence."""
    _disk["full"] = True


def _library_failure_after_full_disk(exc: Optional[BaseException], tb) -> bool:
    """An error of a library (no frame of ours) once the disk is full, or the full disk itself: tensorboardX's
    writer thread and exit handler fail on their closed queue or on the same full disk."""
    if exc is not None and disk_full(exc) is not None:
        _disk["full"] = True
        return True
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return _disk["full"] and not any(own_file(f) for f in frames)


def _quiet_unraisable(unraisable) -> None:
    if _closed_loop_callback(unraisable):
        return
    if _library_failure_after_full_disk(unraisable.exc_value, unraisable.exc_traceback):
        return  # e.g. tensorboardX's exit handler flushing onto the full disk
    sys.__unraisablehook__(unraisable)


def _quiet_thread_disk_full(args) -> None:
    """A library's background thread (tensorboardX's event writer, ...) that died on a full disk, or of it: no
    traceback; the main thread stops on the same full disk with one line naming the file."""
    if not _library_failure_after_full_disk(args.exc_value, args.exc_traceback):
        threading.__excepthook__(args)


def quiet_libraries(verbose: bool = LogSettings.verbose) -> None:
    """The libraries' INFO records and asyncio's orphaned futures off the console (absl's handler), and the
    closed-loop callbacks of `_closed_loop_callback`, unless `verbose`; idempotent."""
    handler = absl_logging.get_absl_handler()
    # on the asyncio logger too: at interpreter exit its records can reach logging's last-resort handler
    asyncio_logger = logging.getLogger("asyncio")
    if verbose:
        for f in (_LIBRARY_INFO, _ORPHAN_FUTURES, _LIBRARY_DISK_FULL):
            handler.removeFilter(f)
        asyncio_logger.removeFilter(_ORPHAN_FUTURES)
        if sys.unraisablehook is _quiet_unraisable:
            sys.unraisablehook = sys.__unraisablehook__
        if threading.excepthook is _quiet_thread_disk_full:
            threading.excepthook = threading.__excepthook__
        return
    if threading.excepthook is threading.__excepthook__:
        threading.excepthook = _quiet_thread_disk_full
    for f in (_LIBRARY_INFO, _ORPHAN_FUTURES, _LIBRARY_DISK_FULL):
        if f not in handler.filters:
            handler.addFilter(f)
    if _ORPHAN_FUTURES not in asyncio_logger.filters:
        asyncio_logger.addFilter(_ORPHAN_FUTURES)
    if sys.unraisablehook is sys.__unraisablehook__:
        sys.unraisablehook = _quiet_unraisable
