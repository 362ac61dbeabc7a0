"""Converters from public coding data sets (local files only) to the canonical ``Problem`` schema.

* LiveCodeBench ``code_generation_lite`` records (test*.jsonl or parquet): public tests plus the private tests,
  which are base64 -> zlib -> pickle -> JSON string. Unpickling untrusted data can execute code, so the
  unpickler here refuses every global: only plain values (the JSON string) can come out.
* NVIDIA Nemotron-RL competitive coding / NeMo-Gym ``code_gen`` records: ``verifier_metadata.unit_tests``.
* HumanEval-style records (``prompt``, ``entry_point``, ``test`` with a ``check(candidate)`` function): every
  top-level ``assert candidate(<literals>) == <literal>`` becomes one functional test, so partial credit works.

Each importer yields ``(where, Problem)`` and raises ``ProblemFormatError`` naming the file and line; the
``import_file`` front end can count and skip malformed records instead.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import pickle
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from jaxrl.data.problems import Problem, ProblemFormatError, TestCase, iter_records
from jaxrl.utils.dataclass_flags import flag_field

# LiveCodeBench's own prompt (lcb_runner/prompts/code_generation.py), so scores are comparable with theirs.
LCB_SYSTEM_PROMPT = ("You are an expert Python programmer. You will be given a question (problem specification) "
                     "and will generate a correct Python program that matches the specification and passes all "
                     "tests.")
LCB_FORMAT_STARTER = ("### Format: You will use the following starter code to write the solution to the problem "
                      "and enclose your code within delimiters.\n```python\n{starter_code}\n```\n\n")
LCB_FORMAT_STDIN = ("### Format: Read the inputs from stdin solve the problem and write the answer to stdout (do not "
                    "directly test on the sample inputs). Enclose your code within delimiters as follows. Ensure "
                    "that when the python program runs, it reads the inputs, runs the algorithm and writes output "
                    "to STDOUT.\n```python\n# YOUR CODE HERE\n```\n\n")
LCB_ANSWER = "### Answer: (use the provided format with backticks)\n\n"


# ------------------------------------------------------------------------------------------------------------
# Reading records
def read_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(location, record) for each JSONL line ("file:line") or parquet row ("file row N")."""
    path = Path(path)
    if path.suffix == ".parquet":
        import datasets

        for row, record in enumerate(datasets.Dataset.from_parquet(str(path), keep_in_memory=True)):
            yield f"{path} row {row}", record
        return
    for lineno, record in iter_records(path, skip_malformed=True):
        yield f"{path}:{lineno}", record


