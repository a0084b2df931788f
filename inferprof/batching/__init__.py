"""Batching: the ``DynamicBatcher`` and the hooks for batchers applications already have.

See ``docs/batching.md``. Submodules are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "DynamicBatcher": "inferprof.batching.dynamic",
    "Collated": "inferprof.batching.dynamic",
    "enqueue": "inferprof.batching.hooks",
    "batch": "inferprof.batching.hooks",
    "current_batch": "inferprof.batching.hooks",
    "set_tokens": "inferprof.batching.hooks",
    "EventDevice": "inferprof.instrumentation.device",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'inferprof.batching' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
