"""PEFT and merged exports against the references: peft 0.21 + transformers load what we write and compute
what our JAX model computes with the same LoRA; the wrong layout is refused; merged folders keep every
non-language tensor and file byte-identical (vision tower, mtp.*, configs, tokenizer files)."""

import copy
import hashlib
import json
import os
import warnings

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

import hf_tiny
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.export import export_checkpoint
from jaxrl.models.peft import read_adapter
from jaxrl.models.adapters import Adapter, AdapterError, write_adapter_checkpoint
from jaxrl.export.audit import FolderSource, MergedSource, fingerprint
from jaxrl.models.peft import LAYOUT_PREFIXES, LayoutError, export_peft, load_peft_adapter
from jaxrl.models import qwen35
from jaxrl.models.lora import ALL_LINEAR, linears
from jaxrl.utils.io import atomic_folder

TOL = 1e-4  # fp32 logits, absolute (logits are O(1) here; observed ~2e-5)


def random_adapter(folder, modules=None, rank=4, alpha=8.0, use_rslora=True, seed=0, scale=0.12):
    """Non-trivial LoRA (A and B random, B far from its zero init; larger factors make the tiny model chaotic:
    at 0.3 even torch merged vs unmerged differ by 3e-4) on `modules` (default: all 12 projection kinds
    of every layer) of the model at `folder`."""
    model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    rng = np.random.default_rng(seed)
    params = {}
    for path, lin in linears(model):
        if path == "lm_head" or (modules is not None and path not in modules):
            continue
        params[path + ".lora.lora_A"] = (rng.standard_normal((rank, lin.in_features)) * scale).astype(np.float32)
        params[path + ".lora.lora_B"] = (rng.standard_normal((lin.out_features, rank)) * scale).astype(np.float32)
    return Adapter(params=params, rank=rank, alpha=alpha, use_rslora=use_rslora, source=f"random seed {seed}")


_FORWARD = {}  # graphdef -> jitted forward: one compile per model structure (eager calls compile every op on its own)


def forward(model, ids):
    graphdef, state = nnx.split(model)
    if graphdef not in _FORWARD:
        _FORWARD[graphdef] = jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x),
                                     compiler_options={"xla_backend_optimization_level": 0})
    return np.asarray(_FORWARD[graphdef](state, jnp.asarray(ids, jnp.int32)))


def jax_logits(folder, adapter, ids):
    from jaxrl.models.adapters import attach
    model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    if adapter is not None:
        attach(model, adapter)
    return forward(model, ids)


def peft_logits(model_cls, base, peft_dir, ids):
    """Logits of PeftModel(base) and the warnings PEFT raised while loading."""
    from peft import PeftModel
    hf = model_cls.from_pretrained(base).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(hf, peft_dir).eval()
    return hf_tiny.hf_logits(pm, ids), [str(w.message) for w in caught]


