import asyncio
import time

import httpx
import pytest
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from opentelemetry import propagate
from opentelemetry.trace import SpanKind, StatusCode

import inferprof
import inferprof.fastapi
from inferprof import semconv
from tests.instrumentation.helpers import Captured, captured, children_of

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def make_app(**options):
    app = FastAPI()

    @app.post("/generate/{model}")
    async def generate(model: str, body: dict):
        with inferprof.stage("tokenize"):
            tokens = body["prompt"].split()
        headers = {}
        propagate.inject(headers)
        return {"model": model, "n": len(tokens), "traceparent": headers.get("traceparent")}

    @app.get("/stream")
    async def stream():
        async def events():
            for i in range(4):
                await asyncio.sleep(0.02)
                yield f"data: {i}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.get("/internal/debug")
    async def debug():
        return {"ok": True}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("handler failed")

    @app.get("/unavailable")
    async def unavailable():
        raise HTTPException(status_code=503, detail="overloaded")

    inferprof.fastapi.instrument(app, **options)
    return app


def client(app):
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://test"
    )


async def test_request_span_with_receive_and_serialize_stages(cap):
    app = make_app(model_name="llm")
    body = b'{"prompt": "a b c"}'
    async with client(app) as c:
        r = await c.post("/generate/m1", content=body, headers={"content-type": "application/json"})
    assert r.json()["n"] == 3
    (request,) = cap.requests()
    assert request.kind is SpanKind.SERVER
    assert request.name == "POST /generate/{model}"
    assert request.attributes["http.route"] == "/generate/{model}"
    assert request.attributes["http.request.method"] == "POST"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes[semconv.ATTR_MODEL_NAME] == "llm"
    assert semconv.ATTR_REQUEST not in request.attributes  # SERVER kind marks it
    kids = {k.attributes[semconv.ATTR_STAGE]: k for k in children_of(cap.spans(), request)}
    assert set(kids) == {"receive", "tokenize", "serialize"}
    assert kids["receive"].attributes[semconv.ATTR_BYTES] == len(body)
    assert kids["serialize"].attributes[semconv.ATTR_BYTES] == len(r.content)
    assert kids["receive"].end_time <= kids["tokenize"].start_time <= kids["serialize"].start_time
    assert request.start_time <= kids["receive"].start_time
    assert kids["serialize"].end_time <= request.end_time
    # no content recorded by default
    assert semconv.ATTR_REQUEST_BODY not in request.attributes
    assert not any("a b c" in str(v) for s in cap.spans() for v in s.attributes.values())


async def test_streaming_response_serialize_covers_the_stream(cap):
    app = make_app()
    async with client(app) as c:
        r = await c.get("/stream")  # (httpx's ASGI transport collects the body; see the raw test)
    assert r.text.count("data:") == 4
    (request,) = cap.requests()
    (serialize,) = cap.stages("serialize")
    assert serialize.end_time - serialize.start_time >= 60_000_000  # 4 chunks, 20 ms apart
    assert serialize.attributes[semconv.ATTR_BYTES] == len(r.content)
    assert cap.stages("receive") == []  # a GET has no body to time
    assert request.end_time >= serialize.end_time


async def test_sse_through_raw_asgi_passes_each_chunk_on(cap):
    app = make_app()
    sent = []

    async def receive():
        await asyncio.sleep(1)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append((time.perf_counter(), message))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/stream",
        "raw_path": b"/stream",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    bodies = [(t, m) for t, m in sent if m["type"] == "http.response.body" and m.get("body")]
    assert len(bodies) == 4  # not buffered: each chunk reaches the server as the app sends it
    assert bodies[-1][0] - bodies[0][0] > 0.04
    (serialize,) = cap.stages("serialize")
    assert serialize.attributes[semconv.ATTR_BYTES] == sum(len(m["body"]) for _, m in bodies)
    # the client disconnected after the whole stream: nothing was cut short
    (request,) = cap.requests()
    assert semconv.ATTR_CANCELLED not in request.attributes


