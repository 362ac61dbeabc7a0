"""Environments of episodes (jaxrl.environments): code_feedback on the real sandbox (public-test
failures as the next message, the reward on the hidden tests, hostile programs contained), and the `environment`
plug-in kind's checks."""

import textwrap
import time

import pytest

from jaxrl.algorithms import plugins
from jaxrl.environments.base import Environment, Turn
from jaxrl.environments.code_feedback import CodeFeedback
from jaxrl.environments.registry import ENVIRONMENTS
from jaxrl.data.problems import Problem
from jaxrl.utils.registry import PluginError
from test_verifier_hostile import HOSTILE_TIMEOUT_S, sandbox_leftovers  # noqa: E402 - tests/ on the path

SUM = Problem.from_dict({
    "id": "sum", "messages": [{"role": "user", "content": "Print a + b."}], "test_type": "stdin",
    "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"},
              {"input": "-5 3\n", "output": "-2\n"}, {"input": "7 -7\n", "output": "0\n"}],
    "time_limit_s": 20.0})


def turn(code, index=0, last=False, finish="stop"):
    text = "```python\n" + textwrap.dedent(code).strip() + "\n```" if code is not None else "I do not know."
    return Turn(text, (1, 2), finish, index, last)


def env(**options):
    e = ENVIRONMENTS.get("code_feedback")(public_tests=2, workers=2, timeout_s=20.0, **options)
    e.reset(SUM)
    return e


def test_public_failures_come_back_and_hidden_tests_give_the_reward():
    e = env(turn_cost=0.1)
    messages, reward, done = e.step(turn("a, b = map(int, input().split())\nprint(a - b)"))
    assert not done and reward == pytest.approx(-0.1)
    (m,) = messages
    text = m["content"]
    assert m["role"] == "user" and "failed 2 of 2 public tests" in text
    assert "Input:\n1 2" in text and "Expected output:\n3" in text and "Your output:\n-1" in text
    assert "-5 3" not in text and "7 -7" not in text  # hidden tests never shown
    # an exception shows its error
    messages, _, done = e.step(turn("print(1 / 0)", index=1))
    assert not done and "ZeroDivisionError" in messages[0]["content"]
    # no code: asked for it
    messages, _, done = e.step(turn(None, index=2))
    assert not done and "No program" in messages[0]["content"]
    # public tests pass: the episode ends with the hidden tests' score (a hard-coded answer fails them)
    messages, reward, done = e.step(turn("print({'1 2': 3, '5 5': 10}[input().strip()])", index=3))
    assert done and messages == [] and reward == 0.0 and e.solved is False
    e.reset(SUM)
    messages, reward, done = e.step(turn("a, b = map(int, input().split())\nprint(a + b)"))
    assert done and reward == 1.0 and e.solved is True


def test_last_turn_and_truncated_turn_are_scored_on_hidden_tests():
    e = env()
    _, reward, done = e.step(turn("a, b = map(int, input().split())\nprint(a + b if a > 0 else 0)", last=True))
    assert done and reward == pytest.approx(0.5)  # hidden: "-5 3" wrong, "7 -7" right
    e = env(score="strict")
    _, reward, done = e.step(turn("a, b = map(int, input().split())\nprint(a + b if a > 0 else 0)", last=True))
    assert done and reward == 0.0
    e = env()
    _, reward, done = e.step(turn("a, b = map(int, input().split())\nprint(a + b)", finish="length"))
    assert done and reward == 0.0  # a turn cut at its cap scores 0, as a truncated completion does
    e = env(reward_tests="all")
    _, reward, done = e.step(turn("print({'1 2': 3, '5 5': 10}[input().strip()])", last=True))
    assert done and reward == pytest.approx(0.5)


def test_feedback_respects_its_character_budget():
    e = env(feedback_chars=300)
    messages, _, _ = e.step(turn("print('x' * 5000)"))
    assert len(messages[0]["content"]) <= 300 and "[truncated]" in messages[0]["content"]
    assert messages[0]["content"].endswith("```python code block.")


# Hostile programs an episode may run (tests/test_verifier_hostile.py's patterns): name -> code. Shared with the
# python_tool tests.
HOSTILE = {"fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
           "sleep": "import time\ntime.sleep(600)",
           "flood": "while True:\n    print('x' * 10000)"}


@pytest.mark.parametrize("code,status", [(HOSTILE["fork_bomb"], "timeout"), (HOSTILE["sleep"], "timeout"),
                                         (HOSTILE["flood"], "output limit")], ids=["fork_bomb", "sleep", "flood"])
