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
@pytest.mark.parametrize("loss, reward_weight", [("reverse_kl", 0.0), ("jsd", 0.0),
                                                 pytest.param("reverse_kl", 1.0, marks=pytest.mark.heavy)])
def test_distill_other_losses_run_with_finite_metrics(teacher, student, tmp_path, loss, reward_weight):
    """reward_weight 1 in a run: the rollout's reward group advantages reach the step (the loss leaves the mean
    log-ratio by -token-mean(A_reward), which is not 0 unless every group's rewards tie)."""
    cfg = distill_config(teacher, student, loss=loss, reward_weight=reward_weight)
    cfg.steps = 2
    cfg.checkpoint_every = 2
    records = run_training(cfg, str(tmp_path / "run")).records
    _finite(records)
    if loss == "reverse_kl":  # the loss is the policy-gradient surrogate: its value is the mean log-ratio
        gap = abs(records[0]["loss"] - records[0]["distill/log_ratio"])
        assert (gap > 1e-4) if reward_weight else (gap <= 1e-5 * abs(records[0]["loss"])), gap


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
    from jaxrl.backends.jax_teacher import check_same_vocabulary
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


def test_a_top_k_over_the_vocabulary_is_refused_before_anything_is_written(teacher, tmp_path):
    """Reproduction (2e1e1a6): `teacher_top_k` above the vocabulary was a raw JAX error after the workdir was
    written."""
    _refused(distill_config(teacher, teacher_top_k=65), str(tmp_path / "run"), "distill.teacher_top_k=65",
             "vocabulary of 64")


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -1.0])
def test_a_reward_weight_that_is_not_a_finite_number_above_0_is_refused(teacher, tmp_path, weight):
    """Reproduction (2e1e1a6): `distill.reward_weight=nan` or `inf` was accepted (every update skipped, exit 0),
    and `-1` too, though the docs say > 0."""
    _refused(distill_config(teacher, reward_weight=weight), str(tmp_path / "run"), "distill.reward_weight",
             "finite number >= 0")


# ------------------------------------------------------------------------------------------ reward_weight


def test_reward_advantages_are_reward_minus_the_group_mean():
    from jaxrl.algorithms.distill_task import reward_advantages
    rewards = np.array([1.0, 0.0, 0.5, np.nan, np.nan, np.nan, 2.0, 4.0, np.nan, np.nan], np.float32)
    # 8 student rows in groups of 2 (one group unscored, one half-scored), then 2 SFT rows
    adv = reward_advantages(rewards, 8, 2)
    np.testing.assert_allclose(adv, [0.5, -0.5, 0.0, 0.0, 0.0, 0.0, -1.0, 1.0, 0.0, 0.0])


