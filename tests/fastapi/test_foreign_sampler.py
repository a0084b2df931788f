"""Production mode under another instrumentation's request spans
(``opentelemetry-instrumentation-fastapi``) whose sampler keeps a share of them: a kept one
carries ``1 / its ratio`` as ``inferprof.sample.weight`` and stands for the requests the
sampler did not keep, so inferprof neither times nor counts those (contract §15); where the
sampler follows a caller's decision (``ParentBased``), a kept one weighs 1 and inferprof
counts the others itself. Either way the collector counts each request once."""

from __future__ import annotations

import asyncio
import math
import random

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind

import inferprof
import inferprof.fastapi
from inferprof import semconv
from inferprof.instrumentation import stage as stage_module
from tests.fastapi.budget_helpers import install_budget
from tests.instrumentation.test_summaries import MemoryExporter

RATIO = 0.25


@pytest.mark.parametrize("callers", [False, True])
def test_each_request_counts_once_under_another_instrumentations_ratio_sampler(
        monkeypatch, callers):
    # callers=False: roots, sampled at RATIO (a kept span weighs 4), over a timing budget
    # (most of inferprof's requests would go untimed, counted); True: every request
    # continues a caller's trace, half of them sampled, which ParentBased follows (a kept
    # span weighs 1), every request timed.
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    from inferprof.collector.engine import Engine

    spans_out = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(RATIO)))
    provider.add_span_processor(SimpleSpanProcessor(spans_out))
    summaries = MemoryExporter()
    app = FastAPI()

    @app.post("/generate")
    async def generate(body: dict):
        async with inferprof.request(model="m"):  # named inside: a nested request()
            with inferprof.stage("compute"):
                await asyncio.sleep(0)
        return {"i": body["i"]}

    inferprof.fastapi.instrument(app)
    monkeypatch.setattr(stage_module, "_random", random.Random(3).random)
    inferprof.configure(tracer_provider=provider, mode="production", sample_rate=1.0,
                        max_timed_rate=0 if callers else 100, summary_exporter=summaries,
                        summary_interval_s=3600)
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
    n = 2000
    try:
        rt = inferprof._config.active_runtime()
        budget_clock = None if callers else install_budget(rt)

        async def run() -> None:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                for i in range(n):
                    headers = {}
                    if callers:
                        flags = "01" if i % 2 else "00"
                        headers["traceparent"] = f"00-{i + 1:032x}-{i + 1:016x}-{flags}"
                    r = await c.post("/generate", json={"i": i}, headers=headers)
                    assert r.status_code == 200
                    if i == 0 and budget_clock is not None:
                        for _ in range(300):  # 300 a second: inferprof would time 1 in 4
                            rt.timing_budget.share("/generate")
                        budget_clock.now += 1.0

        asyncio.run(run())
        snap = inferprof.instrumentation.stats()
        inferprof.shutdown()
    finally:
        FastAPIInstrumentor.uninstrument_app(app)
        provider.shutdown()
    spans = spans_out.get_finished_spans()
    kept = [s for s in spans if s.kind is SpanKind.SERVER  # the other instrumentation's
            and s.instrumentation_scope.name != semconv.INSTRUMENTATION_SCOPE]
    service = provider.resource.attributes[semconv.RESOURCE_SERVICE_NAME]
    engine = Engine(settle_s=0.0)
    for data in summaries.exports:
        assert engine.ingest_metrics(encode_metrics(data)).rejected_spans == 0
    assert engine.ingest_traces(encode_spans(spans)).rejected_spans == 0
    engine.flush()
    requests = engine.breakdown(service, model="m", window_s=None)["requests"]
    if callers:
        assert len(kept) == n // 2  # the callers' sampled half, at weight 1
        assert all(s.attributes.get(semconv.ATTR_SAMPLE_WEIGHT, 1.0) == 1.0 for s in kept)
        assert snap.requests_summarised == n // 2  # the other half, inferprof's own
        assert requests == n
    else:
        # the sampler's kept spans stand for every request (before, inferprof also
        # counted the ones it did not keep: about 1.8 x what was sent)
        assert snap.requests_summarised == snap.requests_untimed_counted == 0
        assert snap.requests_untimed == 0
        assert {s.attributes[semconv.ATTR_SAMPLE_WEIGHT] for s in kept} == {1 / RATIO}
        assert requests == round(len(kept) / RATIO)
        error = 5 * math.sqrt(n * RATIO * (1 - RATIO)) / RATIO  # 5 standard errors
        assert abs(requests - n) < error
