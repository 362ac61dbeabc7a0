"""The order in which a task walks its rows: epoch after epoch, each a seeded permutation of all rows.

    rows = epoch_stream(n, start=step * B, count=B, seed=seed, salt=6121)     # positions start ... start+B-1

Position i lies in epoch i // n at offset i % n; epoch e is `permutation(n)` of a generator seeded by
(seed, e[, salt]). A batch is a pure function of (seed, position), so a resumed run needs only the position.
Fewer rows than one batch is allowed (a smoke run, a tiny data set), with a warning (`warn_if_under_a_batch`):
each step then repeats every row.
"""

from __future__ import annotations

import json
import warnings
from typing import Iterator, Optional

import numpy as np


def epoch_stream(n: int, start: int, count: int, *, seed: int, salt: Optional[int] = None) -> np.ndarray:
    """int64 [count]: the row indices at positions start ... start + count - 1 of the stream (module docstring)."""
    if n <= 0:
        raise ValueError(f"epoch_stream: no rows to draw from (n={n})")
    out = np.empty(count, np.int64)
    perms: dict[int, np.ndarray] = {}
    for j, i in enumerate(range(start, start + count)):
        epoch, offset = divmod(i, n)
        if epoch not in perms:
            key = [int(seed), epoch] if salt is None else [int(seed), epoch, int(salt)]
            perms[epoch] = np.random.default_rng(key).permutation(n)
        out[j] = perms[epoch][offset]
    return out


def warn_if_under_a_batch(n: int, global_batch: int, what: str, unit: str = "row") -> None:
    """A UserWarning when the `n` rows of `what` (a data file, named as its config key's value) do not fill one
    global batch: the stream then repeats each row about global_batch / n times in every step, which is rarely
    what a run of a mistyped or truncated data set means."""
    if 0 < n < global_batch:
        warnings.warn(f"{what}: {n} training {unit}{'s' if n != 1 else ''} for a global batch of {global_batch} "
                      f"(batch.micro_batch_size x batch.grad_accum): every step repeats each {unit} about "
                      f"{global_batch / n:.3g} times", UserWarning, stacklevel=3)


def token_rows(path: str, *, need_loss_mask: bool = False) -> Iterator[tuple[int, list[int], list[int]]]:
    """(line number, input_ids, loss_mask) of each row of a token JSON Lines file (`{"input_ids": [...],
    "loss_mask": [...]}`, the format of data.source = jsonl and of distill.sft_path); loss_mask defaults to all
    ones unless `need_loss_mask`. A malformed line is a ValueError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                ids = [int(t) for t in record["input_ids"]]
                mask = [int(t) for t in (record["loss_mask"] if need_loss_mask or "loss_mask" in record
                                         else [1] * len(ids))]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                shape = '{"input_ids": [...], "loss_mask": [...]}' if need_loss_mask else '{"input_ids": [int, ...]}'
                raise ValueError(f"{path}:{lineno}: expected {shape}: {e}") from e
            yield lineno, ids, mask
