r"""Evaluate the base model and checkpoints on a problems file: metrics, paired comparisons, weight audit.

    # every adapter checkpoint of a run (or --steps=4,8,28,125), greedy, 8192-token cap, code verifier (LCB mode)
    python -m launchers.evaluate --problems=heldout.jsonl --checkpoints=RUN_DIR --steps=28,125 \
        --num_samples=1 --temperature=0 --max_new_tokens=8192
    # adapters trained elsewhere (PEFT folders), merged containers; on vLLM 0.33 (GPU, its own environment,
    # docs/vllm.md: adapters served unmerged as LoRA) or on a running server (--backend=server --server_url=URL)
    python -m launchers.evaluate --problems=lcb.jsonl --base=/models/Qwen3.5-4B --out=eval_lcb \
        --adapters=dpo28=/adapters/dpo_step28 --models=merged125=/export/merged_125 --backend=vllm \
        --batch_size=512 --backend_kwargs='{"python": "~/.venvs/vllm", "tensor_parallel_size": 1}'

Writes to --out (default RUN_DIR/eval): results.json, results.md, samples/<model>.jsonl, audit.json, and the
resume cache cache/<model>.jsonl. Rerun the same command after an interruption: finished samples are kept.
Models: `base` (always; the baseline unless --baseline), `step_<N>` for run checkpoints, and the names given in
--adapters / --models. Every model is scored on the same prompts with the same sample keys; comparisons are
model - baseline with a paired bootstrap interval over prompts and an exact test on strict passes.
--resample_max_new_tokens=N re-runs only the truncated samples at a larger cap N and writes termination.json
(how much of each score the cap decided; jaxrl.diagnostics.termination).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging

from jaxrl.evaluation import cli
from jaxrl.rollout.backends.flags import backend_options

_F = cli.define_flags()
flags.adopt_module_key_flags(cli)  # --helpshort lists them as this launcher's own


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


def build_config():
    from jaxrl.evaluation.runner import EvalConfig, ModelSpec, checkpoint_specs
    if not _F["problems"].value:
        raise app.UsageError("--problems is required")
    workdir = _F["checkpoints"].value
    base = _F["base"].value or (_default_base(workdir) if workdir else None)
    if not base:
        raise app.UsageError("--base is required without --checkpoints")
    out = _F["out"].value or (os.path.join(workdir, "eval") if workdir else None)
    if not out:
        raise app.UsageError("--out is required without --checkpoints")
    if _F["steps"].value and not workdir:
        raise app.UsageError("--steps needs --checkpoints")
    models = checkpoint_specs(workdir, [int(s) for s in _F["steps"].value]) if workdir else []
    models += [ModelSpec(n, "adapter", p) for n, p in _named(_F["adapters"].value, "adapters")]
    models += [ModelSpec(n, "hf", p) for n, p in _named(_F["models"].value, "models")]
    v = {name: holder.value for name, holder in _F.items()}
    backend, backend_kwargs = backend_options(_F)
    return EvalConfig(problems=v["problems"], base=base, out=out, models=models, num_samples=v["num_samples"],
                      temperature=v["temperature"], top_p=v["top_p"], top_k=v["top_k"],
                      max_new_tokens=v["max_new_tokens"], max_prompt_len=v["max_prompt_len"],
                      prompt_buckets=tuple(int(b) for b in v["prompt_buckets"]),
                      enable_thinking=v["enable_thinking"], reward=v["reward"],
                      reward_kwargs=json.loads(v["reward_kwargs"]), baseline=v["baseline"],
                      backend=backend, backend_kwargs=backend_kwargs,
                      truncation_threshold=v["truncation_threshold"], seed=v["seed"], dtype=v["dtype"],
                      batch_size=v["batch_size"], limit=v["limit"], on_overlong=v["on_overlong"],
                      n_resamples=v["n_resamples"], confidence=v["confidence"], progress=v["progress"])


def termination(ev, results, cap: int) -> str:
    """Re-samples the truncated completions of every model at `cap`; writes <out>/termination.json."""
    from jaxrl.data import formats
    from jaxrl.diagnostics.termination import resample_truncated, termination_analysis
    from jaxrl.utils.io import atomic_write_json
    samples = {name: formats.read_samples(formats.samples_path(ev.out, name)) for name in results["models"]}
    resampled = {name: resample_truncated(recs, ev.resample_fn(name), cap, seed=ev.cfg.seed)
                 for name, recs in samples.items()}
    report = termination_analysis(samples, threshold=ev.cfg.truncation_threshold, resampled=resampled)
    return str(atomic_write_json(ev.out / "termination.json", report))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from jaxrl.evaluation.runner import Evaluator, ResumeError
    from jaxrl.models.adapters import AdapterError, CheckpointNotFound
    from jaxrl.rollout.backends import ServerError
    cfg = build_config()
    try:
        ev = Evaluator(cfg)
    except (AdapterError, CheckpointNotFound, ServerError) as e:
        sys.exit(f"evaluate: {e}")
    try:
        results = ev.run()
        if _F["resample_max_new_tokens"].value:
            path = termination(ev, results, _F["resample_max_new_tokens"].value)
            logging.info("termination analysis: %s", path)
    except (ResumeError, AdapterError, ServerError) as e:
        # refused: samples of other weights / settings in --out, an adapter in the wrong layout, a server that is
        # missing, too old or rejects the adapter, ...
        sys.exit(f"evaluate: {e}")
    finally:
        ev.close()
    print((ev.out / "results.md").read_text())
    print(f"evaluate: wrote {ev.out / 'results.json'}")


if __name__ == "__main__":
    app.run(main)
