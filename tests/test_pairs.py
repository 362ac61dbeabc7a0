"""Preference-pair building, filters, audit counts, cohort freezing and the build_pairs launcher."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.data import pairs as P
from jaxrl.utils.io import JsonlError, read_jsonl, write_jsonl

REPO = Path(__file__).resolve().parents[1]
CAP = 4096  # cap - 24 = 4072 is kept, 4073 is truncated
MSGS = [{"role": "user", "content": "solve it"}]


def _r(pid, idx, partial, tokens, finish="stop", text=None, **extra):
    rec = {"problem_id": pid, "sample_index": idx, "completion": text or f"{pid}-s{idx}",
           "completion_tokens": tokens, "finish_reason": finish,
           "reward": {"partial": partial, "strict": partial == 1.0}, "model": "base", "messages": MSGS}
    rec.update(extra)
    return rec


# Each prompt exercises one rule; the comment says what best-vs-worst does with it.
ROLLOUTS = [
    _r("margin_below", 0, 0.7, 100), _r("margin_below", 1, 0.21, 100),       # margin 0.49 -> margin
    _r("margin_at", 0, 0.7, 100), _r("margin_at", 1, 0.2, 100),              # 0.7-0.2 == 0.4999.. -> kept
    _r("margin_above", 0, 0.75, 100), _r("margin_above", 1, 0.2, 100),       # 0.55 -> kept
    _r("tok_at", 0, 1.0, 4072), _r("tok_at", 1, 0.0, 3800),                  # exactly cap-24 -> kept
    _r("tok_over", 0, 1.0, 4073), _r("tok_over", 1, 0.0, 3800),              # cap-23 -> chosen_truncated
    _r("rej_length", 0, 1.0, 1000), _r("rej_length", 1, 0.0, 3000, "length"),  # rejected_truncated + length
    _r("diff_512", 0, 1.0, 100), _r("diff_512", 1, 0.0, 612),                # diff 512 -> kept
    _r("diff_513", 0, 1.0, 100), _r("diff_513", 1, 0.0, 613),                # diff 513 -> length
    _r("tied", 0, 0.5, 10), _r("tied", 1, 0.5, 20), _r("tied", 2, 0.5, 30),  # all_tied
    _r("single", 0, 1.0, 10),                                                # single_sample
    # ties: chosen = shortest of the 1.0s (s1 and s2 have 200 tokens and the same text -> lower index s1),
    # rejected = shortest of the 0.0s (s4)
    _r("tiebreak", 0, 1.0, 300), _r("tiebreak", 1, 1.0, 200, text="same"), _r("tiebreak", 2, 1.0, 200, text="same"),
    _r("tiebreak", 3, 0.0, 250), _r("tiebreak", 4, 0.0, 150),
    # worst is truncated: dropped by best_worst, rescued by best_admissible with s2 (margin 0.6)
    _r("rescue", 0, 1.0, 100), _r("rescue", 1, 0.0, 4096, "length"), _r("rescue", 2, 0.4, 120),
    _r("multi_fail", 0, 0.6, 4080), _r("multi_fail", 1, 0.3, 100),           # chosen_trunc + length + margin
    # the record's own cap (2048) wins over the config's 4096: 2030 > 2048-24 -> chosen_truncated
    _r("cap_record", 0, 1.0, 2030, max_new_tokens=2048), _r("cap_record", 1, 0.0, 1600, max_new_tokens=2048),
]
KEPT_BEST_WORST = ["margin_at", "margin_above", "tok_at", "diff_512", "tiebreak"]


def _samples():
    return [P._sample_from_record(r) for r in ROLLOUTS]


def test_best_worst_kept_set_and_audit():
    pairs, audit = P.build_pairs(_samples(), P.PairConfig(max_new_tokens=CAP))
    assert [p["problem_id"] for p in pairs] == KEPT_BEST_WORST
    assert audit["prompts"] == {"total": 14, "single_sample": 1, "all_tied": 1, "with_candidates": 12,
                                "with_pairs": 5, "without_admissible_pair": 7}
    counts = tuple(audit[k] for k in ("candidates", "passed", "dropped", "rescued", "kept"))
    assert counts == (12, 5, 7, 0, 5)
    assert audit["fail_counts"] == {"chosen_truncated": 3, "rejected_truncated": 2, "length_diff_over_max": 4,
                                    "margin_under_min": 2}
    assert audit["first_fail_counts"] == {"chosen_truncated": 3, "rejected_truncated": 2,
                                          "length_diff_over_max": 1, "margin_under_min": 1}
    tb = pairs[-1]
    assert (tb["chosen_sample_index"], tb["rejected_sample_index"]) == (1, 4)
    assert (tb["chosen"], tb["rejected"]) == ("same", "tiebreak-s4")
    assert (tb["chosen_tokens"], tb["rejected_tokens"]) == (200, 150)
    # schema of docs/reference/interfaces.md, plus our provenance keys
    for p in pairs:
        assert set(P.PAIR_KEYS) <= set(p)
        assert p["messages"] == MSGS and p["model"] == "base" and p["max_new_tokens"] == CAP
        assert p["pair_id"] == P.pair_id(p["problem_id"], p["chosen"], p["rejected"]) and len(p["pair_id"]) == 16
    assert pairs[0]["chosen_reward"] == 0.7 and pairs[0]["rejected_reward"] == 0.2

    # distributions of the 5 kept pairs, by hand: tokens chosen (100,100,4072,100,200) rejected (100,100,3800,612,150)
    kept = audit["distributions"]["kept"]
    assert kept["n"] == 5
    assert kept["chosen_tokens"]["mean"] == pytest.approx(914.4)
    assert kept["rejected_tokens"]["mean"] == pytest.approx(952.4)
    bias = kept["length_bias"]  # (0, 0, 272, -512, 50)
    assert (bias["mean"], bias["median"], bias["min"], bias["max"]) == pytest.approx((-38.0, 0.0, -512.0, 272.0))
    assert (bias["p10"], bias["p90"]) == pytest.approx((-307.2, 183.2))
    assert sum(bias["histogram"]["counts"]) == 5 and len(bias["histogram"]["edges"]) == 11
    assert (kept["fraction_chosen_longer"], kept["fraction_chosen_shorter"]) == pytest.approx((0.4, 0.2))
    assert kept["margin"]["mean"] == pytest.approx((0.5 + 0.55 + 3.0) / 5)
    assert audit["distributions"]["candidates"]["n"] == 12


def test_best_admissible_rescues():
    pairs, audit = P.build_pairs(_samples(), P.PairConfig(max_new_tokens=CAP, selection="best_admissible"))
    assert [p["problem_id"] for p in pairs] == KEPT_BEST_WORST[:4] + ["tiebreak", "rescue"]
    rescue = pairs[-1]
    assert (rescue["chosen_sample_index"], rescue["rejected_sample_index"]) == (0, 2)
    assert rescue["chosen_reward"] - rescue["rejected_reward"] == pytest.approx(0.6)
    # counts are over the best-vs-worst candidates, as in best_worst; the replacement is counted as rescued
    counts = tuple(audit[k] for k in ("candidates", "passed", "dropped", "rescued", "kept"))
    assert counts == (12, 5, 7, 1, 6)
    assert audit["prompts"]["with_pairs"] == 6 and audit["prompts"]["without_admissible_pair"] == 6


def test_pairing_all():
    pairs, audit = P.build_pairs(_samples(), P.PairConfig(max_new_tokens=CAP, pairing="all"))
    by_prompt = {}
    for p in pairs:
        by_prompt.setdefault(p["problem_id"], []).append((p["chosen_sample_index"], p["rejected_sample_index"]))
    # tiebreak: 3 chosen x 2 rejected = 6, minus 2 duplicates (s1/s2 share their text)
    assert by_prompt["tiebreak"] == [(1, 4), (1, 3), (0, 4), (0, 3)]
    assert by_prompt["rescue"] == [(0, 2)]
    assert list(by_prompt) == ["margin_at", "margin_above", "tok_at", "diff_512", "tiebreak", "rescue"]
    assert (audit["candidates"], audit["passed"], audit["duplicates_removed"], audit["kept"]) == (17, 9, 2, 9)
    # rescue adds (s0,s1): rejected_trunc + length; (s2,s1): rejected_trunc + length + margin 0.4
    assert audit["fail_counts"] == {"chosen_truncated": 3, "rejected_truncated": 3, "length_diff_over_max": 5,
                                    "margin_under_min": 3}
    assert audit["first_fail_counts"] == {"chosen_truncated": 3, "rejected_truncated": 3,
                                          "length_diff_over_max": 1, "margin_under_min": 1}
    assert len({p["pair_id"] for p in pairs}) == 9


def test_custom_thresholds_and_missing_cap_or_messages():
    # looser filters keep more: margin 0.4 and length diff 1000 admit margin_below and diff_513
    pairs, _ = P.build_pairs(_samples(), P.PairConfig(max_new_tokens=CAP, min_margin=0.4, max_length_diff=1000))
    assert {"margin_below", "diff_513"} <= {p["problem_id"] for p in pairs}
    with pytest.raises(ValueError, match="problem 'margin_below' sample 0.*cap is unknown"):
        P.build_pairs(_samples(), P.PairConfig())
    no_msgs = [P._sample_from_record({k: v for k, v in r.items() if k != "messages"}) for r in ROLLOUTS[:2]]
    with pytest.raises(ValueError, match="problem 'margin_below'.*no messages"):
        P.build_pairs(no_msgs, P.PairConfig(max_new_tokens=CAP, min_margin=0.1))
    pairs, _ = P.build_pairs(no_msgs, P.PairConfig(max_new_tokens=CAP, min_margin=0.1), {"margin_below": MSGS})
    assert pairs[0]["messages"] == MSGS
    with pytest.raises(ValueError, match="selection must be one of"):
        P.PairConfig(selection="best")


def test_read_rollouts_malformed_lines(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    lines = [json.dumps(ROLLOUTS[0]), json.dumps({k: v for k, v in ROLLOUTS[1].items() if k != "reward"}),
             "{not json", json.dumps(ROLLOUTS[2]), ""]
    path.write_text("\n".join(lines))
    with pytest.raises(JsonlError, match="^" + re.escape(f"{path}:2: missing key 'reward'") + "$"):
        P.read_rollouts(path)
    skipped = []
    samples = P.read_rollouts(path, skip_malformed=True, skipped=skipped)
    assert [(s.problem_id, s.sample_index, s.line) for s in samples] == [("margin_below", 0, 1), ("margin_at", 0, 4)]
    assert len(skipped) == 2
    assert skipped[0].startswith(f"{path}:2:") and skipped[1].startswith(f"{path}:3: invalid JSON")
    bad_finish = tmp_path / "bad.jsonl"
    bad_finish.write_text(json.dumps(_r("x", 0, 1.0, 5, finish="eos")) + "\n")
    with pytest.raises(JsonlError, match=r"bad.jsonl:1: finish_reason must be 'stop' or 'length'"):
        P.read_rollouts(bad_finish)
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps(ROLLOUTS[0]) + "\n" + json.dumps(ROLLOUTS[0]) + "\n")
    with pytest.raises(ValueError, match=r"dup.jsonl:2: duplicate sample .*first seen on line 1"):
        P.read_rollouts(dup)


def _pair(pid, c_tok, r_tok, c_rew=1.0, r_rew=0.0, **extra):
    rec = {"problem_id": pid, "messages": MSGS, "chosen": f"{pid}-c", "rejected": f"{pid}-r",
           "chosen_reward": c_rew, "rejected_reward": r_rew, "chosen_tokens": c_tok, "rejected_tokens": r_tok}
    rec.update(extra)
    return rec


def test_filter_pairs_mode():
    old = [
        _pair("ok", 100, 200),
        _pair("boundary", 4072, 3560, 0.75, 0.25),                      # cap-24, diff 512, margin 0.5 -> kept
        _pair("chosen_long", 4073, 3800),                               # chosen_truncated
        _pair("rej_finish", 100, 100, rejected_finish_reason="length"),  # rejected_truncated
        _pair("small_margin", 100, 100, 0.6, 0.2),                      # margin
        _pair("diff", 100, 613),                                        # length
        _pair("ok", 100, 200),                                          # exact duplicate
        _pair("own_cap", 700, 980, max_new_tokens=1000),                 # 980 > 1000-24 -> rejected_truncated
    ]
    kept, audit = P.filter_pairs(old, P.PairConfig(max_new_tokens=CAP))
    assert [p["problem_id"] for p in kept] == ["ok", "boundary"]
    assert kept[0]["pair_id"] == P.pair_id("ok", "ok-c", "ok-r") and kept[0]["chosen_tokens"] == 100
    assert (audit["mode"], audit["candidates"], audit["passed"], audit["dropped"], audit["duplicates_removed"],
            audit["kept"]) == ("pairs", 7, 2, 5, 1, 2)
    assert audit["fail_counts"] == {"chosen_truncated": 1, "rejected_truncated": 2, "length_diff_over_max": 1,
                                    "margin_under_min": 1}
    assert audit["first_fail_counts"] == audit["fail_counts"]
    assert audit["prompts"] == {"total": 7, "with_pairs": 2, "without_admissible_pair": 5}
    # our own output filtered again with the same config keeps everything (idempotent)
    built, _ = P.build_pairs(_samples(), P.PairConfig(max_new_tokens=CAP))
    again, audit2 = P.filter_pairs(built, P.PairConfig())  # cap comes from the records
    assert again == built and audit2["dropped"] == 0
    with pytest.raises(ValueError, match="pair 0 \\(problem_id 'ok'\\).*cap is unknown"):
        P.filter_pairs(old, P.PairConfig())
    with pytest.raises(ValueError, match="pair 0 .*missing key 'rejected_tokens'"):
        P.filter_pairs([{k: v for k, v in old[0].items() if k != "rejected_tokens"}], P.PairConfig(max_new_tokens=1))


def test_cohort_freeze_refuse_verify(tmp_path):
    pool = [_pair(f"p{i}", 100, 100) for i in range(20)]
    m = P.freeze_cohort(pool, tmp_path, size=5, seed=3)
    cohort = tmp_path / "cohort"
    written = read_jsonl(cohort / "pairs.jsonl")
    assert [p["pair_id"] for p in written] == m["pair_ids"] and len(m["pair_ids"]) == 5
    expected_ids = sorted((P.pair_id(p["problem_id"], p["chosen"], p["rejected"]) for p in pool),
                          key=lambda i: hashlib.sha256(f"3:{i}".encode()).hexdigest())[:5]
    assert m["pair_ids"] == expected_ids
    assert m["sha256"] == hashlib.sha256((cohort / "pairs.jsonl").read_bytes()).hexdigest()
    assert (m["size"], m["seed"], m["n_available"]) == (5, 3, 20)
    assert json.loads((cohort / "manifest.json").read_text()) == m
    assert P.verify_cohort(cohort) == m and P.verify_cohort(tmp_path) == m  # cohort dir or its parent
    assert [p["pair_id"] for p in P.load_cohort(tmp_path)] == m["pair_ids"]

    with pytest.raises(FileExistsError, match="cohort already exists.*--overwrite"):
        P.freeze_cohort(pool, tmp_path, size=5, seed=4)
    assert P.verify_cohort(cohort)["seed"] == 3  # untouched
    # input order does not matter; a smaller cohort with the same seed is a prefix
    m2 = P.freeze_cohort(list(reversed(pool)), tmp_path, size=3, seed=3, overwrite=True)
    assert m2["pair_ids"] == m["pair_ids"][:3]
    m3 = P.freeze_cohort(pool, tmp_path / "other", size=5, seed=4)
    assert m3["pair_ids"] != m["pair_ids"]
    with pytest.raises(ValueError, match="cohort size 21 exceeds the 20 pairs"):
        P.freeze_cohort(pool, tmp_path / "big", size=21)

    # one changed byte -> verify fails naming the file
    data = bytearray((cohort / "pairs.jsonl").read_bytes())
    data[data.index(b"p")] = ord("q")
    (cohort / "pairs.jsonl").write_bytes(bytes(data))
    with pytest.raises(P.CohortError, match=re.escape(f"{cohort / 'pairs.jsonl'}: sha256 ") + ".* does not match"):
        P.verify_cohort(cohort)
    with pytest.raises(P.CohortError, match="no cohort manifest"):
        P.verify_cohort(tmp_path / "nowhere")


def _launch(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "launchers.build_pairs", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_launcher_end_to_end(tmp_path):
    rollouts = tmp_path / "rollouts.jsonl"
    lines = [json.dumps(r) for r in ROLLOUTS]
    lines.insert(2, '{"problem_id": "broken"')  # line 3
    rollouts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"

    res = _launch(f"--rollouts={rollouts}", f"--out_dir={out}", f"--max_new_tokens={CAP}")
    assert res.returncode == 1 and f"{rollouts}:3: invalid JSON" in res.stderr
    assert not out.exists()

    res = _launch(f"--rollouts={rollouts}", f"--out_dir={out}", f"--max_new_tokens={CAP}", "--skip_malformed",
                  "--cohort_size=3", "--seed=1")
    assert res.returncode == 0, res.stderr
    assert "pairs kept: 5" in res.stdout and "first failing reason: chosen_truncated 3" in res.stdout
    kept = read_jsonl(out / "pairs.jsonl")
    assert [p["problem_id"] for p in kept] == KEPT_BEST_WORST
    audit = json.loads((out / "audit.json").read_text())
    assert audit["kept"] == 5 and audit["input"]["skipped_malformed"] == 1 and audit["input"]["records"] == 32
    assert audit["config"]["max_new_tokens"] == CAP and audit["cohort"]["size"] == 3
    manifest = P.verify_cohort(out)
    assert set(manifest["pair_ids"]) <= {p["pair_id"] for p in kept}
    before = (out / "pairs.jsonl").read_bytes()

    # a second freeze is refused before anything is written
    res = _launch(f"--rollouts={rollouts}", f"--out_dir={out}", f"--max_new_tokens={CAP}", "--skip_malformed",
                  "--cohort_size=3", "--seed=2", "--selection=best_admissible")
    assert res.returncode == 1 and "--overwrite" in res.stderr
    assert (out / "pairs.jsonl").read_bytes() == before and P.verify_cohort(out)["seed"] == 1

    # filter mode over the pairs just built, with a stricter margin
    clean = tmp_path / "clean"
    res = _launch(f"--pairs_in={out / 'pairs.jsonl'}", f"--out_dir={clean}", "--min_margin=0.6")
    assert res.returncode == 0, res.stderr
    assert [p["problem_id"] for p in read_jsonl(clean / "pairs.jsonl")] == ["tok_at", "diff_512", "tiebreak"]
    assert json.loads((clean / "audit.json").read_text())["first_fail_counts"]["margin_under_min"] == 2
    assert sorted(os.listdir(clean)) == ["audit.json", "pairs.jsonl"]  # atomic writes leave no temp files


def test_jsonl_helpers(tmp_path):
    path = tmp_path / "a" / "x.jsonl"
    write_jsonl(path, [{"a": 1, "s": "é"}, {"a": 2}])
    assert path.read_text(encoding="utf-8") == '{"a": 1, "s": "é"}\n{"a": 2}\n'
    assert read_jsonl(path) == [{"a": 1, "s": "é"}, {"a": 2}]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # like open(), not mkstemp's 0600
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(JsonlError, match=r"x.jsonl:2: expected a JSON object, got list") as e:
        read_jsonl(path)
    assert e.value.line == 2
    with pytest.raises(ValueError, match=r"y.jsonl: cannot serialise"):
        write_jsonl(tmp_path / "y.jsonl", [{"a": float("nan")}])
    assert not (tmp_path / "y.jsonl").exists() and os.listdir(tmp_path) == ["a"]
