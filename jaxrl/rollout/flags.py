"""The command-line flags of `python -m launchers.rollout`: one per RolloutConfig field (its name, type, default and
help are declared on the field; jaxrl.utils.dataclass_flags makes the flag), plus the flags of the backends'
option blocks (--server_<key>, --vllm_<key>, the deprecated --backend_kwargs: jaxrl.backends.flags) and the
distributed flags (--coordinator_address, ...).

    holders = define_flags()          # {name: absl FlagHolder}
    cfg = build_config(holders)       # after absl parsed them; app.UsageError naming the flag on a bad value
    NAMES                             # every flag name
"""

from __future__ import annotations

from absl import flags

from jaxrl.parallel.distributed import FLAGS as DISTRIBUTED_FLAGS
from jaxrl.backends.flags import BACKEND_FLAGS, backend_options, check_backend
from jaxrl.rollout.runner import RolloutConfig
from jaxrl.utils import dataclass_flags

__all__ = ["NAMES", "build_config", "define_flags"]

# the flags that are not RolloutConfig fields: --server_<key> / --vllm_<key> (they make its `server` / `vllm`),
# --backend_kwargs (deprecated), --coordinator_address, ...
_OTHER_FLAGS = BACKEND_FLAGS + DISTRIBUTED_FLAGS
NAMES = dataclass_flags.flag_names(RolloutConfig) + tuple(f[0] for f in _OTHER_FLAGS)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, flags.FlagHolder]:
    """Defines every flag of launchers.rollout in `flag_values`; returns their holders by name."""
    holders = dataclass_flags.define_flags(RolloutConfig, flag_values)
    holders.update(dataclass_flags.define_table(_OTHER_FLAGS, flag_values))
    return holders


def build_config(holders: dict[str, flags.FlagHolder]) -> RolloutConfig:
    """The RolloutConfig of the parsed flags; app.UsageError for a missing --problems / --model / --out or a bad
    value, a backend option that does not fit --backend (nothing is loaded or written here)."""
    dataclass_flags.check_required(RolloutConfig, holders)
    cfg = dataclass_flags.config_from_flags(RolloutConfig, holders, **backend_options(holders))
    check_backend(cfg)
    return cfg
