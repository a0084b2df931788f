"""The shapes of OpenTelemetry's private names ``_otel_compat`` relies on.

Each test fails when an OpenTelemetry release changes one: inferprof would then still
work (each use has a public fallback) but slower or, for the exporters, through the SDK's
own encoder. Fix ``inferprof/instrumentation/_otel_compat.py`` and the pinned range.
"""

from __future__ import annotations

from opentelemetry import context as context_api
from opentelemetry import trace as trace_api
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExp
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExp
from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inferprof.instrumentation import _otel_compat as compat


def test_the_global_tracer_provider_is_read_from_its_slot():
    assert compat.HAS_GLOBAL_PROVIDER_SLOT
    provider = trace_api._TRACER_PROVIDER
    assert compat.global_tracer_provider() is provider


def test_the_current_context_is_the_context_variable_behind_the_api():
    var = compat.OTEL_CONTEXT
    assert var is not None
    token = context_api.attach(context_api.set_value("inferprof-test", 1))
    try:
        assert var.get() is context_api.get_current()
        assert var.get().get("inferprof-test") == 1
    finally:
        context_api.detach(token)


def test_the_span_key_is_where_the_api_keeps_the_current_span():
    span = trace_api.NonRecordingSpan(trace_api.INVALID_SPAN_CONTEXT)
    ctx = trace_api.set_span_in_context(span)
    assert ctx[compat.SPAN_KEY] is span
    assert trace_api.get_current_span(context_api.Context({compat.SPAN_KEY: span})) is span


def test_the_provider_span_processor_receives_spans_handed_to_it():
    tp = TracerProvider()
    exporter = InMemorySpanExporter()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    ctx = trace_api.SpanContext(1, 2, False, trace_api.TraceFlags(1))
    compat.span_processor(tp).on_end(ReadableSpan(name="s", context=ctx))
    assert [s.name for s in exporter.get_finished_spans()] == ["s"]


def test_samplers_expose_their_root_and_their_decision():
    ratio = sampling.TraceIdRatioBased(0.25)
    assert compat.root_sampler(sampling.ParentBased(ratio)) is ratio
    assert compat.root_sampler(ratio) is ratio
    assert compat.static_decision(sampling.ALWAYS_ON) is sampling.Decision.RECORD_AND_SAMPLE
    assert compat.static_decision(sampling.ALWAYS_OFF) is sampling.Decision.DROP
    assert compat.static_decision(ratio) is None


def test_exports_run_with_instrumentation_suppressed():
    assert is_instrumentation_enabled()
    with compat.suppressed_instrumentation():
        assert not is_instrumentation_enabled()
    assert is_instrumentation_enabled()


def test_the_grpc_exporter_translates_through_the_hook_it_overrides():
    # The SDK's export() turns spans into the request message in _translate_data.
    assert any("_translate_data" in vars(c) for c in GrpcExp.__mro__)
    seen = []

    def translate(data):
        seen.append(list(data))
        raise RuntimeError("translated")  # stop before the network

    cls = compat.grpc_span_exporter_class(translate)
    exporter = cls(endpoint="http://127.0.0.1:1", insecure=True, timeout=1)
    span = ReadableSpan(name="s", context=trace_api.SpanContext(1, 2, False, trace_api.TraceFlags(1)))
    try:
        assert exporter.accepts_encoded
        try:
            exporter.export([span])
        except RuntimeError:
            pass
        assert seen == [[span]]
    finally:
        exporter.shutdown()


def test_the_http_exporter_sends_bytes_through_its_client():
    exporter = HttpExp(endpoint="http://127.0.0.1:1/v1/traces")
    assert compat.http_sender(exporter) is not None  # exporter-otlp-proto-http >= 1.40
    assert compat.http_session(exporter) is not None  # its requests session
    assert compat.http_max_request_size(exporter) >= 0
    assert not compat.http_is_shut_down(exporter)
    exporter.shutdown()
    assert compat.http_is_shut_down(exporter)
