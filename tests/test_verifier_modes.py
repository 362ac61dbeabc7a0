"""The sandbox pool's life cycle and its degraded modes, with real worker processes.

Covers: the worker count is bounded by the cores; close() removes every process, folder and cgroup; a dead
worker is replaced; a verifier process that dies without closing takes its workers along; "auto" falls back
(with a warning) when namespaces cannot start; the "uid" mode still kills setsid() escapees and cleans /tmp;
the "none" mode still grades and enforces limits.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from jaxrl.data.problems import Problem
from jaxrl.rewards import CodeVerifier
from jaxrl.rewards import sandbox as sandbox_module

LEGIT_TIMEOUT_S = 20.0
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the uid mode and cgroups need root")


def problem(tests, time_limit_s=LEGIT_TIMEOUT_S) -> Problem:
    return Problem.from_dict({"id": "p", "messages": [{"role": "user", "content": "x"}], "test_type": "stdin",
                              "tests": [{"input": i, "output": o} for i, o in tests],
                              "time_limit_s": time_limit_s})


def fenced(code: str) -> str:
    return "```python\n" + textwrap.dedent(code).strip() + "\n```"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        try:
            children = [int(x) for x in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except OSError:
            continue
        found.extend(children)
        stack.extend(children)
    return found


def live_descendants(pids, settle_s: float = 5.0) -> list[int]:
    """The processes below `pids` that are still running (a killed child its server has not reaped yet is a zombie:
    dead, listed until the wait), once the kills have had `settle_s` to land."""
    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    deadline = time.monotonic() + settle_s
    while True:
        alive = [d for p in pids for d in descendants(p) if running(d)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


SUM = fenced("a, b = map(int, input().split())\nprint(a + b)")
SUM_PROBLEM = problem([("1 2\n", "3\n"), ("2 2\n", "4\n")])


def test_workers_are_bounded_by_the_cores():
    cores = len(os.sched_getaffinity(0))
    assert CodeVerifier(workers=1000).pool.num_workers == cores
    assert CodeVerifier(workers=1).pool.num_workers == 1
    assert CodeVerifier().pool.num_workers == cores
    with pytest.raises(ValueError, match="workers"):
        CodeVerifier(workers=0)


def test_close_removes_processes_folders_and_cgroups_and_restart_works():
    verifier = CodeVerifier(timeout_s=LEGIT_TIMEOUT_S, workers=2)
    assert verifier.score([SUM], [SUM_PROBLEM])[0].strict
    pids = verifier.pool.worker_pids
    cgroup_dirs = [os.path.dirname(p) for w in verifier.pool._workers for p in w.cgroups.values()]
    all_pids = pids + [d for p in pids for d in descendants(p)]
    assert all(alive(p) for p in pids)
    if os.geteuid() == 0:
        assert cgroup_dirs and all(os.path.isdir(d) for d in cgroup_dirs)
    verifier.close()
    assert [p for p in all_pids if alive(p)] == []
    assert [d for d in cgroup_dirs if os.path.exists(d)] == []
    assert verifier.score([SUM], [SUM_PROBLEM])[0].strict  # starts again on demand
    verifier.close()


def test_a_killed_worker_is_replaced():
    with CodeVerifier(timeout_s=LEGIT_TIMEOUT_S, workers=2) as verifier:
        assert verifier.score([SUM], [SUM_PROBLEM])[0].strict
        for pid in verifier.pool.worker_pids:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        results = verifier.score([SUM] * 3, [SUM_PROBLEM] * 3)
        assert all(r.strict for r in results)


CRASHING_TRAINER = """
import json, os, sys
from jaxrl.rewards import CodeVerifier
verifier = CodeVerifier(timeout_s=20.0, workers=2, isolation=sys.argv[1])
problem = {"id": "p", "messages": [{"role": "user", "content": "x"}], "test_type": "stdin",
           "tests": [{"input": "", "output": "3"}]}
