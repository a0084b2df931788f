"""The span reader on serialized exports (``wire.SpanReader``) gives what reading the
decoded messages gives (``wire.records_of``), for any span protobuf accepts: canonical
layouts (its fast path), any other layout (parsed), repeated and unknown fields."""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1 import trace_pb2

from inferprof import semconv as sc
from inferprof.collector.wire import EMPTY, WANTED, SpanReader, records_of
from tests.collector.synth import TraceBuilder, bulk_export

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def expected(request: ExportTraceServiceRequest) -> list[list[tuple]]:
    """``records_of`` per scope, with what it leaves to the message read off it."""
    out = []
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            rows = []
            for rec, span in zip(records_of(ss.spans), ss.spans, strict=True):
                rec = list(rec)
                rec[6:9] = span.flags, span.status.code, span.trace_state
                rows.append(rec)
            out.append(rows)
    return out


def scanned(payload: bytes, reader: SpanReader | None = None) -> list[list[list]] | None:
    request = ExportTraceServiceRequest.FromString(payload)
    got = (reader or SpanReader()).scan(request, payload)
    if got is None:
        return None
    out = []
    for rows in got:
        fixed = []
        for rec in rows:
            rec = list(rec)
            if rec[9] is None:  # records_of counts links on stage spans only
                rec[11] = 0
            fixed.append(rec)
        out.append(fixed)
    return out


def assert_same(payload: bytes, reader: SpanReader | None = None) -> None:
    got = scanned(payload, reader)
    want = expected(ExportTraceServiceRequest.FromString(payload))
    assert got is not None
    assert got == want


def export_of(spans: list[trace_pb2.Span], scopes: int = 1) -> bytes:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    for i in range(scopes):
        rs.scope_spans.add().spans.extend(spans[i::scopes])
    return request.SerializeToString()


# --- spans of every shape -------------------------------------------------------------

keys = st.sampled_from([*sorted(WANTED), sc.ATTR_STAGE, "http.route", "other"])
scalars = st.one_of(
    st.text(max_size=12).map(lambda s: AnyValue(string_value=s)),
    st.integers(-(2**63), 2**63 - 1).map(lambda i: AnyValue(int_value=i)),
    st.floats(allow_nan=False).map(lambda f: AnyValue(double_value=f)),
    st.booleans().map(lambda b: AnyValue(bool_value=b)),
    st.binary(max_size=6).map(lambda b: AnyValue(bytes_value=b)),
    st.just(AnyValue()),
)
values = st.one_of(
    scalars,
    st.lists(st.floats(allow_nan=False), max_size=4).map(
        lambda xs: AnyValue(array_value=ArrayValue(values=[AnyValue(double_value=x) for x in xs]))),
    st.lists(st.integers(0, 300), max_size=4).map(
        lambda xs: AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=x) for x in xs]))),
    st.just(AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key="a")]))),
)
stage_values = st.sampled_from(["queue", "compute", "batch_assembly", "Bad Stage", ""]).map(
    lambda s: AnyValue(string_value=s))
attribute = st.one_of(
    st.builds(lambda k, v: KeyValue(key=k, value=v), keys, values),
    st.builds(lambda v: KeyValue(key=sc.ATTR_STAGE, value=v), stage_values),
)
ids = st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20))
short_ids = st.one_of(st.binary(min_size=8, max_size=8), st.binary(max_size=10))


@st.composite
def spans(draw: st.DrawFn) -> trace_pb2.Span:
    return trace_pb2.Span(
        trace_id=draw(ids),
        span_id=draw(short_ids),
        trace_state=draw(st.sampled_from(["", "ot=th:8", "x=" + "y" * 200])),
        parent_span_id=draw(short_ids),
        name=draw(st.sampled_from(["", "inferprof.compute", "n" * 300])),
        kind=draw(st.sampled_from([0, 1, 2, 3, 5, 127, 128, -1, 2**31 - 1])),
        start_time_unix_nano=draw(st.sampled_from([0, 1, 1_700_000_000_000_000_000, 2**64 - 1])),
        end_time_unix_nano=draw(st.sampled_from([0, 5, 1_700_000_000_100_000_000])),
        attributes=draw(st.lists(attribute, max_size=6)),
        links=[trace_pb2.Span.Link(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)]
        * draw(st.integers(0, 3)),
        events=[trace_pb2.Span.Event(name="e")] * draw(st.integers(0, 2)),
        status=trace_pb2.Status(code=draw(st.sampled_from([0, 1, 2])),
                                message=draw(st.sampled_from(["", "boom"]))),
        flags=draw(st.sampled_from([0, 0x100, 0x301, 0xFFFFFFFF])),
        dropped_attributes_count=draw(st.sampled_from([0, 3])),
    )


@FAST
@given(st.lists(spans(), max_size=8), st.integers(1, 3))
def test_any_span_reads_as_its_message(span_list, scopes):
    assert_same(export_of(span_list, scopes))


