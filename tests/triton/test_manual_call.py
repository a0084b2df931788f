"""``inferprof.triton.call()``: the ``network`` stage and the headers to send for a Triton
request made without an instrumented client (the ``generate`` endpoints, httpx...). These
tests need no tritonclient; the ones against a real Triton server are in
test_triton_server.py."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.trace import StatusCode

import inferprof
import inferprof.triton
from inferprof import semconv
from tests.triton.helpers import hexid

UPSTREAM_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
UPSTREAM = {
    "traceparent": f"00-{UPSTREAM_TRACE:032x}-00f067aa0ba902b7-01",
    "tracestate": "vendor=opaque",
}


def test_inside_a_request_the_headers_carry_the_network_stage_and_the_callers_are_kept(cap):
    mine = {"Authorization": "Bearer t", "TraceParent": "00-stale"}
    with (
        inferprof.request(carrier=UPSTREAM) as req,
        inferprof.triton.call("llm", model_version=2, headers=mine) as call,
    ):
        sent = dict(call.headers)
        call.add_bytes(sent=120)
        call.add_bytes(received=30)
        call.add_bytes(received=20)  # e.g. per streamed chunk
    (stage,) = cap.stages(semconv.STAGE_NETWORK)
    (request,) = cap.requests()
    assert stage.parent.span_id == request.context.span_id and req.trace_id == UPSTREAM_TRACE
    assert sent == {
        "Authorization": "Bearer t",
        "traceparent": f"00-{hexid(UPSTREAM_TRACE, 32)}-{hexid(stage.context.span_id, 16)}-01",
        "tracestate": "vendor=opaque",
    }
    assert mine == {"Authorization": "Bearer t", "TraceParent": "00-stale"}  # not written
    attrs = stage.attributes
    assert attrs[semconv.ATTR_TRITON_MODEL_NAME] == "llm"
    assert attrs[semconv.ATTR_TRITON_MODEL_VERSION] == "2"
    assert attrs[semconv.ATTR_TRITON_PROTOCOL] == "http"
    assert attrs[semconv.ATTR_TRITON_REQUEST_BYTES] == 120
    assert attrs[semconv.ATTR_TRITON_RESPONSE_BYTES] == 50
    assert attrs[semconv.ATTR_BYTES] == 170


async def test_async_with_records_an_error_and_reraises_it_unchanged(cap):
    class Unavailable(Exception):
        pass

    error = Unavailable("503 from Triton")
    with pytest.raises(Unavailable) as raised:
        async with inferprof.request(), inferprof.triton.call("llm", protocol="grpc") as call:
            await asyncio.sleep(0)
            call.set_attribute("app.attempt", 1)
            raise error
    assert raised.value is error
    (stage,) = cap.stages(semconv.STAGE_NETWORK)
    assert stage.status.status_code is StatusCode.ERROR
    assert stage.attributes[semconv.ATTR_TRITON_PROTOCOL] == "grpc"
    assert stage.attributes["app.attempt"] == 1
    assert any(e.name == "exception" for e in stage.events)


def test_outside_a_request_the_stage_is_a_span_of_its_own_and_its_context_is_sent(cap):
    with inferprof.triton.call("llm") as call:
        headers = call.headers
    assert cap.requests() == []
    (stage,) = cap.stages(semconv.STAGE_NETWORK)
    assert stage.parent is None
    _, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert trace_id == hexid(stage.context.trace_id, 32)
    assert span_id == hexid(stage.context.span_id, 16)
    assert int(flags, 16) & 1  # sampled (the SDK may also set W3C's random-id flag)


def test_entered_again_a_call_sends_nothing_of_its_earlier_use(cap):
    call = inferprof.triton.call("llm", propagate="sampled")
    sampled = {"traceparent": f"00-{UPSTREAM_TRACE:032x}-00f067aa0ba902b7-01"}
    unsampled = {"traceparent": f"00-{UPSTREAM_TRACE + 1:032x}-00f067aa0ba902b7-00"}
    with inferprof.request(carrier=sampled), call:
        first = dict(call.headers)
    with inferprof.request(carrier=unsampled), call:
        second = dict(call.headers)
    assert "traceparent" in first and second == {}


def test_propagate_false_records_the_stage_and_sends_no_trace_context(cap):
    with inferprof.request(), inferprof.triton.call("llm", propagate=False) as call:
        headers = call.headers
    assert headers == {}
    assert len(cap.stages(semconv.STAGE_NETWORK)) == 1


@pytest.mark.parametrize("sampled", [True, False])
def test_propagate_sampled_sends_the_context_of_sampled_requests_only(cap, sampled):
    flag = "01" if sampled else "00"
    carrier = {"traceparent": f"00-{UPSTREAM_TRACE:032x}-00f067aa0ba902b7-{flag}"}
    with (
        inferprof.request(carrier=carrier),
        inferprof.triton.call("llm", propagate="sampled") as call,
    ):
        headers = call.headers
    assert ("traceparent" in headers) is sampled


def test_unconfigured_or_off_nothing_is_recorded_and_the_headers_are_a_copy():
    mine = {"x-app": "1"}
    with inferprof.triton.call("llm", headers=mine) as call:
        call.add_bytes(sent=1)
        call.set_attribute("k", "v")
    assert call.headers == mine and call.headers is not mine
    inferprof.configure(mode="off")
    with inferprof.request(), inferprof.triton.call("llm") as call:
        pass
    assert call.headers == {}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_name": ""},
        {"model_name": 3},
        {"model_name": "m", "protocol": "https"},
        {"model_name": "m", "propagate": "always"},
        {"model_name": "m", "headers": [("a", "b")]},
    ],
)
def test_bad_arguments_are_value_errors(kwargs):
    name = kwargs.pop("model_name")
    with pytest.raises(ValueError):
        inferprof.triton.call(name, **kwargs)


def test_bad_byte_counts_are_value_errors(cap):
    with inferprof.request(), inferprof.triton.call("llm") as call:
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError):
                call.add_bytes(sent=bad)


# --- against a real Triton server ------------------------------------------------------------

#: Triton 2.51 stamps the ``HTTP_SEND_*`` events of its ``generate`` endpoints with another
#: clock (8.8 hours before the request, on this machine; its ``infer`` endpoint's are right):
#: the answer is dated by ``INFER_RESPONSE_COMPLETE`` instead.
GENERATE_ANSWERED = ("INFER_RESPONSE_COMPLETE",)


def _post(url: str, body: bytes, headers: dict) -> bytes:
    import urllib.request

    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


@pytest.mark.integration
def test_generate_endpoint_call_is_a_network_stage_whose_trace_triton_continues(
    cap, triton, triton_traces
):
    import json

    from tests.triton.test_triton_server import assert_triton_continued

    body = json.dumps({"x": [1.0, 2.5]}).encode()
    url = f"http://{triton.http_url}/v2/models/double/generate"
    with inferprof.request(model="front"), inferprof.triton.call("double") as call:
        answer = _post(url, body, call.headers)
        call.add_bytes(sent=len(body), received=len(answer))
    assert json.loads(answer)["y"] == [2.0, 5.0]  # Triton's answer, untouched
    (request,) = cap.requests()
    (stage,) = cap.stages(semconv.STAGE_NETWORK)
    assert stage.parent.span_id == request.context.span_id
    assert request.start_time <= stage.start_time < stage.end_time <= request.end_time
    assert stage.attributes[semconv.ATTR_BYTES] == len(body) + len(answer)
    assert_triton_continued(triton_traces, [stage], "http", answered=GENERATE_ANSWERED)


@pytest.mark.integration
async def test_generate_stream_call_covers_the_whole_stream(cap, triton, triton_traces):
    import json

    from tests.triton.test_triton_server import assert_triton_continued

    body = json.dumps({"x": 3}).encode()  # the decoupled model answers 0, 1, 2
    url = f"http://{triton.http_url}/v2/models/count/generate_stream"
    async with inferprof.request(), inferprof.triton.call("count") as call:
        stream = await asyncio.to_thread(_post, url, body, call.headers)
    lines = stream.decode().splitlines()
    events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert [e["y"] for e in events] == [0, 1, 2]
    (stage,) = cap.stages(semconv.STAGE_NETWORK)
    assert_triton_continued(triton_traces, [stage], "http", answered=GENERATE_ANSWERED)
    # Every response Triton completed for the stream lies inside the one stage.
    (server,) = [
        s
        for s in triton_traces.spans("triton")
        if s.name == "InferRequest" and s.parent_span_id == stage.context.span_id.to_bytes(8, "big")
    ]
    done = [e.time_unix_nano for e in server.events if e.name == "INFER_RESPONSE_COMPLETE"]
    assert done and all(stage.start_time <= t <= stage.end_time for t in done)
