"""The instrumented clients against a real Triton Inference Server (pytriton, CPU) whose own
OpenTelemetry tracing is on: the ``network`` stage each call records, and Triton's spans
continuing the same trace under it — the proof that the ``traceparent`` reached Triton."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from opentelemetry.trace import StatusCode

import inferprof
import inferprof.triton
from inferprof import semconv
from tests.otlp_sink import attributes
from tests.triton.helpers import FLAVOURS, client, close, maybe_await, tensor, urls_of

pytestmark = pytest.mark.integration

X = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)  # 16 bytes in, 16 bytes out

#: Calls per test over gRPC. Triton's gRPC front end (2.51, pytriton 0.7.0) starts a trace of
#: its own for about 1-6% of unary calls and 2% of streams even though their metadata holds a
#: ``traceparent`` (measured with the plain client too: 4/300 calls on one channel, 19/300
#: on a new channel each, 3/150 streams; HTTP 0/400). So over gRPC a test makes several
#: calls and asks that Triton continued at least one, and continued every one correctly
#: where it did; over HTTP it asks for every one. The headers themselves are checked
#: exactly in test_propagation.py.
GRPC_CALLS = 4


def calls_for(flavour: str) -> int:
    return GRPC_CALLS if flavour.startswith("grpc") else 1


def _first(span, suffixes: tuple[str, ...]) -> int:
    """When the first of Triton's events with these suffixes happened (a stream has one per
    response)."""
    return min(e.time_unix_nano for e in span.events if e.name.endswith(suffixes))


def assert_triton_continued(
    triton_traces, stages, protocol: str, answered: tuple[str, ...] = ("_SEND_START",)
) -> None:
    """Triton's root span (``InferRequest``) of each call is a child of the call's network
    stage, in the stage's trace, and Triton read the request and began its answer (the
    first event named with a suffix in ``answered``) within the stage (one host, one
    clock). Over gRPC, at least one of the calls (see GRPC_CALLS)."""
    by_id = {s.context.span_id.to_bytes(8, "big"): s for s in stages}
    traces = {s.context.trace_id.to_bytes(16, "big") for s in stages}

    def mine(spans):
        return [s for s in spans if s.trace_id in traces and s.name == "InferRequest"]

    try:
        spans = triton_traces.wait_for(
            lambda spans: len(mine(spans)) >= len(stages),
            service="triton",
            timeout=10 if protocol == "http" else 3,
        )
    except AssertionError:
        if protocol == "http":
            raise
        spans = triton_traces.spans("triton")
    found = mine(spans)
    assert found, "Triton continued none of the calls' traces"
    parents = [s.parent_span_id for s in found]
    assert len(set(parents)) == len(parents)  # one Triton request per call
    for server in found:
        stage = by_id[server.parent_span_id]  # KeyError: parented on something else
        assert server.trace_id == stage.context.trace_id.to_bytes(16, "big")
        received = _first(server, ("_RECV_END", "_WAITREAD_END"))
        answering = _first(server, answered)
        assert stage.start_time <= received <= answering <= stage.end_time
    if protocol == "http":
        assert set(parents) == set(by_id)


def only(spans):
    (span,) = spans
    return span


@pytest.mark.parametrize("flavour", FLAVOURS)
async def test_infer_is_a_network_stage_whose_trace_triton_continues(
    flavour, cap, triton, triton_traces
):
    protocol = flavour.split("_")[0]
    c = inferprof.triton.instrument(client(flavour, urls_of(triton)))
    try:
        async with inferprof.request(model="front") as req:
            results = [
                await maybe_await(c.infer("double", [tensor(flavour, X)]))
                for _ in range(calls_for(flavour))
            ]
    finally:
        await close(c)
    for result in results:  # Triton's answers, untouched
        np.testing.assert_array_equal(result.as_numpy("y"), X * 2)

    request = only(cap.requests())
    stages = cap.stages(semconv.STAGE_NETWORK)
    assert len(stages) == calls_for(flavour)
    for stage in stages:
        assert stage.name == "inferprof.network"
        assert stage.context.trace_id == request.context.trace_id == req.trace_id
        assert stage.parent.span_id == request.context.span_id
        assert request.start_time <= stage.start_time < stage.end_time <= request.end_time
        assert stage.status.status_code is StatusCode.UNSET
        attrs = stage.attributes
        assert attrs[semconv.ATTR_TRITON_MODEL_NAME] == "double"
        assert attrs[semconv.ATTR_TRITON_PROTOCOL] == protocol
        assert attrs[semconv.ATTR_TRITON_REQUEST_BYTES] == X.nbytes
        assert attrs[semconv.ATTR_TRITON_RESPONSE_BYTES] == X.nbytes
        assert attrs[semconv.ATTR_BYTES] == 2 * X.nbytes
    # the request's own model name is the application's, not Triton's
    assert request.attributes[semconv.ATTR_MODEL_NAME] == "front"

    assert_triton_continued(triton_traces, stages, protocol)
    # ... with Triton's model span under its request span, in the same trace
    server = next(
        s
        for s in triton_traces.spans("triton")
        if s.name == "InferRequest" and s.trace_id == req.trace_id.to_bytes(16, "big")
    )
    model = only(s for s in triton_traces.spans("triton") if s.parent_span_id == server.span_id)
    assert model.trace_id == server.trace_id
    assert attributes(model)["triton.model_name"] == "double"
    assert {e.name for e in model.events} >= {"QUEUE_START", "REQUEST_END"}


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("mistake", ["unknown_model", "bad_input"])
async def test_triton_error_is_recorded_on_the_stage_and_reraised_unchanged(
    flavour, mistake, cap, triton
):
    from tritonclient.utils import InferenceServerException

    model, name = ("no_such_model", "x") if mistake == "unknown_model" else ("double", "wrong")
    plain = client(flavour, urls_of(triton))
    c = inferprof.triton.instrument(client(flavour, urls_of(triton)))
    try:
        with pytest.raises(InferenceServerException) as expected:
            await maybe_await(plain.infer(model, [tensor(flavour, X, name)]))
        async with inferprof.request():
            with pytest.raises(InferenceServerException) as got:
                await maybe_await(c.infer(model, [tensor(flavour, X, name)]))
    finally:
        await close(plain)
        await close(c)
    # what the application catches is what the plain client raises
    assert type(got.value) is type(expected.value)
    assert str(got.value) == str(expected.value)
    assert got.value.status() == expected.value.status()

    stage = only(cap.stages(semconv.STAGE_NETWORK))
    assert stage.status.status_code is StatusCode.ERROR
    assert str(got.value) in stage.status.description
    event = only(stage.events)
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "tritonclient.utils.InferenceServerException"
    assert stage.attributes[semconv.ATTR_TRITON_MODEL_NAME] == model
    assert semconv.ATTR_TRITON_RESPONSE_BYTES not in stage.attributes
    assert only(cap.requests()).status.status_code is StatusCode.UNSET  # the app caught it


def test_grpc_async_infer_stages_end_when_their_callbacks_run(cap, triton, triton_traces):
    import tritonclient.grpc as grpcclient

    c = inferprof.triton.instrument(grpcclient.InferenceServerClient(triton.grpc_url))
    seen = []
    lock = threading.Lock()
    done = threading.Semaphore(0)

    def callback(result, error):
        with lock:
            seen.append((time.time_ns(), result, error))
        done.release()

    try:
        with inferprof.request():
            for _ in range(GRPC_CALLS):
                c.async_infer("double", [tensor("grpc", X)], callback)
            for _ in range(GRPC_CALLS):
                assert done.acquire(timeout=10)
    finally:
        c.close()
    assert all(error is None for _, _, error in seen)
    for _, result, _ in seen:
        np.testing.assert_array_equal(result.as_numpy("y"), X * 2)
    stages = cap.stages(semconv.STAGE_NETWORK)
    assert len(stages) == GRPC_CALLS
    # each ended before the application's callback ran
    assert sorted(s.end_time for s in stages) <= sorted(at for at, _, _ in seen)
    assert all(s.attributes[semconv.ATTR_TRITON_RESPONSE_BYTES] == X.nbytes for s in stages)
    assert_triton_continued(triton_traces, stages, "grpc")


def test_http_async_infer_propagates_through_the_greenlet(cap, triton, triton_traces):
    # The HTTP client sends from a gevent greenlet that does not see the caller's context:
    # the trace context has to travel in the call's headers argument.
    import tritonclient.http as httpclient

    c = inferprof.triton.instrument(httpclient.InferenceServerClient(triton.http_url))
    headers = {"x-app": "1"}
    try:
        with inferprof.request():
            pending = c.async_infer("double", [tensor("http", X)], headers=headers)
            result = pending.get_result()
    finally:
        c.close()
    np.testing.assert_array_equal(result.as_numpy("y"), X * 2)
    assert headers == {"x-app": "1"}  # the application's dict is not written to
    stage = only(cap.stages(semconv.STAGE_NETWORK))
    assert stage.attributes[semconv.ATTR_TRITON_RESPONSE_BYTES] == X.nbytes
    assert_triton_continued(triton_traces, [stage], "http")


def _stream_checks(cap, triton_traces, counts: list[int]) -> None:
    stages = cap.stages(semconv.STAGE_NETWORK)
    assert len(stages) == len(counts)
    request = only(cap.requests())
    for stage, n in zip(sorted(stages, key=lambda s: s.start_time), counts):
        attrs = stage.attributes
        assert attrs[semconv.ATTR_TRITON_MODEL_NAME] == "count"
        assert attrs[semconv.ATTR_TRITON_STREAM_REQUESTS] == 1
        assert attrs[semconv.ATTR_TRITON_STREAM_RESPONSES] == n
        assert attrs[semconv.ATTR_TRITON_REQUEST_BYTES] == 4
        assert attrs[semconv.ATTR_TRITON_RESPONSE_BYTES] == 4 * n
        assert request.start_time <= stage.start_time < stage.end_time <= request.end_time
        assert stage.parent.span_id == request.context.span_id
    assert_triton_continued(triton_traces, stages, "grpc")


def test_grpc_stream_is_one_network_stage_from_start_to_stop(cap, triton, triton_traces):
    import tritonclient.grpc as grpcclient

    c = inferprof.triton.instrument(grpcclient.InferenceServerClient(triton.grpc_url))
    counts = [2, 3, 1, 2]
    got = []
    try:
        with inferprof.request():
            for n in counts:
                c.start_stream(callback=lambda result, error: got.append((result, error)))
                x = np.array([n], dtype=np.int32)
                c.async_stream_infer("count", [tensor("grpc", x, datatype="INT32")])
                c.stop_stream()  # returns once every response has been handled
    finally:
        c.close()
    assert [int(r.as_numpy("y")[0]) for r, e in got] == [k for n in counts for k in range(n)]
    _stream_checks(cap, triton_traces, counts)


async def test_grpc_aio_stream_is_one_network_stage_until_its_iterator_ends(
    cap, triton, triton_traces
):
    import tritonclient.grpc.aio as grpcclient

    c = inferprof.triton.instrument(grpcclient.InferenceServerClient(triton.grpc_url))
    counts = [4, 1, 2, 3]

    async def requests(n):
        x = np.array([n], dtype=np.int32)
        yield {"model_name": "count", "inputs": [tensor("grpc_aio", x, datatype="INT32")]}

    try:
        async with inferprof.request():
            for n in counts:
                got = [int(r.as_numpy("y")[0]) async for r, e in c.stream_infer(requests(n))]
                assert got == list(range(n))
    finally:
        await c.close()
    _stream_checks(cap, triton_traces, counts)


def test_outside_a_request_a_call_is_a_span_of_its_own_that_triton_continues(
    cap, triton, triton_traces
):
    import tritonclient.http as httpclient

    c = inferprof.triton.instrument(httpclient.InferenceServerClient(triton.http_url))
    try:
        c.infer("double", [tensor("http", X)])
    finally:
        c.close()
    assert cap.requests() == []
    stage = only(cap.stages(semconv.STAGE_NETWORK))
    assert stage.parent is None  # nothing was current: a root span, as inferprof.stage makes
    assert stage.attributes[semconv.ATTR_TRITON_MODEL_NAME] == "double"
    assert_triton_continued(triton_traces, [stage], "http")


@pytest.mark.parametrize("flavour", ["http", "grpc"])
def test_unconfigured_the_call_adds_no_span_and_no_trace_context(flavour, triton, triton_traces):
    c = inferprof.triton.instrument(client(flavour, urls_of(triton)))
    before = len(triton_traces.spans("triton"))
    started = time.time_ns()
    try:
        with inferprof.request() as req:  # inferprof is not configured: nothing is opened
            assert req is None
            result = c.infer("double", [tensor(flavour, X)])
    finally:
        c.close()
    ended = time.time_ns()
    np.testing.assert_array_equal(result.as_numpy("y"), X * 2)

    def ours(spans):
        return [
            s
            for s in spans[before:]
            if s.name == "InferRequest" and started <= s.start_time_unix_nano <= ended
        ]

    # Triton traced the call as a trace of its own: its root span has no parent.
    server = only(ours(triton_traces.wait_for(ours, service="triton")))
    assert server.parent_span_id == b""
