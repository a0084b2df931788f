"""The one place inferprof reads what OpenTelemetry keeps private.

Each use saves real time on a path taken per request or per span, and each has a public
fallback: a release that changes one of these shapes costs speed, never correctness. The
tests (``tests/instrumentation/test_otel_compat.py``) assert every shape, so an upgrade
that changes one fails there, loudly, instead of slowing the service down unnoticed.

Pinned against opentelemetry-api/-sdk/-exporter-otlp 1.30 to 1.45 (pyproject.toml).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace as trace_api
from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
from opentelemetry.sdk.trace import sampling
from opentelemetry.trace.propagation import _SPAN_KEY

#: The context key OpenTelemetry stores the current span under.
SPAN_KEY: str = _SPAN_KEY

# --- the global tracer provider ---------------------------------------------------------

#: Whether the API keeps its global provider in ``trace._TRACER_PROVIDER``.
HAS_GLOBAL_PROVIDER_SLOT = hasattr(trace_api, "_TRACER_PROVIDER")


def _public_global_tracer_provider() -> Any:
    provider = trace_api.get_tracer_provider()
    return None if isinstance(provider, trace_api.ProxyTracerProvider) else provider


#: ``global_tracer_provider()``: the tracer provider the application installed, or None.
#: ``trace.get_tracer_provider()`` reads ``os.environ`` on every call while no provider is
#: set; this runs once per request and stage while inferprof is not configured, so the
#: global is read directly (a C-level ``getattr``, no Python frame).
global_tracer_provider: Callable[[], Any] = (
    functools.partial(getattr, trace_api, "_TRACER_PROVIDER", None)
    if HAS_GLOBAL_PROVIDER_SLOT
    else _public_global_tracer_provider
)


# --- the current context ----------------------------------------------------------------


def _otel_context_var() -> ContextVar[Any] | None:
    runtime = getattr(context_api, "_RUNTIME_CONTEXT", None)
    if type(runtime) is not ContextVarsRuntimeContext:
        return None
    var = getattr(runtime, "_current_context", None)
    return var if isinstance(var, ContextVar) else None


#: The ContextVar behind ``opentelemetry.context`` (its default runtime context), or None
#: when another runtime context is in use. Getting and setting it takes one call where the
#: API takes four (get_current, set_span_in_context, set_value, attach) and two to detach.
OTEL_CONTEXT: ContextVar[Any] | None = _otel_context_var()


@contextlib.contextmanager
def suppressed_instrumentation() -> Iterator[None]:
    """Other instrumentations (grpc, requests, urllib3) do not trace the calls made inside:
    the exporter's own requests must not become spans to export."""
    token = context_api.attach(
        context_api.set_value(context_api._SUPPRESS_INSTRUMENTATION_KEY, True)
    )
    try:
        yield
    finally:
        context_api.detach(token)


# --- the SDK's tracer provider and sampler ----------------------------------------------


def span_processor(provider: Any) -> Any:
    """The SDK provider's composite span processor: inferprof hands it the spans it builds
    at a request's end, as the SDK's own spans hand themselves to it when they end."""
    return provider._active_span_processor


def root_sampler(sampler: Any) -> Any:
    """The sampler a ``ParentBased`` sampler consults for root spans (the SDK exposes no
    accessor); ``sampler`` itself otherwise."""
    if isinstance(sampler, sampling.ParentBased):
        return sampler._root
    return sampler


def static_decision(sampler: Any) -> sampling.Decision | None:
    """The decision of an ``ALWAYS_ON``/``ALWAYS_OFF``-like ``StaticSampler``, else None."""
    if isinstance(sampler, sampling.StaticSampler):
        decision: sampling.Decision = sampler._decision
        return decision
    return None


# --- the SDK's OTLP span exporters ------------------------------------------------------


def grpc_span_exporter_class(translate: Callable[[Any], Any]) -> type:
    """The SDK's OTLP/gRPC span exporter, turning what it is given into the request
    message with ``translate`` instead of its own Python-side encoder."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class FastOTLPSpanExporter(OTLPSpanExporter):
        #: the counting exporter may hand it encoded spans
        accepts_encoded = True

        def _translate_data(self, data: Any) -> Any:
            return translate(data)

    return FastOTLPSpanExporter


def http_sender(exporter: Any) -> Callable[[bytes], bool] | None:
    """``send(payload) -> ok`` through the SDK OTLP/HTTP exporter's client (its headers,
    compression, TLS, timeout and retries), or None where the exporter has none
    (opentelemetry-exporter-otlp-proto-http before 1.40)."""
    client = getattr(exporter, "_client", None)
    export = getattr(client, "export", None)
    if not callable(export) or not hasattr(exporter, "_shutdown"):
        return None

    def send(payload: bytes) -> bool:
        return bool(getattr(export(payload), "success", False))

    return send


def http_session(exporter: Any) -> Any:
    """The ``requests`` session the SDK OTLP/HTTP exporter posts through where it posts
    through its client's transport (1.45 and later), or None."""
    transport = getattr(getattr(exporter, "_client", None), "_transport", None)
    session = getattr(transport, "_session", None)
    return session if hasattr(session, "merge_environment_settings") else None


def http_endpoint(exporter: Any) -> str | None:
    """The URL the SDK OTLP/HTTP exporter posts to, or None."""
    url = getattr(exporter, "_endpoint", None)
    return url if isinstance(url, str) and url else None


def metrics_request_sender(exporter: Any) -> Callable[[Any], bool] | None:
    """``send(ExportMetricsServiceRequest) -> ok`` through the SDK OTLP/HTTP metric
    exporter's own step after its encoder (its client: headers, compression, TLS, timeout,
    retries; its size limit and self-metrics), for a request built without the SDK's
    metric objects; None for any other exporter (gRPC, a subclass, a release without that
    step, one splitting its batches)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter,
        )
        from opentelemetry.sdk.metrics.export import MetricExportResult
    except ImportError:
        return None
    batch = getattr(exporter, "_export_batch", None)
    if (type(exporter) is not OTLPMetricExporter or not callable(batch)
            or not hasattr(exporter, "_shutdown")
            or getattr(exporter, "_max_export_batch_size", None) is not None):
        return None

    def send(request: Any) -> bool:
        if exporter._shutdown:  # (as its export())
            return False
        return batch(request) is MetricExportResult.SUCCESS

    return send


def http_is_shut_down(exporter: Any) -> bool:
    return bool(exporter._shutdown)


def http_max_request_size(exporter: Any) -> int:
    """The HTTP exporter's request size limit in bytes (0: none)."""
    return int(getattr(exporter, "_max_request_size", 0) or 0)


__all__ = [
    "HAS_GLOBAL_PROVIDER_SLOT", "OTEL_CONTEXT", "SPAN_KEY", "global_tracer_provider",
    "grpc_span_exporter_class", "http_endpoint", "http_is_shut_down", "http_max_request_size",
    "http_sender", "http_session", "metrics_request_sender", "root_sampler", "span_processor",
    "static_decision", "suppressed_instrumentation",
]
