"""Self-accounting of the in-process half: spans emitted and spans dropped, and why.

When the exporter is down, spans must be dropped — never queued without bound, never
slowing requests — and the drops must be visible. The SDK's ``BatchSpanProcessor`` already
bounds its queue (``OTEL_BSP_MAX_QUEUE_SIZE``, default 2048) and never blocks ``on_end``;
these wrappers count what it throws away (queue full) and what the exporter fails to send,
so ``inferprof.instrumentation.stats()`` and the OTel counter ``inferprof.spans.dropped``
report them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult


@dataclass(frozen=True)
class StatsSnapshot:
    """Counts since ``configure()``."""

    spans_emitted: int
    spans_dropped_queue_full: int
    spans_dropped_export_failed: int
    spans_exported: int
    traces_kept: int
    traces_discarded: int

    @property
    def spans_dropped(self) -> int:
        return self.spans_dropped_queue_full + self.spans_dropped_export_failed


class Stats:
    """Mutable counters. Increments are plain int adds (atomic enough under the GIL for
    monotonically growing statistics; a lost increment under free-threading would only
    under-count, never break serving)."""

    __slots__ = ("emitted", "queue_full", "export_failed", "exported", "kept", "discarded", "_lock")

    def __init__(self) -> None:
        self.emitted = 0
        self.queue_full = 0
        self.export_failed = 0
        self.exported = 0
        self.kept = 0
        self.discarded = 0
        self._lock = threading.Lock()

    def snapshot(self) -> StatsSnapshot:
        return StatsSnapshot(
            spans_emitted=self.emitted,
            spans_dropped_queue_full=self.queue_full,
            spans_dropped_export_failed=self.export_failed,
            spans_exported=self.exported,
            traces_kept=self.kept,
            traces_discarded=self.discarded,
        )


class CountingSpanExporter(SpanExporter):
    """Delegates to ``exporter``; counts spans in failed exports as dropped."""

    def __init__(self, exporter: SpanExporter, stats: Stats) -> None:
        self._exporter = exporter
        self._stats = stats

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._exporter.export(spans)
        except Exception:
            with self._stats._lock:
                self._stats.export_failed += len(spans)
            raise
        with self._stats._lock:
            if result is SpanExportResult.SUCCESS:
                self._stats.exported += len(spans)
            else:
                self._stats.export_failed += len(spans)
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """A ``BatchSpanProcessor`` that counts the spans its bounded queue drops."""

    def __init__(self, exporter: SpanExporter, stats: Stats, **kwargs) -> None:
        super().__init__(exporter, **kwargs)
        self._stats = stats
        # The SDK keeps its queue private; when its layout changes we lose only the
        # queue-full count (export failures are still counted by the exporter wrapper).
        inner = getattr(self, "_batch_processor", None)
        self._queue = getattr(inner, "_queue", None)
        self._max = getattr(inner, "_max_queue_size", None)

    def on_end(self, span: ReadableSpan) -> None:
        queue = self._queue
        if queue is not None and len(queue) >= self._max:
            self._stats.queue_full += 1
        super().on_end(span)


__all__ = ["Stats", "StatsSnapshot", "CountingSpanExporter", "CountingBatchSpanProcessor"]
