r"""GRPO on the demo's task (jaxrl.demo): the tiny Qwen3.5 after its supervised warm-up (M0, `base_model/`) learns to
answer "in digits" or "in letters" as each prompt asks; reward = the fraction of answer characters in that alphabet
(`reward.name=charset`), so M0 starts near 0.5. The same run as the demo's GRPO stage (the demo builds it here),
with a real tokenizer, chat template and held-out prompts (`tasks/eval.jsonl`) for launchers.evaluate. About 35 s
for 48 steps on two CPU cores.

    python -m launchers.demo --workdir=demo_workdir --until=warm_up     # the model, the tasks and M0 (~50 s)
    python -m launchers.train --config=configs/grpo_demo.py:demo=demo_workdir --workdir=/tmp/grpo_demo
    python -m launchers.evaluate --checkpoints=/tmp/grpo_demo --problems=demo_workdir/tasks/eval.jsonl \
        --reward=charset --max_new_tokens=8 --num_samples=4 --temperature=1.0

Argument (optional): `demo=DIR` (the demo's folder; default demo_workdir, what `make demo` writes).
"""

import os

from configs import grpo
from configs.overrides import parse_overrides
from jaxrl.demo_settings import PATHS, DemoSettings, common_run_settings

DEFAULT_DEMO = "demo_workdir"


def build(base_model, train_problems, s: DemoSettings = DemoSettings()):
    """The demo's GRPO run config: M0 at `base_model`, the prompts of `train_problems`, the stage sizes of `s`."""
    c = grpo.get_config("model=tiny")
    common_run_settings(c, model_path=base_model, steps=s.grpo_steps, checkpoint_every=s.grpo_checkpoint_every,
                        learning_rate=s.grpo_learning_rate, schedule="constant_with_warmup", warmup_steps=1,
                        rank=8, micro_batch=64, accum=s.grpo_prompts_per_step // 8)
    c.remat = "none"
    c.grpo.num_generations = 8
    c.grpo.prompts_per_step = s.grpo_prompts_per_step
    c.grpo.max_new_tokens = s.max_new_tokens
    c.grpo.temperature = 1.0
    c.grpo.beta = s.grpo_beta
    c.grpo.logprob_batch_size = 64
    c.data.source = "problems"
    c.data.problems = os.fspath(train_problems)
    c.data.max_prompt_len = 64
    c.reward.name = "charset"
    return c


def get_config(arg: str = ""):
    o = parse_overrides(arg, ("demo",), {}, {}, "configs/grpo_demo.py")
    demo = os.path.abspath(o.get("demo", DEFAULT_DEMO))
    return build(os.path.join(demo, PATHS["base"]), os.path.join(demo, PATHS["train"]))
