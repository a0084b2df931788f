"""Shared helpers for the collector transport tests (no tests here).

``running_app`` starts a real :class:`CollectorApp` on ephemeral 127.0.0.1 ports and
stops it afterwards; ``make_requests`` builds finished SDK spans of requests with
stage children (deterministic timings), which tests send with the SDK's real OTLP
exporters.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import httpx
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context

from inferprof import semconv as sc
from inferprof.collector.app import CollectorApp
from inferprof.collector.settings import CollectorSettings

#: Fast engine settings: traces settle quickly, small windows.
FAST = dict(
    grpc_port=0,
    http_port=0,
    api_port=0,
    settle_s=0.05,
    advance_interval_s=0.05,
    grpc_workers=4,
)

# Stage durations (ms) of the synthetic requests: a slow queue dominates the tail.
STAGES_MS = ((sc.STAGE_TOKENIZE, 2.0), (sc.STAGE_QUEUE, 10.0), (sc.STAGE_COMPUTE, 20.0))


@contextlib.contextmanager
def running_app(**overrides) -> Iterator[CollectorApp]:
    settings = CollectorSettings(**{**FAST, **overrides})
    app = CollectorApp(settings)
    app.start()
    try:
        yield app
    finally:
        app.stop()


def make_requests(
    n: int,
    *,
    service: str = "svc",
    model: str = "m",
    slow_every: int = 10,
    stages: Sequence[tuple[str, float]] = STAGES_MS,
) -> list[ReadableSpan]:
    """``n`` requests (SERVER span + one child per stage); every ``slow_every``-th
    request's queue stage is 10x longer. Returns the finished spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({sc.RESOURCE_SERVICE_NAME: service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("inferprof-tests")
    base = time.time_ns() - 5_000_000_000
    for i in range(n):
        t = base + i * 1_000_000
        slow = slow_every and i % slow_every == 0
        root = tracer.start_span(
            "POST /predict",
            kind=SpanKind.SERVER,
            start_time=t,
            attributes={sc.ATTR_MODEL_NAME: model},
        )
        ctx = set_span_in_context(root)
        cursor = t + 500_000  # 0.5 ms of receive before the first stage: unattributed
        for stage, ms in stages:
            dur = int(ms * 1e6 * (10 if (slow and stage == sc.STAGE_QUEUE) else 1))
            child = tracer.start_span(
                sc.span_name(stage),
                context=ctx,
                start_time=cursor,
                attributes={sc.ATTR_STAGE: stage, sc.ATTR_MODEL_NAME: model},
            )
            child.end(end_time=cursor + dur)
            cursor += dur
        root.end(end_time=cursor + 500_000)
    provider.shutdown()
    return list(exporter.get_finished_spans())


def breakdown(app: CollectorApp, service: str = "svc", **params) -> httpx.Response:
    app.engine.flush()
    return httpx.get(f"{app.api_url}/api/v1/breakdown", params={"service": service, **params})


def stage_counts(doc: dict) -> dict[str, int]:
    return {s["stage"]: s["count"] for s in doc["stages"]}


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
