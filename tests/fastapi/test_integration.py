"""A real uvicorn server on 127.0.0.1 exporting to a real OTLP/gRPC receiver."""

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import inferprof
import inferprof.fastapi
from inferprof import semconv
from tests.otlp_sink import attributes

pytestmark = pytest.mark.integration


def _app():
    app = FastAPI()
    batcher = inferprof.DynamicBatcher(
        lambda xs: [x[::-1] for x in xs], max_batch_size=4, max_delay_ms=5, model_name="rev"
    )

    @app.post("/reverse")
    async def reverse(body: dict):
        with inferprof.stage("tokenize"):
            text = body["text"]
        return {"out": await batcher.submit(text, tokens=len(text))}

    @app.get("/events")
    async def events():
        async def gen():
            for i in range(3):
                await asyncio.sleep(0.01)
                yield f"data: {i}\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    inferprof.fastapi.instrument(app, model_name="rev")
    return app


@pytest.fixture
def server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(_app(), log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not srv.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.started
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        sock.close()


def test_uvicorn_service_exports_request_and_stage_spans(otlp_sink, server):
    inferprof.configure(
        service_name="rev-svc",
        endpoint=otlp_sink.endpoint,
        set_global=False,
        metric_readers=[InMemoryMetricReader()],
    )
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with httpx.Client(base_url=server, timeout=10) as c:
        for word in ("abc", "hello"):
            r = c.post(
                "/reverse",
                json={"text": word},
                headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
            )
            assert r.json() == {"out": word[::-1]}
        with c.stream("GET", "/events") as r:
            chunks = list(r.iter_text())
        assert "".join(chunks).count("data:") == 3
    inferprof.shutdown()
    assert otlp_sink.wait_for(lambda s: len(s.spans()) >= 14)
    spans = otlp_sink.spans()
    resource = spans[0][0]
    assert resource[semconv.RESOURCE_SERVICE_NAME] == "rev-svc"
    servers = [s for _, s in spans if s.kind == s.SPAN_KIND_SERVER]
    assert sorted(s.name for s in servers) == ["GET /events", "POST /reverse", "POST /reverse"]
    posts = [s for s in servers if s.name == "POST /reverse"]
    assert all(s.trace_id.hex() == trace_id for s in posts)
    for post in posts:
        kids = [s for _, s in spans if s.parent_span_id == post.span_id]
        stages = {attributes(k)[semconv.ATTR_STAGE] for k in kids}
        assert stages == {"receive", "tokenize", "queue", "batch_assembly", "serialize"}
    (serialize,) = [
        s
        for _, s in spans
        if attributes(s).get(semconv.ATTR_STAGE) == "serialize"
        and s.parent_span_id == [x for x in servers if x.name == "GET /events"][0].span_id
    ]
    assert serialize.end_time_unix_nano - serialize.start_time_unix_nano >= 20_000_000
