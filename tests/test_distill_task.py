"""`algorithm = "distill"` end to end on the tiny model: a tiny random Qwen3.5 student (configs/distill_tiny.py) and a
different tiny teacher with the same vocabulary, built with transformers at test time (tests/hf_tiny.py)."""

import json
import os

import numpy as np
import pytest

import hf_tiny
from conftest import tiny_config
from jaxrl.algorithms.run import run_training

DISTILL_METRICS = ("distill/reverse_kl", "distill/reverse_kl_max", "distill/log_ratio", "distill/student_logp",
                   "distill/teacher_logp", "distill/top1_agreement", "distill/outside_topk", "distill/student_rows")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny HF Qwen3.5 of the student's vocabulary (64), another shape and other weights."""
    folder = str(tmp_path_factory.mktemp("teacher"))
    hf_tiny.build_text(folder, seed=7, vocab_size=64, num_hidden_layers=2)
    return folder


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """The student's base: a tiny HF Qwen3.5 (the teacher's shape, other weights). Its perturbed weights give
    logits LoRA can move within a few steps, where the preset init is near-uniform."""
    folder = str(tmp_path_factory.mktemp("student"))
    hf_tiny.build_text(folder, seed=3, vocab_size=64, num_hidden_layers=2)
    return folder


def distill_config(teacher, student=None, **block):
    """configs/distill_tiny.py with this teacher (and student base: model_path)."""
    cfg = tiny_config("distill", teacher_path=teacher, **block)
    if student:
        cfg.model_path, cfg.model_overrides = student, {}
    return cfg


def _finite(records):
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    for name in DISTILL_METRICS + ("loss", "reward/mean", "grad_norm"):
        values = np.array([r[name] for r in records])
        assert np.all(np.isfinite(values)), name
    assert all(r["update_skipped"] == 0 for r in records)


@pytest.mark.slow
def test_distill_forward_kl_topk_trains_toward_the_teacher(teacher, student, tmp_path):
    """configs/distill_tiny.py (forward_kl_topk at temperature 0.3): loss and reverse KL to the teacher fall."""
    cfg = distill_config(teacher, student)
    cfg.steps = 10
    cfg.checkpoint_every = 10
    records = run_training(cfg, str(tmp_path / "run")).records
    _finite(records)
    loss = np.array([r["loss"] for r in records])
    rkl = np.array([r["distill/reverse_kl"] for r in records])
    print("loss", np.round(loss, 3), "reverse KL", np.round(rkl, 3))
    assert loss[-3:].mean() < 0.7 * loss[:2].mean()
    assert rkl[-3:].mean() < rkl[:2].mean()
    assert records[0]["distill/student_rows"] == 1.0
    assert 0.0 < records[0]["distill/outside_topk"] < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_distill_other_losses_run_with_finite_metrics(teacher, student, tmp_path, loss):
    cfg = distill_config(teacher, student, loss=loss)
    cfg.steps = 2
    cfg.checkpoint_every = 2
    records = run_training(cfg, str(tmp_path / "run")).records
    _finite(records)
    if loss == "reverse_kl":  # the loss is the policy-gradient surrogate: its value is the mean log-ratio
        np.testing.assert_allclose(records[0]["loss"], records[0]["distill/log_ratio"], rtol=1e-5)


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_lmbda_mixes_student_samples_with_sft_responses(teacher, student, tmp_path):
    """lmbda 0.5: half the step's rows are the student's samples, half the SFT file's responses (prompt = the
    tokens before the first loss_mask 1), every row scored by the teacher."""
    from jaxrl.algorithms.distill_task import SFTResponses
    rng = np.random.default_rng(0)
    sft = tmp_path / "sft.jsonl"
    with open(sft, "w") as f:
        for _ in range(10):
            prompt, response = rng.integers(2, 64, 4).tolist(), rng.integers(2, 64, 5).tolist()
            f.write(json.dumps({"input_ids": prompt + response, "loss_mask": [0] * 4 + [1] * 5}) + "\n")
    rows = SFTResponses(str(sft), max_prompt_len=6, max_new_tokens=8, pad_id=0, seed=0).rows(3, 4)
    assert rows["input_ids"].shape == (4, 14) and rows["completion_mask"].sum(1).tolist() == [5.0] * 4
    assert (rows["attention_mask"][:, :2] == 0).all() and (rows["attention_mask"][:, 2:11] == 1).all()
    cfg = distill_config(teacher, student, loss="jsd", lmbda=0.5, sft_path=str(sft))
    cfg.steps = 2
    cfg.checkpoint_every = 2
    records = run_training(cfg, str(tmp_path / "run")).records
    _finite(records)
    assert records[0]["distill/student_rows"] == 0.5


