"""The runtime in force: what ``stage()``, ``request()`` and the middleware record into.

``inferprof.configure()`` installs one (:func:`install`); until it runs, an application
that installed an SDK ``TracerProvider`` as the global provider gets a full-mode runtime
built on it, once (inferprof installs nothing); otherwise every API is a cheap no-op.
"""

from __future__ import annotations

import threading
from typing import Any

from inferprof.instrumentation import _otel_compat, config
from inferprof.instrumentation.runtime import Runtime

_lock = threading.Lock()
_runtime: Runtime | None = None
_auto: tuple[Any, Runtime] | None = None  # (global SDK provider, Runtime built on it)
_installed_providers: set[int] = set()  # ids of providers inferprof itself created
#: the counters of the runtime ``shutdown()`` took out last: its final counts stay readable
_final_stats: Any = None


def active_runtime() -> Runtime | None:
    """The runtime stage/request/middleware record into, or None (no-op).

    Hot path: one global read when ``configure()`` ran. Otherwise checks whether the
    application installed an SDK TracerProvider globally, and if so builds (once) a full-mode
    runtime on it.
    """
    rt = _runtime
    if rt is not None:
        return rt if rt.enabled else None
    return _auto_runtime()


def _auto_runtime() -> Runtime | None:
    global _auto
    provider = _otel_compat.global_tracer_provider()
    if provider is None:
        return None
    auto = _auto
    if auto is not None and auto[0] is provider:
        return auto[1]
    from opentelemetry import metrics as metrics_api
    from opentelemetry.sdk.trace import TracerProvider

    if not isinstance(provider, TracerProvider) or id(provider) in _installed_providers:
        return None
    resolved = config.resolve(owns=False)
    if not resolved.enabled:
        return None
    rt = Runtime(resolved, provider, metrics_api.get_meter_provider())
    _auto = (provider, rt)
    return rt


def configured_runtime() -> Runtime | None:
    """The runtime ``configure()`` installed (enabled or not), or None."""
    return _runtime


def current_config() -> config.Config | None:
    """The configuration in force, or None when ``configure()`` has not run."""
    rt = _runtime
    return rt.config if rt is not None else None


def install(rt: Runtime) -> None:
    """Make ``rt`` the runtime in force (``configure()``)."""
    global _runtime
    with _lock:
        _runtime = rt


def uninstall() -> Runtime | None:
    """Take the runtime in force out (``shutdown()``); returns it."""
    global _runtime, _auto, _final_stats
    with _lock:
        rt, _runtime = _runtime, None
        _auto = None
        if rt is not None:
            _final_stats = rt.stats
    return rt


def final_stats() -> Any:
    """The counters of the runtime last shut down (``accounting.Stats``), or None."""
    return _final_stats


def mark_installed(provider: Any) -> None:
    """``provider`` is inferprof's own: never adopted as the application's."""
    _installed_providers.add(id(provider))


def is_installed(provider: Any) -> bool:
    return id(provider) in _installed_providers


__all__ = [
    "active_runtime", "configured_runtime", "current_config", "final_stats", "install",
    "is_installed",
    "mark_installed", "uninstall",
]
