"""A service in production mode, end to end: its summaries and a sample of its traces,
encoded by the OpenTelemetry SDK's OTLP encoders, folded by the collector's engine, give
the figures computed exactly from every request's own timings; the traces bring the
examples without counting any request twice."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

import inferprof
from inferprof import semconv as sc
from inferprof.batching import hooks
from inferprof.collector.attribution import exact_tail_shares
from inferprof.collector.engine import Engine
from inferprof.collector.sketch import exact_weighted_quantile
from inferprof.fastapi import middleware
from inferprof.instrumentation import stage as stage_module
from inferprof.timing import partition
from tests.collector.synth import FakeClock
from tests.collector.test_summaries import QS, _assert_matches_exact
from tests.instrumentation.helpers import captured
from tests.instrumentation.test_summaries import FakeClock as NsClock
from tests.instrumentation.test_summaries import MemoryExporter, _is_request, _service

N = 240
ERRORS = {5, 11, 30, 101, 202}


@pytest.fixture
def clock(monkeypatch) -> NsClock:
    """The instrumentation's clock, moved by the service: stage timings are known."""
    c = NsClock()
    for module in (stage_module, hooks, middleware):
        monkeypatch.setattr(module, "_time_ns", c)
    return c


def _exact(spans) -> dict:
    """Exact figures over every request, from its spans as the collector reads them."""
    by_id = {s.context.span_id: s for s in spans}
    requests = {s.context.span_id: s for s in spans if _is_request(s)}
    stages = defaultdict(list)
    for s in spans:
        if sc.ATTR_STAGE in (s.attributes or {}):
            cur = s
            while cur.context.span_id not in requests:
                cur = by_id[cur.parent.span_id]
            stages[cur.context.span_id].append((s.attributes[sc.ATTR_STAGE], s.start_time,
                                                s.end_time))
    e2e, values, exclusive, errors = [], defaultdict(list), [], 0
    for rid, r in requests.items():
        times, excl, unatt = partition(r.start_time, r.end_time, stages[rid])
        e2e.append((r.end_time - r.start_time) * 1e-9)
        for stage, t in [*times.items(), (sc.STAGE_UNATTRIBUTED, unatt)]:
            values[stage].append(t)
        exclusive.append({**excl, sc.STAGE_UNATTRIBUTED: unatt})
        errors += r.status.status_code.name == "ERROR"
    ones = [1.0] * len(e2e)
    return {
        "requests": len(e2e),
        "errors": errors,
        "latency": {k: exact_weighted_quantile(e2e, None, q) for k, q in QS.items()},
        "stages": {s: {k: exact_weighted_quantile(v, None, q) for k, q in QS.items()}
                   for s, v in values.items()},
        "counts": {s: len(v) for s, v in values.items()},
        "shares": exact_tail_shares(e2e, ones, exclusive,
                                    exact_weighted_quantile(e2e, None, 0.95)),
    }


@pytest.mark.parametrize("every", [1, 10])
def test_summaries_and_sampled_traces_give_the_exact_figures_of_every_request(clock, every):
    # sample_rate=1 keeps every trace: the exact reference; the collector gets the traces
    # of every ``every``-th request only, beside the summaries of all of them.
    exporter = MemoryExporter()
    with captured(mode="production", sample_rate=1.0, max_timed_rate=0,
                  summary_exporter=exporter, summary_interval_s=3600) as cap:
        asyncio.run(_service(clock, N, errors=ERRORS))
        inferprof.shutdown()  # flushes the summaries
        spans = cap.spans()
    requests = [s for s in spans if _is_request(s)]
    assert len(requests) == N
    assert all(r.attributes[sc.ATTR_SUMMARY_COUNTED] is True for r in requests)
    kept_traces = {r.context.trace_id for r in requests[::every]}
    engine = Engine(clock=FakeClock(clock.now * 1e-9 + 60), settle_s=0.0)
    for data in exporter.exports:
        result = engine.ingest_metrics(encode_metrics(data))
        assert result.rejected_spans == 0, result.errors
    result = engine.ingest_traces(
        encode_spans([s for s in spans if s.context.trace_id in kept_traces]))
    assert result.rejected_spans == 0, result.errors
    engine.flush()
    doc = engine.breakdown(requests[0].resource.attributes[sc.RESOURCE_SERVICE_NAME],
                           window_s=None)
    _assert_matches_exact(doc, _exact(spans))
    # the traces: drill-down only
    assert engine.stats.requests_finalised == len(kept_traces)
    assert doc["examples"]
    assert engine.stats.summary_requests == N
