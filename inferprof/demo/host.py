"""The demo process's host side: keeping freed heap memory, and what ``/healthz`` reports
of the process (page faults, CPU per thread) for the overhead benchmark.

Keeping freed memory instead of handing it back to the kernel:

The demo model allocates its activations afresh every batch (a few MiB each on the
``small`` model). With glibc's defaults, blocks that large are either ``mmap``-ed and
unmapped again or trimmed off the top of the heap when freed, so the next batch touches
fresh pages and takes a minor page fault for each (the kernel zeroes every one).
Measured on the demo (docs/overhead.md, "Page faults in the model"): 63 faults per
request, about 11% of the model thread's CPU, and the count moves with any other
allocation in the process: beside inferprof's records it rose to 85 per request and the
model ran ~3% slower, an effect on the allocator, not work inferprof did.

Model runtimes keep their memory for this reason (PyTorch's caching allocator,
ONNX Runtime's arena; CPU serving guides recommend jemalloc or tcmalloc). The demo does
the same with glibc's own knobs: no trimming below ``trim_threshold`` and no ``mmap`` for
blocks under ``mmap_threshold`` (the ``MALLOC_TRIM_THRESHOLD_`` and
``MALLOC_MMAP_THRESHOLD_`` environment variables set the same two values). The cost is
that the process keeps its peak heap.
"""

from __future__ import annotations

import ctypes
import logging
import sys

_log = logging.getLogger(__name__)

# mallopt() parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2, 32 MiB on 64-bit systems.
_DEFAULT_MMAP_THRESHOLD = 32 * 1024 * 1024
_DEFAULT_TRIM_THRESHOLD = 512 * 1024 * 1024


def retain_freed_memory(
    trim_threshold: int = _DEFAULT_TRIM_THRESHOLD,
    mmap_threshold: int = _DEFAULT_MMAP_THRESHOLD,
) -> bool:
    """Ask glibc to keep freed memory for reuse. Returns False (and changes nothing)
    where the C library has no ``mallopt`` or refuses the values (not glibc, not Linux)."""
    if trim_threshold <= 0 or mmap_threshold <= 0:
        raise ValueError("thresholds must be positive byte counts")
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already uses
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; musl's is a stub returning 0.
    if mallopt(_M_MMAP_THRESHOLD, mmap_threshold) != 1:
        _log.info("mallopt(M_MMAP_THRESHOLD) refused; freed memory is returned as before")
        return False
    return mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, by thread name with
    trailing digits dropped (``inferprof-batcher_0`` -> ``inferprof-batcher``); threads
    Python did not start (gRPC's, BLAS's) are summed under ``native``. Empty where
    ``/proc`` is missing."""
    import os
    import re
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid))
        key = re.sub(r"[-_]?\d+$", "", name) if name else "native"
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def minor_faults() -> int:
    """Minor page faults of this process so far (0 where the platform does not say)."""
    try:
        import resource
    except ImportError:
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


__all__ = ["minor_faults", "retain_freed_memory", "thread_cpu_seconds"]