async def test_sse_chunks_that_are_not_bytes_are_timed_as_bytes_are(cap):
    # ASGI says bytes; an app that sends a bytearray or a memoryview still gets its content
    # chunks timed (and not a comment's or [DONE]'s), and its response through unchanged.
    bodies = [bytearray(b"data: 0\n\n"), memoryview(b"data: 1\n\n"), b": keep-alive\n\n",
              memoryview(b"data: [DONE]\n\n")]

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for body in bodies:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    sent = []

    async def receive():
        await asyncio.sleep(1)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "GET", "scheme": "http", "path": "/events", "raw_path": b"/events",
             "query_string": b"", "headers": [], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    await inferprof.fastapi.InferprofMiddleware(app)(scope, receive, send)
    assert [m.get("body") for m in sent[1:-1]] == bodies
    (request,) = cap.requests()
    assert len(request.attributes[semconv.ATTR_GEN_EMIT_OFFSETS_S]) == 2


def _json_event(i):
    return b'data: {"i":%d}\n\n' % i


def _plain_event(i):
    return b"data: %d\n\n" % i


async def _stream_events(event, n, *, tokens=None, fail_at=None):
    """Stream ``n`` events made by ``event(i)`` through the middleware to a server whose
    send fails (OSError: the client went away) at body chunk ``fail_at``; ``tokens``:
    {chunk: its chunk_tokens()}. Returns the request span and the bytes the chunks hold."""
    chunks = [event(i) for i in range(n)]
    chunks[1] = b'data: {"text":"[DONE]"}\n\n'  # content that names [DONE]: a token
    chunks.append(b"data: [DONE]\n\n")

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i, body in enumerate(chunks):
            if tokens and i in tokens:
                inferprof.fastapi.chunk_tokens(tokens[i])
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    bodies = []

    async def send(message):
        if message["type"] == "http.response.body":
            if len(bodies) == fail_at:
                raise OSError("the client went away")
            bodies.append(message["body"])

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    with captured() as cap:
        try:
            await inferprof.fastapi.InferprofMiddleware(app)(_raw_scope("GET", "/s"), receive, send)
        except OSError:
            assert fail_at is not None
        (request,) = cap.requests()
        (serialize,) = cap.stages("serialize")
    sent = sum(map(len, chunks[:fail_at + 1] if fail_at is not None else chunks))
    assert serialize.attributes[semconv.ATTR_BYTES] == sent
    return request


@pytest.mark.parametrize("event", [_json_event, _plain_event])
async def test_event_chunks_of_either_shape_are_counted_alike(event):
    # A JSON data field takes send()'s short path, another one the general path: the
    # same emissions, merges, counts and cancellation either way.
    from inferprof.instrumentation.generation import COMPACT_AT

    attrs = (await _stream_events(event, 6)).attributes
    assert len(attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]) == 6  # not [DONE]
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 6
    assert semconv.ATTR_CANCELLED not in attrs

    attrs = (await _stream_events(event, 6, tokens={0: 0, 3: 3, 4: 1})).attributes
    assert list(attrs[semconv.ATTR_GEN_EMIT_TOKENS]) == [1, 1, 3, 1, 1]
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 7

    attrs = (await _stream_events(event, 6, fail_at=3)).attributes
    assert attrs[semconv.ATTR_CANCELLED] is True
    assert len(attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]) == 3  # not the chunk refused

    n = COMPACT_AT + 11
    attrs = (await _stream_events(event, n)).attributes
    assert len(attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]) <= semconv.GEN_MAX_EMIT_ENTRIES
    assert sum(attrs[semconv.ATTR_GEN_EMIT_TOKENS]) == n == attrs[semconv.ATTR_TOKENS_OUTPUT]
    assert attrs[semconv.ATTR_GEN_EMIT_MERGED] == n - len(attrs[semconv.ATTR_GEN_EMIT_TOKENS])


async def test_a_client_leaving_mid_stream_marks_the_request_cancelled(cap):
    app = make_app()

    async def receive():  # the client goes away after the first event or so
        await asyncio.sleep(0.03)
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    await app(_raw_scope("GET", "/stream"), receive, send)
    (request,) = cap.requests()
    assert request.attributes[semconv.ATTR_CANCELLED] is True
    assert request.status.status_code is not StatusCode.ERROR  # not a failure of the service
    (serialize,) = cap.stages("serialize")
    assert 0 < serialize.attributes[semconv.ATTR_BYTES] < 4 * len("data: 0\n\n")


