"""OTLP/JSON parsing (hex ids, integer enums, int64 strings) and OTLP file reading."""

from __future__ import annotations

import gzip
import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1 import trace_pb2

from inferprof.collector.otlp_json import (
    _fast_trace_request,
    iter_otlp_file,
    parse_metrics_request_json,
    parse_trace_request_json,
    to_json,
)
from inferprof.report.dump import write_json_lines, write_pb
from tests.collector.synth import TraceBuilder, gpu_metrics

SPEC_EXAMPLE = """{"resourceSpans":[{"resource":{"attributes":[{"key":"service.name",
"value":{"stringValue":"my.service"}}]},"scopeSpans":[{"scope":{"name":"my.library",
"version":"1.0.0"},"spans":[{"traceId":"5B8EFFF798038103D269B633813FC60C",
"spanId":"EEE19B7EC3C1B174","parentSpanId":"EEE19B7EC3C1B173","name":"I'm a server span",
"startTimeUnixNano":"1544712660000000000","endTimeUnixNano":1544712661000000000,"kind":2,
"attributes":[{"key":"inferprof.batch.size","value":{"intValue":"8"}}],
"links":[{"traceId":"00000000000000000000000000000001","spanId":"0000000000000002"}]}]}]}]}"""


def test_spec_example_hex_ids_int_enums_int64_strings():
    req = parse_trace_request_json(SPEC_EXAMPLE)
    span = req.resource_spans[0].scope_spans[0].spans[0]
    assert span.trace_id == bytes.fromhex("5B8EFFF798038103D269B633813FC60C")
    assert span.span_id == bytes.fromhex("EEE19B7EC3C1B174")
    assert span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert span.start_time_unix_nano == 1544712660000000000
    assert span.end_time_unix_nano == 1544712661000000000
    assert span.attributes[0].value.int_value == 8
    assert span.links[0].span_id == bytes.fromhex("0000000000000002")
    # bytes, str and dict inputs all work; the caller's dict is not modified.
    doc = json.loads(SPEC_EXAMPLE)
    assert parse_trace_request_json(doc) == req
    assert parse_trace_request_json(SPEC_EXAMPLE.encode()) == req
    assert doc == json.loads(SPEC_EXAMPLE)


@pytest.mark.parametrize(
    "bad,fragment",
    [
        ('{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"abc"}]}]}]}', "32 hex digits"),
        (
            '{"resourceSpans":[{"scopeSpans":[{"spans":[{"spanId":"zzzzzzzzzzzzzzzz"}]}]}]}',
            "not hex",
        ),
        ('{"resourceSpans":{"a":1}}', "expected a list"),
        ("[1,2]", "JSON object"),
        ('{"resourceSpans":[{"scopeSpans":[{"spans":[{"name":5}]}]}]}', "malformed"),
        (
            '{"resourceSpans":[{"scopeSpans":[{"spans":[{"startTimeUnixNano":"-5"}]}]}]}',
            "malformed",
        ),
        ("{", ""),
    ],
)
def test_malformed_json_raises_value_error_with_reason(bad, fragment):
    with pytest.raises(ValueError) as info:
        parse_trace_request_json(bad)
    assert fragment in str(info.value)


def test_metrics_json_round_trip_with_exemplar_ids():
    req = gpu_metrics([(0.0, 0.5), (0.1, 0.75)])
    ex = req.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points[0].exemplars.add()
    ex.trace_id = bytes(range(16))
    ex.span_id = bytes(range(8))
    ex.as_double = 1.0
    doc = to_json(req)
    assert (
        doc["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]["gauge"]["dataPoints"][0][
            "exemplars"
        ][0]["traceId"]
        == bytes(range(16)).hex()
    )
    assert parse_metrics_request_json(json.dumps(doc)) == req


# --- property tests --------------------------------------------------------------------

