"""The in-process instrumentation: stages, requests, and the runtime that emits their spans.

See ``docs/instrumenting.md``. ``stats()`` reports what the instrumentation emitted and
dropped since ``inferprof.configure()``.
"""

from __future__ import annotations

from typing import Any


def stats() -> Any:
    """A :class:`~inferprof.instrumentation.accounting.StatsSnapshot` (all zero with
    ``mode="off"``); after ``inferprof.shutdown()``, the final counts of the configuration
    it shut down; None when inferprof has not been configured."""
    from inferprof.instrumentation import active

    rt = active.configured_runtime() or active.active_runtime()
    if rt is not None:
        return rt.snapshot()
    final = active.final_stats()
    return final.snapshot() if final is not None else None


__all__ = ["stats"]
