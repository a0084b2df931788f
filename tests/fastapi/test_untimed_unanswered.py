"""Requests that end with no answer started (an exception before the response) on a
route whose untimed requests are counted (contract §15): a timed one may have no stage
span, so it is counted from its trace at the budget's weight, covering its untimed likes.
So a route's unanswered requests are learnt apart from its answered ones, and not counted
untimed (nor marked when timed) once a timed one had no stage span: each request counts
once, and the collector's request count and errors are unbiased, exact for the answered
ones (and for all when every request has a stage span). Likewise a route that serves
generations of the engine step API is not counted."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

import inferprof
import inferprof.fastapi
from inferprof import semconv
from inferprof.instrumentation import stage as stage_module
from tests.fastapi.budget_helpers import budgeted_capture
from tests.instrumentation.test_summaries import MemoryExporter, decode

MS = 1_000_000
_UNTIMED = semconv.METRIC_SUMMARY_REQUEST_UNTIMED
_REQ = semconv.METRIC_SUMMARY_REQUEST_DURATION
_ERROR = semconv.ATTR_REQUEST_ERROR


@pytest.mark.parametrize("no_stage", [True, False])
def test_unanswered_requests_count_once_learnt_apart_from_the_answered_ones(
        clock, monkeypatch, no_stage):
    # no_stage: some requests fail before any stage (not summarised when timed), so the
    # route's unanswered requests are estimated from their traces and the answered ones
    # exact; else every one has a stage span, and every request counts exactly.
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from inferprof.collector.engine import Engine
    from tests.collector.synth import FakeClock as SecondsClock

    app = FastAPI()
    kinds = ("stage-raise", "body-raise", "503", "stream-raise", "ok", "ok", "ok")
    if no_stage:
        kinds = ("raise", *kinds)

    @app.post("/r")
    async def r(request: Request):
        how = request.query_params["how"]
        if how == "body-raise":
            await request.body()
            raise RuntimeError("after the body")
        if how == "raise":  # no body read, no stage, no answer: no stage span if timed
            raise RuntimeError("before anything")
        with inferprof.stage("compute"):
            clock.tick(MS)
        if how == "stage-raise":
            raise RuntimeError("after a stage")
        if how == "503":
            return JSONResponse({}, status_code=503)
        if how == "stream-raise":  # answered (200), then an exception: an error

            async def chunks():
                yield b"a"
                raise RuntimeError("mid-stream")

            return StreamingResponse(chunks())
        return {}

    inferprof.fastapi.instrument(app, model_name="m")
    rng = random.Random(7)
    warm = [kinds[0], "ok"]  # timed (under the budget): the route's two parts learnt
    sent = [rng.choice(kinds) for _ in range(3000)]
    monkeypatch.setattr(stage_module, "_random", random.Random(11).random)
    exporter = MemoryExporter()
    # sample_rate=1: every timed request's trace is kept (the fast ones at weight 1 x the
    # budget's), so the only randomness is which requests the budget times
    with budgeted_capture(exporter, sample_rate=1.0) as (cap, rt, budget_clock):

        async def run(hows: list[str]) -> list[int]:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                return [(await c.post("/r", params={"how": how}, content=b"x" * 10)
                         ).status_code for how in hows]

        asyncio.run(run(warm))
        budget_clock.step = 1 / 300  # 300 a second from now on, steady: a share of 1/4
        for _ in range(60):
            rt.timing_budget.share("/r")
        statuses = asyncio.run(run(sent))
        inferprof.shutdown()
        spans = cap.spans()
        service = cap.provider.resource.attributes[semconv.RESOURCE_SERVICE_NAME]
        snap = inferprof.instrumentation.stats()
    assert snap.requests_untimed > len(sent) // 2
    answered = [how for how in sent if how in ("503", "stream-raise", "ok")]
    unanswered = len(sent) - len(answered)
    assert statuses.count(500) == unanswered and statuses.count(503) == sent.count("503")
    # exactly, untimed counted and marked timed: the answered ones, and the unanswered
    # ones too when none lacks a stage span
    got = decode(exporter.exports)
    counted = sum(d["count"] for d in got[_UNTIMED].values())
    counted += sum(d["count"] for k, d in got[_REQ].items()
                   if dict(k).get(semconv.ATTR_SUMMARY_UNTIMED_COUNTED))
    errors = sum(d["count"] for k, d in got[_UNTIMED].items() if dict(k).get(_ERROR))
    errors += sum(d["count"] for k, d in got[_REQ].items()
                  if dict(k).get(semconv.ATTR_SUMMARY_UNTIMED_COUNTED) and dict(k).get(_ERROR))
    if no_stage:
        assert counted == len(answered)
        assert errors == sum(1 for how in answered if how != "ok")
    else:
        assert counted == len(sent)
        assert errors == sum(1 for how in sent if how != "ok")
    engine = Engine(clock=SecondsClock(clock.now * 1e-9 + 60), settle_s=0.0)
    for data in exporter.exports:
        assert engine.ingest_metrics(encode_metrics(data)).rejected_spans == 0
    assert engine.ingest_traces(encode_spans(spans)).rejected_spans == 0
    engine.flush()
    doc = engine.breakdown(service, window_s=None)
    served = len(warm) + len(sent)
    errors = 1 + sum(1 for how in sent if how != "ok")
    if no_stage:
        # the unanswered ones estimated from the timed ones (weight 4): about 1,300
        # requests, a standard error of about 4 x sqrt(1300 x 3/16) = 62; counted untimed
        # too (while the route was counted) they made about 1,800
        assert doc["requests"] == pytest.approx(served, abs=190)
        assert doc["errors"] == pytest.approx(errors, abs=190)
    else:
        assert (doc["requests"], doc["errors"]) == (served, errors)


def test_a_route_serving_generations_is_not_counted_so_each_request_counts_once(
        clock, monkeypatch):
    # A route whose requests are sometimes generations of the engine step API (a cache
    # answering the others, say): a timed generation is not summarised, it is counted from
    # its trace at the budget's weight, covering its untimed likes; the untimed branch
    # cannot tell them from the others, so the route is counted no more.
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from inferprof.collector.engine import Engine
    from tests.collector.synth import FakeClock as SecondsClock

    app = FastAPI()
    recorder = inferprof.Engine("g0")

    @app.get("/c")
    async def c(how: str):
        if how == "generate":
            gen = recorder.request(prompt_tokens=2)
            clock.tick(MS)
            gen.finish()
            return {}
        with inferprof.stage("compute"):
            clock.tick(MS)
        return {}

    inferprof.fastapi.instrument(app, model_name="m")
    rng = random.Random(5)
    sent = [rng.choice(("generate", "cached")) for _ in range(3000)]
    monkeypatch.setattr(stage_module, "_random", random.Random(13).random)
    exporter = MemoryExporter()
    with budgeted_capture(exporter, sample_rate=1.0) as (cap, rt, budget_clock):
        for _ in range(300):  # a share of 1/4
            rt.timing_budget.share("/c")
        budget_clock.now += 1.0

        async def run() -> None:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                for how in sent:
                    assert (await c.get("/c", params={"how": how})).status_code == 200

        asyncio.run(run())
        inferprof.shutdown()
        recorder.flush()
        spans = cap.spans()
        service = cap.provider.resource.attributes[semconv.RESOURCE_SERVICE_NAME]
        snap = inferprof.instrumentation.stats()
    assert snap.requests_untimed > len(sent) // 2
    engine = Engine(clock=SecondsClock(clock.now * 1e-9 + 60), settle_s=0.0)
    for data in exporter.exports:
        assert engine.ingest_metrics(encode_metrics(data)).rejected_spans == 0
    assert engine.ingest_traces(encode_spans(spans)).rejected_spans == 0
    engine.flush()
    doc = engine.breakdown(service, window_s=None)
    # all estimated from the timed ones (weight 4): a standard error of about
    # 4 x sqrt(3000 x 3/16) = 95 requests; counted untimed while the route's last timed
    # request was no generation, the untimed generations made about 3,500
    assert doc["requests"] == pytest.approx(len(sent), abs=300)
