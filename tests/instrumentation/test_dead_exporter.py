"""Exporter down: requests keep flowing, the span queue stays bounded, drops are counted."""

import logging
import socket
import threading
import time
import tracemalloc

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

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


def burst(n):
    for _ in range(n):
        with inferprof.request():
            for stage in ("tokenize", "queue", "compute", "postprocess"):
                with inferprof.stage(stage):
                    pass


class HungExporter(SpanExporter):
    """An exporter stuck in its first export until released (a backend that hangs)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def export(self, spans):
        self.entered.set()
        self.release.wait()
        return SpanExportResult.SUCCESS


def test_requests_never_wait_for_a_hung_exporter(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "64")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    exporter = HungExporter()
    inferprof.configure(span_exporter=exporter, set_global=False, metric_readers=[])
    burst(20)
    assert exporter.entered.wait(10)  # the export thread is now stuck
    done = threading.Thread(target=burst, args=(2000,), daemon=True)
    done.start()
    # 2000 requests take well under a second; had any waited on the stuck export
    # (or on room in the full queue) they would never finish.
    done.join(60)
    finished = not done.is_alive()
    exporter.release.set()
    assert finished
    snap = inferprof.instrumentation.stats()
    assert snap.spans_dropped_queue_full >= 2000 * 5 - 64 * 5 - 20 * 5
    inferprof.shutdown(timeout_millis=5000)


def test_dead_exporter_drops_and_counts_without_slowing_requests(monkeypatch, caplog):
    # Log records made for drops, filtered out later or not: the SDK makes one per drop.
    made = []
    factory = logging.getLogRecordFactory()

    def counting_factory(*args, **kwargs):
        record = factory(*args, **kwargs)
        if "queue" in str(record.msg).lower():
            made.append(record)
        return record

    monkeypatch.setattr(logging, "_logRecordFactory", counting_factory)
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
    processor = _config.configured_runtime().owned_processor

    caplog.set_level(logging.WARNING)
    burst(500)  # warm up; the queue fills against the dead endpoint
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    burst(3000)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()

    growth = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert growth < 2_000_000  # 15000 spans would be far more if they were kept
    assert len(processor.queue) <= 128
    snap = inferprof.instrumentation.stats()
    assert snap.spans_emitted == 3500 * 5
    assert snap.spans_dropped_queue_full > 10000
    counters = _dropped_counter(reader)
    assert counters[semconv.DROP_REASON_QUEUE_FULL] == snap.spans_dropped_queue_full
    # Thousands of drops, a warning or two: not the SDK's log line per dropped entry.
    assert len(made) <= 2
    messages = [r.getMessage() for r in caplog.records]
    ours = [m for m in messages if "export queue is full" in m]
    assert 1 <= len(ours) <= 2
    assert all("inferprof.spans.dropped" in m for m in ours)
    t0 = time.perf_counter()
    inferprof.shutdown(timeout_millis=5000)
    assert time.perf_counter() - t0 < 15


def test_shutdown_against_a_dead_endpoint_keeps_to_its_timeout():
    # The SDK's exporters retry each export for up to 10 s (OTEL_EXPORTER_OTLP_TIMEOUT) and
    # its provider shuts its processor down with no bound of its own: ~20 s here before.
    # A service being stopped must not spend that; what is unsent is dropped.
    inferprof.configure(endpoint=f"http://127.0.0.1:{_closed_port()}",
                        protocol="http/protobuf", set_global=False)
    burst(50)
    time.sleep(1.2)  # the export thread is in its first export's retries
    burst(50)
    t0 = time.perf_counter()
    inferprof.shutdown(timeout_millis=1000)
    took = time.perf_counter() - t0
    assert took < 4, took  # the bound plus slack for a loaded machine; 20 s unbounded
    assert _config.configured_runtime() is None  # shut down all the same


def test_final_counts_stay_readable_after_shutdown(monkeypatch):
    """Spans still queued when ``shutdown()`` gives up are counted, and ``stats()`` keeps
    answering with the final counts afterwards."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4096")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    exporter = HungExporter()
    inferprof.configure(span_exporter=exporter, set_global=False, metric_readers=[])
    burst(20)
    assert exporter.entered.wait(10)  # one batch is stuck in the exporter
    burst(200)
    inferprof.shutdown(timeout_millis=200)
    exporter.release.set()  # the stuck batch now completes, after shutdown
    snap = inferprof.instrumentation.stats()
    assert snap is not None
    assert snap.spans_emitted == 220 * 5
    assert snap.spans_dropped_shutdown > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        snap = inferprof.instrumentation.stats()
        if snap.spans_exported + snap.spans_dropped == snap.spans_emitted:
            break
        time.sleep(0.02)
    # Every span is accounted for: exported (the batch that was in flight) or dropped.
    assert snap.spans_exported > 0
    assert snap.spans_exported + snap.spans_dropped == snap.spans_emitted
    assert snap.spans_dropped == snap.spans_dropped_shutdown


def test_stats_after_a_clean_shutdown_show_everything_exported():
    exporter = _Recording()
    inferprof.configure(span_exporter=exporter, set_global=False, metric_readers=[])
    burst(30)
    inferprof.shutdown(timeout_millis=5000)
    snap = inferprof.instrumentation.stats()
    assert snap is not None
    assert snap.spans_emitted == 30 * 5 == snap.spans_exported == exporter.count
    assert snap.spans_dropped == 0
    inferprof.configure(span_exporter=_Recording(), set_global=False, metric_readers=[])
    try:  # a new configuration counts from zero again
        assert inferprof.instrumentation.stats().spans_emitted == 0
    finally:
        inferprof.shutdown()


class _Recording(SpanExporter):
    def __init__(self) -> None:
        self.count = 0

    def export(self, spans):
        self.count += len(spans)
        return SpanExportResult.SUCCESS
