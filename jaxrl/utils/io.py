"""File io of every part of jaxrl: atomic writes, JSON Lines reading and writing, torn-tail repair.

Writing is atomic everywhere: a temp file in the target's folder, fsync, then ``os.replace``, so a reader
never sees half a file and an interrupted write leaves the previous version intact::

    atomic_write_bytes(path, data)         atomic_write_text(path, text)        atomic_write_json(path, obj)
    write_jsonl(path, records)             atomic_copy(src, dst)
    with atomic_path(path) as tmp: save_file(tensors, tmp)          # writers that want a file name
    with atomic_folder(out_dir) as tmp: ...                          # a whole folder, swapped in at the end

Reading (``.gz`` files are decompressed on the fly)::

    records = read_jsonl("rollouts.jsonl")                           # list[dict]; errors name file:line
    records = read_jsonl(path, skip_malformed=True, skipped=msgs)    # bad lines -> msgs ("path:line: why")
    records = read_jsonl(path, validate=check)                       # check(rec) raises ValueError/KeyError
    for line in iter_json_lines(path): line.lineno, line.text, line.value, line.error   # lenient, raw

Appending writers (a resumable results file) cut a line torn by a kill with ``repair_tail(path)`` first, and
append whole lines with ``append_whole(fd, data)``: a write that fails half-way (a full disk) is cut back, so no
half-written line survives.

One writer per output (``writer_lock``): an advisory lock (``flock``) on a lock file beside the output, held by
the process; the kernel releases it when the process ends however it ends, so a crash never leaves a stale lock
(at most the file, which the next writer takes over; a writer that ends normally removes it).
A second writer is refused with OutputInUseError naming the holder's pid::

    with writer_lock(folder_lock_file(workdir), workdir, hint="use another --workdir"): ...
    with writer_lock(sibling_lock_file("rollouts.jsonl"), "rollouts.jsonl", hint="..."): ...

Standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import gzip
import hashlib
import io
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

__all__ = [
    "JsonLine",
    "CorruptCheckpointError",
    "DamagedFileError",
    "JsonlError",
    "OutputExistsError",
    "OutputInUseError",
    "append_whole",
    "atomic_copy",
    "atomic_folder",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "check_not_locked",
    "clean_leftovers",
    "damaged_file",
    "disk_full",
    "folder_lock_file",
    "is_temp_name",
    "iter_json_lines",
    "iter_jsonl",
    "jsonl_bytes",
    "open_text",
    "read_jsonl",
    "repair_tail",
    "sha256_file",
    "sibling_lock_file",
    "write_jsonl",
    "writer_lock",
]

TEMP_SUFFIX = ".tmp"


class JsonlError(ValueError):
    """A malformed JSON Lines record. ``str(err)`` starts with ``"<path>:<line>: "``."""

    def __init__(self, path: str | os.PathLike, line: int, message: str):
        self.path = str(path)
        self.line = line
        self.reason = message
        super().__init__(f"{self.path}:{line}: {message}")


class ResumeError(ValueError):
    """An existing output (a rollouts file, an evaluation, a training run) this run cannot continue: other
    settings, foreign or duplicate records."""


class OutputExistsError(FileExistsError):
    """An output that already holds results a command would replace (or extend inconsistently); the message names
    it and says what to do (resume with the same settings, another output, or --overwrite). Raised before
    anything is written."""


class OutputInUseError(RuntimeError):
    """Another process writes this output now (it holds its lock); the message names the holder's pid."""


