"""Property tests of the OTLP/HTTP body decoders: any input either decodes or gives a
``BodyError`` with a 4xx status; nothing else escapes and nothing grows past the limit."""

from __future__ import annotations

import gzip
import json
import zlib

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from inferprof import semconv as sc
from inferprof.collector.decode import (
    BodyError,
    decode_request,
    decompress,
    encode_response,
)
from tests.collector.test_server_fixtures import make_requests

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMIT = 64 * 1024
VALID = encode_spans(make_requests(3)).SerializeToString()

content_types = st.sampled_from(
    [
        "application/x-protobuf",
        "application/json",
        "application/json; charset=utf-8",
        "text/plain",
        "",
    ]
)
encodings = st.sampled_from(["", "identity", "gzip", "deflate", "br"])
signals = st.sampled_from([sc.SIGNAL_TRACES, sc.SIGNAL_METRICS, sc.SIGNAL_LOGS])


def _decode(body, content_type, encoding, signal=sc.SIGNAL_TRACES, limit=LIMIT):
    try:
        message, fmt = decode_request(
            body,
            content_type=content_type,
            content_encoding=encoding,
            signal=signal,
            max_bytes=limit,
        )
    except BodyError as exc:
        assert exc.status in (400, 413, 415)
        assert exc.reason
        return None
    assert fmt in ("protobuf", "json")
    return message


@FAST
@given(st.binary(max_size=2048), content_types, encodings, signals)
def test_random_bytes_decode_or_fail_cleanly(body, content_type, encoding, signal):
    _decode(body, content_type, encoding, signal)


@FAST
@given(st.integers(min_value=0, max_value=len(VALID)))
@example(len(VALID))
def test_truncated_protobuf_decodes_or_fails_cleanly(cut):
    message = _decode(VALID[:cut], "application/x-protobuf", "")
    if cut == len(VALID):
        assert message.SerializeToString() == VALID


@FAST
@given(st.binary(max_size=256), st.integers(min_value=0, max_value=len(VALID) - 1))
def test_corrupted_protobuf_decodes_or_fails_cleanly(noise, at):
    _decode(VALID[:at] + noise + VALID[at:], "application/x-protobuf", "")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "resourceSpans",
                    "scopeSpans",
                    "spans",
                    "traceId",
                    "spanId",
                    "name",
                    "attributes",
                    "startTimeUnixNano",
                    "endTimeUnixNano",
                    "resource",
                    "key",
                    "value",
                    "stringValue",
                    "resourceMetrics",
                    "scopeMetrics",
                    "metrics",
                    "gauge",
                    "dataPoints",
                    "asDouble",
                    "resourceLogs",
                    "scopeLogs",
                    "logRecords",
                    "body",
                    "severityNumber",
                ]
            )
            | st.text(max_size=8),
            children,
            max_size=4,
        )
    ),
    max_leaves=30,
)


@FAST
@given(json_values, signals)
def test_random_json_decodes_or_fails_cleanly(doc, signal):
    _decode(json.dumps(doc).encode(), "application/json", "", signal)


@FAST
@given(st.binary(max_size=4096), st.sampled_from(["gzip", "deflate"]), st.integers(1, 9))
def test_gzip_roundtrip_and_limit(payload, encoding, level):
    packed = gzip.compress(payload, level) if encoding == "gzip" else zlib.compress(payload, level)
    limit = 1024
    try:
        out = decompress(packed, encoding, limit)
    except BodyError as exc:
        assert exc.status == 413 and len(payload) > limit
    else:
        assert out == payload and len(out) <= limit


@FAST
@given(st.binary(min_size=1, max_size=512), st.integers(0, 64))
def test_corrupted_gzip_never_escapes(garbage, cut):
    packed = gzip.compress(b"abc" * 100)
    for body in (garbage, packed[:cut], packed[:cut] + garbage):
        try:
            decompress(body, "gzip", 1024)
        except BodyError as exc:
            assert exc.status in (400, 413)


def test_concatenated_gzip_members_are_all_read():
    body = gzip.compress(VALID[:10]) + gzip.compress(VALID[10:])
    assert decompress(body, "gzip", LIMIT) == VALID


@FAST
@given(st.integers(0, 10**6), st.text(max_size=50), st.sampled_from(["protobuf", "json"]))
def test_responses_round_trip(rejected, message, fmt):
    body, ctype = encode_response(sc.SIGNAL_TRACES, fmt, rejected=rejected, error_message=message)
    if fmt == "protobuf":
        answer = trace_service_pb2.ExportTraceServiceResponse.FromString(body)
        assert answer.partial_success.rejected_spans == rejected
        assert answer.partial_success.error_message == message
    else:
        doc = json.loads(body)
        if rejected or message:
            assert int(doc["partialSuccess"].get("rejectedSpans", 0)) == rejected
        else:
            assert doc == {}
