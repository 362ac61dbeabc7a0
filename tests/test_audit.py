"""The weight audit tells base, two checkpoints, the merged export of one and a corrupted copy apart, names the
corrupted tensor, and its relative delta norms are the hand-computed ||s B A|| / ||W||."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import jax.numpy as jnp

from jaxrl.models.adapters import Adapter, write_adapter_checkpoint
from jaxrl.export.audit import (FolderSource, MergedSource, audit, compare_sources, fingerprint, format_audit,
                                main as audit_main, tensor_diff)
from jaxrl.export.merge import export_merged
from jaxrl.models import qwen35
from jaxrl.models.lora import linears

pytestmark = pytest.mark.slow  # its fixture trains and exports checkpoints

MODULES_4 = ("layers.0.linear_attn.in_proj_qkv", "layers.1.self_attn.q_proj", "layers.3.mlp.down_proj")
MODULES_8 = MODULES_4 + ("layers.2.linear_attn.out_proj",)
CORRUPT = "layers.2.mlp.up_proj.weight"
VISION = "model.visual.blocks.0.attn.qkv.weight"


def adapter(folder, modules, seed):
    model = qwen35.from_pretrained(folder, dtype=jnp.float32)
    lin = dict(linears(model))
    rng = np.random.default_rng(seed)
    params = {}
    for m in modules:
        params[m + ".lora.lora_A"] = (rng.standard_normal((2, lin[m].in_features)) * 0.1).astype(np.float32)
        params[m + ".lora.lora_B"] = (rng.standard_normal((lin[m].out_features, 2)) * 0.1).astype(np.float32)
    return Adapter(params=params, rank=2, alpha=4.0, source=f"seed {seed}")


def altered_copy(src, dst, key, delta):
    """A copy of a single-file HF folder with one element of one tensor moved by `delta`."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    with safe_open(path, framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    tensors[key] = tensors[key].copy()
    tensors[key].flat[5] += delta
    save_file(tensors, path, metadata=meta)
    return dst


@pytest.fixture(scope="module")
def zoo(hf_container, tmp_path_factory):
    base, _ = hf_container
    root = tmp_path_factory.mktemp("audit")
    a4, a8 = adapter(base, MODULES_4, 4), adapter(base, MODULES_8, 8)
    run = str(root / "run")
    write_adapter_checkpoint(run, 4, a4)
    write_adapter_checkpoint(run, 8, a8)
    merged = str(root / "merged_4")
    export_merged(a4, base, merged)
    corrupt = altered_copy(merged, str(root / "corrupt_4"), "model.language_model." + CORRUPT, 1e-3)
    vision = altered_copy(base, str(root / "vision_changed"), VISION, 0.5)
    return {"base": base, "run": run, "a4": a4, "a8": a8, "merged": merged, "corrupt": corrupt, "vision": vision}


def test_base_two_checkpoints_merged_and_corrupted_copy_told_apart(zoo):
    base = zoo["base"]
    sources = {"base": FolderSource(base), "step_4": MergedSource(base, zoo["a4"]),
               "step_8": MergedSource(base, zoo["a8"]), "merged_4": FolderSource(zoo["merged"]),
               "corrupt_4": FolderSource(zoo["corrupt"])}
    report = audit(sources, reference="base", pairwise=True)
    fps = report["fingerprints"]
    # The merged export IS step 4 (same language weights); everything else differs from everything else.
    assert report["same_weights"] == [["step_4", "merged_4"]]
    assert len({fps[n] for n in ("base", "step_4", "step_8", "corrupt_4")}) == 4

    for name, adapted in (("step_4", MODULES_4), ("step_8", MODULES_8)):
        entry = report["models"][name]
        assert sorted(entry["changed"]) == sorted(m + ".weight" for m in adapted), name
        assert entry["changed_non_language"] == [] and not entry["identical"]
        assert entry["language"]["changed"] == len(adapted)
        assert entry["by_module"]["mlp.up_proj.weight"]["rel_delta_norm"] == 0.0
        assert entry["by_layer"]["3"]["changed"] == 1  # layers.3.mlp.down_proj
    # The corrupted copy differs from the checkpoint it copies in exactly one named tensor, by the injected amount.
    cell = report["pairwise"]["merged_4"]["corrupt_4"]
    assert cell == report["pairwise"]["corrupt_4"]["merged_4"]
    assert cell["changed"] == 1 and not cell["identical"]
    assert cell["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    direct = compare_sources(sources["merged_4"], sources["corrupt_4"])
    assert direct["changed"] == [CORRUPT] and direct["tensors"][0]["layer"] == 2
    assert report["pairwise"]["step_4"]["merged_4"]["identical"]
    assert report["models"]["corrupt_4"]["changed"] == sorted(m + ".weight"
                                                              for m in MODULES_4 + ("layers.2.mlp.up_proj",))

    # Relative delta norm of one adapted weight, by hand: ||s B A|| / ||W|| (fp64; the stored merge is fp32).
    a, b = zoo["a4"].factors("layers.1.self_attn.q_proj")
    with safe_open(os.path.join(base, "model.safetensors"), framework="numpy") as f:
        w = f.get_tensor("model.language_model.layers.1.self_attn.q_proj.weight").astype(np.float64)
    expected = np.linalg.norm(2.0 * (b.astype(np.float64) @ a)) / np.linalg.norm(w)
    row = next(t for t in report["models"]["step_4"]["tensors"] if t["name"] == "layers.1.self_attn.q_proj.weight")
    assert row["rel_delta_norm"] == pytest.approx(expected, rel=1e-4) and expected > 1e-3

    text = format_audit(report)
    assert "SAME language weights: step_4, merged_4" in text and "corrupt_4" in text


def test_fingerprint_covers_the_language_tower_and_the_audit_everything(zoo):
    base = FolderSource(zoo["base"])
    vision = FolderSource(zoo["vision"])
    assert fingerprint(vision) == fingerprint(base)  # vision weights are not what a text evaluation uses...
    diff = compare_sources(base, vision)  # ...but the audit still names the change
    assert diff["changed"] == [VISION] and diff["changed_non_language"] == [VISION] and not diff["identical"]
    assert compare_sources(base, FolderSource(zoo["base"]))["identical"]
    # Tensors of another shape (another model size) are a difference, not a crash.
    assert tensor_diff(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32))["shape"] == "(2, 3) -> (3, 2)"
    # The merged export keeps every non-language tensor of the base.
    merged = compare_sources(base, FolderSource(zoo["merged"]))
    assert merged["changed_non_language"] == [] and merged["only_in_model"] == merged["only_in_reference"] == []


def test_command_line(zoo, tmp_path, capsys):
    out = tmp_path / "audit.json"
    assert audit_main([f"--base={zoo['base']}", f"--out={out}", f"step_4={zoo['run']}/checkpoints/adapters/4",
                       f"merged_4={zoo['merged']}", f"corrupt_4={zoo['corrupt']}"]) == 0
    report = json.loads(out.read_text())
    assert report["fingerprints"]["step_4"] == report["fingerprints"]["merged_4"]
    assert report["fingerprints"]["corrupt_4"] != report["fingerprints"]["merged_4"]
    assert "SAME language weights: step_4, merged_4" in capsys.readouterr().out
