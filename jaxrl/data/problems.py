"""The canonical coding-problem schema (``problems.jsonl``), its validation, loading and atomic writing.

One JSON object per line (``docs/reference/interfaces.md``)::

    {"id": str, "messages": [{"role": ..., "content": ...}, ...],
     "test_type": "stdin" | "functional", "fn_name": str | null, "starter_code": str,
     "tests": [{"input": str, "output": str}, ...], "time_limit_s": float | null, "source": str}

plus an optional free-form ``metadata`` object (platform, difficulty, contest_date, ...). Unknown keys are an
error, so a typo ("fn-name") fails loudly instead of silently grading every sample as wrong.

functional tests: ``input`` holds one JSON value per line (one line per positional argument), ``output`` one
JSON value; both are checked to parse at load time.
"""

from __future__ import annotations

import hashlib
import io
import json
import keyword
import logging
import os
from decimal import Decimal
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from jaxrl.utils.io import atomic_write_bytes, iter_json_lines

logger = logging.getLogger(__name__)

TEST_TYPES = ("stdin", "functional")
ROLES = ("system", "user", "assistant")
_REQUIRED = ("id", "messages", "test_type", "tests")
_OPTIONAL = {"fn_name": None, "starter_code": "", "time_limit_s": None, "source": "", "metadata": None}


class ProblemFormatError(ValueError):
    """A record that does not follow the schema; the message names the file and line (or row) and the key."""

    def __init__(self, where: str, key: str | None, message: str):
        self.where, self.key = where, key
        location = f"{where}: " if where else ""
        super().__init__(f"{location}{'key ' + repr(key) + ': ' if key else ''}{message}")


@dataclass(frozen=True)
class TestCase:
    input: str
    output: str

    __test__ = False  # not a pytest test class, despite the name


@dataclass(frozen=True, eq=True)
class Problem:
    id: str
    messages: tuple[Mapping[str, str], ...]
    test_type: str
    tests: tuple[TestCase, ...]
    fn_name: str | None = None
    starter_code: str = ""
    time_limit_s: float | None = None
    source: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)

    __hash__ = None  # type: ignore[assignment]  # messages/metadata are dicts; use .fingerprint as a key

    @property
    def functional(self) -> bool:
        return self.test_type == "functional"

    def to_dict(self) -> dict[str, Any]:
        """The canonical record, keys in the documented order (the manifest hashes depend on it)."""
        record = {
            "id": self.id,
            "messages": [dict(m) for m in self.messages],
            "test_type": self.test_type,
            "fn_name": self.fn_name,
            "starter_code": self.starter_code,
            "tests": [{"input": t.input, "output": t.output} for t in self.tests],
            "time_limit_s": self.time_limit_s,
            "source": self.source,
        }
        if self.metadata:
            record["metadata"] = dict(self.metadata)
        return record

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"))

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the canonical record: equal problems (tests included) share it."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_dict(cls, record: Any, where: str = "") -> "Problem":
        return _parse_problem(record, where)


