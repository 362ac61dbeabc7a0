"""Our PEFT exports against vLLM 0.33's Qwen3.5 LoRA expectations, replayed without vLLM (it needs a GPU).

VLLM_033 below is the table of what vLLM 0.33.0 does with a PEFT adapter of Qwen3_5ForConditionalGeneration, each
row citing the file:line of the released wheel it was read from (`pip download --no-deps vllm==0.33.0`, unzip;
paths relative to `vllm/`). `vllm_replay` applies the table to an adapter folder: name parsing, the expected-name
check, packing into vLLM's fused layers with their slice sizes, and the packed-LoRA split (`expand_packed_lora`,
ported line for line). Every exported adapter is checked against it: all its tensors land on a vLLM layer with the
right shapes, none is ignored, and the verdict on partial GDN target lists equals the training-start refusal
(`jaxrl.models.lora.vllm_unpackable`).
"""

import itertools
import json
import os

import pytest
from safetensors import safe_open

from jaxrl.models.peft import export_peft
from jaxrl.models.lora import LoRAError, apply_lora_from_config, vllm_unpackable
from jaxrl.backends.openai_client import LORA_RANKS, lora_rank_slot
from test_export import random_adapter

VLLM_033 = {
    # --- names -------------------------------------------------------------------------------------------------
    "strip_prefix": ("base_model.model.", "lora/utils.py:199-208 parse_fine_tuned_lora_name strips "
                     "`base_model.model.`, maps the rest, and drops the trailing lora_A/lora_B.weight (:217-223)"),
    "rename_mapper": ("the model's hf_to_vllm_mapper, renames only", "lora/worker_manager.py:129-135 "
                      "get_rename_mapper(); model_executor/models/utils.py:180-197 (stacked maps dropped)"),
    "container_prefixes": ({"model.visual.": "visual.", "lm_head.": "language_model.lm_head.",
                            "model.language_model.": "language_model.model."},
                           "model_executor/models/qwen3_vl.py:1969-1975, applied in order by "
                           "model_executor/models/utils.py:131-136"),
    "mtp_dropped": ("mtp.", "model_executor/models/qwen3_5.py:476-479 (the MTP drafter reads it, "
                    "model_executor/models/qwen3_5_mtp.py:311-312)"),
    "text_layout_remap": ("model.layers.N... adapters find language_model.model.layers.N... modules",
                          "lora/model_manager.py:1269-1287 _get_text_lora_names"),
    "expected_names": ("every adapted module's last name must be a supported module or a packed member",
                       "lora/worker_manager.py:108-118 (expected set), lora/lora_model.py:246-279 (raises on "
                       "others)"),
    # --- layers, slices, in-features ---------------------------------------------------------------------------
    "self_attn.qkv_proj": ((["q_proj", "k_proj", "v_proj"], "q: nH*hd*(1+gate), k, v: nKV*hd", "hidden"),
                           "model_executor/models/qwen3_vl.py:1949-1954 (packing); "
                           "model_executor/models/qwen3_next.py:317-325 (q heads doubled by attn_output_gate)"),
    "self_attn.o_proj": ((None, "hidden", "nH*hd"), "model_executor/models/qwen3_next.py:327-334"),
    "mlp.gate_up_proj": ((["gate_proj", "up_proj"], "[I, I]", "hidden"),
                         "model_executor/models/qwen3_vl.py:1955-1958; model_executor/models/qwen2_moe.py:91-97"),
    "mlp.down_proj": ((None, "hidden", "I"), "model_executor/models/qwen2_moe.py:99-106"),
    "linear_attn.in_proj_qkvz": ((["in_proj_qkv", "in_proj_z"], "[kd, kd, vd, vd]", "hidden"),
                                 "model_executor/models/qwen3_5.py:481-484 (packing); "
                                 "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:816-826 (4 slices, "
                                 "always fused: :610-616)"),
    "linear_attn.in_proj_ba": ((["in_proj_b", "in_proj_a"], "[nv, nv]", "hidden"),
                               "model_executor/models/qwen3_5.py:481-484; "
                               "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:841-850"),
    "linear_attn.out_proj": ((None, "hidden", "vd"),
                             "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:675-683"),
    # --- packing ---------------------------------------------------------------------------------------------
    "pack": ("members in mapping order, None for an unadapted member", "lora/model_manager.py:849-899 "
             "_create_merged_loras_inplace (None for absent members: :868-871)"),
    "expand_when": ("only when the packed list is shorter than the layer's slices",
                    "lora/layers/column_parallel_linear.py:330-331"),
    "expand": ("a None member covers all remaining slices; a B must cover whole slices, else ValueError",
               "lora/layers/column_parallel_linear.py:265-318 (None: :283-295, raise: :303-308)"),
    # --- adapter config ----------------------------------------------------------------------------------------
    "scale": ("alpha / r, or alpha / sqrt(r) with use_rslora", "lora/peft_helper.py:115-120"),
    "max_lora_rank": (LORA_RANKS, "config/lora.py:27 (allowed values), lora/peft_helper.py:193-198 (r <= it)"),
}


