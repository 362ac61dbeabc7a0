"""`launchers.evaluate --environment` refuses an episode longer than the model's context in one line before it
loads or writes anything, and a failed evaluation never leaves a cache that refuses the corrected command
(jaxrl/evaluation/runner.py: check_episode_fits, Evaluator.cache). Real launcher runs on the tiny model."""

from __future__ import annotations

import json

import pytest

from launcher_env import build, error_lines, launch

SAMPLING = ("--num_samples=2", "--temperature=1.0", "--max_new_tokens=8", "--max_prompt_len=192", "--batch_size=4",
            "--dtype=float32", "--seed=3", "--noprogress", "--n_resamples=200", "--environment=code_feedback")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return build(tmp_path_factory.mktemp("eval_turn_limits"))


def test_a_turn_count_past_the_models_context_is_refused_in_one_line_before_anything_is_written(env, tmp_path):
    """Reproduction on 2e1e1a6: `--max_turns=1000000` makes the default episode budget max_turns x (max_new_tokens
    + max_prompt_len) tokens; the jax backend sizes a session row by it and fails allocating it (73.7 GB on the
    finding's machine, 2.1 TB here with the defaults of the tiny model: a RESOURCE_EXHAUSTED traceback), after
    the cache's settings were written. Here: one line naming the flag and the context, exit 2, no --out."""
    out = tmp_path / "eval"
    proc = launch("evaluate", f"--problems={env['problems']}", f"--base={env['model']}", f"--out={out}", *SAMPLING,
                  "--max_turns=1000000", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert error_lines(proc)[-1] == (
        f"evaluate: --max_turns=1000000: an episode of up to 192 prompt + 200000000 tokens (max_turns x "
        f"(max_new_tokens + max_prompt_len)) is longer than the context of the model in {env['model']} (4096 "
        f"tokens, max_position_embeddings); lower --max_turns, or set --max_episode_tokens (at most 3904 here)")
    assert not out.exists()

    too_long = launch("evaluate", f"--problems={env['problems']}", f"--base={env['model']}", f"--out={out}",
                      *SAMPLING, "--max_turns=3", "--max_episode_tokens=5000", timeout=120)
    assert too_long.returncode == 2 and error_lines(too_long)[-1].startswith(
        "evaluate: --max_episode_tokens=5000: an episode of up to 192 prompt + 5000 tokens (max_episode_tokens)"), \
        too_long.stderr[-3000:]
    assert error_lines(too_long)[-1].endswith("set --max_episode_tokens to at most 3904")
    assert not out.exists()


@pytest.mark.slow  # one evaluation of the tiny model over episodes (a compile), after one that fails
def test_an_evaluation_that_failed_before_its_first_sample_does_not_refuse_the_corrected_command(env, tmp_path):
    """Reproduction on 2e1e1a6: an evaluation that failed after the cache's settings record was written and before
    its first sample (there the 73.7 GB allocation; here an episode too long for the one prompt bucket) left
    cache/base.jsonl empty with that record; the corrected command was refused: "holds samples drawn with other
    settings (max_turns: ... -> ...)". Here the empty cache binds no settings and the corrected command runs."""
    out = tmp_path / "eval"
    common = (f"--problems={env['problems']}", f"--base={env['model']}", f"--out={out}", *SAMPLING,
              "--prompt_buckets=504")
    # 3 turns of the default budget make the last turn's prompt 192 + 3 x 200 - 8 = 784 tokens: no bucket holds it
    failed = launch("evaluate", *common, "--max_turns=3", timeout=300)
    assert failed.returncode != 0 and "504" in error_lines(failed)[-1], failed.stderr[-3000:]
    meta = out / "cache" / "base.jsonl.meta.json"
    assert meta.exists() and json.loads(meta.read_text())["settings"]["max_episode_tokens"] == 600, \
        "premise: the failed run recorded its settings in the cache before drawing a sample"
    assert (out / "cache" / "base.jsonl").read_bytes() == b""

    corrected = launch("evaluate", *common, "--max_turns=3", "--max_episode_tokens=320", timeout=300)
    assert corrected.returncode == 0, corrected.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["evaluation"]["max_episode_tokens"] == 320
    assert results["models"]["base"]["episodes"]["n_episodes"] == len(env["ids"]) * 2
    assert json.loads(meta.read_text())["settings"]["max_episode_tokens"] == 320


def test_a_cache_with_samples_of_other_settings_is_still_refused(env, tmp_path):
    """The empty-cache rule drops nothing that holds a sample: a cache of other settings with one record is
    refused as before, naming the key (mixing samples would corrupt the statistics)."""
    out = tmp_path / "eval"
    cache = out / "cache"
    cache.mkdir(parents=True)
    (cache / "base.jsonl").write_text('{"problem_id": "x", "sample_index": 0}\n')
    old = {"settings": {"max_turns": 5, "environment": "code_feedback"}, "status": "running"}
    (cache / "base.jsonl.meta.json").write_text(json.dumps(old))
    proc = launch("evaluate", f"--problems={env['problems']}", f"--base={env['model']}", f"--out={out}", *SAMPLING,
                  "--max_turns=3", "--max_episode_tokens=320", timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "holds samples drawn with other settings" in error_lines(proc)[-1] and "max_turns: 5 -> 3" in proc.stderr
    assert json.loads((cache / "base.jsonl.meta.json").read_text()) == old
