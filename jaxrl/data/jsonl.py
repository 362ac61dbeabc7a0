"""Small JSON Lines helpers: line-numbered read errors and atomic writes.

Shared by every part that reads or writes the project's ``.jsonl`` / ``.json`` artifacts
(rollouts, pairs, problems, results). Kept dependency-free (standard library only).

Reading::

    records = read_jsonl("rollouts.jsonl")                       # list[dict]; error names file:line
    skipped = []
    records = read_jsonl(path, skip_malformed=True, skipped=skipped)   # bad lines -> skipped (messages)

    def check(rec):                                              # raise ValueError/KeyError/TypeError
        if "problem_id" not in rec: raise KeyError("problem_id")
    records = read_jsonl(path, validate=check)                   # -> JsonlError("path:7: missing key 'problem_id'")

Writing (temp file in the same folder + fsync + ``os.replace``, so a reader never sees half a file and an
interrupted write leaves the previous version intact)::

    write_jsonl(path, records)
    atomic_write_json(path, obj)
    atomic_write_text(path, text)
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

__all__ = [
    "JsonlError",
    "iter_jsonl",
    "read_jsonl",
    "write_jsonl",
    "atomic_write_text",
    "atomic_write_bytes",
    "atomic_write_json",
    "sha256_file",
]


class JsonlError(ValueError):
    """A malformed JSON Lines record. ``str(err)`` starts with ``"<path>:<line>: "``."""

    def __init__(self, path: str | os.PathLike, line: int, message: str):
        self.path = str(path)
        self.line = line
        self.reason = message
        super().__init__(f"{self.path}:{line}: {message}")


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
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"expected a JSON object, got {type(record).__name__}")
                if validate is not None:
                    validate(record)
            except (ValueError, KeyError, TypeError) as e:
                err = JsonlError(path, lineno, _describe(e))
                if not skip_malformed:
                    raise err from None
                if skipped is not None:
                    skipped.append(str(err))
                continue
            yield lineno, record


def read_jsonl(
    path: str | os.PathLike,
    *,
    validate: Optional[Callable[[dict], Any]] = None,
    skip_malformed: bool = False,
    skipped: Optional[list] = None,
) -> list[dict]:
    """All records of ``path`` as a list of dicts; see :func:`iter_jsonl` for the error rules."""
    return [rec for _, rec in iter_jsonl(path, validate=validate, skip_malformed=skip_malformed, skipped=skipped)]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once: mkstemp creates 0600 files, but outputs should get the permissions open() would give them.
_FILE_MODE = 0o666 & ~_umask()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Writes ``data`` to ``path`` via a temp file in the same folder and ``os.replace`` (atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Leave no temp file behind; the previous version of ``path`` (if any) is untouched.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
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


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2) -> Path:
    """Writes ``obj`` as pretty JSON (UTF-8, trailing newline), atomically."""
    path = Path(path)
    return atomic_write_text(path, _dumps(obj, path, indent=indent) + "\n")


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> Path:
    """Writes one compact JSON object per line (UTF-8, ``\\n`` line ends), atomically."""
    path = Path(path)
    lines = [_dumps(rec, path) + "\n" for rec in records]
    return atomic_write_text(path, "".join(lines))


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of the file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
