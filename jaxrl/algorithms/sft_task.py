"""`algorithm = "sft"`: next-token training (tests, benchmarks, and supervised warm-up runs).

Data (`config.data`):
  * `source = "synthetic"`: deterministic token sequences, a function of (seed, step) only, so any step's batch
    can be rebuilt after a restart without saved state. Each row is an arithmetic progression modulo the vocab
    (learnable: the loss falls), left-padded by a random amount on about half of the rows so masks matter.
  * `source = "jsonl"`: `data.path`, one `{"input_ids": [...], "loss_mask": [...] (optional)}` per line; rows
    are cut / right-padded to `data.seq_len`; the order is reshuffled every epoch from (seed, epoch).
Both are indexed by the step, so the data position is the number of rows consumed (kept in checkpoints).

`data.pack`: the step's rows (the same rows as unpacked) have their real tokens laid end to end, first-fit, in
as many rows at the shortest of the lengths seq_len x {1/4, 3/8, 1/2, 5/8, 3/4, 1} (rounded up to 64, or to
seq_len / 8 when smaller) that holds them all (jaxrl.data.packing; at most six compiled steps). The objective's
loss is a sum over target tokens with a global count, so which micro-batch a sequence lands in does not matter,
and every token's log-prob is that of its padded row (`NextToken`, `segment_ids`). The host metric `fill_ratio`
(real tokens / row tokens) is logged every step, packed or not.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from jaxrl.data import packing
from jaxrl.data.stream import epoch_stream, token_rows, warn_if_under_a_batch
from jaxrl.train.objective import NextToken
from jaxrl.train.task import Task
from jaxrl.algorithms.config import TrainConfig


# Packed row lengths are multiples of this (of seq_len / 8 when that is smaller, so short test rows still get a
# ladder of lengths).
PACK_MULTIPLE = 64


def pack_token_rows(batch: dict[str, np.ndarray], lengths, pad_id: int) -> dict[str, np.ndarray]:
    """The real tokens (attention_mask 1) of each row of `batch` (input_ids, attention_mask, optional loss_mask
    [B, T]) packed into B rows at the shortest of `lengths` that holds them (module docstring): input_ids,
    attention_mask, segment_ids (and loss_mask) [B, L]."""
    mask = np.asarray(batch["attention_mask"]) != 0
    extra = [k for k in ("loss_mask",) if k in batch]
    seqs = [{"input_ids": batch["input_ids"][r][mask[r]], **{k: batch[k][r][mask[r]] for k in extra}}
            for r in range(mask.shape[0])]
    row_len, (rows,) = packing.plan([[len(x["input_ids"]) for x in seqs]], mask.shape[0], lengths)
    out = packing.pack_rows(seqs, rows, row_len, pad_id)
    return {k: out[k] for k in ("input_ids", "attention_mask", "segment_ids", *extra)}


def synthetic_batch(step: int, *, batch_size: int, seq_len: int, vocab_size: int, seed: int,
                    pad_id: int = 0, min_token: int = 2) -> dict[str, np.ndarray]:
    """{"input_ids": int32 [B, T], "attention_mask": int32 [B, T]} for `step`; tokens in [min_token, vocab)."""
    rng = np.random.default_rng([int(seed), int(step), 7919])
    span = vocab_size - min_token
    if span <= 1:
        raise ValueError(f"vocab_size={vocab_size} is too small for synthetic data")
    start = rng.integers(0, span, size=(batch_size, 1))
    stride = rng.integers(1, 8, size=(batch_size, 1))
    ids = (min_token + (start + stride * np.arange(seq_len)[None, :]) % span).astype(np.int32)
    mask = np.ones((batch_size, seq_len), np.int32)
    pads = np.where(rng.random(batch_size) < 0.5, rng.integers(0, max(1, seq_len // 4) + 1, size=batch_size), 0)
    for row, n in enumerate(pads):
        if n:
            ids[row] = np.concatenate([np.full(n, pad_id, np.int32), ids[row, :seq_len - n]])
            mask[row, :n] = 0
    return {"input_ids": ids, "attention_mask": mask}


class JsonlTokens:
    """Token rows from a JSON Lines file, reshuffled each epoch (see the module docstring)."""

    def __init__(self, path: str, seq_len: int, seed: int, pad_id: int = 0):
        self.seq_len, self.seed = seq_len, seed
        ids, loss, lengths = [], [], []
        cut = 0
        for lineno, full_ids, full_mask in token_rows(path):
            row = full_ids[:seq_len]
            lm = full_mask[:seq_len]
            if len(lm) != len(row):
                raise ValueError(f"{path}:{lineno}: loss_mask has {len(lm)} entries, input_ids {len(row)}")
            if len(full_ids) > seq_len:
                cut += 1
                if any(full_mask) and not any(lm):
                    # a row that would train on nothing: say so instead of a silent zero loss
                    raise ValueError(f"{path}:{lineno}: every target token lies beyond data.seq_len={seq_len} "
                                     f"(the row has {len(full_mask)} tokens); raise data.seq_len")
            lengths.append(len(row))
            ids.append(row + [pad_id] * (seq_len - len(row)))
            loss.append(lm + [0] * (seq_len - len(lm)))
        if not ids:
            raise ValueError(f"{path}: no rows")
        if cut:
            logging.warning("%s: %d of %d rows are longer than data.seq_len=%d and are cut", path, cut, len(ids),
                            seq_len)
        self.rows_cut = cut
        self.ids = np.asarray(ids, np.int32)
        self.loss_mask = np.asarray(loss, np.int32)
        self.attention_mask = (np.arange(seq_len)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)

    def rows(self, start: int, count: int) -> dict[str, np.ndarray]:
        index = epoch_stream(len(self.ids), start, count, seed=self.seed)
        return {"input_ids": self.ids[index], "attention_mask": self.attention_mask[index],
                "loss_mask": self.loss_mask[index]}


class SFTTask(Task):
    """Next-token objective over synthetic or JSON Lines token data."""

    def __init__(self, config: TrainConfig, vocab_size: int, pad_id: int = 0):
        data = config.data
        self.objective = NextToken(chunk_size=config.logprob_chunk_size)
        self.global_batch = config.batch.global_batch
        self.seq_len = data.seq_len
        self.seed = config.seed
        self.vocab_size, self.pad_id = vocab_size, pad_id
        self.position = 0
        multiple = max(1, min(PACK_MULTIPLE, self.seq_len // 8))
        self.pack_lengths = packing.row_lengths(self.seq_len, multiple) if data.pack else None
        if data.source == "synthetic":
            self.source: Optional[JsonlTokens] = None
        elif data.source == "jsonl":
            if not data.path:
                raise ValueError("data.source='jsonl' needs data.path")
            self.source = JsonlTokens(data.path, self.seq_len, self.seed, pad_id)
            warn_if_under_a_batch(len(self.source.ids), self.global_batch, f"data.path={data.path}")
        else:
            raise ValueError(f"data.source={data.source!r}; choose 'synthetic' or 'jsonl'")

    def batch(self, step: int) -> tuple[dict[str, np.ndarray], dict]:
        self.position = (step + 1) * self.global_batch
        if self.source is None:
            out = synthetic_batch(step, batch_size=self.global_batch, seq_len=self.seq_len,
                                  vocab_size=self.vocab_size, seed=self.seed, pad_id=self.pad_id)
        else:
            out = self.source.rows(step * self.global_batch, self.global_batch)
        if self.pack_lengths is not None:
            out = pack_token_rows(out, self.pack_lengths, self.pad_id)
        return out, {"fill_ratio": packing.fill_ratio(out["attention_mask"])}

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state.get("position", 0))


def build_sft(config: TrainConfig, model, mesh) -> SFTTask:
    pad = model.config.pad_token_id
    return SFTTask(config, vocab_size=model.config.vocab_size, pad_id=0 if pad is None else int(pad))
