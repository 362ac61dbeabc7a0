"""Averaged checkpoints (`launchers.export --average`, jaxrl.export.average) against independent references.

* The exact average: PEFT loads the written folder, and its merged weights (PEFT `merge_and_unload`, fp32) equal the
  weighted mean of the checkpoints merged one by one by PEFT within 1e-6; our logits with it equal PEFT's within
  the export tolerance; a merged export of it records its merge fidelity like any other.
* The truncated average (`--average_rank`): the relative residual of every module in jaxrl_export.json is the one
  `numpy.linalg.svd` gives on the dense mean update, and the factors are that update's best rank-r approximation;
  the warning names the worst module only above the threshold.
* The step specs (`last:N`, lists), the weights and the rank are checked, with errors that name what is wrong.
"""

import json
import logging
import os
import subprocess
import sys
import warnings

import hf_tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl.export import export_average, export_checkpoint
from jaxrl.export.average import (RESIDUAL_WARN, average_checkpoints, average_name, average_steps,
                                  normalised_weights)
from jaxrl.models.peft import read_adapter
from jaxrl.models import qwen35
from jaxrl.models.adapters import A_SUFFIX, B_SUFFIX, Adapter, attach, load_adapter, write_adapter_checkpoint
from jaxrl.models.lora import linears

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4  # fp32 logits, absolute: the tolerance of the PEFT export tests (tests/test_export.py)
MERGE_TOL = 1e-6  # fp32 merged weights, absolute
STEPS = (4, 8, 12, 16)
IDS = np.random.default_rng(3).integers(2, 250, size=(2, 19))


def read_json(folder, name):
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def checkpoint_factors(folder, seed, rank=4, scale=0.12, modules=None, shared=None):
    """Random LoRA factors on every projection of the model at `folder` (or on `modules`); `shared`: (A, B) dicts to
    scale instead of drawing new ones (checkpoints whose updates span one rank-`rank` space)."""
    model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    rng = np.random.default_rng(seed)
    params = {}
    for path, lin in linears(model):
        if path == "lm_head" or (modules is not None and path not in modules):
            continue
        if shared is not None:
            factor = 0.5 + seed * 0.25
            params[path + A_SUFFIX] = shared[path + A_SUFFIX]
            params[path + B_SUFFIX] = (shared[path + B_SUFFIX] * factor).astype(np.float32)
            continue
        params[path + A_SUFFIX] = (rng.standard_normal((rank, lin.in_features)) * scale).astype(np.float32)
        params[path + B_SUFFIX] = (rng.standard_normal((lin.out_features, rank)) * scale).astype(np.float32)
    return params


@pytest.fixture(scope="module")
def run(hf_container, tmp_path_factory):
    """(base folder, run workdir with adapter checkpoints at STEPS): all-linear rsLoRA r4 / alpha 8, each step its
    own random factors (a real run's checkpoints are as far apart as that after enough steps)."""
    folder, _ = hf_container
    workdir = str(tmp_path_factory.mktemp("avg_run"))
    for i, step in enumerate(STEPS):
        adapter = Adapter(params=checkpoint_factors(folder, seed=10 + i), rank=4, alpha=8.0, use_rslora=True,
                          source=f"step {step}", model_path=folder)
        write_adapter_checkpoint(workdir, step, adapter)
    return folder, workdir


def dense_mean(workdir, steps, weights):
    """{module: float64 [out, in]}: sum_i w_i s_i B_i A_i from the checkpoint files (load_adapter, not Adapter)."""
    total = float(sum(weights))
    out = {}
    for step, weight in zip(steps, weights):
        params, meta = load_adapter(workdir, step)
        scale = float(meta["lora"]["scale"])
        for name in params:
            if name.endswith(A_SUFFIX):
                module = name[: -len(A_SUFFIX)]
                update = (weight / total) * scale * (params[module + B_SUFFIX].astype(np.float64)
                                                     @ params[name].astype(np.float64))
                out[module] = out.get(module, 0.0) + update
    return out


def peft_merged(base, peft_dir):
    """{name: fp32 array} of the state dict PEFT's merge_and_unload leaves (the container, fp32)."""
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = PeftModel.from_pretrained(hf, peft_dir).merge_and_unload()
    return {k: v.detach().to(torch.float32).numpy().copy() for k, v in merged.state_dict().items()}


