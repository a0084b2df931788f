"""What reaches the server: the trace headers each kind of call sends, checked on real HTTP
and gRPC endpoints on 127.0.0.1 that record them (Triton does not expose them)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from opentelemetry import propagate

import inferprof
import inferprof.triton
from inferprof import semconv
from inferprof.instrumentation.stage import MAX_STAGES
from tests.instrumentation.helpers import captured
from tests.triton.helpers import FLAVOURS, client, close, hexid, maybe_await, tensor

X = np.array([[1.0]], dtype=np.float32)
UPSTREAM_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
UPSTREAM = {
    "traceparent": f"00-{UPSTREAM_TRACE:032x}-00f067aa0ba902b7-01",
    "tracestate": "vendor=opaque",
}


def traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{hexid(trace_id, 32)}-{hexid(span_id, 16)}-{'01' if sampled else '00'}"


@pytest.mark.parametrize("flavour", FLAVOURS)
async def test_the_call_sends_its_network_stage_as_parent_with_the_upstream_tracestate(
    flavour, cap, recorder
):
    c = inferprof.triton.instrument(client(flavour, recorder.urls))
    try:
        async with inferprof.request(carrier=UPSTREAM) as req:
            result = await maybe_await(c.infer("m", [tensor(flavour, X)]))
    finally:
        await close(c)
    assert result.as_numpy("y").tolist() == [[1.0]]
    (stage,) = cap.stages(semconv.STAGE_NETWORK)
    assert req.trace_id == UPSTREAM_TRACE
    headers = recorder.last(flavour.split("_")[0])
    assert headers["traceparent"] == traceparent(UPSTREAM_TRACE, stage.context.span_id)
    assert headers["tracestate"] == "vendor=opaque"
    # bytes are binary tensor data: the input's 4 bytes; the gRPC answer's 4 raw bytes, the
    # HTTP answer's none (this server sends its tensor as JSON)
    assert stage.attributes[semconv.ATTR_TRITON_REQUEST_BYTES] == 4
    protocol = flavour.split("_")[0]
    assert stage.attributes[semconv.ATTR_TRITON_RESPONSE_BYTES] == (4 if protocol == "grpc" else 0)


def test_an_application_plugin_still_runs_and_its_headers_dict_is_not_written(cap, recorder):
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc.auth import BasicAuth

    c = grpcclient.InferenceServerClient(recorder.urls["grpc"])
    auth = BasicAuth("user", "secret")
    c.register_plugin(auth)
    inferprof.triton.instrument(c)
    headers = {"x-tenant": "a"}  # one dict reused for every call, as applications do
    sent = []
    try:
        for _ in range(2):
            with inferprof.request():
                c.infer("m", [tensor("grpc", X)], headers=headers)
            sent.append(recorder.last("grpc"))
        # (BasicAuth itself writes Authorization into it, as it does without inferprof)
        assert "traceparent" not in headers and "tracestate" not in headers
        stages = cap.stages(semconv.STAGE_NETWORK)
        assert len(stages) == 2
        for h, stage in zip(sent, stages):
            assert h["authorization"].startswith("Basic ")  # the application's plugin ran
            assert h["x-tenant"] == "a"
            assert h["traceparent"] == traceparent(stage.context.trace_id, stage.context.span_id)
        # uninstrument gives the client its own plugin back, and the class it had
        inferprof.triton.uninstrument(c)
        assert c.plugin() is auth
        assert type(c) is grpcclient.InferenceServerClient
        with inferprof.request():
            c.infer("m", [tensor("grpc", X)])
        assert "traceparent" not in recorder.last("grpc")
        assert len(cap.stages(semconv.STAGE_NETWORK)) == 2
    finally:
        c.close()


def test_an_explicit_traceparent_header_is_replaced_by_the_calls_own(cap, recorder):
    import tritonclient.http as httpclient

    c = inferprof.triton.instrument(httpclient.InferenceServerClient(recorder.urls["http"]))
    try:
        with inferprof.request():
            c.infer("m", [tensor("http", X)], headers={"TraceParent": UPSTREAM["traceparent"]})
    finally:
        c.close()
    (stage,) = cap.stages(semconv.STAGE_NETWORK)
    assert recorder.last("http")["traceparent"] == traceparent(
        stage.context.trace_id, stage.context.span_id
    )


def test_propagate_false_records_the_stage_and_sends_no_trace_context(cap, recorder):
    import tritonclient.http as httpclient

    c = inferprof.triton.instrument(
        httpclient.InferenceServerClient(recorder.urls["http"]), propagate=False
    )
    try:
        with inferprof.request():
            c.infer("m", [tensor("http", X)])
            c.async_infer("m", [tensor("http", X)]).get_result()
    finally:
        c.close()
    assert c.plugin() is None
    assert len(cap.stages(semconv.STAGE_NETWORK)) == 2
    assert not any("traceparent" in h for _, h in recorder.seen[-2:])


@pytest.mark.parametrize("flavour", ["http", "grpc"])
def test_mode_off_records_nothing_and_sends_nothing(flavour, recorder):
    inferprof.configure(mode="off")
    c = inferprof.triton.instrument(client(flavour, recorder.urls))
    try:
        with inferprof.request() as req:
            result = c.infer("m", [tensor(flavour, X)])
    finally:
        c.close()
    assert req is None
    assert result.as_numpy("y").tolist() == [[1.0]]
    assert "traceparent" not in recorder.last(flavour)


@pytest.mark.parametrize("propagate", [True, "sampled"])
@pytest.mark.parametrize("sampled", [True, False])
def test_what_a_sampled_out_request_sends_depends_on_propagate(propagate, sampled, recorder):
    import tritonclient.grpc as grpcclient
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    exporter = InMemorySpanExporter()
    # in full mode the provider's sampler decides whether a request's trace is sampled
    provider = TracerProvider(sampler=ALWAYS_ON if sampled else ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    inferprof.configure(tracer_provider=provider, set_global=False)
    c = grpcclient.InferenceServerClient(recorder.urls["grpc"])
    inferprof.triton.instrument(c, propagate=propagate)
    try:
        with inferprof.request() as req:
            c.infer("m", [tensor("grpc", X)])
    finally:
        c.close()
        inferprof.shutdown()
        provider.shutdown()
    assert len(exporter.get_finished_spans()) == (2 if sampled else 0)
    sent = recorder.last("grpc").get("traceparent")
    if sampled or propagate is True:
        # sampled or not, the request's trace id; the flag says which
        assert sent.startswith(f"00-{hexid(req.trace_id, 32)}-")
        assert sent.endswith("-01" if sampled else "-00")
    else:
        assert sent is None  # "sampled": nothing for a trace that is not


def test_past_the_stage_cap_the_call_is_counted_and_parents_on_the_request(cap, recorder):
    import tritonclient.grpc as grpcclient

    c = inferprof.triton.instrument(grpcclient.InferenceServerClient(recorder.urls["grpc"]))
    try:
        with inferprof.request() as req:
            for _ in range(MAX_STAGES):
                with inferprof.stage("tokenize"):
                    pass
            c.infer("m", [tensor("grpc", X)])
    finally:
        c.close()
    (request,) = cap.requests()
    assert request.attributes[semconv.ATTR_STAGES_DROPPED] == 1
    assert cap.stages(semconv.STAGE_NETWORK) == []
    assert recorder.last("grpc")["traceparent"] == traceparent(req.trace_id, req.span_id)


@pytest.mark.parametrize(
    "encoding", [semconv.BATCH_ENCODING_LINKS, semconv.BATCH_ENCODING_CHILDREN]
)
async def test_in_a_batch_the_call_is_a_batch_stage(encoding, recorder):
    import tritonclient.grpc as grpcclient

    with captured(batch_encoding=encoding) as cap:
        c = inferprof.triton.instrument(grpcclient.InferenceServerClient(recorder.urls["grpc"]))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def member():
            async with inferprof.request():
                done = loop.create_future()
                await queue.put((inferprof.enqueue(), done))
                await done

        members = [asyncio.create_task(member()) for _ in range(2)]
        entries = [await queue.get() for _ in members]
        try:
            with inferprof.batch([h for h, _ in entries], model="m"):
                c.infer("m", [tensor("grpc", X)])  # one Triton call for the whole batch
        finally:
            c.close()
        for _, done in entries:
            done.set_result(None)
        await asyncio.gather(*members)
        stages = cap.stages(semconv.STAGE_NETWORK)
    sent = recorder.last("grpc")
    if encoding == semconv.BATCH_ENCODING_LINKS:
        # one span in the batch's own trace, linked to both members: Triton's spans join it
        (stage,) = stages
        assert len(stage.links) == 2
        assert sent["traceparent"] == traceparent(stage.context.trace_id, stage.context.span_id)
    else:
        # a copy under each member, each with an id of its own: no one parent to send
        assert len(stages) == 2
        assert {s.context.trace_id for s in stages} == {r.context.trace_id for r in cap.requests()}
        assert "traceparent" not in sent
    assert all(s.attributes[semconv.ATTR_BATCH_SIZE] == 2 for s in stages)


def test_the_global_propagator_is_used(cap, recorder):
    # An application that configured another propagator (B3...) gets its format.
    import tritonclient.http as httpclient
    from opentelemetry import trace
    from opentelemetry.propagators.textmap import DefaultGetter, DefaultSetter, TextMapPropagator

    class Custom(TextMapPropagator):
        fields = frozenset({"x-trace"})

        def inject(self, carrier, context=None, setter=DefaultSetter()):  # noqa: B008
            sc = trace.get_current_span(context).get_span_context()
            setter.set(carrier, "x-trace", f"{sc.trace_id:032x}:{sc.span_id:016x}")

        def extract(self, carrier, context=None, getter=DefaultGetter()):  # noqa: B008
            return context

    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(Custom())
    c = inferprof.triton.instrument(httpclient.InferenceServerClient(recorder.urls["http"]))
    try:
        with inferprof.request():
            c.infer("m", [tensor("http", X)])
    finally:
        c.close()
        propagate.set_global_textmap(previous)
    (stage,) = cap.stages(semconv.STAGE_NETWORK)
    headers = recorder.last("http")
    assert headers["x-trace"] == f"{stage.context.trace_id:032x}:{stage.context.span_id:016x}"
    assert "traceparent" not in headers


async def test_under_opentelemetry_instrumentation_fastapis_span_its_trace_is_continued(
    cap, recorder
):
    # The request span is then another instrumentation's SERVER span (inferprof enriches it):
    # the call's context is still the network stage's, in that span's trace, with its
    # tracestate.
    import httpx
    import tritonclient.grpc.aio as grpcclient
    from fastapi import FastAPI
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.trace import SpanKind

    import inferprof.fastapi

    app = FastAPI()
    triton = inferprof.triton.instrument(grpcclient.InferenceServerClient(recorder.urls["grpc"]))

    @app.post("/embed")
    async def embed():
        await triton.infer("m", [tensor("grpc_aio", X)])
        return {}

    inferprof.fastapi.instrument(app, model_name="front")
    FastAPIInstrumentor.instrument_app(app, tracer_provider=cap.provider)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.post("/embed", headers=UPSTREAM)).status_code == 200
    finally:
        FastAPIInstrumentor.uninstrument_app(app)
        await triton.close()
    (server,) = [s for s in cap.spans() if s.kind is SpanKind.SERVER]
    assert server.instrumentation_scope.name != semconv.INSTRUMENTATION_SCOPE
    (stage,) = cap.stages(semconv.STAGE_NETWORK)
    assert stage.parent.span_id == server.context.span_id
    sent = recorder.last("grpc")
    assert sent["traceparent"] == traceparent(UPSTREAM_TRACE, stage.context.span_id)
    assert sent["tracestate"] == "vendor=opaque"
