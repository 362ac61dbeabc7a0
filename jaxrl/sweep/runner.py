"""Run a sweep on one machine: a folder per point, training (then evaluation) in a subprocess per point.

    spec = load_sweep("configs/sweeps/dpo_tiny_losses.py")
    runner = SweepRunner(spec, "runs/sweep")
    runner.plan()        # [PlannedPoint]: point, resolved config, folder, current state (writes nothing)
    runner.run()         # skips finished points, resumes interrupted ones; returns a summary

Layout of `OUT/` (the sweep folder)::

    sweep.json                    the spec as expanded: axes, baseline, every point (slug, labels, settings)
    logs/prepare.log              the output of the spec's `prepare` commands (run before any point)
    <slug>/config.json            the point's resolved config (the trainer's workdir is the point folder)
    <slug>/point.json             its labels, values and settings
    <slug>/status.json            state pending | running | done | failed, phase train | evaluate, attempts
                                  (start, end, seconds, exit status, pid, host, resumed_from_step), error
    <slug>/logs/{train,evaluate}.log    the subprocesses' output, one section per attempt
    <slug>/metrics.jsonl, checkpoints/, ...    the trainer's workdir
    <slug>/eval/                  launchers.evaluate output (results.json, samples/) when the spec has `evaluate`
    .jax_cache/                   JAX's persistent compilation cache shared by the points (same shapes compile once)

Why a subprocess per point: a crash (or an OOM) in one point does not end the sweep, every point starts from a
clean device, and a killed sweep leaves the running point exactly as a killed `launchers.train` leaves it: the
next run starts it again in the same folder and the trainer resumes from its newest checkpoint. A point's
subprocess kills itself when the sweep process that started it dies (jaxrl.sweep.point's watchdog), so a
killed sweep never leaves a training running that a resumed sweep would race with.

Interrupts (SIGINT / SIGTERM with jaxrl.utils.interrupt installed, as launchers.sweep does): the signal is
passed on once to the running point's subprocess (started in its own process group, so a terminal's Ctrl-C
reaches it only this way), which finishes its step or batch, writes it and exits; the point goes back to
`pending` and Interrupted is raised. Rerunning the sweep resumes it from its checkpoint.

State rules on (re)running: `done` is skipped; `running` whose process is gone (a killed sweep) is resumed;
`running` whose process is alive is left alone; `failed` is retried (`retry_failed=False`: skipped); a point
whose folder holds a run of a different config is refused (the message lists the keys that differ).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from jaxrl.algorithms.plugins import REFERENCES
from jaxrl.data.formats import CONFIG_FILE, EVAL_DIR
from jaxrl.evaluation import flags as evaluate_flags
from jaxrl.sweep.flags import SweepSettings
from jaxrl.sweep.spec import Point, SweepError, SweepSpec, as_today
from jaxrl.utils import interrupt
from jaxrl.utils.io import atomic_copy, atomic_write_json, iter_jsonl

SWEEP_FILE = "sweep.json"
POINT_FILE = "point.json"
STATUS_FILE = "status.json"
LOG_DIR = "logs"
CACHE_DIR = ".jax_cache"
STATES = ("pending", "running", "done", "failed")
_EVAL_RESERVED = ("checkpoints", "out")  # the runner sets these


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def read_json(path) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def merged_metrics(path) -> list[dict]:
    """metrics.jsonl as one record per step, later lines updating earlier ones (the trainer logs checkpoint-time
    evaluation as a second line of the same step; a resumed run re-logs the steps after its checkpoint)."""
    by_step: dict[int, dict] = {}
    if not os.path.exists(path):
        return []
    for _, rec in iter_jsonl(path, skip_malformed=True):  # a line torn by a kill is not a result
        if isinstance(rec.get("step"), int):
            by_step.setdefault(rec["step"], {}).update(rec)
    return [by_step[s] for s in sorted(by_step)]


def _flatten(d, prefix=""):
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(old: dict, new: dict) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _alive(pid: Optional[int], marker: str) -> bool:
    """Whether process `pid` exists and (where /proc tells) runs for the folder `marker` (pids are reused)."""
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    cmdline = Path(f"/proc/{int(pid)}/cmdline")
    if cmdline.exists():
        try:
            return marker in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
    return True


def _state_steps(point_dir: Path) -> int:
    """Steps of the newest complete-looking training state (for the attempt record only; the trainer decides)."""
    root = point_dir / "checkpoints" / "state"
    steps = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    return max(steps, default=0)


def _error_summary(log_path: Path, max_chars: int = 1500) -> str:
    """The last exception line of the log (what a reader needs first), and the log's tail."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return ""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    last_exc = next((ln for ln in reversed(lines) if re.match(r"^[\w.]*(Error|Exception|Exit)\b.*", ln)
                     or ln.startswith("ERROR:")), "")
    tail = "\n".join(lines[-12:])[-max_chars:]
    return (last_exc + "\n---\n" if last_exc else "") + tail