def peft_logits(base, peft_dir):
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(hf, peft_dir).eval()
    assert not [w for w in caught if "missing" in str(w.message).lower()], [str(w.message) for w in caught]
    return hf_tiny.hf_logits(pm, IDS)


def jax_logits(folder, adapter):
    model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    if adapter is not None:
        attach(model, adapter)
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x), compiler_options={"xla_backend_optimization_level": 0})
    return np.asarray(fn(state, jnp.asarray(IDS, jnp.int32)))


# ------------------------------------------------------------------------------------------------- exact


def test_exact_average_loads_in_peft_and_merges_to_the_mean_of_the_merged_checkpoints(run, tmp_path):
    base, workdir = run
    steps, weights = [8, 12, 16], [1.0, 1.0, 2.0]
    info = export_average(workdir, None, None, average=[str(s) for s in steps], weights=weights)
    out = info["out"]
    assert out == os.path.join(workdir, "averages", "avg_8-12-16_weighted")  # the default folder, by name
    record = read_json(out, "jaxrl_export.json")
    avg = record["average"]
    assert (avg["kind"], avg["steps"], avg["exact_rank"], avg["rank"]) == ("mean", steps, 12, 12)
    assert avg["weights"] == pytest.approx([0.25, 0.25, 0.5]) and "residual" not in avg
    assert [c["step"] for c in avg["checkpoints"]] == steps
    config = read_json(out, "adapter_config.json")
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (12, 12.0, False)  # scale 1: folded into B

    # the reference: each checkpoint exported alone and merged by PEFT; their weighted mean, in float64
    merged = []
    for step in steps:
        single = str(tmp_path / f"peft_{step}")
        export_checkpoint(workdir, base, single, step=step)
        merged.append(peft_merged(base, single))
    mean = {k: sum(w * m[k].astype(np.float64) for w, m in zip(avg["weights"], merged)) for k in merged[0]}
    ours = peft_merged(base, out)
    assert sorted(ours) == sorted(mean)
    worst = max(float(np.abs(ours[k] - mean[k]).max()) for k in ours)
    assert worst <= MERGE_TOL, worst
    adapted = [k for k in ours if "layers.0.linear_attn.in_proj_qkv" in k]
    assert adapted and float(np.abs(mean[adapted[0]] - merged[0][adapted[0]]).max()) > 1e-3  # the mean is not one
    print(f"exact average: max |PEFT merged - mean of merged checkpoints| {worst:.2e}")

    # our model with the folder's adapter (read back) computes what PEFT computes with it
    adapter = read_adapter(out)
    assert adapter.digest() == average_checkpoints(workdir, steps, weights).digest() == record["adapter_digest"]
    assert adapter.average["steps"] == steps  # the record travels with the folder
    ours_logits, ref = jax_logits(base, adapter), peft_logits(base, out)
    assert np.abs(ours_logits - jax_logits(base, None)).max() > 0.1  # the average matters
    err = float(np.abs(ours_logits - ref).max())
    assert err <= TOL, err
    print(f"exact average: max |JAX - PEFT logits| {err:.2e}")


def test_exact_average_update_is_the_mean_of_the_updates_not_of_the_factors(run):
    """`last:3` picks the newest three; the merged update of every module is the mean of theirs (float64 reference),
    which the product of the averaged factors is not."""
    _, workdir = run
    assert average_steps(workdir, "last:3") == [8, 12, 16]
    assert average_steps(workdir, ["last:4"]) == list(STEPS)
    adapter = average_checkpoints(workdir, average_steps(workdir, "last:3"))
    assert (adapter.rank, adapter.scale, adapter.kind, adapter.step) == (12, 1.0, "average", None)
    reference = dense_mean(workdir, [8, 12, 16], [1, 1, 1])
    assert sorted(reference) == adapter.modules
    for module, want in reference.items():
        a, b = adapter.factors(module)
        got = b.astype(np.float64) @ a.astype(np.float64)
        assert np.abs(got - want).max() <= 1e-7 * max(1.0, np.abs(want).max()), module
    # the mean of the factors (what an adapter of rank 4 averaged naively computes) is another update
    module = adapter.modules[0]
    factors = [load_adapter(workdir, s)[0] for s in (8, 12, 16)]
    naive = np.mean([f[module + B_SUFFIX] for f in factors], 0) @ np.mean([f[module + A_SUFFIX] for f in factors], 0)
    scale = 8.0 / 2.0  # rsLoRA: alpha / sqrt(r)
    assert np.abs(scale * naive - reference[module]).max() > 10 * np.abs(reference[module]).max() * 1e-3