async def test_traceparent_is_extracted_and_propagated(cap):
    app = make_app()
    async with client(app) as c:
        r = await c.post("/generate/m", json={"prompt": "x"}, headers={"traceparent": TRACEPARENT})
    (request,) = cap.requests()
    assert request.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert request.parent.span_id == 0xB7AD6B7169203331
    assert (
        r.json()["traceparent"]
        == f"00-{request.context.trace_id:032x}-{request.context.span_id:016x}-01"
    )


async def test_excluded_paths_are_not_traced(cap):
    app = make_app(excluded_paths=["/healthz", "/internal/*"])
    async with client(app) as c:
        assert (await c.get("/healthz")).status_code == 200
        assert (await c.get("/internal/debug")).status_code == 200
    assert cap.spans() == []


async def test_health_checks_and_fastapi_pages_are_untraced_by_default(cap):
    # FastAPI's /docs, /redoc and /openapi.json are not model requests: traced, they
    # would count as requests of the service's model in every figure.
    app = make_app()
    async with client(app) as c:
        for path in ("/healthz", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            assert (await c.get(path)).status_code == 200, path
        await c.post("/generate/m", json={"prompt": "x"})
    assert [s.name for s in cap.requests()] == ["POST /generate/{model}"]


async def test_default_excluded_paths_follow_configure(cap):
    inferprof.configure(tracer_provider=cap.provider, excluded_paths=["/generate/skip"])
    app = make_app()
    async with client(app) as c:
        await c.get("/healthz")
        await c.post("/generate/skip", json={"prompt": "x"})
    assert [s.name for s in cap.requests()] == ["GET /healthz"]


def test_excluded_paths_without_a_leading_slash_are_refused_or_ignored(monkeypatch, caplog):
    # Request paths start with "/": "healthz" would never match, silently.
    with pytest.raises(ValueError, match="must start with '/'"):
        inferprof.configure(mode="off", excluded_paths=["/ok", "healthz"])
    with pytest.raises(ValueError, match="must start with '/'"):
        inferprof.fastapi.InferprofMiddleware(FastAPI(), excluded_paths=["metrics"])
    # instrument() checks at once: Starlette would build the middleware on the first request
    with pytest.raises(ValueError, match="must start with '/'"):
        inferprof.fastapi.instrument(FastAPI(), excluded_paths=["/ok", "metrics"])
    # "*" (every path) still is a valid entry
    inferprof.fastapi.InferprofMiddleware(FastAPI(), excluded_paths=["*"])
    monkeypatch.setenv("INFERPROF_EXCLUDED_PATHS", "/healthz, metrics ,/internal/*, *")
    from inferprof._config import excluded_paths_setting

    with caplog.at_level("WARNING", logger="inferprof._config"):
        assert excluded_paths_setting(None) == ("/healthz", "/internal/*", "*")
    assert "INFERPROF_EXCLUDED_PATHS" in caplog.text and "metrics" in caplog.text


async def test_handler_exception_marks_the_request_failed(cap):
    app = make_app()
    async with client(app) as c:
        r = await c.get("/boom")
    assert r.status_code == 500
    (request,) = cap.requests()
    assert request.status.status_code is StatusCode.ERROR
    assert request.events[0].attributes["exception.type"] == "RuntimeError"
    # what the client got: the 500 answered outside the app for the exception
    assert request.attributes["http.response.status_code"] == 500


async def test_5xx_response_marks_the_request_failed(cap):
    app = make_app()
    async with client(app) as c:
        r = await c.get("/unavailable")
    assert r.status_code == 503
    (request,) = cap.requests()
    assert request.status.status_code is StatusCode.ERROR
    assert request.attributes["http.response.status_code"] == 503


async def test_record_content_is_opt_in():
    with captured() as cap:
        app = make_app(record_content=True, content_max_bytes=8)
        async with client(app) as c:
            await c.post(
                "/generate/m",
                content=b'{"prompt": "secret words"}',
                headers={"content-type": "application/json"},
            )
        (request,) = cap.requests()
        assert request.attributes[semconv.ATTR_REQUEST_BODY] == '{"prompt'
        assert len(request.attributes[semconv.ATTR_RESPONSE_BODY]) == 8


async def test_record_content_reaches_opentelemetry_instrumentation_fastapis_span():
    # Its span ends when the last body chunk passes it, before inferprof's request ends:
    # the HTTP attributes and the opted-in bodies must be on it by then.
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    with captured() as cap:
        app = make_app(record_content=True, content_max_bytes=8)
        FastAPIInstrumentor.instrument_app(app, tracer_provider=cap.provider)
        try:
            async with client(app) as c:
                await c.post("/generate/m", json={"prompt": "secret words"})
        finally:
            FastAPIInstrumentor.uninstrument_app(app)
        (server,) = [s for s in cap.spans() if s.kind is SpanKind.SERVER]
    assert server.instrumentation_scope.name != semconv.INSTRUMENTATION_SCOPE
    assert server.attributes[semconv.ATTR_REQUEST_BODY] == '{"prompt'
    assert len(server.attributes[semconv.ATTR_RESPONSE_BODY]) == 8
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["http.route"] == "/generate/{model}"


async def test_route_templates_of_mounted_apps_docs_and_static_files(cap, tmp_path):
    from fastapi.staticfiles import StaticFiles
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def hello(request):
        return PlainTextResponse("hi")

    sub = FastAPI()

    @sub.post("/generate/{m}")
    async def generate(m: str):
        return {"m": m}

    (tmp_path / "a.txt").write_text("a")
    app = FastAPI()
    app.mount("/v1", sub)
    app.mount("/sub", Starlette(routes=[Route("/x/{y}", hello)]))
    app.mount("/static", StaticFiles(directory=tmp_path))
    inferprof.fastapi.instrument(app, excluded_paths=["/healthz"])  # /docs traced here
    async with client(app) as c:
        for method, path in [("POST", "/v1/generate/llama"), ("GET", "/sub/x/7"),
                             ("GET", "/static/a.txt"), ("GET", "/docs"), ("GET", "/nope")]:
            await c.request(method, path)
    got = {(s.attributes["url.path"], s.name, s.attributes.get("http.route"))
           for s in cap.requests()}
    assert got == {
        ("/v1/generate/llama", "POST /v1/generate/{m}", "/v1/generate/{m}"),
        ("/sub/x/7", "GET /sub/x/{y}", "/sub/x/{y}"),
        ("/static/a.txt", "GET /static", "/static"),
        ("/docs", "GET /docs", "/docs"),
        ("/nope", "GET", None),  # no route matched: the method alone
    }


async def test_coexists_with_opentelemetry_instrumentation_fastapi(cap):
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    app = make_app(model_name="llm")
    FastAPIInstrumentor.instrument_app(app, tracer_provider=cap.provider)
    try:
        async with client(app) as c:
            await c.post(
                "/generate/m", json={"prompt": "a b"}, headers={"traceparent": TRACEPARENT}
            )
    finally:
        FastAPIInstrumentor.uninstrument_app(app)
    servers = [s for s in cap.spans() if s.kind is SpanKind.SERVER]
    assert len(servers) == 1  # exactly one request span: theirs, enriched
    (server,) = servers
    assert server.instrumentation_scope.name != semconv.INSTRUMENTATION_SCOPE
    assert server.attributes[semconv.ATTR_MODEL_NAME] == "llm"
    assert server.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    stages = cap.stages()
    assert {s.attributes[semconv.ATTR_STAGE] for s in stages} == {
        "receive",
        "tokenize",
        "serialize",
    }
    assert all(s.parent.span_id == server.context.span_id for s in stages)
    assert not [
        s
        for s in cap.spans()
        if s.name.startswith("POST") and s.instrumentation_scope.name == "inferprof"
    ]


async def test_non_http_scopes_pass_through(cap):
    seen = []

    async def inner(scope, receive, send):
        seen.append(scope["type"])

    mw = inferprof.fastapi.InferprofMiddleware(inner)
    await mw({"type": "lifespan"}, None, None)
    await mw({"type": "websocket", "path": "/ws", "headers": []}, None, None)
    assert seen == ["lifespan", "websocket"]
    assert cap.spans() == []


async def test_unconfigured_middleware_is_a_pass_through():
    inferprof.shutdown()
    app = make_app()
    async with client(app) as c:
        r = await c.post("/generate/m", json={"prompt": "a b"})
    assert r.json()["n"] == 2


async def test_explicit_tracer_provider_option():
    inferprof.shutdown()
    cap = Captured()
    app = make_app(tracer_provider=cap.provider)
    async with client(app) as c:
        await c.post("/generate/m", json={"prompt": "a"})
    assert len(cap.requests()) == 1
    assert len(cap.stages("tokenize")) == 1


def test_bad_middleware_options():
    with pytest.raises(ValueError):
        inferprof.fastapi.InferprofMiddleware(None, excluded_paths="/healthz")
    with pytest.raises(ValueError):
        inferprof.fastapi.InferprofMiddleware(None, model_name=3)
    with pytest.raises(ValueError):
        inferprof.fastapi.instrument(object())


async def test_batched_service_end_to_end(cap):
    app = FastAPI()

    def fn(xs):
        with inferprof.stage("compute"):
            return [x.upper() for x in xs]

    batcher = inferprof.DynamicBatcher(fn, max_batch_size=4, max_delay_ms=20, model_name="up")

    @app.post("/up")
    async def up(body: dict):
        return {"out": await batcher.submit(body["text"])}

    inferprof.fastapi.instrument(app)
    async with client(app) as c:
        outs = await asyncio.gather(*(c.post("/up", json={"text": t}) for t in "abcd"))
    await batcher.stop()
    assert sorted(o.json()["out"] for o in outs) == list("ABCD")
    spans = cap.spans()
    assert len(cap.requests()) == 4
    for r in cap.requests():
        kids = {k.attributes[semconv.ATTR_STAGE] for k in children_of(spans, r)}
        assert kids == {"receive", "queue", "batch_assembly", "compute", "serialize"}


async def test_production_mode_builds_http_stages_and_attributes_only_for_kept_requests():
    """In production mode the middleware keeps `receive`/`serialize` and the HTTP
    attributes as plain values and makes them only for a kept trace: a kept (slow) request
    still carries all of them, a 5xx its error status; a request not kept emits nothing."""
    app = FastAPI()
    delay = {"s": 0.0}

    @app.post("/v1/run/{model}")
    async def run(model: str, body: dict):
        await asyncio.sleep(delay["s"])
        with inferprof.stage("tokenize"):
            n = len(body["prompt"].split())
        if body.get("fail"):
            raise HTTPException(status_code=503, detail="overloaded")
        return {"n": n}

    inferprof.fastapi.instrument(app, model_name="llm")
    with captured(mode="production", sample_rate=0.001, tail_quantile=0.9, max_timed_rate=0) as cap:
        rt = inferprof._config.active_runtime()
        async with client(app) as c:
            # past the tail sampler's warm-up (which keeps every trace); one in five
            # warm-up requests 20 ms slower puts its running p90 at ~20 ms, far above a
            # fast request's latency even on a loaded machine
            for i in range(rt.tail_sampler._warmup):
                delay["s"] = 0.02 if i % 5 == 0 else 0.0
                await c.post("/v1/run/m", json={"prompt": "a"})
            delay["s"] = 0.0
            cap.clear()
            kept_before, discarded_before = rt.stats.kept, rt.stats.discarded
            for _ in range(20):
                await c.post("/v1/run/m", json={"prompt": "a"})
            fast = cap.requests()
            fast_kept = rt.stats.kept - kept_before
            fast_discarded = rt.stats.discarded - discarded_before
            kept_before = rt.stats.kept
            delay["s"] = 0.05  # far above the running p90: kept
            body = b'{"prompt": "a b c", "fail": true}'
            r = await c.post("/v1/run/m", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 503
    # the fast requests not kept (all but those at the running p90) left no span at all
    assert fast_discarded >= 10 and fast_kept + fast_discarded == 20
    assert len(fast) == fast_kept and len(cap.stages("receive")) == fast_kept + 1
    assert rt.stats.kept == kept_before + 1
    slow = [s for s in cap.requests() if s.end_time - s.start_time >= 50_000_000]
    assert len(slow) == 1
    (request,) = slow
    assert request.name == "POST /v1/run/{model}"
    assert request.attributes["http.route"] == "/v1/run/{model}"
    assert request.attributes["http.response.status_code"] == 503
    assert request.attributes[semconv.ATTR_MODEL_NAME] == "llm"
    assert request.status.status_code is StatusCode.ERROR
    assert semconv.ATTR_SAMPLE_WEIGHT not in request.attributes  # tail-kept: weight 1
    kids = {k.attributes[semconv.ATTR_STAGE]: k for k in children_of(cap.spans(), request)}
    assert set(kids) == {"receive", "tokenize", "serialize"}
    assert kids["receive"].attributes[semconv.ATTR_BYTES] == len(body)
    assert kids["serialize"].attributes[semconv.ATTR_BYTES] == len(r.content)
    assert request.start_time <= kids["receive"].start_time <= kids["receive"].end_time
    assert kids["receive"].end_time <= kids["tokenize"].start_time
    assert kids["tokenize"].end_time <= kids["serialize"].start_time
    assert kids["serialize"].end_time <= request.end_time


def _raw_scope(method, path):
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }


async def test_a_chunked_body_is_one_receive_stage_from_first_read_to_last_chunk(cap):
    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body[:3]})

    chunks = [b"abcd", b"efgh", b"ij"]

    async def receive():
        await asyncio.sleep(0.02)  # the client sends the body in three pieces
        body = chunks.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(chunks)}

    async def send(message):
        pass

    await inferprof.fastapi.InferprofMiddleware(app)(_raw_scope("POST", "/up"), receive, send)
    (receive_stage,) = cap.stages("receive")
    assert receive_stage.attributes[semconv.ATTR_BYTES] == 10
    assert receive_stage.end_time - receive_stage.start_time >= 40_000_000  # 3 reads, 20 ms
    (serialize,) = cap.stages("serialize")
    assert serialize.attributes[semconv.ATTR_BYTES] == 3
    assert receive_stage.end_time <= serialize.start_time


