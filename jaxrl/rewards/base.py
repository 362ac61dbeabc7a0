"""What every reward returns, the protocol rewards follow, and the shared handling of truncated completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Protocol, Sequence, runtime_checkable

TestStatus = Literal["pass", "wrong", "timeout", "error", "output_limit", "memory"]
TEST_STATUSES: tuple[str, ...] = ("pass", "wrong", "timeout", "error", "output_limit", "memory")
TruncationPolicy = Literal["zero", "mask"]


@dataclass
class RewardResult:
    """The score of one completion.

    ``partial`` is the fraction of the problem's tests passed, ``strict`` whether all passed. ``reason`` says
    why nothing ran ("truncated", "no_code", "unclosed_think", "syntax_error", ...), None when tests ran.
    ``masked`` marks a truncated completion under the "mask" policy: trainers drop it from the loss instead of
    learning from a 0. ``isolation`` names the sandbox that produced the score (empty for non-code rewards).
    """

    partial: float
    strict: bool
    tests: list[str] = field(default_factory=list)
    reason: str | None = None
    masked: bool = False
    isolation: str = ""
    detail: str | None = None  # a short hint for humans: the first failing test's error, if any

    def to_dict(self) -> dict[str, Any]:
        return {"partial": self.partial, "strict": self.strict, "tests": list(self.tests),
                "reason": self.reason, "masked": self.masked, "isolation": self.isolation,
                "detail": self.detail}

    @classmethod
    def from_tests(cls, tests: Sequence[str], **kwargs: Any) -> "RewardResult":
        passed = sum(status == "pass" for status in tests)
        total = len(tests)
        return cls(partial=passed / total if total else 0.0, strict=total > 0 and passed == total,
                   tests=list(tests), **kwargs)

    @classmethod
    def nothing_ran(cls, reason: str, n_tests: int = 0, status: str = "error", **kwargs: Any) -> "RewardResult":
        return cls(partial=0.0, strict=False, tests=[status] * n_tests, reason=reason, **kwargs)


@runtime_checkable
class Reward(Protocol):
    """Anything that scores a batch: ``completions[i]`` answers ``problems[i]``."""

    def score(self, completions: Sequence[str], problems: Sequence[Any],
              truncated: Sequence[bool | str] | None = None) -> list[RewardResult]: ...


def close_reward(reward: Any) -> None:
    """Frees what a reward holds (the code verifier: its sandbox pool). `close` is optional in the protocol (a
    plug-in reward may hold nothing): the one place that asks whether a reward has it."""
    close = getattr(reward, "close", None)
    if close is not None:
        close()


def normalize_truncated(truncated: Sequence[bool | str] | None, n: int) -> list[bool]:
    """Accept booleans or rollout finish reasons ("length" means truncated, "stop" does not)."""
    if truncated is None:
        return [False] * n
    if len(truncated) != n:
        raise ValueError(f"truncated has {len(truncated)} entries for {n} completions")
    flags = []
    for i, value in enumerate(truncated):
        if isinstance(value, str):
            if value not in ("length", "stop"):
                raise ValueError(f"truncated[{i}]: finish reason must be 'length' or 'stop', got {value!r}")
            flags.append(value == "length")
        else:
            flags.append(bool(value))
    return flags


def truncated_result(policy: TruncationPolicy, n_tests: int = 0, **kwargs: Any) -> RewardResult:
    """A completion cut off at the token limit scores 0 whatever it contains, or is masked from the loss."""
    if policy not in ("zero", "mask"):
        raise ValueError(f"truncation policy must be 'zero' or 'mask', got {policy!r}")
    return RewardResult(partial=0.0, strict=False, tests=[], reason="truncated", masked=policy == "mask",
                        **kwargs)


def problem_field(problem: Any, name: str, default: Any = None) -> Any:
    """Read a field from a mapping or an object alike (problems come as dicts or dataclasses)."""
    if isinstance(problem, Mapping):
        return problem.get(name, default)
    return getattr(problem, name, default)


def check_batch(completions: Sequence[str], problems: Sequence[Any]) -> None:
    if len(completions) != len(problems):
        raise ValueError(f"{len(completions)} completions for {len(problems)} problems: lists must match")
