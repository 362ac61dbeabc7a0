"""The command-line entry points (launchers/, the demo) drop Orbax's notices that a checkpoint opened read-only
is read-only (three lines per opened checkpoint) and keep every other warning. Real Orbax, a real checkpoint,
a fresh interpreter as a launcher gets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
import launchers  # what every `python -m launchers.X` (the demo included) imports first
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

with ocp.CheckpointManager(sys.argv[1]) as manager:
    manager.save(1, args=ocp.args.StandardSave({"w": np.ones(3, np.float32)}))
with ocp.CheckpointManager(sys.argv[1], options=ocp.CheckpointManagerOptions(read_only=True)) as reader:
    assert reader.latest_step() == 1
logging.warning("a real warning stays")
import logging as std_logging
std_logging.getLogger("orbax").warning("another logger's warning stays")
"""


def test_orbax_read_only_notices_are_dropped_and_real_warnings_kept(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    printed = out.stdout + out.stderr
    assert "a real warning stays" in printed and "another logger's warning stays" in printed
    assert "read_only" not in printed and "read only" not in printed, printed
