"""Streamed responses through the middleware under a real uvicorn server, read by a real
streaming client (httpx): each chunk's time feeds ``inferprof.gen.emit_offsets_s``, a client
that goes away marks the request cancelled, and the step API's emissions give way to the
chunks' times."""

import asyncio
import contextvars
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

import inferprof
import inferprof.fastapi
from inferprof import semconv
from tests.instrumentation.helpers import captured, children_of

pytestmark = pytest.mark.integration

GAP_S = 0.02


class TinyEngine:
    """A continuous-batching loop over fake tokens: admits waiting requests with a prefill
    step, then decodes every running request one token per step."""

    def __init__(self) -> None:
        self.recorder = inferprof.Engine("t0")
        self.waiting: list[dict] = []
        self.running: list[dict] = []
        self.task = None

    def submit(self, prompt_tokens: int, max_tokens: int) -> dict:
        req = {
            "gen": self.recorder.request(prompt_tokens=prompt_tokens),
            "prompt": prompt_tokens, "left": max_tokens, "out": asyncio.Queue(),
        }
        self.waiting.append(req)
        if self.task is None or self.task.done():
            # in a fresh context: the loop must not inherit this request's scope
            self.task = contextvars.Context().run(asyncio.get_running_loop().create_task,
                                                  self._loop())
        return req

    def cancel(self, req: dict) -> None:
        if req in self.running:
            self.running.remove(req)
            req["gen"].cancel()

    async def _loop(self) -> None:
        while self.waiting or self.running:
            admitted, self.waiting = self.waiting, []
            with self.recorder.step() as step:
                for req in admitted:
                    step.prefill(req["gen"], req["prompt"])
                for req in self.running:
                    step.decode(req["gen"])
                with inferprof.stage("compute"):
                    await asyncio.sleep(GAP_S)
            self.running.extend(admitted)
            for req in list(self.running):
                req["left"] -= 1
                req["out"].put_nowait(f"t{req['left']}")
                if req["left"] == 0:
                    self.running.remove(req)
                    req["gen"].finish()
                    req["out"].put_nowait(None)


def _app():
    app = FastAPI()
    engine = TinyEngine()

    @app.get("/sse")
    async def sse(n: int = 5):
        async def events():
            yield ": keep-alive\n\n"  # a comment: no content
            for i in range(n):
                await asyncio.sleep(GAP_S)
                yield f"data: {i}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/chat")
    async def chat():
        async def events():
            inferprof.fastapi.chunk_tokens(0)  # the role: no generated content yet
            yield 'data: {"delta": {"role": "assistant"}}\n\n'
            for i in range(2):
                await asyncio.sleep(GAP_S)
                inferprof.fastapi.chunk_tokens(3)
                yield f'data: {{"delta": {{"content": "{i}"}}}}\n\n'

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/chunked")
    async def chunked():
        async def parts():
            for i in range(3):
                await asyncio.sleep(GAP_S)
                yield f"part {i}\n"

        return StreamingResponse(parts(), media_type="text/plain")

    @app.get("/generate")
    async def generate(max_tokens: int = 6, per_chunk: int = 2):
        req = engine.submit(prompt_tokens=4, max_tokens=max_tokens)

        async def events():
            held = []
            try:
                while True:
                    token = await req["out"].get()
                    if token is not None:
                        held.append(token)
                    if held and (len(held) == per_chunk or token is None):
                        inferprof.fastapi.chunk_tokens(len(held))
                        yield f"data: {' '.join(held)}\n\n"
                        held = []
                    if token is None:
                        break
            finally:
                engine.cancel(req)  # a client gone: the engine drops the request

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/complete")
    async def complete(max_tokens: int = 3):
        req = engine.submit(prompt_tokens=4, max_tokens=max_tokens)
        tokens = []
        while (token := await req["out"].get()) is not None:
            tokens.append(token)
        return {"text": " ".join(tokens)}

    async def one_message(scope, receive, send):
        # no content-length, but the whole body in one message: not a stream
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"all at once"})

    app.mount("/raw", one_message)
    inferprof.fastapi.instrument(app)
    return app


