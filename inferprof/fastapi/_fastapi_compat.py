"""The one place inferprof reads what FastAPI keeps private.

FastAPI (0.120 and later) traces requests itself when OpenTelemetry is installed, from
settings it keeps in ``app._telemetry`` and reads per request (``fastapi/telemetry``).
``tests/fastapi/test_fastapi_compat.py`` asserts that shape against the installed FastAPI,
so a release that changes it fails there instead of leaving two request spans per request.
"""

from __future__ import annotations

from typing import Any


def native_tracing(app: Any) -> dict[str, Any] | None:
    """The app's telemetry settings (a dict with ``"tracing"``), or None where FastAPI
    has none (releases before native telemetry)."""
    config = getattr(app, "_telemetry", None)
    return config if isinstance(config, dict) else None


__all__ = ["native_tracing"]
