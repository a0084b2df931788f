"""Contract §15's untimed counting under what ASGI servers do that httpx's transport does
not: a client that leaves mid-answer, seen as ``http.disconnect`` (ASGI 2.3, uvicorn) or
as ``send`` raising ``OSError`` (ASGI 2.4, which Starlette's streaming responses turn into
``ClientDisconnect``). A real FastAPI app in production mode is driven by a small server
of the test's own that follows the spec, and the collector's engine folds what it
exported: a cancellation is no error whether the request was timed or not."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

import inferprof
import inferprof.fastapi
from inferprof import semconv
from inferprof.instrumentation import stage as stage_module
from tests.fastapi.budget_helpers import budgeted_capture
from tests.instrumentation.test_summaries import MemoryExporter


async def serve(app: Any, path: str, query: bytes = b"", *, spec: str = "2.3",
                leave_after: int | None = None) -> tuple[int | None, BaseException | None]:
    """One GET through ``app`` as an ASGI ``spec`` server would serve it; ``leave_after``:
    the client goes away once that many body chunks reached it. Then ``receive`` answers
    ``http.disconnect``, and ``send`` drops what comes (2.3) or raises ``OSError`` (2.4).
    Returns the status sent (None: none) and the exception the app raised, if any."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec},
             "http_version": "1.1", "method": "GET", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(b"host", b"t")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    gone = asyncio.Event()
    state: dict[str, Any] = {"status": None, "chunks": 0, "read": False}

    async def receive() -> dict:
        if not state["read"]:
            state["read"] = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if gone.is_set():
            if spec >= "2.4":
                raise OSError("the client went away")
            return
        if message["type"] == "http.response.start":
            state["status"] = message["status"]
        elif message.get("body"):
            state["chunks"] += 1
            if leave_after is not None and state["chunks"] >= leave_after:
                gone.set()
        await asyncio.sleep(0)  # a server's write: the app's other tasks run

    try:
        await app(scope, receive, send)
    except Exception as exc:
        return state["status"], exc
    finally:
        gone.set()
    return state["status"], None


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_client_leaving_a_stream_is_no_error_timed_or_untimed(monkeypatch, spec):
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from inferprof.collector.engine import Engine

    app = FastAPI()

    @app.get("/chat")
    async def chat(i: int):
        with inferprof.stage("compute"):
            await asyncio.sleep(0)
        if i % 7 == 0:
            return JSONResponse({}, status_code=503)

        async def tokens():
            for _ in range(4):
                await asyncio.sleep(0)
                yield b'data: {"token": "x"}\n\n'

        return StreamingResponse(tokens(), media_type="text/event-stream")

    inferprof.fastapi.instrument(app, model_name="m")
    rng = random.Random(5)
    monkeypatch.setattr(stage_module, "_random", random.Random(3).random)
    exporter = MemoryExporter()
    with budgeted_capture(exporter, sample_rate=1.0) as (cap, rt, budget_clock):

        async def run() -> list:
            out = [await serve(app, "/chat", b"i=1", spec=spec)]  # timed: the route learnt
            for _ in range(300):  # 300 a second: a share of 1/4
                rt.timing_budget.share("/chat")
            budget_clock.now += 1.0
            for i in range(1, 1200):
                leave = 1 if rng.random() < 0.3 else None
                out.append(await serve(app, "/chat", f"i={i}".encode(), spec=spec,
                                       leave_after=leave))
            return out

        results = asyncio.run(run())
        inferprof.shutdown()
        spans = cap.spans()
        service = cap.provider.resource.attributes[semconv.RESOURCE_SERVICE_NAME]
        snap = inferprof.instrumentation.stats()
    left = [exc for _, exc in results if exc is not None]
    if spec == "2.4":  # Starlette raises it into the middleware, timed or not
        assert len(left) > 200 and {type(e).__name__ for e in left} == {"ClientDisconnect"}
    else:
        assert not left
    cancelled = [s for s in spans if (s.attributes or {}).get(semconv.ATTR_CANCELLED)]
    assert cancelled  # timed ones left too: each kind of request met a client leaving
    assert snap.requests_untimed_counted > len(results) // 2
    answered_503 = sum(1 for status, _ in results if status == 503)
    engine = Engine(settle_s=0.0)
    for data in exporter.exports:
        assert engine.ingest_metrics(encode_metrics(data)).rejected_spans == 0
    assert engine.ingest_traces(encode_spans(spans)).rejected_spans == 0
    engine.flush()
    doc = engine.breakdown(service, model="m", window_s=None)
    # every request counted once; its errors the 503s alone (a client leaving is none:
    # 2.4 counted the untimed ones' ClientDisconnect as errors: 414 for 171)
    assert (doc["requests"], doc["errors"]) == (len(results), answered_503)