def _require(record: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(record, Mapping):
        raise ProblemFormatError(where, None, f"a record must be a JSON object, got {type(record).__name__}")
    if key not in record:
        raise ProblemFormatError(where, key, "missing")
    value = record[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ProblemFormatError(where, key, f"must be {names}, got {type(value).__name__}")
    return value


# ------------------------------------------------------------------------------------------------------------
# LiveCodeBench
class _NoGlobalsUnpickler(pickle.Unpickler):
    """Refuses every class and function: a payload can only rebuild plain strings, numbers and containers."""

    def find_class(self, module: str, name: str):  # noqa: D102
        raise pickle.UnpicklingError(f"refusing global {module}.{name}: test data must be plain values")


def decode_lcb_private_tests(blob: str) -> list[dict]:
    """LiveCodeBench ``private_test_cases``: plain JSON, or base64(zlib(pickle(JSON string)))."""
    try:
        return json.loads(blob)
    except ValueError:
        pass
    payload = _NoGlobalsUnpickler(io.BytesIO(zlib.decompress(base64.b64decode(blob.encode("utf-8"))))).load()
    if isinstance(payload, bytes):
        payload = payload.decode("utf-8")
    if not isinstance(payload, str):
        raise ValueError(f"private tests unpickled to {type(payload).__name__}, expected a JSON string")
    return json.loads(payload)


def encode_lcb_private_tests(tests: list[dict]) -> str:
    """The inverse, for writing fixtures in LiveCodeBench's format."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode("utf-8")


def lcb_messages(question: str, starter_code: str) -> list[dict]:
    user = f"### Question:\n{question}\n\n"
    user += LCB_FORMAT_STARTER.format(starter_code=starter_code) if starter_code else LCB_FORMAT_STDIN
    user += LCB_ANSWER
    return [{"role": "system", "content": LCB_SYSTEM_PROMPT}, {"role": "user", "content": user}]


def lcb_problem(record: Mapping[str, Any], where: str) -> Problem:
    question_id = _require(record, "question_id", str, where)
    question = _require(record, "question_content", str, where)
    starter_code = record.get("starter_code") or ""
    tests: list[dict] = []
    for key in ("public_test_cases", "private_test_cases"):
        raw = record.get(key)
        if raw in (None, ""):
            continue
        try:
            decoded = raw if isinstance(raw, list) else (json.loads(raw) if key == "public_test_cases"
                                                           else decode_lcb_private_tests(raw))
        except (ValueError, zlib.error, pickle.UnpicklingError, EOFError, UnicodeDecodeError) as exc:
            raise ProblemFormatError(where, key, f"cannot decode: {type(exc).__name__}: {exc}") from None
        if not isinstance(decoded, list):
            raise ProblemFormatError(where, key, f"decodes to {type(decoded).__name__}, expected a list of tests")
        tests.extend(decoded)
    metadata_raw = record.get("metadata") or "{}"
    try:
        lcb_meta = json.loads(metadata_raw) if isinstance(metadata_raw, str) else dict(metadata_raw)
    except ValueError as exc:
        raise ProblemFormatError(where, "metadata", f"not valid JSON: {exc}") from None
    fn_name = lcb_meta.get("func_name")
    kinds = {t.get("testtype") for t in tests if isinstance(t, Mapping)}
    test_type = "functional" if fn_name or kinds == {"functional"} else "stdin"
    record_out = {
        "id": f"lcb/{question_id}",
        "messages": lcb_messages(question, starter_code),
        "test_type": test_type,
        "fn_name": fn_name if test_type == "functional" else None,
        "starter_code": starter_code,
        "tests": [{"input": t.get("input"), "output": t.get("output")} if isinstance(t, Mapping) else t
                  for t in tests],
        "time_limit_s": None,
        "source": "livecodebench",
        "metadata": {k: record[k] for k in ("platform", "contest_id", "contest_date", "difficulty",
                                            "question_title") if record.get(k) is not None},
    }
    return Problem.from_dict(record_out, where)


# ------------------------------------------------------------------------------------------------------------
# Nemotron-RL competitive coding / NeMo-Gym code_gen
def _content_text(content: Any) -> str:
    """Responses-API content: a string, or a list of parts with "text"."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, Mapping) else str(part) for part in content)
    raise TypeError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def nemotron_problem(record: Mapping[str, Any], where: str) -> Problem:
    meta = _require(record, "verifier_metadata", Mapping, where)
    unit_tests = _require(meta, "unit_tests", Mapping, where + " (verifier_metadata)")
    inputs = _require(unit_tests, "inputs", list, where + " (verifier_metadata.unit_tests)")
    outputs = _require(unit_tests, "outputs", list, where + " (verifier_metadata.unit_tests)")
    if len(inputs) != len(outputs):
        raise ProblemFormatError(where, "verifier_metadata.unit_tests",
                                 f"{len(inputs)} inputs but {len(outputs)} outputs")
    params = record.get("responses_create_params")
    if isinstance(params, Mapping) and isinstance(params.get("input"), list):
        try:
            messages = [{"role": m["role"], "content": _content_text(m["content"])} for m in params["input"]]
        except (KeyError, TypeError) as exc:
            raise ProblemFormatError(where, "responses_create_params.input", f"bad message: {exc}") from None
    elif isinstance(record.get("question_content"), str):  # Gym's LiveCodeBench rows carry the parts instead
        text = record["question_content"] + (record.get("starter_code") or "")
        if record.get("formatting_message"):
            text += "\n\n" + record["formatting_message"]
        messages = [{"role": "user", "content": text}]
    else:
        raise ProblemFormatError(where, "responses_create_params", "missing (and no question_content either)")
    problem_id = record.get("hash_id") or meta.get("problem_id")
    if not isinstance(problem_id, str) or not problem_id:
        raise ProblemFormatError(where, "hash_id", "missing: a record needs hash_id or verifier_metadata.problem_id")
    fn_name = unit_tests.get("fn_name") or None
    origin = record.get("dataset") or record.get("source") or "competitive_coding"
    return Problem.from_dict({
        "id": f"nemotron/{problem_id}",
        "messages": messages,
        "test_type": "functional" if fn_name else "stdin",
        "fn_name": fn_name,
        "starter_code": record.get("starter_code") or "",
        "tests": [{"input": i, "output": o} for i, o in zip(inputs, outputs)],
        "time_limit_s": None,
        "source": f"nemotron/{origin}",
        "metadata": {k: record[k] for k in ("dataset", "source", "hash_id") if record.get(k) is not None},
    }, where)


# ------------------------------------------------------------------------------------------------------------
# HumanEval
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete function (and any "
                         "imports it needs) in a single ```python code block.\n\n```python\n{prompt}```")


def _literal(node: ast.AST) -> tuple[bool, Any]:
    """(True, value) if the node is a literal that survives a JSON round trip (tuples become lists)."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
    try:
        round_trip = json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return False, None
    return (round_trip == _tuples_as_lists(value) and _same_shape(round_trip, _tuples_as_lists(value))), value


def _tuples_as_lists(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_tuples_as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _tuples_as_lists(v) for k, v in value.items()}
    return value


def _same_shape(a: Any, b: Any) -> bool:
    """Equal values can differ in type (1 == 1.0 == True, {1: x} vs {"1": x}); JSON must keep the types."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return all(_same_shape(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_shape(a[k], b[k]) for k in a)
    return True


def _candidate_call(node: ast.AST, candidate: str) -> tuple[bool, list]:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == candidate
            and not node.keywords):
        return False, []
    args = []
    for arg in node.args:
        ok, value = _literal(arg)
        if not ok:
            return False, []
        args.append(value)
    return True, args


def assert_to_test(test: ast.AST, candidate: str) -> TestCase | None:
    """``candidate(<literals>) == <literal>`` (either side), ``candidate(...)`` or ``not candidate(...)``."""
    expected: Any
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.Is)):
        left, right = test.left, test.comparators[0]
        ok, args = _candidate_call(left, candidate)
        literal_side = right
        if not ok:
            ok, args = _candidate_call(right, candidate)
            literal_side = left
        if not ok:
            return None
        is_literal, expected = _literal(literal_side)
        if not is_literal:
            return None
        if isinstance(test.ops[0], ast.Is) and expected not in (True, False, None):
            return None
    elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        ok, args = _candidate_call(test.operand, candidate)
        if not ok:
            return None
        expected = False
    else:
        ok, args = _candidate_call(test, candidate)
        if not ok:
            return None
        expected = True
    return TestCase(input="\n".join(json.dumps(a) for a in args), output=json.dumps(expected))


