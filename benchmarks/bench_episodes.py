"""Multi-turn episodes with live-row continuation against re-prefilling the history, side by side in one run.

    python -m benchmarks.bench_episodes                       # 32 episodes of 4 turns, 3 timed rounds each
    python -m benchmarks.bench_episodes --episodes=64 --rounds=5

The same episodes (the same keys, so the same tokens: checked) sampled twice on the in-process engine:
  * live: `EpisodeRunner(continue_rows=True)`: an episode keeps its slot between turns (its caches held), and the
    next turn feeds only the turn's last token and the observation (`Engine` sessions);
  * re-prefill: `EpisodeRunner(continue_rows=False)`: every turn a `generate` call whose prompts are the episodes'
    whole histories, as every wire backend does.
The environment is a fixed one: the first prompt, then after each turn a feedback message of a set length,
for `turns` turns; turns end on stop ids (a random model's turns vary in length, a few hit the cap and end their
episode early). The model: a 4-layer Qwen3.5 (three Gated DeltaNet layers and one attention layer, as the real
models' pattern) of hidden size 256, fp32, random weights.

Reported as JSON, for each path: prefill tokens per episode (the engine's counters: prompts prefilled plus, for
live rows, the tokens fed by extensions), the episode's own prompt + observation tokens, their ratio, decode
steps, and episodes per second (median of `rounds` timed runs after a warm-up run that compiles every program);
and live / re-prefill for both. Goals (issue 39): prefill tokens per episode at most 1.1x prompt + observations
with live rows; episode throughput at least 1.5x re-prefilling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

SYSTEM = "You write code. Answer, then revise after the feedback."
FEEDBACK = "Test 3 failed: expected 41, got 40. Traceback: line 7, in solve: off by one. Fix it."


class FixedFeedback:
    """The benchmark's environment: the problem's prompt, then the same feedback after every turn."""

    def __init__(self, max_turns: int = 4):
        self.max_turns = max_turns

    def reset(self, problem):
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(problem)}]

    def step(self, turn):
        return [{"role": "user", "content": FEEDBACK}], 0.0, turn.index + 1 >= self.max_turns


def build(root: str, hidden: int = 256):
    import jax.numpy as jnp
    from jaxrl.data.chat import chat_stop_ids, load_tokenizer
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
    from jaxrl.models import qwen35
    from jaxrl.models.qwen35.config import tiny
    from jaxrl.models.qwen35.tiny_checkpoint import write_tiny_checkpoint

    cfg = tiny(hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=4, head_dim=64,
               linear_key_head_dim=64, linear_value_head_dim=64,
               layer_types=("linear_attention",) * 3 + ("full_attention",))
    write_tiny_checkpoint(root, cfg, seed=0, layout="text", with_mtp=False)
    build_tiny_tokenizer(root, [SYSTEM, FEEDBACK, "Problem 12: sum the numbers of a list."])
    tok = load_tokenizer(root)
    model = qwen35.from_pretrained(root, dtype=jnp.float32)
    # a random model rarely samples <|im_end|>: these ids end its turns after ~10 tokens on average
    stops = tuple(sorted(set(chat_stop_ids(tok)) | set(range(40, 65))))
    return tok, model, stops


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=32, help="episodes per run (problems x 4 samples)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--cap", type=int, default=48, help="max_new_tokens per turn")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each path (after one warm-up)")
    args = parser.parse_args(argv)

    from jaxrl.environments.runner import EpisodeRunner
    from jaxrl.backends import JaxBackend, SamplingParams
    from jaxrl.rollout.collect import Collector

    samples = 4
    problems = [f"Problem {j}: sum the numbers of list {j}." for j in range(max(1, args.episodes // samples))]
    groups = list(range(len(problems)))
    with tempfile.TemporaryDirectory() as root:
        tok, model, stops = build(root)
        prompt_len = 256
        budget = args.turns * (args.cap + 160)
        backend = JaxBackend(model=model, dtype=None, batch_size=len(problems) * samples,
                             max_prompt_len=prompt_len + budget - args.cap, stop_ids=stops, pad_id=0)
        collector = Collector(backend, None, tokenizer=tok, stop_ids=stops)

        def runner(live: bool) -> EpisodeRunner:
            return EpisodeRunner(collector, lambda: FixedFeedback(args.turns), tokenizer=tok, enable_thinking=False,
                                 max_turns=args.turns, max_new_tokens=args.cap, max_episode_tokens=budget,
                                 max_prompt_len=prompt_len, continue_rows=live)

        paths = {"live": runner(True), "reprefill": runner(False)}

        def run(name: str, seed: int):
            before = dict(backend.counters)
            t0 = time.perf_counter()
            episodes = paths[name].run(problems, groups, SamplingParams(n=samples, max_new_tokens=args.cap,
                                                                        temperature=1.0, seed=seed))
            seconds = time.perf_counter() - t0
            if name == "live":
                counts = dict(paths[name].last_stats)
                prefill = counts["prefilled_tokens"] + counts["extended_tokens"]
            else:
                counts = {k: backend.counters[k] - before.get(k, 0) for k in backend.counters}
                prefill = counts["prefilled_tokens"]
            return episodes, seconds, prefill, counts

        for name in paths:  # warm-up: every program compiles here
            run(name, seed=1)
        timings = {name: [] for name in paths}
        results = {}
        for _ in range(args.rounds):
            for name in paths:
                episodes, seconds, prefill, counts = run(name, seed=2)
                timings[name].append(seconds)
                results[name] = (episodes, prefill, counts)
        live_eps, reprefill_eps = results["live"][0], results["reprefill"][0]
        same = all(a.ids == b.ids for a, b in zip(live_eps, reprefill_eps))
        # the tokens each episode brings that are not sampled: its prompt and its observations
        given = sum(len(e.prompt_ids) + len(e.ids) - sum(e.mask) for e in live_eps)
        out = {"episodes": len(live_eps), "turns_mean": statistics.mean(e.turns for e in live_eps),
               "sampled_tokens_per_episode": sum(sum(e.mask) for e in live_eps) / len(live_eps),
               "prompt_and_observation_tokens_per_episode": given / len(live_eps),
               "identical_tokens": same}
        for name in paths:
            _, prefill, counts = results[name]
            median = statistics.median(timings[name])
            out[name] = {"prefill_tokens_per_episode": prefill / len(live_eps),
                         "prefill_over_prompt_and_observations": prefill / given,
                         "decode_steps": counts.get("decode_steps"), "seconds": timings[name],
                         "episodes_per_s": len(live_eps) / median}
        out["throughput_live_over_reprefill"] = out["live"]["episodes_per_s"] / out["reprefill"]["episodes_per_s"]
        out["prefill_reprefill_over_live"] = (out["reprefill"]["prefill_tokens_per_episode"]
                                              / out["live"]["prefill_tokens_per_episode"])
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