assert verifier.score(["```python\\nprint(3)\\n```"], [problem])[0].strict
print(json.dumps({"pids": verifier.pool.worker_pids, "dirs": verifier.pool.worker_dirs}), flush=True)
os._exit(0)  # dies without close() and without running finalizers
"""


@pytest.mark.parametrize("mode", ["auto", pytest.param("uid", marks=needs_root)])
def test_workers_clean_up_after_a_verifier_that_died(tmp_path, mode):
    """A crashed trainer leaves no sandbox process and no folder: EOF on the control pipe ends each worker."""
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_TRAINER)
    out = subprocess.run([sys.executable, "-W", "ignore", str(script), mode], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    left = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(left["pids"]) == min(2, len(os.sched_getaffinity(0)))
    deadline = time.monotonic() + 10
    while (any(alive(p) for p in left["pids"]) or any(os.path.exists(d) for d in left["dirs"])) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in left["pids"] if alive(p)] == []
    assert [d for d in left["dirs"] if os.path.exists(d)] == []


@needs_root
def test_auto_falls_back_with_a_warning_when_namespaces_cannot_start(monkeypatch):
    real_which = sandbox_module.shutil.which
    # `false` stands in for an unshare that the kernel refuses (as in a container without CAP_SYS_ADMIN)
    monkeypatch.setattr(sandbox_module.shutil, "which",
                        lambda name: "/bin/false" if name == "unshare" else real_which(name))
    verifier = CodeVerifier(timeout_s=LEGIT_TIMEOUT_S, workers=1)
    try:
        with pytest.warns(RuntimeWarning, match="degraded to isolation 'uid"):
            assert verifier.isolation.startswith("uid+")
        result = verifier.score([SUM], [SUM_PROBLEM])[0]
        assert result.strict and result.isolation.startswith("uid+")
    finally:
        verifier.close()


def test_requesting_an_unavailable_mode_is_an_error(monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: "/bin/false")
    verifier = CodeVerifier(workers=1, isolation="namespaces")
    with pytest.raises(sandbox_module.SandboxError, match="namespaces"):
        verifier.score([SUM], [SUM_PROBLEM])
    verifier.close()


@needs_root
def test_uid_mode_kills_escapees_and_cleans_shared_tmp():
    name = f"jaxrl-uidmode-{secrets.token_hex(6)}"
    escapee = fenced(f"""
        import os, time
        open("/tmp/{name}", "w").write("left behind")   # world-writable /tmp is shared in this mode
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(2)
                open("/tmp/{name}.late", "w").write("escaped")
                os._exit(0)
            os._exit(0)
        print(int(input()) * 2)
    """)
    bomb = fenced("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    with CodeVerifier(timeout_s=LEGIT_TIMEOUT_S, workers=2, isolation="uid") as verifier:
        assert verifier.isolation.startswith("uid+") and "+uid+" in verifier.isolation
        results = verifier.score([escapee, bomb], [problem([("21\n", "42\n")]),
                                                  problem([("", "x")], time_limit_s=1.5)])
        assert results[0].tests == ["pass"] and results[1].tests == ["timeout"]
        servers = verifier.pool.worker_pids
        assert live_descendants(servers) == []
        time.sleep(2.5)
        assert not os.path.exists(f"/tmp/{name}") and not os.path.exists(f"/tmp/{name}.late")


def test_site_packages_are_opt_in():
    """By default programs get the standard library only (site-packages may hold test data, e.g. HumanEval)."""
    pytest.importorskip("numpy")
    uses_numpy = fenced("import numpy as np\nprint(int(np.arange(int(input())).sum()))")
    sums = problem([("5\n", "10\n")])
    with CodeVerifier(timeout_s=LEGIT_TIMEOUT_S, workers=1) as default:
        (result,) = default.score([uses_numpy], [sums])
        assert result.tests == ["error"] and "ModuleNotFoundError" in result.detail
    with CodeVerifier(timeout_s=LEGIT_TIMEOUT_S, workers=1, site_packages=True) as opted_in:
        assert opted_in.score([uses_numpy], [sums])[0].tests == ["pass"]


PROBE_PROGRAM = """
import os, jaxrl_tmp_probe
try:
    open(os.path.join(os.path.dirname(jaxrl_tmp_probe.__file__), "planted.py"), "w").close()
    print(jaxrl_tmp_probe.VALUE, "writable")
except OSError:
    print(jaxrl_tmp_probe.VALUE, "read-only")
"""
PROBE_TRAINER = """
import json, site, sys
from jaxrl.rewards import CodeVerifier
problem = {"id": "p", "messages": [{"role": "user", "content": "x"}], "test_type": "stdin",
           "tests": [{"input": "", "output": "42 read-only"}] * 2}
with CodeVerifier(timeout_s=20.0, workers=1, site_packages=True) as verifier:
    (result,) = verifier.score(["```python\\n" + sys.argv[1] + "\\n```"], [problem])
    print(json.dumps({"site": site.getsitepackages(), "isolation": verifier.isolation, "tests": result.tests,
                      "detail": result.detail}))
"""


def test_site_packages_of_a_venv_under_tmp_are_importable(tmp_path):
    """A venv under /tmp (a clone in /tmp, a CI scratch folder): the sandbox's private /tmp must not hide it.

    Two tests of one problem: the bind must also survive the wipe of /tmp between tests.
    """
    venv = Path(tempfile.mkdtemp(prefix="jaxrl-venv-", dir="/tmp"))
    try:
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip",
                        str(venv)], check=True, timeout=120)
        python = venv / "bin" / "python"
        site_dir = Path(subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                                       capture_output=True, text=True, check=True).stdout.strip())
        assert site_dir.is_relative_to("/tmp")
        (site_dir / "jaxrl_tmp_probe.py").write_text("VALUE = 42\n")
        script = tmp_path / "probe.py"
        script.write_text(PROBE_TRAINER)
        # This interpreter's path (jaxrl and its dependencies) goes along; the venv adds the folder under /tmp.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
        out = subprocess.run([python, "-W", "ignore", str(script), PROBE_PROGRAM], capture_output=True,
                             text=True, env=env, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert str(site_dir) in report["site"]
        assert report["tests"] == ["pass", "pass"], report
        assert not (site_dir / "planted.py").exists()
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def test_none_mode_still_grades_and_limits():
    with pytest.warns(RuntimeWarning, match="degraded"):
        verifier = CodeVerifier(timeout_s=LEGIT_TIMEOUT_S, workers=2, isolation="none")
        isolation = verifier.isolation
    try:
        assert isolation.startswith("none+") and "+uid" not in isolation
        results = verifier.score(
            [SUM, fenced("while True:\n    pass"), fenced("while True:\n    print('x' * 10000)"),
             fenced("x = bytearray(8 * 1024 ** 3)")],
            [SUM_PROBLEM, problem([("", "x")], time_limit_s=1.5), problem([("", "x")]), problem([("", "x")])])
        assert [r.tests for r in results] == [["pass", "pass"], ["timeout"], ["output_limit"], ["memory"]]
        assert all(r.isolation == isolation for r in results)
    finally:
        verifier.close()
