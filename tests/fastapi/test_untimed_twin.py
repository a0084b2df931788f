"""A request the timing budget leaves untimed and summarises (``untimed_stages``) is handed
to the summaries with exactly the stage spans, end-to-end window, error and model its timed
twin is: the same app, driven through raw ASGI messages on a clock that only the app moves,
served once timed and once untimed, gives the same summary entry (times relative to the
request's start). Every request of a counted route is then in the summaries alike."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi import BackgroundTasks, FastAPI, Request
from fastapi.responses import StreamingResponse

import inferprof
import inferprof.fastapi
from inferprof.fastapi import middleware
from tests.fastapi.budget_helpers import budgeted_capture
from tests.instrumentation.test_summaries import MemoryExporter

MS = 1_000_000


class _Share:
    """The timing budget's decision, set by the test (what is compared is what follows)."""

    def __init__(self) -> None:
        self.value = 1.0

    def __call__(self, rt: Any, key: object, context: Any = None) -> float:
        return self.value


@contextmanager
def _route_learnt(app: FastAPI, clock: Any, monkeypatch: Any) -> Iterator[tuple[Any, _Share]]:
    """``app`` instrumented, its untimed requests summarised and the budget's decision in
    the test's hands, after one timed GET of ``/work`` (its route learnt): yields the
    runtime and the decision (its value set to 0.0 leaves what follows untimed)."""
    share = _Share()
    monkeypatch.setattr(middleware, "timed_share", share)
    inferprof.fastapi.instrument(app)
    with budgeted_capture(MemoryExporter(), sample_rate=0.05, untimed_stages=True) as (
            _cap, rt, _):
        asyncio.run(_drive(app, clock, method="GET"))  # timed: the route learnt
        yield rt, share


async def _drive(app: Any, clock: Any, method: str = "POST", path: str = "/work",
                 chunks: tuple[bytes, ...] = (b'{"i": 1}',), disconnect_at: int | None = None,
                 spec: str = "2.4", headers: list | None = None) -> list[dict]:
    """Serve one request: its body in ``chunks`` (1 ms apart), the client leaving at the
    ``disconnect_at``-th body chunk of the answer (-1: at its start; which an ASGI ``spec``
    2.4 server's send raises as OSError, an earlier one's drops), with ``headers`` (a JSON
    body's by default). The messages the app sent."""
    incoming = [
        {"type": "http.request", "body": c, "more_body": n < len(chunks) - 1}
        for n, c in enumerate(chunks)
    ] or [{"type": "http.request", "body": b"", "more_body": False}]
    sent: list[dict] = []
    gone = asyncio.Event()

    async def receive() -> dict:
        if incoming:
            clock.tick(MS)
            return incoming.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        body = message["type"] == "http.response.body"
        if disconnect_at == -1 or (body and disconnect_at is not None and sum(
                1 for m in sent if m["type"] == "http.response.body") >= disconnect_at):
            gone.set()
            if spec == "2.4":
                raise OSError("client gone")
            return
        clock.tick(MS // 2)
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": spec},
        "http_version": "1.1", "method": method, "scheme": "http", "path": path,
        "raw_path": path.encode(), "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")] if headers is None else headers,
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }
    try:
        await app(scope, receive, send)
    except (Exception, asyncio.CancelledError):
        pass
    return sent


def _relative(entry: tuple) -> tuple:
    start, end, error, model, _weight, flat, _mark = entry
    spans = sorted(
        (flat[i], flat[i + 1] - start, flat[i + 2] - start) for i in range(0, len(flat), 3)
    )
    return end - start, error, model, spans


def _serve_twice(app: FastAPI, clock: Any, monkeypatch: Any, untimed_stages: bool,
                 **request: Any) -> tuple[list, list, list]:
    """One request served timed, then the same served untimed, once the route has been
    learnt from a timed one: the timed one's summary entries, the untimed one's, and the
    untimed requests only counted."""
    share = _Share()
    monkeypatch.setattr(middleware, "timed_share", share)
    inferprof.fastapi.instrument(app)
    with budgeted_capture(MemoryExporter(), sample_rate=0.05,
                          untimed_stages=untimed_stages) as (_cap, rt, _):
        pending = rt.summaries._pending
        asyncio.run(_drive(app, clock, **request))  # timed: the route learnt
        pending.clear()
        asyncio.run(_drive(app, clock, **request))
        timed = list(pending)
        pending.clear()
        share.value = 0.0
        asyncio.run(_drive(app, clock, **request))
        return timed, list(pending), list(rt.summaries._untimed)


