"""Contract §15's untimed counting through middleware stacks and answers the random mix of
``test_untimed_random.py`` leaves out: Starlette's GZip, CORS and a ``BaseHTTPMiddleware``
inside inferprof's middleware or outside it, HEAD, 204 and 304 answers, 405s, dependencies
raising ``HTTPException``, a background task failing after the answer, a router included
twice. With the model named on the middleware every route is counted, so the collector
counts every request that reached the middleware exactly once, errors included; a CORS
preflight answered by a CORS middleware outside it reaches neither inferprof nor its
counts."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from fastapi import APIRouter, BackgroundTasks, Depends, FastAPI, HTTPException
from fastapi.responses import Response, StreamingResponse
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.gzip import GZipMiddleware

import inferprof
import inferprof.fastapi
from inferprof import semconv
from inferprof.instrumentation import stage as stage_module
from tests.fastapi.budget_helpers import budgeted_capture
from tests.instrumentation.test_summaries import MemoryExporter

_PREFLIGHT = {"origin": "http://ui", "access-control-request-method": "GET"}
KINDS = [("GET", "/a", "ok"), ("HEAD", "/a", "ok"), ("GET", "/a", "204"),
         ("GET", "/a", "304"), ("GET", "/a", "background-raise"), ("GET", "/a", "stream"),
         ("GET", "/a", "stream-raise"), ("GET", "/a", "dep401"), ("GET", "/a", "dep503"),
         ("POST", "/a", "ok"), ("PUT", "/a", "ok"), ("GET", "/v1/r", "ok"),
         ("GET", "/v1/r", "dep401"), ("GET", "/v2/r", "dep503"), ("GET", "/nope", "ok"),
         ("OPTIONS", "/a", "preflight")]


class _Passthrough(BaseHTTPMiddleware):
    async def dispatch(self, request, call_next):
        return await call_next(request)


def _app(outside: bool) -> FastAPI:
    """outside: GZip and CORS outside inferprof's middleware, else GZip and a
    BaseHTTPMiddleware inside it (and no CORS)."""
    app = FastAPI()
    router = APIRouter()

    def check(how: str = "ok"):
        if how.startswith("dep"):
            raise HTTPException(int(how[3:]))

    @router.get("/r", dependencies=[Depends(check)])
    async def r():
        with inferprof.stage("compute"):
            await asyncio.sleep(0)
        return {"body": "y" * 600}

    @app.api_route("/a", methods=["GET", "HEAD", "POST"], dependencies=[Depends(check)])
    async def a(tasks: BackgroundTasks, how: str = "ok"):
        with inferprof.stage("compute"):
            await asyncio.sleep(0)
        if how in ("204", "304"):
            return Response(status_code=int(how))
        if how == "background-raise":
            def fail() -> None:
                raise RuntimeError("after the answer")
            tasks.add_task(fail)
        if how.startswith("stream"):
            async def chunks():
                yield b"z" * 700
                if how == "stream-raise":
                    raise RuntimeError("mid-stream")
                yield b"z" * 700
            return StreamingResponse(chunks())
        return {"body": "y" * 600}

    app.include_router(router, prefix="/v1")
    app.include_router(router, prefix="/v2")
    if not outside:
        app.add_middleware(GZipMiddleware, minimum_size=500)
        app.add_middleware(_Passthrough)
    inferprof.fastapi.instrument(app, model_name="m")
    if outside:
        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"])
        app.add_middleware(GZipMiddleware, minimum_size=500)
    return app


@pytest.mark.parametrize("outside", [False, True])
def test_every_request_reaching_the_middleware_counts_once_through_middleware_stacks(
        monkeypatch, outside):
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from inferprof.collector.engine import Engine

    app = _app(outside)
    rng = random.Random(1)
    sent = [rng.choice(KINDS) for _ in range(2000)]
    monkeypatch.setattr(stage_module, "_random", random.Random(2).random)
    exporter = MemoryExporter()
    with budgeted_capture(exporter, sample_rate=1.0) as (cap, rt, budget_clock):

        async def run(requests: list) -> list[tuple[int, bool]]:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                out = []
                for method, path, how in requests:
                    headers = {"accept-encoding": "gzip"}
                    if how == "preflight":
                        headers.update(_PREFLIGHT)
                    r = await c.request(method, path, params={"how": how}, headers=headers)
                    out.append((r.status_code, how.endswith("raise")))
                return out

        answers = asyncio.run(run(KINDS))  # every kind timed once: the routes learnt
        for path in {path for _, path, _ in KINDS}:
            for _ in range(300):  # 300 a second: a share of 1/4
                rt.timing_budget.share(path)
        budget_clock.now += 1.0
        answers += asyncio.run(run(sent))
        inferprof.shutdown()
        spans = cap.spans()
        service = cap.provider.resource.attributes[semconv.RESOURCE_SERVICE_NAME]
        snap = inferprof.instrumentation.stats()
    assert snap.requests_untimed_counted > len(sent) // 2
    kinds = KINDS + sent
    preflights = sum(1 for _, _, how in kinds if how == "preflight")
    statuses = {status for status, _ in answers}
    assert {204, 304, 401, 404, 405, 503} <= statuses
    # a background task failing after a 200 and a stream failing after its first chunk are
    # errors (as their traces), with the 5xx answers
    errors = sum(1 for status, raised in answers if status >= 500 or raised)
    engine = Engine(settle_s=0.0)
    for data in exporter.exports:
        assert engine.ingest_metrics(encode_metrics(data)).rejected_spans == 0
    assert engine.ingest_traces(encode_spans(spans)).rejected_spans == 0
    engine.flush()
    doc = engine.breakdown(service, model="m", window_s=None)
    reached = len(kinds) - (preflights if outside else 0)  # outside: CORS answers them
    assert (doc["requests"], doc["errors"]) == (reached, errors)
