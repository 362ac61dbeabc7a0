"""results.json and results.md: the evaluation's files (schema: jaxrl/data/formats.py RESULTS).

``write_results`` writes both atomically; ``format_results_md`` renders the human-readable page from a
results.json dict: warnings, models (each mean with its interval and sample size), comparisons (marginal and
simultaneous intervals, the test, the claim), the selection (naive vs selection-adjusted gain), censoring
(bounds, finish / quality split, finished-only and extended-cap comparisons), power (the smallest effect these
prompts can detect) and the protocol. Every number carries its sample size; every comparison its interval.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from jaxrl.utils.io import atomic_write_json, atomic_write_text

__all__ = ["truncation_warning", "format_results_md", "write_results", "fmt_pp"]

_MODEL_KEYS = ("partial_reward_mean", "strict_rate", "truncation_rate", "mean_completion_tokens", "pass_at_k",
               "n_prompts", "n_samples")
_COMPARISON_KEYS = ("model", "baseline", "metric", "diff", "ci_low", "ci_high", "n_pairs")


def truncation_warning(rate: Optional[float], threshold: float = 0.10,
                       max_new_tokens: Optional[int] = None) -> Optional[str]:
    """A warning when more than ``threshold`` of completions hit the cap, else None.

    ``truncation_warning(0.45, max_new_tokens=8192)`` ->
    ``"truncation 45%: numbers are censored by the 8192-token cap"``.
    """
    if rate is None or not rate > threshold:
        return None
    cap = f"the {int(max_new_tokens)}-token cap" if max_new_tokens else "the generation cap"
    return f"truncation {rate:.0%}: numbers are censored by {cap}"


def _fmt(x, spec: str = ".4f") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)) and not spec.startswith("+"):
        return str(int(x))
    return format(float(x), spec)


def _is_rate(metric: str) -> bool:
    return not metric.endswith("_tokens")


def fmt_pp(metric: str, v) -> str:
    """A difference in percentage points for rates, in tokens otherwise."""
    if v is None:
        return "–"
    return f"{100 * v:+.2f} pp" if _is_rate(metric) else f"{v:+.1f} tokens"


def _iv(metric: str, lo, hi) -> str:
    if lo is None or hi is None:
        return "–"
    if _is_rate(metric):
        return f"[{100 * lo:+.2f}, {100 * hi:+.2f}] pp"
    return f"[{lo:+.1f}, {hi:+.1f}]"


def _p(p) -> str:
    return "–" if p is None else f"{p:.3g}"


def _value_ci(m: Mapping, key: str) -> str:
    v = _fmt(m.get(key))
    iv = (m.get("intervals") or {}).get(key)
    return v if not iv else f"{v} [{iv[0]:.3f}, {iv[1]:.3f}]"


def _models_md(results: Mapping) -> list[str]:
    models = results["models"]
    ks = sorted({k for m in models.values() for k in m.get("pass_at_k", {})}, key=int)
    conf = next((m["intervals"]["confidence"] for m in models.values() if m.get("intervals")), None)
    lines = ["## Models", "",
             "Means are per prompt first (over a prompt's samples), then over prompts"
             + (f"; brackets: {conf:.0%} interval over prompts." if conf else "."),
             "The untruncated columns average each model's own finished samples (different prompts per model); "
             "the paired finished-only comparison is under Censoring.", ""]
    head = (["model", "prompts", "samples", "partial_reward_mean", "strict_rate"] + [f"pass@{k}" for k in ks]
            + ["truncation_rate", "mean_completion_tokens", "untruncated partial_reward_mean",
               "untruncated strict_rate", "untruncated prompts / samples"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in models.items():
        u = m.get("untruncated") or {}
        pk = (m.get("intervals") or {}).get("pass_at_k", {})
        cells = ([name + (" (reference)" if m.get("reference") else ""), _fmt(m["n_prompts"]), _fmt(m["n_samples"]),
                  _value_ci(m, "partial_reward_mean"),
                  _value_ci(m, "strict_rate")]
                 + [_fmt(m["pass_at_k"].get(k)) + (f" [{pk[k][0]:.3f}, {pk[k][1]:.3f}]" if k in pk else "")
                    for k in ks]
                 + [_value_ci(m, "truncation_rate"), _fmt(m["mean_completion_tokens"], ".1f"),
                    _fmt(u.get("partial_reward_mean")), _fmt(u.get("strict_rate")),
                    f"{_fmt(u.get('n_prompts'))} / {_fmt(u.get('n_samples'))}" if u else "–"])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _comparisons_md(results: Mapping) -> list[str]:
    comps = results.get("comparisons") or []
    if not comps:
        return []
    fam = results.get("family") or {}
    size = fam.get("size") or comps[0].get("family_size")
    conf = comps[0].get("confidence")
    conf_txt = f"{conf:.0%} " if conf else ""
    lines = ["", "## Comparisons (model - baseline, paired over prompts)", "",
             f"Each {conf_txt}interval comes from the same test as its p-value (`test`: mcnemar_midp for one "
             "pass/fail sample a prompt, sign_flip otherwise, zero_spread when every prompt differs by the same "
             "amount), so it excludes 0 exactly when p < "
             f"{1 - conf if conf else 0.05:.2g}. An interval that contains 0 is no evidence of a difference."]
    if size:
        lines += ["", f"**Multiplicity.** This file makes {size} comparisons ({len(fam.get('models') or [])} "
                  f"model(s) x {len(fam.get('metrics') or [])} metric(s)). Picking the best of them and quoting its "
                  f"interval overstates the evidence: the simultaneous intervals (max-T bootstrap over all {size}, "
                  "prompts resampled jointly) hold for every row at once. Read **after selection** when you choose "
                  "among models."]
    if any(c.get("reference") for c in comps):
        lines += ["", "Rows marked (reference) (a distillation's teacher, `--references`) are shown beside the "
                  "candidates, not among them: their marginal interval only, outside the simultaneous family and the "
                  "selection."]
    lines += ["", "| model | baseline | metric | diff | interval | simultaneous interval | n_pairs | p (test) | "
                  "adj. p | contains 0 | significant after selection | claim |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in comps:
        interval = f"{conf_txt}[{_fmt(c['ci_low'], '+.4f')}, {_fmt(c['ci_high'], '+.4f')}]"
        sim = ("–" if c.get("simultaneous_ci_low") is None else
               f"[{_fmt(c['simultaneous_ci_low'], '+.4f')}, {_fmt(c['simultaneous_ci_high'], '+.4f')}]")
        p = c.get("p_value")
        p_cell = "–" if p is None else f"{p:.4g} ({c.get('test', c.get('p_value_test', 'exact'))})"
        crosses = c.get("ci_crosses_zero", c["ci_low"] <= 0.0 <= c["ci_high"])
        after = c.get("significant_after_selection")
        model = c["model"] + (" (reference)" if c.get("reference") else "")
        lines.append(f"| {model} | {c['baseline']} | {c['metric']} | {_fmt(c['diff'], '+.4f')} | {interval} | "
                     f"{sim} | {c['n_pairs']} | {p_cell} | {_p(c.get('simultaneous_p_value'))} | "
                     f"{_fmt(bool(crosses))} | {'–' if after is None else _fmt(bool(after))} | "
                     f"{c.get('claim', 'exploratory')} |")
    return lines


def _selection_md(results: Mapping) -> list[str]:
    sel = results.get("selection") or {}
    if not sel:
        return []
    lines = ["", "## Selection: the best model, and what its gain is worth", "",
             "Naive: the best model's difference on all prompts (biased upwards by the choice). Selection-adjusted: "
             "cross-fitting -- the best model chosen on one half of the prompts, its difference measured on the "
             "other half, and the other way round; centred on the true gain of 'keep the best'.", ""]
    for metric, s in sel.items():
        nv, cf = s["naive"], s["cross_fit"]
        sim = ""
        if nv.get("simultaneous_ci_low") is not None:
            sim = f", simultaneous {_iv(metric, nv['simultaneous_ci_low'], nv['simultaneous_ci_high'])}"
        lines.append(f"- **{metric}**: best of {s['n_candidates']} is `{nv['model']}`, naive "
                     f"{fmt_pp(metric, nv['diff'])} {_iv(metric, nv.get('ci_low'), nv.get('ci_high'))}{sim} "
                     f"over {s['n_pairs']} prompts; selection-adjusted {fmt_pp(metric, cf['diff'])} "
                     f"{_iv(metric, cf['ci_low'], cf['ci_high'])} (p {_p(cf['p_value'])}, n={cf['n_pairs']}); the "
                     f"halves chose `{cf['chosen_on_half'][0]}` / `{cf['chosen_on_half'][1]}`"
                     + (" (the same)." if cf["agree"] else " (they disagree: the choice is noisy)."))
    return lines


def _part(metric: str, r: Mapping) -> str:
    if r is None or r.get("diff") is None:
        return "– (no prompt)"
    return f"{fmt_pp(metric, r['diff'])} {_iv(metric, r['ci_low'], r['ci_high'])}, n={r['n_pairs']}"


def _censoring_md(results: Mapping) -> list[str]:
    cen = results.get("censoring")
    if not cen:
        return []
    lines = ["", "## Censoring (samples that hit the cap)", "",
             "Per model against the baseline, paired over prompts: *finished only* = prompts both models finished "
             "at least once (each prompt's mean over its finished samples); *bounds* = a truncated sample scored 0 "
             "(observed) vs as its prompt's finished mean (assumes a cut-off completion would not have done better "
             "than the finished ones); *finish part* + *quality part* = the observed difference, split into "
             "'finishes more often' and 'better when it finishes'.", ""]
    if cen.get("models"):
        lines += ["| model | metric | observed diff | finished only | bounds | finish part | quality part |",
                  "|---|---|---|---|---|---|---|"]
        obs = {(c["model"], c["metric"]): c for c in results.get("comparisons") or []}
        for name, by_metric in cen["models"].items():
            for metric, e in by_metric.items():
                o = obs.get((name, metric))
                b = e["bounds"]
                lines.append(f"| {name} | {metric} | {_part(metric, o) if o else '–'} | "
                             f"{_part(metric, e['finished'])} | {_iv(metric, b['ci_low'], b['ci_high'])} "
                             f"(lower {fmt_pp(metric, b['lower']['diff'])}, upper {fmt_pp(metric, b['upper']['diff'])}) "
                             f"| {_part(metric, e['decomposition']['finish'])} | "
                             f"{_part(metric, e['decomposition']['quality'])} |")
    ext = cen.get("extended_cap")
    if ext:
        lines += ["", f"### Both re-sampled at {ext['max_new_tokens']} tokens", "",
                  "Truncated samples of every model drawn again at the larger cap (continuing the same random "
                  "stream); model vs baseline, both at that cap.", "",
                  "| model | metric | diff | interval | p (test) | n_pairs | truncation model / baseline |",
                  "|---|---|---|---|---|---|---|"]
        for name, m in ext["models"].items():
            for c in m["comparisons"]:
                lines.append(f"| {name} | {c['metric']} | {_fmt(c['diff'], '+.4f')} | "
                             f"[{_fmt(c['ci_low'], '+.4f')}, {_fmt(c['ci_high'], '+.4f')}] | "
                             f"{_p(c['p_value'])} ({c['test']}) | {c['n_pairs']} | "
                             f"{m['truncation_rate']:.1%} / {m['baseline_truncation_rate']:.1%} |")
    return lines


def _power_md(results: Mapping) -> list[str]:
    rows = [c for c in results.get("comparisons") or [] if c.get("power") and c["metric"] in
            ("partial_reward_mean", "strict_rate")]
    if not rows:
        return []
    pw = rows[0]["power"]["power"]
    lines = ["", f"## Power ({pw:.0%}, two-sided)", "",
             "sd = SD of the per-prompt differences (at least the one the interval implies); MDE = the smallest true effect these prompts detect with "
             f"{pw:.0%} probability (alone / after the family's Bonferroni correction); prompts needed = for a true "
             "effect the size of the observed one. `python -m launchers.plan` plans a new evaluation from this "
             "file.", "",
             "| model | metric | diff | sd | n_pairs | MDE | MDE (family) | prompts needed | (family) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        p = c["power"]
        lines.append(f"| {c['model']} | {c['metric']} | {fmt_pp(c['metric'], c['diff'])} | "
                     f"{100 * p.get('sd', c['sd_diff']):.1f} pp | {c['n_pairs']} | {100 * p['mde']:.2f} pp | "
                     f"{100 * p['mde_family']:.2f} pp | {_fmt(p['n_for_diff'])} | {_fmt(p['n_for_diff_family'])} |")
    return lines


def _protocol_md(results: Mapping) -> list[str]:
    proto = results.get("protocol")
    if not proto:
        return []
    split = proto.get("split")
    where = (f"split `{split['split']}` of `{split['manifest']}` ({split['count']} problems, sha256 "
             f"{split['sha256'][:12]})" if split else "problems that are not a frozen split")
    lines = ["", "## Protocol", "", f"Role: **{proto['role']}**, on {where}."]
    if proto["role"] == "confirmation":
        pr, sel = proto["primary"], proto.get("selection") or {}
        lines.append(f"Confirms the selection `{sel.get('path')}`: `{pr['model']}` vs `{pr['baseline']}` on "
                     f"{pr['metric']} is the one confirmatory claim (chosen among {sel.get('n_candidates')} on "
                     f"split `{(sel.get('split') or {}).get('split')}`); every other row is exploratory.")
    elif proto["role"] == "selection":
        lines.append("The best model is recorded in selection.json; confirm it once on held-out with "
                     "`--confirm=<this folder>/selection.json`. Every row here is exploratory.")
    else:
        lines.append("Every row is exploratory: no selection was recorded before these models were compared.")
    return lines


def format_results_md(results: Mapping) -> str:
    """The human-readable ``results.md`` for a results.json dict."""
    lines = ["# Evaluation results", ""]
    if results.get("warnings"):
        lines += ["## Warnings", ""] + [f"- **{w}**" for w in results["warnings"]] + [""]
    lines += _models_md(results)
    lines += _comparisons_md(results)
    lines += _selection_md(results)
    lines += _censoring_md(results)
    lines += _power_md(results)
    lines += _protocol_md(results)
    return "\n".join(lines) + "\n"


def write_results(
    out_dir: str | os.PathLike,
    models_metrics: Mapping[str, Mapping],
    comparisons: Sequence[Mapping],
    *,
    warnings: Sequence[str] = (),
    max_new_tokens: Optional[int] = None,
    truncation_threshold: float = 0.10,
    extra: Optional[Mapping] = None,
) -> tuple[Path, Path]:
    """Writes ``out_dir/results.json`` (docs/reference/interfaces.md schema + ``warnings`` + ``extra``) and ``results.md``.

    Args:
      models_metrics: ``{name: model_metrics(...)}``; each needs the docs/reference/interfaces.md keys (extra keys kept).
      comparisons: rows of ``stats.compare`` (extra keys kept).
      warnings: messages to add; a :func:`truncation_warning` per model above ``truncation_threshold``
        (prefixed with the model name) is added automatically, naming ``max_new_tokens`` when given.
      extra: more top-level keys for results.json (e.g. the evaluation config, ``analysis.analyze``'s
        ``family`` / ``selection`` / ``censoring`` / ``protocol``); may not replace "models", "comparisons" or
        "warnings".
    Returns:
      (path of results.json, path of results.md). Both are written atomically (temp file + os.replace).
    """
    for name, m in models_metrics.items():
        for key in _MODEL_KEYS:
            if key not in m:
                raise KeyError(f"models_metrics[{name!r}] lacks {key!r}")
    for i, c in enumerate(comparisons):
        for key in _COMPARISON_KEYS:
            if key not in c:
                raise KeyError(f"comparisons[{i}] lacks {key!r}")
    all_warnings = list(warnings)
    for name, m in models_metrics.items():
        w = truncation_warning(m["truncation_rate"], truncation_threshold, max_new_tokens)
        if w:
            all_warnings.append(f"{name}: {w}")
    results = {"models": {n: dict(m) for n, m in models_metrics.items()},
               "comparisons": [dict(c) for c in comparisons],
               "warnings": all_warnings}
    for key, value in (extra or {}).items():
        if key in results:
            raise ValueError(f"write_results: extra key {key!r} would replace a results.json key")
        results[key] = value
    out_dir = Path(out_dir)
    json_path = atomic_write_json(out_dir / "results.json", results)
    md_path = atomic_write_text(out_dir / "results.md", format_results_md(results))
    return json_path, md_path
