"""Pair audit: length bias on a constructed length-biased pairs file, and the semantic audit with the verifier."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import scipy.stats

from jaxrl.utils.io import write_jsonl
from jaxrl.diagnostics.pair_audit import audit_pairs, length_bias

REPO = Path(__file__).resolve().parents[1]
MSGS = [{"role": "user", "content": "solve"}]


def _pair(pid, c_tok, r_tok, c_rew=1.0, r_rew=0.0, chosen="c", rejected="r", **kw):
    rec = {"problem_id": pid, "messages": MSGS, "chosen": chosen, "rejected": rejected, "chosen_reward": c_rew,
           "rejected_reward": r_rew, "chosen_tokens": c_tok, "rejected_tokens": r_tok, "max_new_tokens": 4096,
           "chosen_finish_reason": "stop", "rejected_finish_reason": "stop"}
    rec.update(kw)
    return rec


def biased_pairs():
    """60 pairs; chosen is shorter in 54 of them and the margin grows with how much shorter it is."""
    out = []
    for i in range(60):
        if i < 54:
            gap = 20 + 10 * i  # chosen shorter by 20 ... 550 tokens
            out.append(_pair(f"p{i}", 300, 300 + gap, c_rew=min(1.0, 0.5 + gap / 1100), r_rew=0.0))
        else:
            out.append(_pair(f"p{i}", 400, 350, c_rew=0.55, r_rew=0.0))
    return out


def balanced_pairs():
    """60 pairs; chosen shorter and longer alternate with equal gaps, margin independent of length."""
    return [_pair(f"p{i}", 300 + (40 if i % 2 else -40), 300, c_rew=1.0 if i % 4 < 2 else 0.8, r_rew=0.2)
            for i in range(60)]


def test_length_biased_pairs_are_flagged_with_the_right_numbers():
    audit = audit_pairs(biased_pairs())
    lb = audit["length_bias"]
    assert lb["n_pairs"] == 60
    assert lb["fraction_chosen_shorter"] == pytest.approx(54 / 60)
    assert lb["fraction_chosen_longer"] == pytest.approx(6 / 60)
    want_mean = (sum(-(20 + 10 * i) for i in range(54)) + 6 * 50) / 60
    assert lb["mean_diff"] == pytest.approx(want_mean)
    assert lb["ci_low"] < want_mean < lb["ci_high"] < 0
    assert lb["sign_test"]["p_value"] == pytest.approx(scipy.stats.binomtest(6, 60, 0.5).pvalue, rel=1e-9)
    # More margin where chosen is much shorter: a strong negative correlation with (chosen - rejected).
    assert lb["margin_vs_length_diff"]["spearman"] < -0.8
    codes = [f["code"] for f in audit["flags"]]
    assert codes == ["length_bias_in_pairs"]
    msg = audit["flags"][0]["message"]
    assert "shorter than rejected in 90% of 60 pairs" in msg
    # The default filters would drop the pairs whose gap exceeds 512 tokens (i = 50 ... 53: 520 ... 550).
    assert audit["filters"]["fail_counts"]["length_diff_over_max"] == 4


def test_balanced_pairs_are_not_flagged():
    audit = audit_pairs(balanced_pairs())
    lb = audit["length_bias"]
    assert lb["fraction_chosen_shorter"] == 0.5 and lb["mean_diff"] == 0.0
    assert lb["sign_test"]["p_value"] == 1.0
    assert audit["flags"] == []
    assert audit["chosen_not_full"]["n"] == 30  # chosen_reward 0.8 in half the pairs


def test_length_bias_of_no_pairs():
    assert length_bias([]) == {"n_pairs": 0}
    assert audit_pairs([])["flags"] == []


ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CONST = "```python\nprint(3)\n```"  # passes "1 2" only
MUL = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"


def _problems(tmp_path):
    probs = [{"id": "add", "messages": MSGS, "test_type": "stdin", "fn_name": None, "starter_code": "",
              "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}],
              "time_limit_s": None, "source": "test"},
             {"id": "mul", "messages": MSGS, "test_type": "stdin", "fn_name": None, "starter_code": "",
              "tests": [{"input": "2 3\n", "output": "6\n"}], "time_limit_s": None, "source": "test"}]
    path = tmp_path / "problems.jsonl"
    write_jsonl(path, probs)
    return path


def _semantic_pairs():
    return [_pair("add", 30, 40, chosen=ADD, pair_id="good"),
            _pair("add", 30, 40, chosen=CONST, pair_id="stale"),  # recorded 1.0, really 0.5
            _pair("mul", 30, 40, chosen=MUL, pair_id="mul"),
            _pair("gone", 30, 40, chosen=ADD, pair_id="gone")]


def test_semantic_audit_finds_the_chosen_solution_that_fails(tmp_path):
    audit = audit_pairs(_semantic_pairs(), problems=_problems(tmp_path), reward="code", sample_size=10, seed=0)
    sem = audit["semantic"]
    assert sem["n_checked"] == 3 and sem["missing_problems"] == ["gone"]
    assert sem["n_failed"] == 1 and sem["n_not_strict"] == 1 and sem["n_below_recorded"] == 1
    (bad,) = sem["failures"]
    assert (bad["pair_id"], bad["partial"], bad["strict"], bad["tests"]) == ("stale", 0.5, False, ["pass", "wrong"])
    flag = next(f for f in audit["flags"] if f["code"] == "semantic_failures_in_pairs")
    assert flag["severity"] == "error" and "1 of 3" in flag["message"]


def test_semantic_sample_is_seeded(tmp_path):
    pairs = _semantic_pairs()[:3] * 4  # 12 pairs, sample 5
    a = audit_pairs(pairs, problems=_problems(tmp_path), reward="code", sample_size=5, seed=3)["semantic"]
    b = audit_pairs(pairs, problems=_problems(tmp_path), reward="code", sample_size=5, seed=3)["semantic"]
    assert a["n_checked"] == 5 and a == b


@pytest.mark.slow
def test_diagnose_launcher_pairs(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    write_jsonl(pairs, biased_pairs())
    out = tmp_path / "audit.json"
    proc = subprocess.run([sys.executable, "-m", "launchers.diagnose", "--what=pairs", f"--pairs={pairs}",
                           f"--out={out}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "chosen shorter 90.0%" in proc.stdout and "[warning] Length bias in pairs" in proc.stdout
    assert json.loads(out.read_text())["length_bias"]["n_pairs"] == 60
    proc = subprocess.run([sys.executable, "-m", "launchers.diagnose", "--what=pairs", f"--pairs={tmp_path}/no.jsonl",
                           f"--out={out}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "no.jsonl: no such file" in proc.stderr
