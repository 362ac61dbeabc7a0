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
