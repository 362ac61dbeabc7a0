"""HF checkpoints both ways: bit-identical round trips, carried-over files, sharded folders, meshes, errors."""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

import hf_tiny
from conftest import jitted_forward
import jax
import jax.numpy as jnp

from jaxrl.models import qwen35
from jaxrl.models.qwen35 import CheckpointError, ConfigError
from jaxrl.models.qwen35.tiny_checkpoint import write_tiny_checkpoint


def read_all(folder):
    """{key: (dtype string, raw bytes)} over every safetensors file of a folder."""
    out = {}
    for fname in sorted(os.listdir(folder)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(folder, fname), framework="numpy") as f:
                for k in f.keys():
                    t = f.get_tensor(k)
                    out[k] = (f.get_slice(k).get_dtype(), t.shape, t.tobytes())
    return out


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def sharded_base(tmp_path_factory, hf_container):
    """The tiny container re-saved as several bf16 shards + index, plus an `mtp.*` shard HF would drop."""
    _, hf = hf_container
    folder = str(tmp_path_factory.mktemp("sharded"))
    import copy
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(folder, max_shard_size="60KB")
    index_path = os.path.join(folder, "model.safetensors.index.json")
    index = json.load(open(index_path))
    rng = np.random.default_rng(0)
    save_file({"mtp.fc.weight": rng.standard_normal((64, 128)).astype(np.float32),
               "mtp.norm.weight": rng.standard_normal(64).astype(np.float32)},
              os.path.join(folder, "mtp.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update({"mtp.fc.weight": "mtp.safetensors", "mtp.norm.weight": "mtp.safetensors"})
    json.dump(index, open(index_path, "w"), indent=2)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{{ messages }}", "model_max_length": 1024}, f)
    os.makedirs(os.path.join(folder, "extras"))
    with open(os.path.join(folder, "extras", "notes.txt"), "w") as f:
        f.write("kept verbatim\n")
    return folder


@pytest.mark.slow
def test_sharded_bf16_round_trip_is_bit_identical(sharded_base, tmp_path):
    shards = [f for f in os.listdir(sharded_base) if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) >= 2
    model = qwen35.from_pretrained(sharded_base, dtype=jnp.float32)  # bf16 -> fp32 -> bf16 is exact
    out = str(tmp_path / "out")
    qwen35.save_pretrained(model, out, base_dir=sharded_base)
    before, after = read_all(sharded_base), read_all(out)
    assert before.keys() == after.keys()
    for key in before:
        assert before[key] == after[key], key
    # every non-weight file, and every shard without tower tensors (mtp), byte-identical
    for rel in ["config.json", "generation_config.json", "tokenizer_config.json", "model.safetensors.index.json",
                "mtp.safetensors", os.path.join("extras", "notes.txt")]:
        assert sha(os.path.join(sharded_base, rel)) == sha(os.path.join(out, rel)), rel
    # transformers reloads it; logits equal the JAX model's
    from transformers import Qwen3_5ForConditionalGeneration
    reloaded = Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(2, 250, size=(1, 20))
    ref = hf_tiny.hf_logits(reloaded, ids)
    ours = np.asarray(jitted_forward(model)(jnp.asarray(ids)))
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= 1e-4


def test_text_only_round_trip(hf_text, tmp_path):
    folder, _ = hf_text
    model = qwen35.from_pretrained(folder)
    out = str(tmp_path / "text_out")
    qwen35.save_pretrained(model, out, base_dir=folder)
    assert read_all(folder) == read_all(out)
    assert sha(os.path.join(folder, "config.json")) == sha(os.path.join(out, "config.json"))
    from transformers import Qwen3_5ForCausalLM
    Qwen3_5ForCausalLM.from_pretrained(out)  # loads without complaint


def test_changed_weights_are_written_and_others_kept(hf_container, tmp_path):
    folder, _ = hf_container
    model = qwen35.from_pretrained(folder)
    w = model.layers[1].self_attn.q_proj.weight
    w[...] = w[...] + 1.0
    out = str(tmp_path / "changed")
    qwen35.save_pretrained(model, out, base_dir=folder)
    before, after = read_all(folder), read_all(out)
    changed = sorted(k for k in before if before[k] != after[k])
    assert changed == ["model.language_model.layers.1.self_attn.q_proj.weight"]


@pytest.mark.heavy
@pytest.mark.slow
def test_mesh_load_matches_single_device(hf_container):
    folder, _ = hf_container
    from jaxrl.parallel.mesh import make_mesh
    mesh = make_mesh((2, 2, 2))
    sharded = qwen35.from_pretrained(folder, mesh=mesh)
    w = sharded.layers[0].mlp.gate_proj.weight[...]
    assert len(w.sharding.device_set) == 8 and not w.sharding.is_fully_replicated
    single = qwen35.from_pretrained(folder)
    ids = jnp.asarray(np.random.default_rng(1).integers(2, 250, size=(4, 33)))
    np.testing.assert_allclose(np.asarray(jitted_forward(sharded)(ids)), np.asarray(jitted_forward(single)(ids)),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_tiny_writer_loads_in_transformers_without_missing_keys(tmp_path):
    """The torch-free demo checkpoint is a complete container: HF loads it with nothing missing or unexpected,
    and computes our logits."""
    folder = write_tiny_checkpoint(str(tmp_path / "tiny"), seed=5)
    from transformers import Qwen3_5ForConditionalGeneration
    hf, info = Qwen3_5ForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    unexpected = [k for k in info["unexpected_keys"] if not k.startswith("mtp.")]
    assert not unexpected, unexpected
    model = qwen35.from_pretrained(folder)
    ids = np.random.default_rng(2).integers(2, 240, size=(2, 70))
    ref = hf_tiny.hf_logits(hf.eval(), ids)
    assert np.max(np.abs(np.asarray(jitted_forward(model)(jnp.asarray(ids))) - ref)) / np.max(np.abs(ref)) <= 1e-4


# ------------------------------------------------------------------------------------------------------------
# Bad folders and configs: clear errors naming the file and the key or tensor.

def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_error_missing_weights_file(tmp_path):
    os.makedirs(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(hf_tiny.TEXT_KWARGS | {"model_type": "qwen3_5_text"}))
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        qwen35.from_pretrained(str(tmp_path / "empty"))


def test_error_no_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        qwen35.from_pretrained(str(tmp_path))


def test_error_shape_mismatch_names_tensor_and_file(hf_container, tmp_path):
    folder = _copy(hf_container[0], str(tmp_path / "bad_shape"))
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg["text_config"]["intermediate_size"] = 96
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.language_model\.layers\.0\.mlp"):
        qwen35.from_pretrained(folder)


def test_error_unknown_tower_key(hf_container, tmp_path):
    folder = _copy(hf_container[0], str(tmp_path / "unknown"))
    path = os.path.join(folder, "model.safetensors")
    with safe_open(path, framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.language_model.layers.0.mystery.weight"] = np.zeros(3, np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unknown language-tower tensor 'model.language_model.layers.0.mystery"):
        qwen35.from_pretrained(folder)


def test_error_layout_mismatch_hint(hf_text, tmp_path):
    """Text-only weights under a container config.json: the error says which layout the weights are in."""
    folder = _copy(hf_text[0], str(tmp_path / "mixed"))
    text = json.load(open(os.path.join(folder, "config.json")))
    json.dump({"model_type": "qwen3_5", "text_config": text}, open(os.path.join(folder, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="weights are in the text layout"):
        qwen35.from_pretrained(folder)


def test_error_missing_shard(sharded_base, tmp_path):
    folder = _copy(sharded_base, str(tmp_path / "missing_shard"))
    shard = sorted(f for f in os.listdir(folder) if f.startswith("model-"))[0]
    os.remove(os.path.join(folder, shard))
    with pytest.raises(CheckpointError, match=f"lists shard '{shard}', which is missing"):
        qwen35.from_pretrained(folder)


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings.*disagree"),
    (lambda c: c["text_config"].update(linear_num_value_heads=3), "linear_num_value_heads.*multiple"),
    (lambda c: c["text_config"].update(layer_types=["linear_attention", "sliding", "linear_attention",
                                                    "full_attention"]), r"layer_types\[1\]"),
    (lambda c: c["text_config"].update(layer_types=["full_attention"]), "layer_types.*has 1 entries"),
    (lambda c: c["text_config"].update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c["text_config"].update(num_experts=8), "MoE"),
    (lambda c: c["text_config"].pop("num_hidden_layers"), "missing required key `num_hidden_layers`"),
])
def test_config_errors_name_file_and_key(hf_container, mutate, message):
    raw = json.load(open(os.path.join(hf_container[0], "config.json")))
    mutate(raw)
    with pytest.raises(ConfigError, match=message) as err:
        qwen35.parse_hf_config(raw, "/some/model/config.json")
    assert "/some/model/config.json" in str(err.value)


def test_full_attention_interval_without_layer_types():
    raw = dict(hf_tiny.TEXT_KWARGS, model_type="qwen3_5_text", num_hidden_layers=8)
    raw.pop("full_attention_interval")
    raw["full_attention_interval"] = 4
    cfg, layout = qwen35.parse_hf_config(raw)
    assert layout.kind == "text"
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)
    assert cfg.rotary_dim == 4


@pytest.mark.slow
def test_presets_have_the_real_shapes():
    nine, four = qwen35.qwen35_9b(), qwen35.qwen35_4b()
    assert (nine.hidden_size, nine.intermediate_size, nine.tie_word_embeddings) == (4096, 12288, False)
    assert (four.hidden_size, four.intermediate_size, four.tie_word_embeddings) == (2560, 9216, True)
    assert nine.layer_types.count("full_attention") == 8 and nine.rotary_dim == 64
    model = jax.eval_shape(lambda: None)  # noqa: F841  (presets build without allocating anything)
    from flax import nnx
    abstract = nnx.eval_shape(lambda: qwen35.Qwen35(four, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    n_params = sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)))
    assert abs(n_params - 4.206e9) / 4.206e9 < 0.01  # docs/design/qwen35-architecture.md §1.2: 4.206B with tied embeddings
