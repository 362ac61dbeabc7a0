"""The code verifier: extract the program from each completion, run it on every test in the sandbox, grade.

    verifier = CodeVerifier(timeout_s=6.0, memory_mb=1024, workers=2)
    results = verifier.score(completions, problems, truncated=None)
    results[i].partial, results[i].strict, results[i].tests, results[i].reason

Every test runs in a fresh child process of a sandbox worker, never in this process; expected outputs never
leave this process (see ``sandbox.py``). The comparison happens here (``compare.py``).
"""

from __future__ import annotations

import errno
import math
import signal
from typing import Any, Mapping, Sequence

from jaxrl.data.problems import Problem, coerce_problem
from jaxrl.rewards.base import (RewardResult, TruncationPolicy, check_batch, normalize_truncated,
                                truncated_result)
from jaxrl.rewards.compare import functional_matches, stdout_matches
from jaxrl.rewards.extract import extract_code
from jaxrl.rewards.sandbox import EXIT_OK, Execution, Job, Limits, SandboxPool, SandboxSettings

# LiveCodeBench prepends these imports to every program (lcb_runner/evaluation/testing_util.py) and raises
# the int-string limit to 50000 digits: solutions that use `List`, `defaultdict` or `inf` without importing
# them pass there. Reproduce both with lcb_compat=True when scores must match theirs.
_LCB_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                "statistics", "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing")
LCB_PREAMBLE = "".join(f"from {m} import *\n" for m in _LCB_MODULES) + "".join(
    f"import {m}\n" for m in _LCB_MODULES if m not in ("builtins", "typing")) + "sys.setrecursionlimit(50000)\n"
LCB_INT_MAX_STR_DIGITS = 50000

_FILE_LIMIT_ERRNOS = {errno.EFBIG, errno.ENOSPC, errno.EDQUOT}


def classify(execution: Execution | None, expected_output: str, functional: bool, timeout_s: float) -> str:
    """The status of one test run: pass / wrong / timeout / error / output_limit / memory."""
    if execution is None:  # skipped: another test of the same program already showed it cannot run
        return "error"
    if execution.infra_error:
        return "timeout" if execution.timed_out else "error"
    if execution.output_exceeded:
        return "output_limit"
    if execution.timed_out or execution.signal == signal.SIGXCPU:
        return "timeout"
    record = execution.record or {}
    if record.get("kind") == "exception":
        if record.get("type") == "MemoryError":
            return "memory"
        if record.get("errno") in _FILE_LIMIT_ERRNOS:  # RLIMIT_FSIZE (EFBIG) or the private /tmp filled up
            return "output_limit"
        return "error"
    if execution.signal == signal.SIGKILL:
        # Not the sandbox's own kill (flagged above), so either RLIMIT_CPU's hard limit (ceil(timeout) + 1 s
        # of CPU) or the memory cgroup's OOM killer.
        return "timeout" if execution.cpu_s >= math.ceil(timeout_s) else "memory"
    if execution.signal is not None:
        return "error"  # SIGSEGV (stack overflow in C code), SIGABRT, ...
    if functional:
        if record.get("kind") != "ok" or "result" not in record:
            return "error"
        return "pass" if functional_matches(record["result"], expected_output) else "wrong"
    if execution.exit_code != EXIT_OK:
        return "error"
    actual = execution.stdout.decode("utf-8", errors="replace")
    return "pass" if stdout_matches(actual, expected_output) else "wrong"


def _first_error(executions: Sequence[Execution | None], statuses: Sequence[str]) -> str | None:
    for execution, status in zip(executions, statuses):
        if status == "pass" or execution is None:
            continue
        if execution.infra_error:
            return execution.infra_error
        record = execution.record or {}
        if record.get("kind") in ("exception", "syntax_error", "no_function"):
            return f"{record.get('type', record['kind'])}: {record.get('message', '')}".strip()
        return status
    return None


