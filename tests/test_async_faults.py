"""Asynchronous GRPO (grpo.max_staleness=2, the producer sampling two rollouts ahead on a real `launchers.serve`)
under faults: the trainer SIGKILLed at six random moments (whatever it was doing: sampling ahead, training,
writing a checkpoint or a rollout buffer) and the rollout server SIGKILLed while rows were in flight. After each
fault the same command resumes, and the run ends bit-identical to an uninterrupted one: every rollout the producer
made is trained exactly once, in order (none lost, none twice), with the same samples."""

import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from serve_fixture import Served, build_base
from test_server_rollouts import KEEP_ALL, PROMPT_BUCKET, ROOT, SLOTS, assert_same_run, metrics, overrides, train

KILLS = 6
STEPS = 12  # 6 rollouts of 2 steps, a checkpoint at each rollout's start


def launch(workdir, cache, *args) -> subprocess.Popen:
    """`train` as a process the test can kill when it likes."""
    from launcher_env import launch_env
    config = cache.parent / "grpo_keep_all.py"
    if not config.exists():
        config.write_text(KEEP_ALL)
    return subprocess.Popen([sys.executable, "-m", "launchers.train", f"--config={config}", f"--workdir={workdir}",
                             *args], cwd=ROOT, env=launch_env(cache), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


class StepLines:
    """The steps a trainer process reports on stderr ("step N/M ..." log lines), read as it runs."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.seen: list[int] = []
        self.reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.reader.start()

    def _read(self, proc) -> None:
        for line in proc.stderr:
            self.lines.append(line)
            found = re.search(r"step (\d+)/\d+", line)
            if found:
                self.seen.append(int(found.group(1)))


def rows_in_flight(url: str) -> bool:
    """The server's rows queued or decoding (its Prometheus gauges) are not zero."""
    import urllib.request
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return any(line.split()[-1] not in ("0", "0.0") for line in text.splitlines()
               if line.startswith(("jaxrl:num_rows_running", "jaxrl:num_rows_waiting")))


@pytest.mark.heavy
def test_async_run_resumes_bit_exact_after_random_kills_and_a_server_killed_mid_row(tmp_path):
    base = build_base(tmp_path / "base")
    flags = (f"--allowed_lora_roots={tmp_path}", f"--max_prompt_len={PROMPT_BUCKET}",
             f"--prompt_buckets={PROMPT_BUCKET}", f"--batch_size={SLOTS}", "--max_model_len=128")
    server = Served(tmp_path, base, *flags)
    port = int(server.url.rsplit(":", 1)[1])
    cache = tmp_path / "jax_cache"
    args = overrides(base, [server.url], "server") + ["--config.grpo.max_staleness=2", f"--config.steps={STEPS}"]
    try:
        straight = train(tmp_path / "straight", cache, *args)
        assert straight.returncode == 0, straight.stderr[-4000:]

        killed = tmp_path / "killed"
        # first, the server dies while the trainer's first rows are on it: the trainer stops with one line naming it
        proc = launch(killed, cache, *args)
        deadline = time.monotonic() + 600
        while not rows_in_flight(server.url) and proc.poll() is None:
            assert time.monotonic() < deadline, "the trainer never reached the server"
            time.sleep(0.01)
        server.stop(signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
        assert proc.returncode != 0, "the run ended although its server died with rows in flight"
        last = [line for line in err.strip().splitlines() if line.strip()][-1]
        print("server killed:", last)
        assert f"127.0.0.1:{port}" in last and len(last) < 1000, err[-3000:]
        server = Served(tmp_path, base, *flags, port=port)

        rng = np.random.default_rng(0)
        outcomes = []
        # A random moment of a run: once the process has made 0 to 2 steps, a random fraction of a second later
        # (a warm run takes seconds, so a time alone would mostly land after its end): whatever the trainer or its
        # producer is doing then (starting or restoring, sampling ahead, training, waiting for the producer's
        # rollouts before a checkpoint, writing a checkpoint or a buffer).
        for ahead, delay in zip(rng.integers(0, 3, size=KILLS), rng.uniform(0.0, 1.0, size=KILLS)):
            proc = launch(killed, cache, *args)
            steps = StepLines(proc)
            deadline = time.monotonic() + 600
            while proc.poll() is None and len(steps.seen) < ahead:  # 0 to 2 steps made by this process
                assert time.monotonic() < deadline, "the trainer made no progress"
                time.sleep(0.01)
            time.sleep(delay)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                steps.reader.join()
                outcomes.append(f"killed {delay:.2f} s after steps {steps.seen}")
            else:
                proc.wait()
                steps.reader.join()
                assert proc.returncode == 0, "".join(steps.lines[-40:])
                outcomes.append("finished")
        print("faults:", outcomes)
        assert outcomes.count("finished") < KILLS // 2, outcomes  # the faults hit a running trainer

        final = train(killed, cache, *args)
        assert final.returncode == 0, final.stderr[-4000:]
        assert_same_run(killed, tmp_path / "straight", steps=STEPS)
        assert max(r["rollout/staleness_max"] for r in metrics(killed)) <= 2
    finally:
        server.stop()
