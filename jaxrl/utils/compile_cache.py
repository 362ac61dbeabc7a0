"""JAX's persistent compilation cache for every launcher and the GPU benchmarks: a rerun on the same machine
loads each compiled program from disk instead of compiling it again (the 4B/9B train step and the decode
programs take tens of seconds to minutes each; a GPU lease of 15 minutes cannot pay them twice).

    configure(None)        # the default folder, $XDG_CACHE_HOME/jaxrl/xla (or ~/.cache/jaxrl/xla)
    configure("/fast/x")   # another folder (an unwritable one is the user's error)
    configure("none")      # off ("" too, as launchers.sweep spells it)
    CacheSettings          # the setting as every launcher's --compilation_cache flag (launchers/_main.py)

An inherited JAX_COMPILATION_CACHE_DIR wins over all three: jax reads it when it is imported, and whoever set it
(the test suite, a sweep for its points, a cluster script) chose the folder for a reason. The two thresholds
below apply unless their own JAX_* variables are set. Entries are jax's (`<key>-cache` files, plus XLA:GPU's
autotuning results in a subfolder); they are keyed by the program, the compile options, the jax/XLA version
and the device kind, so a stale entry is never used, only left behind: delete the folder to reclaim the space,
or cap it with JAX_COMPILATION_CACHE_MAX_SIZE=bytes (least recently used first out; every write then takes a
file lock and scans the folder, which is why no cap is set here).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

import jax

from jaxrl.utils.dataclass_flags import flag_field

ENV = "JAX_COMPILATION_CACHE_DIR"
OFF = ("none", "")
# Programs that compile faster than this are not written: reading an entry back costs tens of milliseconds, and the
# many tiny programs of eager operations (milliseconds each) would fill the folder for nothing. Below jax's own
# default of 1 s because every process compiles the generation engine's small programs (its inserts and the
# decode weight preparation: 0.1-1 s each at small shapes) again otherwise. The train steps and decode rounds
# take 10 s and more at real shapes.
MIN_COMPILE_TIME_S = 0.2
# No size floor: a small program that took over a second to compile is worth keeping.
MIN_ENTRY_BYTES = 0
_THRESHOLDS = (("jax_persistent_cache_min_compile_time_secs", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                MIN_COMPILE_TIME_S),
               ("jax_persistent_cache_min_entry_size_bytes", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
                MIN_ENTRY_BYTES))


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """The cache folder of a launcher run; its field is every launcher's --compilation_cache (launchers/_main.py;
    jaxrl.utils.dataclass_flags makes the flag)."""

    compilation_cache: Optional[str] = flag_field(None, help=(
        "JAX's persistent compilation cache: a folder, or none. Default $XDG_CACHE_HOME/jaxrl/xla (else "
        "~/.cache/jaxrl/xla); an inherited JAX_COMPILATION_CACHE_DIR wins. A rerun on this machine loads its "
        "compiled programs instead of compiling them again."))


def default_dir() -> str:
    """$XDG_CACHE_HOME/jaxrl/xla, or ~/.cache/jaxrl/xla (the XDG base directory rule)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxrl", "xla")


def resolve(setting: Optional[str]) -> Optional[str]:
    """The folder a setting names (None: the default folder; "none" / "": None, off), ignoring the environment."""
    if setting is None:
        return default_dir()
    if setting.strip().lower() in OFF:
        return None
    return os.path.abspath(os.path.expanduser(setting))


def unwritable(path: str) -> Optional[str]:
    """Why `path` could not be the cache folder (not a folder, or it or its nearest existing parent not
    writable), or None. Checked without creating anything: jax creates the folder at its first compile, so a
    command refused before it compiles leaves nothing behind."""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def configure(setting: Optional[str] = CacheSettings.compilation_cache) -> Optional[str]:
    """Turns jax's persistent cache on at the folder `setting` names (`resolve`) before the first compile;
    returns the folder in use (the inherited JAX_COMPILATION_CACHE_DIR when it is set), or None when off.

    A folder given explicitly that cannot be written raises OSError (one line from a launcher); the default
    folder that cannot be written only logs a warning and leaves the cache off: nobody asked for it."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    path = resolve(setting)
    if path is None:
        return None
    problem = unwritable(path)
    if problem is not None:
        if setting is not None:
            raise OSError(f"--compilation_cache={setting}: {problem}; give a writable folder, or none")
        logging.getLogger(__name__).warning("no persistent compilation cache: %s", problem)
        return None
    for name, env, value in _THRESHOLDS:
        if env not in os.environ:
            jax.config.update(name, value)
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def child_env(setting: Optional[str], env: Optional[dict] = None) -> dict:
    """A copy of `env` (default os.environ) for a subprocess that should use the cache `setting` names: the
    variables jax reads at import. An inherited JAX_COMPILATION_CACHE_DIR is kept."""
    env = dict(os.environ if env is None else env)
    if env.get(ENV):
        return env
    path = resolve(setting)
    if path is None:
        return env
    problem = unwritable(path)
    if problem is not None:
        raise OSError(f"compilation cache {path}: {problem}")
    env[ENV] = path
    for _, name, value in _THRESHOLDS:
        env.setdefault(name, str(value))
    return env
