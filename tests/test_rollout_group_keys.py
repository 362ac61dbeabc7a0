"""A problem drawn twice within one rollout (the rollout wraps past the end of an epoch, or a draw with
replacement) gets independent samples: each repeat's group is keyed apart, where before both groups shared the
problem's key and so were token-for-token copies. A first occurrence keeps its problem's key, so every rollout
without repeats samples exactly what it did before."""

from jaxrl.algorithms.online.prompts import ProblemPrompts
from jaxrl.data.chat import load_tokenizer
from jaxrl.data.problems import Problem, TestCase, save_problems
from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
from jaxrl.rollout.keys import group_keys, problem_key


def test_repeats_are_keyed_apart_and_first_occurrences_keep_their_key():
    keys = group_keys(["a", "b", "a", "a", "c"])
    assert keys[0] == problem_key("a") and keys[1] == problem_key("b") and keys[4] == problem_key("c")
    assert len(set(keys)) == 5  # the second and third "a" are neither "a" nor each other
    assert group_keys(["a", "b", "a"]) == keys[:3]  # stable: a function of the ids in order


def test_a_rollout_larger_than_the_problem_set_samples_each_repeat_apart(tmp_path):
    texts = ["add two and two", "spell cat backwards", "name a colour"]
    build_tiny_tokenizer(str(tmp_path / "tok"), texts, vocab_size=128)
    problems = [Problem(f"p{i}", ({"role": "user", "content": t},), "stdin", (TestCase("", "x"),))
                for i, t in enumerate(texts)]
    path = tmp_path / "problems.jsonl"
    save_problems(problems, path)
    source = ProblemPrompts(str(path), load_tokenizer(str(tmp_path / "tok")), enable_thinking=False,
                            max_prompt_len=64, on_overlong="error", seed=0)
    _, drawn, keys = source.prompts(0, 5)  # 5 prompts from 3 problems: two of them twice
    ids = [p.id for p in drawn]
    assert len(set(ids)) == 3 and len(set(keys)) == 5
    first = {}
    for pid, key in zip(ids, keys):
        first.setdefault(pid, key)
    assert first == {pid: problem_key(pid) for pid in ids}
    _, drawn, keys = source.prompts(0, 2)  # no repeat: the problems' own keys, as every earlier rollout had
    assert keys == [problem_key(p.id) for p in drawn]
