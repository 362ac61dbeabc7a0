"""The settings of `python -m launchers.diagnose`: one dataclass whose fields are the launcher's flags (their names,
types, defaults and help; jaxrl.utils.dataclass_flags makes the flags). The diagnostics take their defaults from
these fields (termination_analysis's bins and threshold, the pair audit's sample and verifier, drift's prompts and
batch, ...). A module of its own, light to import: the launcher defines its flags (and answers --help) before it
imports the diagnostic it runs. The plain-language flags of a result ("flags": [...]) are `red_flags`.

    holders = dataclass_flags.define_flags(DiagnoseSettings)
    settings = dataclass_flags.config_from_flags(DiagnoseSettings, holders)   # after absl parsed them
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxrl.data.formats import BASE_MODEL
from jaxrl.utils.dataclass_flags import flag_field
from jaxrl.utils.seeds import seed_field

__all__ = ["DRIFT_MAX_NEW_TOKENS", "DiagnoseSettings", "WHATS"]

WHATS = ("drift", "pairs", "diff", "termination", "curves")  # the diagnostics, --what
DRIFT_MAX_NEW_TOKENS = 64  # drift: length of the generated continuations when --max_new_tokens is not given


@dataclasses.dataclass(frozen=True)
class DiagnoseSettings:
    """Which diagnostic, where, and the settings of each (the help text of a setting names the diagnostics that
    read it). `what` is required; the launcher says so with the choices."""

    what: Optional[str] = flag_field(None, choices=WHATS, help="Which diagnostic.")
    workdir: Optional[str] = flag_field(None, help="Run folder: eval/ is read from it, diagnostics/ written to it.")
    eval_dir: Optional[str] = flag_field(None, help="Evaluation folder (default WORKDIR/eval).")
    out: Optional[str] = flag_field(None, help="Output JSON (default WORKDIR/diagnostics/<what>.json).")
    seed: int = seed_field(0, help="Seed of every sample drawn (semantic audit, bootstrap).")
    # pairs
    pairs: Optional[str] = flag_field(None, help="pairs.jsonl to audit (--what=pairs).")
    problems: Optional[str] = flag_field(None, help="problems.jsonl: semantic audit (pairs) / prompts (drift).")
    sample_size: int = flag_field(20, help="Chosen completions re-scored by the semantic audit.")
    reward: Optional[str] = flag_field(None, help="pairs: the reward to re-score chosen completions with (default: "
                                       "the one the pairs were scored with, from the audit.json beside them or their "
                                       "rollouts' .meta.json; unknown: the semantic audit says it cannot judge).")
    timeout_s: float = flag_field(2.0, help="Code verifier timeout per test (semantic audit, reward code).")
    workers: int = flag_field(2, help="Code verifier sandboxes (semantic audit, reward code).")
    max_new_tokens: Optional[int] = flag_field(None, help="pairs: generation cap for records without one; drift: "
                                               f"length of the generated continuations (default "
                                               f"{DRIFT_MAX_NEW_TOKENS}).")
    # diff
    model_a: str = flag_field(BASE_MODEL, help="diff: the reference model (eval/samples/<name>.jsonl).")
    model_b: Optional[str] = flag_field(None, help="diff: the other model (default: the best checkpoint).")
    similarity_threshold: float = flag_field(0.6, help="diff: code similarity below which a change is tagged "
                                             "'algorithm'.")
    # termination / curves
    threshold: float = flag_field(0.10, help="termination: truncation rate flagged as censoring.")
    n_bins: int = flag_field(8, help="termination: completion-length bins.")
    tol: float = flag_field(0.0, help="curves: moves up to this size count as flat (non-monotonic flag).")
    # drift
    base_model: Optional[str] = flag_field(None, help="drift: HF folder of the base model.")
    adapters: Optional[str] = flag_field(None, help="drift: folder of PEFT adapters named step_N/ (or checkpoint-N/, "
                                         "N/).")
    steps: Optional[tuple[int, ...]] = flag_field(None, help="drift: steps to measure (default: every adapter "
                                                  "found).")
    sequences: Optional[str] = flag_field(None, help="drift: JSONL of {prompt_ids, continuation_ids} to reuse "
                                          "(written next to the output on the first run).")
    n_prompts: int = flag_field(8, help="drift: prompts taken from --problems (first N).")
    batch_size: int = flag_field(4, help="drift: rows per forward pass.")
    enable_thinking: bool = flag_field(False, help="drift: chat template's thinking switch.")
