"""Running untrusted programs: isolation, limits and a pool of pre-started fork servers.

Layout of one pool slot ("worker"), strongest mode, as root::

    verifier (holds expected outputs, reads outputs, compares)      <- never runs candidate code
      └─ unshare --pid --net --mount --fork --kill-child
           └─ _sandbox_server.py   PID 1 of the new namespaces, chroot into a tmpfs root with read-only binds
                                   of the interpreter and system libraries
                └─ one forked child per test: setuid to the worker's own uid, rlimits, fresh /tmp/work

The fork server is a blind launcher: per test it receives descriptors only (memfds holding the program and
the input, the write ends of the stdout / stderr / result pipes), so neither expected outputs nor any
program's code or output ever enter the memory that later children inherit. The verifier reads the pipes
with size caps and asks the server to kill a program whose output exceeds them.

Modes, chosen by ``isolation=`` ("auto" picks the strongest that starts):
  * ``namespaces``: PID + network + mount namespaces, private read-only root, unprivileged uid per worker,
    cgroup memory/pids limits where the hierarchy is writable. Needs root and util-linux ``unshare``.
  * ``uid``: root without namespaces: unprivileged uid per worker (so RLIMIT_NPROC binds and a kill by uid
    reaches setsid() escapees), rlimits; the network and world-readable files stay reachable.
  * ``none``: rlimits, the pids cgroup if root, and a process-group kill; programs run as the caller's uid
    (the only choice when not root). Degraded; a warning says so.

The pool is bounded by the CPU count: more concurrent programs than cores turns CPU contention into false
timeouts.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import select
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

_SERVER_SCRIPT = Path(__file__).with_name("_sandbox_server.py")
MODES = ("namespaces", "uid", "none")
# Exit codes of the child driver (literals of _sandbox_server.py, which cannot import this module).
EXIT_OK, EXIT_EXCEPTION, EXIT_SYNTAX, EXIT_SETUP, EXIT_NO_FUNCTION = 0, 1, 2, 3, 4
# Modules every child finds already imported: the LiveCodeBench preamble's and the usual contest imports.
PRELOAD_MODULES = (
    "string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random", "statistics",
    "itertools", "functools", "operator", "io", "json", "typing", "decimal", "fractions", "array", "traceback",
)
_MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Per-test resource limits. The wall-clock timeout is per job (problems may carry their own)."""

    memory_mb: int = 1024  # RLIMIT_AS: address space a program may add to the interpreter it inherits
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file the program may write
    output_mb: int = 16  # stdout cap; more is status "output_limit". Never depends on the expected output.
    stderr_kb: int = 64  # stderr kept for diagnostics (the rest is read and dropped)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # RLIMIT_NPROC of the worker's uid (threads count too); binds only off root
    tmpfs_mb: int = 64  # size of the private /tmp (namespaces mode)
    stack_mb: int | None = None  # None: unlimited, as deep recursion in contest code needs

    def as_server_config(self) -> dict:
        """What the fork server enforces (the output caps are enforced here, where the output is read)."""
        return {
            "memory_bytes": self.memory_mb * _MIB,
            "file_size_bytes": self.file_size_mb * _MIB,
            "open_files": self.open_files,
            "processes": self.processes,
            "tmpfs_bytes": self.tmpfs_mb * _MIB,
            "stack_bytes": -1 if self.stack_mb is None else self.stack_mb * _MIB,  # -1 == RLIM_INFINITY
        }


@dataclass(frozen=True)
class Job:
    """One program run on one test input. ``fn_name`` None means a stdin/stdout program."""

    code: str
    input: str
    fn_name: str | None
    timeout_s: float


@dataclass
class Execution:
    """Raw facts about one run, with no judgement: classification happens in the verifier."""

    stdout: bytes = b""
    stderr: bytes = b""
    record: dict | None = None  # the child's final record: {"kind": "ok" | "exception" | "syntax_error" ...}
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    output_exceeded: bool = False
    wall_s: float = 0.0  # the program's own wall time, measured by the fork server
    cpu_s: float = 0.0
    round_trip_s: float = 0.0  # what the verifier waited, overhead included
    infra_error: str | None = None  # the sandbox itself failed (worker died); the run counts as an error


