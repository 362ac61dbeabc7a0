"""The settings of the embedded demo (jaxrl.demo): the stage sizes (`DemoSettings`) and one `launchers.demo` run
(`DemoRunSettings`, whose fields are the launcher's flags; jaxrl.utils.dataclass_flags makes them). A module of its
own, light to import: the launcher defines its flags, and answers --help, without importing every stage of the
pipeline.
"""

from __future__ import annotations

import dataclasses

from jaxrl.utils.dataclass_flags import flag_field
from jaxrl.utils.seeds import seed_field

__all__ = ["DemoRunSettings", "DemoSettings", "MARKER"]

MARKER = ".jaxrl-demo"  # in a folder the demo made: what `launchers.demo --fresh` may delete


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
    quick_compiles: bool = flag_field(True, help="Compile with LLVM at -O0 (XLA_FLAGS=--xla_backend_optimization_"
                                      "level=0) unless XLA_FLAGS already sets a level: the demo's programs are tiny, "
                                      "so compiling them is most of its time on a CPU.")

    def demo_settings(self) -> DemoSettings:
        """The stage sizes (`DemoSettings.quick()` with `quick`) with this run's seed."""
        return dataclasses.replace(DemoSettings.quick() if self.quick else DemoSettings(), seed=self.seed)