# ------------------------------------------------------------------------------------------------- damaged files
# What a damaged file looks like in the errors of Orbax / tensorstore (a decoding or read failure), as opposed to a
# checkpoint of another structure (a bug or a changed config), which is never taken for damage.
_DAMAGE = re.compile(r"DATA_LOSS|Error decoding|Error reading|Unexpected end|checksum|truncated|corrupt",
                     re.IGNORECASE)
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files cannot be read back; `path` is the damaged file (or the step folder)."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"{path}: corrupted checkpoint ({reason}); restore it from a copy, or use another "
                         "checkpoint (step)")


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def damaged_file(exc: BaseException, folder: Optional[str | os.PathLike] = None
                 ) -> Optional["CorruptCheckpointError"]:
    """The CorruptCheckpointError for `exc` (raised while reading the checkpoint `folder`, when known) when it
    reports damaged files (a decoding or read failure of Orbax / tensorstore, unreadable JSON metadata); else
    None. The file is the one the error names, else the first JSON metadata file of `folder` that does not
    parse, else `folder`."""
    for e in _chain(exc):
        text = str(e)
        if isinstance(e, json.JSONDecodeError) or _DAMAGE.search(text):
            files = _LOCAL_FILE.findall(text)
            path = files[-1] if files else (folder and _unreadable_json(folder)) or folder or "checkpoint"
            first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
            if files:  # tensorstore: "... Error decoding local file "<path>": <what is wrong> [tensorstore_spec..."
                first = first.rsplit(f'"{path}"', 1)[-1].lstrip(": ")
            reason = re.sub(r"\s*\[tensorstore_spec.*", "", first)[:300]
            return CorruptCheckpointError(path, reason or "the file is unreadable or missing")
    return None


def _unreadable_json(folder: str | os.PathLike) -> Optional[str]:
    """The first JSON file of a checkpoint folder (Orbax's metadata, the JSON items) that does not parse."""
    for path in sorted(Path(folder).rglob("*")):
        if not path.is_file() or path.stat().st_size > (64 << 20):
            continue
        if path.name in ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata") or \
                path.parent.name == "array_metadatas":
            try:
                json.loads(path.read_bytes())
            except (ValueError, UnicodeDecodeError):
                return str(path)
    return None


# ------------------------------------------------------------------------------------------------------- reading


class DamagedFileError(ValueError):
    """An input file that cannot be read as what its name says (a truncated or foreign .gz); names the file."""


