"""The settings of the reasoning-gym recipe (jaxrl.demo_tasks, `make demo-tasks`): the stage sizes
(`TasksDemoSettings`) and one `launchers.demo_tasks` run (`TasksDemoRunSettings`, whose fields are the launcher's
flags). Light to import, as jaxrl.demo_settings: the launcher answers --help without importing the pipeline.
"""

from __future__ import annotations

import dataclasses
import json

from jaxrl.utils.dataclass_flags import flag_field
from jaxrl.utils.seeds import seed_field

__all__ = ["PATHS", "STAGES", "TasksDemoRunSettings", "TasksDemoSettings"]

# The stages in order (jaxrl.demo_tasks.TasksDemo has a method of each name).
STAGES = ("tasks", "model", "sft", "grpo", "distill", "evaluation", "report")
PATHS = {"tasks": "tasks", "train": "tasks/train.jsonl", "splits": "tasks/splits", "sft_data": "tasks/sft.jsonl",
         "pretrained": "pretrained", "sft": "sft", "start": "start_model", "teacher": "teacher_model",
         "grpo": "grpo", "distill": "distill", "summary": "recipe.json", "results": "results.md"}


def _parse_config(value) -> dict:
    parsed = json.loads(value) if isinstance(value, str) else dict(value)
    if not isinstance(parsed, dict):
        raise ValueError(f"--task_config: expected a JSON object, got {value!r}")
    return parsed


@dataclasses.dataclass
class TasksDemoSettings:
    """Sizes of the recipe; `quick` (the heavy test) shrinks the training stages."""

    # spell_backward on 3-4 letter words: reversing is one rule that transfers to words never seen (held-out
    # words are new ones), the answer is a few characters (a short decode on a CPU), and the task's own scorer
    # gives partial credit per letter in place, so GRPO has a signal from a partly-right start (see
    # docs/guides/tasks.md, "The CPU recipe", for the measurement behind the choice).
    task: str = "spell_backward"
    task_config: dict = dataclasses.field(default_factory=lambda: {"min_word_len": 3, "max_word_len": 4})
    # no system message (the importer's --system_prompt=''): a tiny model reads no instructions (the SFT rows teach
    # it the answer format), and 60 fewer tokens a row make every training step about a third cheaper
    system_prompt: str = ""
    train_problems: int = 2000
    eval_problems: int = 400  # halves: dev (selection) and held-out (confirmation)
    max_new_tokens: int = 24  # "<answer>" + 4 letters + "</answer>" + <|im_end|> = 22 tokens
    max_prompt_len: int = 160
    # one SFT run: its checkpoint at start_steps is the start (partly right), at teacher_steps the teacher
    # measured on dev (seed 0, 195 problems, greedy): step 200 0.5% exact (partial 0.29), step 300 9% (0.56),
    # step 400 50% (0.84): the start is partly right, the teacher right on half the words
    start_steps: int = 300
    teacher_steps: int = 400
    sft_micro_batch: int = 32
    sft_learning_rate: float = 3e-3
    grpo_steps: int = 32
    distill_steps: int = 32
    checkpoint_every: int = 8
    learning_rate: float = 3e-3
    prompts_per_step: int = 8
    generations: int = 8
    grpo_beta: float = 0.04
    eval_samples: int = 1  # greedy: accuracy as reasoning-gym's evaluations report it
    eval_temperature: float = 0.0
    select_metric: str = "strict_rate"
    seed: int = 0

    @classmethod
    def quick(cls) -> "TasksDemoSettings":
        return cls(train_problems=1000, eval_problems=128, grpo_steps=8, distill_steps=8, checkpoint_every=4)


@dataclasses.dataclass(frozen=True)
class TasksDemoRunSettings:
    """One `launchers.demo_tasks` run; the fields are the launcher's flags (jaxrl.utils.dataclass_flags)."""

    workdir: str = flag_field("demo_tasks_workdir", help="Output folder (resumed when it exists).")
    quick: bool = flag_field(False, help="Fewer problems and steps: for the test.")
    seed: int = seed_field(TasksDemoSettings.seed, help="Seed of the tiny model, the generated problems and every "
                           "sampler.")
    task: str = flag_field(TasksDemoSettings.task, help="The reasoning-gym task.")
    task_config: dict = flag_field(default_factory=lambda: TasksDemoSettings().task_config, parse=_parse_config,
                                   help="The task's own config, JSON (the keys of its config class).")
    start_steps: int = flag_field(0, help="SFT steps of the start (0: the recipe's default).")
    teacher_steps: int = flag_field(0, help="SFT steps of the teacher (0: the recipe's default).")
    until: str = flag_field("", help="Stop after this stage (one of " + ", ".join(STAGES) + ").")
    quick_compiles: bool = flag_field(True, help="Compile with LLVM at -O0 unless XLA_FLAGS sets a level "
                                      "(as launchers.demo).")

    def demo_settings(self) -> TasksDemoSettings:
        s = TasksDemoSettings.quick() if self.quick else TasksDemoSettings()
        changes = dict(seed=self.seed, task=self.task, task_config=dict(self.task_config))
        changes.update({k: getattr(self, k) for k in ("start_steps", "teacher_steps") if getattr(self, k)})
        return dataclasses.replace(s, **changes)
