"""Multi-host start-up: `jax.distributed.initialize` from launcher flags or environment variables.

    initialize(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=0)   # explicit
    initialize(auto=True)       # let JAX detect the cluster (SLURM, TPU pods, Open MPI, ...)
    initialize()                # reads JAXRL_COORDINATOR_ADDRESS, JAXRL_NUM_PROCESSES, JAXRL_PROCESS_ID,
                                # JAXRL_LOCAL_DEVICE_IDS; does nothing when they are unset (one process)

    holders = define_flags()    # a launcher's --coordinator_address, --num_processes, --process_id,
    initialize_from_flags(holders)   # --local_device_ids, --distributed_auto (train, rollout, evaluate)

Must run before anything touches a device. Training: every process runs the same program on the same global
batch; each feeds only its own shards (`jax.make_array_from_callback`), and only process 0 writes metrics and files
other than checkpoints (every process takes part in an Orbax save; each writes its own shards). Offline rollouts
and evaluation: each process samples its `share` of the problems on its own devices, then they meet at a `barrier`
and process 0 merges the shares.
"""

from __future__ import annotations

import collections
import os
from typing import Optional, Sequence

import jax
from absl import flags
from orbax.checkpoint import multihost

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


# ---------------------------------------------------------------------------------------------------------------
# Launcher flags (name, absl kind, default, help), defined by jaxrl.utils.dataclass_flags.define_table

FLAGS = (
    ("coordinator_address", "string", None, "host:port of process 0 (several processes / hosts)."),
    ("num_processes", "integer", None, "Number of processes (several processes / hosts)."),
    ("process_id", "integer", None, "This process's index in [0, --num_processes)."),
    ("local_device_ids", "string", None, "Comma-separated local device ids this process uses."),
    ("distributed_auto", "bool", False, "Let jax.distributed detect the cluster (SLURM, TPU pods, Open MPI)."),
)
NAMES = tuple(f[0] for f in FLAGS)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, flags.FlagHolder]:
    holders = {}
    for name, kind, default, help_text in FLAGS:
        holders[name] = getattr(flags, f"DEFINE_{kind}")(name, default, help_text, flag_values=flag_values)
    return holders


def initialize_from_flags(holders: dict) -> bool:
    """`initialize` from the parsed flags of `define_flags` (or any {name: holder with .value})."""
    v = {name: holders[name].value for name in NAMES}
    return initialize(v["coordinator_address"], v["num_processes"], v["process_id"], v["local_device_ids"],
                      auto=bool(v["distributed_auto"]))


# ---------------------------------------------------------------------------------------------------------------
# Work split over processes

BARRIER_TIMEOUT_S = 24 * 3600  # a barrier waits for the slowest process's share: hours of sampling at worst
_BARRIERS: collections.Counter = collections.Counter()


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Blocks until every process has reached the barrier `name` (nothing to wait for on one process).

    Every process must call the same barriers in the same order; a name may repeat (each call is numbered)."""
    _BARRIERS[name] += 1
    sync = multihost.get_barrier_sync_fn()  # the jax.distributed coordination service; a no-op on one process
    sync(key=f"jaxrl:{name}:{_BARRIERS[name]}", timeout_ms=int(timeout_s * 1000))


def share(count: int) -> list[int]:
    """The indices in [0, count) that this process handles: every `process_count()`-th, from its index (round
    robin, so long and short items spread evenly; the same split on every restart with as many processes)."""
    return list(range(jax.process_index(), int(count), jax.process_count()))