_ids16 = st.binary(min_size=16, max_size=16)
_ids8 = st.binary(min_size=8, max_size=8)
_u64 = st.integers(min_value=0, max_value=2**64 - 1)
_text = st.text(max_size=12)
_scalar = st.one_of(
    _text.map(lambda s: AnyValue(string_value=s)),
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(lambda i: AnyValue(int_value=i)),
    st.floats(allow_nan=False).map(lambda f: AnyValue(double_value=f)),
    st.booleans().map(lambda b: AnyValue(bool_value=b)),
    st.binary(max_size=8).map(lambda b: AnyValue(bytes_value=b)),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda vs: AnyValue(array_value=ArrayValue(values=vs))),
        st.lists(st.builds(KeyValue, key=_text, value=inner), max_size=3).map(
            lambda kvs: AnyValue(kvlist_value=KeyValueList(values=kvs))
        ),
    ),
    max_leaves=6,
)
_attrs = st.lists(st.builds(KeyValue, key=_text, value=_value), max_size=3)
_u32 = st.integers(min_value=0, max_value=2**32 - 1)


@st.composite
def _spans(draw):
    return trace_pb2.Span(
        trace_id=draw(_ids16),
        span_id=draw(_ids8),
        parent_span_id=draw(st.one_of(st.just(b""), _ids8)),
        trace_state=draw(_text),
        name=draw(_text),
        kind=draw(st.integers(0, 5)),
        start_time_unix_nano=draw(_u64),
        end_time_unix_nano=draw(_u64),
        attributes=draw(_attrs),
        flags=draw(st.integers(0, 2**32 - 1)),
        links=[
            trace_pb2.Span.Link(trace_id=t, span_id=s, attributes=a)
            for t, s, a in draw(st.lists(st.tuples(_ids16, _ids8, _attrs), max_size=2))
        ],
        status=trace_pb2.Status(code=draw(st.integers(0, 2)), message=draw(_text)),
        events=[
            trace_pb2.Span.Event(time_unix_nano=t, name=n, attributes=a, dropped_attributes_count=d)
            for t, n, a, d in draw(st.lists(st.tuples(_u64, _text, _attrs, _u32), max_size=2))
        ],
        dropped_attributes_count=draw(_u32),
        dropped_events_count=draw(_u32),
        dropped_links_count=draw(_u32),
    )


@st.composite
def _requests(draw):
    req = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(0, 2))):
        rs = req.resource_spans.add()
        rs.resource.attributes.extend(draw(_attrs))
        rs.schema_url = draw(_text)
        for _ in range(draw(st.integers(0, 2))):
            ss = rs.scope_spans.add()
            ss.scope.name = draw(_text)
            ss.scope.version = draw(_text)
            ss.scope.attributes.extend(draw(_attrs))
            ss.schema_url = draw(_text)
            ss.spans.extend(draw(st.lists(_spans(), max_size=3)))
    return req


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_requests())
def test_round_trip_random_requests(req):
    text = json.dumps(to_json(req))
    assert parse_trace_request_json(text) == req
    # The fast converter handles every well-formed export itself (no fallback needed).
    assert _fast_trace_request(json.loads(text)) == req


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_value_error(data):
    for parse in (parse_trace_request_json, parse_metrics_request_json):
        try:
            parse(data)
        except ValueError:
            pass