def _wait(proc: subprocess.Popen) -> int:
    """The child's exit status; an interrupt (jaxrl.utils.interrupt) is passed on to it once, so it stops at its next
    safe point, and a child still running when this returns abnormally is killed, never left behind."""
    try:
        rc, passed_on = None, False
        while rc is None:
            try:
                rc = proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if interrupt.requested() is not None and not passed_on:
                    proc.send_signal(interrupt.requested())
                    passed_on = True
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): do not leave the child behind
            proc.kill()
            proc.wait()
    return rc


def evaluate_args(evaluate: dict, where: str) -> list[str]:
    """launchers.evaluate command-line flags from a sweep's `evaluate` dict (checked against its flags,
    jaxrl.evaluation.flags)."""
    known = set(evaluate_flags.NAMES)
    args = []
    for key, value in evaluate.items():
        if key in _EVAL_RESERVED:
            raise SweepError(f"{where}: evaluate[{key!r}] is set by the sweep runner (the point's checkpoints and "
                             f"its eval/ folder)")
        if key not in known:
            raise SweepError(f"{where}: evaluate[{key!r}]: launchers.evaluate has no --{key}; flags: "
                             f"{', '.join(sorted(known - set(_EVAL_RESERVED)))}")
        if isinstance(value, bool):
            args.append(f"--{key}" if value else f"--no{key}")
        elif isinstance(value, (list, tuple)):
            args.append(f"--{key}=" + ",".join(str(v) for v in value))
        elif isinstance(value, dict):
            args.append(f"--{key}={json.dumps(value)}")
        else:
            args.append(f"--{key}={value}")
    return args


@dataclasses.dataclass
class PlannedPoint:
    point: Point
    config: dict  # resolved
    dir: Path
    state: str  # new | pending | running | done | failed
    conflict: list  # config keys that differ from the run already in the folder (empty: none)
    status: Optional[dict]