# ------------------------------------------------------------------------------------------------------------
def _expect(cond: bool, where: str, key: str | None, message: str) -> None:
    if not cond:
        raise ProblemFormatError(where, key, message)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _parse_problem(record: Any, where: str) -> Problem:
    _expect(isinstance(record, Mapping), where, None, f"a problem must be a JSON object, got {_type_name(record)}")
    unknown = sorted(set(record) - set(_REQUIRED) - set(_OPTIONAL))
    allowed = list(_REQUIRED) + list(_OPTIONAL)
    _expect(not unknown, where, unknown[0] if unknown else None,
            f"unknown key(s) {unknown}; allowed: {allowed} (free-form data goes in 'metadata')")
    for key in _REQUIRED:
        _expect(key in record, where, key, "missing")

    pid = record["id"]
    _expect(isinstance(pid, str) and pid.strip() != "", where, "id", f"must be a non-empty string, got {pid!r}")

    messages = record["messages"]
    _expect(isinstance(messages, list) and messages, where, "messages", "must be a non-empty list of messages")
    parsed_messages = []
    for i, message in enumerate(messages):
        key = f"messages[{i}]"
        _expect(isinstance(message, Mapping), where, key, f"must be an object, got {_type_name(message)}")
        _expect(message.get("role") in ROLES, where, f"{key}.role",
                f"must be one of {ROLES}, got {message.get('role')!r}")
        _expect(isinstance(message.get("content"), str), where, f"{key}.content",
                f"must be a string, got {_type_name(message.get('content'))}")
        parsed_messages.append(dict(message))

    test_type = record["test_type"]
    _expect(test_type in TEST_TYPES, where, "test_type", f"must be one of {TEST_TYPES}, got {test_type!r}")

    fn_name = record.get("fn_name")
    if test_type == "functional":
        _expect(isinstance(fn_name, str) and fn_name.isidentifier(), where, "fn_name",
                f"functional problems need a function name (a Python identifier), got {fn_name!r}")
        # a keyword is an identifier no function can have: such a problem could never pass
        _expect(not keyword.iskeyword(fn_name), where, "fn_name",
                f"{fn_name!r} is a Python keyword, which no function can be named; give the function's name")
    else:
        _expect(fn_name in (None, ""), where, "fn_name", f"must be null for stdin problems, got {fn_name!r}")
        fn_name = None

    tests = record["tests"]
    _expect(isinstance(tests, list) and tests, where, "tests", "must be a non-empty list of {input, output}")
    parsed_tests = []
    for i, test in enumerate(tests):
        key = f"tests[{i}]"
        _expect(isinstance(test, Mapping), where, key, f"must be an object, got {_type_name(test)}")
        extra = sorted(set(test) - {"input", "output"})
        _expect(not extra, where, f"{key}.{extra[0]}" if extra else key, "unknown key; a test has 'input' and 'output'")
        for part in ("input", "output"):
            _expect(isinstance(test.get(part), str), where, f"{key}.{part}",
                    f"must be a string, got {_type_name(test.get(part))}")
        if test_type == "functional":
            _check_functional_test(test["input"], test["output"], where, key)
        parsed_tests.append(TestCase(test["input"], test["output"]))

    starter_code = record.get("starter_code", "")
    _expect(isinstance(starter_code, str), where, "starter_code", f"must be a string, got {_type_name(starter_code)}")
    time_limit = record.get("time_limit_s")
    _expect(time_limit is None or (isinstance(time_limit, (int, float)) and not isinstance(time_limit, bool)
                                   and time_limit > 0),
            where, "time_limit_s", f"must be null or a positive number, got {time_limit!r}")
    source = record.get("source", "")
    _expect(isinstance(source, str), where, "source", f"must be a string, got {_type_name(source)}")
    metadata = record.get("metadata") or {}
    if isinstance(metadata, str):  # parquet stores it JSON-encoded (a stable Arrow schema)
        try:
            metadata = json.loads(metadata) if metadata else {}
        except ValueError as exc:
            raise ProblemFormatError(where, "metadata", f"not valid JSON: {exc}") from None
    _expect(isinstance(metadata, Mapping), where, "metadata", f"must be an object, got {_type_name(metadata)}")

    return Problem(id=pid, messages=tuple(parsed_messages), test_type=test_type, tests=tuple(parsed_tests),
                   fn_name=fn_name, starter_code=starter_code,
                   time_limit_s=None if time_limit is None else float(time_limit), source=source,
                   metadata=dict(metadata))


def _parse_json(text: str) -> Any:
    # Integers as Decimal: a 10,000-digit expected value must not trip Python's int-string limit.
    return json.loads(text, parse_int=Decimal)


def _check_functional_test(inp: str, out: str, where: str, key: str) -> None:
    lines = inp.strip("\n").split("\n") if inp.strip() else []
    for n, line in enumerate(lines):
        try:
            _parse_json(line)
        except ValueError as exc:
            raise ProblemFormatError(where, f"{key}.input",
                                     f"line {n + 1} is not one JSON value (functional tests take one JSON argument "
                                     f"per line): {exc}") from None
    try:
        _parse_json(out)
    except ValueError as exc:
        raise ProblemFormatError(where, f"{key}.output", f"not a JSON value: {exc}") from None