@dataclass(frozen=True)
class Isolation:
    """What the running workers actually achieved (reported by the fork server, not assumed)."""

    mode: str
    pid_namespace: bool = False
    net_namespace: bool = False
    private_root: bool = False
    uid: int | None = None
    cgroups: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = [self.mode]
        if self.pid_namespace:
            parts.append("pidns")
        if self.net_namespace:
            parts.append("netns")
        if self.private_root:
            parts.append("private-root")
        if self.uid is not None:
            parts.append("uid")
        parts.extend(f"cgroup-{c}" for c in self.cgroups)
        parts.append("rlimits")
        return "+".join(parts)


class SandboxError(RuntimeError):
    """The sandbox could not start in the requested mode."""


@dataclass
class SandboxSettings:
    limits: Limits = field(default_factory=Limits)
    preamble: str = ""  # Python source run before every program, in its namespace
    int_max_str_digits: int = 0  # 0: unlimited (a 10,000-digit integer prints); LiveCodeBench uses 50000
    site_packages: bool = False  # expose the verifier's site-packages (numpy ...) read-only to programs
    uid_base: int | None = None  # first uid of this pool's workers; None picks a free-looking range


# ------------------------------------------------------------------------------------------------------------
# Talking to a worker: one JSON message per SOCK_SEQPACKET packet, descriptors as SCM_RIGHTS.
_MAX_MESSAGE = 1 << 20


def _receive(sock: socket.socket, deadline: float) -> dict:
    timeout = deadline - time.monotonic()
    if timeout <= 0 or not select.select([sock], [], [], timeout)[0]:
        raise TimeoutError("sandbox worker did not answer in time")
    data = sock.recv(_MAX_MESSAGE)
    if not data:
        raise EOFError("sandbox worker exited")
    return json.loads(data)


def _memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, positioned at its start."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# ------------------------------------------------------------------------------------------------------------
def _base_python() -> str:
    """The real interpreter behind a venv: its stdlib is all a program gets unless site_packages=True."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _site_paths() -> list[str]:
    import site

    paths = [*site.getsitepackages(), site.getusersitepackages()]
    return [os.path.realpath(p) for p in paths if os.path.isdir(p)]


def _read_only_view(site_paths: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Host paths bound read-only into the private root, and top-level symlinks to recreate (merged /usr)."""
    binds: list[str] = []
    symlinks: dict[str, str] = {}
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            symlinks[top] = os.readlink(top)
        elif os.path.isdir(top):
            binds.append(top)
    binds.append("/usr")
    for etc in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd",
                "/etc/group", "/etc/nsswitch.conf"):
        if os.path.exists(etc):
            binds.append(etc)
    python = _base_python()
    for needed in (os.path.realpath(sys.base_prefix), os.path.dirname(python), *site_paths):
        if not any(needed == b or needed.startswith(b.rstrip("/") + "/") for b in binds):
            binds.append(needed)
    return binds, symlinks


_POOL_SLOTS = itertools.count()  # distinguishes pools of one process (uids, cgroup names)
_SLOTS_PER_PROCESS, _UIDS_PER_SLOT = 16, 64


def _default_uid_base(slot: int) -> int:
    """A uid range nobody uses, distinct per process and per pool (so concurrent pools never share a uid)."""
    try:
        with open("/proc/self/uid_map") as f:
            spans = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except OSError:
        spans = [(0, 0, 1 << 32)]
    offset = (slot % _SLOTS_PER_PROCESS) * _UIDS_PER_SLOT
    if any(start == 0 and length >= (1 << 31) for start, _, length in spans):
        return (1 << 30) + (os.getpid() % (1 << 20)) * _SLOTS_PER_PROCESS * _UIDS_PER_SLOT + offset
    # A container mapping only 16-bit uids: stay below 65536 (collisions across processes are then possible,
    # and harmless in namespaces mode, where workers cannot see each other).
    return 50_000 + (os.getpid() % 12) * _SLOTS_PER_PROCESS * _UIDS_PER_SLOT + offset


