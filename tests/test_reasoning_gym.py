"""reasoning-gym tasks as problems and reward (jaxrl.data.reasoning_gym, jaxrl.rewards.reasoning_gym): the reward
equals reasoning-gym's own score_answer on 1,000 answers per task (right, wrong, partly right, malformed, garbage),
generation is deterministic (the manifest's hash equals a second generation's in another interpreter), eval never
holds a training problem, and a missing task, a config key a task lacks and a missing extra are each one line before
anything loads.

The tasks: spell_backward (a word reversed: one skill, short answers, partial credit per letter in place) and
basic_arithmetic with two one-digit terms (a handful of tokens, exact match): both are learnable by a tiny model
with a character-level tokenizer, and they exercise both kinds of scorer (a task's own partial credit, and the base
class's exact match with credit for an answer that contains the right one).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import reasoning_gym  # the tasks extra, part of the test extra: the reference these tests compare with
from reasoning_gym.utils import extract_answer as rg_extract_answer

from jaxrl.data.problems import load_problems, save_problems
from jaxrl.data.reasoning_gym import TaskSettings, check_tasks, draw_seed, generate
from jaxrl.rewards import get_reward
from jaxrl.data.answers import extract_answer, format_answer
from launcher_env import ROOT, error_lines, launch, launch_env

SMALL_ARITHMETIC = {"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
SETTINGS = TaskSettings(tasks=("spell_backward", "basic_arithmetic"), task_configs=SMALL_ARITHMETIC, size=500,
                        eval_size=40, task_seed=7)
BLOCK_EXTRA = "import sys; sys.modules['reasoning_gym'] = None"  # `import reasoning_gym` raises ImportError


def _wrong(answer: str, rng: random.Random) -> str:
    """A wrong answer near the right one: a changed character, a dropped one, or one added."""
    if not answer:
        return "x"
    i = rng.randrange(len(answer))
    kind = rng.randrange(3)
    if kind == 0:
        return answer[:i] + rng.choice("abz019-") + answer[i + 1:]
    if kind == 1:
        return answer[:i] + answer[i + 1:]
    return answer[:i] + rng.choice("qk7") + answer[i:]


def _completions(answer: str, rng: random.Random) -> list[str]:
    """Ten completions of one problem: right (plain, other case, padded), wrong, containing the answer, the last of
    several tags, after a closed think block, no tag, an empty tag, garbage."""
    garbage = "".join(rng.choice("<>/ answer\n\tx9é") for _ in range(rng.randrange(0, 30)))
    return [format_answer(answer), f"Reversed:\n<answer> {answer.upper()} </answer>",
            f"<answer>{_wrong(answer, rng)}</answer>", f"<answer>The answer is {answer}.</answer>",
            f"<answer>{_wrong(answer, rng)}</answer> no, <answer>{answer}</answer>",
            f"<think>it is {_wrong(answer, rng)}</think>\n<answer>{answer}</answer>",
            answer, "<answer></answer>", f"<answer>{answer}", garbage]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    return generate(SETTINGS)


def test_the_reward_is_the_tasks_own_score_answer_on_1000_answers_per_task(generated, tmp_path):
    path = tmp_path / "train.jsonl"
    save_problems(generated.train, path)
    problems = load_problems(path)  # through the file, as every launcher reads them
    reward = get_reward("reasoning_gym")
    rng = random.Random(0)
    for task in SETTINGS.tasks:
        mine = [p for p in problems if p.metadata["reasoning_gym"]["task"] == task][:100]
        # the reference: the task's dataset as reasoning-gym builds it from the generation's own settings
        config = SMALL_ARITHMETIC.get(task, {})
        dataset = reasoning_gym.create_dataset(task, **config, seed=draw_seed(SETTINGS.task_seed, task, "train"),
                                               size=generated.plan.train[task])
        completions, batch, want = [], [], []
        for p in mine:
            entry = dataset[p.metadata["reasoning_gym"]["index"]]
            assert (p.messages[-1]["content"], p.tests[0].output) == (entry["question"], entry["answer"])
            for c in _completions(entry["answer"], rng):
                completions.append(c)
                batch.append(p)
                want.append(float(dataset.score_answer(rg_extract_answer(c), entry)))
        got = reward.score(completions, batch)
        assert len(got) == 1000
        assert [r.partial for r in got] == want, task
        assert [r.strict for r in got] == [w == 1.0 for w in want]
        # every kind of score occurs: right, wrong, partial credit, malformed (no answer)
        assert {0.0, 1.0} <= set(want) and any(0 < w < 1 for w in want), task
        assert sum(r.reason == "no_answer" for r in got) >= 200  # the bare answer, the unclosed tag, garbage
        assert all(r.reason in (None, "no_answer") for r in got)


def test_extraction_modes():
    text = "work\n<answer> 12 </answer>\nso: 12 \n\n"
    assert extract_answer(text, "tag") == "12" == extract_answer(text, "last_line").removeprefix("so: ")
    assert extract_answer(text, "regex", pattern=r"so: (\d+)") == "12"
    assert extract_answer("x = 3, x = 4", "regex", pattern=r"x = \d") == "x = 4"  # the last match
    assert extract_answer("  \n ", "last_line") is None and extract_answer(" ", "all") is None
    assert extract_answer("<ans>a</ans>", "tag", tag="ans") == "a" and extract_answer("a", "tag") is None
    with pytest.raises(ValueError, match="needs a pattern"):
        extract_answer(text, "regex")


def test_the_reward_follows_the_recorded_answer_format_and_its_options(generated):
    problem = generated.train[0]
    answer = problem.tests[0].output
    reward = get_reward("reasoning_gym")
    assert reward.score([f"<answer>{answer}</answer>"], [problem])[0].strict
    assert not reward.score([f"blah\n{answer}"], [problem])[0].strict  # the problem asks for tags
    assert get_reward("reasoning_gym", extract="last_line").score([f"blah\n{answer}"], [problem])[0].strict
    [unclosed] = reward.score([f"<think>{answer}"], [problem])
    assert (unclosed.partial, unclosed.reason) == (0.0, "unclosed_think")


def test_a_problem_another_version_would_generate_otherwise_is_refused(generated):
    import dataclasses

    from jaxrl.data.problems import TestCase
    problem = dataclasses.replace(generated.train[0], tests=(TestCase("", "not the answer"),))
    with pytest.raises(ValueError, match=r"generates another problem at spell_backward #0 .* regenerate"):
        get_reward("reasoning_gym").score(["<answer>x</answer>"], [problem])


def test_generation_is_deterministic_and_eval_never_holds_a_training_problem(generated, tmp_path):
    """The manifest written by the launcher (another interpreter) holds this generation's hash; another seed
    gives other problems; dev and held-out share no question with the training draw."""
    flags = ["--tasks=spell_backward,basic_arithmetic", f"--task_configs={json.dumps(SMALL_ARITHMETIC)}",
             "--size=500", "--eval_size=40", "--task_seed=7", f"--output={tmp_path / 'train.jsonl'}"]
    proc = launch("import_problems", *flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((tmp_path / "train_splits" / "manifest.json").read_text())
    record = manifest["generator"]
    assert record["problems_sha256"] == generated.sha256()
    assert (record["package"], record["version"], record["task_seed"]) == ("reasoning-gym", "0.1.25", 7)
    assert record["tasks"]["basic_arithmetic"]["config"] == SMALL_ARITHMETIC["basic_arithmetic"]
    assert {t: v["train"] for t, v in record["tasks"].items()} == {"spell_backward": 250, "basic_arithmetic": 250}
    assert generate(TaskSettings(**{**SETTINGS.__dict__, "task_seed": 8})).sha256() != generated.sha256()

    train = load_problems(tmp_path / "train.jsonl")
    assert [p.to_json() for p in train] == [p.to_json() for p in generated.train]
    evals = load_problems(tmp_path / "train_splits" / "dev.jsonl") + load_problems(
        tmp_path / "train_splits" / "heldout.jsonl")
    assert len(evals) == 40 and {t: v["eval"] for t, v in record["tasks"].items()} == {"spell_backward": 20, "basic_arithmetic": 20}
    questions = {(p.metadata["reasoning_gym"]["task"], p.messages[-1]["content"]) for p in train}
    eval_questions = [(p.metadata["reasoning_gym"]["task"], p.messages[-1]["content"]) for p in evals]
    assert not questions & set(eval_questions) and len(set(eval_questions)) == len(eval_questions)
    assert sum(generated.dropped.values()) > 0  # small arithmetic repeats: the overlap was there to drop


@pytest.mark.parametrize("settings, message", [
    (TaskSettings(tasks=("spell_backwards",)),
     "--tasks: reasoning-gym 0.1.25 has no task 'spell_backwards' (did you mean 'spell_backward'?)"),
    (TaskSettings(tasks=("spell_backward",), task_configs={"spell_backward": {"max_len": 4}}),
     "--task_configs: task 'spell_backward' takes no config key 'max_len' (did you mean 'max_word_len'?); its keys: "
     "min_word_len, max_word_len, data_file"),
    (TaskSettings(tasks=("spell_backward",), task_configs={"spell_backward": {"seed": 4}}),
     "--task_configs: spell_backward.seed is set by --task_seed / --size; leave it out"),
    (TaskSettings(tasks=("spell_backward",), task_configs={"spell_backward": {"min_word_len": 9, "max_word_len": 3}}),
     "--task_configs: task 'spell_backward' refuses the config {\"min_word_len\": 9, \"max_word_len\": 3}: "
     "AssertionError: max_word_len must be >= min_word_len"),
    (TaskSettings(tasks=("spell_backward",), task_weights={"gcd": 2}),
     "--task_weights: 'gcd' is not among --tasks (spell_backward)"),
])
def test_bad_tasks_and_configs_are_one_line(settings, message):
    with pytest.raises(ValueError) as e:
        check_tasks(settings)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_launcher_refuses_a_bad_task_in_one_line_before_writing(tmp_path):
    proc = launch("import_problems", "--tasks=spell_backward", '--task_configs={"spell_backward": {"max_len": 4}}',
                  f"--output={tmp_path / 'p.jsonl'}")
    assert proc.returncode == 2
    assert error_lines(proc) == ["import_problems: --task_configs: task 'spell_backward' takes no config key "
                                 "'max_len' (did you mean 'max_word_len'?); its keys: min_word_len, max_word_len, "
                                 "data_file"]
    assert list(tmp_path.iterdir()) == []


INSTALL_LINE = "pip install -e '.[tasks]'"


@pytest.mark.parametrize("name, args", [
    ("import_problems", ["--tasks=spell_backward", "--output=OUT/p.jsonl"]),
    # the train launcher's reward check, before any model is built or the workdir made
    ("train", ["--config=configs/grpo_tiny.py", "--workdir=OUT/run", "--config.reward.name=reasoning_gym"]),
    # with plug-ins too (a plug-in cannot take a built-in name): refused before they or any model load
    ("train", ["--config=configs/grpo_tiny.py", "--workdir=OUT/run", "--config.reward.name=reasoning_gym",
               "--config.plugins=('policy_loss:tests/test_plugins.py:t_scalar_loss',)"]),
])
def test_without_the_extra_a_command_that_names_it_is_refused_in_one_line(tmp_path, name, args):
    argv = [name] + [a.replace("OUT", str(tmp_path)) for a in args]
    code = (f"{BLOCK_EXTRA}; import runpy; sys.argv = {argv!r}; "
            f"runpy.run_module('launchers.{name}', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    [line] = error_lines(proc)
    assert line.startswith(f"{name}: reasoning-gym tasks need the optional package reasoning-gym")
    assert line.endswith(INSTALL_LINE)
    assert list(tmp_path.iterdir()) == []


def test_without_the_extra_a_reward_that_names_it_is_refused_by_the_first_check(monkeypatch):
    """check_reward_choice is what launchers.train, rollout and evaluate run on the config before a model loads."""
    from jaxrl.rollout.runner import check_reward_choice
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    for attempt in (lambda: check_reward_choice("reasoning_gym", {}, flag="--config.reward.name"),
                    lambda: get_reward("reasoning_gym")):
        with pytest.raises(KeyError) as e:
            attempt()
        assert e.value.args[0].endswith(INSTALL_LINE) and "\n" not in e.value.args[0]
    check_reward_choice("exact_match", {})  # the other rewards are unaffected


def test_the_answer_retry_environment_says_what_was_wrong_and_asks_again(generated):
    from jaxrl.environments import ENVIRONMENTS, Turn
    problem = next(p for p in generated.train if p.metadata["reasoning_gym"]["task"] == "spell_backward")
    answer = problem.tests[0].output
    env = ENVIRONMENTS.get("answer_retry")(turn_cost=0.1)
    assert env.reset(problem) == [dict(m) for m in problem.messages]
    wrong = answer[:-1] + ("a" if answer[-1] != "a" else "b")  # all letters but the last in place

    def turn(text, index, last=False, finish="stop"):
        return Turn(text, (), finish, index=index, last=last)

    messages, reward, done = env.step(turn("I think it is\n" + answer, 0))
    assert (reward, done) == (-0.1, False)
    assert messages == [{"role": "user", "content": "No answer was found in your reply. Try again, and give your final "
                                                    "answer between <answer> and </answer>."}]
    messages, reward, done = env.step(turn(f"<answer>{wrong}</answer>", 1))
    score = (len(answer) - 1) / len(answer)
    assert messages[0]["content"] == (f"Your answer {wrong!r} is not correct (it scores {score:.2f} of 1). Try "
                                      "again, and give your final answer between <answer> and </answer>.")
    assert (reward, done) == (-0.1, False)
    assert env.step(turn(f"<answer>{answer}</answer>", 2)) == ([], 1.0, True) and env.solved
    env.reset(problem)  # the last turn ends the episode with its score, right or not
    assert env.step(turn(f"<answer>{wrong}</answer>", 0, last=True)) == ([], pytest.approx(score), True)
    assert env.solved is False
    env.reset(problem)  # a turn cut at its cap scores 0 and ends the episode
    assert env.step(turn(f"<answer>{answer}</answer>", 0, finish="length")) == ([], 0.0, True)
