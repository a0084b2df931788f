"""What one client can make the collector hold or print is bounded: long names, GPU samples.

Through the real OTLP receivers on 127.0.0.1, as a sender would hit them.
"""

from __future__ import annotations

import re
import time

import grpc
import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from inferprof import semconv as sc
from inferprof.collector.labels import MARKER
from tests.collector.synth import gpu_metrics
from tests.collector.test_server_fixtures import make_requests, running_app

PB = {"content-type": "application/x-protobuf"}
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _post(app, path, body):
    return httpx.post(f"{app.otlp_http_endpoint}{path}", content=body, headers=PB, timeout=30)


def _labels(scrape: str):
    for line in scrape.splitlines():
        if not line.startswith("#"):
            yield from _LABEL.findall(line)


def test_long_service_model_and_stage_names_cannot_make_the_scrape_long():
    with running_app() as app:
        huge = "s" * 1_000_000
        # two long names that differ only past the bound stay two series
        twin_a, twin_b = "t" * 300 + "a", "t" * 300 + "b"
        model = "é" * 200  # 400 bytes in UTF-8, 200 characters
        for service in (huge, twin_a, twin_b):
            body = encode_spans(make_requests(2, service=service, model=model))
            assert _post(app, "/v1/traces", body.SerializeToString()).status_code == 200
        long_stage = "x" * 65
        body = encode_spans(make_requests(
            2, service="short", stages=((sc.STAGE_COMPUTE, 5.0), (long_stage, 1.0))))
        answer = _post(app, "/v1/traces", body.SerializeToString())
        assert answer.status_code == 200
        # the over-long stage's spans are rejected, and said so; the rest is kept
        partial = trace_service_pb2.ExportTraceServiceResponse.FromString(answer.content)
        assert partial.partial_success.rejected_spans == 2
        app.engine.flush()

        scrape = httpx.get(f"{app.api_url}/metrics").text
        values = [v for _, v in _labels(scrape)]
        assert values and max(len(v.encode()) for v in values) <= sc.MAX_LABEL_BYTES
        assert len(scrape) < 200_000  # the 1 MB name would be in every row of its series
        services = {s["service"] for s in httpx.get(f"{app.api_url}/api/v1/services").json()
                    ["services"]}
        assert "short" in services and len(services) == 4
        cut = services - {"short"}
        assert all(len(s.encode()) <= sc.MAX_LABEL_BYTES and MARKER in s for s in cut)
        assert any(s.startswith("s" * 200) for s in cut)
        stats = app.engine.stats
        assert stats.spans_dropped[sc.DROP_INVALID_STAGE] == 2
        assert app.registry.get_sample_value(
            "inferprof_labels_truncated_total", {"label": "service"}) >= 6
        assert app.registry.get_sample_value(
            "inferprof_labels_truncated_total", {"label": "model"}) >= 6
        assert app.registry.get_sample_value(
            "inferprof_spans_dropped_total", {"reason": "invalid_stage"}) == 2


def test_series_names_together_are_bounded_in_bytes():
    # 4 series at most, 64 bytes of names each on average: 256 bytes in all.
    with running_app(max_series=4) as app:
        for i in range(3):
            name = f"{i}" + "n" * 200  # three 201-byte names need 603 bytes
            body = encode_spans(make_requests(1, service=name, model=""))
            assert _post(app, "/v1/traces", body.SerializeToString()).status_code == 200
        app.engine.flush()
        services = {s["service"] for s in httpx.get(f"{app.api_url}/api/v1/services").json()
                    ["services"]}
        assert services == {"0" + "n" * 200, sc.OVERFLOW_SERIES}
        assert app.engine.stats.series_overflow == 2


def _gpu(host="host-1", hw_id="GPU-0", n=1, at=None, metric=sc.METRIC_GPU_UTILIZATION):
    now = time.time() if at is None else at
    return gpu_metrics([(k * 0.01, 0.5) for k in range(n)], host=host, hw_id=hw_id,
                       base_unix=now, metric=metric)


def _dropped(app, reason):
    return app.registry.get_sample_value("inferprof_gpu_samples_dropped_total",
                                         {"reason": reason})


