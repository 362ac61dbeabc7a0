"""What the real Qwen3.5 folders hold that the loader must get right before the first GPU run: the token ids of the
presets, the stop ids of generation_config.json, quantized folders refused by name, cuDNN attention that falls
back instead of raising, and the GPU benchmark's --remat taking every policy."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxrl.models import qwen35
from jaxrl.models.qwen35.checkpoint import CheckpointError
from jaxrl.models.qwen35.config import ENDOFTEXT, IM_END, ConfigError, load_hf_config
from jaxrl.models.qwen35.tiny_checkpoint import write_tiny_checkpoint
from jaxrl.ops import attention
from jaxrl.generation import generate

TWO_LAYERS = qwen35.config.tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))


def test_the_presets_carry_the_real_token_ids():
    """config.json's text_config: eos <|endoftext|>, no pad id; generation_config.json adds <|im_end|>."""
    for preset in ("qwen3.5-4b", "qwen3.5-9b"):
        cfg = qwen35.PRESETS[preset]()
        assert cfg.eos_token_id == (ENDOFTEXT, IM_END) == (248044, 248046) and cfg.pad_token_id is None


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), TWO_LAYERS, layout="text", with_mtp=False)


def _copy(folder, dest):
    os.makedirs(dest)
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as src, open(os.path.join(dest, name), "wb") as out:
            out.write(src.read())
    return str(dest)


@pytest.mark.slow  # two loads and two generate programs
def test_generation_config_stop_ids_are_read_and_generate_stops_on_them(folder, tmp_path):
    model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    assert model.config.eos_token_id == 1  # the tiny folder's generation_config.json adds nothing
    prompts = [[5, 9, 13, 17]]
    free = generate(model, prompts, max_new_tokens=4, temperature=0.0, eos_token_ids=())
    first = free.tokens[0][0]
    assert free.finish_reasons[0] == "length" and first != 1
    # A folder whose generation_config.json also stops on the token the model emits first (Qwen3.5's stops on
    # <|im_end|> and <|endoftext|> while config.json names one): generate() without explicit stop ids stops there.
    other = _copy(folder, tmp_path / "stops")
    with open(os.path.join(other, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [1, int(first)]}, f)
    assert load_hf_config(other)[0].eos_token_id == (1, int(first))
    stopping = qwen35.from_pretrained(other, dtype=jnp.float32)
    out = generate(stopping, prompts, max_new_tokens=4, temperature=0.0)
    assert out.tokens[0] == [first] and out.finish_reasons[0] == "stop"


def test_a_quantized_folder_is_refused_naming_the_quantization(folder, tmp_path):
    declared = _copy(folder, tmp_path / "fp8")
    path = os.path.join(declared, "config.json")
    raw = json.load(open(path))
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    json.dump(raw, open(path, "w"))
    with pytest.raises(ConfigError, match=r"config.json: a quantized checkpoint \(quantization_config: fp8, e4m3\)"
                                          r".*unquantized checkpoint"):
        qwen35.from_pretrained(declared)
    # No quantization_config, but scale tensors beside the weights (a converted folder): named all the same.
    undeclared = _copy(folder, tmp_path / "scales")
    weights = os.path.join(undeclared, "model.safetensors")
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    tensors[name.replace(".weight", ".weight_scale_inv")] = np.ones((1, 1), np.float32)
    save_file(tensors, weights)
    with pytest.raises(CheckpointError, match=r"a FP8 \(block-wise\)-quantized checkpoint \(tensor .*weight_scale_inv"
                                              r".*unquantized checkpoint"):
        qwen35.from_pretrained(undeclared)


def test_auto_attention_falls_back_to_xla_once_where_cudnn_does_not_compile(monkeypatch, caplog):
    """On a "GPU" whose cuDNN cannot build the kernel (here: the CPU, which has no cuDNN, with only the backend
    name changed) "auto" takes the XLA attention with one warning, instead of raising inside the first step."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention, "_CUDNN_SUPPORT", {})
    with caplog.at_level("WARNING"):
        picks = [attention.resolve_implementation("auto", jnp.bfloat16, 256) for _ in range(3)]
    assert picks == ["xla"] * 3
    warnings = [r for r in caplog.records if "cuDNN fused attention does not compile" in r.getMessage()]
    assert len(warnings) == 1 and "head dim 256" in warnings[0].getMessage()
    assert attention.resolve_implementation("auto", jnp.float32, 256) == "xla"  # fp32: never probed
    assert attention.resolve_implementation("cudnn", jnp.bfloat16, 256) == "cudnn"  # asked for explicitly


def test_the_gpu_train_step_benchmark_takes_every_remat_policy():
    from jaxrl.models.qwen35.model import REMAT_CHOICES
    assert "auto" in REMAT_CHOICES and "matmuls" in REMAT_CHOICES and "attention" in REMAT_CHOICES
    run = lambda *a: subprocess.run([sys.executable, "-m", "benchmarks.gpu_train_step", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    refused = run("--remat=bogus")  # argparse lists the choices it takes
    assert refused.returncode == 2
    assert all(f"'{policy}'" in refused.stderr for policy in REMAT_CHOICES), refused.stderr
