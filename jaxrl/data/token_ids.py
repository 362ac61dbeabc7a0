"""The text form of token-id completions: what the generation side returns and the rewards score for tasks
without a tokenizer (`jaxrl.rewards.toy.TokenTask`)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["token_text"]


def token_text(tokens: Sequence[int]) -> str:
    """Completion token ids as text ("17 42 1"): what the Reward protocol scores for tokenizer-less tasks."""
    return " ".join(str(int(t)) for t in tokens)
