"""Every launcher through launchers/_main.py, as a user runs it (a fresh interpreter): --help exits 0, a bad flag,
an unknown flag, a missing required flag and a typo in a config key are one line with exit status 2, a bad value
is refused before any work (nothing written), user errors keep no traceback unless --verbose, and bugs keep
theirs. No model is built here: every command is refused (or helps) before one would be."""

from __future__ import annotations

import json
import textwrap

import pytest

from launcher_env import error_lines, launch, snapshot

LAUNCHERS = ("build_pairs", "compare", "convert", "demo", "diagnose", "evaluate", "export", "import_problems", "plan",
             "report", "rollout", "serve", "sweep", "train")


@pytest.mark.parametrize("name", LAUNCHERS)
def test_help_exits_0_and_prints_the_launchers_flags(name):
    proc = launch(name, "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--[no]verbose:" in proc.stdout and f"launchers/{name}.py:" in proc.stdout  # its own flags listed
    assert proc.stderr == ""


@pytest.mark.parametrize("args, message", [
    (("train", "--config=configs/sft_tiny.py", "--workdir=W", "--bogus=1"),
     "train: Unknown command line flag 'bogus'; see --helpshort"),
    (("train", "--config=configs/sft_tiny.py", "--workdir=W", "--config.optimizer.learning_rat=1e-3"),
     "train: --config.optimizer.learning_rat: no config key 'learning_rat'; Did you mean \"learning_rate\" instead of "
     "\"learning_rat\"?; see --helpshort"),
    (("train", "--config=configs/sft_tiny.py", "--workdir=W", "--config.optimizer.learning_rate=abc"),
     "train: flag --config.optimizer.learning_rate=abc: could not convert string to float: 'abc'; see --helpshort"),
    (("train", "--config=configs/no_such_config.py", "--workdir=W"),
     "train: --config=configs/no_such_config.py: [Errno 2] No such file or directory: 'configs/no_such_config.py'"),
    (("evaluate", "--problems=P", "--base=B", "--out=O", "--num_samples=two"),
     "evaluate: flag --num_samples=two: invalid literal for int() with base 10: 'two'; see --helpshort"),
    (("convert", "--src=S", "--out=O"), "convert: flag --to=None: Flag --to must have a value other than None.; see "
                                        "--helpshort"),
    (("plan", "--sd_diff=0.1", "--power=2"), "plan: --power=2.0: expected a value in (0, 1)"),
    (("rollout", "--problems=P", "--model=M"), "rollout: --out is required"),
    # the deprecated --backend_kwargs: an unknown key, and a key that contradicts its flag (jaxrl.backends.flags)
    (("rollout", "--problems=P", "--model=M", "--out=O", "--backend=vllm", '--backend_kwargs={"gpu_util": 0.5}'),
     "rollout: --backend_kwargs: unknown key 'gpu_util'; valid keys: url, max_lora_rank, concurrency, "
     "request_timeout_s, progress_every_s, fleet_wait_s, python, tensor_parallel_size, data_parallel_size, "
     "gpu_memory_utilization, extra_args, startup_timeout_s, max_loras (each is a flag now: --server_url, --vllm_max_lora_rank, "
     "--server_<key>, --vllm_<key>)"),
    (("evaluate", "--problems=P", "--base=B", "--out=O", "--backend=vllm", "--server_concurrency=4",
      '--backend_kwargs={"concurrency": 8}'),
     "evaluate: --backend_kwargs key 'concurrency'=8 and --server_concurrency=4 disagree; give --server_concurrency "
     "only"),
])
def test_usage_errors_are_one_line_with_status_2(tmp_path, args, message):
    args = [a.replace("=W", f"={tmp_path / 'w'}").replace("=O", f"={tmp_path / 'o'}") for a in args]
    message = message.replace("=W", f"={tmp_path / 'w'}")
    proc = launch(*args, timeout=120)
    assert (proc.returncode, error_lines(proc)) == (2, [message])
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_a_typo_in_a_config_file_names_the_key_and_the_nearest_one(tmp_path):
    config = tmp_path / "typo.py"
    config.write_text(textwrap.dedent("""
        from configs import sft_tiny

        def get_config():
            c = sft_tiny.get_config()
            c.optimizer.warmup_stpes = 3
            return c
    """))
    workdir = tmp_path / "run"
    proc = launch("train", f"--config={config}", f"--workdir={workdir}", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = error_lines(proc)
    assert line.startswith("train: unknown config key 'optimizer.warmup_stpes'; did you mean "
                           "'optimizer.warmup_steps'?")
    assert not workdir.exists()


@pytest.mark.parametrize("override, message", [
    ("--config.steps=0", "train: config: steps must be an integer >= 1, got 0"),
    ("--config.optimizer.learning_rate=-1e-3", "train: optimizer.learning_rate must be >= 0, got -0.001"),
    ("--config.keep_checkpoints=0", "train: config: keep_checkpoints must be an integer >= 1 (or None to keep all), "
                                    "got 0"),
])
def test_bad_training_values_are_refused_before_any_model_is_built(tmp_path, override, message):
    workdir = tmp_path / "run"
    proc = launch("train", "--config=configs/sft_tiny.py", f"--workdir={workdir}", override, timeout=300)
    assert (proc.returncode, error_lines(proc)) == (2, [message]), proc.stderr[-3000:]
    assert not workdir.exists()


def test_a_workdir_holding_a_run_of_another_shape_is_refused_before_any_work(tmp_path):
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "state" / "4").mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps({"lora": {"rank": 8}, "algorithm": "sft"}))
    before = snapshot(workdir)
    proc = launch("train", "--config=configs/sft_tiny.py", f"--workdir={workdir}", timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # refused work (a resume of other settings), as documented
    [line] = error_lines(proc)
    assert line.startswith(f"train: {workdir} holds a run (checkpoint of step 4) whose config differs in keys that "
                           "shape the training state (lora.rank: 8 -> 4")
    assert snapshot(workdir) == before


def test_verbose_adds_the_traceback_and_keeps_the_status(tmp_path):
    quiet = launch("report", f"--workdir={tmp_path / 'nope'}", timeout=120)
    loud = launch("report", f"--workdir={tmp_path / 'nope'}", "--verbose", timeout=120)
    line = f"report: {tmp_path / 'nope'}: no such run folder (--workdir)"
    assert (quiet.returncode, error_lines(quiet)) == (1, [line])
    assert loud.returncode == 1 and "Traceback (most recent call last)" in loud.stderr
    assert error_lines(loud)[-1] == line


def test_user_errors_and_bugs_are_told_apart():
    """The rule of launchers/_main.py: a project error class or a deliberate raise in the project's code is a user
    error; an exception raised inside a library is a bug (its traceback stays)."""
    from absl import app

    from launchers._main import EXIT_REFUSED, EXIT_USAGE, exit_status_of
    from jaxrl.backends.base import SamplingParams
    from jaxrl.utils.typed_config import ConfigKeyError
    from jaxrl.utils.io import JsonlError, OutputExistsError, read_jsonl

    def raised(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            return e
        raise AssertionError("did not raise")

    assert exit_status_of(raised(lambda: SamplingParams(temperature=-1))) == EXIT_USAGE  # ValueError, raised by jaxrl
    assert exit_status_of(ValueError("raised by a test, not by the project")) is None
    assert exit_status_of(app.UsageError("x")) == EXIT_USAGE
    assert exit_status_of(ConfigKeyError("x")) == EXIT_USAGE
    assert exit_status_of(JsonlError("f.jsonl", 3, "invalid JSON")) == EXIT_REFUSED
    assert exit_status_of(OutputExistsError("out exists")) == EXIT_REFUSED
    assert exit_status_of(raised(lambda: read_jsonl("/no/such/file"))) == EXIT_REFUSED
    assert exit_status_of(raised(lambda: json.loads("{"))) is None  # raised inside json: a bug of ours
    assert exit_status_of(raised(lambda: [1, 2][5])) is None  # IndexError: a bug
