"""`make demo` compiles at LLVM -O0 (`launchers/demo.py --quick_compiles`, on by default): the level joins
XLA_FLAGS only when no level is set there, and before any XLA backend has started (XLA reads XLA_FLAGS once,
when its first backend starts, so a flag set later would silently do nothing). A fresh interpreter each, as
`python -m launchers.demo` runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVEL = "--xla_backend_optimization_level"


def run(code: str, xla_flags):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


CHECK = """
import os
from jax._src import xla_bridge
from launchers import demo
assert not xla_bridge._backends, "importing the demo launcher started an XLA backend"
demo._quick_compiles()
import jax
jax.numpy.ones(3).block_until_ready()  # the backend starts here, reading XLA_FLAGS
print(os.environ["XLA_FLAGS"])
"""


@pytest.mark.parametrize("before, after", [
    (None, f"{LEVEL}=0"),
    ("--xla_force_host_platform_device_count=2", f"--xla_force_host_platform_device_count=2 {LEVEL}=0"),
    (f"{LEVEL}=3", f"{LEVEL}=3"),  # the user's own level wins
])
def test_quick_compiles_set_the_level_before_the_backend_starts(before, after):
    assert run(CHECK, before) == after
