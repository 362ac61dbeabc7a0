r"""Evaluate the base model and checkpoints on a problems file: metrics, paired comparisons, weight audit.

    # every adapter checkpoint of a run (or --steps=4,8,28,125), greedy, 8192-token cap, code verifier (LCB mode)
    python -m launchers.evaluate --problems=heldout.jsonl --checkpoints=RUN_DIR --steps=28,125 \
        --num_samples=1 --temperature=0 --max_new_tokens=8192
    # adapters trained elsewhere (PEFT folders), merged containers, the vLLM backend (GPU, merged containers)
    python -m launchers.evaluate --problems=lcb.jsonl --base=/models/Qwen3.5-4B --out=eval_lcb \
        --adapters=dpo28=/adapters/dpo_step28 --models=merged125=/export/merged_125 --backend=vllm

Writes to --out (default RUN_DIR/eval): results.json, results.md, samples/<model>.jsonl, audit.json, and the
resume cache cache/<model>.jsonl. Rerun the same command after an interruption: finished samples are kept.
Models: `base` (always; the baseline unless --baseline), `step_<N>` for run checkpoints, and the names given in
--adapters / --models. Every model is scored on the same prompts with the same sample keys; comparisons are
model - baseline with a paired bootstrap interval over prompts and an exact test on strict passes.
--resample_max_new_tokens=N re-runs only the truncated samples at a larger cap N, keeps the merged records in
resampled/N/<model>.jsonl, writes termination.json (how much of each score the cap decided;
jaxrl.diagnostics.termination) and rewrites results.json/md with every model compared with the baseline BOTH at
the larger cap (censoring.extended_cap).

Select on dev, confirm once on held-out (jaxrl.evaluation.protocol):

    # 1. choose among the checkpoints on the dev split (a frozen split: launchers.import_problems --split)
    python -m launchers.evaluate --problems=data/splits/dev.jsonl --checkpoints=RUN --steps=4,8,12,16,28,40,125 \
        --out=RUN/eval_dev --role=select --select_metric=partial_reward_mean      # -> RUN/eval_dev/selection.json
    # 2. evaluate the chosen checkpoint (and base) once on held-out: the confirmatory claim
    python -m launchers.evaluate --problems=data/splits/heldout.jsonl --confirm=RUN/eval_dev/selection.json \
        --out=RUN/eval_heldout

A second --confirm of the same weights on the same split is refused (data/splits/confirmations.jsonl).
Temperature 0 with --num_samples > 1 is refused: greedy decoding repeats one completion.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging

from jaxrl.evaluation.backends import BACKENDS
from jaxrl.rollout.chat import OVERLONG_POLICIES

_PROBLEMS = flags.DEFINE_string("problems", None, "problems.jsonl (canonical schema, docs/interfaces.md).")
_BASE = flags.DEFINE_string("base", None, "Base HF folder (default: model_path of the run's config.json).")
_CHECKPOINTS = flags.DEFINE_string("checkpoints", None, "A run workdir: evaluate its adapter checkpoints.")
_STEPS = flags.DEFINE_list("steps", [], "Only these checkpoint steps (default: every one in --checkpoints).")
_ADAPTERS = flags.DEFINE_list("adapters", [], "NAME=PATH,...: PEFT folders or adapter checkpoints (on --base).")
_MODELS = flags.DEFINE_list("models", [], "NAME=HF_DIR,...: full HF folders (e.g. merged exports).")
_OUT = flags.DEFINE_string("out", None, "Output folder (default: <--checkpoints>/eval).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Samples per problem (n; pass@k for k <= n).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus mass in (0, 1].")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k; 0 = off.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 8192, "Completion cap (a sample hitting it is truncated).")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 4096, "Prompt budget after the chat template.")
_PROMPT_BUCKETS = flags.DEFINE_list("prompt_buckets", [], "Prompt lengths with their own compiled program.")
_ON_OVERLONG = flags.DEFINE_enum("on_overlong", "skip", list(OVERLONG_POLICIES), "Over-long prompts.")
_ENABLE_THINKING = flags.DEFINE_bool("enable_thinking", False, "Qwen3.5 thinking mode in the generation prompt.")
_REWARD = flags.DEFINE_string("reward", "code", "code (the verifier, LiveCodeBench-compatible) or a toy reward "
                              "name (exact_match, pattern, arithmetic) or module:function.")
_REWARD_KWARGS = flags.DEFINE_string("reward_kwargs", "{}", "JSON keyword arguments of the reward, e.g. "
                                     "'{\"timeout_s\": 10, \"workers\": 8}'.")
_BASELINE = flags.DEFINE_string("baseline", "base", "The model every other one is compared with.")
_BACKEND = flags.DEFINE_enum("backend", "jax", list(BACKENDS), "jax (in-process sampler) or vllm (GPU, merged).")
_BACKEND_KWARGS = flags.DEFINE_string("backend_kwargs", "{}", "JSON options of the backend (vllm: "
                                      "tensor_parallel_size, gpu_memory_utilization, engine_args).")
_TRUNCATION = flags.DEFINE_float("truncation_threshold", 0.10, "Warn when more completions than this hit the cap.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling and bootstrap seed.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Samples per compiled batch (jax backend).")
_LIMIT = flags.DEFINE_integer("limit", 0, "Only the first N problems (0 = all).")
_N_RESAMPLES = flags.DEFINE_integer("n_resamples", 10000, "Bootstrap resamples.")
_CONFIDENCE = flags.DEFINE_float("confidence", 0.95, "Interval confidence level.")
_RESAMPLE = flags.DEFINE_integer("resample_max_new_tokens", 0, "Re-run truncated samples at this larger cap "
                                 "and write termination.json (0 = off).")
_PROGRESS = flags.DEFINE_bool("progress", True, "Progress bars.")
_ROLE = flags.DEFINE_enum("role", "explore", ["explore", "select"], "explore: every claim is exploratory; select: "
                          "record the best model on --select_metric in <out>/selection.json (dev split).")
_SELECT_METRIC = flags.DEFINE_enum("select_metric", "partial_reward_mean", ["partial_reward_mean", "strict_rate"],
                                   "Metric the best model is selected on (--role=select).")
_CONFIRM = flags.DEFINE_string("confirm", None, "A selection.json (or its folder): evaluate base and the selected "
                               "model once on this other split; its comparison is the confirmatory claim.")


def _named(values, flag):
    out = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep:
            name, path = os.path.basename(v.rstrip("/")), v
        if not name or not path:
            raise app.UsageError(f"--{flag}: expected NAME=PATH, got {v!r}")
        out.append((name, path))
    return out


def _default_base(workdir):
    cfg_path = os.path.join(workdir, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            path = json.load(f).get("model_path")
        if path:
            return path
    raise app.UsageError(f"--base is required ({cfg_path} names no model_path)")


def build_config(selection=None):
    from jaxrl.evaluation.analysis import sampling_warning
    from jaxrl.evaluation.runner import EvalConfig, ModelSpec, checkpoint_specs
    if not _PROBLEMS.value:
        raise app.UsageError("--problems is required")
    refused = sampling_warning(_TEMPERATURE.value, _NUM_SAMPLES.value)
    if refused:
        raise app.UsageError(refused)
    if selection is not None:
        return _confirmation_config(selection)
    workdir = _CHECKPOINTS.value
    base = _BASE.value or (_default_base(workdir) if workdir else None)
    if not base:
        raise app.UsageError("--base is required without --checkpoints")
    out = _OUT.value or (os.path.join(workdir, "eval") if workdir else None)
    if not out:
        raise app.UsageError("--out is required without --checkpoints")
    if _STEPS.value and not workdir:
        raise app.UsageError("--steps needs --checkpoints")
    models = checkpoint_specs(workdir, [int(s) for s in _STEPS.value]) if workdir else []
    models += [ModelSpec(n, "adapter", p) for n, p in _named(_ADAPTERS.value, "adapters")]
    models += [ModelSpec(n, "hf", p) for n, p in _named(_MODELS.value, "models")]
    return EvalConfig(problems=_PROBLEMS.value, base=base, out=out, models=models, num_samples=_NUM_SAMPLES.value,
                      temperature=_TEMPERATURE.value, top_p=_TOP_P.value, top_k=_TOP_K.value,
                      max_new_tokens=_MAX_NEW_TOKENS.value, max_prompt_len=_MAX_PROMPT_LEN.value,
                      prompt_buckets=tuple(int(b) for b in _PROMPT_BUCKETS.value),
                      enable_thinking=_ENABLE_THINKING.value, reward=_REWARD.value,
                      reward_kwargs=json.loads(_REWARD_KWARGS.value), baseline=_BASELINE.value,
                      backend=_BACKEND.value, backend_kwargs=json.loads(_BACKEND_KWARGS.value),
                      truncation_threshold=_TRUNCATION.value, seed=_SEED.value, dtype=_DTYPE.value,
                      batch_size=_BATCH_SIZE.value, limit=_LIMIT.value, on_overlong=_ON_OVERLONG.value,
                      n_resamples=_N_RESAMPLES.value, confidence=_CONFIDENCE.value, progress=_PROGRESS.value)


def _confirmation_config(selection):
    """Base + the selected model, as the selection recorded them; the problems are --problems (held-out)."""
    from jaxrl.evaluation.runner import BASE, EvalConfig, ModelSpec
    if _CHECKPOINTS.value or _ADAPTERS.value or _MODELS.value or _STEPS.value:
        raise app.UsageError("--confirm evaluates the selected model only; drop --checkpoints/--steps/--adapters/"
                             "--models")
    if not _OUT.value:
        raise app.UsageError("--out is required with --confirm")
    model = selection["model"]
    source = model.get("source") or {}
    if selection["baseline"] != BASE or not source.get("path"):
        raise app.UsageError(f"{selection['path']}: can only confirm a model selected against {BASE!r} with a "
                             "recorded source")
    base = _BASE.value or selection.get("base")
    if not base:
        raise app.UsageError("--base is required (the selection does not record the base folder)")
    spec = ModelSpec(model["name"], source["kind"], source["path"], step=model.get("step"))
    return EvalConfig(problems=_PROBLEMS.value, base=base, out=_OUT.value, models=[spec],
                      num_samples=_NUM_SAMPLES.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                      top_k=_TOP_K.value, max_new_tokens=_MAX_NEW_TOKENS.value, max_prompt_len=_MAX_PROMPT_LEN.value,
                      prompt_buckets=tuple(int(b) for b in _PROMPT_BUCKETS.value),
                      enable_thinking=_ENABLE_THINKING.value, reward=_REWARD.value,
                      reward_kwargs=json.loads(_REWARD_KWARGS.value), baseline=BASE, backend=_BACKEND.value,
                      backend_kwargs=json.loads(_BACKEND_KWARGS.value), truncation_threshold=_TRUNCATION.value,
                      seed=_SEED.value, dtype=_DTYPE.value, batch_size=_BATCH_SIZE.value, limit=_LIMIT.value,
                      on_overlong=_ON_OVERLONG.value, n_resamples=_N_RESAMPLES.value, confidence=_CONFIDENCE.value,
                      progress=_PROGRESS.value)


def termination(ev, results, cap: int) -> str:
    """Re-samples the truncated completions of every model at `cap`, keeps them in <out>/resampled/<cap>/ (read
    back by the results: every model vs the baseline, both at `cap`), writes <out>/termination.json and rewrites
    results.json / results.md (jaxrl.diagnostics.termination.resample_evaluation)."""
    from jaxrl.diagnostics.termination import resample_evaluation
    return resample_evaluation(ev, cap)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from jaxrl.evaluation import protocol as P
    from jaxrl.evaluation.runner import Evaluator
    from jaxrl.evaluation.runner import ResumeError
    from jaxrl.export.adapters import AdapterError
    from jaxrl.train.checkpoints import CheckpointNotFound
    if _CONFIRM.value and _ROLE.value == "select":
        raise app.UsageError("--confirm and --role=select exclude each other")
    from jaxrl.diagnostics.formats import FormatError
    try:
        selection = P.read_selection(_CONFIRM.value) if _CONFIRM.value else None
    except (FileNotFoundError, FormatError, P.ProtocolError) as e:
        sys.exit(f"evaluate: {e}")
    cfg = build_config(selection)
    try:
        ev = Evaluator(cfg)
    except (AdapterError, CheckpointNotFound) as e:
        sys.exit(f"evaluate: {e}")
    try:
        if selection is not None:  # claims the one confirmation before any sample is drawn
            proto = P.begin_confirmation(selection, cfg.problems, cfg.out)
            P.check_fingerprint(proto, ev.run_audit()["fingerprints"])
        elif _ROLE.value == "select":
            P.begin_selection(cfg.problems, cfg.out, _SELECT_METRIC.value)
        results = ev.run()
        if _RESAMPLE.value:
            path = termination(ev, results, _RESAMPLE.value)
            logging.info("termination analysis: %s", path)
        if _ROLE.value == "select":
            from jaxrl.diagnostics import formats
            rec = P.write_selection(ev.out, formats.read_results(ev.out), metric=_SELECT_METRIC.value,
                                    base=os.path.abspath(cfg.base))
            print(f"evaluate: selected {rec['model']['name']} on {rec['metric']} ({ev.out / P.SELECTION_FILE}); "
                  f"confirm it once with --confirm={ev.out / P.SELECTION_FILE}")
    except (ResumeError, AdapterError, P.ProtocolError) as e:
        # refused: samples of other weights / settings in --out, an adapter in the wrong layout, a second
        # confirmation, ...
        sys.exit(f"evaluate: {e}")
    finally:
        ev.close()
    print((ev.out / "results.md").read_text())
    print(f"evaluate: wrote {ev.out / 'results.json'}")


if __name__ == "__main__":
    app.run(main)
