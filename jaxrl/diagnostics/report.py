"""The run report: one self-contained ``report.html`` (inline CSS, PNG plots as base64 data URIs, no scripts,
no external resources), readable offline in any browser.

    from jaxrl.diagnostics.report import build_report
    path = build_report("runs/dpo_4b")                 # -> runs/dpo_4b/report.html

Sections: flags (plain-language, errors first), run summary + config, training curves, evaluation table with
intervals, checkpoint curves, termination, pair audit, generation diffs, drift. What it reads (``formats``):
``metrics.jsonl``, ``config.json``, ``eval/results.json``, ``eval/samples/*.jsonl`` and the diagnostics in
``diagnostics/*.json`` (written by ``launchers.diagnose``). Diagnostics that are cheap and need no model are
computed here when their JSON is absent: checkpoint curves and termination (from eval/), generation diffs
(base vs the best checkpoint and vs the last one, from eval/samples), and the static pair audit (when a pairs
file is given). Drift needs a model and the semantic pair audit runs code, so they come only from their JSON
(or ``problems=`` for the semantic audit). A section without data says how to produce it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from jaxrl.data.formats import (BASE_MODEL, CONFIG_FILE, DIAGNOSTICS_DIR, EVAL_DIR, METRICS_FILE, REPORT_FILE,
                                averaged_steps, diagnostics_path, model_step, read_config, read_diagnostic,
                                read_results, read_training_metrics)
from jaxrl.diagnostics import red_flags
from jaxrl.diagnostics import plots
from jaxrl.diagnostics.curves import checkpoint_curves, load_eval_samples
from jaxrl.diagnostics.episode_view import episode_side_by_side
from jaxrl.diagnostics.flags import DiagnoseSettings
from jaxrl.diagnostics.generation_diff import diff_generations
from jaxrl.diagnostics.page import CSS, escape, img, table
from jaxrl.diagnostics.pair_audit import audit_pairs
from jaxrl.diagnostics.termination import termination_analysis
from jaxrl.evaluation.censoring import censoring_section
from jaxrl.evaluation.metrics import per_prompt_values
from jaxrl.evaluation.protocol import read_protocol
from jaxrl.evaluation.selection import selection_summary
from jaxrl.train.metrics import CONFIG_HISTORY
from jaxrl.utils.dataclass_flags import flag_field
from jaxrl.utils.seeds import seed_field
from jaxrl.utils.io import atomic_write_text, iter_jsonl

__all__ = ["ReportSettings", "collect", "render_html", "build_report", "default_diff_pairs"]

_COLLAPSE_AFTER = 4  # more flags than this with one code are folded into one line with a details list


@dataclasses.dataclass(frozen=True)
class ReportSettings:
    """launchers.report: the run, where the page goes, and what it adds to the run's files; the fields are the
    launcher's flags (jaxrl.utils.dataclass_flags)."""

    workdir: str = flag_field(help="Run folder.")
    out: Optional[str] = flag_field(None, help="Output HTML (default WORKDIR/report.html).")
    eval_dir: Optional[str] = flag_field(None, help="Evaluation folder (default WORKDIR/eval).")
    pairs: Optional[str] = flag_field(None, help="pairs.jsonl to audit in the report (else diagnostics/pairs.json).")
    problems: Optional[str] = flag_field(None, help="problems.jsonl for the semantic pair audit (with --pairs).")
    seed: int = seed_field(0, help="Seed of the bootstrap and of the semantic-audit sample.")


# --------------------------------------------------------------------------------------------- collecting