def _make_cgroups(name: str, limits: Limits) -> dict[str, str]:
    """Best effort: a memory and a pids cgroup for one worker. Returns {controller: cgroup.procs path}."""
    made: dict[str, str] = {}
    memory_limit = limits.memory_mb * _MIB * 3 // 2 + 128 * _MIB  # the program + the fork server + slack
    pids_limit = limits.processes + 16
    v1 = {"memory": ("memory.limit_in_bytes", memory_limit), "pids": ("pids.max", pids_limit)}
    for controller, (knob, value) in v1.items():
        base = f"/sys/fs/cgroup/{controller}"
        if not os.path.isfile(f"{base}/cgroup.procs"):
            continue
        path = f"{base}/jaxrl-verifier/{name}"
        try:
            os.makedirs(path, exist_ok=True)
            Path(path, knob).write_text(str(value))
            made[controller] = f"{path}/cgroup.procs"
        except OSError as exc:
            logger.debug("cgroup %s unavailable: %s", controller, exc)
    if made or not os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
        return made
    try:  # cgroup v2: a leaf under a group at the hierarchy's root (the root is exempt from "no internal procs")
        parent = "/sys/fs/cgroup/jaxrl-verifier"
        os.makedirs(parent, exist_ok=True)
        Path("/sys/fs/cgroup/cgroup.subtree_control").write_text("+memory +pids")
        Path(parent, "cgroup.subtree_control").write_text("+memory +pids")
        leaf = f"{parent}/{name}"
        os.makedirs(leaf, exist_ok=True)
        Path(leaf, "memory.max").write_text(str(memory_limit))
        Path(leaf, "pids.max").write_text(str(pids_limit))
        return {"memory+pids": f"{leaf}/cgroup.procs"}
    except OSError as exc:
        logger.debug("cgroup v2 unavailable: %s", exc)
        return {}


def _remove_stale_cgroups() -> None:
    """Remove the empty cgroups of verifier processes that died without closing (names start with the pid)."""
    for parent in ("/sys/fs/cgroup/memory/jaxrl-verifier", "/sys/fs/cgroup/pids/jaxrl-verifier",
                   "/sys/fs/cgroup/jaxrl-verifier"):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            owner = name.split("-", 1)[0]
            if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass


def _remove_cgroups(procs_files: dict[str, str]) -> None:
    for procs in procs_files.values():
        leaf = os.path.dirname(procs)
        for _ in range(100):  # the namespace's processes take a moment to leave after PID 1 dies
            try:
                os.rmdir(leaf)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)
        try:
            os.rmdir(os.path.dirname(leaf))  # the shared parent, when this was the last pool using it
        except OSError:
            pass