@FAST
@given(st.lists(spans(), min_size=1, max_size=4), st.data())
def test_any_byte_change_protobuf_accepts_reads_as_its_message(span_list, data):
    """Flip bytes of a valid export: whatever protobuf still parses (another layout,
    unknown fields, other wire types) reads the same both ways."""
    payload = bytearray(export_of(span_list))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    try:
        request = ExportTraceServiceRequest.FromString(bytes(payload))
    except Exception:
        return  # rejected by protobuf: the receivers answer 400 before any read
    got = SpanReader().scan(request, bytes(payload))
    if got is not None:
        assert scanned(bytes(payload)) == expected(request)


def test_remembered_entries_give_the_same_records_export_after_export():
    """The reader remembers entries by their bytes: the same spans read again, and
    spans sharing entries, give what the messages give."""
    reader = SpanReader()
    b = TraceBuilder()
    for i in range(30):
        req = b.request(i, i + 0.05, model="m")
        b.stage(req, "queue", i, i + 0.01)
        b.stage(req, "compute", i + 0.01, i + 0.04, batch_id=f"b{i // 4}", batch_size=4,
                effective=10, padded=16, gpu_id="GPU-0")
    payload = b.export().SerializeToString()
    for _ in range(3):
        assert_same(payload, reader)


# --- layouts only protobuf's rules decide ---------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _fixed64(number: int, value: int) -> bytes:
    return _varint(number << 3 | 1) + struct.pack("<Q", value)


def _export(span_bytes: list[bytes]) -> bytes:
    return _ld(1, _ld(2, b"".join(_ld(2, s) for s in span_bytes)))


TID = bytes(range(1, 17))
SID = bytes(range(1, 9))
STAGE = KeyValue(key=sc.ATTR_STAGE, value=AnyValue(string_value="compute")).SerializeToString()
BATCH = KeyValue(key=sc.ATTR_BATCH_ID, value=AnyValue(string_value="b1")).SerializeToString()
HEAD = _ld(1, TID) + _ld(2, SID) + _ld(5, b"inferprof.compute") + _fixed64(7, 10) + _fixed64(8, 20)


def test_fields_after_the_times_that_come_before_them_win_as_in_protobuf():
    later = [
        _ld(1, bytes(16)),  # trace id again: the last wins
        _ld(2, b"\x09" * 8),
        _fixed64(7, 99),
        _varint(6 << 3) + _varint(2),  # kind after the times
        _ld(4, b"\x07" * 8),
        _ld(3, b"k=v"),
    ]
    for extra in later:
        assert_same(_export([HEAD + _ld(9, STAGE) + extra]))


def test_statuses_merge_and_unknown_fields_are_skipped_as_in_protobuf():
    two_statuses = _ld(15, _varint(3 << 3) + _varint(2)) + _ld(15, _ld(2, b"again"))
    negative_kind = _varint(6 << 3) + _varint(-1)
    unknown = _varint(99 << 3) + _varint(5) + _ld(100, b"xyz") + _varint(7 << 3) + _varint(3)
    spans_ = [
        HEAD + _ld(9, STAGE) + two_statuses,
        _ld(1, TID) + _ld(2, SID) + negative_kind + _fixed64(7, 1) + _fixed64(8, 2),
        HEAD + unknown + _ld(9, BATCH) + _ld(9, STAGE) + _ld(9, BATCH),
        _ld(9, STAGE) + HEAD,  # attributes first
        _fixed64(8, 20) + _fixed64(7, 10) + _ld(2, SID) + _ld(1, TID),  # reversed
        _ld(1, TID) + _ld(2, SID) + _fixed64(7, 10),  # no end time
        HEAD + _ld(9, KeyValue(key=sc.ATTR_STAGE).SerializeToString()),  # stage, no value
    ]
    assert_same(_export(spans_))
    got = scanned(_export(spans_))
    assert got is not None
    assert got[0][0][7] == 2  # status code of the first of the merged statuses
    assert got[0][6][9] is EMPTY


def test_links_and_ids_of_a_bulk_export_read_as_their_messages():
    assert_same(bulk_export(20, links_per_span=3).SerializeToString())


def test_bytes_that_are_not_the_message_are_not_read():
    one = export_of([trace_pb2.Span(trace_id=TID, span_id=SID)])
    two = export_of([trace_pb2.Span(trace_id=TID, span_id=SID)] * 2)
    assert SpanReader().scan(ExportTraceServiceRequest.FromString(one), two) is None
    assert SpanReader().scan(ExportTraceServiceRequest.FromString(one), b"\xff") is None
    # As many spans, one of which protobuf would reject (a trace state not UTF-8).
    bad = _export([_ld(1, TID) + _ld(2, SID) + _ld(3, b"\xff\xfe")])
    assert SpanReader().scan(ExportTraceServiceRequest.FromString(one), bad) is None
