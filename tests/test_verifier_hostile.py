"""Hostile programs against the real sandbox: each is contained, gets the right status, leaves nothing behind.

Every test runs real programs in real sandbox processes. Timeouts are short (1.5 s) only for programs that can
never finish; legitimate programs get 20 s so a loaded CI machine cannot turn them into false timeouts.
After every test no process may remain under the sandbox workers, and the files programs tried to plant on the
host must not exist.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from jaxrl.data.problems import Problem
from jaxrl.rewards import CodeVerifier, sandbox

HOSTILE_TIMEOUT_S = 1.5  # only for programs that never end by themselves
LEGIT_TIMEOUT_S = 20.0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def sandbox_leftovers(verifier: CodeVerifier) -> list[str]:
    """Processes below the workers' fork servers: there must be none between runs."""
    leftovers = []
    for top in verifier.pool.worker_pids:
        # namespaces mode: unshare -> fork server -> (programs); other modes: fork server -> (programs)
        servers = _children(top) if verifier.pool.isolation.pid_namespace else [top]
        stack = [child for server in servers for child in _children(server)]
        while stack:
            pid = stack.pop()
            try:
                leftovers.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:80]!r}")
            except OSError:
                continue  # exited meanwhile
            stack.extend(_children(pid))
    return leftovers


def stdin_problem(tests, time_limit_s=LEGIT_TIMEOUT_S, pid="hostile") -> Problem:
    return Problem.from_dict({
        "id": pid, "messages": [{"role": "user", "content": "solve"}], "test_type": "stdin",
        "tests": [{"input": i, "output": o} for i, o in tests], "time_limit_s": time_limit_s})


def functional_problem(fn_name, tests, time_limit_s=LEGIT_TIMEOUT_S) -> Problem:
    return Problem.from_dict({
        "id": "hostile-fn", "messages": [{"role": "user", "content": "solve"}], "test_type": "functional",
        "fn_name": fn_name, "tests": [{"input": i, "output": o} for i, o in tests], "time_limit_s": time_limit_s})


def fenced(code: str) -> str:
    return "```python\n" + textwrap.dedent(code).strip() + "\n```"


@pytest.fixture(scope="module")
def verifier():
    v = CodeVerifier(timeout_s=LEGIT_TIMEOUT_S, memory_mb=512, workers=2)
    yield v
    worker_dirs = v.pool.worker_dirs
    top_pids = v.pool.worker_pids
    v.close()
    assert [d for d in worker_dirs if os.path.exists(d)] == [], "the workers' folders must be removed on close"
    for pid in top_pids:
        assert not os.path.exists(f"/proc/{pid}") or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.fixture
def run(verifier):
    """Score one completion and check that nothing is left running afterwards."""

    def _run(code: str, problem: Problem):
        (result,) = verifier.score([fenced(code)], [problem])
        assert sandbox_leftovers(verifier) == []
        return result

    return _run


@pytest.fixture(scope="module")
def isolation(verifier):
    return verifier.pool.isolation


def need(isolation, *features):
    missing = [f for f in features if not getattr(isolation, f)]
    if missing:
        pytest.skip(f"sandbox on this machine lacks {missing} (isolation {isolation.describe()})")


# ------------------------------------------------------------------------------------------------------------
def test_strongest_isolation_is_active_as_root(isolation):
    """CI runs as root with util-linux: the full sandbox must start there, not a silent fallback."""
    if os.geteuid() != 0:
        pytest.skip("not root")
    assert isolation.mode == "namespaces"
    assert isolation.pid_namespace and isolation.net_namespace and isolation.private_root
    assert isolation.uid is not None and isolation.uid != 0