def test_merged_export_of_an_average_keeps_the_mean_update_and_records_its_fidelity(run, tmp_path):
    from safetensors.numpy import load_file
    base, workdir = run
    with pytest.raises(ValueError, match="--merge with --average needs --out"):
        export_average(workdir, None, None, average="last:2", merge=True)
    out = str(tmp_path / "merged_avg")
    info = export_average(workdir, None, out, average="last:2", merge=True, merge_dtype="float32")
    assert info["format"] == "merged" and info["average"]["steps"] == [12, 16]
    fidelity = read_json(out, "jaxrl_export.json")["merge_fidelity"]
    assert fidelity["update_rel_error"] < 1e-6  # fp32: the update is kept
    reference = dense_mean(workdir, [12, 16], [1, 1])
    base_w = {k: v for f in os.listdir(base) if f.endswith(".safetensors") for k, v in
              load_file(os.path.join(base, f)).items()}
    got = {k: v for f in os.listdir(out) if f.endswith(".safetensors") for k, v in
           load_file(os.path.join(out, f)).items()}
    module = "layers.1.self_attn.q_proj"  # hf_tiny: full attention every 2nd layer
    key = f"model.language_model.{module}.weight"
    diff = got[key].astype(np.float64) - base_w[key].astype(np.float64)
    assert np.abs(diff - reference[module]).max() <= MERGE_TOL


# --------------------------------------------------------------------------------------------- truncated


def test_truncated_average_residuals_match_numpy_svd_of_the_dense_mean(run, tmp_path, caplog):
    base, workdir = run
    steps, weights, rank = [4, 8, 12], [2.0, 1.0, 1.0], 5
    with caplog.at_level(logging.WARNING, logger="jaxrl.export.average"):
        info = export_average(workdir, base, None, average="4,8,12", weights=weights, rank=rank)
    assert os.path.basename(info["out"]) == "avg_4-8-12_weighted_r5"
    record = read_json(info["out"], "jaxrl_export.json")["average"]
    assert (record["rank"], record["exact_rank"]) == (rank, 12)
    residual = record["residual"]
    reference = dense_mean(workdir, steps, weights)
    assert sorted(residual["modules"]) == sorted(reference)
    adapter = read_adapter(info["out"])
    assert (adapter.rank, adapter.scale) == (rank, 1.0)
    for module, dense in reference.items():
        u, s, vt = np.linalg.svd(dense, full_matrices=False)
        want = float(np.sqrt(np.sum(s[rank:] ** 2) / np.sum(s ** 2)))
        assert residual["modules"][module] == pytest.approx(want, rel=1e-5, abs=1e-7), module
        # and the factors are the best rank-r approximation (Eckart-Young), whose residual is the one reported
        a, b = adapter.factors(module)
        got = b.astype(np.float64) @ a.astype(np.float64)
        best = (u[:, :rank] * s[:rank]) @ vt[:rank]
        assert np.linalg.norm(got - best) <= 1e-5 * np.linalg.norm(dense), module
        assert np.linalg.norm(dense - got) / np.linalg.norm(dense) == pytest.approx(want, rel=1e-4, abs=1e-6)
    worst = max(residual["modules"], key=residual["modules"].get)
    assert (residual["worst_module"], residual["max"]) == (worst, residual["modules"][worst])
    assert residual["warn_above"] == RESIDUAL_WARN and residual["max"] > RESIDUAL_WARN  # random updates: full rank
    [warning] = [r.getMessage() for r in caplog.records if r.name == "jaxrl.export.average"]
    assert f"rank-{rank} average of steps {steps}" in warning and worst in warning