def default_diff_pairs(results: Mapping, samples: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(base, best checkpoint by partial-reward diff) and (base, last checkpoint), where samples exist."""
    if BASE_MODEL not in samples:
        return []
    ckpts = sorted((model_step(n, e), n) for n, e in results["models"].items()
                   if n != BASE_MODEL and n in samples and model_step(n, e) is not None)
    others = [n for n in results["models"] if n != BASE_MODEL and n in samples and model_step(n, results["models"][n])
              is None]
    names: list[str] = []
    if ckpts:
        base_v = results["models"][BASE_MODEL]["partial_reward_mean"]
        best = max(ckpts, key=lambda t: (results["models"][t[1]]["partial_reward_mean"] - base_v, -t[0]))[1]
        names = [best] + ([ckpts[-1][1]] if ckpts[-1][1] != best else [])
    elif others:
        names = others[:1]
    return [(BASE_MODEL, n) for n in names]


_TASK_METRICS = ("partial_reward_mean", "strict_rate")


def _confirmations(workdir: Path, eval_dir: Path) -> list[dict]:
    """Held-out confirmations (``launchers.evaluate --confirm``) in folders beside the evaluation: their protocol
    and their one confirmatory comparison row; a withdrawn one with its primary row (claim exploratory, the
    reason in ``withdrawn``): it stays on the record, so a later confirmation of the same model is read beside
    it."""
    out = []
    for folder in sorted({p for base in (workdir, eval_dir.parent) if base.is_dir() for p in base.iterdir()
                          if p.is_dir() and p != eval_dir}):
        if not (folder / "results.json").is_file() or not (folder / "protocol.json").is_file():
            continue
        proto = read_protocol(folder)
        if (proto or {}).get("role") != "confirmation":
            continue
        res = read_results(folder)
        row = next((c for c in res.get("comparisons", []) if c.get("claim") == "confirmatory"
                    or c.get("withdrawn")), None)
        if row is not None:
            out.append({"dir": os.fspath(folder), "protocol": proto, "row": row, "results": res})
    return out


def _complete_from_samples(results: Mapping, samples: Mapping[str, Sequence[Mapping]]) -> dict:
    """The selection and censoring sections for a results.json written without them (an older evaluator, or
    ``stats.write_results`` called directly), computed from the sample files when they are all there."""
    if (results.get("selection") is not None and results.get("censoring") is not None) or \
            BASE_MODEL not in samples or any(n not in samples for n in results["models"]):
        return {}
    recs = {n: samples[n] for n in results["models"]}
    try:
        per_prompt = {n: per_prompt_values(r) for n, r in recs.items()}
        sel = {m: selection_summary(per_prompt, BASE_MODEL, m, rows=results.get("comparisons") or [],
                                    n_resamples=2000) for m in _TASK_METRICS}
        return {"selection": {m: v for m, v in sel.items() if v is not None} or None,
                "censoring": censoring_section(recs, BASE_MODEL, n_resamples=2000)}
    except (ValueError, KeyError):  # samples on other prompts than each other: nothing paired to add
        return {}


def _kl_reward_flag(drift: Optional[Mapping], curves: Optional[Mapping], metrics: Sequence[Mapping]):
    """KL rising while held-out reward falls: drift KL (or the training ``kl`` at the checkpoint steps) vs the
    checkpoint curve of partial reward."""
    if not curves or "partial_reward_mean" not in curves.get("metrics", {}):
        return None
    pts = curves["metrics"]["partial_reward_mean"]["points"]
    reward = {p["step"]: p["value"] for p in pts}
    kl: dict[int, float] = {}
    if drift:
        kl = {r["step"]: r["kl_to_base"] for r in drift.get("per_step", []) if r.get("kl_to_base") is not None}
        kl.setdefault(0, 0.0)
    else:
        logged = [(r["step"], r["kl"]) for r in metrics if isinstance(r.get("kl"), (int, float))]
        for s in reward:
            before = [v for st, v in logged if st <= s]
            if before:
                kl[s] = before[-1]
    steps = sorted(set(kl) & set(reward))
    return red_flags.kl_rising_reward_falling(steps, [kl[s] for s in steps], [reward[s] for s in steps],
                                      n=pts[0].get("n_prompts"), reward_name="held-out partial reward")


def evaluation_folder(workdir: Path, curves: Optional[Mapping]) -> Path:
    """The evaluation a report shows: DIR/eval when it holds results, else the one the stored checkpoint curves
    were drawn from (``launchers.diagnose --what=curves --eval_dir=...`` records it), else DIR/eval."""
    default = workdir / EVAL_DIR
    if (default / "results.json").is_file():
        return default
    drawn_from = (curves or {}).get("eval_dir")
    if drawn_from and (Path(drawn_from) / "results.json").is_file():
        return Path(drawn_from)
    return default


def read_config_history(workdir: Path) -> list[dict]:
    """The settings of earlier step ranges (jaxrl.train.loop: config_history.jsonl), oldest first; [] if none."""
    path = workdir / CONFIG_HISTORY
    if not path.is_file():
        return []
    return [r for _, r in iter_jsonl(path, skip_malformed=True) if "first_step" in r and "config" in r]


def collect(workdir: str | os.PathLike, *, eval_dir: Optional[str | os.PathLike] = None,
            pairs: Optional[str | os.PathLike] = None, problems=None,
            diff_models: Optional[Sequence[tuple[str, str]]] = None,
            sample_size: int = DiagnoseSettings.sample_size, seed: int = ReportSettings.seed) -> dict:
    """Everything the report shows, as plain dicts (see the module docstring for the sources)."""
    workdir = Path(workdir)
    stored_curves = read_diagnostic(diagnostics_path(workdir, "curves"))
    eval_dir = Path(eval_dir) if eval_dir else evaluation_folder(workdir, stored_curves)
    data: dict[str, Any] = {"workdir": os.fspath(workdir), "config": read_config(workdir), "notes": [],
                            "eval_dir": os.fspath(eval_dir), "config_history": read_config_history(workdir)}
    mpath = workdir / METRICS_FILE
    data["metrics"] = read_training_metrics(mpath) if mpath.is_file() else []
    results = read_results(eval_dir) if (eval_dir / "results.json").is_file() else None
    data["results"] = results
    samples = load_eval_samples(eval_dir) if eval_dir.is_dir() else {}
    data["sample_models"] = {n: len(r) for n, r in samples.items()}

    data["curves"] = stored_curves
    if data["curves"] is None and results and len(results["models"]) > 1 and BASE_MODEL in results["models"]:
        data["curves"] = checkpoint_curves(results, samples=samples, seed=seed)
    data["termination"] = read_diagnostic(diagnostics_path(workdir, "termination"))
    if data["termination"] is None:
        # `launchers.evaluate --resample_max_new_tokens` writes the re-sampled analysis next to the results
        data["termination"] = read_diagnostic(eval_dir / "termination.json")
    if data["termination"] is None and samples:
        data["termination"] = termination_analysis(samples)
    data["diffs"] = []
    stored = read_diagnostic(diagnostics_path(workdir, "diff"))
    if stored is not None:
        data["diffs"].append(stored)
    elif results and samples:
        for a, b in (diff_models if diff_models is not None else default_diff_pairs(results, samples)):
            data["diffs"].append(diff_generations(samples[a], samples[b], name_a=a, name_b=b, max_examples=10))
            data["diffs"][-1]["episode"] = episode_side_by_side(samples[a], samples[b])  # None: not episodes
    data["pairs"] = read_diagnostic(diagnostics_path(workdir, "pairs"))
    if pairs is not None:
        data["pairs"] = audit_pairs(pairs, problems=problems, sample_size=sample_size, seed=seed)
    data["drift"] = read_diagnostic(diagnostics_path(workdir, "drift"))

    flags: list = [red_flags.nonfinite_updates(data["metrics"])] if data["metrics"] else []
    if results:
        term_models = (data["termination"] or {}).get("models", {})
        for name, m in results["models"].items():
            cap = results.get("max_new_tokens") or term_models.get(name, {}).get("max_new_tokens")
            flags.append(red_flags.truncation_censoring(name, m["truncation_rate"], m["n_samples"], max_new_tokens=cap))
        for c in results.get("comparisons", []):
            if c["metric"] in _TASK_METRICS:
                flags += [red_flags.interval_crosses_zero(c), red_flags.not_significant_after_selection(c), red_flags.underpowered(c)]
        extra_sections = _complete_from_samples(results, samples)
        data["selection"] = results.get("selection") or extra_sections.get("selection")
        data["censoring"] = results.get("censoring") or extra_sections.get("censoring")
        for sel in (data["selection"] or {}).values():
            flags.append(red_flags.selection_adjusted_gain(sel))
        for name, by_metric in ((data["censoring"] or {}).get("models") or {}).items():
            for metric, entry in by_metric.items():
                flags.append(red_flags.gain_from_finishing(name, metric, entry))
    data["confirmations"] = _confirmations(workdir, eval_dir)
    for conf in data["confirmations"]:
        flags.append(red_flags.confirmation_result(conf["row"], conf["protocol"]))
    flags.append(_kl_reward_flag(data["drift"], data["curves"], data["metrics"]))
    as_flags = [f for f in red_flags.sort_flags(flags)]
    # Flags the diagnostics computed themselves (dicts); truncation from results.json already covers termination.
    extra = []
    for section in ("curves", "pairs"):
        extra += (data[section] or {}).get("flags", [])
    for d in data["diffs"]:
        extra += d.get("flags", [])
    if not results and data["termination"]:
        extra += data["termination"].get("flags", [])
    all_flags = [f.to_dict() for f in as_flags] + list(extra)
    all_flags.sort(key=lambda f: red_flags.SEVERITIES.index(f["severity"]))
    data["flags"] = all_flags
    return data


# ---------------------------------------------------------------------------------------------- rendering



_SECTIONS = (("flags", "Flags"), ("summary", "Run summary"), ("training", "Training curves"),
             ("evaluation", "Evaluation"), ("curves", "Checkpoint curves"), ("termination", "Termination"),
             ("pairs", "Pair audit"), ("diffs", "Generation diffs"), ("drift", "Drift"))


def _num(v: Any, spec: str = ".4f") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return format(v, spec)
    return escape(v)


def _pct(v: Optional[float]) -> str:
    return "–" if v is None else f"{100 * v:.2f}%"


def _missing(what: str, how: str) -> str:
    return f'<p class="muted">No {escape(what)}: {escape(how)}</p>'


def _flag_html(f: Mapping) -> str:
    return (f'<div class="flag {escape(f["severity"])}"><span class="sev">{escape(f["severity"])}</span>'
            f'{escape(f["message"])} <span class="code">[{escape(f["code"])}]</span></div>')


def _flags_section(flags: Sequence[Mapping]) -> str:
    if not flags:
        return '<p>No flags raised by the checks that had data.</p>'
    by_code: dict[tuple[str, str], list] = {}
    for f in flags:
        by_code.setdefault((f["severity"], f["code"]), []).append(f)
    out = []
    for (sev, code), group in by_code.items():
        if len(group) <= _COLLAPSE_AFTER:
            out += [_flag_html(f) for f in group]
        else:
            inner = "".join(_flag_html(f) for f in group)
            out.append(f'<div class="flag {escape(sev)}"><span class="sev">{escape(sev)}</span>{len(group)} × '
                       f'<span class="code">{escape(code)}</span>, e.g.: {escape(group[0]["message"])}'
                       f'<details><summary>all {len(group)}</summary>{inner}</details></div>')
    return "".join(out)


def _summary_section(data: Mapping) -> str:
    cfg = data.get("config") or {}
    m = data.get("metrics") or []
    rows = [["workdir", escape(data["workdir"])]]
    for key in ("algorithm", "model_path", "steps", "seed", "checkpoint_every"):
        if key in cfg:
            rows.append([key, escape(cfg[key])])
    if data.get("results"):
        rows.append(["evaluation", escape(data.get("eval_dir", ""))])
    for r in data.get("config_history") or []:
        changed = sorted(k for k in set(r["config"]) | set(cfg) if r["config"].get(k) != cfg.get(k))
        rows.append([f"settings of steps {r['first_step']}–{r['last_step']}",
                     "differ from config.json in " + escape(", ".join(changed)) + " (config_history.jsonl)"])
    if m:
        rows.append(["logged steps", f"{len(m)} (steps {m[0]['step']}–{m[-1]['step']})"])
        last = m[-1]
        for key in ("loss", "preference_accuracy", "reward_mean", "kl", "skipped_updates"):
            if isinstance(last.get(key), (int, float)):
                rows.append([f"last {key} (step {last['step']}, one batch)", _num(last[key])])
    res = data.get("results")
    if res:
        rows.append(["evaluated models", escape(", ".join(res["models"]))])
    html_ = table(["", ""], rows)
    if cfg:
        html_ += f"<details><summary>config.json</summary><pre>{escape(json.dumps(cfg, indent=2))}</pre></details>"
    else:
        html_ += _missing("config.json", "the trainer writes DIR/config.json")
    return html_


def _training_section(data: Mapping) -> str:
    m = data.get("metrics") or []
    if not m:
        return _missing("metrics.jsonl", "the trainer writes one record per step to DIR/metrics.jsonl")
    rows = []
    for title, keys, _ in plots.training_panels(m):
        for k in keys:
            vals = [r[k] for r in m if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
            if vals:
                rows.append([escape(k), str(len(vals)), _num(float(vals[0])), _num(float(vals[-1])),
                             _num(float(min(vals))), _num(float(max(vals)))])
    return (img(plots.training_curves(m), "training curves")
            + "<details><summary>values table</summary>"
            + table(["metric", "n steps", "first", "last", "min", "max"], rows) + "</details>")


def _evaluation_section(data: Mapping) -> str:
    res = data.get("results")
    if not res:
        return _missing("evaluation", "run the evaluator (launchers.evaluate) to write DIR/eval/results.json")
    ks = sorted({k for m in res["models"].values() for k in m.get("pass_at_k", {})}, key=int)
    rows = []
    for name, m in res["models"].items():
        u = m.get("untruncated") or {}
        iv = m.get("intervals") or {}

        def with_ci(v, ci):
            return _pct(v) + (f" <span class='muted'>[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]</span>" if ci else "")
        step = _num(model_step(name, m)) if model_step(name, m) is not None else \
            "reference" if m.get("reference") else _averaged_label(m.get("average"))
        rows.append([escape(name), step, str(m["n_prompts"]), str(m["n_samples"]),
                     with_ci(m["partial_reward_mean"], iv.get("partial_reward_mean")),
                     with_ci(m["strict_rate"], iv.get("strict_rate"))]
                    + [with_ci(m["pass_at_k"].get(k), (iv.get("pass_at_k") or {}).get(k)) for k in ks]
                    + [with_ci(m["truncation_rate"], iv.get("truncation_rate")),
                       _num(m["mean_completion_tokens"], ".1f"),
                       _pct(u.get("partial_reward_mean")), _pct(u.get("strict_rate")),
                       f"{u.get('n_prompts', '–')} / {u.get('n_samples', '–')}"])
    out = ("<p class='muted'>Means are per prompt first, then over prompts; brackets: 95% interval over prompts. The "
           "untruncated columns leave out completions that hit the cap (conditional on finishing, each model on its "
           "own prompts; the paired version is under Termination).</p>"
           + table(["model", "step", "prompts", "samples", "partial reward", "strict"] + [f"pass@{k}" for k in ks]
                    + ["truncated", "mean tokens", "untrunc. partial", "untrunc. strict", "untrunc. prompts / samples"],
                    rows))
    comps = res.get("comparisons") or []
    if comps:
        crow = []
        for c in comps:
            crosses = c["ci_low"] <= 0.0 <= c["ci_high"]
            p = c.get("p_value")
            after = c.get("significant_after_selection")
            sim = ("–" if c.get("simultaneous_ci_low") is None else
                   escape(red_flags.fmt_interval(c["metric"], c["simultaneous_ci_low"], c["simultaneous_ci_high"], None)))
            crow.append([escape(c["model"]), escape(c["baseline"]), escape(c["metric"]), escape(red_flags.fmt_diff(c["metric"], c["diff"])),
                         escape(red_flags.fmt_interval(c["metric"], c["ci_low"], c["ci_high"], c.get("confidence", 0.95))),
                         sim, str(c["n_pairs"]),
                         "–" if p is None else f"{p:.3g} ({escape(c.get('test', c.get('p_value_test', '')))})",
                         _num(c.get("simultaneous_p_value"), ".3g"), "<b>yes</b>" if crosses else "no",
                         "–" if after is None else ("<b>yes</b>" if after else "no"),
                         escape(c.get("claim", "exploratory"))])
        fam = res.get("family") or {}
        size = fam.get("size") or comps[0].get("family_size")
        family_models = fam.get("models") or sorted({c["model"] for c in comps})
        n_averaged = sum(1 for n in family_models if averaged_steps(res["models"].get(n)))
        members = (f" of {len(family_models)} models against the baseline"
                   + (f", {n_averaged} of them averaged checkpoints" if n_averaged else ""))
        note = ("<p class='muted'>Each interval comes from the same test as its p-value, so it excludes 0 exactly "
                "when p &lt; 0.05." + (f" This evaluation makes {size} comparisons{members}: the simultaneous "
                                       "intervals (max-T bootstrap over all of them) hold for every row at once; "
                                       "read <b>significant after selection</b> when choosing among models." if size
                                       else "") + "</p>")
        out += ("<h3>Paired comparisons (model − baseline, over prompts)</h3>" + note
                + table(["model", "baseline", "metric", "diff", "interval", "simultaneous interval", "n prompts",
                          "p (test)", "adj. p", "crosses 0", "significant after selection", "claim"], crow, 3))
    out += _selection_html(data.get("selection"))
    out += _power_html(comps)
    proto = res.get("protocol")
    if proto:
        split = proto.get("split")
        where = f"split {split['split']} of {split['manifest']}" if split else "problems that are not a frozen split"
        out += (f"<p class='muted'>Protocol: <b>{escape(proto['role'])}</b> evaluation on {escape(where)}; a claim is "
                "confirmatory only for the selected model on a one-time held-out confirmation.</p>")
    rows = []
    for conf in data.get("confirmations") or []:
        c, pr = conf["row"], conf["protocol"]
        rows.append([escape(os.path.basename(conf["dir"])), escape((pr.get("split") or {}).get("split")), escape(c["model"]),
                     escape(c["metric"]), escape(red_flags.fmt_diff(c["metric"], c["diff"])),
                     escape(red_flags.fmt_interval(c["metric"], c["ci_low"], c["ci_high"], c.get("confidence", 0.95))),
                     str(c["n_pairs"]), f"{c['p_value']:.3g} ({escape(c.get('test', ''))})",
                     f"withdrawn: {escape(c['withdrawn'])}" if c.get("withdrawn") else "<b>confirmatory</b>"])
    if rows:
        out += ("<h3>Confirmation on held-out (once per checkpoint and split)</h3>"
                + table(["folder", "split", "selected model", "metric", "diff vs base", "interval", "n prompts",
                          "p (test)", "claim"], rows, 4))
    for w in res.get("warnings") or []:
        if "truncation" not in w:  # truncation warnings are already flags at the top
            out += f'<div class="flag warning"><span class="sev">evaluator</span>{escape(w)}</div>'
    return out


def _selection_html(selection: Optional[Mapping]) -> str:
    if not selection:
        return ""
    rows = []
    for metric, sel in selection.items():
        nv, cf = sel["naive"], sel["cross_fit"]
        naive_iv = ("–" if nv.get("ci_low") is None else
                    escape(red_flags.fmt_interval(metric, nv["ci_low"], nv["ci_high"], None)))
        sim_iv = ("–" if nv.get("simultaneous_ci_low") is None else
                  escape(red_flags.fmt_interval(metric, nv["simultaneous_ci_low"], nv["simultaneous_ci_high"], None)))
        rows.append([escape(metric), f"{escape(nv['model'])} (of {sel['n_candidates']})", escape(red_flags.fmt_diff(metric, nv["diff"])),
                     naive_iv, sim_iv, escape(red_flags.fmt_diff(metric, cf["diff"])),
                     escape(red_flags.fmt_interval(metric, cf["ci_low"], cf["ci_high"], None)), str(cf["n_pairs"]),
                     escape(" / ".join(cf["chosen_on_half"]))])
    return ("<h3>Selection: the best model's gain, naive and selection-adjusted</h3><p class='muted'>Cross-fit: the "
            "best model chosen on one half of the prompts, its difference measured on the other half, and the other "
            "way round; unlike the naive gain it is not inflated by the choice.</p>"
            + table(["metric", "best", "naive gain", "interval", "simultaneous", "selection-adjusted gain",
                      "interval", "n prompts", "chosen on halves"], rows, 2))


def _power_html(comps: Sequence[Mapping]) -> str:
    rows = []
    for c in comps:
        pw = c.get("power")
        if not pw or c["metric"] not in _TASK_METRICS:
            continue
        rows.append([escape(c["model"]), escape(c["metric"]), escape(red_flags.fmt_diff(c["metric"], c["diff"])),
                     f"{100 * pw.get('sd', c['sd_diff']):.1f} pp", str(c["n_pairs"]), f"{100 * pw['mde']:.2f} pp",
                     f"{100 * pw['mde_family']:.2f} pp", _num(pw["n_for_diff"]), _num(pw["n_for_diff_family"])])
    if not rows:
        return ""
    return (f"<h3>Power ({comps[0]['power']['power']:.0%})</h3><p class='muted'>MDE: the smallest true effect these "
            "prompts detect at this power, alone and after the family's correction; prompts needed: for a true "
            "effect of the observed size (python -m launchers.plan).</p>"
            + table(["model", "metric", "diff", "SD of per-prompt diffs", "n prompts", "MDE", "MDE (family)",
                      "prompts needed", "(family)"], rows, 2))


def _censoring_html(data: Mapping, termination: Optional[Mapping]) -> str:
    cen = data.get("censoring") or {}
    out = ""
    if cen.get("models"):
        rows = []
        for name, by_metric in cen["models"].items():
            for metric, e in by_metric.items():
                fin, b, dec = e["finished"], e["bounds"], e["decomposition"]

                def part(r):
                    if r.get("diff") is None:
                        return "–"
                    return escape(f"{red_flags.fmt_diff(metric, r['diff'])} {red_flags.fmt_interval(metric, r['ci_low'], r['ci_high'], None)}"
                              f" (n={r['n_pairs']})")
                rows.append([escape(name), escape(metric), part(fin),
                             escape(red_flags.fmt_interval(metric, b["ci_low"], b["ci_high"], None)),
                             part(dec["finish"]), part(dec["quality"]),
                             f"{_pct(e['finish_rate_model'])} / {_pct(e['finish_rate_baseline'])}"])
        out += ("<h3>Censoring-aware comparison with the baseline</h3><p class='muted'>Finished only: prompts both "
                "models finished at least once (paired). Bounds: truncated samples scored 0 vs as their prompt's "
                "finished mean. Finish part + quality part = the observed difference: finishing more often vs "
                "doing better when finished.</p>"
                + table(["model", "metric", "finished only", "bounds", "finish part", "quality part",
                          "finish rate model / base"], rows, 2))
    ext = cen.get("extended_cap") or (termination or {}).get("extended_cap")
    if ext:
        rows = []
        for name, m in ext["models"].items():
            for c in m["comparisons"]:
                rows.append([escape(name), escape(c["metric"]), escape(red_flags.fmt_diff(c["metric"], c["diff"])),
                             escape(red_flags.fmt_interval(c["metric"], c["ci_low"], c["ci_high"], c.get("confidence"))),
                             f"{c['p_value']:.3g} ({escape(c['test'])})", str(c["n_pairs"]),
                             f"{_pct(m['truncation_rate'])} / {_pct(m['baseline_truncation_rate'])}"])
        out += (f"<h3>Model vs base, both re-sampled at {ext['max_new_tokens']} tokens</h3>"
                + table(["model", "metric", "diff", "interval", "p (test)", "n prompts",
                          "truncated model / base"], rows, 2))
    return out


def _curves_section(data: Mapping) -> str:
    cur = data.get("curves")
    if not cur or not cur.get("metrics"):
        return _missing("checkpoint curves", "evaluate base and step_<N> checkpoints into DIR/eval/")
    out = img(plots.checkpoint_curves_plot(cur), "checkpoint curves")
    for metric, mc in cur["metrics"].items():

        def row(p, step_label):
            interval = "–" if p["diff"] is None or p["model"] == cur["baseline"] else escape(
                red_flags.fmt_interval(metric, p["ci_low"], p["ci_high"], p.get("confidence")))
            adj = ""
            if p.get("ci_low_adjusted") is not None:
                adj = escape(red_flags.fmt_interval(metric, p["ci_low_adjusted"], p["ci_high_adjusted"],
                                                    p.get("adjusted_confidence")))
            sim = ("" if p.get("simultaneous_ci_low") is None else
                   escape(red_flags.fmt_interval(metric, p["simultaneous_ci_low"], p["simultaneous_ci_high"], None)))
            diff = "–" if p["diff"] is None else escape(red_flags.fmt_diff(metric, p["diff"]))
            return [escape(step_label), escape(p["model"]), escape(red_flags.fmt_value(metric, p["value"])), diff,
                    interval, sim, adj, str(p["n_prompts"])]

        # the steps in order, each averaged candidate right after the last step it averages
        rows = [((p["step"], 0), row(p, str(p["step"]))) for p in mc["points"]]
        rows += [((p["step"], 1), row(p, _averaged_label(p))) for p in mc.get("averages") or []]
        out += f"<h3>{escape(metric)}</h3>" + table(
            ["step", "model", "value", "diff vs base", "interval", "simultaneous", "best-of-m adjusted",
             "n prompts"], [r for _, r in sorted(rows, key=lambda r: r[0])], 2)
        bvl = mc.get("best_vs_last")
        if bvl:
            out += (f"<p class='muted'>{escape(bvl['last'])} vs {escape(bvl['best'])} (last vs best, paired): "
                    f"{escape(red_flags.fmt_diff(metric, bvl['diff']))}, "
                    f"{escape(red_flags.fmt_interval(metric, bvl['ci_low'], bvl['ci_high'], bvl.get('confidence')))} over "
                    f"{bvl['n_pairs']} prompts.</p>")
    return out


def _averaged_label(average: Optional[Mapping]) -> str:
    """What an averaged candidate averages, for the step column: `mean of 32, 40, 48`, `EMA at 48`; – for none."""
    if not average:
        return "–"
    if average.get("kind") == "ema":
        return f"EMA at {average.get('step')}"
    return "mean of " + ", ".join(str(s) for s in average.get("steps") or [])


def _termination_section(data: Mapping) -> str:
    t = data.get("termination")
    if not t or not t.get("models"):
        return _missing("termination analysis", "the evaluator writes per-sample files to DIR/eval/samples/")
    rows = []
    for name, m in t["models"].items():
        u = m["metrics"].get("untruncated") or {}
        rows.append([escape(name), str(m["n_samples"]), f"{m['n_truncated']} ({_pct(m['truncation_rate'])})",
                     _num(m["max_new_tokens"]), _pct(m["metrics"]["partial_reward_mean"]),
                     _pct(m["reward_finished_mean"]), _pct(m["reward_truncated_mean"]),
                     _pct(u.get("partial_reward_mean")), _pct(u.get("strict_rate")),
                     f"{u.get('n_prompts', '–')} / {u.get('n_samples', '–')}"])
    out = (img(plots.termination_plot(t), "termination")
           + table(["model", "samples", "truncated", "cap", "partial (all)", "partial (finished samples)",
                     "partial (truncated samples)", "partial excl. truncated", "strict excl. truncated",
                     "excl. truncated: prompts / samples"], rows))
    out += _censoring_html(data, t)
    for name, r in (t.get("resampled") or {}).items():
        crow = [[escape(c["metric"]), escape(red_flags.fmt_diff(c["metric"], c["diff"])),
                 escape(red_flags.fmt_interval(c["metric"], c["ci_low"], c["ci_high"], c.get("confidence"))), str(c["n_pairs"])]
                for c in r["comparisons"]]
        out += (f"<h3>{escape(name)}: truncated samples re-sampled at {r['max_new_tokens']} tokens "
                f"({r['n_resampled']} re-sampled, {r['still_truncated']} still truncated)</h3>"
                + table(["metric", "after − before", "interval", "n prompts"], crow))
    return out


def _pairs_section(data: Mapping) -> str:
    a = data.get("pairs")
    if not a:
        return _missing("pair audit", "run `python -m launchers.diagnose --what=pairs --pairs=PAIRS.jsonl "
                                      "--problems=PROBLEMS.jsonl --workdir=DIR`, or pass --pairs to the report")
    lb = a["length_bias"]
    out = img(plots.pair_audit_plot(a), "pair audit")
    f = a["filters"]
    rows = [["pairs", str(a["n_pairs"])]]
    if lb.get("n_pairs"):
        rows += [["chosen − rejected tokens, mean (95% interval)",
                  f"{lb['mean_diff']:+.1f} [{lb['ci_low']:+.1f}, {lb['ci_high']:+.1f}] (n={lb['n_pairs']})"],
                 ["chosen shorter / longer / equal",
                  f"{lb['fraction_chosen_shorter']:.1%} / {lb['fraction_chosen_longer']:.1%} / "
                  f"{lb['fraction_equal']:.1%} (sign test p={lb['sign_test']['p_value']:.3g})"]]
        c = lb["margin_vs_length_diff"]
        if c.get("spearman") is not None:
            rows.append(["margin vs length difference",
                         f"Spearman {c['spearman']:+.2f} (p={c['spearman_p']:.3g}), Pearson {c['pearson']:+.2f}"])
    rows += [["chosen not a full solution (chosen_reward < 1)",
              f"{a['chosen_not_full']['n']} of {a['n_pairs']}"],
             ["chosen / rejected hit the cap (finish_reason)",
              f"{a['truncation']['chosen_length_finish']} / {a['truncation']['rejected_length_finish']}"],
             ["would be dropped by the default filters", f"{f['dropped']} of {f['candidates']}" + "".join(
                 f"; {k} {v}" for k, v in f["fail_counts"].items() if v)]]
    out += table(["", ""], rows)
    sem = a.get("semantic")
    if sem and sem.get("skipped"):
        out += f"<h3>Semantic audit</h3><p class='muted'>{escape(sem['skipped'])}</p>"
    elif sem:
        out += (f"<h3>Semantic audit ({escape(str(sem.get('reward')))}): {sem['n_failed']} of {sem['n_checked']} "
                f"sampled chosen completions score below their recorded reward on a re-run (seed {sem['seed']})</h3>")
        if sem.get("missing_problems"):
            out += f"<p class='muted'>problems not in the problems file: {escape(', '.join(sem['missing_problems']))}</p>"
        for x in sem["failures"][:10]:
            out += (f"<p><b>{escape(x['problem_id'])}</b> recorded {x['recorded_reward']:.2f}, re-run "
                    f"{x['partial']:.2f} (strict {_num(x['strict'])}; reason {escape(x['reason'])}; tests "
                    f"{escape(', '.join(x['tests']))})</p><pre>{escape(x['chosen'])}</pre>")
    else:
        out += _missing("semantic audit", "pass --problems to re-run the verifier on sampled chosen solutions")
    return out


def _diffs_section(data: Mapping) -> str:
    diffs = data.get("diffs") or []
    if not diffs:
        return _missing("generation diffs", "needs eval/samples/base.jsonl and a checkpoint's samples")
    out = ""
    for d in diffs:
        s = d["summary"]
        out += (f"<h3>{escape(d['model_b'])} vs {escape(d['model_a'])}: {s['n_changed']} of {s['n_compared']} samples "
                f"changed reward ({s['n_prompts_changed']} of {s['n_prompts']} prompts; "
                f"{s['improved']} improved, {s['worsened']} worsened; mean partial "
                f"{100 * s['mean_partial_diff']:+.2f} pp)</h3>")
        out += img(plots.diff_plot(d), f"diff {d['model_a']} {d['model_b']}")
        rows = [[f'<span class="tag">{escape(t)}</span>', str(v["n"]), str(v["improved"]), str(v["worsened"]),
                 f"{100 * v['net_delta']:+.2f} pp"] for t, v in s["by_tag"].items() if v["n"]]
        out += table(["tag", "changed", "improved", "worsened", "net contribution"], rows)
        for c in [c for c in d["changes"] if c.get("text_a") is not None][:6]:
            sim = "" if c["similarity"] is None else f", code similarity {c['similarity']:.2f}"
            out += (f"<p><b>{escape(c['problem_id'])}</b> #{c['sample_index']} <span class='tag'>{escape(c['tag'])}</span> "
                    f"reward {c['reward_a']:.2f} → {c['reward_b']:.2f}; finish {escape(c['finish_a'])} → "
                    f"{escape(c['finish_b'])}; tokens {c['tokens_a']} → {c['tokens_b']}{escape(sim)}</p>"
                    f"<div class='sbs'><pre>{escape(d['model_a'])}:\n{escape(c['text_a'])}</pre>"
                    f"<pre>{escape(d['model_b'])}:\n{escape(c['text_b'])}</pre></div>")
        out += _episode_view(d)
    return out


def _episode_view(d: Mapping) -> str:
    """One episode of both models, a row per turn (evaluations over episodes; jaxrl.diagnostics.episode_view)."""
    e = d.get("episode")
    if not e:
        return ""
    rows = []
    for t, turn in enumerate(e["turns"]):
        cells = []
        for text, obs, reward in ((turn["a"], turn["obs_a"], turn["reward_a"]),
                                  (turn["b"], turn["obs_b"], turn["reward_b"])):
            reply = "" if not obs else "\n--- environment:\n" + "\n".join(obs)
            cells.append("–" if text is None else f"<pre>{escape(text + reply)}</pre>"
                         + ("" if reward is None else f" reward {reward:+.2f}"))
        rows.append([str(t + 1)] + cells)
    return (f"<p><b>episode {escape(e['problem_id'])}</b> #{e['sample_index']}: reward {e['partial_a']:.2f} → "
            f"{e['partial_b']:.2f}, solved {e['solved_a']} → {e['solved_b']}</p>"
            + table(["turn", d["model_a"], d["model_b"]], rows, left=3))


def _drift_section(data: Mapping) -> str:
    d = data.get("drift")
    if not d or not d.get("per_step"):
        return _missing("drift", "run `python -m launchers.diagnose --what=drift --base_model=HF_DIR "
                                 "--adapters=DIR_OF_PEFT_STEPS --problems=PROBLEMS.jsonl --workdir=DIR`")
    rows = []
    for r in d["per_step"]:
        un = r.get("update_norm") or {}
        top = sorted((un.get("layers") or {}).items(), key=lambda kv: -kv[1])[:3]
        rows.append([str(r["step"]), _num(r.get("kl_to_base"), ".5f"), _num(r.get("kl_max_token"), ".4f"),
                     f"{r.get('n_tokens', '–')} / {r.get('n_sequences', '–')}", _num(un.get("total"), ".4g"),
                     escape(", ".join(f"{k} {v:.3g}" for k, v in top))])
    return (img(plots.drift_plot(d), "drift")
            + table(["step", "KL per token", "max token KL", "tokens / sequences", "update norm",
                      "largest layers"], rows))


_RENDER = {"summary": _summary_section, "training": _training_section, "evaluation": _evaluation_section,
           "curves": _curves_section, "termination": _termination_section, "pairs": _pairs_section,
           "diffs": _diffs_section, "drift": _drift_section}


def render_html(data: Mapping, title: Optional[str] = None) -> str:
    """The report page for :func:`collect`'s output."""
    title = title or f"jaxrl report: {Path(data['workdir']).name}"
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    nav = "".join(f'<a href="#{k}">{escape(v)}</a>' for k, v in _SECTIONS)
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{escape(title)}</h1>"
             f"<p class='muted'>generated {when} from {escape(data['workdir'])}</p><nav>{nav}</nav>",
             f"<h2 id='flags'>Flags</h2>{_flags_section(data.get('flags') or [])}"]
    for key, name in _SECTIONS[1:]:
        parts.append(f"<h2 id='{key}'>{escape(name)}</h2>{_RENDER[key](data)}")
    parts.append("</body></html>")
    return "\n".join(parts)