def test_a_worker_forked_after_configure_counts_its_own_requests_once(monkeypatch):
    # A pre-forking server (gunicorn --preload): configure() and the app in the parent,
    # which served requests of its own whose untimed counts wait to be folded; the worker
    # forked then counts its requests, exactly, and none of its parent's.
    import os

    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from inferprof.collector.engine import Engine

    app = FastAPI()

    @app.get("/a")
    async def a(i: int):
        with inferprof.stage("compute"):
            await asyncio.sleep(0)
        return JSONResponse({}, status_code=503 if i % 5 == 0 else 200)

    inferprof.fastapi.instrument(app, model_name="m")
    monkeypatch.setattr(stage_module, "_random", random.Random(3).random)
    exporter = MemoryExporter()
    with budgeted_capture(exporter, sample_rate=1.0) as (cap, rt, budget_clock):

        def run(first: int, n: int) -> list[int]:
            async def go() -> list[int]:
                return [(await serve(app, "/a", f"i={i}".encode()))[0]
                        for i in range(first, first + n)]
            return asyncio.run(go())

        statuses = run(0, 1)  # timed: the route learnt
        for _ in range(300):  # 300 a second: a share of 1/4
            rt.timing_budget.share("/a")
        budget_clock.now += 1.0
        statuses += run(1, 200)
        # counted, not exported yet: what the worker must not send
        assert inferprof.instrumentation.stats().requests_untimed_counted > 100
        assert not exporter.exports
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: its exports and spans, encoded, down the pipe
            code = 1
            try:
                worker = run(1000, 400)
                inferprof.shutdown()
                blobs = [encode_metrics(d).SerializeToString() for d in exporter.exports]
                blobs.append(encode_spans(cap.spans()).SerializeToString())
                blobs.append(str(worker.count(503)).encode())
                with os.fdopen(write, "wb") as out:
                    for blob in blobs:
                        out.write(len(blob).to_bytes(8, "big") + blob)
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        inferprof.shutdown()
        spans = cap.spans()
        service = cap.provider.resource.attributes[semconv.RESOURCE_SERVICE_NAME]
    blobs = []
    while data:
        n = int.from_bytes(data[:8], "big")
        blobs.append(data[8:8 + n])
        data = data[8 + n:]
    *worker_metrics, worker_spans, worker_503 = blobs
    assert worker_metrics  # the worker exported (its summaries' thread ran)

    def breakdown(metrics: list[bytes], traces: bytes) -> tuple[int, int]:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
        )
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        engine = Engine(settle_s=0.0)
        for blob in metrics:
            request = ExportMetricsServiceRequest.FromString(blob)
            assert engine.ingest_metrics(request).rejected_spans == 0
        assert engine.ingest_traces(ExportTraceServiceRequest.FromString(traces)
                                    ).rejected_spans == 0
        engine.flush()
        doc = engine.breakdown(service, model="m", window_s=None)
        return doc["requests"], doc["errors"]

    assert breakdown(worker_metrics, worker_spans) == (400, int(worker_503))
    parent = [encode_metrics(d).SerializeToString() for d in exporter.exports]
    assert breakdown(parent, encode_spans(spans).SerializeToString()) == (
        len(statuses), statuses.count(503))
