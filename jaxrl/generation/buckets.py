"""The static sizes the engine's programs are compiled for: prompt widths, generation caps, slot counts, scoring
lengths. A value is rounded up to the smallest bucket that holds it (`pick_bucket`), so many distinct prompt
lengths, max_tokens values and row counts share a handful of programs and the resident memory stays flat.
"""

from __future__ import annotations

from typing import Sequence

MIN_PROMPT_BUCKET = 32
MIN_GENERATION_BUCKET = 16
MIN_SCORE_BUCKET = 32


def _ladder(lo: int, hi: int, factor: int) -> tuple[int, ...]:
    """lo, lo * factor, ... below hi, and hi itself."""
    out, b = [], min(lo, hi)
    while b < hi:
        out.append(b)
        b *= factor
    return tuple(out + [int(hi)])


def prompt_buckets(max_prompt_len: int) -> tuple[int, ...]:
    """32, 64, 128, ... below max_prompt_len, and max_prompt_len itself."""
    return _ladder(MIN_PROMPT_BUCKET, int(max_prompt_len), 2)


def generation_buckets(max_model_len: int) -> tuple[int, ...]:
    """16, 64, 256, ... (x4) below max_model_len, and max_model_len itself: a request's max_tokens is rounded up to
    one (its row still ends at its own max_tokens)."""
    return _ladder(MIN_GENERATION_BUCKET, int(max_model_len), 4)


def length_buckets(max_len: int) -> tuple[int, ...]:
    """32, 64, 128, ... below max_len, and max_len itself (the scoring program's sequence lengths)."""
    return _ladder(MIN_SCORE_BUCKET, int(max_len), 2)


def batch_buckets(batch_size: int, multiple: int = 1) -> tuple[int, ...]:
    """batch_size, batch_size / 4, batch_size / 16, ... while they are whole multiples of `multiple` (the
    data-parallel size): the slot counts a call of fewer rows runs at. Every size is a set of compiled programs,
    while a padded slot costs little where decode is bound by reading the weights (accelerators), so the ladder
    is coarse: a call runs padded by at most 4x (or up to the smallest bucket)."""
    if batch_size % multiple:
        raise ValueError(f"batch_size {batch_size} must be a multiple of the data-parallel size {multiple}")
    out, b = [batch_size], batch_size
    while b % 4 == 0 and (b // 4) % multiple == 0:
        b //= 4
        out.append(b)
    return tuple(sorted(out))


def pick_bucket(value: int, buckets: Sequence[int], what: str) -> int:
    """The smallest bucket >= value; ValueError naming `what` when none holds it."""
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"{what} {value} exceeds the largest bucket {max(buckets)}")
