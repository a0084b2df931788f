"""Synthetic OTLP exports built with the real protobuf classes, for collector tests.

    b = TraceBuilder(service="svc")
    req = b.request(0.0, 0.100, model="m")
    b.stage(req, "queue", 0.0, 0.040)
    b.stage(req, "compute", 0.040, 0.090, batch_id="b1", batch_size=4)
    request = b.export()          # an ExportTraceServiceRequest holding every span so far

Times are seconds from ``base_unix`` (default 1.7e9). Ids are deterministic (a counter),
so tests are reproducible.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1 import trace_pb2

from inferprof import semconv as sc

BASE_UNIX = 1_700_000_000.0
SERVER = trace_pb2.Span.SPAN_KIND_SERVER
INTERNAL = trace_pb2.Span.SPAN_KIND_INTERNAL
CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT
_ids = itertools.count(1)


@dataclass(frozen=True)
class Ref:
    trace_id: bytes
    span_id: bytes


def any_value(value: Any) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    return AnyValue(string_value=str(value))


def attributes(mapping: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in mapping.items() if v is not None]


def new_trace_id() -> bytes:
    return next(_ids).to_bytes(16, "big")


def new_span_id() -> bytes:
    return next(_ids).to_bytes(8, "big")


class TraceBuilder:
    def __init__(
        self,
        service: str = "svc",
        *,
        host: str = "host-1",
        instance: str = "i-1",
        base_unix: float = BASE_UNIX,
        scope: str = "",
    ) -> None:
        self.scope = scope
        self.resource = {
            sc.RESOURCE_SERVICE_NAME: service,
            sc.RESOURCE_HOST_NAME: host,
            sc.RESOURCE_SERVICE_INSTANCE_ID: instance,
        }
        self.base = base_unix
        self.spans: list[trace_pb2.Span] = []

    def ns(self, t: float) -> int:
        # Integer base + offset: float seconds since 1970 would lose sub-microsecond digits.
        return round(self.base * 1e9) + round(t * 1e9)

    def span(
        self,
        name: str,
        start: float,
        end: float,
        *,
        parent: Ref | None = None,
        trace_id: bytes | None = None,
        kind: int = INTERNAL,
        attrs: dict | None = None,
        links: Sequence[Ref] = (),
        trace_state: str = "",
        span_id: bytes | None = None,
        events: Sequence[tuple[str, float]] = (),
        status: int = 0,
    ) -> Ref:
        """``events``: (name, time in seconds from the base) of each span event;
        ``status``: the span's status code (2: ERROR)."""
        tid = parent.trace_id if parent is not None else (trace_id or new_trace_id())
        sid = span_id or new_span_id()
        span = trace_pb2.Span(
            trace_id=tid,
            span_id=sid,
            name=name,
            kind=kind,
            trace_state=trace_state,
            parent_span_id=parent.span_id if parent is not None else b"",
            start_time_unix_nano=self.ns(start),
            end_time_unix_nano=self.ns(end),
            attributes=attributes(attrs or {}),
            links=[trace_pb2.Span.Link(trace_id=l.trace_id, span_id=l.span_id) for l in links],
            events=[trace_pb2.Span.Event(name=n, time_unix_nano=self.ns(t)) for n, t in events],
            status=trace_pb2.Status(code=status),
        )
        self.spans.append(span)
        return Ref(tid, sid)

    def request(
        self,
        start: float,
        end: float,
        *,
        model: str | None = "m",
        weight: float | None = None,
        trace_state: str = "",
        parent: Ref | None = None,
        kind: int = SERVER,
        status: int = 0,
        **attrs: Any,
    ) -> Ref:
        a = {sc.ATTR_MODEL_NAME: model, sc.ATTR_SAMPLE_WEIGHT: weight, **attrs}
        return self.span(
            "POST /infer", start, end, parent=parent, kind=kind, attrs=a, trace_state=trace_state,
            status=status,
        )

    def stage(
        self,
        parent: Ref | None,
        stage: str,
        start: float,
        end: float,
        *,
        links: Sequence[Ref] = (),
        batch_id: str | None = None,
        batch_size: int | None = None,
        effective: int | None = None,
        padded: int | None = None,
        gpu_id: str | None = None,
        model: str | None = None,
        **attrs: Any,
    ) -> Ref:
        a = {
            sc.ATTR_STAGE: stage,
            sc.ATTR_BATCH_ID: batch_id,
            sc.ATTR_BATCH_SIZE: batch_size,
            sc.ATTR_TOKENS_EFFECTIVE: effective,
            sc.ATTR_TOKENS_PADDED: padded,
            sc.ATTR_GPU_ID: gpu_id,
            sc.ATTR_MODEL_NAME: model,
            **attrs,
        }
        return self.span(sc.span_name(stage), start, end, parent=parent, attrs=a, links=links)

    def sequential(
        self,
        start: float,
        stages: Iterable[tuple[str, float]],
        *,
        tail_gap: float = 0.0,
        model: str | None = "m",
        weight: float | None = None,
        **kw: Any,
    ) -> tuple[Ref, float]:
        """A request whose stages run back to back, then ``tail_gap`` uncovered seconds.

        Returns the request's ref and its end-to-end time.
        """
        stages = list(stages)
        e2e = sum(d for _, d in stages) + tail_gap
        req = self.request(start, start + e2e, model=model, weight=weight, **kw)
        t = start
        for stage, d in stages:
            self.stage(req, stage, t, t + d)
            t += d
        return req, e2e

    def triton_request(
        self,
        parent: Ref | None,
        start: float,
        end: float,
        *,
        model: str = "double",
        queue_start: float | None = None,
        compute: Sequence[float] | None = None,
        model_events: Sequence[tuple[str, float]] | None = None,
        compute_events: Sequence[tuple[str, float]] | None = None,
        trace_id: bytes | None = None,
    ) -> dict[str, Ref]:
        """The three spans Triton exports for one request, shaped as Triton 2.51 sends them
        (build with ``scope="triton-server"``): ``InferRequest`` (SERVER), the model span
        (named after the model, ``triton.model_name``, events REQUEST_START, QUEUE_START,
        REQUEST_END) and ``compute`` (COMPUTE_START, COMPUTE_INPUT_END,
        COMPUTE_OUTPUT_START, COMPUTE_END at the four times ``compute``; no compute span
        when None). ``model_events`` / ``compute_events`` replace the generated events.
        """
        server = SERVER
        req = self.span(
            "InferRequest",
            start,
            end,
            parent=parent,
            trace_id=trace_id,
            kind=server,
            events=[
                ("HTTP_RECV_START", start - 0.0001),
                ("HTTP_RECV_END", start - 0.00005),
                ("HTTP_SEND_START", end - 0.00002),
                ("HTTP_SEND_END", end - 0.00001),
            ],
        )
        m_start, m_end = start + 0.00001, end - 0.00003
        if model_events is None:
            q = m_start + 0.00001 if queue_start is None else queue_start
            model_events = [("REQUEST_START", m_start), ("QUEUE_START", q), ("REQUEST_END", m_end)]
        m = self.span(
            model,
            m_start,
            m_end,
            parent=req,
            kind=server,
            attrs={"triton.model_name": model, "triton.model_version": 1},
            events=model_events,
        )
        out = {"request": req, "model": m}
        if compute is not None or compute_events is not None:
            if compute_events is None:
                names = (
                    "COMPUTE_START",
                    "COMPUTE_INPUT_END",
                    "COMPUTE_OUTPUT_START",
                    "COMPUTE_END",
                )
                compute_events = list(zip(names, compute))
            times = [t for _, t in compute_events] or [m_start]
            out["compute"] = self.span(
                "compute", min(times), max(times), parent=m, kind=server, events=compute_events
            )
        return out

    def export(self, spans: Sequence[trace_pb2.Span] | None = None) -> ExportTraceServiceRequest:
        """All spans built so far (or ``spans``) in one export; the builder is emptied."""
        chosen = self.spans if spans is None else list(spans)
        if spans is None:
            self.spans = []
        req = ExportTraceServiceRequest()
        rs = req.resource_spans.add()
        rs.resource.attributes.extend(attributes(self.resource))
        ss = rs.scope_spans.add()
        if self.scope:
            ss.scope.name = self.scope
        ss.spans.extend(chosen)
        return req


