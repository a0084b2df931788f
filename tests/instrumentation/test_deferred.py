"""Kept traces queued as one entry: same spans, same bytes, nothing held, all counted.

When ``configure()`` builds the provider, a kept request is queued as one entry: an
EncodedTrace (OTLP bytes made when the request ended) for inferprof's own exporter, else a
DeferredTrace turned into spans on the processor's thread.
"""

import asyncio
import gc
import time
import weakref

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import inferprof
from inferprof import _config, semconv
from inferprof.instrumentation.accounting import (
    CountingSpanExporter,
    DeferredTrace,
    EncodedSpans,
    EncodedTrace,
    Stats,
)
from inferprof.instrumentation.otlp_encode import (
    encode_request,
    encode_trace_spans,
    encode_traces,
    wrap_trace_spans,
)
from inferprof.instrumentation.records import RequestRecord, StageRecord, span_id_of
from tests.instrumentation.helpers import captured

_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class _Queue:
    """Stands in for the batch processor: keeps what the runtime queues."""

    def __init__(self) -> None:
        self.items = []

    def on_end(self, item) -> None:
        self.items.append(item)


class Boom(Exception):
    pass


def _configure(**options):
    exporter = InMemorySpanExporter()
    inferprof.configure(span_exporter=exporter, set_global=False, metric_readers=[], **options)
    return exporter


async def _traffic():
    """Requests touching every spec shape: errors, nesting, a remote parent with
    tracestate, both batch encodings, several attribute types."""
    with inferprof.request(
        model="m", carrier={"traceparent": _PARENT, "tracestate": "vendor=1"}, flag=True
    ):
        with inferprof.stage("tokenize", chars=12, ratio=0.5, tags=["a", "b"]):
            with inferprof.stage("my_substage"):
                pass
    try:
        with inferprof.request(model="m"):
            with inferprof.stage("compute"):
                raise Boom("device lost")
    except Boom:
        pass
    for encoding in (semconv.BATCH_ENCODING_CHILDREN, semconv.BATCH_ENCODING_LINKS):
        handles = []
        for _ in range(3):
            with inferprof.request(model="m"):
                handles.append(inferprof.enqueue(depth=len(handles)))
        # requests have ended before their batch: finished batch stages only
        with inferprof.batch(handles, max_size=8, model="m", batch_encoding=encoding) as b:
            with b.stage("batch_assembly"):
                b.set_tokens(effective=10, padded=12)
            with b.stage("compute"):
                pass
    for encoding in (semconv.BATCH_ENCODING_CHILDREN, semconv.BATCH_ENCODING_LINKS):
        batcher = inferprof.DynamicBatcher(
            lambda xs: [x * 2 for x in xs],
            max_batch_size=4,
            max_delay_ms=1,
            batch_encoding=encoding,
        )

        async def one(i, batcher=batcher):
            with inferprof.request(model="m"):
                return await batcher.submit(i)

        assert await asyncio.gather(*(one(i) for i in range(6))) == [0, 2, 4, 6, 8, 10]
        await batcher.stop()


async def test_direct_encoding_equals_the_sdk_encoding_of_the_same_spans():
    _configure(mode="full")
    rt = _config.configured_runtime()
    queue = rt._deferred = _Queue()
    await _traffic()
    assert len(queue.items) >= 12
    shapes = set()
    for item in queue.items:
        trace = item.build(*item.args)
        direct = ExportTraceServiceRequest.FromString(encode_traces([(rt, trace)]))
        spans = rt._spans(*trace)
        assert len(spans) == item.n  # the count taken on the request's thread is exact
        via_sdk = ExportTraceServiceRequest.FromString(encode_request(spans))
        assert direct == via_sdk
        for span in spans:
            shapes.add(
                (
                    span.kind,
                    span.status.status_code,
                    bool(span.links),
                    bool(span.events),
                    span.parent is not None and span.parent.is_remote,
                )
            )
    assert (SpanKind.INTERNAL, StatusCode.ERROR, False, True, False) in shapes
    assert (SpanKind.INTERNAL, StatusCode.UNSET, True, False, False) in shapes
    assert any(remote for *_, remote in shapes)


async def test_the_exported_trace_is_the_same_as_built_on_the_request_thread():
    exporter = _configure(mode="full")
    await _traffic()
    inferprof.shutdown()
    deferred = sorted(
        (s.name, s.kind.value, s.status.status_code.value, len(s.links), len(s.events))
        for s in exporter.get_finished_spans()
    )
    with captured(mode="full") as cap:
        await _traffic()
        synchronous = sorted(
            (s.name, s.kind.value, s.status.status_code.value, len(s.links), len(s.events))
            for s in cap.spans()
        )
    assert deferred == synchronous
    assert len(deferred) > 40


