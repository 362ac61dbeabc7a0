"""Merge fidelity: a bf16 base and an adapter whose update is 0.1% of each weight's norm. The default merge (into
bf16) records update_rel_error at its true value (recomputed here from the written files with torch) and warns;
--merge_dtype=float32 keeps the update: merged logits equal the unmerged adapter's within 1e-5. The evaluator
shows the lossy merged model as lossy."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import jax.numpy as jnp

from jaxrl.models.adapters import attach, write_adapter_checkpoint
from jaxrl.export.merge import FIDELITY_WARN, export_merged, is_lossy, read_provenance
from jaxrl.models import qwen35
from test_export import IDS, forward, random_adapter, read_tensors, sharded_copy

REL = 1e-3  # ||s*B*A|| / ||W|| of every adapted module
PREFIX = "model.language_model."


@pytest.fixture(scope="module")
def small_update(hf_container, tmp_path_factory):
    """(bf16 base folder, adapter rescaled so that every module's update is REL of its weight's norm)."""
    base = sharded_copy(hf_container[1], str(tmp_path_factory.mktemp("bf16")), torch.bfloat16)
    adapter = random_adapter(base, use_rslora=False, seed=4, scale=0.3)
    weights = {k[len(PREFIX):-len(".weight")]: v for k, (_, v) in read_tensors(base).items() if k.startswith(PREFIX)}
    for module in adapter.modules:
        w = np.linalg.norm(weights[module].astype(np.float64))
        d = np.linalg.norm(adapter.delta(module).astype(np.float64))
        adapter.params[module + ".lora.lora_B"] *= np.float32(REL * w / d)
    return base, adapter


def true_fidelity(base, merged, adapter):
    """(update_rel_error, zeroed_fraction) from the files, the update recomputed with torch in fp64."""
    before, after = read_tensors(base), read_tensors(merged)
    err2 = delta2 = 0.0
    zeroed = nonzero = 0
    for module in adapter.modules:
        key = f"{PREFIX}{module}.weight"
        a, b = (torch.from_numpy(x).double() for x in adapter.factors(module))
        delta = (adapter.scale * (b @ a)).numpy()
        kept = after[key][1].astype(np.float64) - before[key][1].astype(np.float64)
        err2 += float(((kept - delta) ** 2).sum())
        delta2 += float((delta ** 2).sum())
        zeroed += int(((kept == 0) & (delta != 0)).sum())
        nonzero += int((delta != 0).sum())
    return (err2 / delta2) ** 0.5, zeroed / nonzero


def torch_logits(base, merged_dir, adapter, tmp_path):
    """float64 logits of (the merged folder, base + PEFT adapter unmerged, the base) through transformers / peft."""
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration

    from jaxrl.models.peft import export_peft
    import hf_tiny
    peft_dir = str(tmp_path / "peft")
    if not os.path.isdir(peft_dir):
        export_peft(adapter, peft_dir, base)
    load = lambda path: Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float64).eval()  # noqa
    logits = lambda m: hf_tiny.hf_logits(m, IDS).astype(np.float64)  # noqa: E731
    with torch.no_grad():
        ids = torch.as_tensor(IDS, dtype=torch.long)
        out = []
        for model in (load(merged_dir), PeftModel.from_pretrained(load(base), peft_dir).eval(), load(base)):
            out.append(model(input_ids=ids).logits.numpy())
    return out


@pytest.mark.slow
def test_bf16_merge_records_the_lost_update_and_warns(small_update, tmp_path, caplog):
    base, adapter = small_update
    out = str(tmp_path / "merged_bf16")
    with caplog.at_level(logging.WARNING, logger="jaxrl.export.merge"):
        info = export_merged(adapter, base, out)
    fidelity = info["merge_fidelity"]
    true_error, true_zeroed = true_fidelity(base, out, adapter)
    print(f"bf16 merge at ||dW||/||W|| = {REL}: update_rel_error {fidelity['update_rel_error']:.4f} (true "
          f"{true_error:.4f}), zeroed {fidelity['zeroed_fraction']:.3f} (true {true_zeroed:.3f}), probe logits "
          f"rel_error {fidelity['logits']['rel_error']:.3f} cosine {fidelity['logits']['cosine']:.3f}")
    assert fidelity["update_rel_error"] == pytest.approx(true_error, rel=1e-6)
    assert 0.5 < true_error < 0.95  # most of the update is gone (~0.7 at this ratio)
    assert fidelity["zeroed_fraction"] == pytest.approx(true_zeroed, rel=1e-9) and true_zeroed > 0.4
    for module, row in fidelity["modules"].items():
        assert row["update_rel_norm"] == pytest.approx(REL, rel=0.02), module  # bf16 W: norms within rounding
    assert fidelity["logits"]["rel_error"] > 0.2 and fidelity["logits"]["probe"]["compute_dtype"] == "float32"
    assert any("update_rel_error" in r.getMessage() and "merge_dtype=float32" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    merged64, unmerged64, plain64 = torch_logits(base, out, adapter, tmp_path)
    effect, kept = unmerged64 - plain64, merged64 - plain64
    true_logits_error = float(np.linalg.norm(kept - effect) / np.linalg.norm(effect))
    print(f"  probe of the test's own: logit-effect error {true_logits_error:.3f} (float64 transformers + PEFT)")
    assert true_logits_error > 0.2  # the served merged model is not the adapter's
    on_disk = read_provenance(out)
    assert on_disk["merge_fidelity"]["update_rel_error"] == fidelity["update_rel_error"]
    assert on_disk["merge_dtype"] == "stored" and is_lossy(on_disk)


@pytest.mark.slow
def test_float32_merge_keeps_the_update(small_update, tmp_path, caplog):
    """--merge_dtype=float32 through the launcher: adapted tensors stored in fp32 (the rest as in the base), the
    merged model's logits equal the base + unmerged adapter's within 1e-5."""
    base, adapter = small_update
    workdir = str(tmp_path / "run")
    write_adapter_checkpoint(workdir, 3, adapter)
    out = str(tmp_path / "merged_f32")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "launchers.export", f"--checkpoint={workdir}", f"--base={base}",
                           f"--out={out}", "--merge", "--merge_dtype=float32"], cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = read_provenance(out)
    assert info["merge_dtype"] == "float32" and not is_lossy(info)
    assert info["merge_fidelity"]["update_rel_error"] < 1e-3 and "update_rel_error" not in proc.stderr
    true_error, _ = true_fidelity(base, out, adapter)
    assert info["merge_fidelity"]["update_rel_error"] == pytest.approx(true_error, rel=1e-4, abs=1e-9)
    before, after = read_tensors(base), read_tensors(out)
    adapted = {f"{PREFIX}{m}.weight" for m in adapter.modules}
    for key, (dtype, value) in before.items():
        assert after[key][0] == ("F32" if key in adapted else dtype), key
        if key not in adapted:
            assert after[key][1].tobytes() == value.tobytes(), key

    # The reference: transformers + PEFT in float64 (no compute noise), the merged folder against the base with the
    # PEFT export of the same adapter attached unmerged.
    merged64, unmerged64, plain64 = torch_logits(base, out, adapter, tmp_path)
    err = float(np.abs(merged64 - unmerged64).max())
    effect = float(np.abs(unmerged64 - plain64).max())
    print(f"fp32 merge (float64 transformers + PEFT): max |merged - unmerged logits| {err:.2e}; the adapter moves "
          f"logits by up to {effect:.2e}")
    assert err <= 1e-5 and effect > 1000 * err
    # Our own fp32 forward agrees up to fp32 compute noise (test_export's tolerance).
    merged = forward(qwen35.from_pretrained(out, dtype=jnp.float32), IDS)
    model = qwen35.from_pretrained(base, dtype=jnp.float32)
    attach(model, adapter)
    assert float(np.abs(merged - forward(model, IDS)).max()) <= 1e-4
    assert info["merge_fidelity"]["logits"]["probe"]["compute_dtype"] == "float32"
    assert info["merge_fidelity"]["logits"]["rel_error"] < 1e-2


def test_evaluator_shows_a_lossy_merged_model_as_lossy(small_update, tmp_path):
    """A merged export whose merge lost the update is named in results.json's warnings and carries its fidelity."""
    from jaxrl.evaluation.runner import EvalConfig, Evaluator, ModelSpec
    from jaxrl.rewards.base import RewardResult
    from jaxrl.data.chat import load_tokenizer
    from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer
    base, adapter = small_update
    out = str(tmp_path / "merged")
    export_merged(adapter, base, out, probe=False)
    tasks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxrl", "assets", "tasks",
                         "problems.jsonl")
    problem = json.loads(open(tasks).readline())
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps(problem) + "\n")
    tok_dir = str(tmp_path / "tok")
    build_tiny_tokenizer(tok_dir, [m["content"] for m in problem["messages"]])

    class Reward:
        def score(self, completions, problems, truncated=None):
            return [RewardResult(partial=0.0, strict=False, tests=[]) for _ in completions]

    ev = Evaluator(EvalConfig(problems=str(problems), base=base, out=str(tmp_path / "eval"),
                              models=[ModelSpec("merged", "hf", out)], reward="exact_match", n_resamples=10,
                              progress=False), reward=Reward(), backend=object(),
                   tokenizer=load_tokenizer(tok_dir))
    records = {name: [{"problem_id": problem["id"], "sample_index": 0, "completion": "", "completion_tokens": 1,
                       "finish_reason": "stop", "partial": 0.0, "strict": False, "tests": [], "reason": None,
                       "max_new_tokens": 8}] for name in ev.specs}
    results = ev.write(records)
    m = results["models"]["merged"]
    assert m["merge_fidelity"]["lossy"] and m["merge_fidelity"]["update_rel_error"] > FIDELITY_WARN
    assert any("merged export" in w and "not of the checkpoint" in w for w in results["warnings"])
    assert "merge_fidelity" not in results["models"]["base"]
