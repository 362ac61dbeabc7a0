"""Command-line entry points (absl apps). Importing this package, as every `python -m launchers.X` does, installs
the log filter the entry points share (jaxrl.utils.logs: Orbax's read-only notices dropped); each entry point
starts through launchers._main.run (one-line errors, exit statuses, interrupts, quiet library logs)."""

from __future__ import annotations

from jaxrl.utils.logs import OrbaxReadOnlyNotices, install_log_filters

__all__ = ["OrbaxReadOnlyNotices", "install_log_filters"]

install_log_filters()
