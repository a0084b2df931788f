"""End to end: a FastAPI front end (uvicorn, inferprof's middleware) that tokenises and calls
a real Triton server through an instrumented client, exporting OTLP to a real receiver;
Triton exporting its own spans of the same traces; the collector's engine folding both."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import inferprof
import inferprof.fastapi
import inferprof.triton
from inferprof import semconv
from inferprof.collector.engine import Engine
from tests.collector.synth import FakeClock
from tests.otlp_sink import attributes

pytestmark = pytest.mark.integration

N = 6


def _app(triton_url: str) -> FastAPI:
    import tritonclient.http.aio as httpclient

    clients: list = []

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        for c in clients:
            await c.close()

    app = FastAPI(lifespan=lifespan)

    @app.post("/embed")
    async def embed(body: dict):
        if not clients:  # an aio client belongs to the event loop it was made on
            clients.append(
                inferprof.triton.instrument(httpclient.InferenceServerClient(triton_url))
            )
        with inferprof.stage("tokenize"):
            x = np.array([[float(len(w)) for w in body["text"].split()]], dtype=np.float32)
        t = httpclient.InferInput("x", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        result = await clients[0].infer("double", [t])
        return {"y": result.as_numpy("y").tolist()}

    inferprof.fastapi.instrument(app, model_name="embedder")
    return app


@pytest.fixture
def front_end(triton):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_app(triton.http_url), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def test_front_end_breakdown_has_network_and_tritons_spans_join_its_traces(
    otlp_sink, triton_traces, front_end
):
    inferprof.configure(
        service_name="front",
        endpoint=otlp_sink.endpoint,
        set_global=False,
        metric_readers=[InMemoryMetricReader()],
    )
    with httpx.Client(base_url=front_end, timeout=10) as http:
        for i in range(N):
            r = http.post("/embed", json={"text": "a bb ccc " * (i + 1)})
            assert r.status_code == 200
            assert r.json()["y"][0][:3] == [2.0, 4.0, 6.0]
    inferprof.shutdown()  # flushes the front end's spans to the receiver

    ours = [span for resource, span in otlp_sink.spans() if resource["service.name"] == "front"]
    stages = [s for s in ours if attributes(s).get(semconv.ATTR_STAGE) == semconv.STAGE_NETWORK]
    assert len(stages) == N
    traces = {s.trace_id for s in stages}
    by_parent = {s.span_id: s for s in stages}

    def tritons(spans):
        return [s for s in spans if s.trace_id in traces and s.name == "InferRequest"]

    served = tritons(triton_traces.wait_for(lambda s: len(tritons(s)) == N, service="triton"))
    assert {s.parent_span_id for s in served} == set(by_parent)  # each under its stage

    # The collector, fed both services' spans as they arrived, breaks the front end down as
    # before: Triton's request spans (SERVER spans whose parent is in another service) carry
    # no inferprof stage, so they are not requests of a service of their own.
    clock = FakeClock(time.time())
    engine = Engine(clock=clock)
    for request in [*otlp_sink.trace_requests, *triton_traces.requests]:
        engine.ingest_traces(request)
    clock.tick(5.0)
    engine.advance()
    assert [s["service"] for s in engine.services()] == ["front"]
    doc = engine.breakdown("front")
    assert doc["requests"] == N and doc["model"] == "embedder"
    names = {s["stage"]: s for s in doc["stages"]}
    assert {"receive", "tokenize", "network", "serialize"} <= set(names)
    assert names["network"]["count"] == N
    # every network stage lies within its request: p50 of the stage <= p50 of end to end
    assert 0 < names["network"]["p50"] <= doc["latency"]["p50"]
