r"""Debugging diagnostics from files on disk; writes one JSON and prints a summary.

    python -m launchers.diagnose --what=curves --workdir=runs/dpo            # eval/results.json (+ samples)
    python -m launchers.diagnose --what=termination --workdir=runs/dpo       # eval/samples/*.jsonl
    python -m launchers.diagnose --what=diff --workdir=runs/dpo --model_a=base --model_b=step_28
    python -m launchers.diagnose --what=pairs --pairs=pairs/pairs.jsonl --problems=problems.jsonl --workdir=runs/dpo
    python -m launchers.diagnose --what=drift --base_model=HF_DIR --adapters=runs/dpo/export/steps \
        --problems=problems.jsonl --workdir=runs/dpo

Output: ``--out``, default ``WORKDIR/diagnostics/<what>.json`` (the report picks it up from there). Formats:
``jaxrl/data/formats.py`` and the docstring of each diagnostic module. Exit status 1 for a missing or malformed
input file (its file:line named), 2 for usage errors (launchers/_main.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from absl import app

from jaxrl.data import formats
from jaxrl.diagnostics.flags import DRIFT_MAX_NEW_TOKENS, WHATS, DiagnoseSettings
from jaxrl.utils import dataclass_flags
from jaxrl.utils.io import read_jsonl, write_jsonl
from launchers import _main

_F = dataclass_flags.define_flags(DiagnoseSettings)  # a flag per DiagnoseSettings field


def _out_path(s: DiagnoseSettings) -> Path:
    if s.out:
        return Path(s.out)
    if not s.workdir:
        raise app.UsageError("pass --workdir or --out")
    return formats.diagnostics_path(s.workdir, s.what)


def _eval_dir(s: DiagnoseSettings) -> Path:
    if s.eval_dir:
        return Path(s.eval_dir)
    if not s.workdir:
        raise app.UsageError("pass --workdir or --eval_dir")
    return Path(s.workdir) / formats.EVAL_DIR


def _curves(s: DiagnoseSettings) -> tuple[dict, str]:
    from jaxrl.diagnostics.curves import curves_from_eval_dir
    res = curves_from_eval_dir(_eval_dir(s), seed=s.seed, tol=s.tol)
    lines = []
    for metric, mc in res["metrics"].items():
        pts = ", ".join(f"{p['step']}: {p['value']:.4f}" for p in mc["points"])
        lines.append(f"{metric}: {pts}")
    return res, "\n".join(lines)


def _termination(s: DiagnoseSettings) -> tuple[dict, str]:
    from jaxrl.diagnostics.curves import load_eval_samples
    from jaxrl.diagnostics.termination import termination_analysis
    samples = load_eval_samples(_eval_dir(s))
    if not samples:
        raise app.UsageError(f"{_eval_dir(s) / formats.SAMPLES_DIR}: no sample files")
    res = termination_analysis(samples, n_bins=s.n_bins, threshold=s.threshold)
    lines = []
    for n, m in res["models"].items():
        u = m["metrics"]["untruncated"]
        excl = "n/a" if u["partial_reward_mean"] is None else f"{u['partial_reward_mean']:.4f}"
        lines.append(f"{n}: truncated {m['n_truncated']}/{m['n_samples']} ({m['truncation_rate']:.1%}); partial "
                     f"{m['metrics']['partial_reward_mean']:.4f}, excluding truncated {excl} ({u['n_samples']} samples)")
    return res, "\n".join(lines)


def _diff(s: DiagnoseSettings) -> tuple[dict, str]:
    from jaxrl.diagnostics.curves import load_eval_samples
    from jaxrl.diagnostics.generation_diff import diff_generations
    from jaxrl.diagnostics.report import default_diff_pairs
    eval_dir = _eval_dir(s)
    samples = load_eval_samples(eval_dir)
    a, b = s.model_a, s.model_b
    if b is None:
        pairs = default_diff_pairs(formats.read_results(eval_dir), samples)
        if not pairs:
            raise app.UsageError("pass --model_b (no checkpoint samples to pick one from)")
        b = pairs[0][1]
    for name in (a, b):
        if name not in samples:
            raise app.UsageError(f"{formats.samples_path(eval_dir, name)}: no such samples file; have "
                                 f"{sorted(samples)}")
    res = diff_generations(samples[a], samples[b], name_a=a, name_b=b, similarity_threshold=s.similarity_threshold)
    summary = res["summary"]
    lines = [f"{b} vs {a}: {summary['n_changed']} of {summary['n_compared']} samples changed "
             f"(mean partial {100 * summary['mean_partial_diff']:+.2f} pp)"]
    lines += [f"  {t}: {v['n']} ({v['improved']} improved, {v['worsened']} worsened), "
              f"net {100 * v['net_delta']:+.2f} pp" for t, v in summary["by_tag"].items() if v["n"]]
    return res, "\n".join(lines)


def _pairs(s: DiagnoseSettings) -> tuple[dict, str]:
    from jaxrl.data.pairs import PairConfig
    from jaxrl.diagnostics.pair_audit import audit_pairs
    if not s.pairs:
        raise app.UsageError("--what=pairs needs --pairs")
    if s.reward:
        from jaxrl.rollout.runner import check_reward_choice
        check_reward_choice(s.reward, {})
    res = audit_pairs(s.pairs, config=PairConfig(max_new_tokens=s.max_new_tokens), problems=s.problems,
                      reward=s.reward, sample_size=s.sample_size, seed=s.seed, timeout_s=s.timeout_s,
                      workers=s.workers)
    lb = res["length_bias"]
    lines = [f"{res['n_pairs']} pairs"]
    if lb.get("n_pairs"):
        lines.append(f"chosen - rejected tokens: mean {lb['mean_diff']:+.1f} [{lb['ci_low']:+.1f}, "
                     f"{lb['ci_high']:+.1f}]; chosen shorter {lb['fraction_chosen_shorter']:.1%}, longer "
                     f"{lb['fraction_chosen_longer']:.1%} (sign test p={lb['sign_test']['p_value']:.3g})")
    sem = res.get("semantic")
    if sem and sem.get("skipped"):
        lines.append(f"semantic audit: {sem['skipped']}")
    elif sem:
        lines.append(f"semantic audit ({sem['reward']}): {sem['n_failed']} of {sem['n_checked']} chosen completions "
                     "score below their recorded reward on a re-run")
    return res, "\n".join(lines)


def _drift(s: DiagnoseSettings, out: Path) -> tuple[dict, str]:
    from jaxrl.diagnostics import drift
    if not (s.base_model and s.adapters):
        raise app.UsageError("--what=drift needs --base_model and --adapters")
    found = drift.find_peft_checkpoints(s.adapters)
    if not found:
        raise app.UsageError(f"{s.adapters}: no PEFT adapter folders named step_N/ (with "
                             "adapter_model.safetensors)")
    steps = list(s.steps) if s.steps else sorted(found)
    missing = [s for s in steps if s not in found]
    if missing:
        raise app.UsageError(f"no adapter for steps {missing}; found {sorted(found)}")
    import jax.numpy as jnp

    from jaxrl.models import qwen35
    model = qwen35.from_pretrained(s.base_model, dtype=jnp.float32)
    if s.sequences:
        seqs = [(r["prompt_ids"], r["continuation_ids"]) for r in read_jsonl(s.sequences)]
    else:
        if not s.problems:
            raise app.UsageError("--what=drift needs --problems (prompts) or --sequences")
        seqs = drift.fixed_sequences(model, s.base_model, s.problems, n_prompts=s.n_prompts,
                                     max_new_tokens=s.max_new_tokens or DRIFT_MAX_NEW_TOKENS,
                                     enable_thinking=s.enable_thinking)
        seq_path = out.with_name(out.stem + "_sequences.jsonl")
        write_jsonl(seq_path, [{"prompt_ids": list(map(int, p)), "continuation_ids": list(map(int, c))}
                               for p, c in seqs])
        print(f"fixed sequences written to {seq_path} (reuse with --sequences)")
    res = drift.model_checkpoint_drift(s.base_model, {k: drift.load_peft_adapter(found[k]) for k in steps}, seqs,
                                       steps=steps, batch_size=s.batch_size, model=model)
    lines = [f"step {r['step']}: KL {r['kl_to_base']:.5f} per token ({r['n_tokens']} tokens), update norm "
             f"{r['update_norm']['total']:.4g}" for r in res["per_step"]]
    return res, "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    s = dataclass_flags.config_from_flags(DiagnoseSettings, _F)
    what = s.what
    if what is None:
        raise app.UsageError(f"--what is required: {', '.join(WHATS[:-1])} or {WHATS[-1]}")
    out = _out_path(s)
    if what != "drift" and s.workdir and not s.eval_dir and what != "pairs" and not Path(s.workdir).is_dir():
        raise FileNotFoundError(f"{s.workdir}: no such run folder (--workdir)")
    # a missing or malformed input is one line (launchers/_main.py); nothing is written before the result
    if what == "drift":
        res, summary = _drift(s, out)
    else:
        res, summary = {"curves": _curves, "termination": _termination, "diff": _diff, "pairs": _pairs}[what](s)
    formats.write_diagnostic(out, res)
    print(summary)
    for f in res.get("flags", []):
        print(f"[{f['severity']}] {f['message']}")
    print(f"wrote {os.fspath(out)}")
    return 0


if __name__ == "__main__":
    _main.run(main)
