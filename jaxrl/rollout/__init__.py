"""Offline rollouts (`python -m launchers.rollout`): K samples of every problem of a file, scored by a reward and
written to a resumable rollouts.jsonl; and what evaluation shares with them: the collector (a backend, the one
decoding of completions, a reward) and the one resumable sampling loop.

    from jaxrl.rollout.runner import RolloutConfig, run_rollouts
    from jaxrl.rollout.collect import Collector

Generation itself is jaxrl.generation (the engine) and jaxrl.backends (where it runs).
"""