def read_tensors(folder):
    out = {}
    for fname in sorted(os.listdir(folder)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(folder, fname), framework="numpy") as f:
                for k in f.keys():
                    out[k] = (f.get_slice(k).get_dtype(), f.get_tensor(k))
    return out


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def sharded_copy(hf_model, folder, dtype):
    """The container re-saved in `dtype` as several shards + index, plus an mtp.* shard (which HF drops on load),
    tokenizer files and a sub-folder: everything a merged export must carry over untouched."""
    copy.deepcopy(hf_model).to(dtype).save_pretrained(folder, max_shard_size="60KB")
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = json.load(open(index_path))
    rng = np.random.default_rng(1)
    save_file({"mtp.fc.weight": rng.standard_normal((64, 128)).astype(np.float32),
               "mtp.norm.weight": rng.standard_normal(64).astype(np.float32)},
              os.path.join(folder, "mtp.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update({"mtp.fc.weight": "mtp.safetensors", "mtp.norm.weight": "mtp.safetensors"})
    json.dump(index, open(index_path, "w"), indent=2)
    json.dump({"chat_template": "{{ messages }}", "model_max_length": 1024},
              open(os.path.join(folder, "tokenizer_config.json"), "w"))
    os.makedirs(os.path.join(folder, "extras"))
    open(os.path.join(folder, "extras", "notes.txt"), "w").write("kept verbatim\n")
    return folder


IDS = np.random.default_rng(3).integers(2, 250, size=(2, 19))


@pytest.fixture(scope="module")
def container_ckpt(hf_container, tmp_path_factory):
    """(base folder, workdir with an adapter checkpoint at step 7, the adapter): all-linear rsLoRA r=4."""
    folder, _ = hf_container
    adapter = random_adapter(folder)
    workdir = str(tmp_path_factory.mktemp("run"))
    write_adapter_checkpoint(workdir, 7, adapter)
    return folder, workdir, adapter


@pytest.mark.slow
def test_peft_container_export_loads_in_peft_with_equal_logits(container_ckpt, tmp_path):
    from transformers import Qwen3_5ForConditionalGeneration
    folder, workdir, adapter = container_ckpt
    out = str(tmp_path / "peft")
    info = export_checkpoint(workdir, folder, out, step=7)
    assert info["layout"] == "container" and info["step"] == 7 and info["adapter_digest"] == adapter.digest()

    config = json.load(open(os.path.join(out, "adapter_config.json")))
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"], config["use_rslora"]) == \
        ("LORA", "CAUSAL_LM", 4, 8.0, True)
    assert config["target_modules"] == list(ALL_LINEAR)  # every module of those names is adapted: names suffice
    tensors = read_tensors(out)
    assert len(tensors) == 2 * len(adapter.modules)
    assert all(k.startswith(LAYOUT_PREFIXES["container"] + "layers.") for k in tensors)
    key = "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"
    np.testing.assert_array_equal(tensors[key][1], adapter.params["layers.0.linear_attn.in_proj_qkv.lora.lora_A"])

    ours = jax_logits(folder, adapter, IDS)
    ref, caught = peft_logits(Qwen3_5ForConditionalGeneration, folder, out, IDS)
    assert not [w for w in caught if "missing" in w.lower()], caught
    assert np.abs(ours - jax_logits(folder, None, IDS)).max() > 0.5  # the LoRA matters, so equality means something
    err = float(np.abs(ours - ref).max())
    assert err <= TOL, err
    print(f"PEFT container parity: max |logits diff| {err:.2e}")

    # import direction: the PEFT folder attached to a fresh JAX model computes the same, bit for bit
    model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    back = load_peft_adapter(out, model, layout=folder)
    assert back.digest() == adapter.digest()
    np.testing.assert_array_equal(forward(model, IDS), ours)


@pytest.mark.slow
def test_peft_text_layout_partial_targets(hf_text, tmp_path):
    """A text-only checkpoint (Qwen3_5ForCausalLM keys) and an adapter on some layers only: PEFT's target list
    then names full module paths (names alone would add adapters to layers this one never trained)."""
    from transformers import Qwen3_5ForCausalLM
    folder, _ = hf_text
    modules = {"layers.0.linear_attn.in_proj_qkv", "layers.0.linear_attn.out_proj", "layers.1.self_attn.q_proj",
               "layers.3.mlp.down_proj"}
    adapter = random_adapter(folder, modules=modules, use_rslora=False, seed=2)
    out = str(tmp_path / "peft_text")
    info = export_peft(adapter, out, folder)  # layout defaults to the base's: text
    assert info["layout"] == "text"
    config = json.load(open(os.path.join(out, "adapter_config.json")))
    assert sorted(config["target_modules"]) == sorted("model." + m for m in modules)
    assert config["use_rslora"] is False and config["r"] == 4
    assert all(k.startswith(LAYOUT_PREFIXES["text"] + "layers.") for k in read_tensors(out))

    ours = jax_logits(folder, adapter, IDS)
    ref, caught = peft_logits(Qwen3_5ForCausalLM, folder, out, IDS)
    assert not [w for w in caught if "missing" in w.lower()], caught
    err = float(np.abs(ours - ref).max())
    assert np.abs(ours - jax_logits(folder, None, IDS)).max() > 0.1
    assert err <= TOL, err
    print(f"PEFT text parity: max |logits diff| {err:.2e}")


@pytest.mark.slow
def test_wrong_layout_is_refused_instead_of_a_silent_noop(container_ckpt, hf_text, tmp_path):
    from transformers import Qwen3_5ForConditionalGeneration
    folder, _, adapter = container_ckpt
    with pytest.raises(LayoutError, match=r"text layout .* container checkpoint.*change nothing"):
        export_peft(adapter, str(tmp_path / "refused"), folder, layout="text")
    assert not (tmp_path / "refused").exists()

    # Why: the same adapter forced into the text layout loads into PEFT "fine" and does nothing at all.
    forced = str(tmp_path / "forced_text")
    export_peft(adapter, forced, folder, layout="text", allow_layout_mismatch=True)
    ref, caught = peft_logits(Qwen3_5ForConditionalGeneration, folder, forced, IDS)
    assert any("missing adapter keys" in w.lower() for w in caught), caught
    np.testing.assert_allclose(ref, jax_logits(folder, None, IDS), atol=TOL)  # base logits: a silent no-op

    # Our loader refuses that folder for a container model, naming both layouts.
    model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    with pytest.raises(LayoutError, match=r"text layout .* container checkpoint"):
        load_peft_adapter(forced, model, layout="container")
    # And an adapter of another model shape is refused, naming the module (hf_text has 6 GDN value heads).
    text_adapter = random_adapter(hf_text[0], modules={"layers.0.linear_attn.in_proj_z"})
    with pytest.raises(AdapterError, match="layers.0.linear_attn.in_proj_z"):
        export_peft(text_adapter, str(tmp_path / "shape"), folder)


@pytest.fixture(scope="module")
def sharded_fp32(hf_container, tmp_path_factory):
    return sharded_copy(hf_container[1], str(tmp_path_factory.mktemp("sharded32")), torch.float32)


@pytest.mark.slow
def test_merged_container_loads_in_transformers_and_keeps_everything_else(sharded_fp32, container_ckpt, tmp_path):
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration
    base = sharded_fp32
    _, workdir, adapter = container_ckpt
    out = str(tmp_path / "merged")
    info = export_checkpoint(workdir, base, out, merge=True)
    assert info["load_dtype"] == "float32" and info["step"] == 7

    merged = Qwen3_5ForConditionalGeneration.from_pretrained(out).eval()
    ours = jax_logits(base, adapter, IDS)
    err = float(np.abs(ours - hf_tiny.hf_logits(merged, IDS)).max())
    assert err <= TOL, err
    print(f"merged container parity: max |logits diff| {err:.2e}")

    before, after = read_tensors(base), read_tensors(out)
    assert set(before) == set(after)
    adapted = {f"model.language_model.{m}.weight" for m in adapter.modules}
    for key, (dtype, value) in before.items():
        assert after[key][0] == dtype, key
        if key in adapted:
            assert not np.array_equal(after[key][1], value), key
        else:  # vision tower, mtp.*, lm_head, norms, conv, embeddings: untouched bytes
            assert after[key][1].tobytes() == value.tobytes(), key
    assert any(k.startswith("model.visual.") for k in before) and "mtp.fc.weight" in before
    for rel in ("config.json", "generation_config.json", "tokenizer_config.json", "model.safetensors.index.json",
                "mtp.safetensors", os.path.join("extras", "notes.txt")):
        assert sha(os.path.join(base, rel)) == sha(os.path.join(out, rel)), rel

    # The merged weights are PEFT's own merge_and_unload of the same adapter (an independent computation).
    peft_dir = str(tmp_path / "peft")
    export_peft(adapter, peft_dir, base)
    pm = PeftModel.from_pretrained(Qwen3_5ForConditionalGeneration.from_pretrained(base), peft_dir)
    reference = {k: v.detach().numpy() for k, v in pm.merge_and_unload().state_dict().items()}
    worst = max(float(np.abs(after[k][1] - reference[k]).max()) for k in adapted)
    assert worst < 1e-5, worst
    print(f"merged weights vs PEFT merge_and_unload: max |diff| {worst:.2e}")

    # The audit proves which weights a folder holds: the merged folder == base + adapter, computed on the fly.
    assert info["fingerprint"] == fingerprint(FolderSource(out)) == fingerprint(MergedSource(base, adapter))
    assert info["fingerprint"] != fingerprint(FolderSource(base))


@pytest.mark.slow
def test_merged_bf16_keeps_dtypes_and_rounds_once(hf_container, container_ckpt, tmp_path):
    """bf16 checkpoints (the real ones): loaded in bf16 (exact), merged in fp32, rounded once to bf16."""
    base = sharded_copy(hf_container[1], str(tmp_path / "bf16"), torch.bfloat16)
    _, _, adapter = container_ckpt
    info = export_checkpoint(adapter_dir := write_adapter_checkpoint(str(tmp_path / "run"), 3, adapter), base,
                      str(tmp_path / "merged16"), merge=True)
    assert os.path.basename(adapter_dir) == "3" and info["load_dtype"] == "bfloat16"
    before, after = read_tensors(base), read_tensors(str(tmp_path / "merged16"))
    for key, (dtype, value) in before.items():
        assert after[key][0] == dtype, key
        module = key[len("model.language_model."):-len(".weight")] if key.startswith("model.language_model.") \
            else None
        if module in adapter.modules:
            a, b = (torch.from_numpy(x) for x in adapter.factors(module))
            w = torch.from_numpy(value.astype(np.float32))
            expected = (w + adapter.scale * (b @ a)).to(torch.bfloat16).float().numpy()
            assert np.array_equal(after[key][1].astype(np.float32), expected), key
        else:
            assert after[key][1].tobytes() == value.tobytes(), key


def test_exports_are_atomic(container_ckpt, tmp_path):
    folder, workdir, _ = container_ckpt
    out = tmp_path / "peft"
    export_checkpoint(workdir, folder, str(out))
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_checkpoint(workdir, folder, str(out))
    stamp = sha(out / "adapter_model.safetensors")
    with pytest.raises(RuntimeError, match="boom"):  # a failure half-way leaves the old export and no debris
        with atomic_folder(str(out), overwrite=True) as tmp:
            open(os.path.join(tmp, "adapter_model.safetensors"), "wb").write(b"partial")
            raise RuntimeError("boom")
    assert sha(out / "adapter_model.safetensors") == stamp
    assert sorted(os.listdir(tmp_path)) == ["peft"]
    export_checkpoint(workdir, folder, str(out), overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["peft"]
    assert read_adapter(str(out)).digest() == read_adapter(workdir, 7).digest()


@pytest.mark.slow
def test_launcher_refuses_the_wrong_layout_with_a_message(container_ckpt, tmp_path):
    import subprocess
    import sys
    folder, workdir, _ = container_ckpt
    out = tmp_path / "peft_text"
    proc = subprocess.run([sys.executable, "-m", "launchers.export", f"--checkpoint={workdir}", "--step=7",
                           f"--base={folder}", f"--out={out}", "--layout=text"],
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "export: " in proc.stderr and "change nothing" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
