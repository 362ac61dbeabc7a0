"""Side-by-side benchmarks (`make bench`: benchmarks.run_all). Importing this package keeps freed host memory mapped
before jax starts, as every launcher does on a CPU-only install (jaxrl.utils.host_memory); the setting is the
process's, so the peer library in the same process runs under it too. `JAXRL_RETAIN_HOST_MEMORY=0` measures with
glibc's defaults; each result says which (`host_memory_retained`)."""

from jaxrl.utils import host_memory

host_memory.retain_freed_memory()