def test_a_queued_trace_holds_no_exception_or_traceback():
    _configure(mode="full")
    rt = _config.configured_runtime()
    queue = rt._deferred = _Queue()
    payload = bytearray(1 << 20)  # stands for a model input in the failing frame

    def fail():
        data = payload  # noqa: F841 - kept alive by the traceback's frame, if anything holds it
        with inferprof.request(model="m"):
            with inferprof.stage("compute"):
                raise Boom("out of memory")

    try:
        fail()
    except Boom as exc:
        ref = weakref.ref(exc)
    gc.collect()
    assert ref() is None
    assert len(queue.items) == 1
    (trace_id, specs, _) = queue.items[0].build(*queue.items[0].args)
    spans = rt._spans(trace_id, specs)
    compute = next(s for s in spans if s.attributes.get(semconv.ATTR_STAGE) == "compute")
    assert compute.status.status_code is StatusCode.ERROR
    event = compute.events[0]
    assert event.attributes["exception.message"] == "out of memory"
    assert "in fail" in event.attributes["exception.stacktrace"]


def test_spans_emitted_are_the_spans_exported():
    exporter = _configure(mode="full")
    for _ in range(50):
        with inferprof.request(model="m"):
            with inferprof.stage("tokenize"):
                pass
            with inferprof.stage("postprocess"):
                pass
    stats = inferprof.instrumentation.stats
    emitted = stats().spans_emitted
    inferprof.shutdown()
    assert emitted == 150
    assert len(exporter.get_finished_spans()) == 150


class _Failing:
    def __init__(self) -> None:
        self.n = 0

    def build(self):
        raise RuntimeError("broken record")


class _Recorder(SpanExporter):
    accepts_encoded = True

    def __init__(self) -> None:
        self.calls = []

    def export(self, data):
        self.calls.append(data)
        return SpanExportResult.SUCCESS


def test_a_trace_that_cannot_be_built_is_counted_and_the_rest_goes_out():
    _configure(mode="full")
    rt = _config.configured_runtime()
    queue = rt._deferred = _Queue()
    for _ in range(4):
        with inferprof.request(model="m"):
            with inferprof.stage("tokenize"):
                pass
    broken = DeferredTrace(rt, _Failing().build, (), 7)
    items = [queue.items[0], broken, *queue.items[1:]]
    for direct in (False, True):
        stats = Stats()
        inner = _Recorder() if direct else InMemorySpanExporter()
        result = CountingSpanExporter(inner, stats, max_batch=3).export(items)
        assert result is SpanExportResult.SUCCESS
        assert stats.export_failed == 7
        assert stats.exported == 8
        if direct:
            # chunks of at least max_batch spans (whole traces), as encoded messages
            assert [type(c) for c in inner.calls] == [EncodedSpans] * 2
            n_spans = sum(
                len(ss.spans)
                for c in inner.calls
                for rs in ExportTraceServiceRequest.FromString(c.payload).resource_spans
                for ss in rs.scope_spans
            )
            assert n_spans == 8
        else:
            assert len(inner.get_finished_spans()) == 8


def _exported_within(exporter, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if exporter.get_finished_spans():
            return True
        time.sleep(0.05)
    return False


def test_kept_traces_leave_within_a_second_unless_the_env_sets_the_delay(monkeypatch):
    # Small, frequent exports: the export thread shares the service's CPU.
    monkeypatch.delenv("OTEL_BSP_SCHEDULE_DELAY", raising=False)
    exporter = _configure(mode="full")
    with inferprof.request(model="m"):
        pass
    assert _exported_within(exporter, 3.0)  # the SDK's own default would take 5 s
    inferprof.shutdown()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "30000")
    exporter = _configure(mode="full")
    with inferprof.request(model="m"):
        pass
    assert not _exported_within(exporter, 1.5)
    inferprof.shutdown()  # shutdown still flushes what waits
    assert len(exporter.get_finished_spans()) == 1


def test_a_bad_schedule_delay_in_the_env_is_logged_and_the_one_second_default_kept(
    monkeypatch, caplog
):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "abc")
    with caplog.at_level("WARNING"):
        exporter = _configure(mode="full")
    assert "ignoring OTEL_BSP_SCHEDULE_DELAY='abc'" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no SDK traceback
    with inferprof.request(model="m"):
        pass
    assert _exported_within(exporter, 3.0)  # 1 s, not the SDK's 5 s fallback
    inferprof.shutdown()
    # 0: the SDK refuses it, and with it every OTEL_BSP_* setting; only it is ignored here
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "0")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4096")
    caplog.clear()
    with caplog.at_level("WARNING"):
        _configure(mode="full")
    assert "ignoring OTEL_BSP_SCHEDULE_DELAY='0'" in caplog.text
    assert "ignoring OTEL_BSP_* settings" not in caplog.text
    processor = _config.configured_runtime().owned_processor
    assert processor.max_queue_size == 4096  # the queue size was kept
    inferprof.shutdown()


