"""Debugging diagnostics from files on disk; writes one JSON and prints a summary.

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

from absl import app, flags

from jaxrl.data import formats
from jaxrl.utils.io import read_jsonl, write_jsonl
from launchers import _main

_WHAT = flags.DEFINE_enum("what", None, ["drift", "pairs", "diff", "termination", "curves"], "Which diagnostic.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder: eval/ is read from it, diagnostics/ written to it.")
_EVAL_DIR = flags.DEFINE_string("eval_dir", None, "Evaluation folder (default WORKDIR/eval).")
_OUT = flags.DEFINE_string("out", None, "Output JSON (default WORKDIR/diagnostics/<what>.json).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of every sample drawn (semantic audit, bootstrap).")
# pairs
_PAIRS = flags.DEFINE_string("pairs", None, "pairs.jsonl to audit (--what=pairs).")
_PROBLEMS = flags.DEFINE_string("problems", None, "problems.jsonl: semantic audit (pairs) / prompts (drift).")
_SAMPLE_SIZE = flags.DEFINE_integer("sample_size", 20, "Chosen completions re-scored by the semantic audit.")
_REWARD = flags.DEFINE_string("reward", None, "pairs: the reward to re-score chosen completions with (default: the "
                              "one the pairs were scored with, from the audit.json beside them or their rollouts' "
                              ".meta.json; unknown: the semantic audit says it cannot judge).")
_TIMEOUT = flags.DEFINE_float("timeout_s", 2.0, "Code verifier timeout per test (semantic audit, reward code).")
_WORKERS = flags.DEFINE_integer("workers", 2, "Code verifier sandboxes (semantic audit, reward code).")
_CAP = flags.DEFINE_integer("max_new_tokens", None, "pairs: generation cap for records without one; drift: "
                            "length of the generated continuations (default 64).")
# diff
_MODEL_A = flags.DEFINE_string("model_a", "base", "diff: the reference model (eval/samples/<name>.jsonl).")
_MODEL_B = flags.DEFINE_string("model_b", None, "diff: the other model (default: the best checkpoint).")
_SIM = flags.DEFINE_float("similarity_threshold", 0.6, "diff: code similarity below which a change is "
                          "tagged 'algorithm'.")
# termination / curves
_THRESHOLD = flags.DEFINE_float("threshold", 0.10, "termination: truncation rate flagged as censoring.")
_BINS = flags.DEFINE_integer("n_bins", 8, "termination: completion-length bins.")
_TOL = flags.DEFINE_float("tol", 0.0, "curves: moves up to this size count as flat (non-monotonic flag).")
# drift
_BASE = flags.DEFINE_string("base_model", None, "drift: HF folder of the base model.")
_ADAPTERS = flags.DEFINE_string("adapters", None, "drift: folder of PEFT adapters named step_N/ (or "
                                "checkpoint-N/, N/).")
_STEPS = flags.DEFINE_list("steps", None, "drift: steps to measure (default: every adapter found).")
_SEQUENCES = flags.DEFINE_string("sequences", None, "drift: JSONL of {prompt_ids, continuation_ids} to reuse "
                                 "(written next to the output on the first run).")
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 8, "drift: prompts taken from --problems (first N).")
_BATCH = flags.DEFINE_integer("batch_size", 4, "drift: rows per forward pass.")
_THINKING = flags.DEFINE_bool("enable_thinking", False, "drift: chat template's thinking switch.")


def _out_path(what: str) -> Path:
    if _OUT.value:
        return Path(_OUT.value)
    if not _WORKDIR.value:
        raise app.UsageError("pass --workdir or --out")
    return formats.diagnostics_path(_WORKDIR.value, what)


def _eval_dir() -> Path:
    if _EVAL_DIR.value:
        return Path(_EVAL_DIR.value)
    if not _WORKDIR.value:
        raise app.UsageError("pass --workdir or --eval_dir")
    return Path(_WORKDIR.value) / formats.EVAL_DIR


def _curves() -> tuple[dict, str]:
    from jaxrl.diagnostics.curves import curves_from_eval_dir
    res = curves_from_eval_dir(_eval_dir(), seed=_SEED.value, tol=_TOL.value)
    lines = []
    for metric, mc in res["metrics"].items():
        pts = ", ".join(f"{p['step']}: {p['value']:.4f}" for p in mc["points"])
        lines.append(f"{metric}: {pts}")
    return res, "\n".join(lines)


def _termination() -> tuple[dict, str]:
    from jaxrl.diagnostics.curves import load_eval_samples
    from jaxrl.diagnostics.termination import termination_analysis
    samples = load_eval_samples(_eval_dir())
    if not samples:
        raise app.UsageError(f"{_eval_dir() / formats.SAMPLES_DIR}: no sample files")
    res = termination_analysis(samples, n_bins=_BINS.value, threshold=_THRESHOLD.value)
    lines = []
    for n, m in res["models"].items():
        u = m["metrics"]["untruncated"]
        excl = "n/a" if u["partial_reward_mean"] is None else f"{u['partial_reward_mean']:.4f}"
        lines.append(f"{n}: truncated {m['n_truncated']}/{m['n_samples']} ({m['truncation_rate']:.1%}); partial "
                     f"{m['metrics']['partial_reward_mean']:.4f}, excluding truncated {excl} ({u['n_samples']} samples)")
    return res, "\n".join(lines)


def _diff() -> tuple[dict, str]:
    from jaxrl.diagnostics.curves import load_eval_samples
    from jaxrl.diagnostics.generation_diff import diff_generations
    from jaxrl.diagnostics.report import default_diff_pairs
    eval_dir = _eval_dir()
    samples = load_eval_samples(eval_dir)
    a, b = _MODEL_A.value, _MODEL_B.value
    if b is None:
        pairs = default_diff_pairs(formats.read_results(eval_dir), samples)
        if not pairs:
            raise app.UsageError("pass --model_b (no checkpoint samples to pick one from)")
        b = pairs[0][1]
    for name in (a, b):
        if name not in samples:
            raise app.UsageError(f"{formats.samples_path(eval_dir, name)}: no such samples file; have "
                                 f"{sorted(samples)}")
    res = diff_generations(samples[a], samples[b], name_a=a, name_b=b, similarity_threshold=_SIM.value)
    s = res["summary"]
    lines = [f"{b} vs {a}: {s['n_changed']} of {s['n_compared']} samples changed "
             f"(mean partial {100 * s['mean_partial_diff']:+.2f} pp)"]
    lines += [f"  {t}: {v['n']} ({v['improved']} improved, {v['worsened']} worsened), "
              f"net {100 * v['net_delta']:+.2f} pp" for t, v in s["by_tag"].items() if v["n"]]
    return res, "\n".join(lines)


def _pairs() -> tuple[dict, str]:
    from jaxrl.data.pairs import PairConfig
    from jaxrl.diagnostics.pair_audit import audit_pairs
    if not _PAIRS.value:
        raise app.UsageError("--what=pairs needs --pairs")
    if _REWARD.value:
        from jaxrl.rollout.runner import check_reward_choice
        check_reward_choice(_REWARD.value, {})
    res = audit_pairs(_PAIRS.value, config=PairConfig(max_new_tokens=_CAP.value), problems=_PROBLEMS.value,
                      reward=_REWARD.value, sample_size=_SAMPLE_SIZE.value, seed=_SEED.value,
                      timeout_s=_TIMEOUT.value, workers=_WORKERS.value)
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


def _drift(out: Path) -> tuple[dict, str]:
    from jaxrl.diagnostics import drift
    if not (_BASE.value and _ADAPTERS.value):
        raise app.UsageError("--what=drift needs --base_model and --adapters")
    found = drift.find_peft_checkpoints(_ADAPTERS.value)
    if not found:
        raise app.UsageError(f"{_ADAPTERS.value}: no PEFT adapter folders named step_N/ (with "
                             "adapter_model.safetensors)")
    steps = [int(s) for s in _STEPS.value] if _STEPS.value else sorted(found)
    missing = [s for s in steps if s not in found]
    if missing:
        raise app.UsageError(f"no adapter for steps {missing}; found {sorted(found)}")
    import jax.numpy as jnp

    from jaxrl.models import qwen35
    model = qwen35.from_pretrained(_BASE.value, dtype=jnp.float32)
    if _SEQUENCES.value:
        seqs = [(r["prompt_ids"], r["continuation_ids"]) for r in read_jsonl(_SEQUENCES.value)]
    else:
        if not _PROBLEMS.value:
            raise app.UsageError("--what=drift needs --problems (prompts) or --sequences")
        seqs = drift.fixed_sequences(model, _BASE.value, _PROBLEMS.value, n_prompts=_N_PROMPTS.value,
                                     max_new_tokens=_CAP.value or 64, enable_thinking=_THINKING.value)
        seq_path = out.with_name(out.stem + "_sequences.jsonl")
        write_jsonl(seq_path, [{"prompt_ids": list(map(int, p)), "continuation_ids": list(map(int, c))}
                               for p, c in seqs])
        print(f"fixed sequences written to {seq_path} (reuse with --sequences)")
    res = drift.model_checkpoint_drift(_BASE.value, {s: drift.load_peft_adapter(found[s]) for s in steps}, seqs,
                                       steps=steps, batch_size=_BATCH.value, model=model)
    lines = [f"step {r['step']}: KL {r['kl_to_base']:.5f} per token ({r['n_tokens']} tokens), update norm "
             f"{r['update_norm']['total']:.4g}" for r in res["per_step"]]
    return res, "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    what = _WHAT.value
    if what is None:
        raise app.UsageError("--what is required: drift, pairs, diff, termination or curves")
    out = _out_path(what)
    if what != "drift" and _WORKDIR.value and not _EVAL_DIR.value and what != "pairs" and \
            not Path(_WORKDIR.value).is_dir():
        raise FileNotFoundError(f"{_WORKDIR.value}: no such run folder (--workdir)")
    # a missing or malformed input is one line (launchers/_main.py); nothing is written before the result
    if what == "drift":
        res, summary = _drift(out)
    else:
        res, summary = {"curves": _curves, "termination": _termination, "diff": _diff, "pairs": _pairs}[what]()
    formats.write_diagnostic(out, res)
    print(summary)
    for f in res.get("flags", []):
        print(f"[{f['severity']}] {f['message']}")
    print(f"wrote {os.fspath(out)}")
    return 0


if __name__ == "__main__":
    _main.run(main)
