"""The one resumable JSONL writer, for offline rollouts (rollouts.jsonl) and evaluation caches (cache/<model>.jsonl).

    log = ResumableJsonl(path, settings, compare=("temperature", "seed", ...), what="rollouts")
    existing = log.read()            # [(line number, record)] already on disk; refuses other settings
    ...                              # the caller's own checks of `existing`: nothing was written yet
    log.start()                      # cuts a torn last line, writes the meta file, opens for appending
    log.append(records)              # one group (e.g. one problem's samples): written, flushed and fsync'ed
    log.finish({"samples_written": ...})

Crash safety: records are appended whole groups at a time and fsync'ed, so a kill loses at most the group in
flight; a partially written last line is cut off on the next open (and logged). `<path>.meta.json` records the
settings the records were drawn with (`{"settings": ..., "status": "running" | "complete", ...summary}`); opening
with a different value of any `compare` key is refused with ResumeError naming each key as `key: old -> new`,
because mixing samples of different settings would corrupt every statistic computed from the file. A records file
without its meta file is refused too (its settings are unknown).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from jaxrl.utils.io import JsonlError, atomic_write_json

logger = logging.getLogger(__name__)


class ResumeError(ValueError):
    """An existing output this run cannot continue (other settings, foreign or duplicate records)."""


def meta_path_of(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".meta.json")


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
        pos, block, keep = size, 1 << 16, 0
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


def settings_diff(old: Mapping[str, Any], new: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    """`key: old -> new` for every key of `keys` whose values differ."""
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


class ResumableJsonl:
    """See the module docstring. `what` names the file's role in error messages ("rollouts", "samples")."""

    def __init__(self, path: str | os.PathLike, settings: Mapping[str, Any], *, compare: Sequence[str],
                 what: str = "records", hint: str = "write to another output, or delete the file to start over"):
        self.path = Path(path)
        self.meta_path = meta_path_of(self.path)
        self.settings, self.compare, self.what, self.hint = dict(settings), tuple(compare), what, hint
        self._file = None

    def check(self) -> None:
        """Refuses (ResumeError) an existing file of other settings or of unknown settings; writes nothing."""
        if not self.meta_path.exists():
            if self.path.exists() and self.path.stat().st_size > 0:
                raise ResumeError(f"{self.path} exists but {self.meta_path.name} does not, so the settings of its "
                                  f"{self.what} are unknown; move it away or delete it to start over")
            return
        with open(self.meta_path, encoding="utf-8") as f:
            old = json.load(f).get("settings", {})
        diffs = settings_diff(old, self.settings, self.compare)
        if diffs:
            raise ResumeError(f"{self.path} holds {self.what} drawn with other settings ({'; '.join(diffs)}); "
                              f"mixing them would corrupt the statistics: resume with the same settings, or "
                              f"{self.hint}")

    def read(self, validate: Optional[Callable[[dict], None]] = None) -> list[tuple[int, dict]]:
        """Checks the settings and returns the complete records on disk as (line number, record); changes nothing
        (a torn last line is left out here and cut off by `start`)."""
        self.check()
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]
        out = []
        for lineno, line in enumerate(complete.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"expected a JSON object, got {type(record).__name__}")
                if validate is not None:
                    validate(record)
            except json.JSONDecodeError as e:
                raise JsonlError(self.path, lineno, f"invalid JSON ({e.msg} at column {e.colno})") from None
            except (ValueError, KeyError, TypeError) as e:
                raise JsonlError(self.path, lineno, str(e) if not isinstance(e, KeyError) else
                                 f"missing key {e.args[0]!r}") from None
            out.append((lineno, record))
        return out

    def start(self) -> None:
        """Cuts a torn last line, records the settings (status "running") and opens the file for appending: call
        after every check of the run passed, so a refused run leaves the files as they were."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        removed = repair_tail(self.path)
        if removed:
            logger.warning("%s: removed a partially written last line (%d bytes)", self.path, removed)
        atomic_write_json(self.meta_path, {"settings": self.settings, "status": "running"})
        self._file = open(self.path, "a", encoding="utf-8")

    def append(self, records: Iterable[Mapping]) -> None:
        """Writes one group of records; it is on disk (fsync'ed) when this returns."""
        if self._file is None:
            raise RuntimeError(f"{self.path}: append before start()")
        text = "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in records)
        if text:
            self._file.write(text)
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self, summary: Optional[Mapping[str, Any]] = None) -> dict:
        """Closes the file and records the settings with status "complete" (+ `summary`) in the meta file."""
        self.close()
        meta = {"settings": self.settings, "status": "complete", **(summary or {})}
        atomic_write_json(self.meta_path, meta)
        return meta

    def __enter__(self) -> "ResumableJsonl":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