async def test_a_body_cut_short_and_a_response_failing_midway_still_end_their_stages(cap):
    async def app(scope, receive, send):
        await receive()  # the first chunk; the client then goes away
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise RuntimeError("stream broke")

    async def receive():
        return {"type": "http.request", "body": b"12345", "more_body": True}

    async def send(message):
        pass

    with pytest.raises(RuntimeError):
        await inferprof.fastapi.InferprofMiddleware(app)(_raw_scope("POST", "/up"), receive, send)
    (request,) = cap.requests()
    (receive_stage,) = cap.stages("receive")
    (serialize,) = cap.stages("serialize")
    assert receive_stage.attributes[semconv.ATTR_BYTES] == 5
    assert serialize.attributes[semconv.ATTR_BYTES] == 4
    assert receive_stage.end_time <= request.end_time and serialize.end_time <= request.end_time
    assert receive_stage.end_time >= receive_stage.start_time > 0
    assert serialize.end_time >= serialize.start_time > 0
    assert request.status.status_code is StatusCode.ERROR


def _app_with_fastapi_tracing(provider, **instrument_options):
    """An app whose FastAPI traces requests itself (FastAPI >= 0.16x): given a tracer
    provider, as it would find the global one configure() installs."""
    app = FastAPI(telemetry={"tracer_provider": provider, "metrics": False, "logs": False})

    @app.post("/v1/run")
    async def run(body: dict):
        with inferprof.stage("tokenize"):
            return {"n": len(body["prompt"].split())}

    inferprof.fastapi.instrument(app, model_name="llm", **instrument_options)
    return app


