"""How hard each prompt is for the policy, kept for the whole run, and the curriculum that reads it.

Per prompt (problem id) of an online run: the samples drawn, their reward sum, the last rollout that drew it, and
the mean rewards of its last `window` groups. A prompt whose last `window` groups all had a mean reward >= `solved`
is too easy, all <= `failed` too hard (such a group has no reward variance: GRPO learns nothing from it), else
learnable. The state is JSON in the task's state (saved with every checkpoint; floats round-trip exactly), so a
resumed run continues with the same numbers, and each rollout logs the pool as a histogram:
`difficulty/{too_easy,learnable,too_hard,unseen}` (prompts of the pool) and `difficulty/set_aside`.

The curriculum (`data.sampler='curriculum'`, prime-rl's difficulty pools and online filtering): a prompt found too
easy or too hard is set aside for `set_aside` rollouts and then revisited; rollout prompts are taken in order from
the epoch stream of the pool (a cursor kept in the state), skipping those set aside (when every prompt is, the
ones due back soonest are taken). Dynamic sampling's extra draws are unchanged; every drawn group is recorded.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import numpy as np

from jaxrl.data.stream import epoch_stream

TOO_EASY, LEARNABLE, TOO_HARD = "too_easy", "learnable", "too_hard"


class Difficulty:
    """The per-prompt record and the curriculum's rule (module docstring)."""

    def __init__(self, *, window: int = 1, set_aside: int = 8, solved: float = 1.0, failed: float = 0.0):
        self.window, self.set_aside, self.solved, self.failed = int(window), int(set_aside), solved, failed
        self.prompts: dict[str, dict] = {}  # id -> {"samples", "reward_sum", "last_rollout", "recent", "back_at"}
        self.cursor = 0  # the curriculum's position in the pool's epoch stream
        self._lock = threading.Lock()  # rollouts sampled ahead record from the producer's thread

    # the record -----------------------------------------------------------------------------------------------
    def record(self, rollout: int, problem_ids: Sequence[str], rewards: np.ndarray, group: int) -> None:
        """Rows prompt-major in groups of `group` (a prompt's samples); NaN rewards (masked) are left out."""
        rewards = np.asarray(rewards, np.float64).reshape(-1, group)
        with self._lock:
            for j, row in enumerate(rewards):
                scored = row[~np.isnan(row)]
                p = self.prompts.setdefault(str(problem_ids[j * group]), {
                    "samples": 0, "reward_sum": 0.0, "last_rollout": -1, "recent": [], "back_at": -1})
                p["last_rollout"] = int(rollout)
                if not scored.size:
                    continue
                p["samples"] += int(scored.size)
                p["reward_sum"] += float(scored.sum())
                p["recent"] = (p["recent"] + [float(scored.mean())])[-self.window:]
                if self.kind(p) != LEARNABLE:
                    p["back_at"] = int(rollout) + 1 + self.set_aside

    def kind(self, p: dict) -> Optional[str]:
        """too_easy | learnable | too_hard of a prompt's record (None: not scored yet)."""
        recent = p["recent"]
        if not recent:
            return None
        if len(recent) >= self.window and all(m >= self.solved for m in recent):
            return TOO_EASY
        if len(recent) >= self.window and all(m <= self.failed for m in recent):
            return TOO_HARD
        return LEARNABLE

    def metrics(self, rollout: int, pool: Sequence[str]) -> dict[str, float]:
        """The histogram over the pool's prompts after `rollout`."""
        counts = {TOO_EASY: 0, LEARNABLE: 0, TOO_HARD: 0, "unseen": 0}
        aside = 0
        with self._lock:
            for pid in pool:
                p = self.prompts.get(pid)
                kind = None if p is None else self.kind(p)
                counts[kind or "unseen"] += 1
                aside += int(p is not None and p["back_at"] > rollout + 1)
        return {**{f"difficulty/{k}": float(v) for k, v in counts.items()}, "difficulty/set_aside": float(aside)}

    # the curriculum -------------------------------------------------------------------------------------------
    def draw(self, rollout: int, pool: Sequence[str], count: int, *, seed: int, salt: int) -> np.ndarray:
        """`count` pool indices for rollout `rollout`: the next ones of the epoch stream not set aside."""
        n = len(pool)
        out: list[int] = []
        skipped: list[tuple[int, int, int]] = []  # (back_at, stream position, index)
        with self._lock:
            position = self.cursor
            # two laps of the stream hold every prompt at least once (a lap may straddle two epochs' orders)
            while len(out) < count and position < self.cursor + 2 * n:
                i = int(epoch_stream(n, position, 1, seed=seed, salt=salt)[0])
                p = self.prompts.get(pool[i])
                if p is not None and p["back_at"] > rollout and i not in out:
                    skipped.append((p["back_at"], position, i))
                elif i not in out:
                    out.append(i)
                position += 1
            self.cursor = position
            for _, _, i in sorted(skipped):  # every prompt set aside: the ones due back soonest
                if len(out) == count:
                    break
                out.append(i)
        return np.asarray(out[:count] + [out[k % len(out)] for k in range(count - len(out))], np.int64)

    # the state --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        with self._lock:
            return {"cursor": self.cursor, "prompts": {k: dict(v, recent=list(v["recent"]))
                                                       for k, v in self.prompts.items()}}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not state:
            return
        with self._lock:
            self.cursor = int(state["cursor"])
            self.prompts = {k: dict(v, recent=list(v["recent"])) for k, v in state["prompts"].items()}