def open_text(path: str | os.PathLike) -> io.TextIOBase:
    """A UTF-8 text stream of `path`, gunzipped when its name ends in ``.gz``. FileNotFoundError naming a missing
    file (also a .gz one)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


@dataclasses.dataclass(frozen=True)
class JsonLine:
    """One non-blank line of a JSON Lines file: its JSON `value`, or the `error` that parsing it raised."""

    lineno: int  # from 1
    text: str  # without the line end
    value: Any = None
    error: Optional[ValueError] = None


def iter_json_lines(path: str | os.PathLike) -> Iterator[JsonLine]:
    """Every non-blank line of `path` parsed as JSON, errors included (callers decide what a bad line means). A
    .gz file that does not decompress is a DamagedFileError naming it."""
    with open_text(path) as f:
        for lineno, line in _lines(f, path):
            text = line.rstrip("\r\n")
            if not text.strip():
                continue
            try:
                yield JsonLine(lineno, text, json.loads(text))
            except ValueError as e:
                yield JsonLine(lineno, text, error=e)


def _lines(f, path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text stream; a damaged .gz or undecodable bytes are a DamagedFileError."""
    lineno = 0
    try:
        for lineno, line in enumerate(f, start=1):
            yield lineno, line
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DamagedFileError(f"{path}: not a readable gzip file after line {lineno} ({e}); download or copy it "
                               "again") from None
    except UnicodeDecodeError as e:
        raise DamagedFileError(f"{path}:{lineno + 1}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _describe(exc: BaseException) -> str:
    # KeyError's str() is the repr of the key; make it read as a sentence.
    if isinstance(exc, KeyError) and exc.args:
        return f"missing key {exc.args[0]!r}"
    return str(exc) or type(exc).__name__


def iter_jsonl(
    path: str | os.PathLike,
    *,
    validate: Optional[Callable[[dict], Any]] = None,
    skip_malformed: bool = False,
    skipped: Optional[list] = None,
) -> Iterator[tuple[int, dict]]:
    """Yields ``(line_number, record)`` for each non-blank line of ``path`` (line numbers start at 1).

    A line is malformed when it is not valid JSON, is not a JSON object, or ``validate(record)`` raises
    ``ValueError``, ``KeyError`` or ``TypeError``. Malformed lines raise :class:`JsonlError` naming the file and
    line, unless ``skip_malformed``; then they are left out and, if ``skipped`` is a list, its message
    (``"path:line: reason"``) is appended to it so callers can count and report them.
    Blank lines (e.g. a trailing newline) are ignored, not counted as malformed.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    for line in iter_json_lines(path):
        record = line.value
        try:
            if isinstance(line.error, json.JSONDecodeError):
                raise ValueError(f"invalid JSON ({line.error.msg} at column {line.error.colno})")
            if line.error is not None:
                raise ValueError(f"invalid JSON ({line.error})")
            if not isinstance(record, dict):
                raise ValueError(f"expected a JSON object, got {type(record).__name__}")
            if validate is not None:
                validate(record)
        except (ValueError, KeyError, TypeError) as e:
            err = JsonlError(path, line.lineno, _describe(e))
            if not skip_malformed:
                raise err from None
            if skipped is not None:
                skipped.append(str(err))
            continue
        yield line.lineno, record


def read_jsonl(
    path: str | os.PathLike,
    *,
    validate: Optional[Callable[[dict], Any]] = None,
    skip_malformed: bool = False,
    skipped: Optional[list] = None,
) -> list[dict]:
    """All records of ``path`` as a list of dicts; see :func:`iter_jsonl` for the error rules."""
    return [rec for _, rec in iter_jsonl(path, validate=validate, skip_malformed=skip_malformed, skipped=skipped)]


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of the file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------- full disk
# A write refused for want of space: the kernel's errors, and the text Orbax / tensorstore wrap them in.
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_NO_SPACE_TEXT = re.compile(r"No space left on device|Disk quota exceeded|File too large|os_error_code='28'")
_WRITTEN_FILE = re.compile(r'Failed writing: "([^"]+)"|local file "([^"]+)"')


def disk_full(exc: BaseException) -> Optional[str]:
    """When `exc` (or an exception it was raised from, or while handling) is a write refused for want of space,
    the one line that says so, naming the file ("<file>: no space left on device"; the first error of the chain
    that names one); else None."""
    found = []
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS:
            found.append((e.filename, (e.strerror or "no space left on device").lower()))
        elif _NO_SPACE_TEXT.search(str(e)):
            files = [a or b for a, b in _WRITTEN_FILE.findall(str(e))]
            found.append((files[0] if files else None, "no space left on device"))
    if not found:
        return None
    where, what = next(((f, w) for f, w in found if f), found[0])
    return f"{where or 'a file'}: {what}"


# ---------------------------------------------------------------------------------------------- refused path
# The OS refusing a named path (a --workdir or --out whose missing sub-folder lies under a read-only parent, a file
# without permission): the user's file system, not a bug of the code that hit it (pathlib's mkdir, an open()).
_REFUSED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


def refused_path(exc: BaseException) -> Optional[str]:
    """When `exc` (or an exception it was raised from, or while handling) is the OS refusing to create, write or
    read a path it names (no permission, a read-only file system), the one line that says so ("<path>: permission
    denied"); else None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _REFUSED_ERRNOS and e.filename:
            return f"{os.fsdecode(e.filename)}: {(e.strerror or os.strerror(e.errno)).lower()}"
    return None


def append_whole(fd: int, data: bytes, path: str | os.PathLike | None = None) -> None:
    """Appends `data` (whole lines) to the file open as `fd` (O_APPEND or positioned at its end): all of it, or,
    when a write fails part-way (a full disk), none of it -- the file is cut back to its size before the call,
    so no half-written line survives; the error is raised, naming `path`."""
    start = os.lseek(fd, 0, os.SEEK_END)
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        os.ftruncate(fd, start)
        if path is not None and e.filename is None:
            raise type(e)(e.errno, e.strerror, os.fspath(path)) from e
        raise
    except BaseException:
        os.ftruncate(fd, start)
        raise


# ------------------------------------------------------------------------------------------------------- locking
LOCK_SUFFIX = ".lock"
_held_locks: dict[str, list] = {}  # lock file (real path) -> [fd, holds]: re-entrant within this process


def folder_lock_file(folder: str | os.PathLike) -> Path:
    """The lock file of a folder its writer owns (a run's workdir, an evaluation's --out): inside it."""
    return Path(folder) / f".jaxrl{LOCK_SUFFIX}"


def sibling_lock_file(path: str | os.PathLike) -> Path:
    """The lock file of an output that is a file, or a folder replaced whole: a hidden sibling of it."""
    path = Path(os.path.abspath(path))
    return path.parent / f".{path.name}{LOCK_SUFFIX}"


def _holder(lock_file: Path) -> str:
    try:
        text = lock_file.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        text = ""
    pid, _, rest = text.partition(" ")
    return f"process {pid} ({rest})" if pid.isdigit() else "another process"


def check_not_locked(lock_file: str | os.PathLike, target: str | os.PathLike, *, hint: str) -> None:
    """OutputInUseError (as `writer_lock` raises it) when another process holds `lock_file` now; creates and
    changes nothing, so a command can refuse early, before its other checks, and take the lock itself later."""
    lock_file = Path(os.path.abspath(lock_file))
    if os.path.realpath(lock_file) in _held_locks or not lock_file.is_file():
        return
    fd = os.open(lock_file, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OutputInUseError(f"{target}: in use by {_holder(lock_file)}; {hint}") from None
    finally:
        os.close(fd)  # releases the probe's lock too


@contextlib.contextmanager
def writer_lock(lock_file: str | os.PathLike, target: str | os.PathLike, *, hint: str) -> Iterator[Path]:
    """Holds the advisory lock `lock_file` of the output `target` while the block runs (module docstring).
    OutputInUseError, before anything else is written, when another process holds it: "<target>: in use by
    process <pid> (<host>: <command>); <hint>". Re-entrant within one process."""
    lock_file = Path(os.path.abspath(lock_file))
    key = os.path.realpath(lock_file)
    if key not in _held_locks:
        fd = _lock(lock_file, target, hint)
        try:
            # who holds it, for the refusal a second writer prints
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}: {' '.join(sys.argv)[:300]}\n".encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds all the same, only the holder's name is missing
        _held_locks[key] = [fd, 0]
    _held_locks[key][1] += 1
    try:
        yield lock_file
    finally:
        _held_locks[key][1] -= 1
        if _held_locks[key][1] == 0:  # the last of this process's holds (they may end in any order)
            fd = _held_locks.pop(key)[0]
            try:
                os.unlink(lock_file)  # still held: whoever opens the name next gets a new file (see _lock)
            except OSError:
                pass
            os.close(fd)  # releases the lock


def _lock(lock_file: Path, target, hint: str) -> int:
    """An open descriptor of `lock_file` holding its exclusive lock. The holder removes the file when it lets go,
    so a lock taken on a file that is no longer the one at that name is dropped and taken again."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, _FILE_MODE)  # not inherited by child processes
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputInUseError(f"{target}: in use by {_holder(lock_file)}; {hint}") from None
        try:
            if os.stat(lock_file).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the previous holder removed it between our open and our lock: take the new one


# ------------------------------------------------------------------------------------------------------- writing


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once: mkstemp creates 0600 files, but outputs should get the permissions open() would give them.
_FILE_MODE = 0o666 & ~_umask()


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of the temp files the writers here create (left behind only by a kill)."""
    return name.startswith(".") and (name.endswith(TEMP_SUFFIX) or ".tmp-" in name)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temp file name in `path`'s folder; when the block succeeds the file is fsync'd and renamed onto
    `path`, when it fails the temp file is removed and `path` (if any) is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        os.fchmod(fd, _FILE_MODE)
        os.close(fd)
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Writes ``data`` to ``path`` via a temp file in the same folder and ``os.replace`` (atomic on POSIX)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def _dumps(obj: Any, path: Path, **kwargs) -> str:
    try:
        # allow_nan=False: NaN/Infinity are not JSON and break other readers; fail here, naming the file.
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: cannot serialise to JSON: {e}") from e


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2, sort_keys: bool = False) -> Path:
    """Writes ``obj`` as pretty JSON (UTF-8, trailing newline), atomically."""
    path = Path(path)
    return atomic_write_text(path, _dumps(obj, path, indent=indent, sort_keys=sort_keys) + "\n")


def jsonl_bytes(records: Iterable[dict], path: str | os.PathLike = "<records>") -> bytes:
    """The bytes `write_jsonl` writes for `records` (to compare an existing file with what a rerun would write)."""
    return "".join(_dumps(rec, Path(path)) + "\n" for rec in records).encode("utf-8")


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> Path:
    """Writes one compact JSON object per line (UTF-8, ``\\n`` line ends), atomically."""
    path = Path(path)
    return atomic_write_bytes(path, jsonl_bytes(records, path))


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copies the bytes of `src` to `dst` atomically."""
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
    return Path(dst)


def readable_by_others(folder: str | os.PathLike) -> None:
    """Gives `folder` and everything in it the modes a plain open() / mkdir would (0644 / 0755 under the usual umask
    022). mkdtemp, mkstemp and safetensors create 0700 / 0600 entries, which a server running as another user (a
    shared `vllm serve`) cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask
    for root, dirs, files in os.walk(folder):
        os.chmod(root, dir_mode)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, file_mode)


