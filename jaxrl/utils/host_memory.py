"""Host memory for XLA:CPU: keep freed pages mapped, so a program's buffers do not page-fault on every execution.

    from jaxrl.utils import host_memory
    host_memory.retain_freed_memory()      # before jax starts its CPU client; launchers/, benchmarks/, tests do

XLA:CPU allocates every execution's outputs and temporaries afresh through malloc. glibc serves a buffer over its
mmap threshold (at most 32 MiB) with a fresh mmap, and serves XLA's worker threads from per-thread arenas whose
freed tops it hands back to the kernel; either way each execution first-touches its buffers again, one minor
page fault per 4 KiB. Measured on two CPU cores (benchmarks/RESULTS.md, "Host memory"): a [16384, 64] x [64, 1024]
matmul took 65 ms with 18,700 faults a call and 25 ms with the settings below; the forward of the hidden-256
benchmark model (B=4, T=1024) 717-724 ms with 50,000 faults a call and 569-583 ms with 16,000-19,000.

What `retain_freed_memory` sets through glibc's `mallopt` (each alone measured no gain; all three together do):
one arena for every thread (M_ARENA_MAX = 1), no mmap-served allocations (M_MMAP_MAX = 0), and freed memory at
the top of the heap kept up to 2 GiB (M_TRIM_THRESHOLD) instead of returned to the kernel. The arena setting
only reaches threads created afterwards, so it must run before jax creates its CPU client (the first array or
`jax.devices()` call); importing jax is fine.

It applies only where it pays and costs nothing: Linux with glibc, and an install whose only jax backend is the
CPU (`JAX_PLATFORMS` naming only "cpu", or no GPU / TPU plugin installed). On an accelerator host the device
allocator holds the big buffers, and keeping freed host memory would keep, for example, a checkpoint's
host-side copy resident. `JAXRL_RETAIN_HOST_MEMORY=0` turns it off, `=1` forces it on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import sys

ENV_SWITCH = "JAXRL_RETAIN_HOST_MEMORY"

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest value mallopt's int takes: 2 GiB

# Distributions that give jax a non-CPU backend (their presence means an accelerator host).
_ACCELERATOR_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt", "jax-cuda13-pjrt",
                        "jax-rocm60-plugin", "jax-rocm7-plugin", "libtpu", "libtpu-nightly", "jax-metal")

_applied: bool | None = None  # None: not decided yet; afterwards what the first call decided


def cpu_only_install() -> bool:
    """Whether jax can only run on the CPU here: JAX_PLATFORMS names only "cpu", or no accelerator plugin is
    installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return {p.strip() for p in platforms.split(",") if p.strip()} == {"cpu"}
    for name in _ACCELERATOR_PLUGINS:
        try:
            importlib.metadata.distribution(name)
            return False
        except importlib.metadata.PackageNotFoundError:
            continue
    return True


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # musl and others have no such symbol; their malloc is not glibc's
    except (OSError, AttributeError):
        return None
    return libc


def retain_freed_memory() -> bool:
    """Apply the glibc settings above when they pay (see the module docstring); True when they are in effect.
    Idempotent: later calls return the first call's answer."""
    global _applied
    if _applied is not None:
        return _applied
    switch = os.environ.get(ENV_SWITCH, "").strip()
    if switch not in ("", "0", "1"):
        raise ValueError(f"{ENV_SWITCH}={switch!r}: use 1 (keep freed host memory) or 0 (glibc's defaults)")
    wanted = switch == "1" or (switch == "" and cpu_only_install())
    libc = _glibc() if wanted else None
    _applied = bool(libc is not None
                    and libc.mallopt(_M_ARENA_MAX, 1) == 1
                    and libc.mallopt(_M_MMAP_MAX, 0) == 1
                    and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1)
    return _applied