def vllm_layers(config: dict) -> dict:
    """{vLLM module name: (packed members or None, slice sizes, in_features)} of a Qwen3.5 container's language
    model, from its config.json (the table's layer rows)."""
    t = config["text_config"]
    h, inter, nh, nkv, hd = (t["hidden_size"], t["intermediate_size"], t["num_attention_heads"],
                             t["num_key_value_heads"], t["head_dim"])
    kd, vd, nv = (t["linear_num_key_heads"] * t["linear_key_head_dim"],
                  t["linear_num_value_heads"] * t["linear_value_head_dim"], t["linear_num_value_heads"])
    gate = 1 + int(t.get("attn_output_gate", True))
    types = t.get("layer_types") or ["full_attention" if (i + 1) % t["full_attention_interval"] == 0
                                     else "linear_attention" for i in range(t["num_hidden_layers"])]
    out = {}
    for i, kind in enumerate(types):
        p = f"language_model.model.layers.{i}."
        if kind == "full_attention":
            out[p + "self_attn.qkv_proj"] = (["q_proj", "k_proj", "v_proj"], [nh * hd * gate, nkv * hd, nkv * hd], h)
            out[p + "self_attn.o_proj"] = (None, [h], nh * hd)
        else:
            out[p + "linear_attn.in_proj_qkvz"] = (["in_proj_qkv", "in_proj_z"], [kd, kd, vd, vd], h)
            out[p + "linear_attn.in_proj_ba"] = (["in_proj_b", "in_proj_a"], [nv, nv], h)
            out[p + "linear_attn.out_proj"] = (None, [h], vd)
        out[p + "mlp.gate_up_proj"] = (["gate_proj", "up_proj"], [inter, inter], h)
        out[p + "mlp.down_proj"] = (None, [h], inter)
    return out


def parse_name(key: str) -> tuple[str, bool]:
    """lora/utils.py:180-223 with the rename-only container mapper (rows strip_prefix, container_prefixes)."""
    assert key.startswith(VLLM_033["strip_prefix"][0]), key
    name = key[len("base_model.model."):]
    for old, new in VLLM_033["container_prefixes"][0].items():
        if name.startswith(old):
            name = name.replace(old, new, 1)
    parts = name.split(".")
    assert parts[-1] == "weight" and parts[-2] in ("lora_A", "lora_B"), key
    return ".".join(parts[:-2]), parts[-2] == "lora_A"


def expand_packed_lora(output_sizes, lora_a, lora_b):
    """vllm/lora/layers/column_parallel_linear.py:265-318, line for line (rows b rows only)."""
    n_slices = len(output_sizes)
    expanded_a, expanded_b, start_idx = [], [], 0
    for a_i, b_i in zip(lora_a, lora_b):
        if b_i is None:
            covered = n_slices - start_idx
            expanded_a += [None] * covered
            expanded_b += [None] * covered
            start_idx += covered
            continue
        b_rows, cu_rows, covered = b_i.shape[0], 0, 0
        for i in range(start_idx, n_slices):
            cu_rows += output_sizes[i]
            if cu_rows == b_rows:
                covered = i - start_idx + 1
                break
        else:
            raise ValueError(f"Cannot determine how to split lora_b with {b_rows} rows into {n_slices} slices "
                             f"with output sizes {output_sizes} starting from index {start_idx}.")
        start = 0
        for j in range(covered):
            size = output_sizes[start_idx + j]
            expanded_b.append(b_i[start:start + size])
            expanded_a.append(a_i)
            start += size
        start_idx += covered
    return expanded_a, expanded_b


