"""Comparing a program's output with the expected output, in the verifier's own process.

stdin tests follow LiveCodeBench's grade_stdio: strip the whole output, split into lines and strip each; the
line counts must match; each line is equal as a string or, failing that, as a list of whitespace-separated
Decimal tokens (exact numeric equality: "1.0" equals "1", no epsilon).

functional tests compare JSON values: the child already encoded its result (so no object of the program's
reaches this process); tuples arrived as lists. Integers decode as Decimal so a 10,000-digit result neither
hits Python's int-string limit nor loses precision; Decimal equals the int or float of the same value.
"""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation


def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimal_tokens(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(token) for token in line.split()]
    except (InvalidOperation, ValueError):
        return None


def stdout_matches(actual: str, expected: str) -> bool:
    actual_lines, expected_lines = _stripped_lines(actual), _stripped_lines(expected)
    if len(actual_lines) != len(expected_lines):
        return False
    for got, want in zip(actual_lines, expected_lines):
        if got == want:
            continue
        got_numbers, want_numbers = _decimal_tokens(got), _decimal_tokens(want)
        if got_numbers is None or want_numbers is None:
            return False
        try:
            if got_numbers != want_numbers:
                return False
        except InvalidOperation:  # signalling NaN tokens refuse comparison: not equal
            return False
    return True


def decode_json_value(text: str):
    """JSON as the comparison sees it: integers as Decimal (no digit limit), everything else as json does."""
    return json.loads(text, parse_int=Decimal)


def functional_matches(actual_json: str, expected_json: str) -> bool:
    try:
        actual = decode_json_value(actual_json)
    except ValueError:
        return False
    try:
        return bool(actual == decode_json_value(expected_json))
    except InvalidOperation:
        return False