# ------------------------------------------------------------------------------------------------------------
class _Worker:
    """One fork server process and the pipes to it. Not thread-safe: the pool gives each one thread.

    Files on the host: none in namespaces mode (the private root is a tmpfs mounted inside the worker's own
    mount namespace). In the other modes a 0711 temporary folder holds the per-test work folder; the server
    removes it when it exits, even if the verifier died without closing.
    """

    def __init__(self, index: int, mode: str, settings: SandboxSettings, uid: int | None, cgroup_name: str):
        self.index = index
        self.mode = mode
        self.settings = settings
        self.uid = uid
        self.cgroup_name = cgroup_name
        self.dir: str | None = None
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self._requests = 0
        self.log = None  # an anonymous temporary file: the server's stderr, read back when it fails
        self.cgroups: dict[str, str] = {}
        self.isolation: Isolation | None = None

    def _command(self) -> list[str]:
        server = [_base_python(), "-S", "-s", "-B", str(_SERVER_SCRIPT)]
        if self.mode != "namespaces":
            return server
        unshare = shutil.which("unshare") or "/usr/bin/unshare"
        # --kill-child: if unshare dies (the verifier killed it), its child, our PID 1, gets SIGKILL, and with it
        # the whole PID namespace.
        return [unshare, "--pid", "--fork", "--kill-child", "--net", "--mount", "--", *server]

    def start(self) -> Isolation:
        is_root = os.geteuid() == 0
        switch_uid = is_root and self.mode != "none"  # "none" runs programs as the caller (tests, debugging)
        config = {
            "mode": self.mode,
            "uid": self.uid if switch_uid else None,
            "gid": self.uid if switch_uid else None,
            "limits": self.settings.limits.as_server_config(),
            "preamble": self.settings.preamble,
            "int_max_str_digits": self.settings.int_max_str_digits,
            "preload": list(PRELOAD_MODULES),
            "site_paths": _site_paths() if self.settings.site_packages else [],
        }
        if self.mode == "namespaces":
            binds, symlinks = _read_only_view(config["site_paths"])
            config.update(root=_private_root_mountpoint(binds), ro_binds=binds, root_symlinks=symlinks)
        else:
            self.dir = tempfile.mkdtemp(prefix=f"jaxrl-verifier-{os.getpid()}-w{self.index}-")
            os.chmod(self.dir, 0o711)  # the worker's uid traverses it to its own 0700 work folder
            config["tmp_dir"] = self.dir
        if is_root:
            self.cgroups = _make_cgroups(self.cgroup_name, self.settings.limits)
            config["cgroups"] = self.cgroups
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1", "MALLOC_ARENA_MAX": "2"}
        self.log = tempfile.TemporaryFile()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(self._command(), stdin=theirs.fileno(), stdout=subprocess.DEVNULL,
                                         stderr=self.log, env=env, cwd="/", close_fds=True,
                                         start_new_session=True)
        except OSError as exc:
            ours.close()
            self.close()
            raise SandboxError(f"sandbox worker ({self.mode}) could not be launched: {exc}") from exc
        finally:
            theirs.close()
        self.sock = ours
        try:
            self.sock.send(json.dumps(config).encode())
            hello = _receive(self.sock, time.monotonic() + 60)
        except (OSError, EOFError, TimeoutError, ValueError) as exc:
            hello = {"fatal": f"{type(exc).__name__}: {exc}; stderr: {self.log_tail()}"}
        if "fatal" in hello:
            self.close()
            raise SandboxError(f"sandbox worker ({self.mode}) failed to start: {hello['fatal']}")
        self.isolation = Isolation(
            mode=self.mode, pid_namespace=hello["pid_namespace"], net_namespace=hello["net_namespace"],
            private_root=hello["private_root"], uid=hello["uid"], cgroups=tuple(hello["cgroups"]))
        return self.isolation

    def log_tail(self) -> str:
        if self.log is None:
            return ""
        try:
            self.log.seek(0)
            return self.log.read()[-2000:].decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def execute(self, job: Job) -> Execution:
        """Run one job; a dead worker is restarted and the job retried once if it had not been sent yet."""
        for attempt in range(2):
            if not self.alive:
                self.close()
                try:
                    self.start()
                except SandboxError as exc:
                    return Execution(infra_error=str(exc))
            self._requests += 1
            request_id = self._requests
            request = json.dumps({"op": "run", "id": request_id, "fn_name": job.fn_name,
                                  "timeout_s": job.timeout_s}).encode()
            # The worker gets descriptors only: it never holds the program, the input or any output in its
            # memory, which every later child inherits.
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            res_r, res_w = os.pipe()
            theirs = [_memfd("code", job.code.encode("utf-8", "surrogateescape")),
                      _memfd("stdin", job.input.encode("utf-8", "surrogateescape")), out_w, err_w, res_w]
            started = time.monotonic()
            try:
                socket.send_fds(self.sock, [request], theirs)
            except OSError:
                for fd in (out_r, err_r, res_r):
                    os.close(fd)
                if attempt == 0:
                    self.close()
                    continue
                return Execution(infra_error="could not reach the sandbox worker")
            finally:
                for fd in theirs:
                    os.close(fd)
            try:
                return self._collect(request_id, out_r, err_r, res_r, started, job.timeout_s)
            except (OSError, EOFError, TimeoutError, ValueError) as exc:
                logger.warning("sandbox worker %d failed during a run: %s %s", self.index, exc, self.log_tail())
                self.close()
                return Execution(infra_error=f"sandbox worker failed: {exc}", timed_out=isinstance(exc, TimeoutError))
            finally:
                for fd in (out_r, err_r, res_r):
                    os.close(fd)
        raise AssertionError("unreachable")

    def _collect(self, request_id: int, out_r: int, err_r: int, res_r: int, started: float,
                 timeout_s: float) -> Execution:
        """Read the program's output under caps while the worker supervises it; then its exit header."""
        limits = self.settings.limits
        caps = {out_r: limits.output_mb * _MIB, err_r: limits.stderr_kb * 1024, res_r: limits.output_mb * _MIB + 4096}
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: [], res_r: []}
        sizes = dict.fromkeys(chunks, 0)
        output_exceeded = False
        header: dict | None = None
        # The worker kills the program at timeout_s; this margin only covers a worker that wedged.
        backstop = started + timeout_s + 30.0
        drain_until = None
        with selectors.DefaultSelector() as sel:
            for fd in chunks:
                sel.register(fd, selectors.EVENT_READ)
            sel.register(self.sock, selectors.EVENT_READ)
            open_pipes = set(chunks)
            while open_pipes or header is None:
                now = time.monotonic()
                if header is not None and now >= drain_until:
                    break  # only an escaped process (weakest mode) still holds a pipe open
                limit = drain_until if header is not None else backstop
                if now >= limit:
                    raise TimeoutError("sandbox worker did not report the end of the run")
                for key, _ in sel.select(limit - now):
                    if key.fileobj is self.sock:
                        message = _receive(self.sock, backstop)
                        if message.get("id") != request_id:
                            raise ValueError(f"sandbox worker answered request {message.get('id')}, not {request_id}")
                        header = message
                        sel.unregister(self.sock)
                        # Every process of the program is dead now, so the pipes reach EOF at once.
                        drain_until = time.monotonic() + 1.0
                        continue
                    fd = key.fd
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        sel.unregister(fd)
                        open_pipes.discard(fd)
                        continue
                    room = caps[fd] - sizes[fd]
                    if len(chunk) > room:
                        chunk = chunk[:max(room, 0)]
                        if fd != err_r and not output_exceeded:  # stderr is diagnostics: keep the head only
                            output_exceeded = True
                            if header is None:
                                self.sock.send(json.dumps({"op": "kill", "id": request_id}).encode())
                    chunks[fd].append(chunk)
                    sizes[fd] += len(chunk)
        return Execution(
            stdout=b"".join(chunks[out_r]), stderr=b"".join(chunks[err_r]),
            record=_last_record(b"".join(chunks[res_r])), exit_code=header["exit_code"], signal=header["signal"],
            timed_out=header["timed_out"], output_exceeded=output_exceeded, wall_s=header["wall_s"],
            cpu_s=header["cpu_s"], round_trip_s=time.monotonic() - started)

    def close(self) -> None:
        proc, self.proc = self.proc, None
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()  # EOF: the server returns from its loop; as PID 1 it takes its namespace along
        if proc is not None:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()  # unshare --kill-child forwards this as SIGKILL to PID 1
                proc.wait()
        _remove_cgroups(self.cgroups)
        self.cgroups = {}
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if self.log is not None:
            self.log.close()
            self.log = None


