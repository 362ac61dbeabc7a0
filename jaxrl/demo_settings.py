"""The settings of the embedded demo (jaxrl.demo): the stage sizes (`DemoSettings`) and one `launchers.demo` run
(`DemoRunSettings`, whose fields are the launcher's flags; jaxrl.utils.dataclass_flags makes them). A module of its
own, light to import: the launcher defines its flags, and answers --help, without importing every stage of the
pipeline.
"""

from __future__ import annotations

import dataclasses
import os

from jaxrl.utils.dataclass_flags import flag_field
from jaxrl.utils.seeds import seed_field

__all__ = ["DemoRunSettings", "DemoSettings", "MARKER", "STAGES", "PATHS", "common_run_settings"]

MARKER = ".jaxrl-demo"  # in a folder the demo made: what `launchers.demo --fresh` may delete
# The stages in order (jaxrl.demo.Demo has a method of each name); `launchers.demo --until=NAME` stops after one.
STAGES = ("model", "tasks", "warm_up", "rollouts", "pairs", "dpo", "grpo", "exports", "evaluation", "diagnostics",
          "report")
# Where each output lies inside the demo's folder (one home: the demo, and configs/grpo_demo.py that trains on the
# demo's task from another folder).
PATHS = {"pretrained": "pretrained", "m0": "m0", "base": "base_model", "tasks": "tasks",
         "train": "tasks/train.jsonl", "eval": "tasks/eval.jsonl", "sft_data": "tasks/sft.jsonl",
         "rollouts": "rollouts.jsonl", "pairs": "pairs", "dpo": "dpo", "grpo": "grpo", "export": "export",
         "report": "report.html"}


@dataclasses.dataclass
class DemoSettings:
    """Sizes of the demo; `quick` (tests) shrinks every stage."""

    train_problems: int = 192
    eval_problems: int = 128  # halves: dev (selection) and held-out (confirmation)
    samples: int = 8  # K rollouts per training prompt
    max_new_tokens: int = 8
    sft_steps: int = 200
    dpo_steps: int = 48
    dpo_checkpoint_every: int = 8
    # GRPO, like DPO, sits on a plateau for its first ~15-30 updates here (the adapter must learn to carry the
    # requested alphabet from the prompt to the answer) and climbs after; 48 steps = DPO's, so the report
    # compares the two at equal step counts.
    grpo_steps: int = 48
    grpo_checkpoint_every: int = 8
    grpo_learning_rate: float = 3e-3
    grpo_prompts_per_step: int = 8
    grpo_beta: float = 0.04
    eval_samples: int = 4
    seed: int = 0

    @classmethod
    def quick(cls) -> "DemoSettings":
        return cls(train_problems=96, eval_problems=32, sft_steps=120, dpo_steps=16, dpo_checkpoint_every=8,
                   grpo_steps=4, grpo_checkpoint_every=4, eval_samples=2)


@dataclasses.dataclass(frozen=True)
class DemoRunSettings:
    """One `launchers.demo` run: the folder, starting over, the stage sizes, the seed; the fields are the
    launcher's flags (jaxrl.utils.dataclass_flags)."""

    workdir: str = flag_field("demo_workdir", help="Output folder (resumed when it exists).")
    fresh: bool = flag_field(False, help="Delete --workdir first (only a folder the demo made: it holds the demo's "
                             f"{MARKER} mark).")
    quick: bool = flag_field(False, help="Smaller stages (fewer prompts and steps): for tests.")
    seed: int = seed_field(DemoSettings.seed, help="Seed of the tiny model, the tasks and every sampler.")
    until: str = flag_field("", help="Stop after this stage (one of " + ", ".join(STAGES) + "); default: every "
                            "stage. `--until=warm_up` makes the model, the tasks and M0 that configs/grpo_demo.py "
                            "trains on.")
    quick_compiles: bool = flag_field(True, help="Compile with LLVM at -O0 (XLA_FLAGS=--xla_backend_optimization_"
                                      "level=0) unless XLA_FLAGS already sets a level: the demo's programs are tiny, "
                                      "so compiling them is most of its time on a CPU.")

    def demo_settings(self) -> DemoSettings:
        """The stage sizes (`DemoSettings.quick()` with `quick`) with this run's seed."""
        return dataclasses.replace(DemoSettings.quick() if self.quick else DemoSettings(), seed=self.seed)


def common_run_settings(c, *, model_path, steps: int, checkpoint_every: int, learning_rate: float, schedule: str,
                        warmup_steps: int, rank: int, micro_batch: int, accum: int = 1):
    """What every demo run shares: a loaded fp32 tiny model on one device, LoRA alpha = 2 x rank; `c` is a run
    config (configs/base.py and the family configs), changed in place and returned."""
    c.model_preset = ""
    c.model_path = os.fspath(model_path)
    c.dtype = "float32"
    c.steps, c.checkpoint_every, c.keep_checkpoints = steps, checkpoint_every, 2
    c.optimizer.learning_rate, c.optimizer.schedule = learning_rate, schedule
    c.optimizer.warmup_steps, c.optimizer.warmup_ratio, c.optimizer.weight_decay = warmup_steps, 0.0, 0.0
    c.lora.rank, c.lora.alpha = rank, 2.0 * rank
    c.batch.micro_batch_size, c.batch.grad_accum = micro_batch, accum
    c.mesh.shape = (1, 1, 1)  # one device: the tiny model gains nothing from more
    c.logprob_chunk_size = 64
    return c