def _twins(app: FastAPI, clock: Any, monkeypatch: Any, **request: Any) -> tuple[Any, Any]:
    """The summary entries of one request served timed and of the same served untimed,
    once the route has been learnt from a timed one."""
    timed, untimed, counted = _serve_twice(app, clock, monkeypatch, True, **request)
    assert len(timed) == 1, timed
    assert not counted, counted  # summarised, not only counted
    assert len(untimed) == 1, untimed
    assert timed[0][4] == untimed[0][4] == 1.0 and not timed[0][6] and not untimed[0][6]
    return _relative(timed[0]), _relative(untimed[0])


def _app_with(handler_body: Any, method: str = "post", **route: Any) -> FastAPI:
    app = FastAPI()
    getattr(app, method)("/work", **route)(handler_body)
    return app


def test_plain_stages(clock, monkeypatch):
    async def work(request: Request):
        await request.body()
        with inferprof.stage("tokenize"):
            clock.tick(3 * MS)
            with inferprof.stage("compute"):  # nested
                clock.tick(5 * MS)
        return {"ok": True}

    timed, untimed = _twins(_app_with(work), clock, monkeypatch, chunks=(b"{", b'"i": 1}'))
    assert timed == untimed


def test_a_stage_object_entered_twice(clock, monkeypatch):
    async def work():
        st = inferprof.stage("decode")
        for n in range(3):
            with st:
                clock.tick((n + 1) * MS)
            clock.tick(MS)
        return {"ok": True}

    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET")
    assert [s[0] for s in timed[3]].count("decode") == 3
    assert timed == untimed


def _stream(sse: bool, fail_at: int | None = None) -> FastAPI:
    async def work():
        async def gen():
            for n in range(4):
                with inferprof.stage("decode"):
                    clock_ref[0].tick(MS)
                if fail_at is not None and n == fail_at:
                    raise RuntimeError("boom")
                yield b"data: {\"t\": 1}\n\n" if sse else b"chunk"

        media = "text/event-stream" if sse else "application/octet-stream"
        return StreamingResponse(gen(), media_type=media)

    return _app_with(work, "get")


clock_ref: list = []


@pytest.mark.parametrize("sse", [False, True])
def test_a_streamed_answer(clock, monkeypatch, sse):
    clock_ref[:] = [clock]
    timed, untimed = _twins(_stream(sse), clock, monkeypatch, method="GET")
    assert timed == untimed


def test_a_stream_failing_midway(clock, monkeypatch):
    clock_ref[:] = [clock]
    timed, untimed = _twins(_stream(False, fail_at=2), clock, monkeypatch, method="GET")
    assert timed[1] is True
    assert timed == untimed


def test_a_client_leaving_midway(clock, monkeypatch):
    clock_ref[:] = [clock]
    timed, untimed = _twins(_stream(True), clock, monkeypatch, method="GET", disconnect_at=2)
    assert timed == untimed


def test_a_failure_before_the_answer(clock, monkeypatch):
    async def work(request: Request):
        await request.body()
        with inferprof.stage("tokenize"):
            clock.tick(MS)
        raise RuntimeError("boom")

    timed, untimed = _twins(_app_with(work), clock, monkeypatch)
    assert timed[1] is True
    assert timed == untimed


def test_a_5xx_answer(clock, monkeypatch):
    from fastapi import HTTPException

    async def work():
        with inferprof.stage("tokenize"):
            clock.tick(MS)
        raise HTTPException(503, "busy")

    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET")
    assert timed[1] is True
    assert timed == untimed


