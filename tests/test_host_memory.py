"""jaxrl.utils.host_memory: when the glibc settings apply, and that they stop XLA:CPU's page faults per execution."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl.utils import host_memory

# A matmul with a 64 MiB output, run 10 times in a fresh process; prints the minor page faults per call.
_FAULTS_PER_CALL = r"""
import resource, sys
from jaxrl.utils import host_memory
applied = host_memory.retain_freed_memory()
import jax, jax.numpy as jnp
mm = jax.jit(lambda a, b: a @ b)
a, b = jnp.ones((16384, 64)), jnp.ones((64, 1024))
mm(a, b).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    mm(a, b).block_until_ready()
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def _faults(switch: str) -> tuple[bool, float]:
    env = {**os.environ, host_memory.ENV_SWITCH: switch, "XLA_FLAGS": ""}
    out = subprocess.run([sys.executable, "-c", _FAULTS_PER_CALL], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    return json.loads(out[-2].lower()), float(out[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_retained_memory_removes_most_page_faults_of_each_execution():
    applied, retained = _faults("1")
    off, default = _faults("0")
    assert applied and not off
    # 64 MiB of fresh pages is 16,384 faults a call under glibc's defaults; kept mapped, a few thousand remain.
    assert default > 12_000, default
    assert retained < default / 2, (retained, default)


def test_cpu_only_install_follows_jax_platforms(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.cpu_only_install()
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not host_memory.cpu_only_install()
    monkeypatch.delenv("JAX_PLATFORMS")
    assert host_memory.cpu_only_install()  # this test machine has no GPU / TPU plugin installed


def test_a_malformed_switch_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv(host_memory.ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match=host_memory.ENV_SWITCH):
        host_memory.retain_freed_memory()
