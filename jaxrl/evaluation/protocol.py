"""Select on dev, confirm once on held-out: the records that make a claim confirmatory.

Comparing m checkpoints on a split and keeping the best spends that split on the selection; only a fresh look at
other prompts, made once, tests the choice. The protocol (``launchers.evaluate --role=select`` then
``--confirm=...``):

1. **select** -- evaluate the checkpoints on a FROZEN split (``launchers.import_problems --split``: the problems
   file must be listed, with its sha256, in the ``manifest.json`` beside it). ``<out>/selection.json`` records
   the chosen model (the largest difference to the baseline on ``--select_metric``), its weights' fingerprint,
   the split and the manifest's sha256, and the results it was chosen from (path + sha256), with the
   selection-adjusted (cross-fitted) gain beside the naive one.
   selection.json also records the evaluation settings the choice was made with (``evaluation``: reward and its
   options, the caps, dtype, sampling, seed; ``SELECTION_SETTINGS``) and the base folder (``base``).
2. **confirm** -- evaluate only the baseline and the selected model on ANOTHER split of the SAME manifest, with
   the selection's settings (``confirmation_settings``: a setting given otherwise is refused before any work, by
   the launcher's flags and again by :func:`begin_confirmation`). Before any sample is drawn, a line is appended
   to ``<split folder>/confirmations.jsonl`` keyed by (weights fingerprint, manifest sha256, split); a second
   confirmation of the same weights on the same split is refused (resuming the same output folder is allowed).
   The weights the evaluator serves must have the selection's fingerprint. The comparison of the selected model
   with the baseline on the selection metric is the one ``confirmatory`` claim in its results.json; every other
   row of every results file is ``exploratory``.
3. **withdraw** (a confirmation run by mistake, ``launchers.evaluate --withdraw=OUT --reason=...``): a
   ``withdrawn`` line is appended to the ledger (the confirmation's line stays), ``OUT/protocol.json`` and
   ``OUT/results.json`` are marked withdrawn (the claim becomes ``exploratory``, with the reason), and the same
   weights may be confirmed again on the split -- that confirmation's results say that an earlier one was
   withdrawn. Nothing is deleted.

A confirmation is written once: ``--overwrite`` into a folder that holds one (withdrawn or not) is refused
(:func:`refuse_overwrite`), naming that confirmation and, while it stands, the ``--withdraw`` command; a rerun
without it only resumes the same look (the runner refuses other models or prompts).

``<out>/protocol.json`` holds the role of an evaluation folder (written by the launcher; read when results are
written). Without one the role is ``exploratory``.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

from jaxrl.utils.io import append_whole, atomic_write_json, atomic_write_text, iter_jsonl, sha256_file
from jaxrl.data import formats

__all__ = ["ProtocolError", "PROTOCOL_FILE", "SELECTION_FILE", "SELECTION_SETTINGS", "LEDGER_FILE", "ROLES",
           "split_identity", "write_protocol", "read_protocol", "begin_selection", "write_selection", "read_selection",
           "confirmation_settings", "begin_confirmation", "check_fingerprint", "label_claims", "protocol_summary",
           "withdraw_confirmation", "refuse_overwrite"]

PROTOCOL_FILE = "protocol.json"
SELECTION_FILE = "selection.json"
LEDGER_FILE = "confirmations.jsonl"
SELECTION_FORMAT = "jaxrl.selection/1"
ROLES = ("exploratory", "selection", "confirmation")
# The evaluation settings a confirmation takes from its selection (results.json["evaluation"] keys): the reward
# and its options, the caps, the dtype, the sampling and its seed. (The base folder is the selection's too, unless
# given: the same weights may lie elsewhere, and the fingerprint check refuses other ones.)
SELECTION_SETTINGS = ("reward", "reward_kwargs", "max_new_tokens", "max_prompt_len", "on_overlong", "dtype",
                      "num_samples", "temperature", "top_p", "top_k", "enable_thinking", "seed",
                      # episodes (recorded only by evaluations over episodes: absent keys are not compared)
                      "environment", "environment_options", "max_turns", "max_episode_tokens")


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
    """Records the model chosen on this (dev) evaluation: the largest difference to the baseline on ``metric``,
    among the candidates (a reference row is never one).

    ``results``: the evaluation's results.json (with ``protocol.split``, ``models[...].fingerprint`` / ``source``
    and ``selection``). Writes and returns ``<out_dir>/selection.json``.
    """
    out_dir = Path(out_dir)
    split = (results.get("protocol") or {}).get("split")
    if not split:
        raise ProtocolError(f"{out_dir}: selection needs problems from a frozen split (launchers.import_problems "
                            "--split writes one with its manifest.json); this evaluation's problems are not one")
    # reference rows (a distillation's teacher, --references) are shown beside the candidates, never selected
    rows = [c for c in results.get("comparisons", []) if c["metric"] == metric and not c.get("reference")]
    if not rows:
        raise ProtocolError(f"{out_dir}: no comparison of a candidate on {metric!r} to select with")
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
              "evaluation": _settings_of(results),
              "results": {"path": str(res_path.resolve()),
                          "sha256": sha256_file(res_path) if res_path.is_file() else None},
              "naive": {k: best.get(k) for k in ("diff", "ci_low", "ci_high", "simultaneous_ci_low",
                                                 "simultaneous_ci_high", "n_pairs")},
              "cross_fit": (sel or {}).get("cross_fit")}
    atomic_write_json(out_dir / SELECTION_FILE, record)
    return record


def _settings_of(results: Mapping) -> dict:
    """The SELECTION_SETTINGS of a results.json (the cap also from its top level, where older files keep it)."""
    ev = dict(results.get("evaluation") or {})
    ev.setdefault("max_new_tokens", results.get("max_new_tokens"))
    return {k: ev.get(k) for k in SELECTION_SETTINGS if ev.get(k) is not None}


def confirmation_settings(selection: Mapping) -> dict:
    """The evaluation settings a confirmation of `selection` must use: those the selection recorded, else those of
    the results file it was chosen from. ProtocolError when neither is readable."""
    settings = selection.get("evaluation")
    if not settings:
        path = (selection.get("results") or {}).get("path")
        if not path or not os.path.isfile(path):
            raise ProtocolError(f"{selection.get('path')}: records no evaluation settings and its results file "
                                f"{path} is gone; select again (--role=select) to confirm with known settings")
        settings = _settings_of(formats.read_results(path))
    return {k: settings[k] for k in SELECTION_SETTINGS if k in settings}


def settings_conflicts(selection: Mapping, settings: Mapping) -> list[str]:
    """`key: selected -> given` for each setting of `settings` that differs from what a confirmation of `selection`
    must use (keys the selection does not record are not compared)."""
    want = confirmation_settings(selection)
    return [f"{k}: {want[k]!r} -> {settings.get(k)!r}" for k in SELECTION_SETTINGS
            if k in want and k in settings and _norm(settings[k]) != _norm(want[k])]


def _norm(value):
    """Compared as JSON holds them (tuples as lists)."""
    return json.loads(json.dumps(value))


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


def begin_confirmation(selection: Mapping, problems: str | os.PathLike, out_dir: str | os.PathLike,
                       settings: Optional[Mapping] = None) -> dict:
    """Checks that ``problems`` may confirm ``selection`` and claims the one confirmation (module docstring);
    writes ``<out_dir>/protocol.json`` and returns it. ``settings``: the evaluation's (results.json "evaluation"
    keys), refused when they differ from the selection's (``settings_conflicts``); None = not checked here."""
    if settings is not None:
        conflicts = settings_conflicts(selection, settings)
        if conflicts:
            raise ProtocolError(f"{selection['path']}: the confirmation would evaluate with other settings than the "
                                f"selection ({'; '.join(conflicts)}); confirm with the selection's settings")
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
    key = (fingerprint, split["manifest_sha256"], split["split"])
    entries = [e for _, e in iter_jsonl(ledger) if _ledger_key(e) == key] if ledger.is_file() else []
    withdrawn = {e.get("out") for e in entries if e.get("withdrawn")}
    claims = [e for e in entries if not e.get("withdrawn")]
    if out in withdrawn:
        raise ProtocolError(f"{out}: holds a withdrawn confirmation ({ledger}); confirm into another --out")
    prior = [e for e in claims if e.get("out") not in withdrawn]
    if prior and not any(e.get("out") == out for e in prior):
        first = prior[0]
        raise ProtocolError(
            f"{ledger}: model {selection['model']['name']!r} (fingerprint {str(fingerprint)[:12]}) was already "
            f"confirmed on split {split['split']!r} at {first.get('started')} (results in {first.get('out')}). A "
            "second look turns the held-out split into a selection split; read that result, or evaluate "
            "elsewhere without --confirm (exploratory). A confirmation run by mistake (e.g. with other settings) "
            f"can be withdrawn: python -m launchers.evaluate --withdraw={first.get('out')} --reason='...'")
    earlier = [{k: e.get(k) for k in ("out", "started", "reason", "withdrawn_at")} for e in entries
               if e.get("withdrawn")]
    if not prior:
        line = {"fingerprint": fingerprint, "model": selection["model"]["name"],
                "run": (selection["model"].get("source") or {}).get("path"), "manifest_sha256":
                split["manifest_sha256"], "split": split["split"], "out": out, "selection": selection.get("path"),
                "started": _now()}
        if earlier:
            line["after_withdrawn"] = [e["out"] for e in earlier]
        _append_line(ledger, line)
    protocol = {"role": "confirmation", "split": split, "ledger": str(ledger),
                "primary": {"model": selection["model"]["name"], "metric": selection["metric"],
                            "baseline": selection["baseline"]},
                "selection": {k: selection.get(k) for k in ("path", "metric", "baseline", "model", "split",
                                                           "naive", "cross_fit", "n_candidates", "evaluation")}}
    if earlier:
        protocol["after_withdrawn"] = earlier
    write_protocol(out_dir, protocol)
    return protocol