class CodeVerifier:
    """Scores code completions against problems' tests in a sandbox. See the module docstring.

    Args:
      timeout_s: wall-clock limit per test (a problem's own ``time_limit_s`` times ``time_scale`` wins).
      memory_mb: address-space limit of each program.
      workers: parallel sandboxes; None for one per core. Always capped at the core count, because more
        concurrent programs than cores turn CPU contention into false timeouts.
      truncation: "zero" scores a truncated completion 0 with reason "truncated"; "mask" also sets
        ``masked=True`` so trainers can drop it from the loss.
      isolation: "auto" (strongest available), "namespaces", "uid" or "none"; see ``sandbox.py``.
      lcb_compat: prepend LiveCodeBench's import preamble and use its 50000-digit int limit.
      preamble / int_max_str_digits: the same two knobs individually (0 digits = unlimited, the default).
      site_packages: let programs import the verifier's site-packages (numpy ...); read-only.
    """

    def __init__(self, timeout_s: float = 6.0, memory_mb: int = 1024, workers: int | None = None, *,
                 truncation: TruncationPolicy = "zero", isolation: str = "auto", lcb_compat: bool = False,
                 preamble: str | None = None, int_max_str_digits: int | None = None, time_scale: float = 1.0,
                 output_limit_mb: int = 16, file_size_mb: int = 16, max_processes: int = 32,
                 max_open_files: int = 64, site_packages: bool = False):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if truncation not in ("zero", "mask"):
            raise ValueError(f"truncation must be 'zero' or 'mask', got {truncation!r}")
        self.timeout_s = float(timeout_s)
        self.time_scale = float(time_scale)
        self.truncation: TruncationPolicy = truncation
        if preamble is None:
            preamble = LCB_PREAMBLE if lcb_compat else ""
        if int_max_str_digits is None:
            int_max_str_digits = LCB_INT_MAX_STR_DIGITS if lcb_compat else 0
        limits = Limits(memory_mb=memory_mb, file_size_mb=file_size_mb, output_mb=output_limit_mb,
                        open_files=max_open_files, processes=max_processes)
        settings = SandboxSettings(limits=limits, preamble=preamble, int_max_str_digits=int_max_str_digits,
                                   site_packages=site_packages)
        self.pool = SandboxPool(workers=workers, isolation=isolation, settings=settings)

    # ------------------------------------------------------------------------------------------------ API
    @property
    def isolation(self) -> str:
        """What the sandbox achieved on this machine, e.g. 'namespaces+pidns+netns+private-root+uid+...'."""
        return self.pool.isolation.describe()

    def score(self, completions: Sequence[str], problems: Sequence[Problem | Mapping[str, Any]],
              truncated: Sequence[bool | str] | None = None) -> list[RewardResult]:
        """Score ``completions[i]`` against ``problems[i]``; ``truncated`` takes booleans or finish reasons."""
        check_batch(completions, problems)
        flags = normalize_truncated(truncated, len(completions))
        codes: list[str | None] = []
        early: dict[int, RewardResult] = {}
        for i, (completion, is_truncated) in enumerate(zip(completions, flags)):
            if is_truncated:
                early[i] = truncated_result(self.truncation)
                codes.append(None)
                continue
            extraction = extract_code(completion)
            if extraction.code is None:
                early[i] = RewardResult.nothing_ran(extraction.reason or "no_code")
            codes.append(extraction.code)
        results = self.score_code(codes, problems)
        isolation = results[0].isolation if results else ""
        for i, result in early.items():
            result.isolation = isolation
            results[i] = result
        return results

    def score_code(self, codes: Sequence[str | None], problems: Sequence[Problem | Mapping[str, Any]]
                   ) -> list[RewardResult]:
        """Score programs that are already extracted (None: nothing to run, reason "no_code")."""
        check_batch(codes, problems)
        parsed = [coerce_problem(p, where=f"problems[{i}]") for i, p in enumerate(problems)]
        # The same program on the same problem runs once (GRPO groups often repeat a sample): identical
        # inputs give identical results, and the sandbox time goes to distinct programs.
        unique: dict[tuple[str, str], int] = {}
        owner: list[int | None] = []
        for code, problem in zip(codes, parsed):
            if code is None or not code.strip():
                owner.append(None)
                continue
            owner.append(unique.setdefault((code, problem.fingerprint), len(unique)))
        programs = list(unique)
        by_fingerprint = {p.fingerprint: p for p in parsed}
        jobs: list[Job] = []
        job_program: list[int] = []  # program index of each job; a program's jobs are contiguous
        for index, (code, fingerprint) in enumerate(programs):
            problem = by_fingerprint[fingerprint]
            timeout = self._timeout_for(problem)
            for test in problem.tests:
                jobs.append(Job(code=code, input=test.input, fn_name=problem.fn_name, timeout_s=timeout))
                job_program.append(index)
        starts = [0]
        for _, fingerprint in programs:
            starts.append(starts[-1] + len(by_fingerprint[fingerprint].tests))
        isolation = self.isolation if jobs else ""
        # A program that does not compile fails every test the same way: skip its remaining tests.
        executions = self.pool.run(jobs, groups=job_program,
                                   stop_group_if=lambda e: (e.record or {}).get("kind") == "syntax_error")
        per_program = [self._grade(by_fingerprint[fp], executions[starts[i]:starts[i + 1]], isolation)
                       for i, (_, fp) in enumerate(programs)]
        results = []
        for program_index in owner:
            if program_index is None:
                results.append(RewardResult.nothing_ran("no_code", isolation=isolation))
            else:
                template = per_program[program_index]
                results.append(RewardResult(**{**template.to_dict(), "tests": list(template.tests)}))
        return results

    def _timeout_for(self, problem: Problem) -> float:
        return problem.time_limit_s * self.time_scale if problem.time_limit_s else self.timeout_s

    def _grade(self, problem: Problem, mine: Sequence[Execution | None], isolation: str) -> RewardResult:
        """One program's result from its executions (one per test, in test order)."""
        timeout = self._timeout_for(problem)
        statuses = [classify(e, t.output, problem.functional, timeout) for e, t in zip(mine, problem.tests)]
        records = [(e.record or {}) for e in mine if e is not None]
        reason = None
        if any(r.get("kind") == "syntax_error" for r in records):
            reason = "syntax_error"
            statuses = ["error"] * len(problem.tests)
        elif records and all(r.get("kind") == "no_function" for r in records):
            reason = "no_function"
        elif any(e is not None and e.infra_error for e in mine):
            reason = "sandbox_error"
        return RewardResult.from_tests(statuses, reason=reason, isolation=isolation,
                                       detail=_first_error(mine, statuses))

    # ------------------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop the sandbox workers and remove their folders (they restart on the next score())."""
        self.pool.close()

    def __enter__(self) -> "CodeVerifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
