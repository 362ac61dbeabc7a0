"""`algorithm = "dpo"`: its config blocks (`BLOCKS`, registered in jaxrl.algorithms.tasks; the task:
jaxrl.algorithms.dpo_task; the losses: jaxrl.algorithms.dpo). No jax here: configs import this module."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.utils.typed_config import Block, setting

__all__ = ["BLOCKS", "DPOConfig", "DPODataConfig"]


@dataclasses.dataclass(frozen=True)
class DPOConfig(Block):
    loss_type: Any = setting("sigmoid", (str, list, tuple), "a registered loss, or several comma-separated "
                             "('sigmoid,sft' = RPO)")
    loss_weights: tuple = setting((), tuple, "one weight per loss_type; () = all 1")
    beta: float = setting(0.1)
    label_smoothing: float = setting(0.0, doc="robust, exo_pair, aot, aot_unpaired, simpo")
    simpo_gamma: float = setting(0.5, doc="SimPO target margin")
    discopop_tau: float = setting(0.05)
    f_divergence: str = setting("reverse_kl", doc="reverse_kl | forward_kl | js_divergence | alpha_divergence")
    f_alpha: float = setting(0.5)
    plugin: str = setting("", doc="deprecated alias of `plugins` entries of kind dpo_loss: "
                          "'my_losses.py:fn[,other.py:fn2]' (registered by function name)")
    precompute_ref_logps: bool = setting(True, doc="False: a second forward with the adapters off in every step")
    ref_batch_size: int = setting(0, doc="rows per reference / evaluation pass; 0 = batch.micro_batch_size")


@dataclasses.dataclass(frozen=True)
class DPODataConfig(Block):
    source: str = setting("pairs", doc="pairs | synthetic")
    pairs: str = setting("", doc="pairs.jsonl, a frozen cohort folder, or a build folder holding cohort/")
    problems: str = setting("", doc="problems.jsonl supplying `messages` of pairs that have none")
    tokenizer: str = setting("", doc="HF tokenizer folder; '' = model_path")
    max_length: int = setting(2048, doc="prompt + completion tokens of one sequence")
    max_prompt_length: int = setting(0, doc="0 = bounded by max_length only")
    overlong: str = setting("truncate_prompt", doc="truncate_prompt (cut the prompt from the left) | drop")
    min_prompt_tokens: int = setting(64, doc="truncate_prompt keeps at least this many prompt tokens, else the "
                                     "pair is dropped")
    enable_thinking: bool = setting(False, doc="the chat template's generation prompt (as the pairs were sampled)")
    pad_multiple: int = setting(64, doc="sequence-length bucket")
    pack: bool = setting(False, doc="pack each micro-batch's chosen and rejected sequences end to end into as many "
                         "rows as it has pairs, of one of the lengths 2T x {1/4, 3/8, 1/2, 5/8, 3/4, 1} (T: the "
                         "padded length; jaxrl.data.packing); log-probs and loss unchanged")
    eval_fraction: float = setting(0.0, doc="held-out share of the pairs (seeded by pair id), scored at every "
                                   "checkpoint")
    eval_pairs: str = setting("", doc="or a separate held-out pairs file")
    expected_pairs: int = setting(0, doc="> 0: refuse a pair set of any other size (e.g. 1000 for the frozen "
                                  "cohort)")
    synthetic_pairs: int = setting(256, doc="source = synthetic: arithmetic-progression pairs "
                                   "(dpo_data.synthetic_pairs)")
    synthetic_prompt_len: int = setting(6)
    synthetic_completion_len: int = setting(4)
    synthetic_num_tokens: int = setting(0, doc="tokens [2, 2 + n) (0 = the whole vocabulary)")

    def __post_init__(self):
        if self.eval_pairs and self.eval_fraction:
            raise ValueError("set data.eval_pairs or data.eval_fraction, not both")
        super().__post_init__()


# the blocks a run of dpo has, in the order its family config lists them (registered in
# jaxrl.algorithms.tasks)
BLOCKS = {"dpo": DPOConfig, "data": DPODataConfig}
