"""End to end: a FastAPI front end (uvicorn, inferprof's middleware) that tokenises and calls
a real Triton server through an instrumented client, exporting OTLP to a real receiver;
Triton exporting its own spans of the same traces; the collector's engine folding both: the
front end's breakdown, and the Triton service's, translated from Triton's span events."""

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
from inferprof.collector.sketch import exact_weighted_quantile
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


def _only_traces(request, traces: set):
    """A copy of OTLP export ``request`` holding only the spans of ``traces``."""
    out = type(request)()
    out.CopyFrom(request)
    for rs in out.resource_spans:
        for ss in rs.scope_spans:
            kept = [s for s in ss.spans if s.trace_id in traces]
            del ss.spans[:]
            ss.spans.extend(kept)
    return out


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


def test_front_end_and_triton_breakdowns_from_both_services_spans(
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
    # before, and Triton's own spans (scope ``triton-server``) into a breakdown of the
    # Triton service: queue/h2d/compute/d2h from the events of each request.
    # Triton's receiver is shared by the package's tests: only this test's traces.
    tritons_exports = [_only_traces(r, traces) for r in triton_traces.requests]

    def fold(**kw):
        clock = FakeClock(time.time())
        engine = Engine(clock=clock, **kw)
        for request in [*otlp_sink.trace_requests, *tritons_exports]:
            engine.ingest_traces(request)
        clock.tick(5.0)
        engine.advance()
        return engine

    engine = fold()
    without = fold(triton_spans=False)
    assert sorted(s["service"] for s in engine.services()) == ["front", "triton"]
    assert [s["service"] for s in without.services()] == ["front"]
    doc = engine.breakdown("front")
    assert doc == without.breakdown("front")  # the translation leaves the front end alone
    assert doc["requests"] == N and doc["model"] == "embedder"
    names = {s["stage"]: s for s in doc["stages"]}
    assert {"receive", "tokenize", "network", "serialize"} <= set(names)
    assert names["network"]["count"] == N
    # every network stage lies within its request: p50 of the stage <= p50 of end to end
    assert 0 < names["network"]["p50"] <= doc["latency"]["p50"]

    # Triton's side, from the spans exactly as Triton exported them.
    everything = triton_traces.spans("triton")
    expected: dict[str, list[float]] = {"queue": [], "h2d": [], "compute": [], "d2h": []}
    for req in served:
        (model,) = [
            s
            for s in everything
            if s.parent_span_id == req.span_id and "triton.model_name" in attributes(s)
        ]
        assert attributes(model)["triton.model_name"] == "double"
        (compute,) = [
            s for s in everything if s.parent_span_id == model.span_id and s.name == "compute"
        ]
        ev = {e.name: e.time_unix_nano for e in [*model.events, *compute.events]}
        times = [
            ev[k]
            for k in (
                "QUEUE_START",
                "COMPUTE_START",
                "COMPUTE_INPUT_END",
                "COMPUTE_OUTPUT_START",
                "COMPUTE_END",
            )
        ]
        # the events are in order and inside Triton's request span
        assert req.start_time_unix_nano <= times[0]
        assert times == sorted(times) and times[-1] <= req.end_time_unix_nano
        for stage, s, e in zip(expected, times, times[1:]):
            expected[stage].append((e - s) / 1e9)
    triton_doc = engine.breakdown("triton")
    assert triton_doc["requests"] == N and triton_doc["model"] == "double"
    stages = {s["stage"]: s for s in triton_doc["stages"]}
    assert set(stages) == {*expected, "unattributed"}
    e2e = [(s.end_time_unix_nano - s.start_time_unix_nano) / 1e9 for s in served]
    assert triton_doc["latency"]["p50"] == pytest.approx(
        exact_weighted_quantile(e2e, None, 0.5), rel=0.01
    )
    for stage, values in expected.items():
        assert stages[stage]["count"] == N
        assert stages[stage]["p50"] == pytest.approx(
            exact_weighted_quantile(values, None, 0.5), rel=0.01
        ), stage
        assert 0 <= stages[stage]["p99"] <= triton_doc["latency"]["p99"]
    assert engine.stats.triton_requests_partial == 0
    # Triton's time is inside the front end's network stage
    assert triton_doc["latency"]["p50"] <= names["network"]["p50"] * 1.01
