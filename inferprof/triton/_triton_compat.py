"""The one place inferprof reads what tritonclient keeps private.

Each has a fallback that costs a figure, never a call: without it the bytes a call sent
are not counted (``inferprof.bytes`` left off) or an async request is taken as ended when
its result is read. ``tests/triton/test_triton_compat.py`` asserts each shape against the
installed tritonclient (pinned ``tritonclient>=2.55``), so an upgrade that changes one
fails there.
"""

from __future__ import annotations

from typing import Any


def http_input_bytes(tensor: Any) -> bytes | None:
    """The bytes an HTTP ``InferInput`` will send in binary form (None: sent as JSON)."""
    getter = getattr(tensor, "_get_binary_data", None)
    return getter() if getter is not None else None


def grpc_input_bytes(tensor: Any) -> bytes | None:
    """The raw contents a gRPC ``InferInput`` will send (None: none set)."""
    getter = getattr(tensor, "_get_content", None)
    return getter() if getter is not None else None


def async_request_greenlet(pending: Any) -> Any:
    """The greenlet an HTTP ``InferAsyncRequest`` runs in (None: unknown)."""
    return getattr(pending, "_greenlet", None)


__all__ = ["async_request_greenlet", "grpc_input_bytes", "http_input_bytes"]
