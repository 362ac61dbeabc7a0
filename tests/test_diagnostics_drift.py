"""Checkpoint drift: KL to base and LoRA update norms, on constructed drifts with known answers."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxrl.diagnostics import drift

SCALES = {0: 0.0, 4: 0.5, 8: 1.0, 12: 2.0}  # step -> multiple of one fixed LoRA direction


def test_token_kl_known_value_and_zero():
    p = np.log([[0.5, 0.5]])
    q = np.log([[0.9, 0.1]])
    want = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert drift.token_kl(p, q)[0] == pytest.approx(want, rel=1e-12)
    assert drift.token_kl(q, q)[0] == 0.0
    # Logits work too (renormalised): shifting a row by a constant is the same distribution.
    assert drift.token_kl(p + 3.0, q - 1.0)[0] == pytest.approx(want, rel=1e-12)


def test_update_norm_matches_the_explicit_product_and_rolls_up():
    rng = np.random.default_rng(0)
    A, B = rng.normal(size=(4, 32)), rng.normal(size=(48, 4))
    assert drift.lora_delta_norm(A, B, 0.7) == pytest.approx(np.linalg.norm(0.7 * B @ A), rel=1e-10)
    adapter = {"layers.0.self_attn.q_proj": (A, B, 1.0), "layers.0.mlp.up_proj": (A, B, 2.0),
               "layers.1.mlp.up_proj": (A, B, 2.0)}
    n = drift.update_norms(adapter)
    one = np.linalg.norm(B @ A)
    assert n["modules"]["layers.0.mlp.up_proj"] == pytest.approx(2 * one, rel=1e-10)
    assert n["layers"]["layers.0"] == pytest.approx(math.sqrt(5) * one, rel=1e-10)
    assert n["kinds"]["mlp.up_proj"] == pytest.approx(math.sqrt(8) * one, rel=1e-10)
    assert n["total"] == pytest.approx(3 * one, rel=1e-10)
    with pytest.raises(ValueError, match="module 'bad'"):
        drift.update_norms({"bad": (A, A, 1.0)})


def test_constructed_drift_over_callables_is_monotonic_and_zero_at_scale_zero():
    rng = np.random.default_rng(1)
    lengths, vocab = [5, 9, 3], 50
    base = [rng.normal(size=(t, vocab)) for t in lengths]
    direction = [rng.normal(size=(t, vocab)) for t in lengths]
    A, B = rng.normal(size=(2, 16)), rng.normal(size=(16, 2))

    def logprobs_fn(step):
        s = 0.0 if step is None else SCALES[step]
        return [b + s * d for b, d in zip(base, direction)]

    adapters = {step: {"layers.0.mlp.up_proj": (A, B * s, 1.0)} for step, s in SCALES.items()}
    res = drift.checkpoint_drift(list(SCALES)[::-1], logprobs_fn, adapters)
    assert res["steps"] == [0, 4, 8, 12]
    kl = [r["kl_to_base"] for r in res["per_step"]]
    norms = [r["update_norm"]["total"] for r in res["per_step"]]
    assert kl[0] == 0.0 and norms[0] == 0.0
    assert all(a < b for a, b in zip(kl, kl[1:])), kl
    assert norms[1:] == pytest.approx([0.5 * norms[3] / 2, norms[3] / 2, norms[3]], rel=1e-12)
    assert res["per_step"][2]["n_tokens"] == sum(lengths) and res["per_step"][2]["n_sequences"] == 3
    # Streaming (no cached base) gives the same numbers.
    again = drift.checkpoint_drift(list(SCALES), lambda s: iter(logprobs_fn(s)), adapters, cache_base=False)
    assert [r["kl_to_base"] for r in again["per_step"]] == kl


def test_misaligned_sequences_are_an_error_naming_step_and_sequence():
    base = [np.zeros((3, 4)), np.zeros((2, 4))]
    with pytest.raises(ValueError, match="step 4, sequence 1: shape"):
        drift.checkpoint_drift([4], lambda s: base if s is None else [np.zeros((3, 4)), np.zeros((5, 4))])
    with pytest.raises(ValueError, match="step 4: 1 sequences, the base has more"):
        drift.checkpoint_drift([4], lambda s: base if s is None else base[:1])


# ------------------------------------------------------------------------------------------ model-backed

TARGETS = ("layers.0.linear_attn.in_proj_qkv", "layers.1.self_attn.q_proj", "layers.2.mlp.up_proj",
           "layers.3.mlp.down_proj")
PREFIX = "base_model.model.model.language_model."


def _write_tiny(out_dir):
    """A tiny Qwen3.5 HF folder with random weights, filled from numpy: eager or jitted init of the model costs
    seconds on a busy CPU; shape inference plus numpy costs well under one."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.models import qwen35

    cfg = qwen35.tiny()
    graphdef, state = nnx.split(nnx.eval_shape(lambda: qwen35.Qwen35(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))
    flat = dict(nnx.to_flat_state(state))
    rng = np.random.default_rng(0)
    for var in flat.values():  # std 0.1 matrices (0.3 vectors): logits that depend on the input
        var.set_value(jnp.asarray(rng.normal(size=var.shape) * (0.1 if len(var.shape) >= 2 else 0.3), var.dtype))
    qwen35.save_pretrained(nnx.merge(graphdef, nnx.from_flat_state(flat)), out_dir, layout="container")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A torch-free tiny HF checkpoint and PEFT adapters at steps 0/4/8/12 = 0, 0.5, 1, 2 x one direction."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("drift")
    base_dir = str(root / "base")
    _write_tiny(base_dir)
    weights = load_file(f"{base_dir}/model.safetensors")
    rng = np.random.default_rng(0)
    r, alpha = 4, 8  # scale = alpha / r = 2
    direction = {}
    for m in TARGETS:
        out_f, in_f = weights[f"model.language_model.{m}.weight"].shape
        direction[m] = (rng.normal(size=(r, in_f)).astype(np.float32) * 0.2,
                        rng.normal(size=(out_f, r)).astype(np.float32) * 0.2)
    for step, s in SCALES.items():
        d = root / "adapters" / f"step_{step}"
        d.mkdir(parents=True)
        tensors = {}
        for m, (A, B) in direction.items():
            tensors[f"{PREFIX}{m}.lora_A.weight"] = A
            tensors[f"{PREFIX}{m}.lora_B.weight"] = (B * s).astype(np.float32)
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": alpha, "peft_type": "LORA"}))
    seqs = [(list(rng.integers(2, 250, size=n)), list(rng.integers(2, 250, size=m)))
            for n, m in [(5, 7), (3, 9), (8, 4), (6, 6), (4, 5)]]
    return root, base_dir, direction, seqs, weights


@pytest.mark.slow
def test_model_backed_drift_on_a_constructed_drift(tiny_run):
    root, base_dir, direction, seqs, weights = tiny_run
    found = drift.find_peft_checkpoints(root / "adapters")
    assert sorted(found) == [0, 4, 8, 12]
    adapters = {s: drift.load_peft_adapter(p) for s, p in found.items()}
    assert set(adapters[8]) == set(TARGETS) and adapters[8][TARGETS[0]][2] == 2.0
    res = drift.model_checkpoint_drift(base_dir, adapters, seqs, batch_size=4)
    kl = [r["kl_to_base"] for r in res["per_step"]]
    norms = [r["update_norm"]["total"] for r in res["per_step"]]
    assert kl[0] == 0.0 and norms[0] == 0.0  # scale 0: exactly the base
    assert all(a < b for a, b in zip(kl, kl[1:])), kl
    assert kl[3] > 1e-3  # a real drift, not rounding noise
    assert norms[1] / norms[3] == pytest.approx(0.25, rel=1e-6) and norms[2] / norms[3] == pytest.approx(0.5, rel=1e-6)
    assert res["n_tokens"] == sum(len(c) for _, c in seqs)

    # Independent check of step 8: merge the PEFT delta into the safetensors file with numpy, load that folder as
    # a plain model, run all sequences unmasked (right-padded: causal attention keeps padding out of the real
    # positions) and take the KL at the continuation positions.
    import jax.numpy as jnp
    from flax import nnx
    from safetensors.numpy import save_file

    from jaxrl.models import qwen35

    merged_dir = root / "merged8"
    shutil.copytree(base_dir, merged_dir)
    merged = dict(weights)
    for m, (A, B) in direction.items():
        key = f"model.language_model.{m}.weight"
        merged[key] = (merged[key].astype(np.float64) + 2.0 * (B.astype(np.float64) @ A)).astype(np.float32)
    save_file(merged, str(merged_dir / "model.safetensors"))
    width = max(len(p) + len(c) for p, c in seqs)
    ids = jnp.asarray([p + c + [0] * (width - len(p) - len(c)) for p, c in seqs], jnp.int32)
    forward = nnx.jit(lambda model, x: model(x))
    lq_all = np.asarray(forward(qwen35.from_pretrained(base_dir, dtype=jnp.float32), ids))
    lp_all = np.asarray(forward(qwen35.from_pretrained(str(merged_dir), dtype=jnp.float32), ids))
    total, n = 0.0, 0
    for i, (p, c) in enumerate(seqs):
        k = drift.token_kl(lp_all[i, len(p) - 1:len(p) + len(c) - 1], lq_all[i, len(p) - 1:len(p) + len(c) - 1])
        total, n = total + k.sum(), n + k.size
    assert kl[2] == pytest.approx(total / n, rel=1e-5)


@pytest.mark.slow
def test_model_backed_streaming_matches_and_restores_the_base_weights(tiny_run):
    root, base_dir, direction, seqs, _ = tiny_run
    adapters = {s: drift.load_peft_adapter(root / "adapters" / f"step_{s}") for s in (4, 12)}
    import jax.numpy as jnp

    from jaxrl.models import qwen35

    model = qwen35.from_pretrained(base_dir, dtype=jnp.float32)
    fn = drift.ModelLogprobs(None, adapters, seqs, batch_size=2, model=model)
    before = [x.copy() for x in fn(None)]
    cached = drift.checkpoint_drift([4, 12], fn, adapters)
    streamed = drift.checkpoint_drift([4, 12], fn, adapters, cache_base=False)
    assert [r["kl_to_base"] for r in streamed["per_step"]] == pytest.approx(
        [r["kl_to_base"] for r in cached["per_step"]], rel=1e-6)
    after = list(fn(None))
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # the base arrays were put back exactly

    bad = {4: {"layers.0.mlp.up_proj": (np.zeros((2, 7), np.float32), np.zeros((128, 2), np.float32), 1.0)}}
    with pytest.raises(ValueError, match=r"step 4, module 'layers.0.mlp.up_proj': B \(128, 2\) @ A \(2, 7\)"):
        list(drift.ModelLogprobs(None, bad, seqs, model=model)(4))
    with pytest.raises(KeyError, match="'layers.0.nope' is not a linear layer"):
        list(drift.ModelLogprobs(None, {4: {"layers.0.nope": (np.zeros((1, 1)), np.zeros((1, 1)), 1.0)}}, seqs,
                                 model=model)(4))
    assert all(np.array_equal(a, b) for a, b in zip(before, fn(None)))  # failed merges left nothing behind


def test_peft_parsing_errors():
    with pytest.raises(ValueError, match="has no lora_B.weight"):
        drift.parse_peft_tensors({f"{PREFIX}layers.0.mlp.up_proj.lora_A.weight": np.zeros((1, 2))}, 1.0)
    with pytest.raises(ValueError, match="no LoRA tensors"):
        drift.parse_peft_tensors({"something.else": np.zeros(1)}, 1.0)
    text_only = drift.parse_peft_tensors({"base_model.model.model.layers.3.mlp.up_proj.lora_A.weight": np.ones((1, 2)),
                                          "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight": np.ones((3, 1))},
                                         0.5)
    assert list(text_only) == ["layers.3.mlp.up_proj"] and text_only["layers.3.mlp.up_proj"][2] == 0.5


@pytest.mark.slow
def test_diagnose_launcher_drift(tiny_run, tmp_path):
    """The launcher's path: PEFT adapters found on disk, the fixed sequences of an earlier run, drift.json."""
    import subprocess
    import sys

    from jaxrl.utils.io import write_jsonl

    root, base_dir, _, seqs, _ = tiny_run
    seq_file = tmp_path / "seqs.jsonl"
    write_jsonl(seq_file, [{"prompt_ids": [int(t) for t in p], "continuation_ids": [int(t) for t in c]}
                           for p, c in seqs])
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "launchers.diagnose", "--what=drift", f"--base_model={base_dir}",
           f"--adapters={root / 'adapters'}", f"--sequences={seq_file}"]
    proc = subprocess.run(cmd + ["--steps=0,8", f"--workdir={tmp_path}"], cwd=repo, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "diagnostics" / "drift.json").read_text())
    assert out["steps"] == [0, 8] and out["per_step"][0]["kl_to_base"] == 0.0
    assert out["per_step"][1]["kl_to_base"] > 0 and "step 8: KL " in proc.stdout
    assert out["n_tokens"] == sum(len(c) for _, c in seqs)
    proc = subprocess.run(cmd + ["--steps=5", f"--out={tmp_path / 'x.json'}"], cwd=repo, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "no adapter for steps [5]; found [0, 4, 8, 12]" in proc.stderr


@pytest.mark.slow  # compiles the rollout engine's sampler
def test_fixed_sequences_are_the_base_models_greedy_continuations(tiny_run, tmp_path):
    """The launcher's default prompt set: chat-templated problems and the base's greedy continuations."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.utils.io import write_jsonl
    from jaxrl.models import qwen35
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer

    _, base_dir, _, _, _ = tiny_run
    model_dir = tmp_path / "base"
    shutil.copytree(base_dir, model_dir)
    texts = ["add two numbers", "print the sum of a list", "ignored"]
    build_tiny_tokenizer(str(model_dir), texts * 3)
    problems = tmp_path / "problems.jsonl"
    write_jsonl(problems, [{"id": f"q{i}", "messages": [{"role": "user", "content": t}], "test_type": "stdin",
                            "tests": [{"input": "1\n", "output": "1\n"}]} for i, t in enumerate(texts)])
    model = qwen35.from_pretrained(str(model_dir), dtype=jnp.float32)
    seqs = drift.fixed_sequences(model, str(model_dir), problems, n_prompts=2, max_new_tokens=3)
    assert len(seqs) == 2
    forward = nnx.jit(lambda m, x: m(x))
    for prompt, cont in seqs:
        assert 1 <= len(cont) <= 3
        # Each continuation token is the argmax after the tokens before it (greedy, from the base).
        logits = np.asarray(forward(model, jnp.asarray([prompt + cont], jnp.int32)))[0]
        assert [int(np.argmax(logits[len(prompt) - 1 + i])) for i in range(len(cont))] == cont
