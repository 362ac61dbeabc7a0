"""The order in which a task walks its rows: epoch after epoch, each a seeded permutation of all rows.

    rows = epoch_stream(n, start=step * B, count=B, seed=seed, salt=6121)     # positions start ... start+B-1

Position i lies in epoch i // n at offset i % n; epoch e is `permutation(n)` of a generator seeded by
(seed, e[, salt]). A batch is a pure function of (seed, position), so a resumed run needs only the position.
Fewer rows than one batch is allowed (a smoke run, a tiny data set), with a warning (`warn_if_under_a_batch`):
each step then repeats every row.
"""

from __future__ import annotations

import warnings
from typing import Optional

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
