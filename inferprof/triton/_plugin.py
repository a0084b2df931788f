"""The tritonclient plugin that writes a call's trace context into its request headers.

tritonclient calls a client's one registered plugin with a ``Request`` holding the headers
of every request it is about to send, and sends ``request.headers`` as they are afterwards
(HTTP headers; gRPC metadata). The wrapped ``infer`` methods (``_clients``) set the span
context of the call they are making in ``OUTGOING`` around the client's own method; the
plugin injects it. Other client calls (health, metadata, statistics) get nothing. An
application plugin registered before ``instrument()`` (``BasicAuth``, a custom one) is kept
and runs first.

This module imports tritonclient; ``inferprof.triton.instrument()`` imports it after
checking tritonclient is installed.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from tritonclient.http import InferenceServerClientPlugin
except ImportError:  # tritonclient[grpc] alone
    from tritonclient.grpc import InferenceServerClientPlugin

from inferprof.triton._call import OUTGOING, with_trace_context

_logger = logging.getLogger(__name__)


class TraceContextPlugin(InferenceServerClientPlugin):
    """Injects the trace context of the call being made; ``previous``: the plugin it
    replaced on the client, called first."""

    def __init__(self, previous: Any = None) -> None:
        self.previous = previous

    def __call__(self, request: Any) -> None:
        previous = self.previous
        if previous is not None:
            previous(request)  # the application's plugin: its errors are its own
        context = OUTGOING.get()
        if context is None:
            return
        try:
            # A new dict, not the caller's edited in place (``with_trace_context``).
            request.headers = with_trace_context(request.headers, context)
        except Exception:
            _logger.exception("inferprof could not add trace context to a Triton request")


__all__ = ["TraceContextPlugin"]