def test_a_background_task_and_a_stage_left_open(clock, monkeypatch):
    def later():
        with inferprof.stage("postprocess"):
            clock.tick(4 * MS)

    async def work(tasks: BackgroundTasks):
        inferprof.stage("tokenize").__enter__()  # never exited
        clock.tick(MS)
        tasks.add_task(later)
        return {"ok": True}

    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET")
    assert timed == untimed


def test_an_async_decorated_stage(clock, monkeypatch):
    @inferprof.stage("compute")
    async def compute():
        clock.tick(2 * MS)
        await asyncio.sleep(0)

    async def work():
        await compute()
        async with inferprof.stage("postprocess"):
            clock.tick(MS)
        return {"ok": True}

    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET")
    assert timed == untimed


@pytest.mark.parametrize("encoding", ["children", "links"])
def test_a_manual_batch(clock, monkeypatch, encoding):
    from inferprof.batching import hooks

    monkeypatch.setattr(hooks, "_time_ns", clock)

    async def work():
        h = inferprof.enqueue()
        clock.tick(2 * MS)
        with inferprof.batch([h], batch_encoding=encoding) as b:
            with b.stage("batch_assembly"):
                clock.tick(MS)
            with inferprof.stage("compute"):
                clock.tick(3 * MS)
        return {"ok": True}

    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET")
    assert timed == untimed
def test_a_host_device_stage(clock, monkeypatch):
    # device="cpu" (and a CUDA device where torch has none) is timed by the host clock in a
    # timed request: nothing a summarised record cannot hold
    async def work():
        with inferprof.stage("h2d", device="cpu"):
            clock.tick(2 * MS)
        return {"ok": True}

    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET")
    assert timed == untimed


def test_a_batch_that_fails(clock, monkeypatch):
    # The app answers anyway: the batch's failure is the request's error all the same
    from inferprof.batching import hooks

    monkeypatch.setattr(hooks, "_time_ns", clock)

    async def work():
        h = inferprof.enqueue()
        clock.tick(MS)
        try:
            with inferprof.batch([h]), inferprof.stage("compute"):
                clock.tick(MS)
                raise RuntimeError("device lost")
        except RuntimeError:
            pass
        return {"fallback": True}

    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET")
    assert timed[1] is True
    assert timed == untimed


@pytest.mark.parametrize("encoding", ["children", "links"])
def test_a_dynamic_batch_of_a_timed_and_an_untimed_request(clock, monkeypatch, encoding):
    # One batch, two members: the timed one and the untimed one are summarised with the
    # same batch stages, each with its own queue stage
    from inferprof.batching import DynamicBatcher, hooks

    monkeypatch.setattr(hooks, "_time_ns", clock)

    def fn(items):
        with inferprof.stage("compute"):
            clock.tick(3 * MS)
        return items

    batcher = DynamicBatcher(fn, max_batch_size=2, max_delay_ms=10_000, batch_encoding=encoding)

    async def work():
        with inferprof.stage("tokenize"):
            clock.tick(MS)
        return {"i": await batcher.submit(1)}

    app = _app_with(work, "get")
    shares = [1.0, 1.0, 0.0]
    monkeypatch.setattr(middleware, "timed_share", lambda *a, **k: shares.pop(0))
    inferprof.fastapi.instrument(app)
    with budgeted_capture(MemoryExporter(), sample_rate=0.05, untimed_stages=True) as (
            _cap, rt, _):
        pending = rt.summaries._pending

        async def both():
            await asyncio.gather(_drive(app, clock, method="GET", path="/work"),
                                 _drive(app, clock, method="GET", path="/work"))

        async def one():  # alone, the batch of one forms at its deadline: route learnt
            await _drive(app, clock, method="GET", path="/work")

        batcher.max_delay_s = 0.01
        asyncio.run(one())
        pending.clear()
        batcher.max_delay_s = 10.0
        asyncio.run(both())
        entries = list(pending)
        counted = list(rt.summaries._untimed)
        inferprof.shutdown()
        snap = inferprof.instrumentation.stats()
    assert not counted and snap.requests_untimed_summarised == 1
    assert len(entries) == 2
    spans = [_relative(e)[3] for e in entries]
    for s in spans:
        assert [x[0] for x in s].count("queue") == 1
    batch_spans = [  # (absolute times: one batch)
        [e[5][i:i + 3] for i in range(0, len(e[5]), 3) if e[5][i] == "compute"]
        for e in entries
    ]
    assert batch_spans[0] == batch_spans[1] and len(batch_spans[0]) == 1


