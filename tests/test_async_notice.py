"""Sampling ahead says at start when it cannot help (issue 50, item 5): `no_overlap_reason`, logged as one warning
when the rollouts open (a real run on loopback servers: tests/test_fleet.py, async_partial).

Before (main at 2e1e1a6): on a machine where the servers share the trainer's cores, `max_staleness=2` with partial
rollouts ran at 0.62x of synchronous (27 s against 17 s for 12 steps), and nothing said why: rollouts and the update
took turns on the same hardware, and the asynchronous mode only added its thread and copies."""

import pytest

from jaxrl.algorithms.online.rollouts import no_overlap_reason


@pytest.mark.parametrize("backend, servers, platform, cannot", [
    ("server", ("http://127.0.0.1:8001", "http://localhost:8002"), "cpu", True),  # loopback, a CPU trainer
    ("server", ("http://127.0.0.1:8001", "http://gpu-node-2:8000"), "cpu", False),  # one elsewhere: it can overlap
    ("server", ("http://127.0.0.1:8001",), "gpu", False),  # the trainer on accelerators: servers may use others
    ("vllm", ("http://10.0.0.7:8000",), "cpu", False),
])
def test_the_reason_sampling_ahead_cannot_overlap(backend, servers, platform, cannot):
    reason = no_overlap_reason(backend, servers, platform)
    assert (reason is not None) == cannot
    if cannot:
        assert "\n" not in reason and len(reason) < 200