def test_fork_bomb_is_contained(run, isolation):
    need(isolation, "uid")  # RLIMIT_NPROC binds only off root
    result = run("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, stdin_problem([("", "x")], time_limit_s=HOSTILE_TIMEOUT_S))
    assert result.tests == ["timeout"] and result.partial == 0.0


@pytest.mark.parametrize("code", [
    "x = bytearray(8 * 1024 ** 3)\nprint('allocated')",
    "chunks = []\nwhile True:\n    chunks.append(b'x' * 10 ** 7)",
], ids=["one_big_block", "growing_list"])
def test_memory_bomb_gets_memory_status(run, code):
    result = run(code, stdin_problem([("", "allocated")]))
    assert result.tests == ["memory"]


def test_forked_memory_bomb_is_contained(run, isolation):
    """Per-process RLIMIT_AS times many processes would still exhaust the host: the memory cgroup caps the sum."""
    need(isolation, "cgroups")
    result = run("""
        import os
        children = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                block = b"x" * (400 * 1024 * 1024)  # touched pages, 6 x 400 MB > the cgroup's cap
                os._exit(0)
            children.append(pid)
        for pid in children:
            os.waitpid(pid, 0)
        print("all survived")
    """, stdin_problem([("", "never printed by a contained bomb")]))
    assert result.partial == 0.0


def test_infinite_loop_times_out(run):
    result = run("while True:\n    pass", stdin_problem([("", "x")], time_limit_s=HOSTILE_TIMEOUT_S))
    assert result.tests == ["timeout"]


def test_sleep_times_out_on_the_wall_clock(run):
    started = time.monotonic()
    result = run("import time\ntime.sleep(600)", stdin_problem([("", "x")], time_limit_s=HOSTILE_TIMEOUT_S))
    assert result.tests == ["timeout"]
    assert time.monotonic() - started < 60, "a sleeping program must be killed, not waited for"


def test_sigterm_handler_does_not_stop_the_kill(run):
    result = run("""
        import signal, time
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            time.sleep(0.05)
    """, stdin_problem([("", "x")], time_limit_s=HOSTILE_TIMEOUT_S))
    assert result.tests == ["timeout"]


def test_setsid_grandchild_is_killed_and_plants_nothing(run, tmp_path):
    marker = tmp_path / "escaped.txt"
    result = run(f"""
        import os, time
        if os.fork() == 0:
            os.setsid()            # leaves the process group a killpg would reach
            if os.fork() == 0:
                time.sleep(2)
                for path in ({str(marker)!r}, "/tmp/escaped-{secrets.token_hex(4)}"):
                    try:
                        open(path, "w").write("escaped")
                    except OSError:
                        pass
                os._exit(0)
            os._exit(0)
        print(int(input()) * 2)
    """, stdin_problem([("21\n", "42\n")]))
    assert result.tests == ["pass"]  # the program is right; its escapee must still die with the test
    time.sleep(2.5)
    assert not marker.exists()


def test_network_is_unreachable(run, isolation):
    need(isolation, "net_namespace")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        result = run(f"""
            import socket
            for host, port in (("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)):
                try:
                    socket.create_connection((host, port), timeout=2).sendall(b"leak")
                    print("connected")
                    break
                except OSError:
                    pass
            else:
                raise SystemExit("no network")
        """, stdin_problem([("", "connected")]))
        assert result.tests == ["wrong"]
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_writes_outside_the_work_folder_do_not_reach_the_host(run, tmp_path):
    name = f"jaxrl-planted-{secrets.token_hex(6)}"
    targets = [f"/tmp/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}", str(tmp_path / name),
               str(Path.cwd() / name), f"/{name}", f"/root/{name}", f"../{name}", f"../../{name}"]
    result = run(f"""
        import os
        for path in {targets!r}:
            try:
                with open(path, "w") as f:
                    f.write("planted")
            except OSError:
                pass
        print("done")
    """, stdin_problem([("", "done")]))
    assert result.tests == ["pass"]
    assert [t for t in targets if t.startswith("/") and os.path.exists(t)] == []
    assert not list(Path.cwd().glob("jaxrl-planted-*"))


SECRET_SCANNER = r"""
import gc, os, re, sys
PATTERN = re.compile("SEC" + r"RET-[0-9a-f]{32}")
def scan(text):
    match = PATTERN.search(text if isinstance(text, str) else text.decode("latin-1"))
    if match:
        print(match.group(0))
        sys.stdout.flush()
        os._exit(0)
def try_read(path):
    try:
        with open(path, "rb") as f:
            scan(f.read(1 << 22))
    except (OSError, ValueError):
        pass
def read_tree(top, skip):
    for folder, dirs, files in os.walk(top):
        if folder.startswith(skip):
            dirs[:] = []  # pruned, not just skipped: walking a host's /usr alone outlasted the time limit on CI
            continue
        for name in files:
            try_read(os.path.join(folder, name))
"""


def host_binds_skipped() -> tuple[str, ...]:
    """What the scanners may skip: the host's system folders bound read-only on purpose (interpreter, /usr, /lib),
    and the kernel's pseudo file systems. None of them holds the test's data; everything else in the root is read."""
    binds, _ = sandbox._read_only_view([])
    return tuple(sorted({*binds, "/proc", "/sys", "/dev"}))


def test_expected_outputs_are_unreachable_from_files_env_and_proc(run, isolation, tmp_path):
    """The expected output is a secret that exists only in the verifier and in test-data files on the host."""
    need(isolation, "private_root")
    secret = f"SECRET-{secrets.token_hex(16)}"
    data_file = tmp_path / "problems.jsonl"
    data_file.write_text(json.dumps({"output": secret}))
    os.chmod(tmp_path, 0o755)
    os.chmod(data_file, 0o644)  # world-readable, as data sets usually are
    result = run(SECRET_SCANNER + f"""
for path in ({str(data_file)!r}, {str(Path.cwd() / 'tests')!r}, "/work", "/root", "/home", "/tmp", "/proc/1/mem"):
    try_read(path)
scan(repr(dict(os.environ)) + repr(sys.argv))
for top in (".", "/tmp", "/", {str(tmp_path)!r}, {os.path.dirname(str(tmp_path))!r}):
    read_tree(top, {host_binds_skipped()!r})
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for part in ("cmdline", "environ", "maps"):
            try_read(f"/proc/{{pid}}/{{part}}")
print("nothing found")
""", stdin_problem([("", secret)]))
    assert result.tests == ["wrong"]


def test_other_workers_folders_are_unreachable(verifier, isolation):
    """Two programs at once on two workers: the second cannot find what the first wrote in its folder."""
    need(isolation, "private_root")
    if verifier.pool.num_workers < 2:
        pytest.skip("needs two workers")
    secret = f"SECRET-{secrets.token_hex(16)}"
    writer = """
        import time
        data = input()
        with open("note.txt", "w") as f:
            f.write(data)
        time.sleep(3)
        print("written")
    """
    reader = SECRET_SCANNER + f"""
import time
time.sleep(1)
for top in ("/tmp", "/", *{verifier.pool.worker_dirs!r}, {tempfile.gettempdir()!r}):
    read_tree(top, {host_binds_skipped()!r})
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try_read(f"/proc/{{pid}}/cwd/note.txt")
print("nothing found")
"""
    results = verifier.score([fenced(writer), fenced(reader)],
                             [stdin_problem([(secret + "\n", "written")], pid="writer"),
                              stdin_problem([("", secret)], pid="reader")])
    assert results[0].tests == ["pass"]
    assert results[1].tests == ["wrong"]
    assert sandbox_leftovers(verifier) == []


def test_stack_frames_and_gc_hold_no_expected_output(run):
    """In-process graders lose to frame walking; here the child's whole heap has nothing to find."""
    secret = f"SECRET-{secrets.token_hex(16)}"
    code = SECRET_SCANNER.replace("print(match.group(0))", "FOUND.append(match.group(0))").replace(
        "os._exit(0)", "pass") + """
FOUND = []
def solve(x):
    frame = sys._getframe()
    while frame is not None:
        scan(repr(frame.f_locals)); scan(repr(frame.f_globals))
        frame = frame.f_back
    for obj in gc.get_objects():
        try:
            scan(repr(obj)[:100000])
        except Exception:
            pass
    return FOUND[0] if FOUND else "nothing found"
"""
    result = run(code, functional_problem("solve", [('"x"', json.dumps(secret))]))
    assert result.tests == ["wrong"]


MEMORY_SCANNER = r"""
import ctypes, re

class IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

libc = ctypes.CDLL(None, use_errno=True)
libc.process_vm_readv.restype = ctypes.c_ssize_t
PATTERN = re.compile("SEC" + r"RET-[0-9a-f]{32}")
control = "SEC" + "RET-" + "c" * 32  # built at run time: present in memory, absent from the source
buffer = ctypes.create_string_buffer(1 << 20)

def read(start, size):
    local, remote = IOVec(ctypes.addressof(buffer), size), IOVec(start, size)
    got = libc.process_vm_readv(libc.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return buffer.raw[:got] if got > 0 else b""

found = set()
with open("/proc/self/maps") as maps:
    regions = [line.split() for line in maps]
for fields in regions:
    start, end = (int(x, 16) for x in fields[0].split("-"))
    if "r" not in fields[1]:
        continue
    for offset in range(start, end, 1 << 20):  # 1 MiB windows, overlapping by 64 bytes
        chunk = read(offset, min(1 << 20, end - offset))
        found.update(PATTERN.findall(chunk.decode("latin-1")))
if control not in found:
    print("scanner broken")
else:
    print(" ".join(sorted(found - {control})) or "nothing found")
"""


def test_earlier_programs_code_and_output_are_not_in_inherited_memory():
    """A sibling's correct answer must not leak: a later program scans its whole address space for it.

    Every child is a fork of the worker's fork server; had the server ever held an earlier program's source or
    output, a copy would sit in this child's memory. One worker, so both programs run on the same one. The
    scanner checks itself: it must find a marker it built at run time, and nothing else.
    """
    code_mark, output_mark = f"SECRET-{secrets.token_hex(16)}", f"SECRET-{secrets.token_hex(16)}"
    earlier = f"note = {code_mark!r}\nprint({output_mark!r})"
    with CodeVerifier(timeout_s=LEGIT_TIMEOUT_S, workers=1) as verifier:
        results = verifier.score([fenced(earlier), "```python\n" + MEMORY_SCANNER + "```"],
                                 [stdin_problem([("", output_mark)], pid="a"),
                                  stdin_problem([("", "nothing found")], pid="b")])
    assert results[0].tests == ["pass"]
    assert results[1].tests == ["pass"], results[1].detail


@pytest.mark.parametrize("code,expected_status", [
    ("import sys\nsys.exit(0)\nprint(int(input()) * 2)", "wrong"),
    ("import os\nos._exit(0)\nprint(int(input()) * 2)", "wrong"),
    ("raise SystemExit(0)\nprint(int(input()) * 2)", "wrong"),
], ids=["sys_exit", "os_exit", "raise_system_exit"])
def test_exit_before_printing_is_not_a_pass(run, code, expected_status):
    result = run(code, stdin_problem([("21\n", "42\n")]))
    assert result.tests == [expected_status]


def test_exit_inside_a_function_is_an_error(run):
    result = run("import sys\ndef double(x):\n    sys.exit(0)", functional_problem("double", [("21", "42")]))
    assert result.tests == ["error"]


@pytest.mark.parametrize("code,expected_status", [
    ("class Anything:\n    def __eq__(self, other):\n        return True\n"
     "def double(x):\n    return Anything()", "error"),
    ("class Sneaky(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
     "def double(x):\n    return Sneaky(7)", "wrong"),
    ("class Sneaky(list):\n    def __eq__(self, other):\n        return True\n"
     "def double(x):\n    return Sneaky([7])", "wrong"),
], ids=["plain_object", "int_subclass", "list_subclass"])
def test_always_equal_objects_do_not_pass(run, code, expected_status):
    result = run(code, functional_problem("double", [("21", "42")]))
    assert result.tests == [expected_status]


def test_huge_stdout_hits_the_output_limit(run):
    result = run("while True:\n    print('x' * 10000)", stdin_problem([("", "x")]))
    assert result.tests == ["output_limit"]


def test_huge_file_hits_the_file_limit_and_is_removed(run):
    result = run("""
        with open("big.bin", "wb") as f:
            while True:
                f.write(b"x" * (1 << 20))
    """, stdin_problem([("", "x")]))
    assert result.tests == ["output_limit"]


def test_reading_stdin_past_eof_fails_fast(run):
    started = time.monotonic()
    result = run("while True:\n    input()", stdin_problem([("1\n2\n", "x")]))
    assert result.tests == ["error"]
    assert time.monotonic() - started < LEGIT_TIMEOUT_S, "EOF must end the read, not block until the timeout"


def test_program_cannot_kill_its_sandbox(verifier):
    """Signals to the fork server are refused; the next program still runs on the same worker."""
    killer = "import os, signal\nfor pid in (1, -1, os.getppid()):\n    try:\n        os.kill(pid, signal.SIGKILL)\n" \
             "    except OSError:\n        pass\nprint(int(input()) * 2)"
    pids_before = verifier.pool.worker_pids
    results = verifier.score([fenced(killer)] * 2 + [fenced("print(int(input()) + 1)")] * 2,
                             [stdin_problem([("21\n", "42\n")], pid=f"k{i}") for i in range(2)] +
                             [stdin_problem([("1\n", "2\n")], pid=f"n{i}") for i in range(2)])
    assert [r.tests for r in results] == [["pass"]] * 4
    assert verifier.pool.worker_pids == pids_before, "no worker may have died and been restarted"


# ------------------------------------------------------------------------------------------------------------
# Legitimate programs that naive sandboxes break.
def test_deep_recursion_of_200k_levels_passes(run):
    result = run("""
        import sys
        from functools import lru_cache
        sys.setrecursionlimit(10 ** 6)

        @lru_cache(maxsize=None)
        def depth(n):  # lru_cache recursion runs on the C stack: needs a large stack limit
            return 0 if n == 0 else depth(n - 1) + 1

        def plain(n):
            return 0 if n == 0 else plain(n - 1) + 1

        n = int(input())
        print(depth(n), plain(n))
    """, stdin_problem([("200000\n", "200000 200000\n")]))
    assert result.tests == ["pass"], result.detail


def test_ten_thousand_digit_integer_prints(run):
    result = run("print(10 ** 9999)", stdin_problem([("", "1" + "0" * 9999)]))
    assert result.tests == ["pass"], result.detail


def test_ten_thousand_digit_integer_returns(run):
    result = run("def power(n):\n    return 10 ** n", functional_problem("power", [("9999", "1" + "0" * 9999)]))
    assert result.tests == ["pass"], result.detail


def test_thread_with_a_big_stack_passes(run):
    """The contest idiom for deep recursion: a thread with a raised stack size; the process waits for it."""
    result = run("""
        import sys, threading
        sys.setrecursionlimit(10 ** 6)
        threading.stack_size(256 * 1024 * 1024)

        def main():
            def down(n):
                return 0 if n == 0 else down(n - 1) + 1
            print(down(int(input())))

        threading.Thread(target=main).start()
    """, stdin_problem([("100000\n", "100000\n")]))
    assert result.tests == ["pass"], result.detail
