r"""GRPO on a reasoning-gym task (jaxrl.demo_tasks, `make demo-tasks`): the tiny Qwen3.5 after its short SFT
(`start_model/`, partly right) trained with the task's own score_answer as the reward (`reward.name=reasoning_gym`,
partial credit included). The recipe builds it here; to run it alone on a recipe's folder:

    python -m launchers.demo_tasks --workdir=demo_tasks_workdir --until=sft
    python -m launchers.train --config=configs/grpo_tasks_demo.py:demo=demo_tasks_workdir --workdir=/tmp/grpo_rg

Argument (optional): `demo=DIR` (the recipe's folder; default demo_tasks_workdir).
"""

import os

from configs import grpo
from configs.overrides import parse_overrides
from jaxrl.demo_settings import common_run_settings
from jaxrl.demo_tasks_settings import PATHS, TasksDemoSettings

DEFAULT_DEMO = "demo_tasks_workdir"


def build(start_model, train_problems, s: TasksDemoSettings = TasksDemoSettings()):
    """The recipe's GRPO run: the start at `start_model`, the prompts of `train_problems`, the sizes of `s`."""
    c = grpo.get_config("model=tiny")
    # prompts x generations = one micro-batch of 64 rows: one compiled train step
    common_run_settings(c, model_path=start_model, steps=s.grpo_steps, checkpoint_every=s.checkpoint_every,
                        learning_rate=s.learning_rate, schedule="constant_with_warmup", warmup_steps=1, rank=8,
                        micro_batch=s.prompts_per_step * s.generations)
    c.seed = s.seed
    c.remat = "none"
    c.grpo.num_generations = s.generations
    c.grpo.prompts_per_step = s.prompts_per_step
    c.grpo.max_new_tokens = s.max_new_tokens
    c.grpo.temperature = 1.0
    c.grpo.beta = s.grpo_beta
    c.grpo.logprob_batch_size = 64
    c.data.source = "problems"
    c.data.problems = os.fspath(train_problems)
    c.data.max_prompt_len = s.max_prompt_len
    c.reward.name = "reasoning_gym"
    return c


def get_config(arg: str = ""):
    o = parse_overrides(arg, ("demo",), {}, {}, "configs/grpo_tasks_demo.py")
    demo = os.path.abspath(o.get("demo", DEFAULT_DEMO))
    return build(os.path.join(demo, PATHS["start"]), os.path.join(demo, PATHS["train"]))
