"""OpenMetrics exemplars on the duration histograms: a real request's trace per bucket."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from inferprof import semconv as sc
from inferprof.collector.engine import HISTOGRAM_BOUNDS, Engine
from inferprof.collector.metrics import EngineCollector
from tests.collector.synth import FakeClock, TraceBuilder

_EDGES = (0.0, *HISTOGRAM_BOUNDS, float("inf"))


def _fold(engine: Engine, b: TraceBuilder, start: float, n: int, rng: random.Random):
    """``n`` requests (queue, compute); returns per request (trace id hex, queue, e2e)."""
    truth = []
    for i in range(n):
        q, c = rng.choice((0.0008, 0.003, 0.02, 0.2)) * rng.uniform(1, 2), 0.01
        ref, e2e = b.sequential(start + i * 0.01, [("queue", q), ("compute", c)])
        truth.append((ref.trace_id.hex(), q, e2e))
    engine.ingest_traces(b.export())
    b.spans.clear()
    engine.flush()
    return truth


def _exemplars(engine: Engine) -> dict[tuple[str, float], tuple[str, float, float]]:
    """(stage or "" for the request histogram, bucket upper bound) -> exemplar."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    out = {}
    for family in text_string_to_metric_families(openmetrics(registry).decode()):
        if family.name not in (sc.PROM_STAGE_DURATION, sc.PROM_REQUEST_DURATION):
            continue
        for sample in family.samples:
            if sample.exemplar is not None:
                key = (sample.labels.get("stage", ""), float(sample.labels["le"]))
                ex = sample.exemplar
                when = ex.timestamp.sec + ex.timestamp.nsec * 1e-9
                out[key] = (ex.labels["trace_id"], ex.value, when)
    return out


def _bucket(value: float) -> float:
    """Upper bound of the bucket holding ``value`` (Prometheus buckets are le)."""
    return next(b for b in _EDGES[1:] if value <= b)


def test_each_bucket_names_the_slowest_request_in_it():
    clock = FakeClock()
    engine = Engine(settle_s=0, clock=clock)
    truth = _fold(engine, TraceBuilder(), 0.0, 300, random.Random(3))
    exemplars = _exemplars(engine)
    for stage, pick in (("queue", 1), ("", 2)):
        expected = {}
        for row in truth:
            le = _bucket(row[pick])
            if le not in expected or row[pick] > expected[le][pick]:
                expected[le] = row
        got = {le: ex for (st, le), ex in exemplars.items() if st == stage}
        assert got.keys() == expected.keys()
        for le, ex in got.items():
            assert ex[0] == expected[le][0]
            assert ex[1] == pytest.approx(expected[le][pick], abs=1e-9)
            assert ex[2] == pytest.approx(clock.t, abs=1e-3)  # the collector's time of the fold


def test_a_newer_fold_replaces_a_buckets_exemplar_and_the_text_format_has_none():
    clock = FakeClock()
    engine = Engine(settle_s=0, clock=clock)
    b = TraceBuilder()
    old, _ = b.sequential(0.0, [("queue", 0.2), ("compute", 0.01)])
    engine.ingest_traces(b.export())
    b.spans.clear()
    engine.flush()
    clock.tick(30)
    new, _ = b.sequential(30.0, [("queue", 0.15), ("compute", 0.01)])  # same bucket, faster
    engine.ingest_traces(b.export())
    engine.flush()
    ex = _exemplars(engine)[("queue", 0.25)]
    assert ex[0] == new.trace_id.hex()
    assert ex[2] == pytest.approx(clock.t, abs=1e-3)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    assert "trace_id" not in generate_latest(registry).decode()
    assert old.trace_id.hex() not in openmetrics(registry).decode()


def test_metrics_endpoint_serves_exemplars_to_an_openmetrics_scraper():
    import httpx
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from tests.collector.test_server_fixtures import breakdown, make_requests, running_app

    spans = make_requests(20)
    traces = {format(s.context.trace_id, "032x") for s in spans}
    with running_app() as app:
        OTLPSpanExporter(endpoint=f"{app.otlp_http_endpoint}/v1/traces").export(spans)
        breakdown(app)
        om = httpx.get(f"{app.api_url}/metrics",
                       headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        text = httpx.get(f"{app.api_url}/metrics")
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    named = {line.split('trace_id="')[1][:32] for line in om.text.splitlines()
             if line.startswith(sc.PROM_STAGE_DURATION) and "# {trace_id=" in line}
    assert named and named <= traces
    assert text.headers["content-type"].startswith("text/plain")
    assert "trace_id" not in text.text