def test_hostile_programs_in_an_episode_are_contained(code, status):
    """The episode's public tests run in the verifier's sandbox: killed in time, reported as feedback, nothing
    left running (tests/test_verifier_hostile.py's patterns)."""
    problem = Problem.from_dict({**SUM.to_dict(), "time_limit_s": HOSTILE_TIMEOUT_S})
    e = ENVIRONMENTS.get("code_feedback")(public_tests=1, workers=2)
    e.reset(problem)
    if "fork" in code and not e.verifier.pool.isolation.uid:
        pytest.skip("RLIMIT_NPROC binds only off root: a fork bomb needs the uid sandbox")
    started = time.monotonic()
    messages, reward, done = e.step(turn(code))
    assert time.monotonic() - started < 60
    assert not done and f"Test 1: {status}" in messages[0]["content"]
    assert sandbox_leftovers(e.verifier) == []


def test_files_outside_the_work_folder_are_not_readable(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-OUTPUT-42")
    secret.chmod(0o644)
    e = env()
    if not e.verifier.pool.isolation.private_root:
        pytest.skip("no private root on this machine")
    messages, _, done = e.step(turn(f"print(open({str(secret)!r}).read())"))
    assert not done and "SECRET-OUTPUT-42" not in messages[0]["content"] and "Error" in messages[0]["content"]


# ------------------------------------------------------------------------------------------------ plug-ins


class Secret(Environment):
    def reset(self, problem):
        return list(problem.messages)

    def step(self, turn):
        return [], float(turn.text.startswith("x")), True


class WrongReward(Secret):
    def step(self, turn):
        return [], "high", True


class WrongMessages(Secret):
    def step(self, turn):
        return "hello", 0.0, False


class Raises(Secret):
    def reset(self, problem):
        raise KeyError("no such problem")


def test_environment_plugins_are_checked_before_registration():
    try:
        plugins.register("environment", "secret_env")(Secret)
        assert "secret_env" in plugins.names("environment") and plugins.get("environment", "secret_env") is Secret
        for cls, match in ((WrongReward, "reward 'high'"), (WrongMessages, "not a list of messages"),
                           (Raises, "raised KeyError")):
            with pytest.raises(PluginError, match=match):
                plugins.register("environment", f"bad_{cls.__name__}")(cls)
            assert f"bad_{cls.__name__}" not in plugins.names("environment")
        with pytest.raises(PluginError, match="grpo.environment='nope': no environment named 'nope'"):
            plugins.check_references({"grpo": {"environment": "nope"}})
        plugins.check_references({"grpo": {"environment": "secret_env"}})
    finally:
        plugins.unregister("environment", "secret_env")


def test_code_feedback_refuses_bad_options():
    with pytest.raises(ValueError, match="reward_tests"):
        CodeFeedback(reward_tests="public")
    with pytest.raises(ValueError, match="turn_cost"):
        CodeFeedback(turn_cost=float("nan"))


class NeedsLevel(Secret):
    """A plug-in whose constructor needs an option the run gives in environment_options."""

    def __init__(self, level):
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self.level = level


def test_a_plugin_with_a_required_option_is_checked_with_the_runs_options(tmp_path):
    """Reproduction (2e1e1a6): an environment plug-in whose constructor needs an option was refused although
    `environment_options` gave it (the check built it with no options); an unknown environment name was refused
    only after the model was built. Now the example episode runs with the run's options, and both are refused in
    one line naming the key before any model loads (the model path here does not exist)."""
    from conftest import tiny_config
    from jaxrl.algorithms.run import check_environments, resolve_config, run_training
    try:
        plugins.register("environment", "needs_level")(NeedsLevel)  # deferred: needs the run's options
        loaded = [{"kind": "environment", "name": "needs_level", "path": __file__}]

        def config(**grpo):
            cfg = tiny_config("grpo", **{"environment": "needs_level", "max_turns": 2, "max_episode_tokens": 64,
                                         **grpo})
            cfg.model_path, cfg.data.source, cfg.data.problems = "/nonexistent/model", "problems", "p.jsonl"
            return cfg

        check_environments(resolve_config(config(environment_options={"level": 2})), loaded)
        with pytest.raises(PluginError, match=r"(?s)grpo.environment 'needs_level' with "
                                              r"grpo.environment_options=\{\}.*missing 1 required positional "
                                              r"argument: 'level'"):
            check_environments(resolve_config(config()), loaded)
        with pytest.raises(PluginError, match="level must be 1 or 2, got 3"):
            check_environments(resolve_config(config(environment_options={"level": 3})), loaded)
        with pytest.raises(ValueError, match=r"grpo.environment_options=\{'turns': 2\} for 'code_feedback': "):
            check_environments(resolve_config(config(environment="code_feedback",
                                                     environment_options={"turns": 2})), [])
        with pytest.raises(ValueError, match=r"^grpo.environment: unknown environment 'nope'"):
            run_training(config(environment="nope"), str(tmp_path / "run"))
    finally:
        plugins.unregister("environment", "needs_level")
