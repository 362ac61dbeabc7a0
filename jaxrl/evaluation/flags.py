"""The command-line flags of `python -m launchers.evaluate`, defined once: the launcher defines its flags from
this table (the backend flags come from jaxrl.rollout.backends.flags) and the sweep runner checks a sweep's `evaluate` block against the same names.

    values = define_flags()          # {name: absl FlagHolder}; values["problems"].value after app.run parses
    NAMES                            # every flag name
"""

from __future__ import annotations

from absl import flags

from jaxrl.data.chat import OVERLONG_POLICIES
from jaxrl.parallel.distributed import FLAGS as DISTRIBUTED_FLAGS
from jaxrl.rollout.backends.flags import BACKEND_FLAGS

# (name, absl kind, default, [enum values,] help)
FLAGS = (
    ("problems", "string", None, "problems.jsonl (canonical schema, docs/interfaces.md)."),
    ("base", "string", None, "Base HF folder (default: model_path of the run's config.json)."),
    ("checkpoints", "string", None, "A run workdir: evaluate its adapter checkpoints."),
    ("steps", "list", [], "Only these checkpoint steps (default: every one in --checkpoints)."),
    ("adapters", "list", [], "NAME=PATH,...: PEFT folders or adapter checkpoints (on --base)."),
    ("models", "list", [], "NAME=HF_DIR,...: full HF folders (e.g. merged exports)."),
    ("out", "string", None, "Output folder (default: <--checkpoints>/eval)."),
    ("num_samples", "integer", 1, "Samples per problem (n; pass@k for k <= n)."),
    ("temperature", "float", 0.0, "0 = greedy."),
    ("top_p", "float", 1.0, "Nucleus mass in (0, 1]."),
    ("top_k", "integer", 0, "Top-k; 0 = off."),
    ("max_new_tokens", "integer", 8192, "Completion cap (a sample hitting it is truncated)."),
    ("max_prompt_len", "integer", 4096, "Prompt budget after the chat template."),
    ("prompt_buckets", "list", [], "Prompt lengths with their own compiled program."),
    ("on_overlong", "enum", "skip", list(OVERLONG_POLICIES), "Over-long prompts."),
    ("enable_thinking", "bool", False, "Qwen3.5 thinking mode in the generation prompt."),
    ("reward", "string", "code", "code (the verifier, LiveCodeBench-compatible) or a toy reward name "
     "(exact_match, pattern, arithmetic) or module:function."),
    ("reward_kwargs", "string", "{}", "JSON keyword arguments of the reward, e.g. "
     "'{\"timeout_s\": 10, \"workers\": 8}'."),
    ("baseline", "string", "base", "The model every other one is compared with."),
    ("truncation_threshold", "float", 0.10, "Warn when more completions than this hit the cap."),
    ("seed", "integer", 0, "Sampling and bootstrap seed."),
    ("dtype", "enum", "bfloat16", ["bfloat16", "float32"], "Compute dtype."),
    ("batch_size", "integer", 64, "Samples per compiled batch (jax backend); samples in flight at once (server "
     "backends: vLLM wants hundreds)."),
    ("limit", "integer", 0, "Only the first N problems (0 = all)."),
    ("n_resamples", "integer", 10000, "Bootstrap resamples."),
    ("confidence", "float", 0.95, "Interval confidence level."),
    ("resample_max_new_tokens", "integer", 0, "Re-run truncated samples at this larger cap and write "
     "termination.json (0 = off)."),
    ("progress", "bool", True, "Progress bars."),
    ("overwrite", "bool", False, "Replace the results in --out of models or prompts this run leaves out (without "
     "it a narrower rerun is refused)."),
    ("role", "enum", "explore", ["explore", "select"], "explore: every claim is exploratory; select: record the best "
     "model on --select_metric in <out>/selection.json (dev split)."),
    ("select_metric", "enum", "partial_reward_mean", ["partial_reward_mean", "strict_rate"], "Metric the best model "
     "is selected on (--role=select)."),
    ("confirm", "string", None, "A selection.json (or its folder): evaluate base and the selected model once on this "
     "other split; its comparison is the confirmatory claim."),
) + BACKEND_FLAGS + DISTRIBUTED_FLAGS  # --backend, --server_url, --backend_kwargs, --mesh_shape (shared with
#                                       launchers.rollout); --coordinator_address, ... (shared with launchers.train)
NAMES = tuple(f[0] for f in FLAGS)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, flags.FlagHolder]:
    """Defines every flag of FLAGS in `flag_values`; returns their holders by name."""
    holders = {}
    for name, kind, default, *rest in FLAGS:
        holders[name] = getattr(flags, f"DEFINE_{kind}")(name, default, *rest, flag_values=flag_values)
    return holders
