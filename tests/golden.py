"""Golden outputs: what the generation engine (and the server over it) produced at fp32 when the comparisons with
the static sampler it replaced still ran, committed once under tests/fixtures/golden/ and compared since.

    golden.check_rows("engine_greedy", out.tokens, out.logprobs, out.finish_reasons)
    golden.check_json("server_answers", answers)          # any JSON; floats within LOGPROB_ATOL

Tokens, finish reasons and every non-float value must be identical; floats (log-probabilities) agree within
LOGPROB_ATOL, the tolerance the engine-vs-static comparisons used (a decode step's attention reads a cache prefix
whose length may differ between two schedules, so a sum may round differently in the last bit).
`JAXRL_WRITE_GOLDEN=1` writes the file instead of comparing (only to record a deliberate change of the samples).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

GOLDEN_DIR = Path(__file__).resolve().parent / "fixtures" / "golden"
LOGPROB_ATOL = 1e-5


def _path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def _write(name: str, value: Any) -> None:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    _path(name).write_text(json.dumps(value, indent=None, separators=(",", ":")) + "\n")


def _compare(got: Any, want: Any, where: str) -> None:
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, (int, float)) and isinstance(want, (int, float)), (where, got, want)
        assert math.isclose(got, want, rel_tol=0.0, abs_tol=LOGPROB_ATOL), (where, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (where, sorted(got), sorted(want))
        for k in want:
            _compare(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            _compare(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def check_json(name: str, value: Any) -> None:
    """`value` (plain JSON) equals the golden `name` (floats within LOGPROB_ATOL)."""
    value = json.loads(json.dumps(value))  # tuples as lists, numpy scalars refused early
    if os.environ.get("JAXRL_WRITE_GOLDEN"):
        _write(name, value)
        return
    path = _path(name)
    assert path.exists(), f"no golden {path}: record it with JAXRL_WRITE_GOLDEN=1"
    _compare(value, json.loads(path.read_text()), name)


def rows(tokens: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], finish_reasons: Sequence[str]
         ) -> list[dict]:
    return [{"tokens": [int(t) for t in toks], "logprobs": [float(x) for x in lps], "finish_reason": str(reason)}
            for toks, lps, reason in zip(tokens, logprobs, finish_reasons)]


def check_rows(name: str, tokens, logprobs, finish_reasons) -> None:
    """Generated rows (prompt-major) equal the golden `name`: tokens and finish reasons identical, log-probs within
    LOGPROB_ATOL."""
    assert len(tokens) == len(logprobs) == len(finish_reasons)
    check_json(name, rows(tokens, logprobs, finish_reasons))


def load(name: str):
    """The golden value `name` (as check_json stored it)."""
    return json.loads(_path(name).read_text())


def keyed_rows(name: str, keys) -> dict:
    """Golden rows stored for samples keyed by (problem id, sample index), in `sorted(keys, key=str)` order, back
    under their keys: {key: {"tokens", "logprobs", "finish_reason"}}."""
    rows = load(name)
    ordered = sorted(keys, key=str)
    assert len(rows) == len(ordered), (name, len(rows), len(ordered))
    return dict(zip(ordered, rows))
