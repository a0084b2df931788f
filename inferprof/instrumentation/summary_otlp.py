"""The summaries' export as an OTLP request message, built straight from their state.

The SDK's path makes one ``ExponentialHistogramDataPoint`` object per data point, then
its encoder makes a message of each and copies it into the request; filling the request
in place costs a fraction of that (docs/overhead.md). The message is the one the SDK's
encoder makes of the same data (``tests/instrumentation/test_summaries.py`` compares
them); the resource and scope are encoded by the SDK, once per resource (:func:`frame`).
"""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

_DELTA = AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA


def frame(resource: Any, scope: Any) -> ExportMetricsServiceRequest:
    """A request holding ``resource`` and ``scope`` and no metric, as the SDK's encoder
    writes them."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics

    return encode_metrics(MetricsData(resource_metrics=[ResourceMetrics(
        resource=resource,
        scope_metrics=[ScopeMetrics(scope=scope, metrics=[], schema_url="")],
        schema_url="",
    )]))


def request(frame: ExportMetricsServiceRequest, series: list[Any], start: int, now: int,
            scale: int) -> ExportMetricsServiceRequest:
    """``frame`` with the exponential histograms of ``series`` (``(name, unit, points)``,
    each point a ``summaries._Point``) at ``scale``, DELTA over ``[start, now]``."""
    out = ExportMetricsServiceRequest()
    out.CopyFrom(frame)
    metrics = out.resource_metrics[0].scope_metrics[0].metrics
    for name, unit, points in series:
        metric = metrics.add()
        metric.name = name
        metric.unit = unit
        histogram = metric.exponential_histogram
        histogram.aggregation_temporality = _DELTA
        add = histogram.data_points.add
        for p in points:
            point = add()
            _attributes(point.attributes, p.attrs)
            point.start_time_unix_nano = start
            point.time_unix_nano = now
            point.count = p.total
            point.sum = p.sum
            point.scale = scale
            point.zero_count = p.zero
            if p.counts:
                point.positive.offset = p.offset
                point.positive.bucket_counts.extend(p.counts)
            point.min = p.min
            point.max = p.max
    return out


def _attributes(out: Any, attrs: dict[str, Any]) -> None:
    """The summaries' attributes into ``out``, typed as the SDK's encoder types them
    (a ``str`` or ``int`` subclass as its base: a ``str`` enum, ``numpy.str_``)."""
    for key, value in attrs.items():
        kv = out.add()
        kv.key = key
        if isinstance(value, bool):
            kv.value.bool_value = value
        elif isinstance(value, str):
            kv.value.string_value = value
        elif isinstance(value, int):
            kv.value.int_value = value
        elif isinstance(value, float):
            kv.value.double_value = value
        else:
            raise TypeError(f"a summary attribute of type {type(value).__name__}: {key}")


__all__ = ["frame", "request"]
