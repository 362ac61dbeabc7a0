"""Frozen dev / held-out splits with a manifest that proves a split unchanged.

Assignment is per problem id: ``sha256(f"{seed}:{id}")`` read as a number in [0, 1) against the cumulative
fractions. A problem's split therefore never depends on which other problems are in the file: adding data later
does not move anything between dev and held-out.

``freeze_splits`` writes ``<name>.jsonl`` for each split and ``manifest.json``::

    {"format": "jaxrl.splits/1", "seed": 0, "fractions": {"dev": 0.5, "heldout": 0.5},
     "method": "sha256(seed:id) thresholds", "source": {"path": ..., "sha256": ...},
     "splits": {"dev": {"file": "dev.jsonl", "count": 12, "sha256": "...", "ids": [...]}, ...}}

All files are written atomically. Freezing again into the same folder must reproduce identical splits
(or pass ``overwrite=True``); ``load_split`` re-hashes the file and checks ids before returning problems.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

from jaxrl.data.problems import Problem, load_problems, problems_jsonl_bytes
from jaxrl.utils.dataclass_flags import flag_field
from jaxrl.utils.seeds import seed_field
from jaxrl.utils.io import atomic_write_bytes, sha256_file

MANIFEST = "manifest.json"
FORMAT = "jaxrl.splits/1"
DEFAULT_FRACTIONS = {"dev": 0.5, "heldout": 0.5}


@dataclasses.dataclass(frozen=True)
class SplitSettings:
    """The dev / held-out splits launchers.import_problems freezes of what it imported (its fields are the
    launcher's flags, jaxrl.utils.dataclass_flags)."""

    split: bool = flag_field(False, help="Also freeze dev / held-out splits of the imported problems.")
    split_dir: Optional[str] = flag_field(None, help="Folder for the splits and manifest.json (default: next to "
                                          "--output).")
    dev_fraction: float = flag_field(DEFAULT_FRACTIONS["dev"], help="Fraction of problems in the dev split; the rest "
                                     "is held out.")
    seed: int = seed_field(0, help="Seed of the split assignment.")

    def fractions(self) -> dict[str, float]:
        """The fractions of `plan_splits`: dev, and the rest held out."""
        return {"dev": self.dev_fraction, "heldout": 1.0 - self.dev_fraction}


class SplitIntegrityError(RuntimeError):
    """A frozen split on disk no longer matches its manifest (or a re-freeze would change it)."""


def _unit_interval(seed: int, problem_id: str) -> float:
    digest = hashlib.sha256(f"{seed}:{problem_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_split(problem_id: str, seed: int, fractions: Mapping[str, float]) -> str:
    point = _unit_interval(seed, problem_id)
    cumulative = 0.0
    names = list(fractions)
    for name in names:
        cumulative += fractions[name]
        if point < cumulative:
            return name
    return names[-1]  # rounding at the very top of the interval


def _check_fractions(fractions: Mapping[str, float]) -> None:
    if not fractions:
        raise ValueError("need at least one split")
    if any(f < 0 for f in fractions.values()) or abs(sum(fractions.values()) - 1.0) > 1e-9:
        raise ValueError(f"split fractions must be >= 0 and sum to 1, got {dict(fractions)}")
    for name in fractions:
        if not name or "/" in name or name.startswith(".") or name == Path(MANIFEST).stem:
            raise ValueError(f"bad split name {name!r}")


def freeze_splits(problems: Sequence[Problem], out_dir: str | os.PathLike,
                  fractions: Mapping[str, float] = DEFAULT_FRACTIONS, seed: int = SplitSettings.seed,
                  source_path: str | os.PathLike | None = None, overwrite: bool = False) -> dict:
    """Split problems by id, write one JSONL per split plus the manifest; return the manifest."""
    manifest, payloads = plan_splits(problems, fractions, seed, source_path)
    check_splits(out_dir, manifest, overwrite)
    return write_splits(out_dir, manifest, payloads)


def plan_splits(problems: Sequence[Problem], fractions: Mapping[str, float] = DEFAULT_FRACTIONS,
                seed: int = SplitSettings.seed,
                source_path: str | os.PathLike | None = None, source_sha256: str | None = None
                ) -> tuple[dict, dict[str, bytes]]:
    """(manifest, {split: file bytes}) of the splits `freeze_splits` would write; writes nothing. The source's
    sha256 is `source_sha256`, else that of the file at `source_path`."""
    _check_fractions(fractions)
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError("problem ids must be unique to split them")
    members: dict[str, list[Problem]] = {name: [] for name in fractions}
    for problem in sorted(problems, key=lambda p: p.id):  # file order independent of input order
        members[assign_split(problem.id, seed, fractions)].append(problem)
    payloads = {name: problems_jsonl_bytes(group) for name, group in members.items()}
    source = None
    if source_path:
        source = {"path": str(source_path), "sha256": source_sha256 or sha256_file(source_path)}
    manifest = {
        "format": FORMAT,
        "seed": seed,
        "fractions": dict(fractions),
        "method": "sha256(seed:id) thresholds",
        "source": source,
        "splits": {name: {"file": f"{name}.jsonl", "count": len(members[name]),
                          "sha256": hashlib.sha256(payloads[name]).hexdigest(),
                          "ids": [p.id for p in members[name]]} for name in fractions},
    }
    return manifest, payloads


def check_splits(out_dir: str | os.PathLike, manifest: Mapping, overwrite: bool = False) -> None:
    """SplitIntegrityError when `out_dir` holds frozen splits that `manifest` would change (and not
    `overwrite`)."""
    existing = Path(out_dir) / MANIFEST
    if existing.exists() and not overwrite:
        try:
            old = json.loads(existing.read_text())
        except ValueError as e:
            raise SplitIntegrityError(f"{existing}: unreadable manifest ({e}); pass --overwrite to replace "
                                      "it") from None
        if old.get("splits") != manifest["splits"]:
            changed = [n for n in set(old.get("splits", {})) | set(manifest["splits"])
                       if old.get("splits", {}).get(n) != manifest["splits"].get(n)]
            raise SplitIntegrityError(f"{existing}: frozen splits {sorted(changed)} would change; "
                                      "pass overwrite=True (--overwrite) to replace them deliberately")


def write_splits(out_dir: str | os.PathLike, manifest: Mapping, payloads: Mapping[str, bytes]) -> dict:
    """Writes the split files, then the manifest (each atomically); returns the manifest."""
    out_dir = Path(out_dir)
    for name, payload in payloads.items():
        atomic_write_bytes(out_dir / f"{name}.jsonl", payload)
    atomic_write_bytes(out_dir / MANIFEST, (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode())
    return dict(manifest)


def read_manifest(split_dir: str | os.PathLike) -> dict:
    path = Path(split_dir) / MANIFEST
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise SplitIntegrityError(f"{path}: not a {FORMAT} manifest")
    return manifest


def verify_split(split_dir: str | os.PathLike, name: str) -> None:
    """Raise SplitIntegrityError unless ``<name>.jsonl`` has the manifest's sha256 and ids."""
    manifest = read_manifest(split_dir)
    if name not in manifest["splits"]:
        raise KeyError(f"no split {name!r} in {Path(split_dir) / MANIFEST}; have {sorted(manifest['splits'])}")
    entry = manifest["splits"][name]
    path = Path(split_dir) / entry["file"]
    actual = sha256_file(path)
    if actual != entry["sha256"]:
        raise SplitIntegrityError(f"{path}: sha256 {actual} != manifest {entry['sha256']}: the split changed")


def load_split(split_dir: str | os.PathLike, name: str) -> list[Problem]:
    """The problems of a frozen split, after proving the file unchanged."""
    verify_split(split_dir, name)
    entry = read_manifest(split_dir)["splits"][name]
    problems = load_problems(Path(split_dir) / entry["file"])
    if [p.id for p in problems] != entry["ids"]:
        raise SplitIntegrityError(f"{split_dir}/{entry['file']}: ids differ from the manifest")
    return problems
