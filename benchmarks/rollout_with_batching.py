"""`python -m launchers.rollout` with the jax backend's batching chosen by the first argument ("static" or
"continuous"), for bench_rollout_engine.run_launcher (the launcher itself always samples with the engine).

    python -m benchmarks.rollout_with_batching static --problems=... --model=... --out=...
"""

import functools
import sys

if __name__ == "__main__":
    from jaxrl.rollout import runner
    runner.JaxBackend = functools.partial(runner.JaxBackend, batching=sys.argv.pop(1))
    from launchers import _main, rollout
    _main.run(rollout.main)
