"""The one way every launcher starts and ends: flags parsed, user errors as one line, interrupts, quiet logs.

    if __name__ == "__main__":
        run(main)                          # a launcher whose work is short, or written atomically at the end
        run(main, interruptible=True)      # one whose loops stop at a safe point on SIGINT / SIGTERM

Exit status (every launcher): `EXIT_STATUSES` below, sorted by the project's own error types
(`exit_status_table()` renders it; docs/reference/interfaces.md holds that rendering, tests/test_docs.py
compares them).

A user error is printed as one line, `<launcher>: <what is wrong>; <what to do>` (messages about a file start
with `file:line:`), without a traceback. What counts as one: the project's own error types (every exception
class defined under jaxrl/) and the standard ValueError / KeyError / TypeError / OSError families raised by the
project's own code (a deliberate `raise`, whose innermost frame is in jaxrl/ or launchers/), a full disk
wherever it is hit (one line naming the file), and a path the OS refuses wherever it is hit (permission denied, a
read-only file system: e.g. a --workdir or --out whose missing sub-folder lies under a read-only parent; one line
naming the path). Anything else is a bug and keeps its traceback; --verbose prints
the traceback of every error.

Compiled programs persist (jaxrl/utils/compile_cache.py): every launcher takes --compilation_cache=PATH|none
(default $XDG_CACHE_HOME/jaxrl/xla, or ~/.cache/jaxrl/xla), so a rerun on the same machine loads its programs
instead of compiling them; an inherited JAX_COMPILATION_CACHE_DIR wins. A launcher that defines the flag itself
(launchers.sweep: the cache its points share) keeps its own meaning.

Quiet by default: INFO records of the libraries (absl logging from Orbax, jax, ...) are dropped unless
--verbose, and so are the libraries' own reports of a full disk (their background threads log one traceback per
file they could not write; the launcher's one line names the file); the project's own INFO lines (progress with
ETA, "resumed from ...") and every other warning stay.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import Callable, Optional

from absl import app, flags

from jaxrl.utils import compile_cache, dataclass_flags, interrupt
from jaxrl.utils.io import damaged_file, disk_full, refused_path
from jaxrl.utils.logs import LogSettings, note_disk_full, own_file, quiet_libraries

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_NONFINITE = 3  # launchers.train, jaxrl.sweep.point

_VERBOSE = dataclass_flags.define_flags(LogSettings)["verbose"]

# --compilation_cache, defined by run() (not here: launchers.sweep defines a flag of that name with its own meaning,
# and a second definition at import would fail); None when the launcher owns the name or did not start via run().
_COMPILATION_CACHE: Optional[flags.FlagHolder] = None

# --verbose is shown by every launcher's --help: run() declares it a key flag of the calling launcher, which absl
# attributes to the first module on the stack that has not disclaimed key flags.
flags.disclaim_key_flags()
_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?")
# Project error classes that are mistakes on the command line (exit 2), by name; every other project error
# class is refused work (exit 1).
_USAGE_TYPES = {"ConfigKeyError", "UnknownAlgorithm", "PluginError", "SweepError", "OptimizerConfigError",
                "MeshConfigError", "DistributedConfigError", "LoRAError", "ConfigError", "UsageError",
                "RewardChoiceError"}
# Modules whose errors never end a launcher: the OpenAI server answers them as HTTP statuses.
_ANSWERED_INSIDE = ("jaxrl.serve.",)
# Project error classes with a status of their own, by name.
_OWN_STATUS = {"NonFiniteError": EXIT_NONFINITE}

# Every exit status a launcher ends with: (status, meaning). The error types of 1 and 2 are listed by
# exit_status_table() from the project's own exception classes.
EXIT_STATUSES = (
    (0, "done (and --help)"),
    (EXIT_REFUSED, "refused work: an output that holds other results or that another process writes now, a "
                   "malformed, missing or damaged input file or checkpoint, a resume of other settings or of another "
                   "checkpoint, a protocol rule, a full disk, a path the OS refuses (permission denied, a read-only file "
                   "system), a server that refuses (the message names the file); "
                   "launchers.sweep: points failed"),
    (EXIT_USAGE, "usage: an unknown or malformed flag, a bad value, a typo in a config key, an unknown reward or "
                 "reward option, a flag that contradicts the selection being confirmed (the message names it)"),
    (EXIT_NONFINITE, "launchers.train: training stopped on too many non-finite updates in a row (a checkpoint was "
                     "saved first)"),
    (130, "SIGINT: the work stopped at a safe point; the message says how to continue"),
    (143, "SIGTERM: as SIGINT"),
)


# ------------------------------------------------------------------------------------------------ errors


def _own_class(exc: BaseException) -> Optional[type]:
    """The most derived project-defined class of `exc` (defined under jaxrl/ or launchers/), or None."""
    for cls in type(exc).__mro__:
        if cls.__module__.split(".")[0] in ("jaxrl", "launchers"):
            return cls
    return None


def _raised_by_own_code(exc: BaseException) -> bool:
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return last is not None and own_file(last.tb_frame.f_code.co_filename)


def _through_checkpoint_reader(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if f"{os.sep}orbax{os.sep}" in name or f"{os.sep}tensorstore{os.sep}" in name:
            return True
        tb = tb.tb_next
    return False


def exit_status_of(exc: BaseException) -> Optional[int]:
    """EXIT_USAGE / EXIT_REFUSED for a user error (module docstring), None for a bug."""
    if isinstance(exc, (app.UsageError, flags.Error)):
        return EXIT_USAGE
    if disk_full(exc) is not None or refused_path(exc) is not None:
        return EXIT_REFUSED
    own = _own_class(exc)
    if own is None:
        if not (isinstance(exc, (ValueError, KeyError, TypeError, OSError)) and _raised_by_own_code(exc)):
            return None
        return EXIT_USAGE if type(exc) in (ValueError, TypeError) else EXIT_REFUSED
    return _status_of_class(type(exc))


def _status_of_class(cls: type) -> int:
    """The exit status of a project error class (module docstring)."""
    for c in cls.__mro__:
        if c.__name__ in _OWN_STATUS:
            return _OWN_STATUS[c.__name__]
    return EXIT_USAGE if any(c.__name__ in _USAGE_TYPES for c in cls.__mro__) else EXIT_REFUSED


def message_of(exc: BaseException) -> str:
    """The exception as the line a user reads (a KeyError's str() is the repr of its argument)."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        text = exc.args[0]
    else:
        text = str(exc) or type(exc).__name__
    return text.strip()


def project_error_types() -> dict[int, list[str]]:
    """{status: [...]} of EXIT_REFUSED, EXIT_USAGE, EXIT_NONFINITE: the names of the project's own exception
    classes (every module of jaxrl/ imported; the launchers define none) by the exit status a launcher gives
    them."""
    import importlib
    import pkgutil

    import jaxrl
    for info in pkgutil.walk_packages(jaxrl.__path__, "jaxrl."):
        importlib.import_module(info.name)
    found: dict[str, type] = {}
    todo = [BaseException]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.split(".")[0] in ("jaxrl", "launchers"):
            found.setdefault(cls.__name__, cls)
    out: dict[int, list[str]] = {EXIT_REFUSED: [], EXIT_USAGE: [], EXIT_NONFINITE: []}
    for name, cls in sorted(found.items()):
        if issubclass(cls, KeyboardInterrupt) or cls.__module__.startswith(_ANSWERED_INSIDE):
            continue  # interrupt.Interrupted: 130 / 143; the server's request errors: HTTP statuses
        out[_status_of_class(cls)].append(name)
    return out


def exit_status_table() -> str:
    """The Markdown table of EXIT_STATUSES with the error types behind 1 and 2 (docs/reference/interfaces.md)."""
    types = project_error_types()
    extra = {EXIT_REFUSED: "; also OSError / KeyError raised by the project's own checks (a missing file), a full "
                           "disk or a path the OS refuses anywhere",
             EXIT_USAGE: "; also absl's UsageError and flag errors, ValueError / TypeError raised by the project's "
                         "own checks"}
    lines = ["| status | meaning | raised by |", "|---|---|---|"]
    for status, meaning in EXIT_STATUSES:
        raised = ", ".join(f"`{t}`" for t in types.get(status, [])) + extra.get(status, "")
        lines.append(f"| {status} | {meaning} | {raised.lstrip('; ') or '-'} |")
    return "\n".join(lines) + "\n"


def fail(name: str, message: str, status: int) -> None:
    sys.stderr.write(f"{name}: {message}\n")
    sys.stderr.flush()
    raise SystemExit(status)


# ------------------------------------------------------------------------------------------------ flags


def _config_flag_error(exc: BaseException, argv: list) -> str:
    """ml_collections' error for an override of a key that does not exist (an AttributeError / KeyError whose
    text is "'key'\\nDid you mean ...?"), as one line naming the argument."""
    text = message_of(exc).strip("'\"").replace("\\'", "'").replace("\\n", "\n")
    key, _, hint = text.partition("\n")
    key = key.strip("'\"")
    arg = next((a for a in argv[1:] if f".{key}=" in a or f".{key}." in a or a.endswith(f".{key}")), None)
    where = f"{arg.split('=')[0]}: " if arg else ""
    return f"{where}no config key {key!r}" + (f"; {hint.strip()}" if hint.strip() else "")


def _flag_error_line(exc: BaseException) -> str:
    """absl's flag error as one line. A config file that raised while it was read (ml_collections wraps the error
    as "Error whilst parsing config file:" and the whole traceback) is named with the error it raised, e.g.
    "flag --config=configs/dpo.py:pair=x: configs/dpo.py: unknown override key 'pair'; keys: ..."."""
    lines = message_of(exc).splitlines()
    if "Error whilst parsing config file:" in lines[0]:
        raised = next((ln for ln in reversed(lines) if ln.strip() and not ln.startswith(" ")), "")
        reason = raised.split(": ", 1)[1] if ": " in raised and raised.split(": ", 1)[0].isidentifier() else raised
        return lines[0].split("Error whilst parsing config file:")[0].rstrip() + " " + reason.strip()
    return lines[0]


def _asked_for_help(argv: list) -> bool:
    for arg in argv[1:]:
        if arg == "--":
            break
        name, _, value = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name in _HELP_FLAGS and value.lower() not in ("false", "0"):
            return True
    return False


def _parse(name: str) -> Callable[[list], list]:
    def parse(argv: list) -> list:
        try:
            return flags.FLAGS(argv)
        except SystemExit:
            if _asked_for_help(argv):  # absl's --help prints the usage, then exits with status 1
                raise SystemExit(0) from None
            raise
        except flags.Error as e:
            fail(name, f"{_flag_error_line(e)}; see --helpshort", EXIT_USAGE)
        except (AttributeError, KeyError) as e:  # --config.a.b=... naming a key that does not exist
            fail(name, f"{_config_flag_error(e, argv)}; see --helpshort", EXIT_USAGE)
        except (ValueError, TypeError) as e:
            fail(name, f"{message_of(e).splitlines()[0]}; see --helpshort", EXIT_USAGE)
    return parse


# ------------------------------------------------------------------------------------------------ running


def launcher_name(main: Callable) -> str:
    module = getattr(main, "__module__", "") or ""
    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name if spec is not None else os.path.splitext(os.path.basename(sys.argv[0]))[0]
    return module.rsplit(".", 1)[-1]


def call(main: Callable, argv: list, name: str, interruptible: bool) -> int:
    """Runs `main(argv)` under the rules of the module docstring; returns its exit status."""
    verbose = bool(_VERBOSE.value) or os.environ.get("JAXRL_VERBOSE") == "1"
    quiet_libraries(verbose)
    interrupt.install(raise_now=not interruptible)
    try:
        if _COMPILATION_CACHE is not None:  # before main: jax reads the folder at its first compile
            compile_cache.configure(_COMPILATION_CACHE.value)
        status = main(argv)
    except interrupt.Interrupted as e:
        if verbose:
            traceback.print_exc()
        fail(name, f"{signal_line(e.signum)}: {message_of(e)}", e.exit_status)
    except KeyboardInterrupt:
        if verbose:
            traceback.print_exc()
        fail(name, "interrupted (SIGINT); every file is either complete or as it was", interrupt.exit_status(
            signal.SIGINT))
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 (sorted into user errors and bugs)
        full = disk_full(e)
        if full is None and exit_status_of(e) is None and _through_checkpoint_reader(e):
            damage = damaged_file(e)  # a damaged checkpoint file, read by Orbax: a user's file, not a bug
            if damage is not None:
                e = damage
        status = exit_status_of(e)
        if status is None or verbose:
            traceback.print_exc()
        if status is None:
            return EXIT_REFUSED
        if full is not None:
            note_disk_full()  # what the libraries' threads and exit handlers fail on next is its consequence
            fail(name, f"{full}; free space (or write elsewhere) and rerun the same command: it resumes from what "
                       "was written (--verbose: the libraries' tracebacks)", status)
        # the OS refused a path, wherever (pathlib's mkdir, an open): the path in one line; a project error raised
        # from such a refusal keeps its own message
        denied = refused_path(e) if _own_class(e) is None else None
        if denied is not None:
            fail(name, f"{denied}; make it writable (or choose another path) and rerun (--verbose: the traceback)",
                 status)
        fail(name, message_of(e), status)
    signum = interrupt.requested()
    if signum is not None and not status:
        # a signal that arrived while the last piece of work finished: it was not lost
        fail(name, f"{signal_line(signum)}: the work finished first; its outputs are complete",
             interrupt.exit_status(signum))
    return status or 0


def signal_line(signum: int) -> str:
    return f"interrupted ({interrupt.signal_name(signum)})"


def run(main: Callable, *, interruptible: bool = False) -> None:
    """`app.run(main)` with the rules of the module docstring."""
    global _COMPILATION_CACHE
    name = launcher_name(main)
    flags.declare_key_flag("verbose")
    if "compilation_cache" not in flags.FLAGS:
        # defined here, after the launcher's own flags: absl attributes it to the launcher (this module disclaims
        # its flags), so --helpshort lists it
        _COMPILATION_CACHE = dataclass_flags.define_flags(compile_cache.CacheSettings)["compilation_cache"]

    def wrapped(argv):
        return call(main, argv, name, interruptible)

    wrapped.__module__ = getattr(main, "__module__", None)
    app.run(wrapped, flags_parser=_parse(name))
