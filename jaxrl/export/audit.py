"""Weight audit: which weights does a model really have, and how do they differ from the base?

    base = FolderSource("Qwen3.5-4B")
    sources = {"base": base, "step_28": MergedSource("Qwen3.5-4B", read_adapter(".../adapters/28")),
               "merged_28": FolderSource("export/merged_28")}
    report = audit(sources, reference="base")         # per tensor / layer / module: max |d|, ||d|| / ||W||
    fingerprint(sources["step_28"])                    # sha256 of the language tower as it would be served

A loader that silently drops the adapter makes an evaluation score the base weights; this is the check that
catches it. A *source* is anything that yields tensors by canonical name:

* `FolderSource(hf_dir)`: an HF folder (container or text-only, one file or shards);
* `MergedSource(base_dir, adapter)`: base + adapter merged exactly as `export_merged` writes it (in the stored
  dtype), computed on the fly, so `fingerprint(MergedSource(b, a)) == fingerprint(FolderSource(export_merged(a, b,
  out)))`: the fingerprint names base + adapter. It is a label, not the weights every backend computes with: the
  jax backend and vLLM LoRA apply the adapter unmerged, while a bf16 merged folder holds bf16(W + s*B*A), which
  loses most of a small update (`jaxrl.export.merge`, merge_fidelity).

Canonical names drop the tower prefix (`layers.3.mlp.up_proj.weight`, `embed_tokens.weight`, `norm.weight`,
`lm_head.weight`), so container and text-only folders of the same weights compare equal; other tensors keep their
key (`model.visual.*`, `mtp.*`). The *language tower* (what the fingerprint covers) is the tower plus lm_head.

Fingerprint: sha256 over, for each language-tower tensor in sorted canonical-name order, its name, stored dtype,
shape and raw bytes. Equal fingerprints mean bit-identical language weights; it ignores file layout and sharding.

Run from the command line::

    python -m jaxrl.export.audit --base=HF_DIR [--out=audit.json] name=HF_DIR_OR_ADAPTER ...
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from typing import Iterator, Mapping, Optional

import numpy as np
from flax import nnx
from safetensors import safe_open

from jaxrl.models.peft import read_adapter
from jaxrl.models.adapters import Adapter, check_against_model, merged_weight
from jaxrl.models.qwen35.checkpoint import read_weight_map
from jaxrl.models.qwen35.config import load_hf_config
from jaxrl.models.qwen35.model import Qwen35
from jaxrl.utils.io import atomic_write_json

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


class AuditError(ValueError):
    """Sources that cannot be compared (missing files, shape mismatches); names the tensor."""


# ---------------------------------------------------------------------------------------------------------------
# Sources

class FolderSource:
    """Tensors of an HF folder, read lazily one at a time (a 9B model never sits in memory twice)."""

    def __init__(self, folder: str):
        self.folder = os.path.abspath(folder)
        self.config, self.layout, _ = load_hf_config(folder)
        self._files = read_weight_map(folder)  # hf key -> file
        self._canon = {canonical(k, self.layout.tower_prefix): k for k in self._files
                       if not k.endswith("rotary_emb.inv_freq")}
        self._handles: dict = {}
        self.description = f"folder {self.folder}"

    def keys(self) -> list[str]:
        return sorted(self._canon)

    def hf_key(self, name: str) -> str:
        return self._canon[name]

    def get(self, name: str) -> np.ndarray:
        key = self._canon[name]
        fname = self._files[key]
        if fname not in self._handles:
            self._handles[fname] = safe_open(os.path.join(self.folder, fname), framework="numpy")
        return self._handles[fname].get_tensor(key)


class MergedSource:
    """`base + adapter` merged as `jaxrl.export.merge.export_merged` writes it (`merged_weight`), computed on
    the fly."""

    def __init__(self, base_dir: str, adapter: Adapter):
        self.base = FolderSource(base_dir)
        self.adapter = adapter
        self.config, self.layout = self.base.config, self.base.layout
        check_against_model(adapter, nnx.eval_shape(lambda: Qwen35(self.config, rngs=nnx.Rngs(0))))
        self._modules = {f"{m}.weight": m for m in adapter.modules}
        self.description = f"{self.base.folder} + adapter {adapter.source}"

    def keys(self) -> list[str]:
        return self.base.keys()

    def get(self, name: str) -> np.ndarray:
        value = self.base.get(name)
        module = self._modules.get(name)
        return value if module is None else merged_weight(value, self.adapter, module)


def canonical(hf_key: str, tower_prefix: str) -> str:
    """HF key -> canonical name (module docstring)."""
    if hf_key.startswith(tower_prefix):
        return hf_key[len(tower_prefix):]
    return hf_key


def is_language(name: str) -> bool:
    """Canonical names of the language tower + head (what the fingerprint covers)."""
    return bool(_LAYER.match(name)) or name in ("embed_tokens.weight", "norm.weight", "lm_head.weight")


def split_name(name: str) -> tuple[Optional[int], str]:
    """(layer number or None, module) of a canonical name: `layers.3.mlp.up_proj.weight` -> (3,
    "mlp.up_proj.weight")."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