def test_a_truncation_that_keeps_the_update_does_not_warn(hf_container, tmp_path, caplog):
    """Checkpoints whose updates share one rank-2 space (A fixed, B rescaled): their exact average has rank 6 but is
    of rank 2, so truncating to 2 keeps it (residual ~0) without a warning."""
    folder, _ = hf_container
    modules = ("layers.0.linear_attn.in_proj_qkv", "layers.1.mlp.down_proj")
    shared = checkpoint_factors(folder, seed=0, rank=2, modules=modules)
    workdir = str(tmp_path / "run")
    for i, step in enumerate((2, 4, 6)):
        write_adapter_checkpoint(workdir, step, Adapter(params=checkpoint_factors(folder, i, 2, modules=modules,
                                                                                  shared=shared),
                                                        rank=2, alpha=4.0, source=f"step {step}"))
    with caplog.at_level(logging.WARNING, logger="jaxrl.export.average"):
        adapter = average_checkpoints(workdir, [2, 4, 6], rank=2)
    assert not [r for r in caplog.records if r.name == "jaxrl.export.average"]
    residual = adapter.average["residual"]
    assert residual["max"] < 1e-5 and sorted(residual["modules"]) == sorted(modules)
    reference = dense_mean(workdir, [2, 4, 6], [1, 1, 1])
    for module in modules:
        a, b = adapter.factors(module)
        assert np.abs(b.astype(np.float64) @ a - reference[module]).max() <= 1e-6 * np.abs(reference[module]).max()


# ------------------------------------------------------------------------------------------------ errors


def test_step_specs_weights_and_ranks_are_checked_with_clear_errors(run):
    _, workdir = run
    assert average_steps(workdir, "16,4") == [4, 16] and average_steps(workdir, [" 8", "12 "]) == [8, 12]
    cases = {"4,99": r"no adapter checkpoint for step\(s\) \[99\]; present: \[4, 8, 12, 16\]",
             "last:9": r"has only 4 adapter checkpoint\(s\): \[4, 8, 12, 16\]",
             "last:0": "expected last:N with N >= 1", "last:x": "expected last:N with N >= 1",
             "4,4": r"a step is listed twice: \[4, 4\]", "4,latest": "'latest' is not a step number",
             "-4": "'-4' is not a step number", "": "no steps given", "last:2,4": "'last:2' is not a step number"}
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message):
            average_steps(workdir, spec)
    assert normalised_weights(None, 3) == pytest.approx([1 / 3] * 3)
    assert normalised_weights([0, 1, 3], 3) == [0.0, 0.25, 0.75]  # a weight of 0 drops that checkpoint
    for weights in ([-1, 1, 1], [0, 0, 0], [1, float("nan"), 1], [1, float("inf"), 1]):
        with pytest.raises(ValueError, match="weights must be finite, >= 0 and not all 0"):
            normalised_weights(weights, 3)
    with pytest.raises(ValueError, match=r"2 weight\(s\) for 3 checkpoint\(s\)"):
        normalised_weights([1, 2], 3)
    for rank in (0, 12, 13):
        with pytest.raises(ValueError, match=r"--average_rank=\d+: must be in \[1, 12\)"):
            average_checkpoints(workdir, [4, 8, 12], rank=rank)
    assert average_name([4, 8], [1, 1]) == "avg_4-8" and average_name([4, 8], [1, 3], 2) == "avg_4-8_weighted_r2"


@pytest.mark.heavy  # long for the fast tier (make test-heavy, CI run it)
def test_the_launcher_writes_an_average_and_refuses_bad_ones_in_one_line(run, tmp_path):
    _, workdir = run

    def export(*args):
        return subprocess.run([sys.executable, "-m", "launchers.export", f"--checkpoint={workdir}", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, check=False)

    done = export("--average=last:2", "--average_rank=3")  # --base: the model_path the checkpoints record
    assert done.returncode == 0, done.stderr[-2000:]
    out = os.path.join(workdir, "averages", "avg_12-16_r3")
    assert done.stdout.strip().startswith("export: wrote the PEFT adapter of the rank-3 average of steps 12, 16 "
                                          "(max residual ") and out in done.stdout, done.stdout
    assert read_json(out, "jaxrl_export.json")["average"]["rank"] == 3

    missing = export("--average=4,99")
    lines = [line for line in missing.stderr.splitlines() if line.strip()]
    assert missing.returncode == 2, missing.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in missing.stderr, lines
    assert "no adapter checkpoint for step(s) [99]; present: [4, 8, 12, 16]" in lines[0]
    negative = export("--average=4,8", "--average_weights=1,-1")
    assert negative.returncode == 2 and "weights must be finite, >= 0" in negative.stderr, negative.stderr[-2000:]
    assert not os.path.exists(os.path.join(workdir, "averages", "avg_4-99"))
    assert not os.path.exists(os.path.join(workdir, "averages", "avg_4-8_weighted"))
