"""The GPU MFU script runs end to end on the CPU (--tiny) and counts FLOPs from the real shapes."""

import math

import pytest

from flax import nnx

from benchmarks import gpu_train_step
from jaxrl.models import qwen35
from jaxrl.models.qwen35.layers import Linear

pytestmark = pytest.mark.heavy  # the benchmark scripts' own smoke runs


@pytest.mark.slow
def test_tiny_dpo_style_step_runs_and_starts_at_log2():
    """Step 0: adapters (B = 0) leave the policy equal to the reference, so every pair's DPO loss is log 2 --
    with LoRA dropout on and every layer rematerialised (remat + dropout inside the real jitted step)."""
    result = gpu_train_step.run(tiny=True, seq_len=32, steps=1, peak_tflops=1.0, lora_dropout=0.1)
    assert result["first_loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert result["first_grad_norm"] > 0 and result["update_skipped_total"] == 0
    assert result["rows_per_step"] == 2 and result["devices"] == 1 and result["tokens_per_s"] > 0
    assert 0 < result["mfu"] and 0 < result["share_linear"] < 1


@pytest.mark.parametrize("tie", [False, True])
def test_flop_count_matches_the_model_shapes(tie):
    """The formula's matmul FLOPs equal 2 x (every Linear weight of the model), counted on the abstract module
    tree, for an odd-sized 4-layer config (every dimension different, so a swapped one shows)."""
    cfg = qwen35.tiny(hidden_size=48, intermediate_size=80, num_attention_heads=3, num_key_value_heads=1,
                      head_dim=24, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=12,
                      linear_value_head_dim=20, vocab_size=300, tie_word_embeddings=tie)
    model = nnx.eval_shape(lambda: qwen35.Qwen35(cfg, rngs=nnx.Rngs(0)))
    weights = sum(m.in_features * m.out_features for _, m in nnx.iter_modules(model) if isinstance(m, Linear))
    if model.lm_head is None:  # tied: the embedding is the head
        weights += cfg.vocab_size * cfg.hidden_size
    flops = gpu_train_step.model_flops(cfg, lora_rank=16, rows=2, seq_len=64)
    assert flops["share_linear"] * flops["per_token"] == pytest.approx(3 * 2 * weights, rel=1e-9)
    assert flops["per_step"] == flops["per_token"] * 2 * 64


def test_kernel_benchmark_runs_and_its_rows_parse():
    """`bench_kernels --tiny` runs every section, including the decode projections (the tiny model's 30
    projections and its head, each against its [in, out] copy), and `run_all` turns the result into its rows."""
    from benchmarks import bench_kernels, run_all
    result = bench_kernels.run(tiny=True)
    p = result["decode_projections"]
    assert p["weights"] == 31 and p["batch"] == 4 and p["fast_us"] > 0 and p["ratio"] > 0
    assert bench_kernels.weight_shapes("4b")[-1] == (248320, 2560)  # tied: the head is the embedding
    rows = run_all.rows_kernels(result)
    assert len(rows) == 4 and "[in, out]" in rows[-1]["benchmark"]


@pytest.mark.slow
def test_aot_real_shapes_runs_every_program_at_the_tiny_shape():
    """The AOT benchmark of the real programs (benchmarks/aot_real_shapes.py) at the tiny shape: every program's
    analysis (remat's choice and budget, the kept activations), and one train step and the decode round compiled
    through to XLA's memory and cost analysis."""
    from benchmarks import aot_real_shapes

    analysed = aot_real_shapes.run(shape="tiny", scan_layers="both", analysis_only=True)["programs"]
    assert [r.get("error") for r in analysed] == [None] * len(analysed)
    steps = ("decode",) + aot_real_shapes.PASSES  # the kinds without a backward
    trains = [r for r in analysed if r["kind"] not in steps]
    assert {(r["program"], r["scan_layers"]) for r in trains} == {
        (name, scan) for name, spec in aot_real_shapes.PROGRAMS.items() if spec["kind"] not in steps
        for scan in (True, False)}
    for r in trains:
        assert r["remat"]["chosen"] in ("none", "matmuls", "attention", "full")
        assert r["remat"]["kept_activations"]["gib"] >= 0 and r["remat"]["kept_activations"]["largest"]
        assert (r["layer_cycle"][0] is not None) == r["scan_layers"]
    compiled = aot_real_shapes.run(programs="dpo_9b_mb1,decode_4b", shape="tiny", scan_layers="off")["programs"]
    assert [r.get("error") for r in compiled] == [None, None]
    for r in compiled:
        assert r["compile_s"] > 0 and r["memory"]["peak_gib"] > 0 and r["flops"]["counted"] > 0


@pytest.mark.heavy  # two more compiles of the tiny model (~25 s on two cores)
def test_aot_real_shapes_compiles_the_distill_step_and_the_teacher_pass():
    """The distillation programs of the AOT benchmark at the tiny shape: the train step with the teacher's top-k
    scores in its batch, the teacher pass and GRPO's reference pass compiled through to memory and FLOPs, the
    in-process total (the step's peak + the teacher's weights; the teacher pass's + the student's state), and the
    formula's shares: a teacher as large as the policy (the tiny shape's 4b and 9b are one model) costs its
    step what the reference pass costs GRPO's."""
    from benchmarks import aot_real_shapes

    out = aot_real_shapes.run(programs="distill_4b,teacher_9b,reference_4b", shape="tiny", scan_layers="off",
                              llvm_opt=0)["programs"]
    assert [r.get("error") for r in out] == [None, None, None]
    step, teacher, reference = out
    for r in out:
        assert r["compile_s"] > 0 and r["memory"]["peak_gib"] > 0 and r["flops"]["counted"] > 0
    assert step["with_the_other_model"]["peak_gib"] >= step["memory"]["peak_gib"]
    assert "student_resident_gib" in teacher and "with_the_other_model" not in reference
    shares = step["passes"]
    assert shares["teacher_over_reference"] == 1.0
    assert shares["teacher_share_of_distill"] == shares["reference_share_of_grpo"]
    assert 0 < shares["reference_share_of_grpo"] < 0.5


def test_engine_batch_decodes_what_the_sampler_samples():
    """benchmarks.common.EngineBatch (the programs bench_decode and gpu_decode time) runs the generation engine's
    programs on one full batch: new_tokens - 1 decode steps, and the greedy tokens of `jaxrl.generation.Sampler`."""
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import EngineBatch
    from jaxrl.generation import Sampler

    model = qwen35.init_model(qwen35.tiny(), dtype=jnp.float32, seed=0)
    prompts = np.random.default_rng(0).integers(2, model.config.vocab_size, size=(4, 16))
    batch = EngineBatch(model, prompts, new_tokens=8)
    state, steps = batch.decode(batch.prefill())
    assert steps == 7
    out = Sampler(model, max_new_tokens=8, prompt_buckets=(16,), batch_size=4).sample(prompts.tolist())
    assert batch.tokens(state).tolist() == out.tokens


def test_versus_finds_the_sampler_of_either_layout(tmp_path, monkeypatch):
    """benchmarks.versus.sampler_class: this tree's engine Sampler (jaxrl/generation), and in a tree of the older
    layout (no jaxrl/generation, no rollout engine) its static jaxrl/rollout/sampler.py."""
    import importlib

    import jaxrl
    from benchmarks import versus

    assert versus.sampler_class(jaxrl)[1] == "generation.sampler.Sampler"
    old = tmp_path / "jaxrl_layout_test" / "rollout"
    old.mkdir(parents=True)
    (old.parent / "__init__.py").write_text("")
    (old / "__init__.py").write_text("")
    (old / "sampler.py").write_text("class Sampler:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = importlib.import_module("jaxrl_layout_test")
    cls, path = versus.sampler_class(pkg)
    assert path == "rollout.sampler.Sampler" and cls.__module__ == "jaxrl_layout_test.rollout.sampler"


def test_the_gpu_grpo_step_runs_in_the_layout_asked_for():
    """benchmarks.gpu_grpo --layout (the issue-51 GPU plan: the 4B GRPO step in each layout): the run trains in that
    layout and reports its counters; shared_prefix computes each of the 2 prompts once for its 4 samples."""
    from benchmarks import gpu_grpo
    shared = gpu_grpo.run(True, prompts=2, k=4, prompt_len=8, max_new_tokens=8, steps=2, layout="shared_prefix")
    padded = gpu_grpo.run(True, prompts=2, k=4, prompt_len=8, max_new_tokens=8, steps=2, layout="padded")
    assert shared["layout"] == "shared_prefix" and shared["layout/shared_prefix"] == 1.0
    assert padded["layout/shared_prefix"] == 0.0 and padded["layout/packed"] == 0.0
    assert padded["layout/prompt_tokens"] == 4 * shared["layout/prompt_tokens"] > 0
    assert shared["loss"][0] == pytest.approx(padded["loss"][0], rel=1e-5, abs=1e-7)  # the same first step
