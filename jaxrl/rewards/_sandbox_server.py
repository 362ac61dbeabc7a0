"""Fork server of the code sandbox: started once per pool slot, forks one fresh child per test.

This file runs as a *script* inside the sandbox (``python -S -s _sandbox_server.py``), never imported by the
verifier. It uses the standard library only, because once it has built the sandbox's private root the jaxrl
package is no longer visible.

Why a fork server: forking an interpreter that has already imported the common modules costs far less than
starting a cold Python per test (measured in benchmarks/RESULTS.md, section 'Idle machine (the numbers to
quote)', the code verifier rows), and the child still gets a fresh address space, fresh limits and a fresh
working folder.

A blind launcher. Every child is a copy of this process's memory, so this process must never hold anything a
program could profit from: not expected outputs (they never leave the verifier), and not other programs' code
or output either (a program scanning its inherited heap for a sibling's correct answer). So the verifier hands
over *file descriptors* only: a memfd with the program, a memfd with the test input, and the write ends of the
stdout / stderr / result pipes, which the verifier reads itself. This process only forks, limits, waits, kills.

Protocol: one SOCK_SEQPACKET socket on fd 0 (moved away at start-up), one JSON message per packet.
  verifier -> server: config; then per test {"op": "run", "id", "fn_name", "timeout_s"} with 5 descriptors
                      (code, stdin, stdout, stderr, result), and possibly {"op": "kill", "id"} (output cap hit)
  server -> verifier: hello (the isolation achieved, or {"fatal": msg}); per test one header with the exit
                      status, whether the wall clock ran out, and the CPU time used.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import sys
import time

# --------------------------------------------------------------------------------------------------------------
# Constants shared with jaxrl/rewards/sandbox.py (kept as literals there too: this file cannot import jaxrl).
RESULT_FD = 3  # the child's private channel for its final record (functional results, exceptions)
CODE_FD = 4  # the program's source, read by the child and closed before the program runs
EXIT_OK = 0
EXIT_EXCEPTION = 1  # the program raised; the record names the exception type
EXIT_SYNTAX = 2  # the program does not compile
EXIT_SETUP = 3  # the sandbox could not set the child up (a verifier bug or a limit too small)
EXIT_NO_FUNCTION = 4  # functional test: fn_name is neither top level nor a method of class Solution
MAX_MESSAGE = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)

# mount(2) flags (linux/mount.h)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
# prctl(2) options
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    ret = _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(ret, f"mount {source} -> {target}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) when the verifier hung up."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 8)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


def _vm_size() -> int:
    """This process's address-space size: the part of a child's RLIMIT_AS that is the inherited interpreter."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


# --------------------------------------------------------------------------------------------------------------
# Building the private root (namespaces mode). We are PID 1 of fresh PID, network and mount namespaces, as root.
def build_private_root(cfg: dict) -> None:
    """Mount a tmpfs root holding read-only binds of the interpreter and system libraries, then chroot into it.

    Everything else on the host (the dataset, the repository, the verifier's temp folders, /root, /home, ...)
    simply does not exist inside. Writable places: /tmp (a size-capped tmpfs, wiped after every test).
    """
    root = cfg["root"]
    under_tmp = binds_under_tmp(cfg["ro_binds"])
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount leaks back to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    for link, target in cfg["root_symlinks"].items():  # e.g. /bin -> usr/bin on merged-/usr systems
        os.symlink(target, root + link)
    for path in cfg["ro_binds"]:
        if path not in under_tmp:
            _bind_read_only(path, root + path)
    os.makedirs(root + "/dev", exist_ok=True)
    for dev in ("null", "zero", "random", "urandom", "full"):
        target = f"{root}/dev/{dev}"
        open(target, "a").close()
        _mount(f"/dev/{dev}", target, None, MS_BIND)
        _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NOEXEC)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("shm", "/tmp/.shm")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc", exist_ok=True)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/tmp", exist_ok=True)
    tmp_bytes = cfg["limits"]["tmpfs_bytes"]
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_bytes},nr_inodes=4096,mode=1777")
    # A venv under the host's /tmp: bound on top of the private /tmp, or the tmpfs above would hide it. The
    # folders leading to it belong to root (0755), so programs can neither write there nor remove them.
    previous_umask = os.umask(0o022)
    try:
        for path in under_tmp:
            _bind_read_only(path, root + path)
    finally:
        os.umask(previous_umask)
    # Read-only from here: nothing but /tmp is writable, even for code that finds a way to be root again.
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir("/")


