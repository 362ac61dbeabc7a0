"""Evaluation over multi-turn episodes (launchers.evaluate --environment=NAME --max_turns=T): each of a problem's
samples is an episode sampled by the training's EpisodeRunner (jaxrl/environments/runner.py) through the
evaluation backend, written as one SAMPLES record with its turns, and summarised as solved-within-t.

    stream = EpisodeStream(runner)                  # Collector.stream's signature: what SamplingLoop draws with
    rec = episode_record(sample.episode, ...)       # a SAMPLES record + "episode": texts, rewards, turns, ...
    summary = episode_summary(records, max_turns)   # results.json models[name]["episodes"]

A record's `partial` is the episode's reward clipped to [0, 1] (an environment's turn cost can make it negative,
and the comparisons of results.json are over [0, 1] rewards; the raw sum is `episode.reward`), `strict` is the
episode's `solved` (code_feedback: the strict verifier pass on the hidden tests; otherwise the environment's
`solved`, or a reward >= 1), `completion` the last turn's text, `completion_tokens` the sampled tokens of every
turn, `finish_reason` "length" when the episode was truncated (a turn hit the cap, or the token budget cut it).
An episode whose environment raised keeps `partial` 0 and `strict` false, its error in `reason`.

solved within t: the fraction of episodes solved by turn t (`episode.solved_turn` <= t: the turn from which the
episode stayed solved), for t = 1..T, in the T-turn episodes; non-decreasing in t, its value at T the strict rate.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

from jaxrl.environments.runner import Episode, EpisodeRunner
from jaxrl.evaluation.stats import mean_interval

__all__ = ["EpisodeSample", "EpisodeStream", "episode_markdown", "episode_record", "episode_summary"]


@dataclasses.dataclass
class EpisodeSample:
    """An episode as the sampling loop sees a sample (prompt_index, sample_index, tokens, truncated)."""

    prompt_index: int
    sample_index: int
    episode: Episode

    @property
    def tokens(self) -> list[int]:  # the sampled tokens (the loop's tokens/s counts what the model generated)
        return [t for t, m in zip(self.episode.ids, self.episode.mask) if m]

    @property
    def truncated(self) -> bool:
        return bool(self.episode.truncated)


class EpisodeStream:
    """`Collector.stream` for episodes: `chunk` problems at a time through the runner; `wanted` filters what is
    kept (a problem's K episodes are sampled together: their first turn is one prompt x K samples)."""

    def __init__(self, runner: EpisodeRunner):
        self.runner = runner

    def __call__(self, prompts: Sequence[Sequence[int]], group_ids: Sequence[int], problems: Sequence[Any],
                 sampling, *, chunk: int, wanted=None):
        for b in range(0, len(problems), chunk):
            episodes = self.runner.run(problems[b:b + chunk], group_ids[b:b + chunk], sampling)
            yield b, [EpisodeSample(b + e.problem_index, e.sample_index, e) for e in episodes
                      if wanted is None or wanted(b + e.problem_index, e.sample_index)]


def episode_record(e: Episode, problem_id: str, *, max_new_tokens: int, problem_fingerprint: str) -> dict:
    """The SAMPLES record of episode `e` (module docstring)."""
    reward = e.reward if math.isfinite(e.reward) else 0.0
    sampled = sum(e.mask)
    return {"problem_id": problem_id, "sample_index": e.sample_index,
            "completion": e.texts[-1] if e.texts else "", "completion_tokens": sampled,
            "finish_reason": "length" if e.truncated else "stop", "partial": min(1.0, max(0.0, float(reward))),
            "strict": bool(e.solved) and e.error is None, "tests": [], "reason": e.error,
            "max_new_tokens": int(max_new_tokens), "prompt_tokens": len(e.prompt_ids),
            "problem_fingerprint": problem_fingerprint,
            "episode": {"turns": e.turns, "texts": list(e.texts), "rewards": list(e.rewards),
                        "observations": [[m["content"] for m in obs] for obs in e.observations],
                        "reward": None if not math.isfinite(e.reward) else float(e.reward),
                        "solved": bool(e.solved) and e.error is None,
                        "solved_turn": e.solved_turn if e.error is None else None,
                        "tokens": len(e.ids), "sampled_tokens": sampled, "done": bool(e.done),
                        "truncated": bool(e.truncated), "error": e.error}}


def _mean(values: Sequence[float]) -> Optional[float]:
    return float(sum(values) / len(values)) if values else None


def episode_summary(records: Sequence[Mapping], max_turns: int, confidence: float = 0.95) -> dict:
    """results.json models[name]["episodes"]: solved within t for t = 1..max_turns, turns and tokens per episode,
    each with its sample size (episodes); solved within t also with an interval over prompts (per prompt first,
    like every rate of results.json)."""
    eps = [(str(r["problem_id"]), r["episode"]) for r in records]
    n = len(eps)
    by_prompt: dict[str, list[dict]] = {}
    for pid, e in eps:
        by_prompt.setdefault(pid, []).append(e)
    within = {}
    for t in range(1, int(max_turns) + 1):
        solved = sum(1 for _, e in eps if e["solved_turn"] is not None and e["solved_turn"] <= t)
        per_prompt = [sum(e["solved_turn"] is not None and e["solved_turn"] <= t for e in es) / len(es)
                      for es in by_prompt.values()]
        ci = mean_interval(per_prompt, confidence)
        within[str(t)] = {"rate": solved / n if n else None, "solved": solved, "n": n,
                          "ci": [ci["ci_low"], ci["ci_high"]]}
    return {"max_turns": int(max_turns), "n_episodes": n, "n_prompts": len(by_prompt),
            "solved_within": within,
            "turns_mean": {"mean": _mean([e["turns"] for _, e in eps]), "n": n},
            "tokens_mean": {"mean": _mean([e["tokens"] for _, e in eps]), "n": n},
            "sampled_tokens_mean": {"mean": _mean([e["sampled_tokens"] for _, e in eps]), "n": n},
            "truncated": sum(bool(e["truncated"]) for _, e in eps),
            "failed": sum(e["error"] is not None for _, e in eps)}


def episode_markdown(models: Mapping[str, Mapping]) -> str:
    """The results.md section of the models' episode summaries ('' when none has one)."""
    rows = {name: m["episodes"] for name, m in models.items() if m.get("episodes")}
    if not rows:
        return ""
    turns = max(s["max_turns"] for s in rows.values())
    head = " | ".join(f"solved ≤{t}" for t in range(1, turns + 1))
    lines = ["", "## Episodes", "",
             "Solved within t turns: the fraction of episodes solved by turn t (n episodes; interval over prompts). "
             "Tokens: after the prompt, environment observations included.", "",
             f"| model | {head} | turns (mean) | tokens (mean) | sampled tokens (mean) | n | truncated | failed |",
             "|---|" + "---|" * (turns + 6)]
    for name, s in rows.items():
        cells = []
        for t in range(1, turns + 1):
            w = s["solved_within"].get(str(t))
            cells.append("–" if w is None or w["rate"] is None else
                         f"{w['rate']:.3f} [{w['ci'][0]:.3f}, {w['ci'][1]:.3f}]")
        fmt = (lambda v: "–" if v is None else f"{v:.2f}")
        lines.append(f"| {name} | {' | '.join(cells)} | {fmt(s['turns_mean']['mean'])} | "
                     f"{fmt(s['tokens_mean']['mean'])} | {fmt(s['sampled_tokens_mean']['mean'])} | "
                     f"{s['n_episodes']} | {s['truncated']} | {s['failed']} |")
    return "\n".join(lines) + "\n"
