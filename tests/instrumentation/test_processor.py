"""inferprof's batch span processor: every span exported or counted as dropped."""

from __future__ import annotations

import threading

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

import inferprof
from inferprof import _config


class GatedExporter(SpanExporter):
    """Exports nothing until its gate opens: a backend that hangs, then recovers."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.received = 0

    def export(self, spans):
        self.gate.wait(10)
        self.received += len(spans)
        return SpanExportResult.SUCCESS


def _burst(n: int) -> None:
    for _ in range(n):
        with inferprof.request(model="m"):
            with inferprof.stage("tokenize"):
                pass
            with inferprof.stage("compute"):
                pass


def test_every_span_is_exported_or_counted_as_dropped(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "16")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    exporter = GatedExporter()
    inferprof.configure(span_exporter=exporter, set_global=False, metric_readers=[])
    rt = _config.configured_runtime()
    processor = rt.owned_processor
    _burst(200)  # the first export hangs; the queue fills and drops its oldest traces
    inferprof.shutdown(timeout_millis=300)  # gives up on what is still queued
    exporter.gate.set()
    processor._worker.join(10)
    snap = rt.snapshot()
    assert snap.spans_emitted == 200 * 3
    assert snap.spans_dropped_queue_full > 0 and snap.spans_dropped_shutdown > 0
    assert snap.spans_exported == exporter.received > 0
    assert snap.spans_exported + snap.spans_dropped == snap.spans_emitted


def test_a_healthy_exporter_gets_every_span_and_nothing_is_dropped(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    exporter = GatedExporter()
    exporter.gate.set()
    inferprof.configure(span_exporter=exporter, set_global=False, metric_readers=[])
    rt = _config.configured_runtime()
    _burst(300)
    inferprof.shutdown(timeout_millis=5000)
    snap = rt.snapshot()
    assert snap.spans_dropped == 0
    assert snap.spans_exported == exporter.received == snap.spans_emitted == 900


def test_inconsistent_batch_settings_fall_back_to_the_defaults(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "64")
    with caplog.at_level("WARNING"):
        inferprof.configure(span_exporter=GatedExporter(), set_global=False, metric_readers=[])
    processor = _config.configured_runtime().owned_processor
    assert "ignoring OTEL_BSP_* settings" in caplog.text
    assert (processor.max_queue_size, processor.max_export_batch_size) == (2048, 512)
    inferprof.shutdown(timeout_millis=100)