@pytest.mark.heavy  # two launcher processes, one killed
def test_distill_killed_and_resumed_is_bit_identical(teacher, student, tmp_path):
    """SIGKILL after step 3 (checkpoints every 2), resumed by the launcher: the adapters and every step's loss and
    distill/* metrics equal an uninterrupted run's (a rollout is a function of (seed, step) and the parameters)."""
    from test_resume import launch
    from jaxrl.models.adapters import load_adapter
    from jaxrl.train.metrics import read_metrics
    args = ["--config=configs/distill_tiny.py", f"--config.distill.teacher_path={teacher}",
            f"--config.model_path={student}", "--config.model_overrides={}", "--config.steps=6",
            "--config.checkpoint_every=2", "--config.tensorboard=False"]
    cache = str(tmp_path / "jax_cache")
    straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
    done = launch(straight, cache, args=args)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = launch(broken, cache, "--debug_kill_after_step=3", args=args)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = launch(broken, cache, args=args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    a, b = load_adapter(straight, step=6)[0], load_adapter(broken, step=6)[0]
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    ma, mb = read_metrics(straight), read_metrics(broken)
    assert [r["step"] for r in mb] == list(range(1, 7))
    for key in ("loss", "distill/reverse_kl", "distill/teacher_logp", "reward/mean"):
        assert [r[key] for r in mb] == [r[key] for r in ma], key


# ------------------------------------------------------------------------------------------------- bad input


def _refused(cfg, workdir, *needles):
    """run_training refuses `cfg` with a one-line error naming `needles`, before writing anything to `workdir`."""
    with pytest.raises(ValueError) as info:
        run_training(cfg, workdir)
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    assert not os.path.exists(workdir) or not os.listdir(workdir), os.listdir(workdir)
    return message


def test_a_teacher_of_another_vocabulary_is_refused_naming_both(tmp_path):
    other = str(tmp_path / "teacher80")
    hf_tiny.build_text(other, seed=7, vocab_size=80, num_hidden_layers=2)
    message = _refused(distill_config(other), str(tmp_path / "run"), other, "80", "64")
    assert "student" in message


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(teacher, tmp_path):
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
    import shutil
    theirs = str(tmp_path / "teacher_tok")
    shutil.copytree(teacher, theirs)
    build_tiny_tokenizer(theirs, ["abcdef ghij"], vocab_size=64, printable_ascii=False)
    ours = build_tiny_tokenizer(str(tmp_path / "student_tok"), ["klmnop qrst"], vocab_size=64,
                                printable_ascii=False)
    cfg = distill_config(theirs)
    cfg.data.tokenizer = ours
    _refused(cfg, str(tmp_path / "run"), theirs, ours, "tokenizer")
    # the same tokenizer on both sides passes this check (and the run goes on to train)
    from jaxrl.algorithms.online.teacher import check_same_vocabulary
    build_tiny_tokenizer(ours, ["abcdef ghij"], vocab_size=64, printable_ascii=False)
    check_same_vocabulary(ours, 64, theirs)


@pytest.mark.parametrize("lmbda", [-0.1, 1.5])
def test_lmbda_outside_0_1_is_refused(teacher, tmp_path, lmbda):
    _refused(distill_config(teacher, lmbda=lmbda, loss="jsd", sft_path="x.jsonl"), str(tmp_path / "run"),
             "distill.lmbda", str(lmbda))


def test_a_missing_sft_file_is_refused_when_lmbda_is_below_1(teacher, tmp_path):
    _refused(distill_config(teacher, lmbda=0.5, loss="jsd"), str(tmp_path / "run1"), "distill.sft_path")
    missing = str(tmp_path / "nope.jsonl")
    _refused(distill_config(teacher, lmbda=0.5, loss="jsd", sft_path=missing), str(tmp_path / "run2"), missing)


def test_reverse_kl_needs_the_students_own_samples(teacher, tmp_path):
    _refused(distill_config(teacher, loss="reverse_kl", lmbda=0.5, sft_path="x.jsonl"), str(tmp_path / "run"), "reverse_kl",
             "lmbda")
