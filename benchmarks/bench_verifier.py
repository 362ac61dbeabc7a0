"""Per-test overhead and throughput of the code verifier against a plain ``subprocess.run`` per test.

Both sides run the same trivial programs (``print(int(input()) + k)``, one test each) and check the output, in
one process, back to back:

* latency: one worker, one program at a time; the median wall time of a whole ``verifier.score([c], [p])`` call
  (extraction, sandbox round trip, comparison) against the median of one ``subprocess.run`` of a fresh Python.
* throughput: every core; programs per second for ``verifier.score(all)`` against a thread pool running
  ``subprocess.run`` with as many threads as cores.

The baseline has no isolation at all (no namespaces, no limits), so the ratios understate what the sandbox
costs against an equally isolated cold start.

    python -m benchmarks.bench_verifier [--programs 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from jaxrl.data.problems import Problem
from jaxrl.rewards import CodeVerifier
from jaxrl.rewards.compare import stdout_matches


def _programs(n: int) -> list[tuple[str, Problem]]:
    cases = []
    for k in range(n):
        code = f"print(int(input()) + {k})\n"
        problem = Problem.from_dict({"id": f"bench/{k}", "messages": [{"role": "user", "content": "add"}],
                                     "test_type": "stdin", "tests": [{"input": f"{k}\n", "output": f"{2 * k}\n"}]})
        cases.append((code, problem))
    return cases


def _subprocess_once(python: list[str], code: str, problem: Problem) -> bool:
    test = problem.tests[0]
    done = subprocess.run([*python, "-c", code], input=test.input.encode(), capture_output=True, timeout=60)
    return done.returncode == 0 and stdout_matches(done.stdout.decode(), test.output)


def _timed(fn, *args) -> tuple[float, bool]:
    started = time.perf_counter()
    ok = fn(*args)
    return time.perf_counter() - started, ok


def run(programs: int = 60) -> dict:
    """Measure and return the numbers (seconds, programs/s, ratios); prints nothing."""
    cases = _programs(programs)
    completions = [f"```python\n{code}```" for code, _ in cases]
    cores = len(os.sched_getaffinity(0))
    plain = [sys.executable]
    bare = [os.path.realpath(getattr(sys, "_base_executable", sys.executable)), "-I", "-S"]

    # ---- latency: one at a time
    with CodeVerifier(timeout_s=30.0, workers=1) as verifier:
        isolation = verifier.isolation  # starts the worker outside the timed region
        verifier.score(completions[:2], [p for _, p in cases[:2]])  # warm-up
        verifier_lat = []
        for completion, (_, problem) in zip(completions, cases):
            seconds, result = _timed(lambda c, p: verifier.score([c], [p])[0], completion, problem)
            assert result.strict, result
            verifier_lat.append(seconds)
    baseline_lat, bare_lat = [], []
    for code, problem in cases:
        for python, sink in ((plain, baseline_lat), (bare, bare_lat)):
            seconds, ok = _timed(_subprocess_once, python, code, problem)
            assert ok
            sink.append(seconds)

    # ---- throughput: every core
    with CodeVerifier(timeout_s=30.0, workers=cores) as verifier:
        verifier.score(completions[:cores], [p for _, p in cases[:cores]])  # start and warm every worker
        started = time.perf_counter()
        results = verifier.score(completions, [p for _, p in cases])
        verifier_s = time.perf_counter() - started
        assert all(r.strict for r in results)
    with ThreadPoolExecutor(max_workers=cores) as executor:
        started = time.perf_counter()
        oks = list(executor.map(lambda case: _subprocess_once(plain, *case), cases))
        baseline_s = time.perf_counter() - started
        assert all(oks)

    verifier_median = statistics.median(verifier_lat)
    baseline_median = statistics.median(baseline_lat)
    bare_median = statistics.median(bare_lat)
    return {
        "isolation": isolation,
        "programs": programs,
        "cores": cores,
        "verifier_median_per_test_s": verifier_median,
        "subprocess_median_per_test_s": baseline_median,
        "subprocess_bare_median_per_test_s": bare_median,
        "per_test_speedup_vs_subprocess": baseline_median / verifier_median,
        "per_test_speedup_vs_bare_subprocess": bare_median / verifier_median,
        "verifier_programs_per_s": programs / verifier_s,
        "subprocess_programs_per_s": programs / baseline_s,
        "throughput_ratio_vs_subprocess": baseline_s / verifier_s,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=60)
    args = parser.parse_args(argv)
    numbers = run(args.programs)
    ms = lambda s: f"{1000 * s:8.1f} ms"  # noqa: E731
    print(f"code verifier benchmark: {numbers['programs']} trivial programs, {numbers['cores']} cores, "
          f"isolation {numbers['isolation']}")
    print(f"{'':44s}{'per test (median)':>18s}{'programs/s':>14s}")
    print(f"{'CodeVerifier.score (sandbox, fork server)':44s}{ms(numbers['verifier_median_per_test_s']):>18s}"
          f"{numbers['verifier_programs_per_s']:14.1f}")
    print(f"{'subprocess.run(sys.executable -c ...)':44s}{ms(numbers['subprocess_median_per_test_s']):>18s}"
          f"{numbers['subprocess_programs_per_s']:14.1f}")
    print(f"{'subprocess.run(python -I -S -c ...)':44s}{ms(numbers['subprocess_bare_median_per_test_s']):>18s}"
          f"{'':>14s}")
    print(f"per-test speed-up vs subprocess.run: {numbers['per_test_speedup_vs_subprocess']:.1f}x "
          f"(vs -I -S: {numbers['per_test_speedup_vs_bare_subprocess']:.1f}x); "
          f"throughput ratio: {numbers['throughput_ratio_vs_subprocess']:.1f}x")
    return numbers


if __name__ == "__main__":
    main()
