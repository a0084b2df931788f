"""The in-process instrumentation: stages, requests, and the runtime that emits their spans.

See ``docs/instrumenting.md``. ``stats()`` reports what the instrumentation emitted and
dropped since ``inferprof.configure()``.
"""

from __future__ import annotations

from typing import Any


def stats() -> Any:
    """A :class:`~inferprof.instrumentation.accounting.StatsSnapshot` (all zero with
    ``mode="off"``), or None when inferprof is not configured."""
    from inferprof import _config

    rt = _config._runtime if _config._runtime is not None else _config.active_runtime()
    return rt.snapshot() if rt is not None else None


__all__ = ["stats"]
