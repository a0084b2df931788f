"""``inferprof.triton.call()``: a ``network`` stage, and the trace context to send, for a
Triton request the wrapped clients do not make (the ``generate`` / ``generate_stream``
endpoints, or the REST API through httpx, aiohttp, requests...).

It needs no tritonclient: it records the stage as :func:`inferprof.triton.instrument`'s
wrapper does (``_call.begin``) and hands the caller the headers to send, with the stage's
own ``traceparent`` (and ``tracestate``) in them, so Triton's spans nest under the stage.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from inferprof import semconv
from inferprof.triton._call import NetworkCall, begin, with_trace_context

_logger = logging.getLogger(__name__)

PROTOCOLS = ("http", "grpc")


class TritonCall:
    """What :func:`call` returns: ``with`` / ``async with`` it around the request. Entered
    again, it records another stage with headers of its own.

    ``headers``: what to send (set on entering): a copy of the headers given to
    :func:`call`, with the trace context in it when it is propagated.
    """

    __slots__ = ("_attrs", "_call", "_given", "_propagate", "headers")

    def __init__(self, attrs: dict, headers: Mapping[str, str] | None, propagate: bool | str):
        self._attrs = attrs
        self._given = headers
        self._propagate = propagate
        self._call: NetworkCall | None = None
        self.headers: dict[str, str] = dict(headers or {})

    # --- what the caller reports ------------------------------------------------------
    def add_bytes(self, sent: int | None = None, received: int | None = None) -> None:
        """Count bytes sent / received (``inferprof.triton.request_bytes`` /
        ``response_bytes``, their sum in ``inferprof.bytes``); may be called repeatedly,
        e.g. once per streamed chunk."""
        for name, value in (("sent", sent), ("received", received)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self._call is not None:
            self._call.add_bytes(sent, received)

    def set_attribute(self, key: str, value: Any) -> None:
        """An attribute on the ``network`` stage's span."""
        if self._call is not None:
            self._call.set_attributes({key: value})

    # --- context manager --------------------------------------------------------------
    def __enter__(self) -> TritonCall:
        # Each use is a call of its own: nothing of an earlier one's (its stage, its
        # traceparent) may carry over to this one.
        self.headers = dict(self._given or {})
        call = self._call = begin(dict(self._attrs))
        if call is None or call.context is None or self._propagate is False:
            return self
        context = call.context
        if self._propagate is True or context.trace_flags.sampled:
            try:
                self.headers = with_trace_context(self._given, context)
            except Exception:
                _logger.exception("inferprof could not add the trace context to the headers")
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        call = self._call
        if call is not None:
            call.end(exc)
        return False

    async def __aenter__(self) -> TritonCall:
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> Literal[False]:
        return self.__exit__(exc_type, exc, tb)


def call(
    model_name: str,
    *,
    model_version: str | int | None = None,
    protocol: str = "http",
    headers: Mapping[str, str] | None = None,
    propagate: bool | str = True,
) -> TritonCall:
    """See :func:`inferprof.triton.call`."""
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
    if not (isinstance(propagate, bool) or propagate == "sampled"):
        raise ValueError(f"propagate must be True, False or 'sampled', got {propagate!r}")
    if headers is not None and not isinstance(headers, Mapping):
        raise ValueError(f"headers must be a mapping of header names to values, got {headers!r}")
    attrs: dict[str, Any] = {
        semconv.ATTR_TRITON_MODEL_NAME: model_name,
        semconv.ATTR_TRITON_PROTOCOL: protocol,
    }
    if model_version:  # as the wrapped clients: "" (and 0) mean Triton's default version
        attrs[semconv.ATTR_TRITON_MODEL_VERSION] = str(model_version)
    return TritonCall(attrs, headers, propagate)


__all__ = ["TritonCall", "call"]
