"""Summary exports (contract §15) built with the real protobuf classes, for collector tests.

    s = SummaryBuilder()
    s.add(e2e_start_ns, e2e_end_ns, [("queue", s_ns, e_ns), ...], weight=2.0, model="m")
    s.add_untimed(e2e_start_ns, e2e_end_ns, model="m")  # a request left untimed
    request = s.export(service="svc")   # an ExportMetricsServiceRequest, DELTA

Each request is partitioned with the collector's own ``attribution.partition``, then
bucketed at ``scale`` as §15 says: one count per request at its end-to-end latency, one
count per (request, stage entered) at its stage time (``unattributed`` included), and per
end-to-end bucket each stage's exclusive nanoseconds. ``add(..., marked=True)`` puts the
request in a request-duration data point marked ``inferprof.summary.untimed_counted``;
``add_untimed`` counts one in ``inferprof.summary.request.untimed``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from inferprof import semconv as sc
from inferprof.timing import exp_index, partition
from tests.collector.synth import attributes

DELTA = metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA


def _index(value: float, scale: int) -> int | None:
    """The OTLP bucket index of a value (``timing.exp_index``); None for <= 0."""
    return int(exp_index([value], scale)[0]) if value > 0 else None


class _Hist:
    __slots__ = ("buckets", "count", "sum", "zero")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = defaultdict(int)
        self.zero = 0
        self.count = 0
        self.sum = 0.0


class SummaryBuilder:
    """Requests summarised as a producer would (see the module docstring)."""

    def __init__(self, scale: int = 7) -> None:
        self.scale = scale
        # (metric kind, model, weight, error, stage, marked) -> histogram
        self._h: dict[tuple, _Hist] = defaultdict(_Hist)

    def add(self, start: int, end: int, spans: Iterable[tuple[str, int, int]], *,
            weight: float = 1.0, model: str | None = None, error: bool = False,
            marked: bool = False) -> None:
        stage_time, exclusive, unattributed = partition(start, end, list(spans))
        e2e = (end - start) * 1e-9
        e2e_i = _index(e2e, self.scale)
        self._count(("r", model, weight, error, None, marked), e2e_i, 1, e2e)
        for stage, t in [*stage_time.items(), (sc.STAGE_UNATTRIBUTED, unattributed)]:
            self._count(("s", model, weight, False, stage, False), _index(t, self.scale), 1, t)
        for stage, x in [*exclusive.items(), (sc.STAGE_UNATTRIBUTED, unattributed)]:
            ns = round(x * 1e9)
            if ns:
                self._count(("t", model, weight, False, stage, False), e2e_i, ns, 0.0)

    def add_untimed(self, start: int, end: int, *, model: str | None = None,
                    error: bool = False) -> None:
        e2e = (end - start) * 1e-9
        self._count(("u", model, 1.0, error, None, False), _index(e2e, self.scale), 1, e2e)

    def _count(self, key: tuple, index: int | None, n: int, value: float) -> None:
        h = self._h[key]
        if index is None:
            h.zero += n
        else:
            h.buckets[index] += n
        h.count += n
        h.sum += value

    def metrics(self) -> list[metrics_pb2.Metric]:
        names = {"r": sc.METRIC_SUMMARY_REQUEST_DURATION, "s": sc.METRIC_SUMMARY_STAGE_DURATION,
                 "t": sc.METRIC_SUMMARY_STAGE_TAIL, "u": sc.METRIC_SUMMARY_REQUEST_UNTIMED}
        out = []
        for kind, name in names.items():
            if kind == "u" and not any(k[0] == "u" for k in self._h):
                continue  # optional (§15): a producer counting no untimed request omits it
            metric = metrics_pb2.Metric(name=name, unit="ns" if kind == "t" else "s")
            metric.exponential_histogram.aggregation_temporality = DELTA
            for (k, model, weight, error, stage, marked), h in sorted(
                self._h.items(), key=lambda kv: repr(kv[0])
            ):
                if k == kind:
                    metric.exponential_histogram.data_points.append(
                        self._point(h, model, weight, error, stage, kind != "t", marked))
            out.append(metric)
        return out

    def _point(self, h: _Hist, model: str | None, weight: float, error: bool,
               stage: str | None, with_sum: bool, marked: bool = False
               ) -> metrics_pb2.ExponentialHistogramDataPoint:
        attrs: dict[str, Any] = {sc.ATTR_MODEL_NAME: model, sc.ATTR_REQUEST_ERROR: error or None,
                                 sc.ATTR_STAGE: stage,
                                 sc.ATTR_SUMMARY_UNTIMED_COUNTED: True if marked else None}
        if weight != 1.0:
            attrs[sc.ATTR_SAMPLE_WEIGHT] = float(weight)
        dp = metrics_pb2.ExponentialHistogramDataPoint(
            attributes=attributes(attrs), count=h.count, zero_count=h.zero, scale=self.scale,
            start_time_unix_nano=1, time_unix_nano=2)
        if with_sum:
            dp.sum = h.sum
        if h.buckets:
            lo, hi = min(h.buckets), max(h.buckets)
            dp.positive.offset = lo
            dp.positive.bucket_counts.extend(h.buckets.get(i, 0) for i in range(lo, hi + 1))
        return dp

    def export(self, service: str = "svc", metrics: list | None = None
               ) -> ExportMetricsServiceRequest:
        req = ExportMetricsServiceRequest()
        rm = req.resource_metrics.add()
        rm.resource.CopyFrom(Resource(attributes=attributes({sc.RESOURCE_SERVICE_NAME: service})))
        sm_ = rm.scope_metrics.add()
        sm_.scope.name = sc.INSTRUMENTATION_SCOPE
        sm_.metrics.extend(self.metrics() if metrics is None else metrics)
        return req
