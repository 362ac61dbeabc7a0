"""Paired generation diffs: two models on the same prompts, the samples whose reward changed, side by side.

Samples pair up by ``(problem_id, sample_index)`` (with one deterministic rollout a prompt this is the same
prompt; with several samples it pairs draw i with draw i). Each changed sample gets a heuristic tag:

* ``termination``: the finish reason changed (one hit the cap, the other stopped), or the extracted code is the
  same but the completion length changed more than ``length_ratio`` (2x) -- the model changed when it stops;
* ``format``: one side has runnable code and the other has none (no closed code block, an open think block);
* ``answer``: neither side has code (a non-code reward such as the toy ones): the answers themselves differ;
* ``same_code``: the same program (after normalising identifiers) scored differently: a flaky test or timeout;
* ``algorithm``: the programs differ substantially (normalised-token similarity < ``similarity_threshold``);
* ``code_edit``: the programs are similar but not equal (a small fix or a small bug: same approach).

Code comes from ``jaxrl.rewards.extract.extract_code`` (what the verifier runs). Each change also gets its
``contribution`` to the difference in mean partial reward (per prompt first, then over prompts, as
``model_metrics``): ``delta / (n_prompts * samples of that prompt)``, so contributions add up to the metric's
difference and ``summary.by_tag[tag].net_delta`` says how much of a gain each kind of change explains.

Output (``diff.json``)::

    {"model_a", "model_b", "similarity_threshold",
     "summary": {"n_compared", "n_prompts", "only_in_a", "only_in_b", "n_changed", "n_prompts_changed",
                 "improved", "worsened", "mean_partial_a", "mean_partial_b", "mean_partial_diff",
                 "by_tag": {TAG: {"n", "improved", "worsened", "net_delta", "abs_delta"}}},
     "changes": [{"problem_id", "sample_index", "tag", "similarity", "reward_a", "reward_b", "delta",
                  "contribution", "strict_a", "strict_b", "finish_a", "finish_b", "tokens_a", "tokens_b",
                  "has_code_a", "has_code_b", "reason_a", "reason_b",
                  "text_a", "text_b", "code_a", "code_b"}, ...],   # by |delta|; texts trimmed, only for the
                                                                   # first max_examples changes
     "flags": [...]}
"""

from __future__ import annotations

import builtins
import difflib
import io
import keyword
import re
import tokenize
from typing import Mapping, Optional, Sequence

from jaxrl.diagnostics import red_flags
from jaxrl.diagnostics.flags import DiagnoseSettings
from jaxrl.rewards.extract import extract_code

__all__ = ["TAGS", "normalized_tokens", "code_similarity", "tag_change", "diff_generations", "trim_text"]

TAGS = ("termination", "format", "answer", "algorithm", "code_edit", "same_code")
_KEEP_NAMES = frozenset(keyword.kwlist) | frozenset(dir(builtins))
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}


def normalized_tokens(code: str) -> list[str]:
    """Python tokens with user identifiers -> ``ID`` and string literals -> ``STR``; comments and blank lines
    dropped. Renaming a variable does not change the result; changing the algorithm does. Falls back to a
    regex split when the code does not tokenize (e.g. broken indentation)."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type in _SKIP:
                continue
            if tok.type == tokenize.NAME:
                out.append(tok.string if tok.string in _KEEP_NAMES else "ID")
            elif tok.type == tokenize.STRING:
                out.append("STR")
            elif tok.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                out.append(tokenize.tok_name[tok.type])
            else:
                out.append(tok.string)
        return out
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [t if (t in _KEEP_NAMES or not t[0].isalpha()) else "ID" for t in re.findall(r"\w+|[^\w\s]", code)]


def code_similarity(a: str, b: str) -> float:
    """Similarity in [0, 1] of two programs' normalised token sequences (difflib ratio; 1.0 = same code)."""
    ta, tb = normalized_tokens(a), normalized_tokens(b)
    if ta == tb:
        return 1.0
    return difflib.SequenceMatcher(None, ta, tb, autojunk=False).ratio()


def tag_change(a: Mapping, b: Mapping, *, similarity_threshold: float = DiagnoseSettings.similarity_threshold,
               length_ratio: float = 2.0) -> tuple[str, Optional[float], Optional[str], Optional[str]]:
    """(tag, similarity or None, code of a, code of b) for two SAMPLES records of the same prompt."""
    code_a, code_b = extract_code(a["completion"]).code, extract_code(b["completion"]).code
    if a["finish_reason"] != b["finish_reason"]:
        sim = code_similarity(code_a, code_b) if code_a is not None and code_b is not None else None
        return "termination", sim, code_a, code_b
    if code_a is None and code_b is None:
        return "answer", None, code_a, code_b
    if (code_a is None) != (code_b is None):
        return "format", None, code_a, code_b
    sim = code_similarity(code_a, code_b)
    if sim == 1.0:
        ta, tb = max(1, a["completion_tokens"]), max(1, b["completion_tokens"])
        if max(ta, tb) / min(ta, tb) > length_ratio:
            return "termination", sim, code_a, code_b
        return "same_code", sim, code_a, code_b
    return ("algorithm" if sim < similarity_threshold else "code_edit"), sim, code_a, code_b


