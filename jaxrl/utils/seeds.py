"""The one range of seeds: every seed a config key (`seed`, `model_seed`) or a launcher flag (`--seed`) takes is an
integer in [0, 2**32).

Why 32 bits: jax.random.key keeps a seed's low 32 bits (x64 is off), so seed 2**32 would draw the LoRA factors,
dropout and sampling keys of seed 0, and -1 those of 2**32 - 1, while numpy (data order, bootstrap) draws other
streams for them or refuses a negative one with a traceback; the sampler keys its rows with 32-bit seeds
(jaxrl.generation). Refused with one line naming the key or flag, never aliased.

    seed_problem(value, "seed")     # None, or "seed must be an integer in [0, 2**32), got -1"
    seed: int = seed_field(0, help="...")   # a dataclass flag whose bounds absl checks while it parses
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

from jaxrl.utils.dataclass_flags import flag_field

__all__ = ["SEED_LIMIT", "seed_field", "seed_problem"]

SEED_LIMIT = 2 ** 32


def seed_problem(value: Any, name: str) -> Optional[str]:
    """The problem with `value` as the seed `name` (a config key or flag), or None when it is one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) < SEED_LIMIT:
        return f"{name} must be an integer in [0, 2**32), got {value!r}"
    return None


def seed_field(default: int = 0, *, help: str) -> Any:  # noqa: A002 (the word absl uses)
    """A `flag_field` for a seed: absl refuses a value outside [0, 2**32) while it parses ("flag --seed=-1: -1 is
    not an integer in the range [0, 4294967295]")."""
    return flag_field(default, help=help, bounds=(0, SEED_LIMIT - 1))
