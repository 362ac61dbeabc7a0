"""Packed rows: several sequences laid end to end in one row, instead of one sequence per row padded to the
longest (issue 31). Real throughput is the accelerator's utilisation times the fill ratio (real tokens / row
tokens); with the pair builder's length spread a padded DPO batch is mostly padding.

    lengths = row_lengths(widest=2 * 1024, multiple=64)          # the fixed set of row lengths a run may use
    row_len, rows = plan([[310, 95, 402, 388], ...], rows=2, lengths=lengths)   # per group, first-fit decreasing
    arrays = pack_rows(sequences, rows, row_len, pad_id)          # input_ids, attention_mask, segment_ids, ...

Shapes: every row of a run has one of the lengths `row_lengths` gives, ROW_FRACTIONS of the widest row (each
rounded up to `multiple`), so a run compiles its train step at most len(ROW_FRACTIONS) times; a batch takes the
shortest length at which every group fits its rows. With the default pad multiple the set for a widest row W is
{W/4, 3W/8, W/2, 5W/8, 3W/4, W} (rounded up to 64): a ladder about 1.2-1.5x apart, so the chosen length wastes
at most a few tenths of a row to rounding up, and six compiles at most.

Packing: first-fit decreasing (longest sequence first, each into the first row with room), which for bins
filled to about 80% or less places everything the optimum would in almost every case, and is a few
microseconds per sequence in Python. A group is the set of sequences that must share rows: DPO packs each
micro-batch's pairs into that micro-batch's rows (a pair's two log-probs meet in one loss term), SFT packs a whole
step's rows together (its loss is a sum over tokens).

Row layout (all [rows, row_len] int32): `segment_ids` numbers the sequences of a row 1, 2, ... in order, 0 on
the padding at the row's end; `attention_mask` is 1 on real tokens; any other per-token array of a sequence
(`loss_mask`) is copied beside its tokens; `sequence_index` holds the caller's index of the sequence (0 on
padding), so per-sequence sums can be gathered back (`jax.ops.segment_sum`). The model computes each sequence as
if it were alone in a row (`Qwen35.hidden_states(segment_ids=...)`), so its log-probs are those of the padded
layout up to float rounding.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

# Row lengths as fractions of the widest row (module docstring).
ROW_FRACTIONS = (1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 1)


def row_lengths(widest: int, multiple: int = 64) -> tuple[int, ...]:
    """The fixed set of row lengths: ROW_FRACTIONS of `widest`, each rounded up to `multiple` and capped at
    `widest` (itself in the set), ascending, without repeats."""
    if widest < 1 or multiple < 1:
        raise ValueError(f"row_lengths: widest={widest} and multiple={multiple} must be >= 1")
    out = {min(widest, -(-int(np.ceil(f * widest)) // multiple) * multiple) for f in ROW_FRACTIONS}
    return tuple(sorted(out | {widest}))


def first_fit(lengths: Sequence[int], rows: int, row_len: int) -> Optional[list[list[int]]]:
    """First-fit decreasing: the indices of `lengths` placed into `rows` rows of `row_len` tokens (each row's
    indices in placement order), or None when they do not all fit. Ties keep the given order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    free = [row_len] * rows
    placed: list[list[int]] = [[] for _ in range(rows)]
    for i in order:
        n = lengths[i]
        for r in range(rows):
            if free[r] >= n:
                free[r] -= n
                placed[r].append(i)
                break
        else:
            return None
    return placed


def plan(groups: Sequence[Sequence[int]], rows: int, lengths: Sequence[int]
         ) -> tuple[int, list[list[list[int]]]]:
    """(row length, per group its rows' sequence indices): the shortest of `lengths` at which every group's
    sequences (their token counts, `groups[g]`) fit into `rows` rows by `first_fit`."""
    for row_len in sorted(lengths):
        placed = [first_fit(group, rows, row_len) for group in groups]
        if all(p is not None for p in placed):
            return row_len, placed
    longest = max((max(g) for g in groups if len(g)), default=0)
    raise ValueError(f"packing: the sequences of a group do not fit into {rows} rows of {max(lengths)} tokens "
                     f"(longest sequence {longest})")


def pack_rows(sequences: Sequence[Mapping[str, np.ndarray]], rows: Sequence[Sequence[int]], row_len: int,
              pad_id: int = 0, index: Optional[Sequence[int]] = None) -> dict[str, np.ndarray]:
    """Lays `sequences` (each {"input_ids": [n], other per-token arrays: [n]}) out as packed rows: row r holds
    sequences rows[r] in that order (module docstring). index: the `sequence_index` of each sequence (default
    its position in `sequences`)."""
    keys = [k for k in sequences[0] if k != "input_ids"] if sequences else []
    out = {"input_ids": np.full((len(rows), row_len), pad_id, np.int32)}
    for k in ("attention_mask", "segment_ids", "sequence_index", *keys):
        out[k] = np.zeros((len(rows), row_len), np.int32)
    for r, members in enumerate(rows):
        pos = 0
        for number, i in enumerate(members, 1):
            seq = sequences[i]
            n = len(seq["input_ids"])
            if pos + n > row_len:
                raise ValueError(f"pack_rows: row {r} overflows its {row_len} tokens")
            span = slice(pos, pos + n)
            out["input_ids"][r, span] = seq["input_ids"]
            out["attention_mask"][r, span] = 1
            out["segment_ids"][r, span] = number
            out["sequence_index"][r, span] = i if index is None else index[i]
            for k in keys:
                out[k][r, span] = seq[k]
            pos += n
    return out


def fill_ratio(attention_mask: np.ndarray) -> float:
    """Real tokens / row tokens of a batch."""
    mask = np.asarray(attention_mask)
    return float(np.count_nonzero(mask)) / max(1, mask.size)
