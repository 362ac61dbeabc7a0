"""Environments never hang the run (jaxrl/environments/limits.py): an environment call past `step_timeout_s` fails
its episode with an error naming the environment and the limit while the other episodes go on; a progress line
shows the call while it runs long; and SIGINT while the trainer waits on an environment stops the run at once,
keeping its last finished step.

Reproduction on 2e1e1a6: a step that never returns: the run hung with no line; Ctrl-C announced a stop ("SIGINT:
stopping after the current step") that never came."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl.environments.base import Environment
from jaxrl.environments.limits import EnvironmentThread, EnvironmentTimeout
from jaxrl.environments.runner import EpisodeRunner
from jaxrl.data.problems import load_problems
from jaxrl.rollout.collect import Collector
from jaxrl.rollout.keys import problem_key
from jaxrl.utils import interrupt
from test_episodes import CAP, E, P, TASKS, TURNS, setup  # noqa: F401 (setup: the tiny model's fixture)
from test_grpo_episodes import base  # noqa: F401 (the fixture of a tiny model whose turns end within the cap)

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
RELEASE = threading.Event()  # set when a test ends: the abandoned calls return then instead of in 1000 s


class HangsOnSomeSeeds(Environment):
    """Never returns from its first step when the episode's seed is divisible by 3 (1000 s, or until the test
    releases it); asks again otherwise, 0.25 per turn. Counts its steps: a timed-out one is not stepped again."""

    def reset(self, problem):
        self.steps = 0
        return list(problem.messages)

    def step(self, turn):
        self.steps += 1
        if turn.index == 0 and self.seed % 3 == 0:
            RELEASE.wait(1000)
        return [{"role": "user", "content": "Again."}], 0.25, False


class HangsOnceAStepIsRecorded(Environment):
    """The plug-in of the process test: steps normally until `hang_when` (the run's metrics.jsonl) holds a line,
    i.e. from the second rollout on; then its step writes `hang_when + ".stuck"` and never returns."""

    def __init__(self, hang_when: str = ""):
        self.hang_when = hang_when

    def reset(self, problem):
        return list(problem.messages)

    def step(self, turn):
        if self.hang_when and os.path.exists(self.hang_when) and os.path.getsize(self.hang_when):
            Path(self.hang_when + ".stuck").touch()
            time.sleep(1000)
        return [], 0.0, True


def hanging_runner(setup, limit_s: float, progress_every_s: float = 0.0) -> EpisodeRunner:
    collector = Collector(setup["backend"], None, tokenizer=setup["tok"], stop_ids=setup["stop_ids"])
    return EpisodeRunner(collector, HangsOnSomeSeeds, tokenizer=setup["tok"], enable_thinking=False,
                         max_turns=TURNS, max_new_tokens=CAP, max_episode_tokens=E, max_prompt_len=P,
                         step_timeout_s=limit_s, progress_every_s=progress_every_s)


@pytest.fixture
def release_hung_calls():
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.mark.slow  # the tiny model's episodes (test_episodes' fixture)
def test_a_step_past_its_limit_fails_its_episode_and_the_others_complete(setup, release_hung_calls, caplog):
    """Reproduction on 2e1e1a6: a step that never returns: the run hung with no line; Ctrl-C announced a stop that
    never came. Now the step is waited for step_timeout_s: that episode fails naming the environment and the
    limit, its environment is not stepped again, the others run all their turns, and a progress line showed the
    wait."""
    caplog.set_level(logging.INFO)
    runner = hanging_runner(setup, limit_s=1.0, progress_every_s=0.3)
    problems = load_problems(TASKS)[:2]
    t0 = time.monotonic()
    episodes = runner.run(problems, [problem_key(p.id) for p in problems], setup["sampling"])
    seconds = time.monotonic() - t0
    hung = [e for e in episodes if e.env.seed % 3 == 0]
    fine = [e for e in episodes if e.env.seed % 3]
    assert hung and fine, [e.env.seed % 3 for e in episodes]
    for e in hung:
        assert e.error == ("step 0: EnvironmentTimeout: environment 'HangsOnSomeSeeds': step 0 did not return "
                           "within step_timeout_s=1 s (left running on an abandoned thread; this episode's "
                           "environment is not used again)")
        assert np.isnan(e.reward) and e.turns == 1 and e.env.steps == 1
    for e in fine:
        assert e.error is None and e.reward == pytest.approx(0.25 * e.turns) and (e.turns == TURNS or e.truncated)
    # one second per hung step, plus the sampling of a few tiny turns
    assert seconds < len(hung) * 1.0 + 30, seconds
    assert "environment 'HangsOnSomeSeeds': waiting for step 0, running" in caplog.text
    # the runner goes on with a fresh environment thread: a second run works the same
    again = runner.run(problems, [problem_key(p.id) for p in problems], setup["sampling"])
    assert [e.error for e in again] == [e.error for e in episodes]


def test_a_call_past_its_limit_is_abandoned_and_the_next_call_runs_on_a_fresh_thread(release_hung_calls):
    """The environment thread alone: a call past the limit raises EnvironmentTimeout within the limit (plus one
    poll) and is left on its thread; the next call runs on another thread; an error of the call is raised as it
    was; limit 0 waits as long as the call takes."""
    calls = EnvironmentThread("Sleeper", limit_s=0.5)
    threads = []

    def where(wait: float = 0.0) -> str:
        threads.append(threading.current_thread())
        RELEASE.wait(wait)
        return threading.current_thread().name

    assert calls.call("reset", where) == "jaxrl-environment-Sleeper"
    assert calls.call("step 0", where) and threads[0] is threads[1]  # one thread serves the calls in turn
    t0 = time.monotonic()
    with pytest.raises(EnvironmentTimeout, match=r"environment 'Sleeper': step 1 did not return within "
                                                 r"step_timeout_s=0.5 s"):
        calls.call("step 1", where, 1000.0)
    assert 0.5 <= time.monotonic() - t0 < 1.5
    calls.call("step 2", where)
    assert threads[3] is not threads[2] and threads[2].is_alive() and threads[2].daemon
    with pytest.raises(ZeroDivisionError):
        calls.call("step 3", lambda: 1 / 0)
    assert EnvironmentThread("Slow", limit_s=0).call("step 0", where, 0.8) == "jaxrl-environment-Slow"


def test_a_signal_stops_the_wait_for_an_environment_at_once(release_hung_calls):
    """SIGINT (the launchers' handler installed) while the main thread waits on a step that never returns, with no
    time limit: Interrupted within a poll, naming the environment; nothing else runs."""
    calls = EnvironmentThread("Stuck", limit_s=0)
    interrupt.install()
    try:
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(interrupt.Interrupted, match=r"stopped while waiting for environment 'Stuck' \(step 4 "
                                                        r"had run \d+ s\); the rollout in flight is dropped") as info:
            calls.call("step 4", RELEASE.wait, 1000)
        assert info.value.exit_status == 130 and time.monotonic() - t0 < 1.5
    finally:
        interrupt.uninstall()


def test_the_step_limit_setting_is_checked():
    from conftest import tiny_config
    from jaxrl.algorithms.run import resolve_config

    assert resolve_config(tiny_config("grpo", environment="code_feedback")).grpo.step_timeout_s == 600.0
    assert resolve_config(tiny_config("ppo", step_timeout_s=0)).ppo.step_timeout_s == 0.0
    with pytest.raises(ValueError, match=r"grpo.step_timeout_s must be a finite number of seconds >= 0 \(0 = no "
                                         r"limit\), got -1.0"):
        resolve_config(tiny_config("grpo", environment="code_feedback", step_timeout_s=-1.0))


CONFIG = """from test_grpo_episodes import episode_config


def get_config():
    cfg = episode_config({{"model": {model!r}, "problems": {problems!r}}}, steps=3, environment="hangs",
                         environment_options={{"hang_when": {metrics!r}}})
    cfg.plugins = ("environment:hangs={plugin}:HangsOnceAStepIsRecorded",)
    cfg.checkpoint_every = 100  # no checkpoint before the end: the stop itself must save step 1
    return cfg
"""


@pytest.mark.slow  # a `launchers.train` process compiling the tiny model (about 20 s)
def test_sigint_while_the_trainer_waits_on_an_environment_stops_at_once_with_its_last_step(base, tmp_path):
    """Reproduction on 2e1e1a6: a step that never returns: the run hung with no line; Ctrl-C announced a stop that
    never came. Now a real `launchers.train` run whose environment hangs in the second rollout's first step
    exits on SIGINT within seconds: status 130, the last line says where it stopped, and the checkpoint of step 1
    (the last finished step) is on disk."""
    from launcher_env import launch_env
    from jaxrl.train.checkpoints import RunCheckpoints

    workdir = tmp_path / "run"
    metrics = workdir / "metrics.jsonl"
    config = tmp_path / "hangs.py"
    config.write_text(CONFIG.format(model=base["model"], problems=base["problems"], metrics=str(metrics),
                                    plugin=HERE))
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launchers.train", f"--config={config}",
                                 f"--workdir={workdir}"], cwd=ROOT, env=launch_env(tmp_path / "xla"), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not Path(str(metrics) + ".stuck").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(0.5)  # well inside the step: the trainer is waiting on it
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log_path.read_text()
    assert status == 130, out[-3000:]
    assert seconds < 15, (seconds, out[-3000:])
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"train: interrupted \(SIGINT\): stopped while waiting for environment "
                        r"'HangsOnceAStepIsRecorded' \(step 0 had run \d+ s\); the rollout in flight is dropped; "
                        rf"training stopped after step 1 of 3 \(checkpoint of step 1 in "
                        rf"{re.escape(str(workdir))}/checkpoints/state/1\); rerun the same command to resume",
                        last), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1]
    ckpt = RunCheckpoints(str(workdir), async_save=False)
    assert ckpt.latest_step() == 1
    ckpt.close()