async def test_instrument_turns_fastapis_own_request_tracing_off_so_production_mode_samples(
        caplog):
    import logging

    with captured(mode="production", sample_rate=0.001, tail_quantile=0.9, max_timed_rate=0) as cap:
        app = _app_with_fastapi_tracing(cap.provider)
        assert app._telemetry["tracing"] is False
        rt = inferprof._config.active_runtime()
        with caplog.at_level(logging.WARNING, logger="inferprof"):
            async with client(app) as c:
                for _ in range(rt.tail_sampler._warmup + 40):
                    assert (await c.post("/v1/run", json={"prompt": "a b"})).status_code == 200
        spans = cap.spans()
    assert not [s for s in spans if s.instrumentation_scope.name == "fastapi"]
    requests = [s for s in spans if s.kind is SpanKind.SERVER]
    assert all(s.instrumentation_scope.name == semconv.INSTRUMENTATION_SCOPE for s in requests)
    # the warm-up keeps everything; after it, inferprof's tail sampler drops most fast ones
    assert rt.tail_sampler._warmup <= len(requests) < rt.tail_sampler._warmup + 40
    assert "another instrumentation" not in caplog.text


async def test_fastapi_tracing_kept_on_request_is_enriched_and_production_mode_warns_once(
        caplog):
    import logging

    with captured(mode="production", sample_rate=0.001, tail_quantile=0.9, max_timed_rate=0) as cap:
        app = _app_with_fastapi_tracing(cap.provider, fastapi_tracing=True)
        with caplog.at_level(logging.WARNING, logger="inferprof"):
            async with client(app) as c:
                for _ in range(100):
                    await c.post("/v1/run", json={"prompt": "a b"})
        servers = [s for s in cap.spans() if s.kind is SpanKind.SERVER]
    # FastAPI's span is the request span, enriched; its sampler (always on) keeps every one
    assert len(servers) == 100
    assert {s.instrumentation_scope.name for s in servers} == {"fastapi"}
    assert all(s.attributes[semconv.ATTR_MODEL_NAME] == "llm" for s in servers)
    warnings = [r for r in caplog.records if "another instrumentation" in r.getMessage()]
    # ... without telling the user to undo what they chose
    assert len(warnings) == 1 and "FastAPI(telemetry=" not in warnings[0].getMessage()


