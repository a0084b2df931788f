"""GPU samples as OTLP metrics (contract §4), and the exporter that ships them.

The SDK's ``PeriodicExportingMetricReader`` sends one data point per instrument and
collection, stamped with the collection time; GPU samples need one data point *per sample*,
each with the time it was taken, because the collector joins them to compute spans on
time. So the sampler builds the SDK's own export records (``MetricsData`` ->
``ResourceMetrics`` -> ``ScopeMetrics`` -> ``Metric`` with a ``Gauge`` of
``NumberDataPoint``\\ s) itself and hands them to the official ``OTLPMetricExporter``, which
encodes, compresses, retries and reads the ``OTEL_EXPORTER_OTLP_*`` variables as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.metrics.export import (
    Gauge,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from inferprof import semconv as sc
from inferprof._version import __version__
from inferprof.gpu.records import METRICS, GpuSample
from inferprof.instrumentation import active
from inferprof.instrumentation import config as instr_config

_logger = logging.getLogger(__name__)
_SCOPE = InstrumentationScope(sc.INSTRUMENTATION_SCOPE, __version__)


def to_metrics_data(samples: Iterable[GpuSample], resource: Resource) -> MetricsData:
    """One ``ResourceMetrics`` per host (``resource``, with ``host.name`` replaced by the
    sample's host when it has one), one gauge per metric, one data point per sample."""
    by_host: dict[str | None, dict[str, list[NumberDataPoint]]] = {}
    attrs: dict[str, dict[str, str]] = {}
    for s in samples:
        metrics = by_host.setdefault(s.host, {})
        point_attrs = attrs.get(s.hw_id)
        if point_attrs is None:
            point_attrs = attrs[s.hw_id] = {sc.ATTR_HW_ID: s.hw_id}
            if s.model:
                point_attrs[sc.ATTR_HW_MODEL] = s.model
        for name, value in s.values:
            metrics.setdefault(name, []).append(NumberDataPoint(
                attributes=point_attrs, start_time_unix_nano=0,
                time_unix_nano=s.time_unix_nano, value=value))
    resource_metrics = []
    for host, metrics in by_host.items():
        res = resource if host is None else resource.merge(
            Resource({sc.RESOURCE_HOST_NAME: host}))
        resource_metrics.append(ResourceMetrics(
            resource=res,
            scope_metrics=[ScopeMetrics(
                scope=_SCOPE,
                metrics=[Metric(name=name, description=METRICS[name][1], unit=METRICS[name][0],
                                data=Gauge(data_points=points))
                         for name, points in metrics.items()],
                schema_url="")],
            schema_url=""))
    return MetricsData(resource_metrics=resource_metrics)


def service_host_name() -> str:
    """The ``host.name`` the instrumented service in this process puts on its spans.

    When ``inferprof.configure()`` ran, its tracer provider's resource's ``host.name``;
    else that of the application's global SDK tracer provider; otherwise what
    ``configure()`` would use:
    ``OTEL_RESOURCE_ATTRIBUTES``' ``host.name``, else ``socket.gethostname()``.
    """
    from opentelemetry import trace as trace_api

    rt = active.configured_runtime()  # read, not built: active_runtime() would build one
    for provider in (getattr(rt, "tracer_provider", None), trace_api.get_tracer_provider()):
        resource = getattr(provider, "resource", None)
        host = getattr(resource, "attributes", {}).get(sc.RESOURCE_HOST_NAME)
        if isinstance(host, str) and host:
            return host
    host = instr_config.resource(None, None).attributes.get(sc.RESOURCE_HOST_NAME)
    return str(host)


def sampler_resource(source: str, host_name: str, service_name: str | None) -> Resource:
    """The resource of the sampler's exports: ``configure()``'s (fresh
    ``service.instance.id``, ``OTEL_RESOURCE_ATTRIBUTES`` folded in), with ``host_name``
    and ``inferprof.gpu.source``."""
    base = instr_config.resource(service_name, {sc.RESOURCE_GPU_SOURCE: source})
    return base.merge(Resource({sc.RESOURCE_HOST_NAME: host_name}))


def metrics_config(endpoint: str | None, protocol: str | None) -> instr_config.Config:
    """Where GPU samples go, as a ``configure()`` configuration.

    ``endpoint``/``protocol`` given: those, read as ``configure(endpoint=..., protocol=...)``
    reads them. Not given, in a process where ``configure()`` ran: where its metrics go.
    Otherwise ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` and
    ``..._METRICS_PROTOCOL`` / ``..._PROTOCOL`` (default: gRPC to ``localhost:4317``).
    """
    config = active.current_config() if endpoint is None and protocol is None else None
    if config is None or not config.enabled:
        config = instr_config.resolve(endpoint=endpoint, protocol=protocol, owns=False)
    return config


#: Where the SDK's ``OTLPMetricExporter`` sends when no endpoint is configured (its own
#: defaults: ``opentelemetry-exporter-otlp-proto-grpc`` / ``-proto-http``).
DEFAULT_ENDPOINTS = {
    instr_config.PROTOCOL_GRPC: "http://localhost:4317",
    instr_config.PROTOCOL_HTTP: "http://localhost:4318/v1/metrics",
}


def metrics_target(config: instr_config.Config) -> tuple[str, str]:
    """The protocol and the URL the metric exporter for ``config`` really sends to: the
    configured one, else the exporter's default for the protocol."""
    protocol, url = instr_config.metrics_endpoint(config)
    default = DEFAULT_ENDPOINTS[instr_config.PROTOCOL_GRPC]
    return protocol, url or DEFAULT_ENDPOINTS.get(protocol, default)


def metric_exporter(config: instr_config.Config) -> Any:
    """The official ``OTLPMetricExporter`` (gRPC or HTTP/protobuf) for ``config``; headers,
    timeout, compression and TLS come from the ``OTEL_EXPORTER_OTLP_[METRICS_]*``
    variables, which the exporter reads itself."""
    protocol, url = instr_config.metrics_endpoint(config)
    mismatch = instr_config.protocol_port_mismatch(url, protocol)
    if mismatch:
        _logger.warning("%s", mismatch)
    return instr_config.metric_exporter(config)


__all__ = [
    "DEFAULT_ENDPOINTS", "metric_exporter", "metrics_config", "metrics_target",
    "sampler_resource", "service_host_name", "to_metrics_data",
]
