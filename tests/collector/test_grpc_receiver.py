"""OTLP/gRPC receiver, end to end with the SDK's real gRPC exporters."""

from __future__ import annotations

import grpc
import httpx
import pytest
from grpc import Compression
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpMetricExporter,
)
from opentelemetry.metrics import Observation
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult

from inferprof import semconv as sc
from tests.collector.test_server_fixtures import breakdown, make_requests, running_app, stage_counts


def _gpu_metrics(n_gpus: int = 2):
    """MetricsData with one ``hw.gpu.utilization`` gauge point per GPU."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(
        metric_readers=[reader], resource=Resource.create({sc.RESOURCE_HOST_NAME: "node-1"})
    )

    def observe(_options):
        return [Observation(0.5, {sc.ATTR_HW_ID: f"GPU-{i}"}) for i in range(n_gpus)]

    provider.get_meter("gpu").create_observable_gauge(sc.METRIC_GPU_UTILIZATION, [observe])
    data = reader.get_metrics_data()
    provider.shutdown()
    return data


@pytest.mark.parametrize("compression", [None, Compression.Gzip])
def test_sdk_grpc_exporter_spans_become_a_breakdown(compression):
    with running_app() as app:
        exporter = OTLPSpanExporter(
            endpoint=app.otlp_grpc_endpoint, insecure=True, timeout=10, compression=compression
        )
        try:
            assert exporter.export(make_requests(30)) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        doc = breakdown(app).json()
        assert doc["requests"] == 30
        assert stage_counts(doc)[sc.STAGE_QUEUE] == 30
        assert sum(s["share_of_p95"] for s in doc["stages"]) == pytest.approx(1.0, abs=1e-6)
        text = httpx.get(f"{app.api_url}/metrics").text
        assert (
            'inferprof_otlp_requests_total{outcome="ok",signal="traces",transport="grpc"} 1.0'
            in text
        )


def test_sdk_metric_exporters_deliver_gpu_samples_over_grpc_and_http():
    with running_app() as app:
        grpc_exporter = OTLPMetricExporter(
            endpoint=app.otlp_grpc_endpoint, insecure=True, timeout=10
        )
        http_exporter = HttpMetricExporter(
            endpoint=f"{app.otlp_http_endpoint}/v1/metrics", timeout=10
        )
        try:
            assert grpc_exporter.export(_gpu_metrics(2)) is MetricExportResult.SUCCESS
            assert http_exporter.export(_gpu_metrics(3)) is MetricExportResult.SUCCESS
        finally:
            grpc_exporter.shutdown()
            http_exporter.shutdown()
        assert app.engine.stats.gpu_samples_received == 5
        text = httpx.get(f"{app.api_url}/metrics").text
        for transport in ("grpc", "http"):
            labels = f'outcome="ok",signal="metrics",transport="{transport}"'
            assert f"inferprof_otlp_requests_total{{{labels}}} 1.0" in text


@pytest.fixture(scope="module")
def app():
    with running_app(max_body_bytes=64 * 1024) as running:
        yield running


@pytest.fixture
def raw_export(app):
    """The TraceService Export method with identity serialisation (any bytes go out)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{app.otlp_grpc_port}")
    try:
        yield channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=None,
            response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString,
        )
    finally:
        channel.close()


def test_malformed_protobuf_is_invalid_argument_with_a_reason(raw_export):
    with pytest.raises(grpc.RpcError) as info:
        raw_export(b"\x0a\xff\xff\xff\xff\x0f", timeout=5)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in info.value.details()


def test_oversized_message_is_refused_and_valid_spans_still_flow(app, raw_export):
    with pytest.raises(grpc.RpcError) as info:
        raw_export(b"\x0a" + b"\x00" * (64 * 1024 + 10), timeout=5)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    request = encode_spans(make_requests(3, service="after-bad"))
    answer = raw_export(request.SerializeToString(), timeout=5)
    assert not answer.HasField("partial_success")
    assert breakdown(app, "after-bad").json()["requests"] == 3


def test_partial_success_carries_rejected_spans(app):
    request = encode_spans(make_requests(2, service="grpc-partial"))
    request.resource_spans[0].scope_spans[0].spans[0].span_id = b"\x00" * 8  # invalid
    with grpc.insecure_channel(f"127.0.0.1:{app.otlp_grpc_port}") as channel:
        answer = trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=5)
    assert answer.partial_success.rejected_spans >= 1
    assert answer.partial_success.error_message