def vllm_replay(folder: str, base_config: dict) -> dict:
    """What vLLM 0.33 does with the PEFT adapter at `folder` on the container of `base_config` (module docstring).
    Returns {"applied": {vLLM module: slices set}, "text_remapped": bool}; raises ValueError where vLLM raises."""
    cfg = json.load(open(os.path.join(folder, "adapter_config.json")))
    assert lora_rank_slot(cfg["r"]) in VLLM_033["max_lora_rank"][0]
    layers = vllm_layers(base_config)
    expected = set()
    for packed, _, _ in layers.values():
        expected.update(packed or [])
    expected.update(name.rsplit(".", 1)[-1] for name, (packed, _, _) in layers.items() if packed is None)
    factors: dict = {}
    with safe_open(os.path.join(folder, "adapter_model.safetensors"), framework="numpy") as f:
        for key in f.keys():
            module, is_a = parse_name(key)
            if module.rsplit(".", 1)[-1] not in expected:  # lora_model.py:246-279
                raise ValueError(f"While loading {folder}, expected target modules in {expected} but received "
                                 f"{module}")
            factors.setdefault(module, {})["A" if is_a else "B"] = f.get_tensor(key)
    text_remapped = False

    def lookup(name):  # the module's own name, else the text-layout name (model_manager.py:1269-1287)
        nonlocal text_remapped
        if name in factors:
            return name
        text = name.removeprefix("language_model.")
        if text in factors:
            text_remapped = True
            return text
        return None

    applied, consumed = {}, set()
    for name, (packed, sizes, in_features) in layers.items():
        prefix = name.rsplit(".", 1)[0]
        members = packed or [name.rsplit(".", 1)[-1]]
        found = [lookup(f"{prefix}.{m}") for m in members]
        if not any(found):
            continue
        a = [factors[k]["A"] if k else None for k in found]
        b = [factors[k]["B"] if k else None for k in found]
        consumed.update(k for k in found if k)
        for a_i in a:
            if a_i is not None:
                assert a_i.shape[1] == in_features and a_i.shape[0] == cfg["r"], (name, a_i.shape)
        if len(b) != len(sizes):  # column_parallel_linear.py:330-331
            a, b = expand_packed_lora(sizes, a, b)
        for size, b_i in zip(sizes, b):
            if b_i is not None:
                assert b_i.shape == (size, cfg["r"]), (name, b_i.shape, size)
        applied[name] = [i for i, b_i in enumerate(b) if b_i is not None]
    ignored = sorted(set(factors) - consumed)
    assert not ignored, f"vLLM would apply no layer for {ignored} (logged at DEBUG only, model_manager.py:403-409)"
    return {"applied": applied, "text_remapped": text_remapped}


@pytest.fixture(scope="module")
def base(hf_container):
    folder = hf_container[0]
    return folder, json.load(open(os.path.join(folder, "config.json")))


def modules_of(folder, names, layers=None):
    from jaxrl.models import qwen35
    from jaxrl.models.lora import linears
    import jax.numpy as jnp
    model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    return {p for p, _ in linears(model) if p != "lm_head" and p.rsplit(".", 1)[-1] in names
            and (layers is None or int(p.split(".")[1]) in layers)}


def test_all_linear_export_packs_onto_every_vllm_layer(base, tmp_path):
    folder, config = base
    adapter = random_adapter(folder)  # all 12 projection kinds of every layer, rsLoRA r=4
    out = str(tmp_path / "peft")
    export_peft(adapter, out, folder)
    result = vllm_replay(out, config)
    layers = vllm_layers(config)
    assert set(result["applied"]) == set(layers)  # every vLLM LoRA layer of the language model gets its slices
    for name, slices in result["applied"].items():
        assert slices == list(range(len(layers[name][1]))), name  # all slices, qkv split three ways
    assert not result["text_remapped"]