@pytest.fixture
def server():
    with captured() as cap:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        srv = uvicorn.Server(uvicorn.Config(_app(), log_level="warning", lifespan="off"))
        thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while not srv.started and time.monotonic() < deadline:
                time.sleep(0.02)
            assert srv.started
            yield f"http://127.0.0.1:{port}", cap
        finally:
            srv.should_exit = True
            thread.join(timeout=10)
            sock.close()


def _wait_requests(cap, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        requests = cap.requests()
        if len(requests) >= n:
            return requests
        time.sleep(0.02)
    raise AssertionError(f"{len(cap.requests())} request spans, expected {n}")


def _read_events(response):
    """(arrival time, event payload) of each ``data:`` event, as the client saw them."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            out.append((time.time_ns(), line[5:].strip()))
    return out


def test_sse_chunk_times_are_the_emissions_and_match_the_client(server):
    url, cap = server
    with httpx.Client(base_url=url, timeout=10) as client:
        sent = time.time_ns()
        with client.stream("GET", "/sse", params={"n": 5}) as response:
            events = _read_events(response)
    assert [payload for _, payload in events] == ["0", "1", "2", "3", "4", "[DONE]"]
    (request,) = _wait_requests(cap, 1)
    attrs = request.attributes
    offsets = attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]
    assert len(offsets) == 5  # not the comment, not [DONE]
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 5
    assert semconv.ATTR_GEN_EMIT_TOKENS not in attrs
    assert semconv.ATTR_ENGINE_ID not in attrs  # no engine: the middleware alone
    assert offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert min(gaps) >= GAP_S * 0.9
    # as the client measured, up to loopback and the client's own reading
    client_ttft = (events[0][0] - sent) / 1e9
    assert offsets[0] <= client_ttft + 0.001
    assert client_ttft - offsets[0] < 0.05
    client_gaps = [(b[0] - a[0]) / 1e9 for a, b in zip(events, events[1:5])]
    assert gaps == pytest.approx(client_gaps, abs=0.015)
    assert request.end_time >= request.start_time + round(offsets[-1] * 1e9)


def test_a_chunk_of_no_tokens_is_no_emission(server):
    url, cap = server
    with httpx.Client(base_url=url, timeout=10) as client:
        sent = time.time_ns()
        with client.stream("GET", "/chat") as response:
            events = _read_events(response)
    assert len(events) == 3
    (request,) = _wait_requests(cap, 1)
    attrs = request.attributes
    offsets = attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]
    assert len(offsets) == 2 and offsets[0] >= GAP_S * 0.9  # ttft: the first content
    assert list(attrs[semconv.ATTR_GEN_EMIT_TOKENS]) == [3, 3]
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 6
    assert (events[1][0] - sent) / 1e9 >= offsets[0]


def test_chunked_responses_count_each_chunk(server):
    url, cap = server
    with httpx.Client(base_url=url, timeout=10) as client:
        with client.stream("GET", "/chunked") as response:
            body = b"".join(response.iter_bytes())
    assert body.count(b"part") == 3
    (request,) = _wait_requests(cap, 1)
    assert len(request.attributes[semconv.ATTR_GEN_EMIT_OFFSETS_S]) == 3
    assert request.attributes[semconv.ATTR_TOKENS_OUTPUT] == 3


def test_a_body_in_one_message_is_not_a_stream(server):
    url, cap = server
    with httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/raw/").content == b"all at once"
    (request,) = _wait_requests(cap, 1)
    assert semconv.ATTR_GEN_EMIT_OFFSETS_S not in request.attributes
    assert semconv.ATTR_TOKENS_OUTPUT not in request.attributes


def test_with_the_step_api_the_chunk_times_win_and_the_engine_counts(server):
    url, cap = server
    with httpx.Client(base_url=url, timeout=10) as client:
        with client.stream("GET", "/generate", params={"max_tokens": 5, "per_chunk": 2}) as r:
            events = _read_events(r)
    assert len(events) == 3  # tokens 2 + 2 + 1
    (request,) = _wait_requests(cap, 1)
    attrs = request.attributes
    assert attrs[semconv.ATTR_ENGINE_ID] == "t0"
    assert attrs[semconv.ATTR_TOKENS_PROMPT] == 4
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 5
    assert attrs[semconv.ATTR_GEN_EMIT_TOKENS] == [2, 2, 1]
    offsets = attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]
    assert len(offsets) == 3  # one per chunk, not one per engine token
    stages = {s.attributes[semconv.ATTR_STAGE]: s for s in children_of(cap.spans(), request)}
    assert {"queue", "prefill", "decode", "serialize"} <= set(stages)
    # a chunk leaves after the step that made its last token
    assert request.start_time + offsets[0] * 1e9 >= stages["decode"].start_time
    assert request.start_time + offsets[-1] * 1e9 >= stages["decode"].end_time - 1000
    # serialize is what follows the last token: the engine's stages cover the stream
    assert stages["serialize"].start_time == pytest.approx(
        request.start_time + offsets[-1] * 1e9, abs=1000)
    assert stages["serialize"].start_time >= stages["decode"].end_time
    spans = sorted(stages.values(), key=lambda s: s.start_time)
    assert all(a.end_time <= b.start_time for a, b in zip(spans, spans[1:]))
    steps = cap.by_name(semconv.ENGINE_STEP_SPAN_NAME)
    assert len(steps) == 5
    assert all(children_of(cap.spans(), s)[0].name == "inferprof.compute" for s in steps)


def test_a_non_streamed_generation_has_one_emission_at_the_response_end(server):
    url, cap = server
    with httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/complete", params={"max_tokens": 3}).json() == {"text": "t2 t1 t0"}
    (request,) = _wait_requests(cap, 1)
    attrs = request.attributes
    (offset,) = attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]
    assert attrs[semconv.ATTR_GEN_EMIT_TOKENS] == [3]
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 3
    (serialize,) = [s for s in children_of(cap.spans(), request)
                    if s.attributes[semconv.ATTR_STAGE] == "serialize"]
    assert request.start_time + offset * 1e9 == pytest.approx(serialize.end_time, abs=1000)


def test_a_client_that_disconnects_mid_stream_cancels_and_loses_nothing_else(server):
    url, cap = server
    with httpx.Client(base_url=url, timeout=10) as client:
        with client.stream("GET", "/generate", params={"max_tokens": 200, "per_chunk": 1}) as r:
            got = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got.append(line)
                if len(got) == 3:
                    break  # the stream closes on leaving the block
    (request,) = _wait_requests(cap, 1)
    attrs = request.attributes
    assert attrs[semconv.ATTR_CANCELLED] is True
    assert request.status.is_ok
    assert 3 <= len(attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]) < 200
    assert 3 <= attrs[semconv.ATTR_TOKENS_OUTPUT] < 200
    stages = {s.attributes[semconv.ATTR_STAGE] for s in children_of(cap.spans(), request)}
    assert {"queue", "prefill", "decode", "serialize"} <= stages
    # the engine dropped it: its steps stop (a few may be in flight when it notices)
    time.sleep(5 * GAP_S)
    n = len(cap.by_name(semconv.ENGINE_STEP_SPAN_NAME))
    time.sleep(5 * GAP_S)
    assert len(cap.by_name(semconv.ENGINE_STEP_SPAN_NAME)) == n < 200


def test_chunk_tokens_rejects_bad_counts_and_is_a_no_op_outside_a_request():
    inferprof.fastapi.chunk_tokens(3)
    with pytest.raises(ValueError):
        inferprof.fastapi.chunk_tokens(-1)


def test_a_runaway_stream_is_merged_pairwise_and_keeps_every_token():
    from inferprof.instrumentation.generation import COMPACT_AT

    n = COMPACT_AT + 1000

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(n):
            await send({"type": "http.response.body", "body": b"data: x\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def run():
        transport = httpx.ASGITransport(app=inferprof.fastapi.InferprofMiddleware(app))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/stream")

    with captured() as cap:
        assert asyncio.run(run()).content.count(b"data:") == n
    (request,) = cap.requests()
    attrs = request.attributes
    assert len(attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]) <= semconv.GEN_MAX_EMIT_ENTRIES
    assert sum(attrs[semconv.ATTR_GEN_EMIT_TOKENS]) == n == attrs[semconv.ATTR_TOKENS_OUTPUT]
    assert attrs[semconv.ATTR_GEN_EMIT_MERGED] > 0