# ---------------------------------------------------------------------------------------------------------------
# Fingerprint

class _Hasher:
    """The fingerprint, fed one tensor at a time in sorted canonical-name order (so it can ride along a
    comparison pass instead of reading a model twice)."""

    def __init__(self):
        self.h, self.n = hashlib.sha256(), 0

    def add(self, name: str, value: np.ndarray) -> None:
        value = np.ascontiguousarray(value)
        self.h.update(f"{name}|{value.dtype}|{value.shape}|".encode())
        self.h.update(value.tobytes())
        self.n += 1

    def hexdigest(self, description: str) -> str:
        if not self.n:
            raise AuditError(f"{description}: no language-tower tensors")
        return self.h.hexdigest()


def fingerprint(source) -> str:
    """sha256 of the language tower (module docstring), as 64 hex digits."""
    hasher = _Hasher()
    for name in source.keys():
        if is_language(name):
            hasher.add(name, source.get(name))
    return hasher.hexdigest(source.description)


def short(fp: Optional[str]) -> str:
    return fp[:12] if fp else "-"


# ---------------------------------------------------------------------------------------------------------------
# Comparison

def tensor_diff(ref: np.ndarray, other: np.ndarray, name: str = "") -> dict:
    """{"identical", "max_abs_diff", "rel_delta_norm", "delta_norm", "ref_norm"} of `other - ref` (fp64);
    `identical` compares raw bytes and dtype, so a dtype change alone is a difference."""
    if ref.shape != other.shape:  # another model size: nothing to subtract, but certainly a difference
        return {"identical": False, "max_abs_diff": None, "rel_delta_norm": None, "delta_norm": None,
                "ref_norm": None, "shape": f"{ref.shape} -> {other.shape}"}
    identical = ref.dtype == other.dtype and ref.tobytes() == other.tobytes()
    if identical:
        norm = float(np.linalg.norm(ref.astype(np.float64).ravel()))
        return {"identical": True, "max_abs_diff": 0.0, "rel_delta_norm": 0.0, "delta_norm": 0.0, "ref_norm": norm}
    a, b = ref.astype(np.float64), other.astype(np.float64)
    d = b - a
    ref_norm = float(np.linalg.norm(a.ravel()))
    delta_norm = float(np.linalg.norm(d.ravel()))
    return {"identical": False, "max_abs_diff": float(np.max(np.abs(d))) if d.size else 0.0,
            # None: a change of an all-zero tensor has no relative size (and inf is not JSON)
            "rel_delta_norm": delta_norm / ref_norm if ref_norm > 0 else None,
            "delta_norm": delta_norm, "ref_norm": ref_norm,
            **({"dtype": f"{ref.dtype} -> {other.dtype}"} if ref.dtype != other.dtype else {})}


def _aggregate(rows: list[dict]) -> dict:
    """Counts, max |d| and ||d|| / ||W|| over a group of tensors (tensors of different shapes are only counted)."""
    sized = [r for r in rows if "shape" not in r]
    ref2 = sum(r["ref_norm"] ** 2 for r in sized)
    d2 = sum(r["delta_norm"] ** 2 for r in sized)  # ||d|| over all of them, relative to ||W|| over all
    return {"tensors": len(rows), "changed": sum(not r["identical"] for r in rows),
            "shape_changed": len(rows) - len(sized),
            "max_abs_diff": max((r["max_abs_diff"] for r in sized), default=0.0),
            "rel_delta_norm": (d2 ** 0.5) / (ref2 ** 0.5) if ref2 > 0 else (0.0 if d2 == 0 else None)}


def compare_sources(reference, other, with_fingerprint: bool = False) -> dict:
    """Every tensor of `other` against `reference`: per tensor, per layer, per module, language tower overall,
    and the other (vision, mtp) tensors; names of changed tensors; keys present on one side only.
    with_fingerprint: also `"fingerprint"` of `other`, computed in the same pass (each tensor is read once)."""
    ref_keys, other_keys = set(reference.keys()), set(other.keys())
    rows = []
    hasher = _Hasher()
    for name in sorted(ref_keys | other_keys):  # sorted: the fingerprint's order
        if name not in other_keys:
            continue
        value = other.get(name)
        if with_fingerprint and is_language(name):
            hasher.add(name, value)
        if name not in ref_keys:
            continue
        row = tensor_diff(reference.get(name), value, name)
        layer, module = split_name(name)
        rows.append({"name": name, "layer": layer, "module": module, "language": is_language(name), **row})
    lang = [r for r in rows if r["language"]]
    by_layer: dict = {}
    by_module: dict = {}
    for r in lang:
        if r["layer"] is not None:
            by_layer.setdefault(str(r["layer"]), []).append(r)
        by_module.setdefault(r["module"], []).append(r)
    changed = [r for r in rows if not r["identical"]]
    out = {
        "identical": not changed and ref_keys == other_keys,
        "language": _aggregate(lang),
        "non_language": _aggregate([r for r in rows if not r["language"]]),
        "changed": [r["name"] for r in changed],
        "changed_non_language": [r["name"] for r in changed if not r["language"]],
        "only_in_reference": sorted(ref_keys - other_keys),
        "only_in_model": sorted(other_keys - ref_keys),
        "by_layer": {k: _aggregate(v) for k, v in sorted(by_layer.items(), key=lambda kv: int(kv[0]))},
        "by_module": {k: _aggregate(v) for k, v in sorted(by_module.items())},
        "tensors": [{k: v for k, v in r.items() if k != "language"} for r in changed],
    }
    if with_fingerprint:
        out["fingerprint"] = hasher.hexdigest(getattr(other, "description", "model"))
    return out


