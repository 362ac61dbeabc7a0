"""One episode of two models side by side (the report's generation diffs, for evaluations over episodes): the
same problem and sample index (the same keys, so the same environment draw), each turn's answer and the
environment's reply, in a row per turn.

    view = episode_side_by_side(samples["base"], samples["step_28"])   # None without episode samples
    view["turns"][t] == {"a": text | None, "b": text | None, "obs_a": [..], "obs_b": [..]}
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

__all__ = ["episode_side_by_side"]


def episode_side_by_side(samples_a: Sequence[Mapping], samples_b: Sequence[Mapping]) -> Optional[dict]:
    """The first sample (in file order) whose episode reward differs between the models, else the first shared
    one; None when the samples carry no episodes (single completions)."""
    b_by_key = {(r["problem_id"], r["sample_index"]): r for r in samples_b if r.get("episode")}
    shared = [(a, b_by_key[(a["problem_id"], a["sample_index"])]) for a in samples_a
              if a.get("episode") and (a["problem_id"], a["sample_index"]) in b_by_key]
    if not shared:
        return None
    a, b = next(((a, b) for a, b in shared if a["partial"] != b["partial"]), shared[0])
    ea, eb = a["episode"], b["episode"]

    def at(e: Mapping, key: str, t: int):
        seq = e.get(key) or []
        return seq[t] if t < len(seq) else None

    turns = [{"a": at(ea, "texts", t), "b": at(eb, "texts", t), "obs_a": at(ea, "observations", t),
              "obs_b": at(eb, "observations", t), "reward_a": at(ea, "rewards", t), "reward_b": at(eb, "rewards", t)}
             for t in range(max(ea["turns"], eb["turns"]))]
    return {"problem_id": a["problem_id"], "sample_index": a["sample_index"], "partial_a": a["partial"],
            "partial_b": b["partial"], "solved_a": ea["solved"], "solved_b": eb["solved"], "turns": turns}
