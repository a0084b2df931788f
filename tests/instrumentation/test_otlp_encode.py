"""inferprof's OTLP wire encoder produces exactly the SDK encoder's message."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace as trace_api
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

import inferprof
from inferprof import semconv
from inferprof.instrumentation import otlp_encode
from inferprof.instrumentation.otlp_encode import encode_request
from tests.otlp_sink import attributes

RESOURCE = Resource({"service.name": "svc", "service.instance.id": "i-1", "weight": 1.5})
SCOPE = InstrumentationScope("inferprof", "1.0")


def _span(i: int, attrs: dict, **kw) -> ReadableSpan:
    ctx = trace_api.SpanContext(
        (i + 1) << 64 | 7, i + 1, False, trace_api.TraceFlags(1), kw.pop("trace_state", None)
    )
    defaults = dict(
        name=f"inferprof.stage.{i % 3}", context=ctx, parent=None, resource=RESOURCE,
        attributes=attrs, kind=SpanKind.INTERNAL, start_time=1_700_000_000_000_000_000 + i,
        end_time=1_700_000_000_000_500_000 + i, instrumentation_scope=SCOPE,
        status=Status(StatusCode.UNSET),
    )
    defaults.update(kw)
    return ReadableSpan(**defaults)


def _same(spans: list[ReadableSpan]) -> None:
    expected = encode_spans(spans)
    got = ExportTraceServiceRequest.FromString(encode_request(spans))
    assert got == expected


def test_every_span_field_matches_the_sdk_encoder():
    other_scope = InstrumentationScope("other", None, "https://schema", {"a": 1})
    remote = trace_api.SpanContext(99, 98, True, trace_api.TraceFlags(1))
    state = trace_api.TraceState([("ot", "th:8"), ("vendor", "x")])
    spans = [
        _span(0, {semconv.ATTR_STAGE: "compute", semconv.ATTR_BATCH_SIZE: 16}),
        _span(1, {"ok": True, "no": False, "neg": -5, "big": 2**63 - 1, "f": 0.25, "e": "",
                  "arr": (1, 2, 3), "strs": ("a", "b"), "raw": b"\x00\x01"},
              parent=remote, kind=SpanKind.SERVER, trace_state=state),
        _span(2, {}, parent=trace_api.SpanContext(3, 4, False, trace_api.TraceFlags(1)),
              status=Status(StatusCode.ERROR, "ValueError: bad"),
              events=[Event("exception", {"exception.type": "ValueError"}, timestamp=12)]),
        _span(3, {"x": 1}, links=(Link(remote, {"why": "batch"}), Link(remote)),
              kind=SpanKind.CONSUMER, instrumentation_scope=other_scope),
        _span(4, {"x": 1}, status=Status(StatusCode.OK), kind=SpanKind.CLIENT,
              instrumentation_scope=InstrumentationScope("other", None, "https://schema",
                                                         {"a": 1})),  # equal, not identical
        _span(5, {"x": 1.0}, resource=Resource({"service.name": "second"}, "https://r")),
        _span(6, {"x": True}, resource=Resource(dict(RESOURCE.attributes))),  # equal copy
    ]
    _same(spans)
    _same(spans[:1])
    _same([])


_values = st.one_of(
    st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False), st.text(max_size=20), st.binary(max_size=8),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=3).map(tuple),
    st.lists(st.text(max_size=5), max_size=3).map(tuple),
    # arrays of one numeric type (the compact step spans', the emission offsets) and mixed
    st.lists(st.floats(allow_nan=False), max_size=40).map(tuple),
    st.lists(st.integers(min_value=-3, max_value=300), max_size=40).map(tuple),
    st.lists(st.one_of(st.integers(min_value=0, max_value=200), st.floats(allow_nan=False),
                       st.booleans()), max_size=8).map(tuple),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.text(min_size=1, max_size=12), _values, max_size=6),
                min_size=1, max_size=5))
def test_arbitrary_attributes_match_the_sdk_encoder(attr_sets):
    # Run twice: the second pass is served from the attribute cache.
    spans = [_span(i, attrs) for i, attrs in enumerate(attr_sets)]
    _same(spans)
    _same(spans)


def test_cached_encodings_keep_types_apart():
    # 1, True and 1.0 are equal and hash alike in Python; their OTLP values differ.
    spans = [_span(0, {"v": 1}), _span(1, {"v": True}), _span(2, {"v": 1.0})]
    _same(spans)
    _same(list(reversed(spans)))
    # and inside arrays: (0,) == (0.0,) == (False,)
    spans = [_span(0, {"v": (0,)}), _span(1, {"v": (0.0,)}), _span(2, {"v": (False,)})]
    _same(spans)
    _same(list(reversed(spans)))
    # and in arrays of arrays: ((0,),) == ((False,),), their entries' types alike
    spans = [_span(0, {"v": ((0,),)}), _span(1, {"v": ((0.0,),)}), _span(2, {"v": ((False,),)})]
    _same(spans)
    _same(list(reversed(spans)))


def test_cached_encodings_keep_the_sign_of_zero():
    # -0.0 == 0.0 and they hash alike, but their doubles differ (hypothesis found it in
    # test_arbitrary_attributes_match_the_sdk_encoder: the cache lives across examples)
    for values in ((0.0, -0.0), ((0.0, 1.5), (-0.0, 1.5)), ((0, 0.0), (0, -0.0))):
        spans = [_span(i, {"v": v}) for i, v in enumerate(values)]
        otlp_encode._attr_cache.clear()
        _same(spans)
        _same(list(reversed(spans)))


def test_nan_and_infinities_encode_like_the_sdk():
    _same([_span(0, {"nan": math.nan, "inf": math.inf, "-inf": -math.inf})])


def test_the_attribute_cache_stays_bounded(monkeypatch):
    monkeypatch.setattr(otlp_encode, "_MAX_CACHED_ATTRIBUTES", 16)
    otlp_encode._attr_cache.clear()
    for i in range(100):
        _same([_span(i, {semconv.ATTR_BATCH_ID: f"b-{i}", semconv.ATTR_STAGE: "compute"})])
        assert len(otlp_encode._attr_cache) <= 16


def test_an_unsupported_value_falls_back_to_the_sdk_encoder():
    class Odd:
        pass

    # The SDK logs and skips the attribute it cannot encode; so must we (by delegating).
    spans = [_span(0, {"odd": Odd(), "fine": 1})]
    assert ExportTraceServiceRequest.FromString(encode_request(spans)) == encode_spans(spans)


def test_configure_exports_through_the_fast_encoder_to_a_real_receiver(otlp_sink):
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    # Not global: later tests must not inherit this process-wide provider.
    inferprof.configure(service_name="enc-test", endpoint=otlp_sink.endpoint, mode="full",
                        set_global=False, metric_readers=[InMemoryMetricReader()])
    with inferprof.request(model="m"):
        with inferprof.stage(semconv.STAGE_TOKENIZE, **{semconv.ATTR_BYTES: 12}):
            pass
    inferprof.shutdown()
    assert otlp_sink.wait_for(lambda s: len(s.spans()) >= 2)
    by_name = {span.name: (res, span) for res, span in otlp_sink.spans()}
    res, stage = by_name[semconv.span_name(semconv.STAGE_TOKENIZE)]
    assert res["service.name"] == "enc-test"
    assert attributes(stage)[semconv.ATTR_STAGE] == semconv.STAGE_TOKENIZE
    assert attributes(stage)[semconv.ATTR_BYTES] == 12
    request = next(span for _, span in by_name.values() if not span.parent_span_id)
    assert stage.parent_span_id == request.span_id and stage.trace_id == request.trace_id


def test_the_int_entry_table_stays_bounded(monkeypatch):
    # Arrays of ints are written from a table of their entries, filled on first use.
    monkeypatch.setattr(otlp_encode, "_MAX_INT_ENTRIES", len(otlp_encode._INT_ENTRIES) + 5)
    _same([_span(0, {"v": tuple(range(1000, 1100))}), _span(1, {"v": (-1, 2**40, 7, 1000)})])
    assert len(otlp_encode._INT_ENTRIES) <= otlp_encode._MAX_INT_ENTRIES
