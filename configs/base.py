r"""Base training config: every key the trainer and the chosen algorithm (sft, dpo, grpo, ppo) read.

Algorithm configs start from this one (`config = base.get_config("dpo")`, then set their own values). Run (any
config file, any key overridable on the command line):

    python -m launchers.train --config=configs/base.py --workdir=runs/base \
        --config.model_path=/models/Qwen3.5-4B --config.algorithm=sft --config.data.path=tokens.jsonl \
        --config.data.source=jsonl

Every key, its one default and what it means are declared next to the code that owns it and composed in
jaxrl/algorithms/config.py; a run fills a config's missing keys from there and refuses an unknown one. The
defaults follow the users' earlier stack (the users' report): LoRA r16/alpha32 on all linear projections,
checkpoints every 4 optimizer steps, AdamW with a linear decay, micro-batch 1 x grad_accum 8, bf16 base weights, a
stop after 10 non-finite updates in a row.
"""

import ml_collections

from jaxrl.algorithms.tasks import default_config


def get_config(algorithm: str = "sft") -> ml_collections.ConfigDict:
    """Every key of a run of `algorithm` (sft | dpo | grpo | ppo) at its default."""
    return default_config(algorithm or "sft")
