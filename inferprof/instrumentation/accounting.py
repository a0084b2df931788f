"""Self-accounting of the in-process half, and the export queue's deferred traces.

Spans emitted and spans dropped, and why:

When the exporter is down, spans must be dropped — never queued without bound, never
slowing requests — and the drops must be visible. inferprof's batch processor
(``processor.BatchSpanProcessor``) bounds its queue (``OTEL_BSP_MAX_QUEUE_SIZE``, default
2048), never blocks ``on_end`` and counts what it throws away (queue full);
:class:`CountingSpanExporter` counts what the exporter fails to send; so
``inferprof.instrumentation.stats()`` and the OTel counter ``inferprof.spans.dropped``
report them.

Queued traces: when ``configure()`` built the provider, a kept request goes into the
queue as one entry instead of ~10 ``ReadableSpan`` objects:

* :class:`EncodedTrace`, its spans already encoded to OTLP protobuf bytes when the
  request ended, when the exporter is inferprof's own (it takes bytes). A queued entry
  is then two objects, not the ~15 records of the request: a trace waiting up to a second
  for export would otherwise keep them alive past the garbage collector's youngest
  generation, and on the demo that made young collections nearly four times as frequent
  and each six to eight times slower (docs/overhead.md, "Garbage collection and queued
  traces");
* :class:`DeferredTrace`, its records (frozen), for any other exporter;
  :class:`CountingSpanExporter` builds the spans on the export thread.

The bounded queue holds at most ``OTEL_BSP_MAX_QUEUE_SIZE`` entries, each a span or a
trace; drops are counted in spans.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from inferprof.instrumentation.otlp_encode import (
    encode_request,
    encode_trace_spans,
    wrap_trace_spans,
)

_logger = logging.getLogger(__name__)
#: Traces built between voluntary GIL releases on the export thread, so that a large
#: export does not hold the request threads off for a whole switch interval (5 ms).
_BUILD_SLICE = 16


class DeferredTrace:
    """A kept trace of ``n`` spans: ``build(*args)`` gives its (trace id, span specs,
    trace state) on the export thread; ``runtime`` turns those into ``ReadableSpan``
    objects or, for inferprof's own OTLP exporter, straight into protobuf bytes."""

    __slots__ = ("args", "build", "n", "runtime")

    def __init__(self, runtime: Any, build: Callable[..., tuple], args: tuple, n: int) -> None:
        self.runtime = runtime
        self.build = build
        self.args = args
        self.n = n

    def spans(self) -> list:
        return self.runtime._spans(*self.build(*self.args))


class EncodedTrace:
    """A kept trace of ``n`` spans, encoded (``otlp_encode.encode_trace_spans``) for
    ``runtime``'s resource and scope."""

    __slots__ = ("n", "payload", "runtime")

    def __init__(self, runtime: Any, payload: bytes, n: int) -> None:
        self.runtime = runtime
        self.payload = payload
        self.n = n


#: Queue entries that stand for several spans (the rest are single ReadableSpans).
TRACE_ENTRIES = (DeferredTrace, EncodedTrace)


class EncodedSpans:
    """``n`` spans already encoded as an ``ExportTraceServiceRequest`` (``payload``)."""

    __slots__ = ("n", "payload")

    def __init__(self, payload: bytes, n: int) -> None:
        self.payload = payload
        self.n = n

    def __len__(self) -> int:
        return self.n


@dataclass(frozen=True)
class StatsSnapshot:
    """Counts since ``configure()``."""

    spans_emitted: int
    spans_dropped_queue_full: int
    spans_dropped_export_failed: int
    spans_exported: int
    traces_kept: int
    traces_discarded: int
    #: requests production mode's timing budget left untimed (no trace could be kept)
    requests_untimed: int = 0
    #: spans still queued when ``inferprof.shutdown()``'s time ran out
    spans_dropped_shutdown: int = 0
    #: requests handed to the summaries with their stages (contract §15): the timed ones
    #: and those summarised untimed (``requests_untimed_summarised``)
    requests_summarised: int = 0
    #: summarised (or counted untimed) requests that never reached the exporter's backend:
    #: the buffer was full, their export failed, or shutdown's time ran out
    summaries_dropped: int = 0
    #: summary exports that succeeded / failed
    summary_exports: int = 0
    summary_exports_failed: int = 0
    #: untimed requests counted in the summaries (contract §15, "Requests not timed");
    #: those dropped count in ``summaries_dropped`` too
    requests_untimed_counted: int = 0
    #: untimed requests summarised with their stages (``configure(untimed_stages=True)``,
    #: the default); also in ``requests_summarised``
    requests_untimed_summarised: int = 0

    @property
    def spans_dropped(self) -> int:
        return (self.spans_dropped_queue_full + self.spans_dropped_export_failed
                + self.spans_dropped_shutdown)


