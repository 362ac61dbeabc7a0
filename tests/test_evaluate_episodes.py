"""launchers.evaluate over multi-turn episodes (--environment, --max_turns): a real run of the launcher on the tiny
model with the built-in code_feedback environment and the packaged problems, base and a checkpoint; the episode
metrics of results.json are recounted from the written samples."""

import html
import json
from pathlib import Path

import pytest

from launcher_env import build, launch

ENVS = Path(__file__).resolve().parent / "episode_envs.py"

TURNS, K = 3, 2
# flags of the tiny model: 8-token turns, one prompt bucket holding the last turn's history (192 + 320 - 8)
FLAGS = ("--num_samples=2", "--temperature=1.0", "--max_new_tokens=8", "--max_prompt_len=192",
         "--prompt_buckets=504", "--batch_size=4", "--dtype=float32", "--seed=3", "--noprogress",
         "--environment=code_feedback", f"--max_turns={TURNS}", "--max_episode_tokens=320",
         '--environment_options={"public_tests": 1, "feedback_chars": 120, "timeout_s": 5, "workers": 2}',
         "--n_resamples=200")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate_episodes")
    env = build(root)
    # Thirty ordinary tokens are also stop ids: a random model then ends some turns within the 8-token cap, so
    # episodes take a second and third turn (a turn cut at the cap ends its episode).
    path = f"{env['model']}/config.json"
    with open(path) as f:
        config = json.load(f)
    for holder in (config, config.get("text_config") or {}):
        if "eos_token_id" in holder:
            holder["eos_token_id"] = [1, *range(40, 70)]
    with open(path, "w") as f:
        json.dump(config, f)
    return env


