"""Select on dev, confirm once on held-out: the records that make a claim confirmatory.

Comparing m checkpoints on a split and keeping the best spends that split on the selection; only a fresh look at
other prompts, made once, tests the choice. The protocol (``launchers.evaluate --role=select`` then
``--confirm=...``):

1. **select** -- evaluate the checkpoints on a FROZEN split (``launchers.import_problems --split``: the problems
   file must be listed, with its sha256, in the ``manifest.json`` beside it). ``<out>/selection.json`` records
   the chosen model (the largest difference to the baseline on ``--select_metric``), its weights' fingerprint,
   the split and the manifest's sha256, and the results it was chosen from (path + sha256), with the
   selection-adjusted (cross-fitted) gain beside the naive one.
2. **confirm** -- evaluate only the baseline and the selected model on ANOTHER split of the SAME manifest.
   Before any sample is drawn, a line is appended to ``<split folder>/confirmations.jsonl`` keyed by (weights
   fingerprint, manifest sha256, split); a second confirmation of the same weights on the same split is refused
   (resuming the same output folder is allowed). The weights the evaluator serves must have the selection's
   fingerprint. The comparison of the selected model with the baseline on the selection metric is the one
   ``confirmatory`` claim in its results.json; every other row of every results file is ``exploratory``.

``<out>/protocol.json`` holds the role of an evaluation folder (written by the launcher; read when results are
written). Without one the role is ``exploratory``.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

from jaxrl.utils.io import atomic_write_json, iter_jsonl, sha256_file
from jaxrl.data import formats

__all__ = ["ProtocolError", "PROTOCOL_FILE", "SELECTION_FILE", "LEDGER_FILE", "ROLES", "split_identity",
           "write_protocol", "read_protocol", "begin_selection", "write_selection", "read_selection", "begin_confirmation",
           "check_fingerprint", "label_claims", "protocol_summary"]

PROTOCOL_FILE = "protocol.json"
SELECTION_FILE = "selection.json"
LEDGER_FILE = "confirmations.jsonl"
SELECTION_FORMAT = "jaxrl.selection/1"
ROLES = ("exploratory", "selection", "confirmation")


class ProtocolError(ValueError):
    """A selection / confirmation that would break the protocol (names the files involved)."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def split_identity(problems: str | os.PathLike) -> Optional[dict]:
    """The frozen split a problems file is, from the ``manifest.json`` beside it (``jaxrl.data.splits``); None
    when the file is not a frozen split. Raises ProtocolError when it is listed but its sha256 changed."""
    path = Path(problems).resolve()
    manifest = path.parent / "manifest.json"
    if not manifest.is_file():
        return None
    try:
        meta = json.loads(manifest.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    if not isinstance(meta, dict) or meta.get("format") != "jaxrl.splits/1":
        return None
    for name, entry in (meta.get("splits") or {}).items():
        if entry.get("file") == path.name:
            sha = sha256_file(path)
            if sha != entry.get("sha256"):
                raise ProtocolError(f"{path}: sha256 {sha} does not match split {name!r} of {manifest} "
                                    f"({entry.get('sha256')}): the split changed after it was frozen")
            return {"manifest": str(manifest), "manifest_sha256": sha256_file(manifest), "split": name,
                    "file": str(path), "sha256": sha, "count": int(entry.get("count", 0)),
                    "split_dir": str(path.parent)}
    return None


def write_protocol(out_dir: str | os.PathLike, protocol: Mapping) -> Path:
    if protocol.get("role") not in ROLES:
        raise ValueError(f"protocol role must be one of {ROLES}, got {protocol.get('role')!r}")
    return atomic_write_json(Path(out_dir) / PROTOCOL_FILE, dict(protocol))


def read_protocol(out_dir: str | os.PathLike) -> Optional[dict]:
    """``<out_dir>/protocol.json``, None when absent (an exploratory evaluation)."""
    return formats.read_diagnostic(Path(out_dir) / PROTOCOL_FILE)


def begin_selection(problems: str | os.PathLike, out_dir: str | os.PathLike,
                    metric: str = "partial_reward_mean") -> dict:
    """Marks ``out_dir`` as a selection evaluation on the frozen split ``problems`` (refused when it is not one);
    after the run, :func:`write_selection` records the choice."""
    split = split_identity(problems)
    if split is None:
        raise ProtocolError(f"{problems}: a selection needs a frozen split (launchers.import_problems --split writes "
                            "it with manifest.json)")
    protocol = {"role": "selection", "split": split, "metric": metric}
    write_protocol(out_dir, protocol)
    return protocol


def write_selection(out_dir: str | os.PathLike, results: Mapping, *, metric: str = "partial_reward_mean",
                    base: Optional[str] = None) -> dict:
    """Records the model chosen on this (dev) evaluation: the largest difference to the baseline on ``metric``.

    ``results``: the evaluation's results.json (with ``protocol.split``, ``models[...].fingerprint`` / ``source``
    and ``selection``). Writes and returns ``<out_dir>/selection.json``.
    """
    out_dir = Path(out_dir)
    split = (results.get("protocol") or {}).get("split")
    if not split:
        raise ProtocolError(f"{out_dir}: selection needs problems from a frozen split (launchers.import_problems "
                            "--split writes one with its manifest.json); this evaluation's problems are not one")
    rows = [c for c in results.get("comparisons", []) if c["metric"] == metric]
    if not rows:
        raise ProtocolError(f"{out_dir}: no comparison on {metric!r} to select with")
    best = max(rows, key=lambda c: c["diff"])
    name = best["model"]
    entry = results["models"][name]
    res_path = out_dir / "results.json"
    sel = (results.get("selection") or {}).get(metric)
    record = {"format": SELECTION_FORMAT, "created": _now(), "metric": metric, "baseline": best["baseline"],
              "rule": f"largest difference to {best['baseline']} on {metric}",
              "model": {"name": name, "step": entry.get("step"), "fingerprint": entry.get("fingerprint"),
                        "adapter_digest": entry.get("adapter_digest"), "source": entry.get("source")},
              "base": base, "n_candidates": len(rows), "split": split,
              "results": {"path": str(res_path.resolve()),
                          "sha256": sha256_file(res_path) if res_path.is_file() else None},
              "naive": {k: best.get(k) for k in ("diff", "ci_low", "ci_high", "simultaneous_ci_low",
                                                 "simultaneous_ci_high", "n_pairs")},
              "cross_fit": (sel or {}).get("cross_fit")}
    atomic_write_json(out_dir / SELECTION_FILE, record)
    return record


def read_selection(path: str | os.PathLike) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / SELECTION_FILE
    rec = formats.read_diagnostic(path)
    if rec is None:
        raise FileNotFoundError(f"{path}: no selection record (evaluate the dev split with --role=select)")
    if rec.get("format") != SELECTION_FORMAT:
        raise ProtocolError(f"{path}: not a {SELECTION_FORMAT} record")
    for key in ("metric", "baseline", "model", "split"):
        if key not in rec:
            raise ProtocolError(f"{path}: missing key {key!r}")
    rec["path"] = str(path.resolve())
    return rec


def begin_confirmation(selection: Mapping, problems: str | os.PathLike, out_dir: str | os.PathLike) -> dict:
    """Checks that ``problems`` may confirm ``selection`` and claims the one confirmation (module docstring);
    writes ``<out_dir>/protocol.json`` and returns it."""
    split = split_identity(problems)
    sel_split = selection["split"]
    if split is None:
        raise ProtocolError(f"{problems}: a confirmation needs a frozen split of {sel_split['manifest']} (this file "
                            "has no manifest.json beside it listing it)")
    if split["manifest_sha256"] != sel_split["manifest_sha256"]:
        raise ProtocolError(f"{problems}: belongs to {split['manifest']} (sha256 {split['manifest_sha256'][:12]}), "
                            f"but the selection was made on a split of {sel_split['manifest']} (sha256 "
                            f"{sel_split['manifest_sha256'][:12]}); confirm on the same manifest's other split")
    if split["split"] == sel_split["split"]:
        raise ProtocolError(f"{problems}: is split {split['split']!r}, the one the model was selected on; confirm on "
                            "another split (held-out)")
    fingerprint = selection["model"].get("fingerprint")
    ledger = Path(split["split_dir"]) / LEDGER_FILE
    out = str(Path(out_dir).resolve())
    prior = []
    if ledger.is_file():
        prior = [e for _, e in iter_jsonl(ledger) if (e.get("fingerprint"), e.get("manifest_sha256"),
                                                      e.get("split")) == (fingerprint, split["manifest_sha256"],
                                                                          split["split"])]
    if prior and not any(e.get("out") == out for e in prior):
        first = prior[0]
        raise ProtocolError(
            f"{ledger}: model {selection['model']['name']!r} (fingerprint {str(fingerprint)[:12]}) was already "
            f"confirmed on split {split['split']!r} at {first.get('started')} (results in {first.get('out')}). A "
            "second look turns the held-out split into a selection split; read that result, or evaluate "
            "elsewhere without --confirm (exploratory)")
    if not prior:
        line = {"fingerprint": fingerprint, "model": selection["model"]["name"],
                "run": (selection["model"].get("source") or {}).get("path"), "manifest_sha256":
                split["manifest_sha256"], "split": split["split"], "out": out, "selection": selection.get("path"),
                "started": _now()}
        ledger.parent.mkdir(parents=True, exist_ok=True)
        with open(ledger, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
    protocol = {"role": "confirmation", "split": split, "ledger": str(ledger),
                "primary": {"model": selection["model"]["name"], "metric": selection["metric"],
                            "baseline": selection["baseline"]},
                "selection": {k: selection.get(k) for k in ("path", "metric", "baseline", "model", "split",
                                                           "naive", "cross_fit", "n_candidates")}}
    write_protocol(out_dir, protocol)
    return protocol


def check_fingerprint(protocol: Mapping, fingerprints: Mapping[str, str]) -> None:
    """The confirmation must score the selected weights: raises ProtocolError when the audit's fingerprint of the
    primary model differs from the selection's."""
    if protocol.get("role") != "confirmation":
        return
    name = protocol["primary"]["model"]
    want = (protocol.get("selection") or {}).get("model", {}).get("fingerprint")
    got = fingerprints.get(name)
    if want and got != want:
        raise ProtocolError(f"model {name!r}: weights fingerprint {str(got)[:12]} differ from the selected ones "
                            f"({want[:12]}, {protocol['selection'].get('path')}); a confirmation must score the "
                            "selected checkpoint itself")


def label_claims(rows: Sequence[dict], protocol: Optional[Mapping]) -> None:
    """Sets every row's ``claim``: ``confirmatory`` only for the primary comparison of a confirmation."""
    primary = (protocol or {}).get("primary") if (protocol or {}).get("role") == "confirmation" else None
    for row in rows:
        is_primary = bool(primary) and (row["model"], row["metric"], row["baseline"]) == (
            primary["model"], primary["metric"], primary["baseline"])
        row["claim"] = "confirmatory" if is_primary else "exploratory"


def protocol_summary(protocol: Optional[Mapping], problems: Optional[str], n_candidates: int) -> tuple[dict, list]:
    """(results.json ``protocol``, warnings) for an evaluation folder's protocol and problems file."""
    warnings: list[str] = []
    proto = dict(protocol or {"role": "exploratory"})
    if "split" not in proto and problems is not None:
        try:
            proto["split"] = split_identity(problems)
        except ProtocolError as e:
            proto["split"] = None
            warnings.append(str(e))
    split = proto.get("split")
    if proto["role"] == "exploratory" and n_candidates >= 2 and split and split.get("split") not in ("dev", "train"):
        warnings.append(f"{n_candidates} models are compared on split {split['split']!r}: choosing among them here "
                        "spends this split on the selection. Select on dev (--role=select) and confirm the choice "
                        "once here (--confirm=DEV_OUT/selection.json) for a confirmatory claim")
    return proto, warnings