_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=5)
)
_json = st.recursive(
    _json_leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(
            st.sampled_from(
                [
                    "resourceSpans",
                    "scopeSpans",
                    "spans",
                    "traceId",
                    "spanId",
                    "links",
                    "attributes",
                    "key",
                    "value",
                    "kind",
                    "name",
                    "resource",
                    "x",
                ]
            ),
            children,
            max_size=4,
        ),
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_random_json_shapes_raise_only_value_error(doc):
    for data in (json.dumps(doc), {"resourceSpans": doc}):
        try:
            parse_trace_request_json(data)
        except ValueError:
            pass


# --- files ---------------------------------------------------------------------------------


def _exports():
    b = TraceBuilder()
    b.sequential(0.0, [("queue", 0.01), ("compute", 0.02)])
    first = b.export()
    b.sequential(1.0, [("compute", 0.03)])
    return [first, gpu_metrics([(0.0, 0.5)]), b.export()]


def test_iter_json_lines_gzip_and_pb_dumps(tmp_path):
    exports = _exports()
    jsonl = tmp_path / "traces.jsonl"
    write_json_lines(jsonl, exports)
    with open(jsonl, "a") as fh:
        fh.write('\n{"resourceLogs": []}\n')  # other signals are skipped
    gz = tmp_path / "traces.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    pb = tmp_path / "traces.pb"
    assert write_pb(pb, exports) == 3
    seen = []
    for path in (jsonl, gz, pb):
        got = list(iter_otlp_file(path, on_bytes=seen.append))
        assert got == exports
        assert isinstance(got[1], ExportMetricsServiceRequest)
    assert seen and seen[-1] == pb.stat().st_size


def test_bad_files_name_the_line_or_record(tmp_path):
    bad = tmp_path / "bad.jsonl"
    write_json_lines(bad, _exports()[:1])
    with open(bad, "a") as fh:
        fh.write("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(iter_otlp_file(bad))
    pb = tmp_path / "cut.pb"
    write_pb(pb, _exports())
    pb.write_bytes(pb.read_bytes()[:-5])
    with pytest.raises(ValueError, match="truncated"):
        list(iter_otlp_file(pb))
    with pytest.raises(ValueError):
        write_pb(tmp_path / "x.pb", ["not a request"])


def _collector_proto(path, requests) -> None:
    # What the collector's file exporter writes with ``format: proto``.
    with open(path, "wb") as fh:
        for req in requests:
            data = req.SerializeToString()
            fh.write(struct.pack(">I", len(data)) + data)


def test_collector_proto_files_traces_and_metrics(tmp_path):
    exports = _exports()
    traces = [exports[0], exports[2]]
    metrics = [exports[1], gpu_metrics([(1.0, 0.25)])]
    _collector_proto(tmp_path / "traces.binpb", traces)
    _collector_proto(tmp_path / "metrics.binpb", metrics)
    assert list(iter_otlp_file(tmp_path / "traces.binpb")) == traces
    assert list(iter_otlp_file(tmp_path / "metrics.binpb")) == metrics
    junk = tmp_path / "junk.txt"
    junk.write_text("hello, not telemetry")
    with pytest.raises(ValueError, match="not OTLP JSON lines"):
        list(iter_otlp_file(junk))


def test_json_lines_whose_first_line_is_shorter_than_the_format_sniff(tmp_path):
    # The format is sniffed from the first 20 bytes; a shorter first line must stay a line.
    exports = _exports()
    path = tmp_path / "short.jsonl"
    write_json_lines(path, exports)
    path.write_bytes(b'{"resourceLogs":[]}\n{}\n' + path.read_bytes())
    assert list(iter_otlp_file(path)) == exports
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"{}\n{}\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:3"):
        list(iter_otlp_file(bad))


def test_collector_proto_signal_is_recognised_past_records_without_spans(tmp_path):
    exports = _exports()
    traces = [exports[0], exports[2]]
    # A first export holding a resource and no spans, as a collector may write.
    empty = ExportTraceServiceRequest()
    empty.resource_spans.add().resource.attributes.add(key="service.name").value.string_value = "s"
    _collector_proto(tmp_path / "traces.binpb", [empty, *traces])
    got = list(iter_otlp_file(tmp_path / "traces.binpb"))
    assert got == [empty, *traces] and all(isinstance(r, ExportTraceServiceRequest) for r in got)
    # A span with a bad id is still a traces file (the engine rejects the span, counted).
    bad_id = ExportTraceServiceRequest()
    bad_id.CopyFrom(traces[0])
    bad_id.resource_spans[0].scope_spans[0].spans[0].trace_id = b"short"
    _collector_proto(tmp_path / "bad_id.binpb", [bad_id, traces[1]])
    got = list(iter_otlp_file(tmp_path / "bad_id.binpb"))
    assert got == [bad_id, traces[1]]
    # Metrics after an empty first record.
    metrics = [exports[1]]
    _collector_proto(tmp_path / "metrics.binpb", [ExportMetricsServiceRequest(), *metrics])
    got = list(iter_otlp_file(tmp_path / "metrics.binpb"))
    assert got[1:] == metrics and isinstance(got[1], ExportMetricsServiceRequest)