def trim_text(text: Optional[str], max_chars: int = 1200) -> Optional[str]:
    """Head and tail of a long text with the number of characters left out in between."""
    if text is None or len(text) <= max_chars:
        return text
    head = max_chars * 2 // 3
    tail = max_chars - head
    return f"{text[:head]}\n[... {len(text) - head - tail} characters omitted ...]\n{text[-tail:]}"


def _index(records: Sequence[Mapping], name: str) -> dict[tuple[str, int], Mapping]:
    out = {}
    for i, r in enumerate(records):
        key = (str(r["problem_id"]), int(r["sample_index"]))
        if key in out:
            raise ValueError(f"{name}: record {i} repeats sample {key}")
        out[key] = r
    return out


def diff_generations(samples_a: Sequence[Mapping], samples_b: Sequence[Mapping], *, name_a: str = "a",
                     name_b: str = "b", similarity_threshold: float = DiagnoseSettings.similarity_threshold,
                     length_ratio: float = 2.0,
                     max_examples: int = 30, max_chars: int = 1200, tol: float = 1e-9) -> dict:
    """Changed samples between two models' SAMPLES records (module docstring for the output and the tags).

    Only samples present in both are compared (``only_in_a`` / ``only_in_b`` count the rest). A sample changed
    when its partial reward moved by more than ``tol`` or its strict outcome flipped.
    """
    ia, ib = _index(samples_a, name_a), _index(samples_b, name_b)
    keys = [k for k in ia if k in ib]
    if not keys:
        raise ValueError(f"{name_a} and {name_b} share no (problem_id, sample_index): not the same prompts")
    per_prompt_n: dict[str, int] = {}
    for pid, _ in keys:
        per_prompt_n[pid] = per_prompt_n.get(pid, 0) + 1
    n_prompts = len(per_prompt_n)
    by_tag = {t: {"n": 0, "improved": 0, "worsened": 0, "net_delta": 0.0, "abs_delta": 0.0} for t in TAGS}
    changes, prompts_changed = [], set()
    mean_a = sum(ia[k]["partial"] / per_prompt_n[k[0]] for k in keys) / n_prompts
    mean_b = sum(ib[k]["partial"] / per_prompt_n[k[0]] for k in keys) / n_prompts
    for key in keys:
        a, b = ia[key], ib[key]
        delta = float(b["partial"]) - float(a["partial"])
        if abs(delta) <= tol and bool(a["strict"]) == bool(b["strict"]):
            continue
        tag, sim, code_a, code_b = tag_change(a, b, similarity_threshold=similarity_threshold,
                                              length_ratio=length_ratio)
        contribution = delta / (n_prompts * per_prompt_n[key[0]])
        t = by_tag[tag]
        t["n"] += 1
        if delta > 0:
            t["improved"] += 1
        elif delta < 0:
            t["worsened"] += 1
        t["net_delta"] += contribution
        t["abs_delta"] += abs(contribution)
        prompts_changed.add(key[0])
        changes.append({
            "problem_id": key[0], "sample_index": key[1], "tag": tag, "similarity": sim,
            "reward_a": a["partial"], "reward_b": b["partial"], "delta": delta, "contribution": contribution,
            "strict_a": bool(a["strict"]), "strict_b": bool(b["strict"]),
            "finish_a": a["finish_reason"], "finish_b": b["finish_reason"],
            "tokens_a": a["completion_tokens"], "tokens_b": b["completion_tokens"],
            "has_code_a": code_a is not None, "has_code_b": code_b is not None,
            "reason_a": a.get("reason"), "reason_b": b.get("reason"),
            "_texts": (a["completion"], b["completion"], code_a, code_b)})
    changes.sort(key=lambda c: (-abs(c["delta"]), c["problem_id"], c["sample_index"]))
    for i, c in enumerate(changes):
        ta, tb, ca, cb = c.pop("_texts")
        keep = i < max_examples
        c.update(text_a=trim_text(ta, max_chars) if keep else None, text_b=trim_text(tb, max_chars) if keep else None,
                 code_a=trim_text(ca, max_chars) if keep else None, code_b=trim_text(cb, max_chars) if keep else None)
    summary = {
        "n_compared": len(keys), "n_prompts": n_prompts,
        "only_in_a": len(ia) - len(keys), "only_in_b": len(ib) - len(keys),
        "n_changed": len(changes), "n_prompts_changed": len(prompts_changed),
        "improved": sum(1 for c in changes if c["delta"] > 0), "worsened": sum(1 for c in changes if c["delta"] < 0),
        "mean_partial_a": mean_a, "mean_partial_b": mean_b, "mean_partial_diff": mean_b - mean_a,
        "by_tag": by_tag,
    }
    out = {"model_a": name_a, "model_b": name_b, "similarity_threshold": similarity_threshold,
           "summary": summary, "changes": changes}
    flag = red_flags.termination_only_change(out)
    out["flags"] = [flag.to_dict()] if flag else []
    return out