def _ledger_key(entry: Mapping) -> tuple:
    return entry.get("fingerprint"), entry.get("manifest_sha256"), entry.get("split")


def _append_line(ledger: Path, line: Mapping) -> None:
    """One ledger line, whole and fsync'ed (the ledger is append-only: nothing in it is ever rewritten)."""
    ledger.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        append_whole(fd, (json.dumps(line, sort_keys=True) + "\n").encode("utf-8"), ledger)
        os.fsync(fd)
    finally:
        os.close(fd)


def withdraw_confirmation(out_dir: str | os.PathLike, reason: str) -> dict:
    """Withdraws the confirmation in ``out_dir`` (module docstring, step 3); returns its withdrawal record.
    ProtocolError when ``out_dir`` holds no confirmation, or one already withdrawn; ValueError without a
    reason."""
    out = Path(out_dir).resolve()
    if not reason.strip():
        raise ValueError("--reason is required with --withdraw: say why the confirmation is withdrawn (it is kept "
                         "in the ledger with it)")
    proto = read_protocol(out)
    if (proto or {}).get("role") != "confirmation":
        raise ProtocolError(f"{out / PROTOCOL_FILE}: not a confirmation (role {(proto or {}).get('role')!r}); "
                            "--withdraw takes the --out of an evaluation run with --confirm")
    if proto.get("withdrawn"):
        raise ProtocolError(f"{out}: the confirmation was already withdrawn at {proto['withdrawn']['at']} "
                            f"({proto['withdrawn']['reason']})")
    split, model = proto["split"], proto["selection"]["model"]
    record = {"at": _now(), "reason": reason.strip()}
    _append_line(Path(proto["ledger"]), {
        "withdrawn": True, "fingerprint": model.get("fingerprint"), "model": model.get("name"),
        "manifest_sha256": split["manifest_sha256"], "split": split["split"], "out": str(out),
        "withdrawn_at": record["at"], "reason": record["reason"]})
    proto["withdrawn"] = record
    write_protocol(out, proto)
    results_path = out / formats.RESULTS_FILE
    if results_path.is_file():
        results = json.loads(results_path.read_text(encoding="utf-8"))
        results["protocol"] = {**(results.get("protocol") or {}), "withdrawn": record}
        label_claims(results.get("comparisons", []), proto)
        atomic_write_json(results_path, results)
        md = out / "results.md"
        if md.is_file():
            atomic_write_text(md, f"> **Withdrawn** confirmation ({record['at']}): {record['reason']}. Its "
                                  "comparison is exploratory.\n\n" + md.read_text(encoding="utf-8"))
    return record


