"""`algorithm = "sft"`: its config block (`BLOCKS`, registered in jaxrl.algorithms.tasks; the task:
jaxrl.algorithms.sft_task). No jax here: configs import this module."""

from __future__ import annotations

import dataclasses

from jaxrl.utils.typed_config import Block, setting

__all__ = ["BLOCKS", "SFTDataConfig"]


@dataclasses.dataclass(frozen=True)
class SFTDataConfig(Block):
    source: str = setting("synthetic", doc="synthetic (arithmetic progressions) | jsonl")
    path: str = setting("", doc="jsonl: one {'input_ids': [...], 'loss_mask': [...]} per line")
    seq_len: int = setting(2048, doc="rows are cut / right-padded to it")
    pack: bool = setting(False, doc="pack a step's sequences end to end into rows of one of the lengths "
                         "seq_len x {1/4, 3/8, 1/2, 5/8, 3/4, 1} (jaxrl.algorithms.sft_task); per-token losses "
                         "unchanged")


# the blocks a run of sft has, in the order its family config lists them (registered in
# jaxrl.algorithms.tasks)
BLOCKS = {"data": SFTDataConfig}