def test_what_the_application_does_after_the_request_ended_is_not_in_its_trace():
    _configure(mode="full")
    rt = _config.configured_runtime()
    queue = rt._deferred = _Queue()
    with inferprof.request(model="m") as handle:
        with inferprof.stage("tokenize"):
            pass
    handle.set_attribute("late", True)  # the export thread has not built the spans yet
    (item,) = queue.items
    spans = rt._spans(*item.build(*item.args))
    assert len(spans) == item.n == 2
    (request,) = [s for s in spans if semconv.ATTR_STAGE not in s.attributes]
    assert request.attributes[semconv.ATTR_MODEL_NAME] == "m"
    assert "late" not in request.attributes


def _shape(span) -> tuple:
    return (span.name, span.kind, span.status.code, len(span.links), len(span.events))


def _sdk_shape(span) -> tuple:
    # OTLP kinds and status codes as the exporter writes them (kind + 1; code value).
    return (span.name, span.kind.value + 1, span.status.status_code.value, len(span.links),
            len(span.events))


async def test_for_inferprofs_exporter_a_kept_trace_is_queued_as_bytes_holding_no_records():
    inferprof.configure(span_exporter=_Recorder(), set_global=False, metric_readers=[])
    rt = _config.configured_runtime()
    assert rt._encode
    queue = rt._deferred = _Queue()

    def records() -> int:
        gc.collect()
        return sum(type(o) in (RequestRecord, StageRecord) for o in gc.get_objects())

    before = records()
    await _traffic()
    assert queue.items and all(type(item) is EncodedTrace for item in queue.items)
    assert all(type(item.payload) is bytes for item in queue.items)
    # The queue keeps the bytes alive, not the requests' records: nothing of theirs is
    # left for the garbage collector to walk while a trace waits for export.
    assert records() == before
    message = ExportTraceServiceRequest.FromString(
        wrap_trace_spans([(rt, item.payload) for item in queue.items])
    )
    encoded = [
        span for rs in message.resource_spans for ss in rs.scope_spans for span in ss.spans
    ]
    assert len(encoded) == sum(item.n for item in queue.items)
    with captured(mode="full") as cap:
        await _traffic()
        synchronous = sorted(_sdk_shape(s) for s in cap.spans())
    assert sorted(_shape(s) for s in encoded) == synchronous
    # every span of a trace lies under the request span, with the trace's id
    for item in queue.items:
        spans = ExportTraceServiceRequest.FromString(wrap_trace_spans([(rt, item.payload)]))
        (scope,) = [ss for rs in spans.resource_spans for ss in rs.scope_spans]
        assert len({span.trace_id for span in scope.spans}) == 1
        assert scope.scope.name == semconv.INSTRUMENTATION_SCOPE


