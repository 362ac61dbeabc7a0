"""The one way every launcher starts and ends: flags parsed, user errors as one line, interrupts, quiet logs.

    if __name__ == "__main__":
        run(main)                          # a launcher whose work is short, or written atomically at the end
        run(main, interruptible=True)      # one whose loops stop at a safe point on SIGINT / SIGTERM

Exit status (every launcher):

    0    done (and --help)
    1    refused work: an output that already holds other results, a malformed or missing input file, a corrupted
         checkpoint, a resume of other settings, a server that refuses, ... (the message names the file)
    2    usage: an unknown or malformed flag, a bad value, a typo in a config key (the message names it)
    130  SIGINT, 143 SIGTERM: the work stopped at a safe point; the message says how to continue
    (launchers.train: 3 when training stopped on non-finite updates; launchers.sweep: 1 when points failed)

A user error is printed as one line, `<launcher>: <what is wrong>; <what to do>` (messages about a file start
with `file:line:`), without a traceback. What counts as one: the project's own error types (every exception
class defined under jaxrl/) and the standard ValueError / KeyError / TypeError / OSError families raised by the
project's own code (a deliberate `raise`, whose innermost frame is in jaxrl/ or launchers/). Anything else is a
bug and keeps its traceback; --verbose prints the traceback of every error.

Quiet by default: INFO records of the libraries (absl logging from Orbax, jax, ...) are dropped unless
--verbose; the project's own INFO lines (progress with ETA, "resumed from ...") and every warning stay.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from typing import Callable, Optional

from absl import app, flags

from jaxrl.utils import interrupt
from jaxrl.utils.io import damaged_file
from jaxrl.utils.logs import own_file, quiet_libraries

EXIT_REFUSED = 1
EXIT_USAGE = 2

_VERBOSE = flags.DEFINE_bool("verbose", False, "Tracebacks for every error and the libraries' INFO logs "
                             "(Orbax, jax, ...).")

# --verbose is shown by every launcher's --help: run() declares it a key flag of the calling launcher, which absl
# attributes to the first module on the stack that has not disclaimed key flags.
flags.disclaim_key_flags()
_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?")
# Project error classes that are mistakes on the command line (exit 2), by name; every other project error
# class is refused work (exit 1).
_USAGE_TYPES = {"ConfigKeyError", "UnknownAlgorithm", "PluginError", "SweepError", "OptimizerConfigError",
                "MeshConfigError", "DistributedConfigError", "LoRAError", "ConfigError", "UsageError"}


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
    own = _own_class(exc)
    if own is None:
        if not (isinstance(exc, (ValueError, KeyError, TypeError, OSError)) and _raised_by_own_code(exc)):
            return None
        return EXIT_USAGE if type(exc) in (ValueError, TypeError) else EXIT_REFUSED
    if any(c.__name__ in _USAGE_TYPES for c in type(exc).__mro__):
        return EXIT_USAGE
    return EXIT_REFUSED


def message_of(exc: BaseException) -> str:
    """The exception as the line a user reads (a KeyError's str() is the repr of its argument)."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        text = exc.args[0]
    else:
        text = str(exc) or type(exc).__name__
    return text.strip()


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
            fail(name, f"{message_of(e).splitlines()[0]}; see --helpshort", EXIT_USAGE)
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
        if exit_status_of(e) is None and _through_checkpoint_reader(e):
            damage = damaged_file(e)  # a damaged checkpoint file, read by Orbax: a user's file, not a bug
            if damage is not None:
                e = damage
        status = exit_status_of(e)
        if status is None or verbose:
            traceback.print_exc()
        if status is None:
            return EXIT_REFUSED
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
    name = launcher_name(main)
    flags.declare_key_flag("verbose")

    def wrapped(argv):
        return call(main, argv, name, interruptible)

    wrapped.__module__ = getattr(main, "__module__", None)
    app.run(wrapped, flags_parser=_parse(name))
