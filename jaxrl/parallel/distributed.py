"""Multi-host start-up: `jax.distributed.initialize` from launcher flags or environment variables.

    initialize(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=0)   # explicit
    initialize(auto=True)       # let JAX detect the cluster (SLURM, TPU pods, Open MPI, ...)
    initialize()                # reads JAXRL_COORDINATOR_ADDRESS, JAXRL_NUM_PROCESSES, JAXRL_PROCESS_ID,
                                # JAXRL_LOCAL_DEVICE_IDS; does nothing when they are unset (one process)

Must run before anything touches a device. Every process then runs the same program on the same global batch;
each feeds only its own shards (`jax.make_array_from_callback`), and only process 0 writes metrics and files
other than checkpoints (Orbax coordinates checkpoint writes itself).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import jax

_ENV = {"coordinator_address": "JAXRL_COORDINATOR_ADDRESS", "num_processes": "JAXRL_NUM_PROCESSES",
        "process_id": "JAXRL_PROCESS_ID", "local_device_ids": "JAXRL_LOCAL_DEVICE_IDS"}


class DistributedConfigError(ValueError):
    """Incomplete multi-host flags; names the flag / variable that is missing."""


def settings_from(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                  process_id: Optional[int] = None, local_device_ids: Optional[Sequence[int]] = None,
                  environ=None) -> Optional[dict]:
    """The kwargs for `jax.distributed.initialize`, flags first, then environment; None when single-process."""
    environ = os.environ if environ is None else environ
    values = {"coordinator_address": coordinator_address, "num_processes": num_processes,
              "process_id": process_id, "local_device_ids": local_device_ids}
    for key, var in _ENV.items():
        if values[key] in (None, "", []) and environ.get(var):
            values[key] = environ[var]
    if values["coordinator_address"] in (None, ""):
        others = [k for k in ("num_processes", "process_id") if values[k] not in (None, "")]
        if others:
            raise DistributedConfigError(f"--{others[0]} given without --coordinator_address "
                                         f"(or ${_ENV['coordinator_address']})")
        return None
    for key in ("num_processes", "process_id"):
        if values[key] in (None, ""):
            raise DistributedConfigError(f"--coordinator_address is set; --{key} (or ${_ENV[key]}) is required too")
        values[key] = int(values[key])
    if not (0 <= values["process_id"] < values["num_processes"]):
        raise DistributedConfigError(f"--process_id={values['process_id']} must be in [0, --num_processes="
                                     f"{values['num_processes']})")
    ids = values["local_device_ids"]
    if isinstance(ids, str):
        ids = [int(i) for i in ids.split(",") if i.strip()]
    values["local_device_ids"] = list(ids) if ids else None
    return values


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, local_device_ids: Optional[Sequence[int]] = None,
               auto: bool = False) -> bool:
    """Start `jax.distributed` when configured; returns True if it was started (False: single process)."""
    if auto:
        jax.distributed.initialize()
        return True
    settings = settings_from(coordinator_address, num_processes, process_id, local_device_ids)
    if settings is None:
        return False
    jax.distributed.initialize(**{k: v for k, v in settings.items() if v is not None})
    return True


def is_main_process() -> bool:
    return jax.process_index() == 0