@dataclass
class AssertSplit:
    tests: list[TestCase] = field(default_factory=list)
    unconverted: int = 0  # asserts (or statements holding asserts) that are not literal calls


def split_check_function(test_source: str) -> AssertSplit:
    """One functional test per top-level assert of ``def check(candidate)``."""
    tree = ast.parse(test_source)
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None or not check.args.args:
        raise ValueError("no `def check(candidate)` in the test code")
    candidate = check.args.args[0].arg
    split = AssertSplit()
    for stmt in check.body:
        if isinstance(stmt, ast.Assert):
            if isinstance(stmt.test, ast.Constant):  # `assert True, "..."` checks nothing
                continue
            case = assert_to_test(stmt.test, candidate)
            if case is None:
                split.unconverted += 1
            else:
                split.tests.append(case)
        elif any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
            split.unconverted += 1  # asserts inside loops or branches (randomised checks)
    return split


def humaneval_problem(record: Mapping[str, Any], where: str, require_all_asserts: bool = False) -> Problem:
    task_id = _require(record, "task_id", str, where)
    prompt = _require(record, "prompt", str, where)
    entry_point = _require(record, "entry_point", str, where)
    test_source = _require(record, "test", str, where)
    try:
        split = split_check_function(test_source)
    except (SyntaxError, ValueError) as exc:
        raise ProblemFormatError(where, "test", str(exc)) from None
    if not split.tests:
        raise ProblemFormatError(where, "test", "no assert of the form candidate(<literals>) == <literal>")
    if require_all_asserts and split.unconverted:
        raise ProblemFormatError(where, "test", f"{split.unconverted} assert(s) are not literal calls")
    return Problem.from_dict({
        "id": task_id,
        "messages": [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=prompt)}],
        "test_type": "functional",
        "fn_name": entry_point,
        "starter_code": prompt,
        "tests": [{"input": t.input, "output": t.output} for t in split.tests],
        "time_limit_s": None,
        "source": "humaneval",
        "metadata": {"asserts_converted": len(split.tests), "asserts_unconverted": split.unconverted},
    }, where)