def audit(sources: Mapping[str, object], reference: str = "base", pairwise: bool = False) -> dict:
    """Fingerprints of every source and the comparison of each with `reference`.

    Returns ``{"reference", "fingerprints": {name: sha256}, "same_weights": [[names sharing a fingerprint]],
    "models": {name: {"description", "fingerprint", ...compare_sources(reference, name)}},
    "pairwise": {a: {b: {"identical", "changed", "max_abs_diff"}}}`` (pairwise only when asked: one full pass
    per pair). ``same_weights`` lists only groups of 2+ models: two "different" models with equal language
    weights is the evaluated-the-wrong-weights failure.
    """
    if reference not in sources:
        raise AuditError(f"reference {reference!r} is not among the sources {sorted(sources)}")
    fps = {reference: fingerprint(sources[reference])}
    entries = {}
    for name, src in sources.items():
        entry = {"description": getattr(src, "description", ""), "fingerprint": None}
        if name != reference:  # one pass over both: the comparison and this model's fingerprint
            found = compare_sources(sources[reference], src, with_fingerprint=True)
            fps[name] = found.pop("fingerprint")
            entry.update(found)
        entry["fingerprint"] = fps[name]
        entries[name] = entry
    fps = {name: fps[name] for name in sources}
    groups: dict[str, list[str]] = {}
    for name, fp in fps.items():
        groups.setdefault(fp, []).append(name)
    report = {"reference": reference, "fingerprints": fps,
              "same_weights": [names for names in groups.values() if len(names) > 1], "models": entries}
    if pairwise:
        names = list(sources)
        report["pairwise"] = {a: {} for a in names}
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                c = compare_sources(sources[a], sources[b])
                cell = {"identical": c["identical"], "changed": len(c["changed"]),
                        "max_abs_diff": max(c["language"]["max_abs_diff"], c["non_language"]["max_abs_diff"])}
                report["pairwise"][a][b] = report["pairwise"].setdefault(b, {})[a] = cell
    return report


def format_audit(report: Mapping) -> str:
    """A short text table: one line per model (fingerprint, changed tensors, max |d|, relative delta norm)."""
    lines = [f"reference: {report['reference']}",
             f"{'model':<20} {'fingerprint':<13} {'changed':>8} {'max|d|':>10} {'|d|/|W|':>10}  non-language changed"]
    for name, m in report["models"].items():
        if name == report["reference"]:
            lines.append(f"{name:<20} {short(m['fingerprint']):<13} {'(reference)':>8}")
            continue
        lang = m["language"]
        rel = "n/a" if lang["rel_delta_norm"] is None else f"{lang['rel_delta_norm']:.3g}"
        if lang.get("shape_changed"):
            rel += f" ({lang['shape_changed']} reshaped)"
        lines.append(f"{name:<20} {short(m['fingerprint']):<13} {len(m['changed']):>8} "
                     f"{lang['max_abs_diff']:>10.3g} {rel:>10}  "
                     f"{', '.join(m['changed_non_language']) or 'none'}")
    for group in report["same_weights"]:
        lines.append(f"SAME language weights: {', '.join(group)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Command line

def source_for(path: str, base_dir: str, step: Optional[int] = None):
    """FolderSource for an HF folder (config.json), else MergedSource(base, adapter at `path`)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return FolderSource(path)
    return MergedSource(base_dir, read_adapter(path, step))


def iter_specs(specs) -> Iterator[tuple[str, str]]:
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"expected NAME=PATH, got {spec!r}")
        yield name, path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxrl.export.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="base HF folder (the reference, named 'base')")
    parser.add_argument("--out", help="write the full report as JSON here")
    parser.add_argument("--pairwise", action="store_true", help="also compare every pair of models")
    parser.add_argument("models", nargs="*", help="NAME=PATH: an HF folder or an adapter (trainer / PEFT)")
    args = parser.parse_args(argv)
    sources = {"base": FolderSource(args.base)}
    for name, path in iter_specs(args.models):
        sources[name] = source_for(path, args.base)
    report = audit(sources, "base", pairwise=args.pairwise)
    if args.out:
        atomic_write_json(args.out, report)
    print(format_audit(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