# ------------------------------------------------------------------------------------------------------------
@dataclass
class LoadResult:
    problems: list[Problem]
    skipped: list[str] = field(default_factory=list)  # one message per skipped record (file:line: why)


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets  # heavy import: only for parquet

    table = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    for row, record in enumerate(table):
        yield f"{path} row {row}", record


def read_problems(path: str | os.PathLike, skip_malformed: bool = False) -> LoadResult:
    """Validate every record of a problems file (JSONL, JSONL.gz or parquet).

    A malformed record raises ProblemFormatError naming the file and line; with ``skip_malformed`` it is
    skipped and counted instead (``LoadResult.skipped``). Duplicate ids are malformed too.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        records: Iterable[tuple[str, Any]] = _iter_parquet(path)
    else:
        records = ((f"{path}:{lineno}", rec) for lineno, rec in iter_records(path, skip_malformed))
    result = LoadResult(problems=[])
    seen: dict[str, str] = {}
    for where, record in records:
        if isinstance(record, ProblemFormatError):  # a JSON syntax error passed through in lenient mode
            result.skipped.append(str(record))
            continue
        try:
            problem = Problem.from_dict(record, where)
            if problem.id in seen:
                raise ProblemFormatError(where, "id", f"duplicate id {problem.id!r} (first at {seen[problem.id]})")
        except ProblemFormatError as exc:
            if not skip_malformed:
                raise
            result.skipped.append(str(exc))
            continue
        seen[problem.id] = where
        result.problems.append(problem)
    if result.skipped:
        logger.warning("%s: skipped %d malformed record(s); first: %s", path, len(result.skipped), result.skipped[0])
    return result


def iter_records(path: str | os.PathLike, skip_malformed: bool = False) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON) for every non-blank line of a JSONL / JSONL.gz file. A line that is not JSON
    raises ProblemFormatError naming the file and line, or with ``skip_malformed`` comes as that error."""
    for line in iter_json_lines(path):
        if line.error is None:
            yield line.lineno, line.value
            continue
        error = ProblemFormatError(f"{path}:{line.lineno}", None, f"invalid JSON: {line.error}")
        if not skip_malformed:
            raise error from None
        yield line.lineno, error


def load_problems(path: str | os.PathLike, skip_malformed: bool = False) -> list[Problem]:
    """The problems of a JSONL / JSONL.gz / parquet file, validated (see ``read_problems``)."""
    return read_problems(path, skip_malformed).problems


def load_problems_dataset(path: str | os.PathLike, skip_malformed: bool = False):
    """The same problems as a ``datasets.Dataset`` (metadata JSON-encoded, so every row has one Arrow schema)."""
    return problems_to_dataset(load_problems(path, skip_malformed))


def problems_to_dataset(problems: Sequence[Problem]):
    import datasets

    rows = []
    for problem in problems:
        row = problem.to_dict()
        row["metadata"] = json.dumps(row.get("metadata", {}), ensure_ascii=False, sort_keys=True)
        rows.append(row)
    return datasets.Dataset.from_list(rows)


# ------------------------------------------------------------------------------------------------------------
def problems_jsonl_bytes(problems: Iterable[Problem]) -> bytes:
    return "".join(p.to_json() + "\n" for p in problems).encode("utf-8")


def problems_file_bytes(problems: Iterable[Problem], path: str | os.PathLike) -> bytes:
    """The bytes `save_problems` writes to `path` (JSONL, or parquet by suffix)."""
    problems = list(problems)
    if Path(path).suffix == ".parquet":
        buffer = io.BytesIO()
        problems_to_dataset(problems).to_parquet(buffer)
        return buffer.getvalue()
    return problems_jsonl_bytes(problems)


def save_problems(problems: Iterable[Problem], path: str | os.PathLike) -> str:
    """Write problems atomically (JSONL, or parquet by suffix); return the sha256 of the bytes written."""
    data = problems_file_bytes(problems, path)
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def coerce_problem(problem: Problem | Mapping[str, Any], where: str = "") -> Problem:
    """Accept a Problem or a raw record (validated)."""
    return problem if isinstance(problem, Problem) else Problem.from_dict(problem, where)