def _remove(path: str) -> None:
    """A folder, or a symlink (to a folder or not: the link goes, never what it points to)."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def clean_leftovers(out_dir: str | os.PathLike) -> list[str]:
    """What a killed `atomic_folder` of `out_dir` left beside it: its temp folders (`.NAME.tmp-*`, possibly
    gigabytes) are removed, and so are the previous versions it moved aside (`.NAME.old-*`, folders or links),
    except that when `out_dir` itself is missing (killed between the two renames) the newest previous version is
    put back as `out_dir`. Call with the output's lock held (`writer_lock`), so no running writer's folder is
    touched. Returns what was removed or restored."""
    out = os.path.abspath(out_dir)
    parent, name = os.path.dirname(out), os.path.basename(out)
    if not os.path.isdir(parent):
        return []
    entries = sorted(os.listdir(parent))
    temps = [e for e in entries if e.startswith(f".{name}.tmp-")]
    olds = sorted((e for e in entries if e.startswith(f".{name}.old-")),
                  key=lambda e: os.lstat(os.path.join(parent, e)).st_mtime)
    done = []
    if olds and not os.path.lexists(out):
        os.replace(os.path.join(parent, olds.pop()), out)
        done.append(f"restored {out}")
    for entry in temps + olds:
        _remove(os.path.join(parent, entry))
        done.append(f"removed {os.path.join(parent, entry)}")
    return done


@contextlib.contextmanager
def atomic_folder(out_dir: str | os.PathLike, overwrite: bool = False) -> Iterator[str]:
    """Yields a temp sibling folder of `out_dir`, renamed onto `out_dir` when the block succeeds (removed when it
    fails), so `out_dir` is always absent, the old complete folder or the new complete one. One writer at a time
    (the lock `sibling_lock_file(out_dir)`); what a killed earlier one left is cleaned first (`clean_leftovers`).
    An `out_dir` that is a symlink is replaced by the folder (the link is removed, never its target)."""
    out = os.path.abspath(out_dir)
    if os.path.lexists(out) and not overwrite:
        raise OutputExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    with writer_lock(sibling_lock_file(out), out, hint="wait for it to finish, or write to another --out"):
        for what in clean_leftovers(out):
            logging.getLogger(__name__).warning("%s (left by an interrupted write)", what)
        if os.path.lexists(out) and not overwrite:  # a previous version just put back
            raise OutputExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out)}.tmp-")
        try:
            yield tmp
            readable_by_others(tmp)  # mkdtemp makes it 0700, safetensors' files are 0600
            if os.path.lexists(out):
                old = tmp.replace(".tmp-", ".old-")
                os.replace(out, old)  # two renames: the old folder disappears only once the new one is complete
                os.replace(tmp, out)
                _remove(old)
            else:
                os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def repair_tail(path: str | os.PathLike) -> int:
    """Cuts a partially written last line (no trailing newline) off `path`; returns the bytes removed."""
    path = Path(path)
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # Walk back to the last newline (files are appended whole lines at a time, so this is the torn record).
        pos, block = size, 1 << 16
        keep = 0
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            idx = chunk.rfind(b"\n")
            if idx >= 0:
                keep = start + idx + 1
                break
            pos = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep
