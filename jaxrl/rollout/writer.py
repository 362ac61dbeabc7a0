"""The one resumable JSONL writer, for offline rollouts (rollouts.jsonl) and evaluation caches (cache/<model>.jsonl).

    log = ResumableJsonl(path, settings, compare=("temperature", "seed", ...), what="rollouts")
    existing = log.read()            # [(line number, record)] already on disk; refuses other settings
    ...                              # the caller's own checks of `existing`: nothing was written yet
    log.start()                      # cuts a torn last line, writes the meta file, opens for appending
    log.append(records)              # one group (e.g. one problem's samples): written, flushed and fsync'ed
    log.finish({"samples_written": ...})

Several processes (offline rollouts, evaluation over hosts): each process appends to its own part file, a
ResumableJsonl of the same settings at `part(index, count)` (`<path>.parts/part-<i>-of-<n>.jsonl`); after a
barrier, one process `merge_parts()` into the file itself, which then holds what a single process would have
written:

    mine = log.part(jax.process_index(), jax.process_count())
    done = keys of log.read() + every one of log.parts() (their .read())   # resume: nothing is drawn twice
    mine.start(); mine.append(...); mine.finish(summary)
    barrier(...); if process 0: log.merge_parts(key, order); log.finish(summary)

Crash safety: records are appended whole groups at a time and fsync'ed, so a kill loses at most the group in
flight; a partially written last line is cut off on the next open (and logged), and a group a full disk refused
half-way is cut off at once. `<path>.meta.json` records the
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

from jaxrl.utils.io import JsonlError, ResumeError, append_whole, atomic_write_json, repair_tail

logger = logging.getLogger(__name__)

PARTS = ".parts"  # <path>.parts/: the part files of several processes, until they are merged into <path>


def meta_path_of(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".meta.json")


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
        self._file = open(self.path, "ab", buffering=0)  # unbuffered: append_whole writes whole groups

    def append(self, records: Iterable[Mapping]) -> None:
        """Writes one group of records, whole or not at all (a full disk cuts it back before the error is raised);
        it is on disk (fsync'ed) when this returns."""
        if self._file is None:
            raise RuntimeError(f"{self.path}: append before start()")
        text = "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in records)
        if text:
            append_whole(self._file.fileno(), text.encode("utf-8"), self.path)
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

    # ---------------------------------------------------------------------------------------- several processes
    @property
    def parts_dir(self) -> Path:
        return self.path.with_name(self.path.name + PARTS)

    def _like(self, path: Path) -> "ResumableJsonl":
        return ResumableJsonl(path, self.settings, compare=self.compare, what=self.what, hint=self.hint)

    def part(self, index: int, count: int) -> "ResumableJsonl":
        """The part file of process `index` of `count` (same settings and checks as this file)."""
        return self._like(self.parts_dir / f"part-{index:05d}-of-{count:05d}.jsonl")

    def parts(self) -> list["ResumableJsonl"]:
        """Every part file on disk (of this run or left by an interrupted one, of any process count)."""
        if not self.parts_dir.is_dir():
            return []
        return [self._like(p) for p in sorted(self.parts_dir.glob("part-*.jsonl"))]

    def merge_parts(self, key: Callable[[dict], Any], order: Optional[Callable[[dict], Any]] = None,
                    keep: Optional[Callable[[dict], bool]] = None,
                    validate: Optional[Callable[[dict], None]] = None) -> int:
        """Appends to this file the records of every part file that it lacks, sorted by `order` (default: as
        read), then deletes the parts; returns how many were appended. Leaves the file open (call `finish`).

        key(record): the identity of a record (e.g. (problem_id, sample_index)); the first one of a key wins.
        keep(record): only records it accepts count, in this file and in the parts (e.g. drawn for the current
        version of their problem). Call on one process, after every process finished its part: a kill during
        the merge loses nothing (the parts stay until the merged records are on disk, and a rerun appends only
        what is still missing)."""
        keep = keep or (lambda record: True)
        have = {key(r) for _, r in self.read(validate) if keep(r)}
        new: dict = {}
        parts = self.parts()
        for part in parts:
            for _, record in part.read(validate):
                k = key(record)
                if keep(record) and k not in have and k not in new:
                    new[k] = record
        records = list(new.values())
        if order is not None:
            records.sort(key=order)
        self.start()
        self.append(records)
        for part in parts:
            part.path.unlink()
            part.meta_path.unlink(missing_ok=True)
        if parts and not any(self.parts_dir.iterdir()):
            self.parts_dir.rmdir()
        return len(records)

    def __enter__(self) -> "ResumableJsonl":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