def _samples(out, name):
    with open(out / "samples" / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_evaluate_over_episodes_reports_solved_within_t_turns_recounted_from_the_samples(env, tmp_path):
    out = tmp_path / "eval"
    proc = launch("evaluate", f"--problems={env['problems']}", f"--base={env['model']}",
                  f"--checkpoints={env['run']}", "--steps=5", f"--out={out}", *FLAGS, cache=tmp_path / "xla")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["evaluation"]["environment"] == "code_feedback" and results["evaluation"]["max_turns"] == TURNS
    turns_seen = 0
    for name in ("base", "step_5"):
        recs = _samples(out, name)
        n = len(env["ids"]) * K
        assert len(recs) == n
        ep = results["models"][name]["episodes"]
        assert ep["n_episodes"] == n and ep["n_prompts"] == len(env["ids"]) and ep["max_turns"] == TURNS
        rates = [ep["solved_within"][str(t)]["rate"] for t in range(1, TURNS + 1)]
        assert rates == sorted(rates), rates  # non-decreasing in t
        for t in range(1, TURNS + 1):
            w = ep["solved_within"][str(t)]
            solved = sum(1 for r in recs if r["episode"]["solved_turn"] is not None and r["episode"]["solved_turn"] <= t)
            assert (w["solved"], w["n"], w["rate"]) == (solved, n, solved / n)
            assert 0.0 <= w["ci"][0] <= w["rate"] <= w["ci"][1] <= 1.0
        # solved by the last turn is the strict rate (equal samples a prompt: per prompt first changes nothing)
        assert rates[-1] == pytest.approx(results["models"][name]["strict_rate"])
        assert ep["turns_mean"] == {"mean": pytest.approx(sum(r["episode"]["turns"] for r in recs) / n), "n": n}
        assert ep["tokens_mean"] == {"mean": pytest.approx(sum(r["episode"]["tokens"] for r in recs) / n), "n": n}
        for r in recs:
            e = r["episode"]
            assert 1 <= e["turns"] <= TURNS and len(e["texts"]) == len(e["rewards"]) == e["turns"]
            assert r["completion"] == e["texts"][-1] and e["error"] is None
            assert r["strict"] == e["solved"] and (e["solved_turn"] is not None) == e["solved"]
            assert r["finish_reason"] == ("length" if e["truncated"] else "stop")
            assert e["tokens"] >= e["sampled_tokens"] == r["completion_tokens"] > 0
            # every turn but the last was answered by the environment: its feedback is the next observation
            assert len(e["observations"]) == e["turns"] - 1
            for obs in e["observations"]:
                assert "python" in obs[0] or "test" in obs[0].lower(), obs
            turns_seen = max(turns_seen, e["turns"])
    assert turns_seen > 1  # some episodes took a turn after the environment's feedback
    # the paired comparison of the per-problem episode reward, as for single completions
    rows = {(c["model"], c["metric"]) for c in results["comparisons"]}
    assert ("step_5", "partial_reward_mean") in rows and ("step_5", "strict_rate") in rows
    md = (out / "results.md").read_text()
    assert "## Episodes" in md and f"solved ≤{TURNS}" in md
    # what scored them: the environment's return (2e1e1a6 listed the unused `reward code` here)
    assert "episodes of environment `code_feedback`" in md and "reward `code`" not in md
    # the same command again resumes from the cache (nothing drawn again); other episode settings are refused
    before = (out / "samples" / "base.jsonl").read_bytes()
    args = (f"--problems={env['problems']}", f"--base={env['model']}", f"--checkpoints={env['run']}", "--steps=5",
            f"--out={out}")
    again = launch("evaluate", *args, *FLAGS, cache=tmp_path / "xla")
    assert again.returncode == 0 and (out / "samples" / "base.jsonl").read_bytes() == before, again.stderr[-2000:]
    other = launch("evaluate", *args, *[f for f in FLAGS if not f.startswith("--max_turns")], "--max_turns=2",
                   cache=tmp_path / "xla")
    assert other.returncode != 0 and "max_turns: 3 -> 2" in other.stderr, other.stderr[-2000:]
    # the report shows one episode of base and the checkpoint side by side, turn by turn, from the samples
    from jaxrl.diagnostics.report import build_report
    page = build_report(env["run"], out=tmp_path / "report.html", eval_dir=out).read_text()
    base_recs = {(r["problem_id"], r["sample_index"]): r for r in _samples(out, "base")}
    shown = [r for r in base_recs.values() if f"<b>episode {r['problem_id']}</b> #{r['sample_index']}:" in page]
    assert len(shown) == 1, "one episode side by side"
    assert all(html.escape(text) in page for text in shown[0]["episode"]["texts"] if text)


@pytest.mark.slow
def test_a_plugin_environment_solved_at_known_turns_gives_the_recounted_solved_within_t(env, tmp_path):
    """SolvedAt solves episode i at turn 1 + seed % 3 unless a turn hits the cap first: solved within t rises
    with t, and equals the recount of which episodes ended solved at which turn."""
    out = tmp_path / "eval"
    flags = [f for f in FLAGS if not f.startswith(("--environment", "--max_turns"))]
    proc = launch("evaluate", f"--problems={env['problems']}", f"--base={env['model']}", f"--out={out}", *flags,
                  f"--environment={ENVS}:SolvedAt", f"--max_turns={TURNS}", cache=tmp_path / "xla")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ep = json.loads((out / "results.json").read_text())["models"]["base"]["episodes"]
    recs = _samples(out, "base")
    ended = [r["episode"]["turns"] for r in recs if r["episode"]["solved"]]
    assert all(r["episode"]["solved_turn"] == r["episode"]["turns"] for r in recs if r["episode"]["solved"])
    counts = [ep["solved_within"][str(t)]["solved"] for t in range(1, TURNS + 1)]
    assert counts == [sum(turns <= t for turns in ended) for t in range(1, TURNS + 1)]
    assert counts[0] < counts[-1]  # some episodes are solved only after a later turn
    assert all(r["partial"] == float(r["strict"]) for r in recs)  # reward 1 exactly when solved


@pytest.mark.heavy  # a launcher run (the fix it proves: the failed-episodes warning was appended before the list
# of warnings existed, an UnboundLocalError that lost the whole evaluation's results)
def test_an_environment_that_raises_gives_failed_episodes_and_a_warning_not_a_crash(env, tmp_path):
    out = tmp_path / "eval"
    flags = [f for f in FLAGS if not f.startswith(("--environment", "--max_turns"))]
    proc = launch("evaluate", f"--problems={env['problems']}", f"--base={env['model']}", f"--out={out}", *flags,
                  f"--environment={ENVS}:RaisesOnOddSeeds", f"--max_turns={TURNS}", cache=tmp_path / "xla")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    failed = results["models"]["base"]["episodes"]["failed"]
    assert failed > 0 and any("episodes failed" in w for w in results["warnings"]), results["warnings"]


@pytest.mark.slow
def test_episode_flags_without_an_environment_or_with_an_unknown_one_are_refused_naming_the_flag(env, tmp_path):
    out = tmp_path / "eval"
    common = (f"--problems={env['problems']}", f"--base={env['model']}", f"--out={out}")
    proc = launch("evaluate", *common, "--max_turns=3")
    assert proc.returncode != 0 and "max_turns" in proc.stderr and "environment" in proc.stderr
    proc = launch("evaluate", *common, "--environment=no_such_env", "--max_turns=2")
    assert proc.returncode != 0 and "--environment='no_such_env'" in proc.stderr, proc.stderr[-2000:]
    assert not (out / "results.json").exists()