def test_an_untimed_request_the_summaries_no_longer_take_is_dropped_once(clock, monkeypatch):
    # Summaries closed (shutdown while requests finish): the request is one dropped
    # request, not one dropped summary plus one dropped count
    async def work():
        with inferprof.stage("tokenize"):
            clock.tick(MS)
        return {"ok": True}

    app = _app_with(work, "get")
    with _route_learnt(app, clock, monkeypatch) as (rt, share):
        rt.summaries.close(5.0)
        before = inferprof.instrumentation.stats()
        share.value = 0.0
        asyncio.run(_drive(app, clock, method="GET"))
        after = inferprof.instrumentation.stats()
    assert after.summaries_dropped - before.summaries_dropped == 1
    assert after.requests_untimed_counted == before.requests_untimed_counted
    assert after.requests_untimed_summarised == before.requests_untimed_summarised == 0


def test_a_request_past_the_stage_bound(clock, monkeypatch):
    # A timed request keeps its first MAX_STAGES stages and is summarised with them (a
    # per-token stage on a long stream): so is an untimed one, its route still summarised
    from inferprof.instrumentation.stage import MAX_STAGES

    async def work():
        for _ in range(MAX_STAGES + 50):
            with inferprof.stage("decode"):
                clock.tick(1_000)
        return {"ok": True}

    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET")
    assert [s[0] for s in timed[3]].count("decode") == MAX_STAGES
    assert timed == untimed


def test_a_client_gone_before_a_plain_answer(clock, monkeypatch):
    # An ASGI 2.4 server's send raises OSError for the client gone: Starlette's Response
    # lets it through (no ClientDisconnect); a timed request's send() sees it: cancelled,
    # no error
    async def work():
        with inferprof.stage("compute"):
            clock.tick(MS)
        return {"ok": True}

    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET",
                            disconnect_at=0)
    assert timed[1] is False
    assert timed == untimed


def test_an_app_failing_once_the_client_left(clock, monkeypatch):
    # The app sees the client leave (request.is_disconnected()) and raises: no error for
    # a timed request, whose receive() saw the disconnect
    async def work(request: Request):
        async def gen():
            for _ in range(4):
                if await request.is_disconnected():
                    raise RuntimeError("client left")
                with inferprof.stage("decode"):
                    clock.tick(MS)
                yield b'data: {"t": 1}\n\n'

        return StreamingResponse(gen(), media_type="text/event-stream")

    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET",
                            disconnect_at=2, spec="2.3")
    assert timed[1] is False
    assert timed == untimed


def test_a_cancellation_after_a_5xx_answer_started(clock, monkeypatch):
    # Cancelled (the server's task, the client gone) once a 503 stream started: a timed
    # request's error is the cancellation, which is no error, whatever the status
    async def work():
        async def gen():
            with inferprof.stage("decode"):
                clock.tick(MS)
            yield b"chunk"
            raise asyncio.CancelledError()

        return StreamingResponse(gen(), status_code=503,
                                 media_type="application/octet-stream")

    clock_ref[:] = [clock]
    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET")
    assert timed[1] is False
    assert timed == untimed


def test_a_client_gone_midway_through_a_file(clock, monkeypatch, tmp_path):
    # Starlette's FileResponse under an ASGI 2.4 server lets the OSError of a refused
    # chunk through (no ClientDisconnect), here one before the last: a timed request's
    # send() sees it: cancelled, no error
    from fastapi.responses import FileResponse

    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * (3 * 64 * 1024))

    async def work():
        with inferprof.stage("compute"):
            clock.tick(MS)
        return FileResponse(big)

    timed, untimed = _twins(_app_with(work, "get"), clock, monkeypatch, method="GET",
                            disconnect_at=1)
    assert timed[1] is False
    assert timed == untimed