# ------------------------------------------------------------------------------------------------------------
IMPORTERS: dict[str, Callable[[Mapping[str, Any], str], Problem]] = {
    "lcb": lcb_problem,
    "nemotron": nemotron_problem,
    "humaneval": humaneval_problem,
    "problems": lambda record, where: Problem.from_dict(record, where),
}


@dataclass(frozen=True)
class ImportSettings:
    """One import (launchers.import_problems; its fields are the launcher's flags, jaxrl.utils.dataclass_flags,
    `format`, `input` and `output` required while absl parses). Its frozen splits: jaxrl.data.splits.SplitSettings."""

    format: str = flag_field(help="Record format of the input files.", choices=sorted(IMPORTERS))
    input: tuple[str, ...] = flag_field(help="Local input files (comma-separated): .jsonl, .jsonl.gz or .parquet.")
    output: str = flag_field(help="Where to write the canonical problems (.jsonl or .parquet).")
    skip_malformed: bool = flag_field(False, help="Skip and count malformed records instead of stopping at the "
                                      "first.")
    limit: Optional[int] = flag_field(None, help="Keep at most this many problems (in input order).")
    overwrite: bool = flag_field(False, help="Allow replacing an --output that holds other problems and frozen "
                                 "splits that would change.")


@dataclass
class ImportResult:
    problems: list[Problem] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "file:line: key ...: why", one per skipped record


def import_file(path: str | Path, fmt: str, skip_malformed: bool = ImportSettings.skip_malformed,
                limit: int | None = ImportSettings.limit, result: ImportResult | None = None) -> ImportResult:
    """Convert one local file. Malformed records raise (naming file and line) unless ``skip_malformed``."""
    if fmt not in IMPORTERS:
        raise ValueError(f"unknown format {fmt!r}; known: {sorted(IMPORTERS)}")
    convert = IMPORTERS[fmt]
    result = result or ImportResult()
    seen = {p.id for p in result.problems}
    for where, record in read_records(path):
        if limit is not None and len(result.problems) >= limit:
            break
        try:
            if isinstance(record, ProblemFormatError):
                raise record
            problem = convert(record, where)
            if problem.id in seen:
                raise ProblemFormatError(where, "id", f"duplicate id {problem.id!r}")
        except ProblemFormatError as exc:
            if not skip_malformed:
                raise
            result.skipped.append(str(exc))
            continue
        seen.add(problem.id)
        result.problems.append(problem)
    return result
