import asyncio

import pytest
from opentelemetry import propagate
from opentelemetry import trace as trace_api
from opentelemetry.trace import SpanKind, StatusCode

import inferprof
from inferprof import semconv
from tests.instrumentation.helpers import Captured, children_of

STAGES = [
    "receive",
    "tokenize",
    "queue",
    "batch_assembly",
    "h2d",
    "compute",
    "d2h",
    "postprocess",
    "serialize",
]


def test_every_stage_is_a_child_of_the_request_span_in_its_trace(cap):
    with inferprof.request(model="m1") as req:
        for name in STAGES:
            with inferprof.stage(name, custom=3):
                pass
    spans = cap.spans()
    (request,) = cap.requests()
    assert request.name == semconv.REQUEST_SPAN_NAME
    assert request.attributes[semconv.ATTR_REQUEST] is True
    assert request.attributes[semconv.ATTR_MODEL_NAME] == "m1"
    assert request.parent is None
    assert request.context.trace_id == req.trace_id and request.context.span_id == req.span_id
    stages = cap.stages()
    assert [s.attributes[semconv.ATTR_STAGE] for s in stages] == STAGES
    for s in stages:
        assert s.name == semconv.span_name(s.attributes[semconv.ATTR_STAGE])
        assert s.context.trace_id == request.context.trace_id
        assert s.parent.span_id == request.context.span_id
        assert s.attributes["custom"] == 3
        assert request.start_time <= s.start_time <= s.end_time <= request.end_time
        assert s.resource is cap.provider.resource
        assert s.instrumentation_scope.name == semconv.INSTRUMENTATION_SCOPE
    assert len({s.context.span_id for s in spans}) == len(spans)


def test_nested_stage_is_a_child_of_the_enclosing_stage(cap):
    with inferprof.request():
        with inferprof.stage("compute"):
            with inferprof.stage("kv_cache_swap"):
                pass
    (outer,) = cap.stages("compute")
    (inner,) = cap.stages("kv_cache_swap")
    assert inner.parent.span_id == outer.context.span_id


async def test_async_with_and_decorators_sync_and_async(cap):
    @inferprof.stage("postprocess")
    def post(x):
        return x + 1

    @inferprof.stage("tokenize")
    async def tok(x):
        await asyncio.sleep(0)
        return x * 2

    async with inferprof.request() as req:
        async with inferprof.stage("compute") as st:
            st.set_attribute(semconv.ATTR_BYTES, 12)
        assert await tok(2) == 4
        assert post(1) == 2
    assert post.__name__ == "post"
    names = sorted(s.attributes[semconv.ATTR_STAGE] for s in cap.stages())
    assert names == ["compute", "postprocess", "tokenize"]
    assert cap.stages("compute")[0].attributes[semconv.ATTR_BYTES] == 12
    assert all(s.parent.span_id == req.span_id for s in cap.stages())


def test_stage_exception_is_recorded_and_reraised_unchanged(cap):
    err = KeyError("boom")
    with pytest.raises(KeyError) as info:
        with inferprof.request():
            with inferprof.stage("tokenize"):
                raise err
    assert info.value is err
    (st,) = cap.stages("tokenize")
    assert st.status.status_code is StatusCode.ERROR
    assert "KeyError" in st.status.description
    (event,) = st.events
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "KeyError"
    assert "boom" in event.attributes["exception.message"]
    (request,) = cap.requests()
    assert request.status.status_code is StatusCode.ERROR


async def test_cancelled_request_is_marked_not_failed(cap):
    async def handler():
        async with inferprof.request():
            with inferprof.stage("compute"):
                await asyncio.sleep(10)

    task = asyncio.create_task(handler())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (request,) = cap.requests()
    assert request.attributes[semconv.ATTR_CANCELLED] is True
    assert request.status.status_code is StatusCode.UNSET
    assert cap.stages("compute")[0].attributes[semconv.ATTR_CANCELLED] is True


@pytest.mark.parametrize("bad", ["Tokenize", "to-ken", "", "unattributed"])
def test_invalid_stage_names_raise_value_error(bad):
    with pytest.raises(ValueError):
        inferprof.stage(bad)


def test_bad_request_arguments_raise_value_error():
    with pytest.raises(ValueError):
        inferprof.request(model=3)
    with pytest.raises(ValueError):
        inferprof.request(kind="server")


def test_unconfigured_everything_is_a_silent_no_op():
    inferprof.shutdown()
    with inferprof.request(model="m") as req:
        with inferprof.stage("compute") as st:
            st.set_attribute("x", 1)
        assert inferprof.current_request() is None
    assert req is None


def test_stage_outside_a_request_is_a_standalone_span_under_the_current_span(cap):
    tracer = cap.provider.get_tracer("app")
    with tracer.start_as_current_span("app-work") as outer:
        with inferprof.stage("tokenize"):
            pass
    (st,) = cap.stages("tokenize")
    assert st.parent.span_id == outer.get_span_context().span_id
    assert st.attributes[semconv.ATTR_STAGE] == "tokenize"


def test_current_request_handle(cap):
    assert inferprof.current_request() is None
    with inferprof.request(model="m") as req:
        handle = inferprof.current_request()
        assert handle is req
        assert handle.model == "m"
        handle.set_attribute(semconv.ATTR_MODEL_VERSION, "v2")
        with inferprof.request(model="ignored", extra=1) as nested:
            assert nested is req  # nested request() joins the outer request
    assert inferprof.current_request() is None
    (request,) = cap.requests()
    assert request.attributes[semconv.ATTR_MODEL_VERSION] == "v2"
    assert request.attributes["extra"] == 1