def _counted_twins(app: FastAPI, clock: Any, monkeypatch: Any, **request: Any
                   ) -> tuple[bool, bool]:
    """Whether one request ended in error served timed and served untimed on a route whose
    untimed requests are only counted (``untimed_stages=False``; its end there is when
    the last chunk was handed over: the error alone is compared)."""
    timed, summarised, counted = _serve_twice(app, clock, monkeypatch, False, **request)
    assert len(timed) == 1, timed
    assert not summarised, summarised
    assert len(counted) == 1, counted
    return timed[0][2], counted[0][2]


def test_only_counted_a_client_gone_before_a_plain_answer(clock, monkeypatch):
    async def work():
        with inferprof.stage("compute"):
            clock.tick(MS)
        return {"ok": True}

    timed, counted = _counted_twins(_app_with(work, "get"), clock, monkeypatch,
                                    method="GET", disconnect_at=0)
    assert timed is False
    assert timed == counted


def test_only_counted_a_client_gone_midway_through_a_file(clock, monkeypatch, tmp_path):
    from fastapi.responses import FileResponse

    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * (3 * 64 * 1024))

    async def work():
        return FileResponse(big)

    timed, counted = _counted_twins(_app_with(work, "get"), clock, monkeypatch,
                                    method="GET", disconnect_at=1)
    assert timed is False
    assert timed == counted


def test_only_counted_a_client_leaving_a_stream_midway(clock, monkeypatch):
    clock_ref[:] = [clock]
    timed, counted = _counted_twins(_stream(True), clock, monkeypatch, method="GET",
                                    disconnect_at=2)
    assert timed is False
    assert timed == counted


@pytest.mark.parametrize("counted", [False, True])
def test_the_answer_start_refused(clock, monkeypatch, counted):
    # An OSError for the answer's start: a timed request's send() does not catch it there
    # (the request fails): not the client gone mid-answer that one for a body chunk is
    async def work():
        with inferprof.stage("compute"):
            clock.tick(MS)
        return {"ok": True}

    app = _app_with(work, "get")
    if counted:
        timed, untimed = _counted_twins(app, clock, monkeypatch, method="GET",
                                        disconnect_at=-1)
    else:
        timed, untimed = _twins(app, clock, monkeypatch, method="GET", disconnect_at=-1)
        timed, untimed = timed[1], untimed[1]
    assert timed is True
    assert timed == untimed


def test_the_untimed_twins_spans_come_in_the_timed_ones_order(clock, monkeypatch):
    # Its stages, then receive, then serialize: the order a fold meets stage names in is
    # the order of the summaries' data points (not only the same spans, the same entry)
    async def work(request: Request):
        await request.body()
        with inferprof.stage("tokenize"):
            clock.tick(3 * MS)
        with inferprof.stage("compute"):
            clock.tick(5 * MS)
        return {"ok": True}

    timed, untimed, counted = _serve_twice(_app_with(work), clock, monkeypatch, True,
                                           chunks=(b"{", b'"i": 1}'))
    assert not counted and len(timed) == len(untimed) == 1
    names = untimed[0][5][0::3]
    assert names == ("tokenize", "compute", "receive", "serialize")
    assert names == timed[0][5][0::3]


def test_headers_it_cannot_read_leave_an_untimed_request_served_and_summarised(
        clock, monkeypatch, caplog):
    # A header whose name cannot be hashed (a bytearray): the trace context check fails,
    # is logged, and the request is served and summarised all the same
    async def work():
        with inferprof.stage("compute"):
            clock.tick(MS)
        return {"ok": True}

    app = _app_with(work, "get")
    with _route_learnt(app, clock, monkeypatch) as (rt, share):
        rt.summaries._pending.clear()
        share.value = 0.0
        for odd in ((bytearray(b"x-odd"), b"1"), (bytearray(b"traceparent"), b"?")):
            sent = asyncio.run(_drive(app, clock, method="GET", headers=[odd]))
            assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
            assert sent[0]["status"] == 200
        assert len(rt.summaries._pending) == 2 and not rt.summaries._untimed
    assert caplog.text.count("could not read a request's trace context") == 2