def _private_root_mountpoint(binds: Sequence[str]) -> str:
    """A directory to mount the private root's tmpfs on, inside the worker's own mount namespace.

    The host never sees the mount, so no host folder is needed; it only must not hide a path we bind from.
    """
    for candidate in ("/mnt", "/media", "/srv", "/opt", "/tmp"):
        if os.path.isdir(candidate) and not any(b == candidate or b.startswith(candidate + "/") for b in binds):
            return candidate
    raise SandboxError("no directory to mount the private root on (tried /mnt, /media, /srv, /opt, /tmp)")


def _last_record(channel: bytes) -> dict | None:
    """The driver's record is the last JSON line on the result channel (earlier bytes may be program noise)."""
    for line in reversed(channel.split(b"\n")):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                return None
            return record if isinstance(record, dict) and "kind" in record else None
    return None


def _shutdown(workers: list[_Worker], owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked copy of the verifier must not tear down the original's workers
        return
    for worker in workers:
        worker.close()


# ------------------------------------------------------------------------------------------------------------
class SandboxPool:
    """A fixed set of sandbox workers (at most one per CPU core) that run jobs in parallel.

    Workers start on first use and stay up between calls; ``close()`` (or garbage collection, or interpreter
    exit) stops them and removes every file the pool made.
    """

    def __init__(self, workers: int | None = None, isolation: str = "auto",
                 settings: SandboxSettings | None = None):
        if isolation not in ("auto", *MODES):
            raise ValueError(f"isolation must be 'auto' or one of {MODES}, got {isolation!r}")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        requested = cores if workers is None else int(workers)
        if requested < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.num_workers = min(requested, cores, _UIDS_PER_SLOT)
        self._slot = next(_POOL_SLOTS)
        self.requested_isolation = isolation
        self.settings = settings or SandboxSettings()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._isolation: Isolation | None = None
        self._finalizer: weakref.finalize | None = None

    # -------------------------------------------------------------------------------------------- start-up
    def _candidate_modes(self) -> list[str]:
        if self.requested_isolation != "auto":
            return [self.requested_isolation]
        if os.geteuid() != 0:
            return ["none"]
        return ["namespaces", "uid", "none"] if shutil.which("unshare") else ["uid", "none"]

    def _start(self) -> None:
        if self._workers:
            return
        if os.geteuid() == 0:
            _remove_stale_cgroups()
        uid_base = self.settings.uid_base if self.settings.uid_base is not None else _default_uid_base(self._slot)
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, os.getpid())
        errors = []
        for mode in self._candidate_modes():
            try:
                for index in range(self.num_workers):
                    worker = _Worker(index, mode, self.settings, uid_base + index,
                                     cgroup_name=f"{os.getpid()}-{self._slot}-{index}")
                    self._workers.append(worker)
                    isolation = worker.start()
                self._isolation = isolation
                break
            except SandboxError as exc:
                errors.append(str(exc))
                for worker in self._workers:
                    worker.close()
                self._workers.clear()
        if not self._workers:
            self.close()
            raise SandboxError("no sandbox mode could start:\n" + "\n".join(errors))
        if errors or self._isolation.mode == "none":
            why = errors[0] if errors else (
                "requested" if self.requested_isolation == "none" else "not running as root")
            message = f"code sandbox degraded to isolation '{self._isolation.describe()}' ({why})"
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            logger.warning(message)

    @property
    def worker_pids(self) -> list[int]:
        """Host pids of the running workers' top processes (``unshare`` or the fork server)."""
        return [w.proc.pid for w in self._workers if w.proc is not None]

    @property
    def worker_dirs(self) -> list[str]:
        """The workers' folders on the host (none in namespaces mode; removed by close())."""
        return [w.dir for w in self._workers if w.dir is not None]

    @property
    def isolation(self) -> Isolation:
        with self._lock:
            self._start()
            return self._isolation

    # ------------------------------------------------------------------------------------------------- run
    def run(self, jobs: Sequence[Job], groups: Sequence[int] | None = None,
            stop_group_if: Callable[[Execution], bool] | None = None) -> list[Execution | None]:
        """Run every job; results come back in job order.

        ``groups``/``stop_group_if``: once a run of a group satisfies the predicate (e.g. the program does not
        compile), the group's jobs that have not started are skipped and come back as ``None``. Use it only for
        outcomes every job of the group would share, so results stay deterministic.
        """
        with self._lock:
            self._start()
            results: list[Execution | None] = [None] * len(jobs)
            pending = deque(range(len(jobs)))
            stopped: set[int] = set()
            queue_lock = threading.Lock()

            def drive(worker: _Worker) -> None:
                while True:
                    with queue_lock:
                        while pending and groups is not None and groups[pending[0]] in stopped:
                            pending.popleft()
                        if not pending:
                            return
                        i = pending.popleft()
                    execution = worker.execute(jobs[i])
                    results[i] = execution
                    if stop_group_if is not None and groups is not None and stop_group_if(execution):
                        with queue_lock:
                            stopped.add(groups[i])

            active = self._workers[: max(1, min(len(self._workers), len(jobs)))]
            if len(active) == 1:
                drive(active[0])
            else:
                threads = [threading.Thread(target=drive, args=(w,), daemon=True) for w in active]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            return results

    def close(self) -> None:
        """Stop the workers and remove the pool's folders. The pool restarts on next use."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._workers.clear()
        self._isolation = None

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
