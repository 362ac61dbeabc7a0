"""Asynchronous GRPO (grpo.max_staleness=2, the producer sampling two rollouts ahead on a real `launchers.serve`)
under faults: the trainer SIGKILLed at six random moments (whatever it was doing: sampling ahead, training,
writing a checkpoint or a rollout buffer) and the rollout server SIGKILLed while rows were in flight. After each
fault the same command resumes, and the run ends bit-identical to an uninterrupted one: every rollout the producer
made is trained exactly once, in order (none lost, none twice), with the same samples. With partial rollouts (not
bit-reproducible) the record proves the same: every step trained the samples the store holds for its rollout."""

import os
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


def kill_at_random_moments(workdir, cache, args, rng, after_kill=None) -> list[str]:
    """Starts the run KILLS times, each time SIGKILLing it at a random moment: once the process has made 0 to 2
    steps, a random fraction of a second later (a warm run takes seconds, so a time alone would mostly land after
    its end): whatever the trainer or its producer is doing then (starting or restoring, sampling ahead, training,
    waiting for the producer's rollouts before a checkpoint, writing a checkpoint or a buffer). Returns what
    happened each time; `after_kill()` runs after each kill."""
    outcomes = []
    for ahead, delay in zip(rng.integers(0, 3, size=KILLS), rng.uniform(0.0, 1.0, size=KILLS)):
        proc = launch(workdir, cache, *args)
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
            if after_kill is not None:
                after_kill()
        else:
            proc.wait()
            steps.reader.join()
            assert proc.returncode == 0, "".join(steps.lines[-40:])
            outcomes.append("finished")
    return outcomes


@pytest.mark.heavy
def test_async_run_resumes_bit_exact_after_random_kills_and_a_server_killed_mid_row(tmp_path):
    base = build_base(tmp_path / "base")
    flags = (f"--allowed_lora_roots={tmp_path}", f"--max_prompt_len={PROMPT_BUCKET}",
             f"--prompt_buckets={PROMPT_BUCKET}", f"--batch_size={SLOTS}", "--max_model_len=128")
    server = Served(tmp_path, base, *flags)
    port = int(server.url.rsplit(":", 1)[1])
    cache = tmp_path / "jax_cache"
    args = overrides(base, [server.url], "server") + ["--config.grpo.max_staleness=2", f"--config.steps={STEPS}",
                                                      "--config.grpo.rollout_server.fleet_wait_s=2"]
    try:
        straight = train(tmp_path / "straight", cache, *args)
        assert straight.returncode == 0, straight.stderr[-4000:]

        killed = tmp_path / "killed"
        # first, the only server dies while the trainer's first rows are on it: with no server left the trainer
        # waits fleet_wait_s (2 s here) for one to come back, then stops with one line naming it
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

        outcomes = kill_at_random_moments(killed, cache, args, np.random.default_rng(0))
        print("faults:", outcomes)
        assert outcomes.count("finished") < KILLS // 2, outcomes  # the faults hit a running trainer

        final = train(killed, cache, *args)
        assert final.returncode == 0, final.stderr[-4000:]
        assert_same_run(killed, tmp_path / "straight", steps=STEPS)
        assert max(r["rollout/staleness_max"] for r in metrics(killed)) <= 2
    finally:
        server.stop()


@pytest.mark.heavy
def test_partial_rollouts_train_every_written_rollout_once_after_random_kills(tmp_path):
    """grpo.partial_rollouts (k = 2: two rollouts on the server at once, rows continued across versions) on a
    server slowed so rows are in flight at every publish, the trainer SIGKILLed at six random moments. Such runs
    are not bit-reproducible (which version reaches a row when is timing), so the proof is the record. After each
    kill the rollouts its newest checkpoint covers (rollouts r .. r + k - 1 at a checkpoint of rollout r: the
    checkpoint waited for them) are on disk; after the last resume every step is recorded once, each trained on
    exactly the samples the store holds for its rollout (the digest it logged), and those of every covered rollout
    are the ones on disk at the kill: read back, not sampled again, none lost. No token was over the bound."""
    from jaxrl.algorithms.online.buffer import RolloutStore
    from jaxrl.algorithms.online.controller import samples_digest

    base = build_base(tmp_path / "base")
    server = Served(tmp_path, base, f"--allowed_lora_roots={tmp_path}", f"--max_prompt_len={PROMPT_BUCKET}",
                    f"--prompt_buckets={PROMPT_BUCKET}", "--batch_size=2", "--max_model_len=128", "--round_steps=1",
                    "--debug_round_delay_s=0.002")
    cache = tmp_path / "jax_cache"
    args = overrides(base, [server.url], "server") + [
        "--config.grpo.max_staleness=2", "--config.grpo.partial_rollouts=True",
        "--config.grpo.off_policy_loss=decoupled", f"--config.steps={STEPS}", "--config.grpo.max_new_tokens=16"]
    run = tmp_path / "run"
    covered: dict[int, str] = {}  # rollout -> the digest on disk when a kill left it covered by a checkpoint

    def note_covered():
        states = run / "checkpoints" / "state"
        done = [int(n) for n in os.listdir(states) if n.isdigit()] if states.is_dir() else []
        if not done or max(done) >= STEPS:
            return
        first = max(done) // 2  # the checkpoint's rollout (two steps a rollout)
        for q in range(first, min(first + 2, STEPS // 2)):  # k = 2
            digest = samples_digest(RolloutStore(str(run)).load(q)[0])
            assert covered.setdefault(q, digest) == digest, f"rollout {q} changed on disk after its checkpoint"

    try:
        outcomes = kill_at_random_moments(run, cache, args, np.random.default_rng(1), note_covered)
        print("faults:", outcomes)
        assert outcomes.count("finished") < KILLS // 2, outcomes
        final = train(run, cache, *args)
        assert final.returncode == 0, final.stderr[-4000:]
    finally:
        server.stop()
    records = metrics(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    store = RolloutStore(str(run))
    rollouts = STEPS // 2  # two steps a rollout (num_iterations=2)
    stored = {r: samples_digest(store.load(r)[0]) for r in range(rollouts)}
    assert [r["rollout/samples_digest"] for r in records] == [stored[(r["step"] - 1) // 2] for r in records]
    assert covered and all(stored[q] == digest for q, digest in covered.items()), (covered, stored)
    assert all(r["rollout/staleness_max"] <= 2 and r["rollout/dropped_stale_samples"] == 0 for r in records)
    assert all(np.isfinite(r["loss"]) for r in records)
