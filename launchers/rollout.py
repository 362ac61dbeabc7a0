"""Sample K completions per problem with a model (+ optional adapter), score them, write rollouts.jsonl.

    python -m launchers.rollout --problems=problems.jsonl --model=HF_DIR --out=rollouts.jsonl \
        --num_samples=8 --temperature=1.0 --max_new_tokens=4096 --reward=code [--adapter=CKPT_DIR]

    # on vLLM 0.33 (its own environment, docs/vllm.md), the adapter served as LoRA; or on a running server
    python -m launchers.rollout ... --backend=vllm --batch_size=1024 \
        --backend_kwargs='{"python": "~/.venvs/vllm", "data_parallel_size": 8}'
    python -m launchers.rollout ... --backend=server --server_url=http://127.0.0.1:8000

    # several hosts (the flags of launchers.train): each process samples every n-th problem on its devices
    # (--mesh_shape, default all local devices data-parallel), then process 0 merges them into --out
    python -m launchers.rollout ... --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=$i

Every backend writes the same records with the same sample keys (seed, problem id, sample index); a file is
resumed only with the backend it was started with.
Resumable: rerun the same command after an interruption; already written samples are kept and skipped, a
partially written last line is cut off. The record format and the resume rules: jaxrl/rollout/runner.py.
A progress bar shows samples/s and tokens/s; the run's summary is written to <out>.meta.json.
Every value is checked before the model is loaded or the output is touched. Ctrl-C / SIGTERM: the batch in
flight is written, exit status 130 / 143; rerun the same command to resume. Exit status 1 for refused work (an
--out of other settings), 2 for usage errors (launchers/_main.py).
"""

from __future__ import annotations

import json

from absl import app, flags, logging

from jaxrl.data.chat import OVERLONG_POLICIES
from jaxrl.parallel import distributed
from jaxrl.rollout.backends.flags import backend_options, define_backend_flags, mesh_shape_of
from jaxrl.rollout.runner import RolloutConfig, run_rollouts
from launchers import _main

_PROBLEMS = flags.DEFINE_string("problems", None, "problems.jsonl (canonical schema of docs/interfaces.md).")
_MODEL = flags.DEFINE_string("model", None, "HF model folder (weights, config.json, tokenizer, chat template).")
_ADAPTER = flags.DEFINE_string("adapter", None, "Optional adapter checkpoint folder (trainer format).")
_OUT = flags.DEFINE_string("out", None, "Output rollouts.jsonl (appended to and resumed if it exists).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 8, "Samples per problem (K).")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature; 0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1].")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k filtering; 0 = off.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 4096, "Generation cap; a sample hitting it is truncated "
                                       "(finish_reason 'length').")
_MAX_PROMPT_LEN = flags.DEFINE_integer("max_prompt_len", 2048, "Prompt budget in tokens after the chat template.")
_PROMPT_BUCKETS = flags.DEFINE_list("prompt_buckets", [], "Prompt lengths that get their own compiled program "
                                    "(default 32, 64, ... up to --max_prompt_len).")
_ON_OVERLONG = flags.DEFINE_enum("on_overlong", "skip", list(OVERLONG_POLICIES),
                                 "Prompts over --max_prompt_len: skip (counted in the summary) or error.")
_ENABLE_THINKING = flags.DEFINE_bool("enable_thinking", False, "Qwen3.5 thinking mode in the generation prompt.")
_REWARD = flags.DEFINE_string("reward", "code", "Reward name (jaxrl.rewards.get_reward) or module:function.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Samples per compiled batch.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Model compute dtype.")
_LIMIT = flags.DEFINE_integer("limit", 0, "Use only the first N problems (0 = all).")
_MODEL_NAME = flags.DEFINE_string("model_name", "", "Value of the records' 'model' field (default: folder name).")
_SAVE_LOGPROBS = flags.DEFINE_bool("save_logprobs", False, "Also write token_ids and per-token logprobs.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
_BACKEND_FLAGS = define_backend_flags()  # --backend, --server_url, --backend_kwargs, --mesh_shape
_DISTRIBUTED = distributed.define_flags()  # --coordinator_address, --num_processes, --process_id, ...


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for flag in (_PROBLEMS, _MODEL, _OUT):
        if not flag.value:
            raise app.UsageError(f"--{flag.name} is required")
    backend, backend_kwargs = backend_options(_BACKEND_FLAGS)
    try:
        buckets = tuple(int(b) for b in _PROMPT_BUCKETS.value)
    except ValueError:
        raise app.UsageError(f"--prompt_buckets: expected integers, got {','.join(_PROMPT_BUCKETS.value)}") from None
    mesh_shape = mesh_shape_of(_BACKEND_FLAGS)
    distributed.initialize_from_flags(_DISTRIBUTED)
    cfg = RolloutConfig(problems=_PROBLEMS.value, model=_MODEL.value, out=_OUT.value, adapter=_ADAPTER.value,
                        num_samples=_NUM_SAMPLES.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                        top_k=_TOP_K.value, max_new_tokens=_MAX_NEW_TOKENS.value,
                        max_prompt_len=_MAX_PROMPT_LEN.value,
                        prompt_buckets=buckets,
                        enable_thinking=_ENABLE_THINKING.value,
                        reward=_REWARD.value, batch_size=_BATCH_SIZE.value, seed=_SEED.value,
                        on_overlong=_ON_OVERLONG.value, dtype=_DTYPE.value, limit=_LIMIT.value,
                        model_name=_MODEL_NAME.value, save_logprobs=_SAVE_LOGPROBS.value,
                        progress=_PROGRESS.value, backend=backend, backend_kwargs=backend_kwargs,
                        mesh_shape=mesh_shape)
    summary = run_rollouts(cfg)  # refused work (ResumeError, ServerError, ...) is one line: launchers/_main.py
    logging.info("rollouts summary: %s", json.dumps(summary))
    print(json.dumps({k: v for k, v in summary.items() if k != "settings"}, indent=1))


if __name__ == "__main__":
    _main.run(main, interruptible=True)