class Stats:
    """Mutable counters. Increments are plain int adds (atomic enough under the GIL for
    monotonically growing statistics; a lost increment under free-threading would only
    under-count, never break serving)."""

    __slots__ = (
        "_lock",
        "discarded",
        "emitted",
        "export_failed",
        "exported",
        "kept",
        "queue_full",
        "shutdown",
        "summarised",
        "summary_dropped",
        "summary_export_failed",
        "summary_exports",
        "untimed",
        "untimed_counted",
        "untimed_summarised",
    )

    def __init__(self) -> None:
        self.emitted = 0
        self.queue_full = 0
        self.export_failed = 0
        self.exported = 0
        self.kept = 0
        self.discarded = 0
        self.untimed = 0
        self.shutdown = 0
        self.summarised = 0
        self.summary_dropped = 0
        self.summary_exports = 0
        self.summary_export_failed = 0
        self.untimed_counted = 0
        self.untimed_summarised = 0
        self._lock = threading.Lock()

    def snapshot(self) -> StatsSnapshot:
        return StatsSnapshot(
            spans_emitted=self.emitted,
            spans_dropped_queue_full=self.queue_full,
            spans_dropped_export_failed=self.export_failed,
            spans_exported=self.exported,
            traces_kept=self.kept,
            traces_discarded=self.discarded,
            requests_untimed=self.untimed,
            spans_dropped_shutdown=self.shutdown,
            requests_summarised=self.summarised,
            summaries_dropped=self.summary_dropped,
            summary_exports=self.summary_exports,
            summary_exports_failed=self.summary_export_failed,
            requests_untimed_counted=self.untimed_counted,
            requests_untimed_summarised=self.untimed_summarised,
        )


class CountingSpanExporter(SpanExporter):
    """Delegates to ``exporter``; counts spans in failed exports as dropped. Builds the
    spans of :class:`DeferredTrace` entries first, handing the exporter at most
    ``max_batch`` spans per call."""

    def __init__(self, exporter: SpanExporter, stats: Stats, max_batch: int = 512) -> None:
        self._exporter = exporter
        self._stats = stats
        self.max_batch = max(1, max_batch)

    @property
    def accepts_encoded(self) -> bool:
        """Whether the wrapped exporter takes :class:`EncodedSpans` (inferprof's own)."""
        return bool(getattr(self._exporter, "accepts_encoded", False))

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        if any(type(s) in TRACE_ENTRIES for s in spans):
            return self._export_deferred(spans)
        return self._export(spans)

    def _export_deferred(self, items: Sequence[Any]) -> SpanExportResult:
        # inferprof's exporters take encoded bytes: traces go from their records to
        # protobuf with no ReadableSpan in between (otlp_encode.encode_trace_spans), most
        # of them already encoded when their request ended (EncodedTrace).
        direct = self.accepts_encoded
        result = SpanExportResult.SUCCESS
        spans: list = []
        traces: list = []  # (runtime, encoded spans of one trace)
        pending = 0
        built = 0
        for item in items:
            kind = type(item)
            if kind is EncodedTrace:
                if not direct:  # the runtime encodes only for exporters that take bytes
                    _logger.error("inferprof's exporter cannot send an encoded trace")
                    with self._stats._lock:
                        self._stats.export_failed += item.n
                    continue
                traces.append((item.runtime, item.payload))
                pending += item.n
            elif kind is not DeferredTrace:
                spans.append(item)
                pending += 1
            else:
                try:
                    if direct:
                        trace = item.build(*item.args)
                        traces.append((item.runtime, encode_trace_spans(*trace)))
                    else:
                        spans.extend(item.spans())
                except Exception:
                    _logger.exception("inferprof could not build the spans of a trace")
                    with self._stats._lock:
                        self._stats.export_failed += item.n
                    continue
                pending += item.n
                built += 1
                if built % _BUILD_SLICE == 0:
                    time.sleep(0)  # let the request threads in (GIL)
            if pending >= self.max_batch:
                if self._send(spans, traces, pending, direct) is not SpanExportResult.SUCCESS:
                    result = SpanExportResult.FAILURE
                spans, traces, pending = [], [], 0
        if pending and self._send(spans, traces, pending, direct) is not SpanExportResult.SUCCESS:
            result = SpanExportResult.FAILURE
        return result

    def _send(self, spans: list, traces: list, n: int, direct: bool) -> SpanExportResult:
        if not direct:
            return self._export_counted(spans)
        try:
            # Serialized protobuf messages concatenate into their merge: one request.
            payload = (encode_request(spans) if spans else b"") + wrap_trace_spans(traces)
        except Exception:
            _logger.exception("inferprof could not encode spans")
            with self._stats._lock:
                self._stats.export_failed += n
            return SpanExportResult.FAILURE
        return self._export_counted(EncodedSpans(payload, n))

    def _export_counted(self, spans: Sequence[ReadableSpan] | EncodedSpans) -> SpanExportResult:
        try:
            return self._export(spans)
        except Exception:  # counted in _export; the rest of the entries still go out
            _logger.exception("inferprof's span exporter failed")
            return SpanExportResult.FAILURE

    def _export(self, spans: Sequence[ReadableSpan] | EncodedSpans) -> SpanExportResult:
        try:
            result = self._exporter.export(spans)  # type: ignore[arg-type]  # ours take both
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


__all__ = [
    "TRACE_ENTRIES",
    "CountingSpanExporter",
    "DeferredTrace",
    "EncodedSpans",
    "EncodedTrace",
    "Stats",
    "StatsSnapshot",
]
