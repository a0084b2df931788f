"""The SDK's OTLP span exporters, sending bytes from inferprof's encoder (``otlp_encode``).

Same wire messages, a fraction of the CPU per span: the SDK's exporters build one Python
protobuf object per span, attribute and value (docs/overhead.md). What the exporters keep
private (the gRPC translation hook, the HTTP client) is reached through
``_otel_compat``; where it is missing the SDK's own export runs, slower, never wrong.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from inferprof.instrumentation import _otel_compat as compat
from inferprof.instrumentation.accounting import EncodedSpans
from inferprof.instrumentation.otlp_encode import encode_request

_logger = logging.getLogger("inferprof.instrumentation.otlp_encode")


def grpc_span_exporter(**kwargs: Any) -> Any:
    """The SDK's OTLP/gRPC span exporter, encoding with :func:`encode_request`."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    parse = ExportTraceServiceRequest.FromString

    # The gRPC stub wants a message: parsing our bytes (C, upb) costs far less than the
    # SDK's Python-side message building it replaces.
    def translate(data: Any) -> Any:
        if type(data) is EncodedSpans:
            return parse(data.payload)
        return parse(encode_request(data))

    return compat.grpc_span_exporter_class(translate)(**kwargs)


def http_span_exporter(**kwargs: Any) -> Any:
    """The SDK's OTLP/HTTP (protobuf) span exporter, sending :func:`encode_request` bytes
    through its client (its headers, compression, TLS, timeout and retries)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    class FastHTTPSpanExporter(OTLPSpanExporter):
        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            self._send = compat.http_sender(self)
            settle_exporter_environment(self)
            #: the counting exporter may hand it EncodedSpans (bytes built from records)
            self.accepts_encoded = self._send is not None

        def export(self, spans: Any) -> Any:
            if self._send is None:
                return super().export(spans)
            if compat.http_is_shut_down(self):
                _logger.warning("inferprof's OTLP/HTTP exporter is shut down; spans dropped")
                return SpanExportResult.FAILURE
            payload = spans.payload if type(spans) is EncodedSpans else encode_request(spans)
            limit = compat.http_max_request_size(self)
            if 0 < limit < len(payload):
                _logger.warning(
                    "dropping %d spans: their OTLP request is %d bytes, over the exporter's "
                    "max_request_size of %d", len(spans), len(payload), limit
                )
                return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS if self._send(payload) else SpanExportResult.FAILURE

    return FastHTTPSpanExporter(**kwargs)


def settle_exporter_environment(exporter: Any) -> None:
    """:func:`settle_environment` for a session the SDK's OTLP/HTTP exporter made itself
    (1.45 and later: its client's transport's) and its endpoint. Nothing for any other: a
    gRPC exporter, an earlier release (whose posts pass ``verify`` per request, which the
    environment's CA bundle must override), or a session a credential provider supplied
    (``OTEL_PYTHON_EXPORTER_OTLP_*CREDENTIAL_PROVIDER``: it may be shared, with other
    endpoints and with the application, and is not inferprof's to change). Never raises."""
    try:
        if any(name.startswith(_PROVIDER_PREFIX) and name.endswith(_PROVIDER_SUFFIX) and value
               for name, value in os.environ.items()):
            return
        session = compat.http_session(exporter)
        url = compat.http_endpoint(exporter)
        if session is not None and url:
            settle_environment(session, url)
    except Exception:  # left as it was: read at each post
        _logger.exception("inferprof could not read the exporter's environment settings")


_PROVIDER_PREFIX = "OTEL_PYTHON_EXPORTER_OTLP_"
_PROVIDER_SUFFIX = "CREDENTIAL_PROVIDER"


def settle_environment(session: Any, url: str) -> None:
    """Read what a ``requests`` session takes from the environment for ``url`` once, here,
    instead of at every post: its proxy (``HTTPS_PROXY``, ``NO_PROXY``, ...), CA bundle
    (``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``, which win over the session's own, as
    requests has it) and ``.netrc`` credentials. With ``trust_env`` set, requests scans
    ``os.environ`` and looks for a ``.netrc`` file at each request, a large part of the CPU
    of a post (docs/overhead.md). The same settings, read at start-up: a change to the
    environment later is not seen."""
    if not session.trust_env:
        return
    try:
        from requests.utils import get_netrc_auth

        settings = session.merge_environment_settings(url, {}, None, None, None)
        auth = session.auth or get_netrc_auth(url)  # (requests: netrc when no auth)
    except Exception:  # left as it was: read at each post
        _logger.exception("inferprof could not read the exporter's environment settings")
        return
    session.proxies = settings["proxies"]
    session.verify = settings["verify"]
    session.auth = auth
    session.trust_env = False


__all__ = ["grpc_span_exporter", "http_span_exporter", "settle_environment",
           "settle_exporter_environment"]
