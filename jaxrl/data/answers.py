"""Finding a short answer in a completion (the reasoning already stripped: jaxrl.rewards.extract.strip_reasoning).

    extract_answer(text, "tag")                   # the last <answer>...</answer>, stripped
    extract_answer(text, "last_line")             # the last non-blank line, stripped
    extract_answer(text, "regex", pattern=r"= (\\d+)")   # the last match (its first group when it has one)
    extract_answer(text, "all")                   # the whole text, stripped

None when there is no answer (no tag, no match, nothing but whitespace): the reward then scores the scorer's
answer to None (0 for every reasoning-gym task) and says why (`reason="no_answer"`).

"tag" is reasoning-gym's own `reasoning_gym.utils.extract_answer` (the same pattern: one optional whitespace
character inside each tag, the last match, stripped), so a score here is the score its own evaluation gives.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["EXTRACTIONS", "check_extraction", "extract_answer", "format_answer"]

EXTRACTIONS = ("tag", "last_line", "regex", "all")


def check_extraction(how: str, tag: str = "answer", pattern: Optional[str] = None) -> None:
    """ValueError unless (`how`, `tag`, `pattern`) describe an extraction (regex needs a pattern that compiles)."""
    if how not in EXTRACTIONS:
        raise ValueError(f"answer extraction {how!r}: choose one of {', '.join(EXTRACTIONS)}")
    if how == "tag" and not re.fullmatch(r"[A-Za-z_][\w-]*", tag or ""):
        raise ValueError(f"answer tag {tag!r} must be a tag name such as 'answer'")
    if how == "regex":
        if not pattern:
            raise ValueError("answer extraction 'regex' needs a pattern")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"answer pattern {pattern!r} does not compile: {e}") from None


def extract_answer(text: str, how: str = "tag", tag: str = "answer", pattern: Optional[str] = None) -> Optional[str]:
    """The answer in `text` by the extraction `how` (module docstring); None when there is none."""
    check_extraction(how, tag, pattern)
    if how == "tag":
        matches = list(re.finditer(f"<{tag}>\\s?(.*?)\\s?</{tag}>", text, flags=re.DOTALL))
        return matches[-1].group(1).strip() if matches else None
    if how == "last_line":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else None
    if how == "regex":
        matches = list(re.finditer(pattern, text, flags=re.DOTALL))
        if not matches:
            return None
        last = matches[-1]
        return (last.group(1) if last.re.groups else last.group(0)).strip()
    return text.strip() or None


def format_answer(answer: str, how: str = "tag", tag: str = "answer") -> str:
    """A completion that `extract_answer(..., how, tag)` reads as `answer`: what supervised warm-up rows train on.
    A regex extraction has no one form; ValueError."""
    check_extraction(how, tag, pattern="." if how == "regex" else None)
    if how == "regex":
        raise ValueError("answer extraction 'regex' has no canonical form to write answers in; choose tag, "
                         "last_line or all")
    return f"<{tag}>{answer}</{tag}>" if how == "tag" else answer
