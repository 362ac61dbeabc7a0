"""The settings the training core owns: the optimizer, the batch, logging, the EMA of the adapter, and the run-level
keys the Trainer reads (`RunSettings`, a part of every run's config: jaxrl.algorithms.config.TrainConfig).

    OptimizerConfig.learning_rate            # the one default of `optimizer.learning_rate`
    make_optimizer(config.optimizer, steps)  # jaxrl.train.optim acts on it

No jax here: configs import this module (through jaxrl.algorithms.config).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

from jaxrl.parallel.settings import MeshConfig
from jaxrl.utils.seeds import seed_problem
from jaxrl.utils.typed_config import Block, setting

__all__ = ["BatchConfig", "EMAConfig", "LoggingConfig", "OptimizerConfig", "OptimizerConfigError", "RunSettings",
           "SCHEDULES", "TrainerConfig", "WANDB_MODES"]

SCHEDULES = ("linear", "constant_with_warmup", "cosine", "constant")
WANDB_MODES = ("", "online", "offline", "disabled")


class OptimizerConfigError(ValueError):
    """An `optimizer.*` config value we cannot use; names the key."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Block):
    name: str = setting("adamw", doc="only adamw")
    learning_rate: float = setting(1e-6, doc="peak learning rate")
    schedule: str = setting("linear", doc="linear | constant_with_warmup | cosine | constant")
    warmup_steps: int = setting(0, doc="takes precedence over warmup_ratio when > 0")
    warmup_ratio: float = setting(0.0)
    weight_decay: float = setting(0.0)
    b1: float = setting(0.9)
    b2: float = setting(0.999)
    eps: float = setting(1e-8)
    max_grad_norm: float = setting(1.0, doc="global-norm clipping; <= 0 disables")

    def __post_init__(self):
        if self.name != "adamw":
            raise OptimizerConfigError(f"optimizer.name={self.name!r}; only 'adamw' is implemented")
        if self.schedule not in SCHEDULES:
            raise OptimizerConfigError(f"optimizer.schedule={self.schedule!r}; choose one of {SCHEDULES}")
        if not self.learning_rate >= 0:
            raise OptimizerConfigError(f"optimizer.learning_rate must be >= 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise OptimizerConfigError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps == 0 and not 0.0 <= self.warmup_ratio <= 1.0:
            raise OptimizerConfigError(f"optimizer.warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class BatchConfig(Block):
    micro_batch_size: int = setting(1, doc="rows per forward/backward (a step: micro_batch_size x grad_accum rows)")
    grad_accum: int = setting(8, doc="micro-batches summed into one update")

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step."""
        return self.micro_batch_size * self.grad_accum


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Block):
    """Where a run's metrics go besides metrics.jsonl (and TensorBoard): Weights & Biases (jaxrl.train.wandb_log)."""

    wandb_project: str = setting("", doc="W&B project: metrics lines, config and artefact paths mirrored to W&B "
                                 "(process 0; the wandb extra); '' = off")
    wandb_entity: str = setting("", doc="W&B team or user; '' = the account's default")
    wandb_run_name: str = setting("", doc="'' = the workdir's folder name")
    wandb_group: str = setting("", doc="W&B group of the run")
    wandb_tags: tuple = setting((), tuple, "W&B tags of the run")
    wandb_mode: str = setting("", doc="'' (WANDB_MODE, else online) | online | offline (local files; `wandb sync` "
                              "uploads them) | disabled", choices=WANDB_MODES)
    wandb_dir: str = setting("", doc="folder of the W&B run files ('' = the workdir)")


@dataclasses.dataclass(frozen=True)
class EMAConfig(Block):
    """An exponential moving average of the LoRA factors, kept in the training state and written beside each adapter
    checkpoint as its own adapter (checkpoints/ema/<step>; evaluated as ema_<step>)."""

    decay: Optional[float] = setting(
        None, (float, type(None)),
        "None: off. d in [0, 1): after every applied update each LoRA factor's EMA becomes d * ema + (1 - d) * factor "
        "(A and B each; from the initial factors; a skipped update leaves it). Its update B_ema A_ema is not the EMA of "
        "the updates B A (an exact one has no fixed rank: a dense [out, in] fp32 matrix per module); for the exact "
        "mean of checkpoints' updates use launchers.export --average. d = 0 is the last checkpoint itself")

    def __post_init__(self):
        if self.decay is not None and not 0.0 <= self.decay < 1.0:
            raise ValueError(f"ema.decay must be in [0, 1) (or None: off), got {self.decay}")
        super().__post_init__()


# the blocks of RunSettings (`optimizer.*`, `batch.*`, `logging.*`, `ema.*`), in config.json's order among the
# run's core blocks (jaxrl.algorithms.config.CORE_BLOCKS)
TRAIN_BLOCKS = {"optimizer": OptimizerConfig, "batch": BatchConfig, "logging": LoggingConfig, "ema": EMAConfig}


@dataclasses.dataclass(frozen=True)
class RunSettings(Block):
    """The run-level keys the training loop (jaxrl.train.loop.Trainer) reads: how long, how often a checkpoint, how
    many kept, the stop rule for non-finite updates, logging; and its blocks (TRAIN_BLOCKS). A run's config is
    composed of this part and the others (jaxrl.algorithms.config.TrainConfig)."""

    steps: int = setting(125, doc="train steps (global batches); the schedule's length")
    checkpoint_every: int = setting(4, doc="adapter + training state every N steps (and at the end)")
    keep_checkpoints: Optional[int] = setting(2, (int, type(None)), "full training states kept (adapters are all "
                                              "kept); None: all")
    checkpoint_async: bool = setting(True, doc="write checkpoints in the background")
    seed: int = setting(0, doc="LoRA init, dropout, data order")
    max_consecutive_nonfinite: int = setting(10, doc="stop (with a checkpoint) after this many skipped updates in "
                                             "a row; 0 never")
    log_every: int = setting(1, doc="console log cadence when not on a terminal (metrics.jsonl gets every step)")
    tensorboard: bool = setting(True, doc="TensorBoard event files beside metrics.jsonl")
    logprob_chunk_size: int = setting(512, doc="rows per chunk of the chunked log-prob over the vocab")
    compile_options: dict = setting({}, dict, "XLA options of every jitted program of the run (normally none)")
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    batch: BatchConfig = dataclasses.field(default_factory=BatchConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    ema: EMAConfig = dataclasses.field(default_factory=EMAConfig)

    def run_problems(self) -> list[str]:
        """What is wrong with the run-level keys, one message each (the composed config raises them together)."""
        bad = []
        for key, minimum in (("steps", 1), ("batch.micro_batch_size", 1), ("batch.grad_accum", 1),
                             ("checkpoint_every", 1), ("log_every", 1), ("max_consecutive_nonfinite", 0)):
            value: Any = self
            for part in key.split("."):
                value = getattr(value, part)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                bad.append(f"{key} must be an integer >= {minimum}, got {value!r}")
        keep = self.keep_checkpoints
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            bad.append(f"keep_checkpoints must be an integer >= 1 (or None to keep all), got {keep!r}")
        return bad + [m for m in (seed_problem(self.seed, "seed"),) if m]


class TrainerConfig(Protocol):
    """What the training loop (jaxrl.train.loop) reads of a run's config: the keys of `RunSettings`, the mesh, what
    its checkpoints record of the model (`model_path`, `algorithm`), and config.json (`to_json`; a config.json an
    earlier version wrote, `restate`d as this version writes the same settings). The run's config,
    jaxrl.algorithms.config.TrainConfig, is one; the loop never reads an algorithm's blocks."""

    algorithm: str
    model_path: str
    steps: int
    checkpoint_every: int
    keep_checkpoints: Optional[int]
    checkpoint_async: bool
    seed: int
    max_consecutive_nonfinite: int
    log_every: int
    tensorboard: bool
    compile_options: dict
    optimizer: OptimizerConfig
    batch: BatchConfig
    logging: LoggingConfig
    ema: EMAConfig
    mesh: MeshConfig

    def to_json(self) -> dict: ...

    def restate(self, written: dict) -> dict: ...