class SweepRunner:
    """Plans, prepares and runs the points of one sweep into `out` (module docstring).

    jobs: points run at the same time (one machine; 1 on an accelerator). compilation_cache: JAX's persistent
    compilation cache folder for the points ("" = off; default OUT/.jax_cache; an inherited
    JAX_COMPILATION_CACHE_DIR wins). retry_failed: rerun failed points. force: also take over points marked
    running by a process this machine cannot see (another host). echo: progress lines.
    """

    def __init__(self, spec: SweepSpec, out: str, *, jobs: int = SweepSettings.jobs,
                 compilation_cache: Optional[str] = SweepSettings.compilation_cache,
                 retry_failed: bool = SweepSettings.retry_failed, force: bool = SweepSettings.force,
                 python: str = sys.executable,
                 echo: Callable[[str], None] = lambda msg: print(msg, flush=True)):
        if jobs < 1:
            raise SweepError(f"jobs must be >= 1, got {jobs}")
        self.spec, self.out = spec, Path(out).absolute()
        self.jobs, self.retry_failed, self.force, self.python = jobs, retry_failed, force, python
        self.cache = os.path.join(self.out, CACHE_DIR) if compilation_cache is None else compilation_cache
        self._echo, self._lock = echo, threading.Lock()
        self.eval_args = evaluate_args(spec.evaluate, spec.where) if spec.evaluate else None
        self._points = spec.points()

    def echo(self, msg: str) -> None:
        with self._lock:
            self._echo(msg)

    # ------------------------------------------------------------------------------------------------ planning
    def select(self, only: Optional[str] = None) -> list[Point]:
        """The points whose slug equals `only` or whose slug / name contains it (all when None)."""
        if not only:
            return list(self._points)
        exact = [p for p in self._points if p.slug == only]
        chosen = exact or [p for p in self._points if only in p.slug or only in p.name]
        if not chosen:
            raise SweepError(f"no point of {self.spec.where} matches {only!r}; points: "
                             f"{', '.join(p.slug for p in self._points)}")
        return chosen

    def plan(self, only: Optional[str] = None) -> list[PlannedPoint]:
        """Resolve every selected point's config (all errors now, before anything runs) and read its state."""
        out = []
        for p in self.select(only):
            cfg = self.spec.resolve(p)
            d = self.out / p.slug
            status = read_json(d / STATUS_FILE)
            old = read_json(d / CONFIG_FILE)
            started = bool(status and (status.get("attempts") or status["state"] != "pending"))
            conflict = config_diff(as_today(old), cfg) if (old is not None and started and old != cfg) else []
            out.append(PlannedPoint(p, cfg, d, status["state"] if status else "new", conflict, status))
        return out

    def prepare(self, planned: Sequence[PlannedPoint]) -> None:
        """Write sweep.json and each point's config.json / point.json / status.json (pending when new)."""
        bad = [pp for pp in planned if pp.conflict]
        if bad:
            lines = "\n".join(f"  {pp.dir}: " + "; ".join(pp.conflict[:8]) + (" ..." if len(pp.conflict) > 8 else "")
                              for pp in bad)
            raise SweepError(f"{len(bad)} point folder(s) hold runs of another config (the sweep file or the base "
                             f"config changed since they ran):\n{lines}\nRestore the old values, delete those "
                             "folders, or sweep into a new --out.")
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.out / SWEEP_FILE, {**self.spec.to_dict(),
                                                  "points": [p.to_dict() for p in self._points]})
        for pp in planned:
            pp.dir.mkdir(parents=True, exist_ok=True)
            # Unchanged files are left alone: a finished point's folder is not touched by a rerun.
            for name, content in ((CONFIG_FILE, pp.config), (POINT_FILE, {**pp.point.to_dict(),
                                                                          "sweep": self.spec.where,
                                                                          "base": self.spec.base})):
                if read_json(pp.dir / name) != content:
                    atomic_write_json(pp.dir / name, content)
            if pp.status is None:
                pp.status = {"state": "pending", "phase": None, "trained": False, "evaluated": False,
                             "attempts": [], "created": now(), "updated": now(), "error": None}
                atomic_write_json(pp.dir / STATUS_FILE, pp.status)

    def check_plugins(self, planned: Sequence[PlannedPoint]) -> None:
        """Check the points' plug-ins and the objective names they use (`dpo.loss_type`, `grpo.kl_estimator`,
        `reward.name`, ...; jaxrl.algorithms.plugins) on the CPU in a subprocess: this process never touches the
        accelerator, so the points get the whole device. A malformed plug-in or an unknown name stops the sweep
        before any point trains."""
        seen: dict[str, tuple] = {}
        for pp in planned:
            c = pp.config
            part = {"plugins": c.get("plugins") or [], "dpo": {"plugin": (c.get("dpo") or {}).get("plugin", "")}}
            for key, _ in REFERENCES:
                block, leaf = key.split(".")
                if isinstance(c.get(block), dict) and leaf in c[block]:
                    part.setdefault(block, {})[leaf] = c[block][leaf]
            key = json.dumps(part, sort_keys=True)
            if key not in seen:
                seen[key] = (pp, part)
        if not seen:
            return
        with tempfile.TemporaryDirectory() as tmp:
            paths = {}
            for i, (pp, part) in enumerate(seen.values()):
                paths[os.path.join(tmp, f"point{i}.json")] = pp
                with open(os.path.join(tmp, f"point{i}.json"), "w") as f:
                    json.dump(part, f)
            # one process for all of them: its start (jax import) is most of the cost
            proc = subprocess.run([self.python, "-m", "jaxrl.algorithms.plugins", *paths], capture_output=True,
                                  text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        if proc.returncode != 0:
            msg = proc.stderr.strip().splitlines()
            detail = next((ln for ln in reversed(msg) if ln.startswith("PluginError")), "\n".join(msg[-15:]))
            pp = next((p for path, p in paths.items() if path in detail), None)
            for path in paths:
                detail = detail.replace(path + ": ", "")
            where = f" for point {pp.point.name} ({pp.dir / CONFIG_FILE})" if pp else ""
            raise SweepError(f"plug-in check failed{where}: {detail}")

    # ------------------------------------------------------------------------------------------------ commands
    def point_command(self, slug: str) -> str:
        """The shell command that runs one point with the same bookkeeping; it starts with `cd` to this working
        directory, so relative paths in the configs (pairs, problems) mean what they mean here."""
        sweep = self.spec.path + (f":{self.spec.arg}" if self.spec.arg else "")
        run = " ".join(shlex.quote(a) for a in [self.python, "-m", "launchers.sweep", f"--sweep={sweep}",
                                                f"--out={self.out}", f"--point={slug}"])
        return f"cd {shlex.quote(os.getcwd())} && {run}"

    def _train_cmd(self, d: Path) -> list[str]:
        return [self.python, "-m", "jaxrl.sweep.point", "train", str(d)]

    def _eval_cmd(self, d: Path) -> list[str]:
        return ([self.python, "-m", "jaxrl.sweep.point", "evaluate", str(d), "--", f"--checkpoints={d}",
                 f"--out={d / EVAL_DIR}"] + list(self.eval_args or []))

    def _env(self, pp: Optional[PlannedPoint] = None) -> dict:
        env = dict(os.environ)
        if self.cache and "JAX_COMPILATION_CACHE_DIR" not in env:
            env["JAX_COMPILATION_CACHE_DIR"] = str(self.cache)
        if pp is not None:
            env["JAXRL_SWEEP_POINT"] = pp.point.slug
        return env

    def run_prepare(self) -> None:
        """Runs the spec's `prepare` commands in order, before any point (each must skip what already exists: they
        run on every call); their output goes to OUT/logs/prepare.log. A command that fails is a SweepError naming
        it, its exit status and the log's last lines; Ctrl-C is passed on to it as to a point."""
        if not self.spec.prepare:
            return
        log = self.out / LOG_DIR / "prepare.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        for cmd in self.spec.prepare:
            argv = [self.python if k == 0 and a == "python" else a for k, a in enumerate(cmd)]
            shown = " ".join(shlex.quote(a) for a in argv)
            self.echo(f"prepare: {shown}")
            with open(log, "a", encoding="utf-8") as f:
                f.write(f"\n===== prepare at {now()}: {shown}\n")
                f.flush()
                proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=self._env(),
                                        start_new_session=True)
            rc = _wait(proc)
            interrupt.check(f"sweep stopped while preparing ({shown}; log {log}); rerun the same command")
            if rc != 0:
                raise SweepError(f"{self.spec.where}: prepare command `{shown}` exited with status {rc}; log {log}\n"
                                 + _error_summary(log))

    # ------------------------------------------------------------------------------------------------ running
    def _write_status(self, pp: PlannedPoint, **changes) -> None:
        pp.status.update(changes, updated=now())
        atomic_write_json(pp.dir / STATUS_FILE, pp.status)

    def _run_child(self, pp: PlannedPoint, phase: str, cmd: list[str]) -> tuple[int, Path]:
        log = pp.dir / LOG_DIR / f"{phase}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        attempt = {"phase": phase, "start": now(), "host": socket.gethostname(),
                   "resumed_from_step": _state_steps(pp.dir) if phase == "train" else None}
        pp.status.setdefault("attempts", []).append(attempt)
        t0 = time.time()
        n = sum(a["phase"] == phase for a in pp.status["attempts"])
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"\n===== {phase} attempt {n} at {attempt['start']}: "
                    f"{' '.join(shlex.quote(c) for c in cmd)}\n")
            f.flush()
            # its own process group: a terminal's Ctrl-C reaches the point only once, passed on below
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self._env(pp),
                                    start_new_session=True)
        attempt["pid"] = proc.pid
        self._write_status(pp, state="running", phase=phase, pid=proc.pid, host=attempt["host"],
                           started=pp.status.get("started") or attempt["start"], error=None)
        rc = _wait(proc)
        attempt.update(end=now(), seconds=round(time.time() - t0, 3), returncode=rc)
        key = "train_seconds" if phase == "train" else "eval_seconds"
        pp.status[key] = round(float(pp.status.get(key) or 0.0) + attempt["seconds"], 3)
        return rc, log

    def _fail(self, pp: PlannedPoint, phase: str, message: str) -> str:
        self._write_status(pp, state="failed", phase=phase, pid=None, error=message, finished=now())
        return "failed"

    def _share_base_eval(self, pp: PlannedPoint, planned: Sequence[PlannedPoint]) -> None:
        """Seed this point's evaluation cache of the base model from a point already evaluated with the same base
        weights: the base model is the same for every point, so it is sampled once per sweep. The evaluator
        still checks the cache's settings (weights fingerprint, sampling, reward) and refuses a mismatch."""
        dst = pp.dir / EVAL_DIR / "cache" / "base.jsonl"
        if dst.exists():
            return
        for other in planned:
            src = other.dir / EVAL_DIR / "cache" / "base.jsonl"
            meta = src.with_name(src.name + ".meta.json")
            if other is pp or not other.status or not other.status.get("evaluated") or not meta.exists():
                continue
            if other.config.get("model_path") != pp.config.get("model_path"):
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            for s, d in ((src, dst), (meta, dst.with_name(meta.name))):
                atomic_copy(s, d)
            self.echo(f"      {pp.point.slug}: base-model samples reused from {other.point.slug}")
            return

    def run_point(self, pp: PlannedPoint, planned: Sequence[PlannedPoint] = ()) -> str:
        """Train (resuming) and evaluate one point unless done; returns its final state (or 'skipped')."""
        st = pp.status
        if st["state"] == "done":
            return "done"
        if st["state"] == "running":
            if st.get("host") not in (None, socket.gethostname()) and not self.force:
                self.echo(f"      {pp.point.slug}: marked running on host {st.get('host')} (pid {st.get('pid')}); "
                          "skipped (--force takes it over)")
                return "skipped"
            if _alive(st.get("pid"), str(pp.dir)):
                self.echo(f"      {pp.point.slug}: running in process {st.get('pid')}; skipped")
                return "skipped"
            self.echo(f"      {pp.point.slug}: interrupted during {st.get('phase')}; resuming")
        if st["state"] == "failed" and not self.retry_failed:
            return "failed"
        if not st.get("trained"):
            rc, log = self._run_child(pp, "train", self._train_cmd(pp.dir))
            self._stop_if_interrupted(pp, "train", log)
            if rc != 0:
                why = {3: "stopped on too many non-finite updates in a row", -9: "killed (SIGKILL; out of memory?)"}
                return self._fail(pp, "train", f"training exited with status {rc}"
                                  f"{' (' + why[rc] + ')' if rc in why else ''}; log {log}\n{_error_summary(log)}")
            records = merged_metrics(pp.dir / "metrics.jsonl")
            last = records[-1]["step"] if records else 0
            want = int(pp.config.get("steps", last))
            if last != want:
                return self._fail(pp, "train", f"training exited 0 but {pp.dir / 'metrics.jsonl'} ends at step "
                                  f"{last} of {want}")
            self._write_status(pp, trained=True)
        if self.eval_args is not None and not st.get("evaluated"):
            self._share_base_eval(pp, planned)
            rc, log = self._run_child(pp, "evaluate", self._eval_cmd(pp.dir))
            self._stop_if_interrupted(pp, "evaluate", log)
            if rc != 0:
                return self._fail(pp, "evaluate", f"evaluation exited with status {rc}; log {log}\n"
                                  f"{_error_summary(log)}")
            self._write_status(pp, evaluated=True)
        self._write_status(pp, state="done", phase=None, pid=None, error=None, finished=now())
        return "done"

    def _stop_if_interrupted(self, pp: PlannedPoint, phase: str, log: Path) -> None:
        """After a child ended: when a signal asked the sweep to stop, the point goes back to pending (it resumes
        from its checkpoint on the next run) and Interrupted is raised."""
        if interrupt.requested() is None:
            return
        self._write_status(pp, state="pending", phase=phase, pid=None, error=None, interrupted=now())
        interrupt.check(f"sweep stopped: point {pp.point.slug} interrupted during {phase} (log {log}); rerun the "
                        "same command to resume it from its checkpoint")

    def run(self, only: Optional[str] = None) -> dict:
        """Run the selected points (all by default); returns {"done": [...], "failed": [...], "skipped": [...],
        "ran": [...]} of slugs (`ran`: points this call trained or evaluated)."""
        planned = self.plan(only)
        self.prepare(planned)
        self.run_prepare()
        will_run = [pp for pp in planned if pp.status["state"] != "done" and (
            self.retry_failed or pp.status["state"] != "failed")]
        self.check_plugins(will_run)
        total = len(planned)
        summary = {"done": [], "failed": [], "skipped": [], "ran": []}
        todo = []
        for i, pp in enumerate(planned):
            if pp.status["state"] == "done":
                self.echo(f"[{i + 1}/{total}] done (earlier) {pp.point.slug}")
                summary["done"].append(pp.point.slug)
            else:
                todo.append((i, pp))

        def work(item):
            i, pp = item
            self.echo(f"[{i + 1}/{total}] start {pp.point.slug}  ({pp.point.name})")
            try:
                state = self.run_point(pp, planned)
            except Exception as e:  # noqa: BLE001 - one point's bookkeeping error must not end the sweep
                state = self._fail(pp, pp.status.get("phase") or "train", f"{type(e).__name__}: {e}")
            secs = pp.status.get("train_seconds"), pp.status.get("eval_seconds")
            timing = ", ".join(f"{k} {v:.1f} s" for k, v in zip(("train", "evaluate"), secs) if v)
            line = f"[{i + 1}/{total}] {state} {pp.point.slug}" + (f" ({timing})" if timing else "")
            if state == "failed":
                line += "\n      " + (pp.status.get("error") or "").splitlines()[0]
            self.echo(line)
            return pp, state

        if self.jobs == 1:
            results = []
            for item in todo:
                interrupt.check("sweep stopped between points; rerun the same command to continue")
                results.append(work(item))
        else:
            with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
                results = list(pool.map(work, todo))
        for pp, state in results:
            if state != "skipped":
                summary["ran"].append(pp.point.slug)
            summary.setdefault(state, []).append(pp.point.slug)
        return summary
