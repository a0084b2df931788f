"""Exporter down: requests keep flowing, the span queue stays bounded, drops are counted."""

import socket
import time
import tracemalloc

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import inferprof
from inferprof import _config, semconv


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _dropped_counter(reader):
    data = reader.get_metrics_data()
    out = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == semconv.METRIC_SPANS_DROPPED:
                    for point in metric.data.data_points:
                        out[point.attributes[semconv.ATTR_DROP_REASON]] = point.value
    return out


def test_dead_exporter_drops_and_counts_without_slowing_requests(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "128")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "64")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    reader = InMemoryMetricReader()
    inferprof.configure(
        endpoint=f"http://127.0.0.1:{_closed_port()}",
        set_global=False,
        metric_readers=[reader],
    )
    processor = _config._runtime.tracer_provider._active_span_processor._span_processors[0]

    def burst(n):
        t0 = time.perf_counter()
        for _ in range(n):
            with inferprof.request():
                for stage in ("tokenize", "queue", "compute", "postprocess"):
                    with inferprof.stage(stage):
                        pass
        return (time.perf_counter() - t0) / n

    burst(500)  # warm up; the queue fills against the dead endpoint
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    per_request = burst(3000)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()

    growth = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert growth < 2_000_000  # 15000 spans would be far more if they were kept
    assert len(processor._queue) <= 128
    assert per_request < 0.002  # never blocked on the exporter
    snap = inferprof.instrumentation.stats()
    assert snap.spans_emitted == 3500 * 5
    assert snap.spans_dropped_queue_full > 10000
    counters = _dropped_counter(reader)
    assert counters[semconv.DROP_REASON_QUEUE_FULL] == snap.spans_dropped_queue_full
    t0 = time.perf_counter()
    inferprof.shutdown(timeout_millis=5000)
    assert time.perf_counter() - t0 < 15
