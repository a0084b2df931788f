"""Differential test of contract §15's untimed counting: a FastAPI service in production
mode (a timing budget leaving most requests untimed) serves a random mix over routes of
several kinds; its summaries and kept traces, folded by the collector's engine, give per
model the exact requests and errors sent wherever every request of that model's routes is
counted (answered requests of routes learnt under one model: plain and streamed answers,
5xx answers, HTTPExceptions, a mid-stream exception, a sub-app mounted twice, 404s with no
route), and an estimate elsewhere (a route naming two models, one that sometimes serves
a generation of the engine step API, requests ending in an exception before any answer),
so the service's total is about what was sent."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx
import pytest
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse

import inferprof
import inferprof.fastapi
from inferprof import semconv
from inferprof.instrumentation import stage as stage_module
from tests.fastapi.budget_helpers import budgeted_capture
from tests.instrumentation.test_summaries import MemoryExporter

MS = 1_000_000


@pytest.mark.parametrize("seed", [1, 2])
def test_a_random_mix_counts_each_request_once_per_model(clock, monkeypatch, seed):
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from inferprof.collector.engine import Engine
    from tests.collector.synth import FakeClock as SecondsClock

    truth: Counter = Counter()  # (model, error) -> n
    app = FastAPI()
    sub = FastAPI()

    def model(m):
        req = inferprof.current_request()
        if req is not None:
            req.set_attribute(semconv.ATTR_MODEL_NAME, m)

    @app.get("/a")
    async def a(i: int, how: str):
        model("a")
        with inferprof.stage("compute"):
            clock.tick(MS * (1 + i % 5))
        if how == "503":
            return JSONResponse({}, status_code=503)
        if how == "http500":
            raise HTTPException(500)
        if how == "404":
            raise HTTPException(404)
        if how == "stream-raise":
            async def chunks():
                yield b"a"
                clock.tick(MS)
                raise RuntimeError("mid")
            return StreamingResponse(chunks())
        if how == "stream":
            async def chunks2():
                for _ in range(3):
                    clock.tick(MS)
                    yield b"data: x\n\n"
            return StreamingResponse(chunks2(), media_type="text/event-stream")
        return {}

    @app.get("/mix")
    async def mix(i: int, how: str):
        model("x" if i % 2 else "y")
        with inferprof.stage("compute"):
            clock.tick(MS)
        return {}

    @sub.get("/s")
    async def s(i: int, how: str):
        model("s")
        with inferprof.stage("compute"):
            clock.tick(MS * 2)
        if how == "503":
            return JSONResponse({}, status_code=503)
        return {}

    recorder = inferprof.Engine("g0")

    @app.get("/g")
    async def g(i: int, how: str):
        model("g")
        if how == "generate":
            gen = recorder.request(prompt_tokens=2)
            clock.tick(MS)
            gen.finish()
            return {}
        with inferprof.stage("compute"):
            clock.tick(MS)
        return {}

    @app.get("/u")
    async def u(i: int, how: str):
        model("u")
        if how == "raise":
            raise RuntimeError("before any answer")
        with inferprof.stage("compute"):
            clock.tick(MS)
        return {}

    app.mount("/v1", sub)
    app.mount("/v2", sub)
    inferprof.fastapi.instrument(app)
    kinds = {"/a": ["ok", "ok", "503", "http500", "404", "stream-raise", "stream"],
             "/mix": ["ok"], "/v1/s": ["ok", "503"], "/v2/s": ["ok", "503"], "/nope": ["ok"],
             "/g": ["ok", "generate"], "/u": ["ok", "raise"]}
    models = {"/a": "a", "/v1/s": "s", "/v2/s": "s", "/nope": None}
    rng = random.Random(seed)
    warm = [(p, 1, "ok") for p in ("/a", "/v1/s", "/v2/s", "/nope")]
    sent = [(p := rng.choice(list(kinds)), i, rng.choice(kinds[p])) for i in range(4000)]
    monkeypatch.setattr(stage_module, "_random", random.Random(seed + 100).random)
    exporter = MemoryExporter()
    with budgeted_capture(exporter, sample_rate=1.0) as (cap, rt, bc):

        async def run(reqs):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                out = []
                for p, i, how in reqs:
                    r = await c.get(p, params={"i": i, "how": how})
                    out.append(r.status_code)
                return out
        asyncio.run(run(warm))
        # 300 a second per path from now on, steady: a share of 1/4 (about 30 a tenth of a
        # second each, within the tenth's budget of 10 at that share)
        bc.step = 1 / (300 * len(kinds))
        for _ in range(60):
            for p in kinds:
                rt.timing_budget.share(p)
        statuses = asyncio.run(run(sent))
        inferprof.shutdown()
        recorder.flush()
        spans = cap.spans()
        service = cap.provider.resource.attributes[semconv.RESOURCE_SERVICE_NAME]
        snap = inferprof.instrumentation.stats()
    assert snap.requests_untimed > len(sent) // 2
    assert statuses.count(500) == sum(1 for _, _, how in sent if how in ("http500", "raise"))
    for p, _, how in warm + sent:
        if p in models:
            truth[models[p]] += 1
            truth[(models[p], "err")] += how in ("503", "http500", "stream-raise")
    engine = Engine(clock=SecondsClock(clock.now * 1e-9 + 60), settle_s=0.0)
    for data in exporter.exports:
        r = engine.ingest_metrics(encode_metrics(data))
        assert r.rejected_spans == 0, r.errors
    r = engine.ingest_traces(encode_spans(spans))
    assert r.rejected_spans == 0, r.errors
    engine.flush()
    for m in ("a", "s", None):
        doc = engine.breakdown(service, model=m if m is not None else "", window_s=None)
        assert (doc["requests"], doc["errors"]) == (truth[m], truth[(m, "err")]), m
    # the rest estimated from the timed requests (weight 4): about 1,500 requests, a
    # standard error of about 4 x sqrt(1500 x 3/16) = 67 (the two bugs the dedicated tests
    # in test_untimed_unanswered.py catch made these 125 and 154 more than sent)
    doc = engine.breakdown(service, window_s=None)
    assert doc["requests"] == pytest.approx(len(warm) + len(sent), abs=160)
