"""Command-line entry points (absl apps). Importing this package, as every `python -m launchers.X` does, installs
the log filters the entry points share (`install_log_filters`): one place, the demo included."""

from __future__ import annotations

import logging

# Orbax warns, on every checkpoint manager opened with read_only=True (as every evaluation, export and resume of
# an adapter checkpoint does), that a read-only manager will not save, create or clean up: three lines per
# opened checkpoint, dozens per evaluation, and nothing a user can act on.
_ORBAX_READ_ONLY_NOTICES = ("CheckpointManagerOptions.read_only=True, setting ", "Given directory is read only=")


class OrbaxReadOnlyNotices(logging.Filter):
    """Drops Orbax's read-only notices (only those, only from Orbax's own modules); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" not in record.pathname.replace("\\", "/"):
            return True
        return not record.getMessage().startswith(_ORBAX_READ_ONLY_NOTICES)


_FILTER = OrbaxReadOnlyNotices()


def install_log_filters() -> None:
    """Attach the filters to the logger Orbax writes through (absl's); idempotent."""
    from absl import logging as absl_logging

    # absl's own logger class names the real caller (Orbax's file); a plain logging.getLogger("absl") made
    # before absl is imported would not, and would replace it.
    logger = absl_logging.get_absl_logger()
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


install_log_filters()
