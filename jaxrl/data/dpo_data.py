"""DPO sequences: preference pairs -> fixed-shape token arrays with completion-only loss masks.

    enc = tokenize_pairs(pairs, tokenizer, enable_thinking=False)          # text pairs (pairs.jsonl records)
    enc = pretokenized_pairs(records)                                      # or {"prompt_ids", "chosen_ids", ...}
    data = build_sequences(enc, SequenceConfig(max_length=2560, overlong="truncate_prompt"))
    data.arrays["chosen_input_ids"]   # [N, T] int32, and *_attention_mask, *_loss_mask; rejected_* likewise
    data.stats                        # what the length policy did (written to <workdir>/data_stats.json)

A sequence is `chat-templated prompt + completion tokens + turn end`:

* prompt: `format_chat(tokenizer, messages, enable_thinking, add_generation_prompt=True)`, i.e. the exact text
  the completion was sampled after (Qwen3.5: `<|im_start|>assistant\\n<think>\\n` with thinking on);
* completion: the completion text tokenised on its own (no special tokens added; prompt and completion are
  tokenised separately, as TRL does, so the prompt tokens are the ones the sampler saw);
* turn end: `<|im_end|>` is appended to a completion that *stopped*, and is part of the loss, so when to stop
  is learnt too. A completion that hit the generation cap (`*_finish_reason == "length"`) gets no end token:
  teaching the model to stop where a cap cut it would be wrong.

`loss_mask` is 1 on completion (+ end) tokens only; prompt and padding are 0. Padding is on the right with
`pad_id`, and `T` is one bucket for the whole data set (the longest kept sequence rounded up to
`pad_multiple`, capped at `max_length`), so a training step compiles once.

Length policy (`max_length` bounds prompt + completion; `max_prompt_length`, if set, bounds the prompt alone):
a completion is never cut. `overlong="truncate_prompt"` drops prompt tokens from the LEFT (the start of the
conversation; the generation prompt at its end stays) down to what fits, keeping at least `min_prompt_tokens`,
and drops the pair when even that does not fit; `overlong="drop"` drops every pair that does not fit as it is.
Both sides of a pair share one prompt, so the longer completion decides. `stats` counts each outcome.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from jaxrl.data.chat import format_chat
from jaxrl.data.pairs import pair_id as make_pair_id

OVERLONG_POLICIES = ("truncate_prompt", "drop")
SIDES = ("chosen", "rejected")
ARRAY_KEYS = tuple(f"{s}_{k}" for s in SIDES for k in ("input_ids", "attention_mask", "loss_mask"))
TURN_END = "<|im_end|>"


@dataclasses.dataclass(frozen=True)
class EncodedPair:
    """One pair as token ids, before the length policy."""

    pair_id: str
    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]  # completion tokens (+ the turn-end token when it stopped)
    rejected_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SequenceConfig:
    max_length: int = 2048  # prompt + completion tokens of one sequence
    max_prompt_length: Optional[int] = None  # None: only max_length bounds the prompt
    overlong: str = "truncate_prompt"  # truncate_prompt | drop
    min_prompt_tokens: int = 1  # truncate_prompt keeps at least this many prompt tokens
    pad_multiple: int = 64  # T = longest kept sequence rounded up to this (capped at max_length)
    pad_id: int = 0

    def __post_init__(self):
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"data.overlong={self.overlong!r}; choose one of {OVERLONG_POLICIES}")
        if self.max_length < 2:
            raise ValueError(f"data.max_length={self.max_length} must be >= 2 (a prompt token and a completion "
                             "token)")
        if self.min_prompt_tokens < 1:
            # The first token of a sequence is never predicted: a completion needs a prompt token before it.
            raise ValueError(f"data.min_prompt_tokens={self.min_prompt_tokens} must be >= 1")
        if self.max_prompt_length is not None and self.max_prompt_length < self.min_prompt_tokens:
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length} is below "
                             f"data.min_prompt_tokens={self.min_prompt_tokens}")
        if self.pad_multiple < 1:
            raise ValueError(f"data.pad_multiple={self.pad_multiple} must be >= 1")


@dataclasses.dataclass
class PairSequences:
    """The kept pairs as arrays (row i = pair `pair_ids[i]`) and what the length policy did."""

    arrays: dict[str, np.ndarray]  # ARRAY_KEYS -> [N, T] int32
    pair_ids: list[str]
    stats: dict[str, Any]

    def __len__(self) -> int:
        return len(self.pair_ids)

    def subset(self, index: Sequence[int]) -> "PairSequences":
        index = np.asarray(index, np.int64)
        return PairSequences({k: v[index] for k, v in self.arrays.items()}, [self.pair_ids[i] for i in index],
                             dict(self.stats))

    def digest(self) -> str:
        """sha256 over the pair ids and every array: identical exactly when the model inputs are identical."""
        h = hashlib.sha256()
        h.update("\n".join(self.pair_ids).encode())
        for k in ARRAY_KEYS:
            a = np.ascontiguousarray(self.arrays[k], np.int32)
            h.update(f"{k}{a.shape}".encode())
            h.update(a.tobytes())
        return h.hexdigest()


# ------------------------------------------------------------------------------------------------- encoding


def _ids(value, what: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{what} must be a list of token ids, got {type(value).__name__}")
    out = tuple(int(t) for t in value)
    if any(t < 0 for t in out):
        raise ValueError(f"{what} holds a negative token id")
    return out


def pretokenized_pairs(records: Sequence[Mapping], where: str = "pairs") -> list[EncodedPair]:
    """Records `{"prompt_ids", "chosen_ids", "rejected_ids", "pair_id" (optional)}` used verbatim (no end token
    is added: include it in `chosen_ids` / `rejected_ids` if it should be learnt)."""
    out = []
    for i, rec in enumerate(records):
        label = f"{where} record {i}"
        try:
            out.append(EncodedPair(str(rec.get("pair_id", i)), _ids(rec["prompt_ids"], "prompt_ids"),
                                   _ids(rec["chosen_ids"], "chosen_ids"), _ids(rec["rejected_ids"], "rejected_ids")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{label}: expected {{\"prompt_ids\", \"chosen_ids\", \"rejected_ids\"}} lists of token "
                             f"ids: {type(e).__name__}: {e}") from e
    return out


def is_pretokenized(record: Mapping) -> bool:
    return "prompt_ids" in record and "chosen_ids" in record


def turn_end_id(tokenizer) -> int:
    vocab = tokenizer.get_vocab()
    if TURN_END not in vocab:
        raise ValueError(f"the tokenizer has no {TURN_END} token; it is needed to end completions")
    return int(vocab[TURN_END])


def tokenize_pairs(pairs: Sequence[Mapping], tokenizer, enable_thinking: bool,
                   messages_by_problem: Optional[Mapping[str, list]] = None,
                   format_fn: Optional[Callable] = None) -> list[EncodedPair]:
    """Text pairs (pairs.jsonl records) -> token ids. `messages_by_problem` supplies the prompt of pairs whose
    `messages` is null (a problems.jsonl, `data.problems`). Prompts of the same problem are tokenised once."""
    if format_fn is None:
        format_fn = format_chat
    end = turn_end_id(tokenizer)
    cache: dict[str, tuple[int, ...]] = {}
    out = []
    for i, p in enumerate(pairs):
        pid = str(p.get("pair_id") or make_pair_id(p["problem_id"], p["chosen"], p["rejected"]))
        messages = p.get("messages")
        if messages is None:
            messages = (messages_by_problem or {}).get(str(p["problem_id"]))
            if messages is None:
                raise ValueError(f"pair {pid} (record {i}, problem {p['problem_id']!r}) has no messages; set "
                                 "data.problems to the problems.jsonl holding its prompt")
        key = repr(messages)
        if key not in cache:
            cache[key] = tuple(format_fn(tokenizer, messages, enable_thinking, add_generation_prompt=True))
        sides = []
        for side in SIDES:
            ids = list(tokenizer(p[side], add_special_tokens=False)["input_ids"])
            if p.get(f"{side}_finish_reason") != "length":
                ids.append(end)
            sides.append(tuple(ids))
        out.append(EncodedPair(pid, cache[key], sides[0], sides[1]))
    return out


# ------------------------------------------------------------------------------------------------- length policy


def apply_length_policy(pair: EncodedPair, cfg: SequenceConfig) -> tuple[Optional[tuple[int, ...]], str]:
    """(the prompt to use or None when the pair is dropped, outcome). Outcomes: kept, prompt_truncated,
    dropped_overlong, dropped_completion_overlong (truncate_prompt: the completion leaves less than
    min_prompt_tokens), dropped_empty (an empty prompt or completion)."""
    prompt = pair.prompt_ids
    longest = max(len(pair.chosen_ids), len(pair.rejected_ids))
    if not prompt or not pair.chosen_ids or not pair.rejected_ids:
        return None, "dropped_empty"
    budget = cfg.max_length - longest
    if cfg.max_prompt_length is not None:
        budget = min(budget, cfg.max_prompt_length)
    if len(prompt) <= budget:
        return prompt, "kept"
    if cfg.overlong == "drop":
        return None, "dropped_overlong"
    if budget < cfg.min_prompt_tokens:
        return None, "dropped_completion_overlong"
    return prompt[len(prompt) - budget:], "prompt_truncated"


def _summary(values: Sequence[int]) -> Optional[dict]:
    if not values:
        return None
    v = np.asarray(values, np.float64)
    return {"mean": float(v.mean()), "min": int(v.min()), "p50": float(np.percentile(v, 50)),
            "p95": float(np.percentile(v, 95)), "max": int(v.max())}


def build_sequences(pairs: Sequence[EncodedPair], cfg: SequenceConfig) -> PairSequences:
    """Applies the length policy and lays the kept pairs out as right-padded [N, T] arrays (module docstring)."""
    counts = {k: 0 for k in ("kept", "prompt_truncated", "dropped_overlong", "dropped_completion_overlong",
                             "dropped_empty")}
    kept: list[tuple[EncodedPair, tuple[int, ...]]] = []
    tokens_cut = 0
    dropped_ids: dict[str, list[str]] = {}
    for pair in pairs:
        prompt, outcome = apply_length_policy(pair, cfg)
        if prompt is None:
            counts[outcome] += 1
            dropped_ids.setdefault(outcome, []).append(pair.pair_id)
            continue
        counts["kept"] += 1
        if outcome == "prompt_truncated":
            counts["prompt_truncated"] += 1
            tokens_cut += len(pair.prompt_ids) - len(prompt)
        kept.append((pair, prompt))
    if not kept:
        raise ValueError(f"no pair survives the length policy (data.max_length={cfg.max_length}, "
                         f"data.overlong={cfg.overlong!r}): {counts}")
    longest = max(len(p) + max(len(e.chosen_ids), len(e.rejected_ids)) for e, p in kept)
    seq_len = min(cfg.max_length, -(-longest // cfg.pad_multiple) * cfg.pad_multiple)
    n = len(kept)
    arrays = {k: np.zeros((n, seq_len), np.int32) for k in ARRAY_KEYS}
    for side in SIDES:
        arrays[f"{side}_input_ids"][:] = cfg.pad_id
    lengths = {s: [] for s in SIDES}
    for row, (pair, prompt) in enumerate(kept):
        for side in SIDES:
            completion = getattr(pair, f"{side}_ids")
            ids = prompt + completion
            arrays[f"{side}_input_ids"][row, :len(ids)] = ids
            arrays[f"{side}_attention_mask"][row, :len(ids)] = 1
            arrays[f"{side}_loss_mask"][row, len(prompt):len(ids)] = 1
            lengths[side].append(len(completion))
    stats = {
        "input_pairs": len(pairs), **counts,
        "dropped": len(pairs) - counts["kept"],
        "prompt_tokens_cut": tokens_cut,
        "max_length": cfg.max_length, "max_prompt_length": cfg.max_prompt_length, "overlong": cfg.overlong,
        "min_prompt_tokens": cfg.min_prompt_tokens, "seq_len": seq_len, "longest_sequence": longest,
        "prompt_tokens": _summary([len(p) for _, p in kept]),
        "chosen_tokens": _summary(lengths["chosen"]), "rejected_tokens": _summary(lengths["rejected"]),
        "padding_fraction": float(1.0 - (arrays["chosen_attention_mask"].sum()
                                         + arrays["rejected_attention_mask"].sum()) / (2.0 * n * seq_len)),
        "dropped_pair_ids": dropped_ids,
    }
    return PairSequences(arrays, [e.pair_id for e, _ in kept], stats)


def format_stats(stats: Mapping) -> str:
    """One line for the log."""
    return (f"{stats['input_pairs']} pairs: {stats['kept']} kept ({stats['prompt_truncated']} with the prompt cut "
            f"from the left, {stats['prompt_tokens_cut']} prompt tokens removed), {stats['dropped_overlong']} "
            f"dropped as over-long, {stats['dropped_completion_overlong']} dropped because the completion alone "
            f"exceeds max_length - min_prompt_tokens, {stats['dropped_empty']} dropped as empty; "
            f"sequence length {stats['seq_len']} (longest {stats['longest_sequence']}, max_length "
            f"{stats['max_length']}, overlong={stats['overlong']!r})")


def split_eval(pair_ids: Sequence[str], fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, eval rows): the round(fraction * N) pairs with the smallest sha256(f"{seed}:eval:{id}") are
    held out -- a seeded choice that depends on neither file order nor N's other members."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"data.eval_fraction={fraction} must be in [0, 1)")
    n = len(pair_ids)
    n_eval = int(round(fraction * n))
    if fraction > 0 and n_eval == 0:
        n_eval = 1
    if n_eval >= n:
        raise ValueError(f"data.eval_fraction={fraction} leaves no training pair out of {n}")
    order = sorted(range(n), key=lambda i: hashlib.sha256(f"{seed}:eval:{pair_ids[i]}".encode()).hexdigest())
    eval_rows = np.sort(np.asarray(order[:n_eval], np.int64))
    train_rows = np.setdiff1d(np.arange(n), eval_rows)
    return train_rows, eval_rows


# ------------------------------------------------------------------------------------------------- synthetic


def synthetic_pairs(n: int, vocab_size: int, seed: int, prompt_len: int = 6, completion_len: int = 4,
                    eos_id: int = 1, min_token: int = 2, strides: Sequence[int] = (1,),
                    num_tokens: Optional[int] = None) -> list[dict]:
    """Pre-tokenised pairs with a learnable preference (tests, the tiny config, the benchmark).

    prompt = an arithmetic progression (start random, stride from `strides`) modulo the token range
    [min_token, min_token + num_tokens) (default: up to vocab_size); chosen = its next `completion_len` terms +
    eos; rejected = `completion_len` random tokens of the same range that each break the progression + eos, so
    only the order, not the choice of tokens, tells them apart. A pure function of its arguments.
    """
    span = vocab_size - min_token if num_tokens is None else int(num_tokens)
    if span < 4 or min_token + span > vocab_size:
        raise ValueError(f"synthetic pairs need 4 <= num_tokens <= vocab_size - min_token; got num_tokens={span}, "
                         f"vocab_size={vocab_size}")
    rng = np.random.default_rng([int(seed), 4099])
    out = []
    for i in range(n):
        start = int(rng.integers(0, span))
        stride = int(strides[int(rng.integers(0, len(strides)))])
        seq = [min_token + (start + stride * t) % span for t in range(prompt_len + completion_len)]
        rejected = []
        for t in range(completion_len):
            tok = int(rng.integers(min_token, min_token + span))
            while tok == seq[prompt_len + t]:
                tok = int(rng.integers(min_token, min_token + span))
            rejected.append(tok)
        out.append({"pair_id": f"syn{seed}-{i}", "prompt_ids": seq[:prompt_len],
                    "chosen_ids": seq[prompt_len:] + [eos_id], "rejected_ids": rejected + [eos_id]})
    return out