def _bind_read_only(path: str, target: str) -> None:
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(path, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def binds_under_tmp(binds: list[str]) -> list[str]:
    """Read-only binds that live inside the private /tmp (e.g. a venv under the host's /tmp)."""
    found = [b for b in binds if b == "/tmp" or b.startswith("/tmp/")]
    if "/tmp" in found:
        raise RuntimeError("cannot bind the host's /tmp itself into the sandbox (site-packages at /tmp?)")
    return found


def only_loopback_network() -> bool:
    try:
        with open("/proc/self/net/dev") as f:
            names = [line.split(":")[0].strip() for line in f.readlines()[2:]]
    except OSError:
        return False
    return names == ["lo"] or names == []


# --------------------------------------------------------------------------------------------------------------
class ForkServer:
    def __init__(self, cfg: dict, sock: socket.socket):
        self.cfg = cfg
        self.sock = sock
        self.mode: str = cfg["mode"]  # "namespaces" | "uid" | "none"
        self.uid: int | None = cfg.get("uid")
        self.gid: int | None = cfg.get("gid")
        self.limits: dict = cfg["limits"]
        self.tmp_dir: str = "/tmp" if self.mode == "namespaces" else cfg["tmp_dir"]
        # Top-level entries of the private /tmp that hold read-only binds: the per-test wipe leaves them.
        self.kept_in_tmp: set[str] = set()
        if self.mode == "namespaces":
            self.kept_in_tmp = {b.split("/")[2] for b in binds_under_tmp(cfg["ro_binds"])}
        work, suffix = "work", 0
        while work in self.kept_in_tmp:
            work, suffix = f"work-{suffix}", suffix + 1
        if ".shm" in self.kept_in_tmp:
            raise RuntimeError("a bound path lies under /tmp/.shm, which the sandbox's /dev/shm needs")
        self.work_dir = os.path.join(self.tmp_dir, work)
        self.is_root = os.geteuid() == 0
        self.own_processes = 0  # processes the (unprivileged) user already runs, plus slack; set in setup()
        self.preamble_code = compile(cfg["preamble"], "<preamble>", "exec") if cfg["preamble"] else None

    # ---------------------------------------------------------------------------------------------- set-up
    def setup(self) -> dict:
        """Join cgroups, build the private root, pre-import modules; return what isolation was achieved."""
        joined = []
        for controller, procs_file in sorted(self.cfg.get("cgroups", {}).items()):
            with open(procs_file, "w") as f:
                f.write("0")  # "0" = the writing process; our children inherit the cgroup
            joined.append(controller)
        # Sandbox children write 1000 to theirs: under memory pressure the kernel kills them, not us. Lowering
        # needs CAP_SYS_RESOURCE, which containers often drop: then the children's 1000 alone has to do.
        _write_best_effort("/proc/self/oom_score_adj", "-1000")
        pid_namespace = os.getpid() == 1
        net_isolated = only_loopback_network()
        private_root = False
        if self.mode == "namespaces":
            if not (pid_namespace and self.is_root):
                raise RuntimeError("namespaces mode needs to run as root PID 1 of a new PID namespace")
            build_private_root(self.cfg)
            private_root = True
        else:
            # Orphaned grandchildren get re-parented to us, so we can reap them after killing them.
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
        for name in self.cfg["preload"]:
            try:
                __import__(name)
            except ImportError:
                pass
        os.makedirs(self.tmp_dir, exist_ok=True)
        if not self.is_root:
            self.own_processes = sum(owner == os.getuid() for owner in _process_uids()) + 64
        # Move everything imported so far out of the collector's reach: a child's first collection would
        # otherwise write to every object header and copy the whole inherited heap (several ms per test).
        gc.collect()
        gc.freeze()
        return {
            "pid_namespace": pid_namespace,
            "net_namespace": net_isolated,
            "private_root": private_root,
            "uid": self.uid if self.is_root and self.uid is not None else None,
            "cgroups": joined,
            "python": sys.version.split()[0],
        }

    # ------------------------------------------------------------------------------------------------ loop
    def shutdown(self) -> None:
        """The verifier closed the socket (or died): kill what is left and remove our folder, then exit."""
        self.kill_everything(None)
        if self.mode != "namespaces":  # (in namespaces mode everything vanishes with the namespace)
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        os._exit(0)

    def serve(self) -> None:
        while True:
            request, fds = receive(self.sock)
            if request is None:
                self.shutdown()
            if request.get("op") != "run" or len(fds) != 5:
                for fd in fds:  # a late "kill" for a test that had already ended
                    os.close(fd)
                continue
            header = self.run_one(request, fds)
            self.sock.send(json.dumps(header).encode())

    def run_one(self, req: dict, fds: list[int]) -> dict:
        self.fresh_work_dir()
        timeout_s = float(req["timeout_s"])
        address_space = _vm_size() + self.limits["memory_bytes"]
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:  # ------------------------------------------------------------------------------ child
            try:
                self.enter_child(fds, timeout_s, address_space)
            except BaseException:  # noqa: BLE001 - nothing of the child may ever return into the server loop
                os._exit(EXIT_SETUP)
            run_program(req, self.preamble_code, self.cfg, self.work_dir)  # never returns
            os._exit(EXIT_SETUP)
        for fd in fds:
            os.close(fd)
        header = self.supervise(pid, started, timeout_s, req.get("id"))
        self.fresh_work_dir(create=False)
        return header

    def fresh_work_dir(self, create: bool = True) -> None:
        """Empty the writable area; in namespaces mode that is all of /tmp (nothing survives a test)."""
        if self.mode == "namespaces":
            for name in os.listdir(self.tmp_dir):
                if name in self.kept_in_tmp:
                    continue
                path = os.path.join(self.tmp_dir, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
        else:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            if self.uid is not None and self.is_root:
                remove_files_of_uid(self.uid)
        if create:
            os.mkdir(self.work_dir, 0o700)
            if self.mode == "namespaces":
                os.mkdir(os.path.join(self.tmp_dir, ".shm"), 0o700)
            if self.uid is not None and self.is_root:
                os.chown(self.work_dir, self.uid, self.gid)
                if self.mode == "namespaces":
                    os.chown(os.path.join(self.tmp_dir, ".shm"), self.uid, self.gid)

    # ------------------------------------------------------------------------------------------ the child
    def enter_child(self, fds: list[int], timeout_s: float, address_space: int) -> None:
        """Runs in the forked child: descriptors, limits, privileges. Order matters (see comments)."""
        os.setsid()  # own session and process group: the killpg fallback needs one
        # Move the verifier's descriptors onto 4 (code), 0 (stdin), 1, 2, 3 (result), then close everything
        # else, the control socket included. Copies above the targets first, so no dup2 overwrites a source.
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 16) for fd in fds]
        for src, dst in zip(moved, (CODE_FD, 0, 1, 2, RESULT_FD)):
            os.dup2(src, dst, inheritable=True)
        os.closerange(CODE_FD + 1, 1 << 16)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGALRM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _write_best_effort("/proc/self/oom_score_adj", "1000")
        lim = self.limits
        cpu = max(1, int(-(-timeout_s // 1)))  # ceil: the wall clock is the precise limit
        for rlimit, value in (
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # soft: SIGXCPU, hard: SIGKILL a second later
            # The memory limit is what the program may add to the interpreter it inherits.
            (resource.RLIMIT_AS, (address_space, address_space)),
            (resource.RLIMIT_FSIZE, (lim["file_size_bytes"], lim["file_size_bytes"])),
            (resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"])),
            (resource.RLIMIT_CORE, (0, 0)),
            (resource.RLIMIT_STACK, (lim["stack_bytes"], lim["stack_bytes"])),
        ):
            # Clamped: raising a hard limit needs CAP_SYS_RESOURCE, which even root may lack in a container.
            resource.setrlimit(rlimit, _clamp_to_hard(rlimit, value))
        if self.uid is not None and self.is_root:
            # Root ignores RLIMIT_NPROC, so the process limit only binds after the switch to the worker's uid.
            resource.setrlimit(resource.RLIMIT_NPROC, _clamp_to_hard(resource.RLIMIT_NPROC, (lim["processes"],) * 2))
            os.setgroups([])
            os.setresgid(self.gid, self.gid, self.gid)
            os.setresuid(self.uid, self.uid, self.uid)
        elif not self.is_root:
            # Unprivileged, the limit counts every process of the user, so it sits above what already runs.
            nproc = self.own_processes + lim["processes"]
            resource.setrlimit(resource.RLIMIT_NPROC, _clamp_to_hard(resource.RLIMIT_NPROC, (nproc, nproc)))
        _prctl(PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries cannot hand privileges back
        os.chdir(self.work_dir)

    # ------------------------------------------------------------------------------------------ supervision
    def supervise(self, pid: int, started: float, timeout_s: float, request_id) -> dict:
        """Wait for the child to exit, the wall clock to run out, or the verifier to ask for a kill."""
        pidfd = _pidfd_open(pid)
        sel = selectors.DefaultSelector()
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ)
        sel.register(self.sock, selectors.EVENT_READ)
        deadline = started + timeout_s
        timed_out = killed_on_request = exited = False
        while not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if pidfd is None:  # kernels before 5.3: poll for the exit every few milliseconds
                remaining = min(remaining, 0.005)
                exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            for key, _ in sel.select(remaining):
                if key.fileobj is self.sock:
                    message, fds = receive(self.sock)
                    for fd in fds:
                        os.close(fd)
                    if message is None:  # the verifier went away: take everything down with us
                        self.kill_everything(pid)
                        self.shutdown()
                    if message.get("op") == "kill" and message.get("id") == request_id:
                        killed_on_request = True  # the verifier saw the output cap exceeded
                else:
                    exited = True
            if killed_on_request:
                break
        if not exited:
            os.kill(pid, signal.SIGKILL)
        _, status, rusage = os.wait4(pid, 0)
        wall_s = time.monotonic() - started
        self.kill_everything(None, pgid=pid)  # whatever the program left behind, escaped or not
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
        return {
            "id": request_id,
            "exit_code": os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": timed_out,
            "killed_on_request": killed_on_request,
            "wall_s": wall_s,
            "cpu_s": rusage.ru_utime + rusage.ru_stime,
            "max_rss_kb": rusage.ru_maxrss,
        }

    def kill_everything(self, main_pid: int | None, pgid: int | None = None) -> None:
        """Kill every process the program started, including ones that escaped its process group."""
        if main_pid is not None:
            try:
                os.kill(main_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.mode == "namespaces" and os.getpid() == 1:
            # PID 1 of a PID namespace: kill(-1) reaches every other process of the namespace and nothing
            # outside it; a setsid() grandchild cannot hide from it. Repeat until a fork race is lost.
            for _ in range(10_000):
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if not reap_children():
                    return
                time.sleep(0.0005)
            return
        if self.uid is not None and self.is_root:
            kill_uid(self.uid)  # reaches setsid() escapees too
        elif (pgid or main_pid) is not None:
            try:  # weakest mode: the process group; a program that calls setsid() escapes it
                os.killpg(pgid or main_pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        reap_children()  # orphans come to us (child subreaper); stragglers are reaped after the next test


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def reap_children() -> bool:
    """Reap every exited child without blocking; return True while live children remain."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def kill_uid(uid: int) -> None:
    """Without a PID namespace: a helper switched to the worker's uid kills everything that uid owns.

    kill(-1) from a process signals every process its uid may signal, i.e. exactly the worker uid's processes,
    wherever they hid (new sessions included). The uid is dedicated to this worker, so nothing else dies.
    """
    for _ in range(20):
        helper = os.fork()
        if helper == 0:
            try:
                os.setresuid(uid, uid, uid)
                # kill(-1) succeeds whenever *any* other process exists, so it cannot tell us when to stop;
                # the caller re-checks /proc and comes back if a fork raced the kill.
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(helper, 0)
        reap_children()
        if not any(owner == uid for owner in _process_uids()):
            return


def _write_best_effort(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:
        pass


def _clamp_to_hard(rlimit: int, value: tuple[int, int]) -> tuple[int, int]:
    """A limit can only be raised above the current hard limit with CAP_SYS_RESOURCE: never ask for that."""
    _, hard = resource.getrlimit(rlimit)
    if hard == resource.RLIM_INFINITY:
        return value
    clamp = lambda v: hard if v == resource.RLIM_INFINITY or v > hard else v  # noqa: E731
    return clamp(value[0]), clamp(value[1])


def _process_uids():
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                yield os.stat(f"/proc/{name}").st_uid
            except OSError:
                pass


def remove_files_of_uid(uid: int) -> None:
    """Without a private /tmp: delete what the worker's uid left in the world-writable folders."""
    for top in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


# --------------------------------------------------------------------------------------------------------------
# Inside the child, after the sandbox is set up: run the program like `python solution.py` would.
def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _report(record: dict) -> None:
    """Write the final record on the private channel. A newline first so program garbage cannot glue onto it."""
    try:
        payload = b"\n" + json.dumps(record).encode() + b"\n"
        while payload:
            payload = payload[os.write(RESULT_FD, payload):]
    except BaseException:  # noqa: BLE001 - the exit code still tells the verifier what happened
        pass


def _finish(code: int) -> None:
    """Shut down the way the interpreter would: wait for non-daemon threads, run atexit, flush, exit."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()  # noqa: SLF001 - what Py_FinalizeEx does
    except BaseException:  # noqa: BLE001
        pass
    try:
        import atexit

        atexit._run_exitfuncs()  # noqa: SLF001
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            if code == EXIT_OK:
                code = EXIT_EXCEPTION
    os._exit(code)


def _describe(exc: BaseException) -> dict:
    record = {"kind": "exception", "type": type(exc).__name__, "message": str(exc)[:300]}
    if isinstance(exc, OSError):
        record["errno"] = exc.errno
    return record


def run_program(req: dict, preamble_code, cfg: dict, work_dir: str) -> None:
    import io
    import types

    # Fresh standard streams over fds 0-2 (the server's own sys.std* point at its control pipes / log).
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", errors="surrogateescape")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False), 1 << 16), encoding="utf-8", errors="surrogateescape")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work_dir,
                       "TMPDIR": work_dir, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
                       "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    source = _read_all(CODE_FD).decode("utf-8", "surrogateescape")
    os.close(CODE_FD)
    filename = os.path.join(work_dir, "solution.py")
    try:
        with open(filename, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(source)
    except OSError:
        pass
    sys.argv = [filename]
    sys.path[:0] = [work_dir]
    sys.path.extend(cfg["site_paths"])
    sys.setrecursionlimit(1000)  # CPython's default; the preamble or the program may raise it
    sys.set_int_max_str_digits(cfg["int_max_str_digits"])
    if "random" in sys.modules:  # pre-imported: reseed, or every run would share the server's random state
        sys.modules["random"].seed(0)
    main = types.ModuleType("__main__")
    main.__file__ = filename
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    namespace = main.__dict__

    try:
        # optimize=0 equals the default here (no -O), but passing the default (-1) costs time on every fresh fork
        # (measured in benchmarks/RESULTS.md, section 'Figures formerly quoted in code comments').
        code_obj = compile(source, filename, "exec", dont_inherit=True, optimize=0)
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as exc:
        _report({"kind": "syntax_error", "type": type(exc).__name__, "message": str(exc)[:300]})
        os._exit(EXIT_SYNTAX)
    fn_name = req.get("fn_name")
    try:
        if preamble_code is not None:
            exec(preamble_code, namespace)
        exec(code_obj, namespace)
        if fn_name is None:
            _report({"kind": "ok"})
            _finish(EXIT_OK)
        target = _resolve_function(namespace, fn_name)
        if target is None:
            _report({"kind": "no_function", "message": f"no function or Solution method named {fn_name!r}"})
            _finish(EXIT_NO_FUNCTION)
        text = os.pread(0, os.fstat(0).st_size, 0).decode("utf-8", "surrogateescape")  # stdin stays unread
        args = [json.loads(line) for line in text.strip("\n").split("\n")] if text.strip() else []
        result = target(*args)
        # Encode *here*: what crosses to the verifier is plain JSON, so an object that claims to equal anything
        # is either rejected (not serialisable) or reduced to the honest value of its base type.
        encoded = json.dumps(result)
    except SystemExit as exc:
        if fn_name is None:  # a stdin program may end with exit(): LiveCodeBench grades its output anyway
            _report({"kind": "ok", "exit": str(exc.code)})
            _finish(EXIT_OK)
        _report({"kind": "exception", "type": "SystemExit", "message": str(exc.code)})
        _finish(EXIT_EXCEPTION)
    except BaseException as exc:  # noqa: BLE001 - every failure of the program is a graded outcome
        try:
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
        _report(_describe(exc))
        _finish(EXIT_EXCEPTION)
    _report({"kind": "ok", "result": encoded})
    _finish(EXIT_OK)


def _resolve_function(namespace: dict, fn_name: str):
    solution_cls = namespace.get("Solution")
    if isinstance(solution_cls, type) and hasattr(solution_cls, fn_name):
        return getattr(solution_cls(), fn_name)
    fn = namespace.get(fn_name)
    return fn if callable(fn) else None


# --------------------------------------------------------------------------------------------------------------
def main() -> None:
    # A large stack for deep recursion must be in place when the interpreter *starts* (the kernel lays out the
    # address space at exec time), so raise the limit and re-exec ourselves once.
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_STACK, (hard, hard))
            os.execv(sys.executable, sys.orig_argv)
        except (OSError, ValueError):
            pass
    if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # the script's folder: nothing of jaxrl should be importable by programs
    # The control socket arrives as fd 0; keep a private copy and point 0 and 1 at /dev/null.
    sock = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    cfg, _ = receive(sock)
    if cfg is None:
        return
    try:
        server = ForkServer(cfg, sock)
        hello = server.setup()
    except BaseException as exc:  # noqa: BLE001 - report why, the verifier decides whether to degrade
        sock.send(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"}).encode())
        os._exit(1)
    sock.send(json.dumps(hello).encode())
    server.serve()


if __name__ == "__main__":
    main()
