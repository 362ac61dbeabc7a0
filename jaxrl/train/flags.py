"""The settings of `python -m launchers.train` besides its config file (--config, ml_collections) and the
multi-host flags (jaxrl.parallel.distributed): one dataclass whose fields are the launcher's flags
(jaxrl.utils.dataclass_flags makes them)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxrl.utils.dataclass_flags import flag_field

__all__ = ["TrainSettings"]


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Where a run trains (`workdir` is required with --config; the launcher says so with both names)."""

    workdir: Optional[str] = flag_field(None, help="Run folder: checkpoints, metrics, config.json.")
    # Test-only: prove that a run killed without any clean-up resumes exactly.
    debug_kill_after_step: int = flag_field(0, help="TESTS ONLY: SIGKILL this process after step N (after its "
                                            "pending checkpoint writes have landed).")
    debug_kill_during_save: int = flag_field(0, help="TESTS ONLY: SIGKILL this process right after the checkpoint "
                                             "of step N was started (its write may be unfinished).")