def check_run_folder(workdir: str | os.PathLike, eval_dir: Optional[str | os.PathLike] = None) -> None:
    """FileNotFoundError unless `workdir` holds a run: config.json, metrics.jsonl, an evaluation or diagnostics."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise FileNotFoundError(f"{workdir}: no such run folder (--workdir)")
    evals = Path(eval_dir) if eval_dir else workdir / EVAL_DIR
    if eval_dir and not evals.is_dir():
        raise FileNotFoundError(f"{evals}: no such evaluation folder (--eval_dir)")
    found = [p for p in (workdir / CONFIG_FILE, workdir / METRICS_FILE, evals / "results.json",
                         workdir / DIAGNOSTICS_DIR) if p.exists()]
    if not found:
        raise FileNotFoundError(f"{workdir}: holds no run ({CONFIG_FILE}, {METRICS_FILE}, "
                                f"{EVAL_DIR}/results.json or {DIAGNOSTICS_DIR}/); is --workdir the run folder?")


def build_report(workdir: str | os.PathLike, out: Optional[str | os.PathLike] = None, **kwargs) -> Path:
    """Collects (``collect(workdir, **kwargs)``), renders and writes ``out`` (default ``DIR/report.html``)
    atomically; returns its path. A workdir that does not exist, or holds none of the files a report is built
    from, is refused (FileNotFoundError) before anything is written: a mistyped path never gets an empty report."""
    check_run_folder(workdir, kwargs.get("eval_dir"))
    data = collect(workdir, **kwargs)
    path = Path(out) if out else Path(workdir) / REPORT_FILE
    return atomic_write_text(path, render_html(data))
