r"""Sample K completions per problem with a model (+ optional adapter), score them, write rollouts.jsonl.

    python -m launchers.rollout --problems=problems.jsonl --model=HF_DIR --out=rollouts.jsonl \
        --num_samples=8 --temperature=1.0 --max_new_tokens=4096 --reward=code [--adapter=CKPT_DIR]

    # on vLLM 0.33 (its own environment, docs/guides/vllm.md), the adapter served as LoRA; or on a running server
    python -m launchers.rollout ... --backend=vllm --server_concurrency=128 \
        --vllm_python=~/.venvs/vllm --vllm_data_parallel_size=8
    python -m launchers.rollout ... --backend=server --server_url=http://127.0.0.1:8000

The backend flags: --server_<key> (how requests reach a server: concurrency, request_timeout_s, progress_every_s),
--vllm_<key> (the `vllm serve` --backend=vllm starts: python, tensor_parallel_size, data_parallel_size,
gpu_memory_utilization, extra_args, startup_timeout_s, max_loras) and --vllm_max_lora_rank, one per key of the
typed option blocks (jaxrl.backends.flags); --backend_kwargs='{"data_parallel_size": 8}' is their deprecated JSON
form (mapped onto them with a warning).

    # several hosts (the flags of launchers.train): each process samples every n-th problem on its devices
    # (--mesh_shape, default all local devices data-parallel), then process 0 merges them into --out
    python -m launchers.rollout ... --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=$i

Every backend writes the same records with the same sample keys (seed, problem id, sample index); a file is
resumed only with the backend it was started with.
Resumable: rerun the same command after an interruption; already written samples are kept and skipped, a
partially written last line is cut off. The record format and the resume rules: jaxrl/rollout/runner.py.
A progress bar shows samples/s and tokens/s; the run's summary is written to <out>.meta.json and printed as one
line. The meta file records the checkpoint --adapter resolved to (step and digest): a resume that resolves to
another checkpoint is refused. One writer per --out: a second run on it is refused naming the first one's pid.
Every value is checked before the model is loaded or the output is touched. Ctrl-C / SIGTERM: the batch in
flight is written, exit status 130 / 143; rerun the same command to resume. Exit status 1 for refused work (an
--out of other settings), 2 for usage errors (launchers/_main.py).
"""

from __future__ import annotations

from absl import app, flags

from jaxrl.evaluation.analysis import sampling_warning
from jaxrl.parallel import distributed
from jaxrl.rollout import flags as rollout_flags
from jaxrl.rollout.runner import run_rollouts
from launchers import _main

_F = rollout_flags.define_flags()  # a flag per RolloutConfig field, --server_*, --vllm_*, --coordinator_address, ...
flags.adopt_module_key_flags(rollout_flags)  # --helpshort lists them as this launcher's own


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cfg = rollout_flags.build_config(_F)
    refused = sampling_warning(cfg.temperature, cfg.num_samples)  # the refusal evaluate gives too
    if refused:
        raise app.UsageError(refused)
    distributed.initialize_from_flags(_F)
    summary = run_rollouts(cfg)  # refused work (ResumeError, ServerError, ...) is one line: launchers/_main.py
    print(summary_line(cfg.out, summary))


def summary_line(out: str, summary: dict) -> str:
    """What a finished run prints: its counts in one line (the whole summary is in <out>.meta.json)."""
    rate = summary.get("truncation_rate_written")
    settings = summary.get("settings") or {}
    step = settings.get("adapter_step")
    return (f"rollout: {summary['samples_total']} samples of {summary['problems']} problems in {out} "
            f"({summary['samples_written']} written now, {summary['samples_resumed']} resumed"
            + (f", {len(summary['skipped_overlong'])} problems skipped as over-long" if summary['skipped_overlong']
               else "")
            + (f"; {rate:.1%} truncated" if rate is not None else "")
            + (f"; adapter step {step}" if step is not None else "") + f"); summary in {out}.meta.json")


if __name__ == "__main__":
    _main.run(main, interruptible=True)