def test_gpu_samples_respect_their_caps_over_http_and_grpc():
    with running_app(max_gpu_samples=100, max_gpus_per_host=2, max_gpu_hosts=2) as app:
        channel = grpc.insecure_channel(f"127.0.0.1:{app.otlp_grpc_port}")
        stub = metrics_service_pb2_grpc.MetricsServiceStub(channel)
        try:
            def http(request):
                resp = _post(app, "/v1/metrics", request.SerializeToString())
                partial = None
                if resp.status_code == 200:
                    partial = metrics_service_pb2.ExportMetricsServiceResponse.FromString(
                        resp.content).partial_success.rejected_data_points
                return resp.status_code, partial

            assert http(_gpu(n=60)) == (200, 0)
            stub.Export(_gpu(hw_id="GPU-1", n=30), timeout=10)
            assert http(_gpu(hw_id="GPU-2", n=5)) == (200, 5)  # a third GPU on host-1
            assert http(_gpu(host="host-2", n=5)) == (200, 0)
            assert http(_gpu(host="host-3", n=5)) == (200, 5)  # a third host
            # timestamps outside a sane window around now, and over-long ids
            assert http(_gpu(at=time.time() - 100_000)) == (200, 1)
            assert http(_gpu(at=time.time() + 3600)) == (200, 1)
            assert http(_gpu(at=9_223_372_036.0)) == (200, 1)  # 2**63 - 1 ns
            assert http(_gpu(hw_id="G" * 300)) == (200, 1)
            # 95 retained: 10 more would pass the cap, over either transport
            status, _ = http(_gpu(n=10))
            assert status == 429
            with pytest.raises(grpc.RpcError) as info:
                stub.Export(_gpu(n=10), timeout=10)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert http(_gpu(n=5)) == (200, 0)  # what fits still gets in
        finally:
            channel.close()
        assert app.engine.stats.gpu_samples == 100
        assert app.registry.get_sample_value("inferprof_gpu_samples", {}) == 100
        assert _dropped(app, "too_many_gpus") == 5
        assert _dropped(app, "too_many_hosts") == 5
        assert _dropped(app, "too_old") == 1
        assert _dropped(app, "future") == 2
        assert _dropped(app, "label_too_long") == 1
        for transport in ("grpc", "http"):
            assert app.registry.get_sample_value("inferprof_otlp_requests_total", {
                "transport": transport, "signal": "metrics", "outcome": "overloaded"}) == 1


def test_gpu_samples_past_the_retention_are_pruned_and_free_their_gpu_and_host():
    from inferprof.collector.engine import Engine
    from tests.collector.synth import FakeClock

    clock = FakeClock(1_800_000_000.0)
    engine = Engine(clock=clock, windows_s=(60.0,), max_gpus_per_host=1, max_gpu_hosts=1)
    assert engine.ingest_metrics(_gpu(n=10, at=clock())).accepted_spans == 10
    assert engine.ingest_metrics(_gpu(host="other", at=clock())).rejected_spans == 1
    clock.tick(61.0)
    engine.advance()
    assert engine.stats.gpu_samples == 0
    # the host's and GPU's places are free again
    assert engine.ingest_metrics(_gpu(host="other", hw_id="GPU-9", at=clock())).accepted_spans == 1


def test_a_scrape_reads_only_the_gpus_its_compute_spans_name():
    # Many GPUs' samples retained: each breakdown joins its own GPU's series, and counts
    # the window's samples from per-second totals, not by reading every series.
    from inferprof.collector.engine import Engine
    from tests.collector.synth import FakeClock, TraceBuilder

    clock = FakeClock(1_800_000_000.0)
    engine = Engine(clock=clock, settle_s=0.0, max_gpus_per_host=4096)
    for g in range(2000):
        engine.ingest_metrics(_gpu(hw_id=f"GPU-{g}", n=3, at=clock()))
    b = TraceBuilder(base_unix=clock())
    req = b.request(0.0, 0.02)
    b.stage(req, "compute", 0.0, 0.02, gpu_id="GPU-7")
    engine.ingest_traces(b.export())
    clock.tick(1.0)
    engine.advance()
    read = []
    original = engine._gpu._arrays
    engine._gpu._arrays = lambda key: read.append(key) or original(key)
    doc = engine.breakdown("svc", window_s=60.0)
    assert doc["gpu"]["samples_received"] == 6000
    assert doc["gpu"]["samples"] > 0
    assert {key[1] for key in read} == {"GPU-7"}
