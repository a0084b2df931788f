"""inferprof: where each request's time goes, stage by stage, at the tail.

The in-process half (``configure``, ``stage``, the FastAPI middleware, the
batchers) emits OpenTelemetry spans per ``docs/span-contract.md``; the collector
half (``inferprof collect`` / ``inferprof report``) folds them into per-stage
quantiles, tail attribution and a bottleneck verdict.

Heavy or optional pieces are imported on first use, so ``import inferprof`` stays
cheap and works without the optional extras installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from inferprof import semconv
from inferprof._version import __version__

# public name -> module that defines it; resolved lazily by __getattr__.
_LAZY = {
    "configure": "inferprof._config",
    "shutdown": "inferprof._config",
    "stage": "inferprof.instrumentation.stage",
    "request": "inferprof.instrumentation.stage",
    "current_request": "inferprof.instrumentation.stage",
    "Engine": "inferprof.instrumentation.engine",
    "DynamicBatcher": "inferprof.batching.dynamic",
    "enqueue": "inferprof.batching.hooks",
    "batch": "inferprof.batching.hooks",
}

#: subpackages reachable as attributes after ``import inferprof`` alone (imported on first
#: use): ``inferprof.instrumentation.stats()``, ``inferprof.batching.current_batch()``...
_SUBPACKAGES = frozenset(
    (
        "instrumentation", "batching", "fastapi", "triton", "gpu", "collector", "report",
        "demo", "cli",
    )
)

__all__ = ["semconv", "__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    # redundant aliases: names re-exported (resolved lazily by __getattr__ at run time)
    from inferprof._config import configure as configure
    from inferprof._config import shutdown as shutdown
    from inferprof.batching.dynamic import DynamicBatcher as DynamicBatcher
    from inferprof.batching.hooks import batch as batch
    from inferprof.batching.hooks import enqueue as enqueue
    from inferprof.instrumentation.engine import Engine as Engine
    from inferprof.instrumentation.stage import current_request as current_request
    from inferprof.instrumentation.stage import request as request
    from inferprof.instrumentation.stage import stage as stage


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"inferprof.{name}")  # binds inferprof.<name> too
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'inferprof' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # the subpackages too, so that completion offers ``inferprof.fastapi``, ``.gpu``...
    return sorted({*__all__, *_SUBPACKAGES})