def test_request_extracts_w3c_traceparent_from_a_carrier(cap):
    carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with inferprof.request(carrier=carrier, kind=SpanKind.CONSUMER):
        with inferprof.stage("compute"):
            pass
    (request,) = cap.requests()
    assert request.kind is SpanKind.CONSUMER
    assert request.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert request.parent.span_id == 0xB7AD6B7169203331
    assert request.parent.is_remote
    assert cap.stages("compute")[0].context.trace_id == request.context.trace_id


def test_traceparent_injected_downstream_names_the_request_span(cap):
    with inferprof.request() as req:
        headers = {}
        propagate.inject(headers)
        tracer = cap.provider.get_tracer("client")
        with tracer.start_as_current_span("outgoing", kind=SpanKind.CLIENT):
            pass
    assert headers["traceparent"] == f"00-{req.trace_id:032x}-{req.span_id:016x}-01"
    (client,) = cap.by_name("outgoing")
    assert client.parent.span_id == req.span_id


async def test_concurrent_requests_keep_their_stages_apart(cap):
    async def one(i):
        async with inferprof.request(n=i):
            with inferprof.stage("tokenize", n=i):
                await asyncio.sleep(0.001 * (i % 3))
            with inferprof.stage("postprocess", n=i):
                await asyncio.sleep(0)

    await asyncio.gather(*(one(i) for i in range(20)))
    requests = cap.requests()
    assert len(requests) == 20
    spans = cap.spans()
    for r in requests:
        kids = children_of(spans, r)
        assert sorted(k.attributes[semconv.ATTR_STAGE] for k in kids) == ["postprocess", "tokenize"]
        assert all(k.attributes["n"] == r.attributes["n"] for k in kids)
        assert all(k.context.trace_id == r.context.trace_id for k in kids)


def test_otel_sampler_is_honoured_in_full_mode_with_weights():
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    cap = Captured()
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    cap.provider = TracerProvider(sampler=TraceIdRatioBased(0.25))
    cap.provider.add_span_processor(SimpleSpanProcessor(cap.exporter))
    inferprof.configure(tracer_provider=cap.provider, meter_provider=cap.meter_provider)
    n = 2000
    for _ in range(n):
        with inferprof.request():
            with inferprof.stage("compute"):
                pass
    requests = cap.requests()
    assert 0.18 * n < len(requests) < 0.32 * n
    assert all(r.attributes[semconv.ATTR_SAMPLE_WEIGHT] == 4.0 for r in requests)
    assert len(cap.stages("compute")) == len(requests)


def test_span_context_flags_follow_the_head_decision(cap):
    with inferprof.request() as req:
        assert req.span_context.trace_flags.sampled
        current = trace_api.get_current_span().get_span_context()
        assert current.span_id == req.span_id


def test_decorator_defined_before_configure_records_after_configure():
    inferprof.shutdown()

    @inferprof.stage("postprocess")
    def post(x):
        return x

    with inferprof.stage("tokenize") as noop:  # unconfigured: a shared no-op
        noop.set_attribute("k", "v")
    from tests.instrumentation.helpers import captured

    with captured() as cap:
        with inferprof.request():
            assert post(5) == 5
        assert len(cap.stages("postprocess")) == 1


def test_stages_per_request_are_capped_and_counted(cap):
    from inferprof.instrumentation.stage import MAX_STAGES

    with inferprof.request():
        for _ in range(MAX_STAGES + 10):
            with inferprof.stage("decode"):
                pass
    (request,) = cap.requests()
    assert len(cap.stages("decode")) == MAX_STAGES
    assert request.attributes[semconv.ATTR_STAGES_DROPPED] == 10


def test_tracestate_is_propagated_and_ot_threshold_dropped_in_production(cap):
    carrier = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=abc,ot=th:8",
    }
    with inferprof.request(carrier=carrier) as req:
        headers = {}
        propagate.inject(headers)
        with inferprof.stage("compute"):
            pass
    assert "vendor=abc" in headers["tracestate"] and "ot=th:8" in headers["tracestate"]
    (request,) = cap.requests()
    assert request.context.trace_state.get("vendor") == "abc"
    assert cap.stages("compute")[0].context.trace_state.get("ot") == "th:8"

    inferprof.configure(tracer_provider=cap.provider, mode="production", sample_rate=1.0)
    with inferprof.request(carrier=carrier) as req:
        headers = {}
        propagate.inject(headers)
    assert headers["tracestate"] == "vendor=abc"
    assert req.span_context.trace_state.get("ot") is None


def test_a_stage_entered_twice_records_two_stages(cap):
    with inferprof.request():
        s = inferprof.stage("tokenize", part="a")
        with s:
            s.set_attribute("n", 1)
        with s:
            s.set_attribute("n", 2)
    spans = sorted(cap.stages("tokenize"), key=lambda sp: sp.start_time)
    assert [sp.attributes["n"] for sp in spans] == [1, 2]
    assert all(sp.attributes["part"] == "a" for sp in spans)
    assert spans[0].context.span_id != spans[1].context.span_id
    assert spans[0].end_time <= spans[1].start_time


def test_a_finished_request_leaves_no_reference_cycle(cap):
    import gc

    from inferprof.batching.hooks import _NOTHING
    from inferprof.instrumentation.records import RequestRecord, StageRecord

    def alive():  # (the shared handle of requests that record nothing lives forever)
        return [
            o
            for o in gc.get_objects()
            if isinstance(o, (RequestRecord, StageRecord)) and o is not _NOTHING
        ]

    gc.collect()
    gc.disable()
    try:
        with inferprof.request() as rec:
            with inferprof.stage("tokenize"):
                with inferprof.stage("postprocess"):
                    pass
        assert len(rec.stages) == 2
        del rec
        # freed by reference counting alone, not left for the cycle collector
        assert alive() == []
    finally:
        gc.enable()