def test_encoded_entries_reach_the_exporter_whole_and_counted():
    recorder = _Recorder()
    inferprof.configure(span_exporter=recorder, set_global=False, metric_readers=[])
    for _ in range(40):
        with inferprof.request(model="m"):
            with inferprof.stage("tokenize"):
                pass
    _config.configured_runtime().tracer_provider.force_flush()
    snap = inferprof.instrumentation.stats()
    inferprof.shutdown()
    assert recorder.calls and all(type(c) is EncodedSpans for c in recorder.calls)
    spans = [
        span
        for c in recorder.calls
        for rs in ExportTraceServiceRequest.FromString(c.payload).resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    assert len(spans) == 80 == sum(len(c) for c in recorder.calls)
    assert snap.spans_emitted == snap.spans_exported == 80


def test_encoding_at_request_end_equals_encoding_on_the_export_thread():
    _configure(mode="full")
    rt = _config.configured_runtime()
    queue = rt._deferred = _Queue()
    with inferprof.request(model="m", carrier={"traceparent": _PARENT, "tracestate": "v=1"}):
        with inferprof.stage("tokenize", chars=3):
            pass
    (item,) = queue.items
    trace = item.build(*item.args)
    assert wrap_trace_spans([(rt, encode_trace_spans(*trace))]) == encode_traces([(rt, trace)])


def test_an_encoded_trace_given_to_an_exporter_without_bytes_is_counted_not_sent():
    _configure(mode="full")
    rt = _config.configured_runtime()
    queue = rt._deferred = _Queue()
    with inferprof.request(model="m"):
        pass
    stray = EncodedTrace(rt, b"", 3)
    stats = Stats()
    inner = InMemorySpanExporter()
    result = CountingSpanExporter(inner, stats).export([stray, *queue.items])
    assert result is SpanExportResult.SUCCESS
    assert stats.export_failed == 3 and stats.exported == 1
    assert len(inner.get_finished_spans()) == 1


async def test_stages_encoded_from_their_records_equal_the_spec_path():
    """encode_request_trace writes a request's own stages without spec tuples; the bytes
    must be those encode_trace_spans gives for Runtime._request_trace's specs, built at
    the same moment (for every shape: nesting, attributes, errors, an open stage, a remote
    parent with tracestate, batch stages copied under the request)."""
    import random

    inferprof.configure(span_exporter=_Recorder(), set_global=False, metric_readers=[])
    rt = _config.configured_runtime()
    assert rt._encode
    queue = rt._deferred = _Queue()
    encode_from_records = rt._defer_encoded_request
    pairs = []

    def both(rec, weight, batches):
        for st in rec.stages:  # drawn lazily; before the seed, so both paths see them drawn
            span_id_of(st)
        random.seed(7)  # the batch stages' copies draw their ids: the same ones each time
        expected = encode_trace_spans(*rt._request_trace(rec, weight, batches))
        random.seed(7)
        encode_from_records(rec, weight, batches)
        pairs.append((expected, queue.items[-1].payload))

    rt._defer_encoded_request = both
    with inferprof.request(model="m", carrier={"traceparent": _PARENT, "tracestate": "v=1"}):
        with inferprof.stage("tokenize", chars=12, ratio=0.5, tags=["a", "b"]):
            with inferprof.stage("my_substage", **{semconv.ATTR_STAGE: "override"}):
                pass
        inferprof.stage("postprocess").__enter__()  # open when the request ends
    try:
        with inferprof.request(model="m"):
            with inferprof.stage("compute"):
                raise Boom("device lost")
    except Boom:
        pass
    await _traffic()
    await _members_ending_after_their_batch()
    assert len(pairs) >= 11  # (the queue also holds the linked batches' own traces)
    for expected, payload in pairs:
        assert payload == expected


async def _members_ending_after_their_batch(n: int = 3) -> list:
    """``n`` requests batched together that end after the batch has closed, whose batch
    has a nested stage and a failing one; returns the batch's record."""
    handles, done, records = [], asyncio.Event(), []

    async def member():
        with inferprof.request(model="m"):
            handles.append(inferprof.enqueue(depth=len(handles)))
            await done.wait()

    tasks = [asyncio.create_task(member()) for _ in range(n)]
    while len(handles) < n:
        await asyncio.sleep(0)
    with inferprof.batch(handles, max_size=8, model="m") as b:
        with b.stage("batch_assembly", rows=n):
            b.set_tokens(effective=10, padded=12)
            with inferprof.stage("h2d"):  # nested: inside the batch's current stage
                pass
        try:
            with b.stage("compute"):
                raise Boom("kernel failed")
        except Boom:
            pass
    records.append(b.record)
    done.set()
    await asyncio.gather(*tasks)
    return records[0]


async def test_a_closed_batch_encodes_its_stages_once_for_all_kept_members():
    """Members ending after their batch closed share its stages' encoded bodies: each
    member's copies differ only in their ids, and the spans parse to the batch's stages
    (nesting, the error, the batch's attributes) under each member's own request span."""
    inferprof.configure(span_exporter=_Recorder(), set_global=False, metric_readers=[])
    rt = _config.configured_runtime()
    assert rt._encode
    queue = rt._deferred = _Queue()
    record = await _members_ending_after_their_batch(3)
    assert record.bodies is not None and len(record.bodies) == 3
    assert len(queue.items) == 3
    ids = set()
    for item in queue.items:
        spans = [
            span
            for rs in ExportTraceServiceRequest.FromString(wrap_trace_spans([(rt, item.payload)]))
            .resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]
        assert item.n == len(spans) == 5  # request, queue, three batch stages
        by_name = {span.name: span for span in spans}
        request = next(s for s in spans if not s.parent_span_id)
        assembly = by_name["inferprof.batch_assembly"]
        assert by_name["inferprof.h2d"].parent_span_id == assembly.span_id
        assert assembly.parent_span_id == request.span_id
        compute = by_name["inferprof.compute"]
        assert compute.status.code == compute.status.STATUS_CODE_ERROR
        assert "kernel failed" in compute.status.message
        attrs = {kv.key: kv.value for kv in assembly.attributes}
        assert attrs[semconv.ATTR_BATCH_ID].string_value == record.batch_id
        assert attrs[semconv.ATTR_TOKENS_PADDED].int_value == 12
        assert attrs["rows"].int_value == 3
        ids.update(s.span_id for s in spans if s.name != "inferprof.queue")
    assert len(ids) == 3 * 4  # every copy has an id of its own
