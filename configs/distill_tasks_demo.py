r"""On-policy distillation on a reasoning-gym task (jaxrl.demo_tasks, `make demo-tasks`): the student is the tiny
Qwen3.5 after its short SFT (`start_model/`), the teacher the same SFT run continued (`teacher_model/`, merged);
the student samples, the teacher's top-k distribution over each sampled prefix is the target
(`forward_kl_topk`), and the task's own score is logged beside it (`reward_weight` 0: pure distillation).

    python -m launchers.demo_tasks --workdir=demo_tasks_workdir --until=sft
    python -m launchers.train --config=configs/distill_tasks_demo.py:demo=demo_tasks_workdir --workdir=/tmp/kd_rg

Argument (optional): `demo=DIR` (the recipe's folder; default demo_tasks_workdir).
"""

import os

from configs import base
from configs.overrides import parse_overrides
from jaxrl.demo_settings import common_run_settings
from jaxrl.demo_tasks_settings import PATHS, TasksDemoSettings

DEFAULT_DEMO = "demo_tasks_workdir"


def build(start_model, teacher_model, train_problems, s: TasksDemoSettings = TasksDemoSettings()):
    """The recipe's distillation run: the student at `start_model`, the teacher at `teacher_model`."""
    c = base.get_config("distill")
    # the same batch shape, rank and rate as the recipe's GRPO run: the two differ in their signal only
    common_run_settings(c, model_path=start_model, steps=s.distill_steps, checkpoint_every=s.checkpoint_every,
                        learning_rate=s.learning_rate, schedule="constant_with_warmup", warmup_steps=1, rank=8,
                        micro_batch=s.prompts_per_step * s.generations)
    c.model_preset = ""
    c.seed = s.seed
    c.remat = "none"
    d = c.distill
    d.teacher_path = os.fspath(teacher_model)
    d.num_generations = s.generations
    d.prompts_per_step = s.prompts_per_step
    d.max_new_tokens = s.max_new_tokens
    # sampled as GRPO samples (temperature 1): the teacher is trained, so no sharpening is needed (unlike
    # configs/distill_tiny.py's random teacher)
    d.temperature = 1.0
    # the dense top-k target moves a tiny student within a few steps (configs/distill_tiny.py)
    d.loss = "forward_kl_topk"
    d.teacher_top_k = 8
    d.logprob_batch_size = 64
    c.data.source = "problems"
    c.data.problems = os.fspath(train_problems)
    c.data.max_prompt_len = s.max_prompt_len
    c.reward.name = "reasoning_gym"
    return c


def get_config(arg: str = ""):
    o = parse_overrides(arg, ("demo",), {}, {}, "configs/distill_tasks_demo.py")
    demo = os.path.abspath(o.get("demo", DEFAULT_DEMO))
    return build(os.path.join(demo, PATHS["start"]), os.path.join(demo, PATHS["teacher"]),
                 os.path.join(demo, PATHS["train"]))