async def test_add_middleware_under_fastapi_tracing_warns_with_the_way_to_turn_it_off(caplog):
    import logging

    with captured(mode="production", sample_rate=0.001, tail_quantile=0.9, max_timed_rate=0) as cap:
        app = FastAPI(telemetry={"tracer_provider": cap.provider, "metrics": False,
                                 "logs": False})

        @app.get("/v1/ping")
        async def ping():
            return {}

        app.add_middleware(inferprof.fastapi.InferprofMiddleware)
        with caplog.at_level(logging.WARNING, logger="inferprof"):
            async with client(app) as c:
                for _ in range(3):
                    await c.get("/v1/ping")
    warnings = [r for r in caplog.records if "another instrumentation" in r.getMessage()]
    assert len(warnings) == 1 and "FastAPI(telemetry=" in warnings[0].getMessage()


def test_instrument_rejects_a_non_bool_fastapi_tracing():
    with pytest.raises(ValueError, match="fastapi_tracing"):
        inferprof.fastapi.instrument(FastAPI(), fastapi_tracing="yes")


async def test_failed_requests_reach_the_collector_as_errors(cap):
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from inferprof.collector.engine import Engine
    from tests.collector.synth import FakeClock

    app = make_app(model_name="llm")
    body = b'{"prompt": "a b c"}'
    async with client(app) as c:
        for _ in range(6):
            await c.post("/generate/m1", content=body,
                         headers={"content-type": "application/json"})
        for path in ("/unavailable", "/unavailable", "/boom"):
            await c.get(path)
    clock = FakeClock()
    engine = Engine(clock=clock)
    engine.ingest_traces(encode_spans(cap.spans()))
    clock.tick(5)
    doc = engine.breakdown(cap.requests()[0].resource.attributes["service.name"], "llm")
    # the 503s and the 500 failed; every request is in the figures
    assert doc["requests"] == 9 and doc["errors"] == 3


async def test_stream_offsets_under_another_instrumentations_span_count_from_its_start(cap):
    # emit_offsets_s are seconds since the start of the request span (§14); when that span
    # is another instrumentation's, opened before this middleware ran, the offsets count
    # from its start, not from the middleware's.
    app = make_app()
    tracer = cap.provider.get_tracer("outer")

    async def outer(scope, receive, send):
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        with tracer.start_as_current_span("GET /stream", kind=SpanKind.SERVER):
            await asyncio.sleep(0.1)  # other middleware before inferprof's
            await app(scope, receive, send)

    transport = httpx.ASGITransport(app=outer)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        await c.get("/stream")
    (server,) = [s for s in cap.spans() if s.kind is SpanKind.SERVER]
    offsets = server.attributes[semconv.ATTR_GEN_EMIT_OFFSETS_S]
    assert len(offsets) == 4
    assert offsets[0] >= 0.1 + 0.02
    assert server.start_time + round(offsets[-1] * 1e9) <= server.end_time
