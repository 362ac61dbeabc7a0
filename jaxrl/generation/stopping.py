"""The one stopping rule, as vLLM's `check_stop` is one function: when a row ends, why, and what of it is returned.

Device side (inside the engine's decode loop, `running_after`): a row ends when its new token is one of its stop ids
(finish_reason "stop"; the id is kept in its tokens) or when it has generated its cap (finish_reason "length").
A row's cap is its max_new_tokens, which the caller bounds by the model length: `max_tokens_within` says how
many tokens the context leaves after a prompt (the server's cap of a request that names none).

Host side (`StopRule`, what a client sees): the stop ids a row runs with (EOS unless ignored, the requested ids,
and every stop string that is one token), stop strings matched on the decoded text and cut there (the string
left out unless asked for), the `stop_reason` (the string, or a requested id that is not an EOS id), and the
text of a completion (`completion_text`: the final stop id dropped, special tokens skipped), and how much of a
running row's text is sure to be in its answer (`StopRule.sure_length`: what a stream may send before the row
ends, as vLLM's detokenizer holds back what could still be a stop string). Clients read the same rule back
(`with_stop_token`: a server that drops the stop token from `token_ids` gets it back, so a completion's length
counts it on every backend).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxrl.data.token_ids import token_text

__all__ = ["Finished", "StopRule", "completion_text", "hits_stop", "max_tokens_within", "running_after",
           "with_stop_token"]


# ---------------------------------------------------------------------------------------------------------------
# Device side


def hits_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """tokens [B] against stop_ids [B, W] (each row's, padded with -1) -> [B] bool: the token is a stop id."""
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


def running_after(running: jax.Array, token: jax.Array, stop_ids: jax.Array, generated: jax.Array,
                  cap: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(still running, ended on a stop id now) of rows that were `running` and just produced `token` as their
    `generated`-th token (counted from 1), with caps `cap`: the rule of the module docstring."""
    hit = running & hits_stop(token, stop_ids)
    return running & ~hit & (generated < cap), hit


def max_tokens_within(model_len: int, prompt_len: int) -> int:
    """The most tokens a completion of a `prompt_len`-token prompt may have in a context of `model_len`."""
    return max(int(model_len) - int(prompt_len), 0)


# ---------------------------------------------------------------------------------------------------------------
# Host side


def completion_text(tokenizer: Any, tokens: Sequence[int], stop_ids) -> str:
    """The text of one completion: the final token dropped when it is a stop id (EOS / <|im_end|>: not part of the
    answer), special tokens skipped; `<think>` / `</think>` stay (ordinary added tokens in Qwen3.5 tokenizers).
    tokenizer None (token-id tasks): the ids joined by spaces ("17 42 9")."""
    body = list(tokens)
    if body and body[-1] in stop_ids:
        body = body[:-1]
    if tokenizer is None:
        return token_text(body)
    return tokenizer.decode(body, skip_special_tokens=True)


def with_stop_token(tokens: list[int], finish_reason: str, stop_reason: Any, stop_ids: Sequence[int]
                    ) -> tuple[list[int], bool]:
    """A server's completion read back by the rule: (tokens ending with the stop id when it ended on one, whether
    the id was put back). Both vLLM and the JAX server keep it; a server that drops it gets it back here (its
    log-probability is then unknown)."""
    if finish_reason != "stop" or (tokens and tokens[-1] in stop_ids):
        return tokens, False
    stop = stop_reason if isinstance(stop_reason, int) else (tuple(stop_ids) or (None,))[0]
    if stop is None:
        return tokens, False
    return tokens + [int(stop)], True


@dataclasses.dataclass
class Finished:
    """A row as the client sees it: its tokens (cut at a stop string), their sampled log-probs, the text,
    finish_reason "stop" | "length" and stop_reason (None, a stop id, or a stop string)."""

    tokens: list
    logprobs: list
    text: str
    finish_reason: str
    stop_reason: Any


@dataclasses.dataclass(frozen=True)
class StopRule:
    """The stopping of one request (module docstring). Built by `of_request`; `finish` applies it to a row."""

    stop_ids: tuple  # sorted: the ids a row ends on in the engine
    requested_ids: frozenset  # stop_token_ids as requested
    eos_ids: frozenset
    strings: tuple  # stop strings, matched on the decoded text
    one_token: dict  # {id: stop string} of stop strings that are one token (rows also end on those ids)
    include_stop_str: bool = False

    @classmethod
    def of_request(cls, tokenizer, *, eos_ids: Sequence[int], stop_token_ids: Sequence[int] = (),
                   strings: Sequence[str] = (), ignore_eos: bool = False, default_ids: Sequence[int] = (),
                   include_stop_str: bool = False) -> "StopRule":
        """default_ids: ids every row of the endpoint ends on (chat: <|im_end|>)."""
        one_token: dict = {}
        for s in strings:
            ids = tokenizer(s, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                one_token.setdefault(int(ids[0]), s)
        stop = set(int(t) for t in stop_token_ids) | set(int(t) for t in default_ids) | set(one_token)
        if not ignore_eos:
            stop |= set(int(t) for t in eos_ids)
        return cls(tuple(sorted(stop)), frozenset(int(t) for t in stop_token_ids),
                   frozenset(int(t) for t in eos_ids), tuple(strings), one_token, bool(include_stop_str))

    def finish(self, tokenizer, tokens: Sequence[int], logprobs: Sequence[float], finish_reason: str,
               skip_special_tokens: bool = True) -> Finished:
        """A row the engine finished, as the client sees it: stop strings cut on the decoded text, the text."""
        tokens, lps = list(tokens), list(logprobs)
        ended_on = tokens[-1] if finish_reason == "stop" and tokens and tokens[-1] in self.stop_ids else None
        body = tokens[:-1] if ended_on is not None else tokens
        text = tokenizer.decode(body, skip_special_tokens=skip_special_tokens)
        cut = self.cut_at_string(tokenizer, body, text, skip_special_tokens) if self.strings else None
        if cut is not None:
            tokens, text, string = cut
            return Finished(tokens, lps[:len(tokens)], text, "stop", string)
        stop_reason = None
        if ended_on is not None and ended_on in self.one_token and ended_on not in self.requested_ids:
            stop_reason = self.one_token[ended_on]
            if self.include_stop_str:
                text += stop_reason
        elif ended_on is not None and ended_on in self.requested_ids and ended_on not in self.eos_ids:
            stop_reason = ended_on
        return Finished(tokens, lps, text, finish_reason, stop_reason)

    def sure_length(self, text: str) -> int:
        """How many leading characters of a running row's decoded `text` are sure to be in its answer, whatever it
        samples next (a stream sends no more): up to the first stop string the text holds (`cut_at_string` cuts
        there; whether the string itself is sent is decided once the row ends), else all but the last len(longest
        stop string) - 1 characters, which could still be the start of one. Negative when the text is shorter than
        that: not even an empty piece is sure then."""
        found = [text.find(s) for s in self.strings if s in text]
        if found:
            return min(found)
        longest = max((len(s) for s in self.strings), default=0)
        return len(text) - max(longest - 1, 0)

    def cut_at_string(self, tokenizer, tokens: list[int], text: str, skip_special_tokens: bool
                      ) -> Optional[tuple[list[int], str, str]]:
        """(tokens, text, the stop string) of a completion cut at the first occurrence of any stop string in its
        decoded `text` (the text before it, or through it with include_stop_str; the tokens up to the one that
        completes it), or None when none occurs."""
        found = [(text.find(s), s) for s in self.strings if s in text]
        if not found:
            return None
        at, stop = min(found, key=lambda x: (x[0], -len(x[1])))
        end = at + len(stop)
        lo, hi = 1, len(tokens)  # the shortest token prefix whose text reaches `end` (binary search: texts grow)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tokenizer.decode(tokens[:mid], skip_special_tokens=skip_special_tokens)) >= end:
                hi = mid
            else:
                lo = mid + 1
        return tokens[:lo], text[:end] if self.include_stop_str else text[:at], stop