@pytest.mark.heavy  # three gradient programs of the tiny model: ~40 s on two cores
def test_reward_weight_adds_its_group_advantage_to_every_token_as_documented(teacher, student):
    """DistillObjective with reward_weight w (jsd here, so the distillation term is a divergence): the loss is the
    w = 0 loss - w x token-mean(A_reward), and its gradient the w = 0 gradient plus that of the policy-gradient term
    -w x token-mean(A_reward(row) x log p(token)), written out here from the student's own log-probs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jaxrl.algorithms.distill_task import DistillObjective
    from jaxrl.backends.jax_teacher import JaxTeacher
    from jaxrl.models import qwen35
    from jaxrl.models.teacher_forced import next_token_logprobs
    from test_teacher_server import rollout_arrays
    arrays = rollout_arrays(n=6, seed=4)
    arrays["completion_mask"][-1, :2] = 1  # every row scored (reward groups of 2)
    scores = JaxTeacher.load(teacher, dtype="float32").score(arrays, k=8, temperature=1.0, batch_size=6)
    batch = {k: jnp.asarray(v) for k, v in arrays.items()}
    batch.update({"teacher_" + k: jnp.asarray(v) for k, v in scores.items()})
    batch["reward_advantages"] = jnp.asarray([0.5, -0.5, 1.0, -1.0, 0.0, 0.0], jnp.float32)
    model = qwen35.from_pretrained(student, dtype=jnp.float32)
    w = 0.7
    plain, paid = DistillObjective(loss_name="jsd"), DistillObjective(loss_name="jsd", reward_weight=w)
    norms = plain.normalisers(batch)
    mask = batch["completion_mask"]
    C = mask.shape[1]

    def explicit(m):  # -w x token-mean(A x log p), the student's log-probs of the completion tokens
        logp = next_token_logprobs(m, batch["input_ids"], batch["attention_mask"],
                                   start=batch["input_ids"].shape[1] - C - 1).logp
        return -w * jnp.sum(batch["reward_advantages"][:, None] * logp * mask) / jnp.sum(mask)

    loss0, grad0 = nnx.value_and_grad(lambda m: plain.loss(m, batch, norms, None)[0])(model)
    loss1, grad1 = nnx.value_and_grad(lambda m: paid.loss(m, batch, norms, None)[0])(model)
    grad_pg = nnx.grad(explicit)(model)
    expected = float(loss0) - w * float(jnp.sum(batch["reward_advantages"][:, None] * mask) / jnp.sum(mask))
    np.testing.assert_allclose(float(loss1), expected, rtol=1e-6, atol=1e-6)
    g0, g1, gp = (jax.tree_util.tree_leaves(nnx.state(g, nnx.Param)) for g in (grad0, grad1, grad_pg))
    assert sum(float(jnp.abs(x).sum()) for x in gp) > 1e-3  # the reward term moves the weights
    for a, b, c in zip(g0, g1, gp):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a) + np.asarray(c), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------ teacher_adapter


@pytest.mark.slow
def test_a_peft_teacher_adapter_gives_the_adapted_models_log_probs(teacher, tmp_path):
    """distill.teacher_adapter: a PEFT LoRA folder written by `peft` itself (random non-zero B) on the teacher; the
    in-process teacher's log-probs and top-k equal PEFT's PeftModel on the same rows (fp32, 1e-4), not the base's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForCausalLM
    from jaxrl.backends.jax_teacher import JaxTeacher
    from test_teacher_server import rollout_arrays
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM.from_pretrained(teacher, torch_dtype=torch.float32).eval()
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                               init_lora_weights=False)).eval()
    adapter = str(tmp_path / "adapter")
    peft_model.save_pretrained(adapter)
    arrays = rollout_arrays(n=4, seed=2)
    with torch.no_grad():
        logits = peft_model(input_ids=torch.as_tensor(arrays["input_ids"], dtype=torch.long),
                            attention_mask=torch.as_tensor(arrays["attention_mask"], dtype=torch.long)).logits
    ref = torch.log_softmax(logits.float(), -1).numpy()
    C = arrays["completion_mask"].shape[1]
    P = arrays["input_ids"].shape[1] - C
    ref = ref[:, P - 1:-1]  # column P + t - 1 predicts completion token t
    sampled = np.take_along_axis(ref, arrays["input_ids"][:, P:, None], -1)[..., 0]
    mask = arrays["completion_mask"] > 0
    adapted = JaxTeacher.load(teacher, adapter, dtype="float32").score(arrays, k=4, temperature=1.0, batch_size=4)
    base = JaxTeacher.load(teacher, dtype="float32").score(arrays, k=4, temperature=1.0, batch_size=4)
    np.testing.assert_allclose(adapted["logp"][mask], sampled[mask], atol=1e-4)
    np.testing.assert_allclose(adapted["top_logp"][mask], np.sort(ref, -1)[..., ::-1][..., :4][mask], atol=1e-4)
    assert np.abs(base["logp"][mask] - sampled[mask]).max() > 100 * 1e-4  # the adapter moved them
