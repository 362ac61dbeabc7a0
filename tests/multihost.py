"""Several local processes of a launcher as one `jax.distributed` job, as a user starts them on several hosts: the
same command on each, with --coordinator_address (a free localhost port), --num_processes and --process_id. Each
process sees its own fake CPU devices; collectives between processes go over gloo (jax's CPU default).

    with job(tmp_path, "launchers.train", args, processes=2, devices=4) as procs:
        codes = wait(procs)                      # exit codes; every process is killed when the block fails
    log_of(tmp_path, "launchers.train", 0)       # what process 0 printed

Every process is started in its own session and killed with its children when the `with` block is left while it
still runs (a failed assertion, a timeout), so no stray process outlives a test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int, cache_dir, **extra) -> dict:
    """The environment of one process: `devices` fake CPU devices, a compilation cache shared by every run of a
    test (each compiles alike; a low LLVM optimisation level just compiles quicker)."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                                     "--xla_backend_optimization_level=0",
               JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def log_path(log_dir, name: str, index: int) -> Path:
    return Path(log_dir) / f"{name}.p{index}.log"


def log_of(log_dir, name: str, index: int) -> str:
    return log_path(log_dir, name, index).read_text(errors="replace")


def start(log_dir, module: str, args, *, processes: int, devices: int, cache_dir, name: str = "run",
          per_process=None, env=None) -> list[subprocess.Popen]:
    """`python -m module args` as `processes` processes (one process: no distributed flags); per_process[i]:
    extra flags of process i only; env: extra environment variables."""
    port = free_port()
    procs = []
    for i in range(processes):
        cmd = [sys.executable, "-m", module, *args, *((per_process or {}).get(i, []))]
        if processes > 1:
            cmd += [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}", f"--process_id={i}"]
        with open(log_path(log_dir, name, i), "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=process_env(devices, cache_dir, **(env or {})),
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait(procs, timeout: float = 900) -> list[int]:
    """Exit codes of every process (negative: killed by that signal); kills them all and raises TimeoutError when
    one runs past `timeout` seconds."""
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            kill(procs)
            raise TimeoutError(f"a process ran past {timeout} s: {p.args}") from None
    return [p.returncode for p in procs]


@contextlib.contextmanager
def job(log_dir, module: str, args, **kwargs):
    """`start` in a with-block that kills every process still running when it is left."""
    procs = start(log_dir, module, args, **kwargs)
    try:
        yield procs
    finally:
        kill(procs)


def run(log_dir, module: str, args, timeout: float = 900, **kwargs) -> list[int]:
    """Start, wait, return the exit codes."""
    with job(log_dir, module, args, **kwargs) as procs:
        return wait(procs, timeout)


def tail(log_dir, name: str, processes: int, chars: int = 3000) -> str:
    """The end of every process's log, for assertion messages."""
    return "\n".join(f"--- process {i} ---\n{log_of(log_dir, name, i)[-chars:]}" for i in range(processes))
