"""Shared test helpers: inferprof configured on an in-memory span exporter."""

from __future__ import annotations

import contextlib

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import inferprof
from inferprof import semconv


class Captured:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.metric_reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.metric_reader])

    def spans(self):
        return list(self.exporter.get_finished_spans())

    def by_name(self, name):
        return [s for s in self.spans() if s.name == name]

    def stages(self, stage=None):
        out = [s for s in self.spans() if semconv.ATTR_STAGE in (s.attributes or {})]
        if stage is not None:
            out = [s for s in out if s.attributes[semconv.ATTR_STAGE] == stage]
        return out

    def requests(self):
        return [
            s
            for s in self.spans()
            if s.kind.name in ("SERVER", "CONSUMER")
            or (s.attributes or {}).get(semconv.ATTR_REQUEST)
        ]

    def clear(self):
        self.exporter.clear()


@contextlib.contextmanager
def captured(**options):
    cap = Captured()
    inferprof.configure(tracer_provider=cap.provider, meter_provider=cap.meter_provider, **options)
    try:
        yield cap
    finally:
        inferprof.shutdown()
        cap.provider.shutdown()
        cap.meter_provider.shutdown()


def children_of(spans, parent):
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]
