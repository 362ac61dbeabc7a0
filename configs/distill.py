r"""On-policy distillation with LoRA: a Qwen3.5 4B student taught by the 9B (the same tokenizer), one family file.

    python -m launchers.train --config=configs/distill.py:OVERRIDES --workdir=DIR [--config.key=value ...]

OVERRIDES (comma-separated key=value; `--config.x=y` flags win over them):

    model=4b|9b (the student)  start=base|m0 (as configs/grpo.py)  teacher=PATH (distill.teacher_path; default $JAXRL_QWEN35_9B_BASE)
    loss=reverse_kl|jsd|forward_kl_topk   k=16 (distill.teacher_top_k)   lmbda=1.0   sft=PATH (distill.sft_path)
    lr=1e-6   lora=r16|r32   gens=8 (num_generations)   prompts=20   max_new_tokens=4096   prompt_len=2048
    steps=N   mb=M   problems=PATH (data.problems)   reward_weight=0.0

model_path comes from `--config.model_path=` or JAXRL_QWEN35_4B_BASE / JAXRL_QWEN35_9B_BASE (as configs/grpo.py);
data.problems from `problems=`. Defaults: 20 prompts x 8 samples x 4,096 tokens, one on-policy update per rollout
(prompts x gens = the global batch), the code verifier's reward computed and logged (reward_weight 0: pure
distillation). Guide: docs/guides/distillation.md.
"""

import os

import ml_collections

from configs import base, grpo, overrides
from configs.overrides import choice

KEYS = ("model", "start", "teacher", "loss", "k", "lmbda", "sft", "lr", "lora", "gens", "prompts", "max_new_tokens",
        "prompt_len", "steps", "mb", "problems", "reward_weight")
WHERE = "configs/distill.py"


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    o = overrides.parse_overrides(arg, KEYS, {}, {}, WHERE)
    c = base.get_config("distill")
    grpo.model_block(c, o, WHERE)
    c.steps = int(o.get("steps", 125))
    d = c.distill
    d.teacher_path = o.get("teacher", os.environ.get("JAXRL_QWEN35_9B_BASE", ""))
    d.loss = choice("loss", o.get("loss", "reverse_kl"), ("reverse_kl", "jsd", "forward_kl_topk"), WHERE)
    d.teacher_top_k = int(o.get("k", 16))
    d.lmbda = float(o.get("lmbda", 1.0))
    d.sft_path = o.get("sft", "")
    d.reward_weight = float(o.get("reward_weight", 0.0))
    d.num_generations = int(o.get("gens", 8))
    d.prompts_per_step = int(o.get("prompts", 20))
    d.max_new_tokens = int(o.get("max_new_tokens", 4096))
    d.temperature = 1.0
    d.logprob_batch_size = 8
    grpo.rollout_batch(c, d.num_generations * d.prompts_per_step, o, WHERE)
    return grpo.code_problems(c, o)