def test_text_layout_adapters_are_remapped_by_vllm_033(base, tmp_path):
    folder, config = base
    adapter = random_adapter(folder, modules=modules_of(folder, ("q_proj", "in_proj_qkv", "down_proj")))
    out = str(tmp_path / "peft_text")
    export_peft(adapter, out, folder, layout="text", allow_layout_mismatch=True)
    result = vllm_replay(out, config)
    assert result["text_remapped"] and len(result["applied"]) == len(adapter.modules)


GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


@pytest.mark.parametrize("subset", [s for k in range(1, 5) for s in itertools.combinations(GDN, k)],
                         ids=lambda s: "+".join(x.replace("in_proj_", "") for x in s))
def test_partial_gdn_targets_pack_exactly_when_the_refusal_says(base, tmp_path, subset):
    """Each of the 15 GDN target subsets (plus a partial q/k/v group): the replay of vLLM's packing fails exactly
    for the subsets that `vllm_unpackable` refuses at training start (in_proj_z without in_proj_qkv)."""
    folder, config = base
    modules = modules_of(folder, subset + ("k_proj",), layers={0, 1})  # k without q/v: a partial qkv_proj too
    adapter = random_adapter(folder, modules=modules, use_rslora=False, seed=3)
    out = str(tmp_path / "peft")
    export_peft(adapter, out, folder)
    refused = vllm_unpackable(adapter.modules)
    if refused:
        with pytest.raises(ValueError, match="Cannot determine how to split lora_b"):
            vllm_replay(out, config)
        assert all("in_proj_z without" in r for r in refused)
    else:
        vllm_replay(out, config)
    assert bool(refused) == ("in_proj_z" in subset and "in_proj_qkv" not in subset)


def test_unpackable_targets_are_refused_at_training_start(base):
    import dataclasses

    from jaxrl.models.settings import LoRAConfig
    from jaxrl.models import qwen35
    import jax.numpy as jnp
    model = qwen35.from_pretrained(base[0], dtype=jnp.float32)
    cfg = LoRAConfig(rank=4, alpha=8.0, targets="in_proj_z,out_proj")
    with pytest.raises(LoRAError, match=r"vLLM 0.33 cannot serve.*in_proj_z without .*in_proj_qkv.*"
                                        r"Add in_proj_qkv to lora.targets.*allow_vllm_unpackable"):
        apply_lora_from_config(model, cfg)
    # the explicit key: allowed (jaxrl and PEFT serve it)
    report = apply_lora_from_config(model, dataclasses.replace(cfg, allow_vllm_unpackable=True))
    assert report["by_name"] == {"in_proj_z": 2, "out_proj": 2}
    model2 = qwen35.from_pretrained(base[0], dtype=jnp.float32)
    cfg2 = LoRAConfig(rank=4, alpha=8.0, targets="all-linear")
    assert len(apply_lora_from_config(model2, cfg2)["modules"]) == 2 * 8 + 2 * 7


def test_exports_are_readable_by_others(base, tmp_path):
    """PEFT and merged exports: files 0644 and folders 0755 under umask 022 (a `vllm serve` running as another
    user reads them); a stricter umask is honoured."""
    import stat

    from jaxrl.export.merge import export_merged
    folder, _ = base
    adapter = random_adapter(folder, modules=modules_of(folder, ("q_proj",)), use_rslora=False)
    old = os.umask(0o022)
    try:
        export_peft(adapter, str(tmp_path / "peft"), folder)
        export_merged(adapter, folder, str(tmp_path / "merged"), probe=False)
        os.umask(0o027)
        export_peft(adapter, str(tmp_path / "private"), folder)
    finally:
        os.umask(old)
    for name, (want_file, want_dir) in (("peft", (0o644, 0o755)), ("merged", (0o644, 0o755)),
                                        ("private", (0o640, 0o750))):
        root = tmp_path / name
        entries = [root] + list(root.rglob("*"))
        assert len(entries) > 3
        for p in entries:
            mode = stat.S_IMODE(p.stat().st_mode)
            assert mode == (want_dir if p.is_dir() else want_file), (str(p), oct(mode))
