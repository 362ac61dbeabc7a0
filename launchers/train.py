r"""Train with LoRA (sft, dpo, grpo, ppo, distill: `config.algorithm`); resumes from the newest checkpoint in --workdir.

    python -m launchers.train --config=configs/sft_tiny.py --workdir=/tmp/run
    python -m launchers.train --config=configs/X.py --workdir=DIR --config.optimizer.learning_rate=5e-7 \
        --config.lora.rank=32 --config.lora.alpha=64
    # several hosts (run on each, with its --process_id; or --distributed_auto on SLURM / TPU pods):
    python -m launchers.train --config=... --workdir=... --coordinator_address=10.0.0.1:1234 \
        --num_processes=4 --process_id=0

Writes into the workdir: config.json (the resolved config), metrics.jsonl, tensorboard/, checkpoints/
(adapters/<step>, state/<step>). Rerun the same command to resume from the newest intact checkpoint (a damaged
newer one is moved to checkpoints/corrupt/, with a warning naming its file). A resume with other settings keeps
the earlier settings, with the steps they trained, in config_history.jsonl (jaxrl/train/loop.py).
One writer per workdir: a second `train` on a workdir another process trains in is refused at once, naming its
pid (an advisory lock the kernel releases when that process ends, however it ends).
Ctrl-C (SIGINT) or SIGTERM: the current step finishes, its checkpoint is written, exit status 130 (143); a second
one stops at once. Exit status 0 on success, 3 when training stopped on too many non-finite updates in a row (a
checkpoint was saved first), 1 / 2 for refused work / usage errors (launchers/_main.py; a full disk is one line
naming the file).
"""

from __future__ import annotations

import os
import signal

from absl import app, flags
from ml_collections import config_flags

from jaxrl.parallel import distributed
from jaxrl.train.flags import TrainSettings
from jaxrl.utils import dataclass_flags
from launchers import _main

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config()); --config.key=value overrides.")
_F = dataclass_flags.define_flags(TrainSettings)  # --workdir, --debug_kill_after_step, ...
_DISTRIBUTED = distributed.define_flags()  # --coordinator_address, --num_processes, --process_id, ...

EXIT_NONFINITE = _main.EXIT_NONFINITE


def _kill_hook(kill_after: int, kill_during_save: int):
    if not kill_after and not kill_during_save:
        return None

    def hook(done: int, trainer) -> None:
        if kill_during_save and done == kill_during_save:
            print(f"KILLING during save of step {done}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if kill_after and done == kill_after:
            trainer.ckpt.wait()
            print(f"KILLING after step {done}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _check_reward(config) -> None:
    """An unknown config.reward.name is a usage error here (RewardChoiceError), like an unknown flag value; a
    reward a plug-in registers later is not known yet, so with plug-ins only a built-in name is checked here (a
    plug-in cannot take a built-in's name): one that needs a missing optional package is refused before any plug-in
    or model loads."""
    from jaxrl.rewards.registry import REWARDS
    from jaxrl.rollout.runner import check_reward_choice
    reward = config.get("reward", None) if hasattr(config, "get") else None
    name = reward.get("name", None) if reward is not None and hasattr(reward, "get") else None
    if name and (not config.get("plugins", None) or str(name) in REWARDS):
        check_reward_choice(str(name), {}, flag="--config.reward.name")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    s = dataclass_flags.config_from_flags(TrainSettings, _F)
    if not s.workdir:
        raise app.UsageError("--config and --workdir are required")
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config and --workdir are required")
    try:
        config.keys()
    except OSError as e:  # ml_collections defers a config file that failed to load to its first use
        reason = [line.strip() for line in str(e).splitlines() if line.strip()][-1]
        raise app.UsageError(f"--config={config_flags.get_config_filename(flags.FLAGS['config'])}: "
                             f"{reason}") from None
    _check_reward(config)
    distributed.initialize_from_flags(_DISTRIBUTED)
    from jaxrl.algorithms.run import run_training
    from jaxrl.train.loop import NonFiniteError, check_workdir_free
    check_workdir_free(s.workdir)  # another process trains there: refused now, before a model is loaded
    try:
        result = run_training(config, s.workdir,
                              on_step_end=_kill_hook(s.debug_kill_after_step, s.debug_kill_during_save))
    except NonFiniteError as e:
        _main.fail("train", str(e), EXIT_NONFINITE)
    print(f"done: {result.final_step} steps; checkpoints in {os.path.join(s.workdir, 'checkpoints')}",
          flush=True)


if __name__ == "__main__":
    _main.run(main, interruptible=True)
