"""The one stable id a problem's random streams derive from.

Every sample of the project is keyed by (seed, problem key, sample index), never by its position in a batch or
file, so a resumed, re-batched or re-sharded run draws the same samples, and two models evaluated on the same
problems share their random streams (common random numbers make paired differences less noisy).
"""

from __future__ import annotations

import zlib


def problem_key(problem_id: str) -> int:
    """The 32-bit key of a problem id (crc32 of its UTF-8 bytes: stable across runs, orderings and machines)."""
    return zlib.crc32(str(problem_id).encode("utf-8"))


def group_keys(problem_ids) -> list[int]:
    """The keys of one batch's prompt groups: each problem's `problem_key`, and a problem drawn again within the
    batch (a rollout that wraps past the end of an epoch, a draw with replacement) keyed apart for each repeat, so
    its groups are independent samples, not copies. A first occurrence keeps its problem's key: batches without
    repeats are keyed as before."""
    seen: dict[str, int] = {}
    keys = []
    for problem_id in problem_ids:
        problem_id = str(problem_id)
        repeat = seen.get(problem_id, 0)
        seen[problem_id] = repeat + 1
        keys.append(problem_key(problem_id if repeat == 0 else f"{problem_id}\x00repeat{repeat}"))
    return keys
