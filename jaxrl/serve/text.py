"""The texts of single tokens in a response: each token's piece of the decoded text (streaming, `text_offset`)
and each token's own string (log-prob entries), as vLLM writes them."""

from __future__ import annotations

from typing import Sequence


def token_pieces(tokenizer, tokens: Sequence[int], skip_special_tokens: bool = True) -> list[str]:
    """The text each token adds to the decoded sequence, so that "".join(pieces) is the sequence's text (up to
    a trailing incomplete character). vLLM's incremental detokenisation: each token's text is read off a short
    window of the tokens before it; a token that ends inside a multi-byte character adds "" until one completes."""
    tokens = [int(t) for t in tokens]
    out, prefix, read = [], 0, 0
    for k in range(1, len(tokens) + 1):
        before = tokenizer.decode(tokens[prefix:read], skip_special_tokens=skip_special_tokens)
        now = tokenizer.decode(tokens[prefix:k], skip_special_tokens=skip_special_tokens)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            out.append(now[len(before):])
            prefix, read = read, k
        else:
            out.append("")
    return out


def token_strings(tokenizer, tokens: Sequence[int], as_ids: bool = False) -> list[str]:
    """The `token` strings of log-prob entries: each token decoded alone (as vLLM), or "token_id:N"."""
    if as_ids:
        return [f"token_id:{int(t)}" for t in tokens]
    return [tokenizer.decode([int(t)]) for t in tokens]


def clip_pieces(pieces: list[str], text: str) -> list[str]:
    """Per-token pieces trimmed to a completion's final `text` (cut at a stop string); what is missing of it
    (an incomplete character at the end) joins the last piece."""
    out, at = [], 0
    for piece in pieces:
        keep = piece[:max(0, len(text) - at)]
        out.append(keep)
        at += len(keep)
    if at < len(text):
        if out:
            out[-1] += text[at:]
        else:
            out.append(text[at:])
    return out
