"""Paired generation diffs: the tags on constructed model pairs whose right answer is known."""

import pytest

from jaxrl.diagnostics.generation_diff import code_similarity, diff_generations, normalized_tokens, tag_change
from jaxrl.evaluation.metrics import model_metrics

SOLVE = "n = int(input())\ntotal = 0\nfor i in range(n):\n    total += i\nprint(total)\n"
SOLVE_RENAMED = "k = int(input())\nacc = 0\nfor j in range(k):\n    acc += j\nprint(acc)\n"
SOLVE_OFF_BY_ONE = "n = int(input())\ntotal = 0\nfor i in range(n + 1):\n    total += i\nprint(total)\n"
FORMULA = "import sys\ndef main():\n    data = sys.stdin.read().split()\n    n = int(data[0])\n" \
          "    sys.stdout.write(str(n * (n - 1) // 2))\nmain()\n"


def fenced(code, prose="Here is my solution."):
    return f"{prose}\n```python\n{code}```\n"


def rec(pid, partial, completion, tokens, finish="stop", idx=0):
    return {"problem_id": pid, "sample_index": idx, "completion": completion, "completion_tokens": tokens,
            "finish_reason": finish, "partial": partial, "strict": partial == 1.0, "tests": [], "reason": None,
            "max_new_tokens": 512}


def termination_only_pair():
    """Base rambles past the cap on prompts 0-5 (and stops but rambles 3x on 6-7); the checkpoint writes the same
    program and stops. Prompts 8-9 are unchanged."""
    base, ckpt = [], []
    for i in range(6):
        base.append(rec(f"p{i}", 0.0, "Let me think. " * 80 + "```python\n" + SOLVE, 512, "length"))
        ckpt.append(rec(f"p{i}", 1.0, fenced(SOLVE), 60))
    for i in (6, 7):
        base.append(rec(f"p{i}", 0.5, "Hmm. " * 150 + fenced(SOLVE), 300))
        ckpt.append(rec(f"p{i}", 1.0, fenced(SOLVE), 60))
    for i in (8, 9):
        base.append(rec(f"p{i}", 1.0, fenced(SOLVE), 60))
        ckpt.append(rec(f"p{i}", 1.0, fenced(SOLVE), 62))
    return base, ckpt


def test_a_model_that_only_changed_its_termination_is_tagged_termination():
    base, ckpt = termination_only_pair()
    d = diff_generations(base, ckpt, name_a="base", name_b="step_28")
    s = d["summary"]
    assert s["n_compared"] == 10 and s["n_changed"] == 8 and s["improved"] == 8 and s["worsened"] == 0
    assert {c["tag"] for c in d["changes"]} == {"termination"}
    assert s["by_tag"]["termination"]["n"] == 8 and s["by_tag"]["algorithm"]["n"] == 0
    # Contributions add up to the change of the evaluation metric (per prompt, then over prompts).
    want = model_metrics(ckpt)["partial_reward_mean"] - model_metrics(base)["partial_reward_mean"]
    assert s["mean_partial_diff"] == pytest.approx(want) == pytest.approx(0.7)
    assert sum(c["contribution"] for c in d["changes"]) == pytest.approx(want)
    assert s["by_tag"]["termination"]["net_delta"] == pytest.approx(0.7)
    (flag,) = d["flags"]
    assert flag["code"] == "termination_only_change" and "100% of the reward change" in flag["message"]
    first = d["changes"][0]
    assert first["finish_a"] == "length" and first["finish_b"] == "stop" and not first["has_code_a"]
    assert "```python" in first["text_b"]


def test_a_model_with_a_different_algorithm_is_tagged_algorithm_and_not_flagged():
    base = [rec(f"p{i}", 0.25, fenced(SOLVE), 60) for i in range(5)]
    ckpt = [rec(f"p{i}", 1.0, fenced(FORMULA), 70) for i in range(5)]
    d = diff_generations(base, ckpt, name_a="base", name_b="step_8")
    assert {c["tag"] for c in d["changes"]} == {"algorithm"}
    assert all(c["similarity"] < 0.6 for c in d["changes"])
    assert d["flags"] == []


@pytest.mark.parametrize("a,b,tag", [
    (rec("p", 0.0, "The answer: n*(n-1)/2, computed in a loop.", 40),
     rec("p", 1.0, fenced(SOLVE), 60), "format"),                                   # no closed block -> one
    (rec("p", 0.0, fenced(SOLVE), 60), rec("p", 1.0, fenced(SOLVE_RENAMED), 61), "same_code"),  # flaky
    (rec("p", 0.0, fenced(SOLVE), 60), rec("p", 1.0, fenced(SOLVE_OFF_BY_ONE), 62), "code_edit"),
    (rec("p", 0.0, fenced(SOLVE), 60), rec("p", 1.0, fenced(FORMULA), 80), "algorithm"),
    (rec("p", 0.0, fenced(SOLVE), 60, "length"), rec("p", 1.0, fenced(FORMULA), 80), "termination"),
    (rec("p", 0.5, "blah " * 200 + fenced(SOLVE), 260), rec("p", 1.0, fenced(SOLVE), 60), "termination"),
    (rec("p", 0.0, "abc", 4), rec("p", 1.0, "123", 4), "answer"),               # a non-code reward: no code
])
def test_tags(a, b, tag):
    assert tag_change(a, b)[0] == tag


def test_code_similarity_ignores_names_and_comments_but_not_structure():
    assert normalized_tokens(SOLVE) == normalized_tokens(SOLVE_RENAMED)
    assert code_similarity(SOLVE, "# a comment\n" + SOLVE) == 1.0
    assert 0.6 < code_similarity(SOLVE, SOLVE_OFF_BY_ONE) < 1.0
    assert code_similarity(SOLVE, FORMULA) < 0.6
    assert normalized_tokens("def f(:\n  x = 'a")  # untokenizable code still gives tokens


def test_unpaired_samples_are_counted_and_disjoint_sets_refused():
    base, ckpt = termination_only_pair()
    d = diff_generations(base + [rec("extra", 1.0, "x", 1)], ckpt, name_a="base", name_b="s")
    assert d["summary"]["only_in_a"] == 1 and d["summary"]["n_compared"] == 10
    with pytest.raises(ValueError, match="share no"):
        diff_generations([rec("a", 1.0, "x", 1)], [rec("b", 1.0, "x", 1)])
    with pytest.raises(ValueError, match="record 1 repeats sample"):
        diff_generations([rec("a", 1.0, "x", 1)] * 2, [rec("a", 1.0, "x", 1)])