def gpu_metrics(
    samples: Iterable[tuple[float, float]],
    *,
    metric: str = sc.METRIC_GPU_UTILIZATION,
    host: str = "host-1",
    hw_id: str = "GPU-0",
    base_unix: float = BASE_UNIX,
    model: str | None = None,
) -> ExportMetricsServiceRequest:
    """One gauge with a data point per ``(t, value)`` sample; ``model``: its ``hw.model``."""
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.extend(attributes({sc.RESOURCE_HOST_NAME: host}))
    m = rm.scope_metrics.add().metrics.add()
    m.name = metric
    for t, v in samples:
        dp = m.gauge.data_points.add()
        dp.time_unix_nano = round(base_unix * 1e9) + round(t * 1e9)
        dp.as_double = v
        dp.attributes.extend(attributes({sc.ATTR_HW_ID: hw_id, sc.ATTR_HW_MODEL: model}))
    return req


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field: tag, length, payload."""
    out = bytearray()
    for n in (number << 3 | 2, len(payload)):
        while n > 0x7F:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        out.append(n)
    return bytes(out) + payload


_bulk_ids = itertools.count(1 << 40)


def bulk_export(
    n_spans: int, *, links_per_span: int = 0, stage: str = "compute", service: str = "svc"
) -> ExportTraceServiceRequest:
    """``n_spans`` stage spans, each in a trace of its own with no request span, each
    linking ``links_per_span`` request spans that never arrive: for tests that need the
    collector to hold hundreds of thousands of entries. Built as protobuf bytes and
    parsed (building each span with the protobuf classes would take the test's time)."""
    body = trace_pb2.Span(
        name=sc.span_name(stage),
        start_time_unix_nano=round(BASE_UNIX * 1e9),
        end_time_unix_nano=round(BASE_UNIX * 1e9) + 1_000_000,
        attributes=attributes({sc.ATTR_STAGE: stage}),
    ).SerializeToString()
    pack = struct.Struct(">QQ").pack
    spans = []
    for _ in range(n_spans):
        first = next(_bulk_ids)
        links = b"".join(
            _field(13, _field(1, pack(7, i)) + _field(2, pack(0, i)[8:]))
            for i in (next(_bulk_ids) for _ in range(links_per_span))
        )
        head = _field(1, pack(1, first)) + _field(2, pack(0, first)[8:])
        spans.append(_field(2, head + body + links))
    resource = Resource(attributes=attributes({sc.RESOURCE_SERVICE_NAME: service}))
    payload = _field(1, resource.SerializeToString()) + _field(2, b"".join(spans))
    return ExportTraceServiceRequest.FromString(_field(1, payload))


class FakeClock:
    def __init__(self, t: float = BASE_UNIX) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float) -> float:
        self.t += dt
        return self.t


__all__ = [
    "FakeClock", "Ref", "TraceBuilder", "any_value", "attributes", "bulk_export", "gpu_metrics",
]