def refuse_overwrite(out_dir: str | os.PathLike) -> None:
    """ProtocolError when ``out_dir`` holds a confirmation: ``--overwrite`` would replace the one look at its split
    with a second one under the same label (e.g. a --limit=10 result by a --limit=20 one), and the ledger, keyed by
    model and split, would not show it. A standing confirmation may be withdrawn (kept on the record) and the model
    confirmed again into another folder; a withdrawn one is itself the record of that look."""
    out = Path(out_dir).resolve()
    proto = read_protocol(out)
    if (proto or {}).get("role") != "confirmation":
        return
    model = (proto.get("primary") or {}).get("model")
    split = (proto.get("split") or {}).get("split")
    if proto.get("withdrawn"):
        raise ProtocolError(f"{out}: holds the confirmation of {model!r} on split {split!r} withdrawn at "
                            f"{proto['withdrawn']['at']} ({proto['withdrawn']['reason']}); it stays on the record, "
                            "so --overwrite is refused: evaluate into another --out")
    ledger = Path(proto["ledger"])
    started = next((e.get("started") for _, e in (iter_jsonl(ledger) if ledger.is_file() else [])
                    if e.get("out") == str(out) and not e.get("withdrawn")), None)
    raise ProtocolError(f"{out}: holds the confirmation of {model!r} on split {split!r} (started {started}, "
                        f"{ledger}); --overwrite would replace the one look at that split. Read that result, or "
                        f"withdraw it (python -m launchers.evaluate --withdraw={out} --reason='...') and confirm "
                        "again into another --out")


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
    """Sets every row's ``claim``: ``confirmatory`` only for the primary comparison of a confirmation that was not
    withdrawn (a withdrawn one's row is ``exploratory`` with ``withdrawn``: the reason)."""
    protocol = protocol or {}
    primary = protocol.get("primary") if protocol.get("role") == "confirmation" else None
    withdrawn = protocol.get("withdrawn")
    for row in rows:
        is_primary = bool(primary) and (row["model"], row["metric"], row["baseline"]) == (
            primary["model"], primary["metric"], primary["baseline"])
        row["claim"] = "confirmatory" if is_primary and not withdrawn else "exploratory"
        if is_primary and withdrawn:
            row["withdrawn"] = withdrawn["reason"]


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
    for earlier in proto.get("after_withdrawn") or []:
        warnings.append(f"an earlier confirmation of this model on this split ({earlier['out']}) was withdrawn "
                        f"({earlier.get('reason')}): this split was looked at before this confirmation")
    if proto.get("withdrawn"):
        warnings.append(f"this confirmation was withdrawn ({proto['withdrawn']['reason']}): its comparison is "
                        "exploratory")
    if proto["role"] == "exploratory" and n_candidates >= 2 and split and split.get("split") not in ("dev", "train"):
        warnings.append(f"{n_candidates} models are compared on split {split['split']!r}: choosing among them here "
                        "spends this split on the selection. Select on dev (--role=select) and confirm the choice "
                        "once here (--confirm=DEV_OUT/selection.json) for a confirmatory claim")
    return proto, warnings
