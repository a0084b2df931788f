"""What the demo's ``/healthz`` reports of its own process for the overhead benchmark:
minor page faults, CPU per thread (which thread pays for what) and the time the garbage
collector ran."""

from __future__ import annotations

import gc
import os
import re
import threading
import time


class GcClock:
    """Seconds the garbage collector has run, by generation, timed from ``gc.callbacks``
    (two ``perf_counter()`` calls per collection; the collector holds the GIL throughout,
    so this is the collector's own time unless the OS preempts the process mid-run)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def install(self) -> GcClock:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, by thread name with
    trailing digits dropped (``inferprof-batcher_0`` -> ``inferprof-batcher``); threads
    Python did not start (gRPC's, BLAS's) are summed under ``native``. Empty where
    ``/proc`` is missing."""
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


__all__ = ["minor_faults", "thread_cpu_seconds"]
