"""Finding the program in a model's completion.

Policy (the issue's): drop the reasoning; a think block left open means there is nothing to run; take the
last *closed* python-tagged fence (```python, ```py, ```python3), else the last closed untagged fence. An
unclosed fence never runs: it is what a truncated generation looks like.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
PYTHON_TAGS = frozenset({"python", "py", "python3"})


@dataclass(frozen=True)
class Extraction:
    code: str | None  # None when there is nothing to run
    reason: str | None = None  # "unclosed_think" | "no_code" when code is None


def strip_reasoning(text: str) -> str | None:
    """The answer part of a completion: what follows the last ``</think>``; None if a think block is open.

    Qwen3 chat templates may put ``<think>`` in the prompt, so a completion can hold ``</think>`` alone.
    """
    close = text.rfind(THINK_CLOSE)
    answer = text[close + len(THINK_CLOSE):] if close >= 0 else text
    if THINK_OPEN in answer:
        return None
    return answer


def closed_fences(text: str) -> list[tuple[str, str]]:
    """Every closed fenced block as (language tag, body), in order. Fences must start a line."""
    blocks: list[tuple[str, str]] = []
    tag: str | None = None
    body: list[str] = []
    for line in text.split("\n"):
        stripped = line.strip()
        if tag is None:
            if stripped.startswith("```"):
                info = stripped[3:].strip().lower()
                tag = info.split()[0] if info else ""
                body = []
        elif stripped.startswith("```") and not stripped.strip("`"):
            blocks.append((tag, "\n".join(body)))
            tag = None
        else:
            body.append(line)
    return blocks


def extract_code(completion: str) -> Extraction:
    answer = strip_reasoning(completion)
    if answer is None:
        return Extraction(None, "unclosed_think")
    blocks = closed_fences(answer)
    for wanted in (lambda t: t in PYTHON_TAGS, lambda t: t == ""):
        for tag, body in reversed(blocks):
            if wanted(tag) and body.strip():
                return Extraction(body + "\n")
    return Extraction(None, "no_code")
