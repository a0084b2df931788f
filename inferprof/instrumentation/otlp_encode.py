"""A faster OTLP trace encoder for the span exporter's thread.

Why: profiling the demo service showed the OpenTelemetry exporter's encoder
(``opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans``) to be the
largest single cost of exporting a span — about 15-20 µs per span, more than inferprof
spends recording it — because it builds one protobuf object per span, per attribute and
per attribute value, and hashes the span's ``Resource`` (a JSON dump of its attributes)
for every span. inferprof's spans repeat the same few attributes (stage name, model,
batch size, HTTP method and route), so this encoder writes the protobuf wire format
directly and caches the encoded bytes of each ``(key, value)`` attribute it has seen
(bounded), of each resource and of each scope. The result is the same message: the
tests parse both encoders' output and compare.

``encode_request(spans)`` returns the serialized ``ExportTraceServiceRequest``. Anything
it does not handle (an attribute value of an unexpected type) makes it fall back to the
SDK encoder for that batch, so output never depends on this module being complete.
Field numbers are those of ``opentelemetry/proto/trace/v1/trace.proto`` and
``common/v1/common.proto``.
"""

from __future__ import annotations

import logging
import math
import random
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.trace import SpanKind

from inferprof.instrumentation.records import span_id_of
from inferprof.instrumentation.spans import SpanSpec, stage_spec
from inferprof.instrumentation.spans import error_parts as _error_parts
from inferprof.semconv import ATTR_STAGE, SPAN_NAME_PREFIX

_logger = logging.getLogger(__name__)
_pack_q = struct.Struct("<Q").pack
_pack_d = struct.Struct("<d").pack
_pack_i = struct.Struct("<I").pack
_getrandbits = random.getrandbits

#: Most cached attribute encodings. Attributes with unbounded values (batch ids, byte
#: counts) fill it up; then it is emptied, and the hot entries come back on next use.
_MAX_CACHED_ATTRIBUTES = 8192
_FLAGS_HAS_IS_REMOTE = 0x100
_FLAGS_IS_REMOTE = 0x200


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64: two's complement, ten bytes
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _span_field(payload: bytes) -> bytes:
    """``_ld(2, payload)`` for one span (field 2 of ScopeSpans), the length inlined: a span
    is almost always 128 bytes to 16 KiB, a two-byte varint."""
    n = len(payload)
    if 0x80 <= n < 0x4000:
        return bytes((0x12, (n & 0x7F) | 0x80, n >> 7)) + payload
    return b"\x12" + _varint(n) + payload


def _str(field: int, value: str | None) -> bytes:
    if not value:
        return b""  # proto3: an empty string is not written
    return _ld(field, value.encode("utf-8"))


class _Unsupported(Exception):
    pass


def _any_value(value: Any) -> bytes:
    """An ``AnyValue`` message's payload."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _ld(1, value.encode("utf-8"))
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _pack_d(value)
    if isinstance(value, bytes):
        return _ld(7, value)
    if isinstance(value, Sequence):
        return _ld(5, _array_values(value))
    if isinstance(value, Mapping):
        return _ld(6, b"".join(_ld(1, _key_value(str(k), v)) for k, v in value.items()))
    raise _Unsupported(type(value))


#: An ``ArrayValue`` entry (field 1) holding a double: tag, length 9, the double's tag.
_DOUBLE_ENTRY = b"\x0a\x09\x21"
#: Most ints whose ``ArrayValue`` entries are kept (token counts, member counts).
_MAX_INT_ENTRIES = 4096


class _IntEntries(dict):
    """``ArrayValue`` entries holding an int, by value: 0..127 from the start, others
    made on first use and kept up to ``_MAX_INT_ENTRIES``."""

    def __missing__(self, value: int) -> bytes:
        entry = _ld(1, b"\x18" + _varint(value))
        if len(self) < _MAX_INT_ENTRIES:
            self[value] = entry
        return entry


_INT_ENTRIES = _IntEntries((v, b"\x0a\x02\x18" + bytes((v,))) for v in range(128))
_ONLY_FLOATS = frozenset((float,))
_ONLY_INTS = frozenset((int,))


def _array_values(values: Sequence[Any]) -> bytes:
    """An ``ArrayValue``'s entries. Arrays of floats or of ints alone (the compact step
    spans', the emission offsets) are written without a call per entry."""
    kinds = set(map(type, values))
    if kinds == _ONLY_FLOATS:
        return b"".join(map(_DOUBLE_ENTRY.__add__, map(_pack_d, values)))
    if kinds == _ONLY_INTS:  # (C loops: no Python step per entry)
        return b"".join(map(_INT_ENTRIES.__getitem__, values))
    return b"".join(_ld(1, _any_value(v)) for v in values)


def _key_value(key: str, value: Any) -> bytes:
    return _str(1, key) + _ld(2, _any_value(value))


_attr_cache: dict[tuple, bytes] = {}


#: Value types whose (key, type, value) is hashable and worth caching as is.
_CACHEABLE = frozenset((str, int, float, bool, bytes))


def _attributes(field: int, attributes: Mapping[str, Any] | None) -> bytes:
    """Repeated ``KeyValue`` field ``field``, each entry cached by (key, type, value) (an
    array's by its entries' types too)."""
    if not attributes:
        return b""
    parts = []
    cache = _attr_cache
    for key, value in attributes.items():
        # The type is part of the key: True == 1 == 1.0 must not share an encoding.
        vtype = type(value)
        if vtype in _CACHEABLE:
            scalar: tuple = (field, key, vtype, value)
            if vtype is float and not value:  # -0.0 == 0.0, hashed alike: the sign too
                scalar += (math.copysign(1.0, value),)
            enc = cache.get(scalar)
            if enc is not None:
                parts.append(enc)
                continue
            ck: tuple | None = scalar
        elif vtype is tuple:  # its entries' types too: (0,) == (0.0,) == (False,)
            types = tuple(map(type, value))
            # (an array of arrays is not cached: ((0,),) == ((False,),), types alike)
            ck = (field, key, vtype, value, types) if _CACHEABLE.issuperset(types) else None
            if ck is not None and float in types and 0.0 in value:  # and the zeros' signs
                ck += (tuple(math.copysign(1.0, v) for v in value if type(v) is float),)
        else:
            ck = (field, key, vtype, value) if not isinstance(value, (list, dict)) else None
        if ck is not None:
            try:
                enc = cache.get(ck)
            except TypeError:  # an unhashable value (a tuple holding a list)
                enc, ck = None, None
            if enc is not None:
                parts.append(enc)
                continue
        enc = _ld(field, _key_value(key, value))
        if ck is not None:
            if len(cache) >= _MAX_CACHED_ATTRIBUTES:
                cache.clear()
            cache[ck] = enc
        parts.append(enc)
    return b"".join(parts)


def _status(status: Any) -> bytes:
    if status is None:
        return b""
    payload = _str(2, status.description)
    code = status.status_code.value
    if code:
        payload += b"\x18" + _varint(code)
    return _ld(15, payload)


def _flags(tag: bytes, parent: Any) -> bytes:
    flags = _FLAGS_HAS_IS_REMOTE
    if parent is not None and parent.is_remote:
        flags |= _FLAGS_IS_REMOTE
    return tag + _pack_i(flags)


def _trace_state(field: int, trace_state: Any) -> bytes:
    if trace_state is None:
        return b""
    return _str(field, ",".join(f"{k}={v}" for k, v in trace_state.items()))


def _event(event: Any) -> bytes:
    """Span field 11: one ``Event``."""
    payload = (b"\x09" + _pack_q(event.timestamp or 0) + _str(2, event.name)
               + _attributes(3, event.attributes))
    if event.dropped_attributes:
        payload += b"\x20" + _varint(event.dropped_attributes)
    return _ld(11, payload)


def _link(link: Any) -> bytes:
    """Span field 13: one ``Link``."""
    lctx = link.context
    payload = (b"\x0a\x10" + lctx.trace_id.to_bytes(16, "big")
               + b"\x12\x08" + lctx.span_id.to_bytes(8, "big")
               + _attributes(4, link.attributes))
    if link.dropped_attributes:
        payload += b"\x28" + _varint(link.dropped_attributes)
    return _ld(13, payload + _flags(b"\x35", lctx))


def _span(span: Any) -> bytes:
    ctx = span.get_span_context()
    parent = span.parent
    out = [
        b"\x0a\x10", ctx.trace_id.to_bytes(16, "big"),
        b"\x12\x08", ctx.span_id.to_bytes(8, "big"),
        _trace_state(3, ctx.trace_state),
    ]
    if parent is not None:
        out += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
    out += (
        _str(5, span.name),
        b"\x30" + _varint(span.kind.value + 1),  # SDK kinds start at 0, OTLP's at 1
        b"\x39", _pack_q(span.start_time or 0),
        b"\x41", _pack_q(span.end_time or 0),
        _attributes(9, span.attributes),
    )
    if span.dropped_attributes:
        out.append(b"\x50" + _varint(span.dropped_attributes))
    for event in span.events or ():
        out.append(_event(event))
    if span.dropped_events:
        out.append(b"\x60" + _varint(span.dropped_events))
    for link in span.links or ():
        out.append(_link(link))
    if span.dropped_links:
        out.append(b"\x70" + _varint(span.dropped_links))
    out.append(_status(span.status))
    out.append(_flags(b"\x85\x01", parent))  # field 16, fixed32
    return _ld(2, b"".join(out))


_resource_cache: dict[int, tuple[Any, bytes]] = {}
_scope_cache: dict[int, tuple[Any, bytes]] = {}


def _resource_fields(resource: Any) -> bytes:
    """``resource`` (field 1) of a ResourceSpans, cached per Resource object."""
    hit = _resource_cache.get(id(resource))
    if hit is not None and hit[0] is resource:
        return hit[1]
    enc = _ld(1, _attributes(1, resource.attributes))
    if len(_resource_cache) > 64:
        _resource_cache.clear()
    _resource_cache[id(resource)] = (resource, enc)
    return enc


def _scope_fields(scope: Any) -> bytes:
    """``scope`` (field 1) and ``schema_url`` (field 3) of a ScopeSpans, cached per scope."""
    hit = _scope_cache.get(id(scope))
    if hit is not None and hit[0] is scope:
        return hit[1]
    if scope is None:
        enc = _ld(1, b"")
    else:
        enc = _ld(1, _str(1, scope.name) + _str(2, scope.version)
                  + _attributes(3, scope.attributes))
    if len(_scope_cache) > 64:
        _scope_cache.clear()
    _scope_cache[id(scope)] = (scope, enc)
    return enc


def _encode(spans: Sequence[Any]) -> bytes:
    # Group as the SDK does: by resource, then by scope, in first-seen order. Resources are
    # told apart by identity first (one provider, one Resource object: no hashing per
    # span), then equal ones are merged, as the SDK's equality-keyed grouping would.
    by_id: dict[int, tuple[Any, dict[Any, list[bytes]]]] = {}
    for span in spans:
        resource = span.resource
        group = by_id.get(id(resource))
        if group is None:
            group = by_id[id(resource)] = (resource, {})
        scope = span.instrumentation_scope or None
        encoded = group[1].get(scope)
        if encoded is None:
            encoded = group[1][scope] = []
        encoded.append(_span(span))
    groups: list[tuple[Any, dict[Any, list[bytes]]]] = []
    for resource, scopes in by_id.values():
        for known, known_scopes in groups:
            if known is resource or known == resource:
                for scope, encoded in scopes.items():
                    known_scopes.setdefault(scope, []).extend(encoded)
                break
        else:
            groups.append((resource, scopes))
    out = []
    for resource, scopes in groups:
        body = [_resource_fields(resource)]
        for scope, encoded in scopes.items():
            scope_body = _scope_fields(scope) + b"".join(encoded)
            if scope is not None:
                scope_body += _str(3, scope.schema_url)
            body.append(_ld(2, scope_body))
        body.append(_str(3, resource.schema_url))
        out.append(_ld(1, b"".join(body)))
    return b"".join(out)


def encode_request(spans: Sequence[Any]) -> bytes:
    """Serialized ``ExportTraceServiceRequest`` for ``spans`` (SDK ``ReadableSpan`` objects)."""
    try:
        return _encode(spans)
    except _Unsupported:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        return encode_spans(spans).SerializeToString()


# --- straight from inferprof's records --------------------------------------------------

_name_cache: dict[str, bytes] = {}
_kind_cache: dict[Any, bytes] = {}
_INTERNAL = SpanKind.INTERNAL
_KIND_INTERNAL = b"\x30" + _varint(SpanKind.INTERNAL.value + 1)
_STATUS_UNSET = _ld(15, b"")
_FLAGS_LOCAL = b"\x85\x01" + _pack_i(_FLAGS_HAS_IS_REMOTE)
_FLAGS_REMOTE = b"\x85\x01" + _pack_i(_FLAGS_HAS_IS_REMOTE | _FLAGS_IS_REMOTE)
_STATUS_UNSET_FLAGS_LOCAL = _STATUS_UNSET + _FLAGS_LOCAL
#: A span's start and end (fields 7 and 8, fixed64), tags included.
_pack_times = struct.Struct("<BQBQ").pack
_TIMES_SIZE = 18


def _spec_span(tid: bytes, state: bytes, spec: SpanSpec) -> bytes:
    name, span_id, parent, kind, start, end, attrs, error, links = spec
    out = [b"\x0a\x10", tid, b"\x12\x08", span_id.to_bytes(8, "big"), state]
    flags = _FLAGS_LOCAL
    if parent is not None:
        if isinstance(parent, int):
            out += (b"\x22\x08", parent.to_bytes(8, "big"))
        else:  # a SpanContext: the request's (possibly remote) parent
            out += (b"\x22\x08", parent.span_id.to_bytes(8, "big"))
            if parent.is_remote:
                flags = _FLAGS_REMOTE
    enc = _name_cache.get(name)
    if enc is None:
        enc = _str(5, name)
        if len(_name_cache) < _MAX_CACHED_ATTRIBUTES:
            _name_cache[name] = enc
    out.append(enc)
    if kind is _INTERNAL:  # stage spans (SpanKind hashes in Python: test identity first)
        enc = _KIND_INTERNAL
    else:
        enc = _kind_cache.get(kind)
        if enc is None:
            enc = _kind_cache[kind] = b"\x30" + _varint(kind.value + 1)
    out += (enc, b"\x39", _pack_q(start or 0), b"\x41", _pack_q(end or 0))
    status = None
    if error is not None:
        status, events, extra = _error_parts(error, end)
        if extra:
            attrs = {**attrs, **extra}
    out.append(_attributes(9, attrs))
    if status is not None:
        out += map(_event, events)
    out += map(_link, links)
    out.append(_status(status) if status is not None else _STATUS_UNSET)
    out.append(flags)
    return _span_field(b"".join(out))


def encode_trace_spans(
    trace_id: int, specs: Sequence[SpanSpec], trace_state: Any = None
) -> bytes:
    """One trace's spans as repeated ``ScopeSpans.spans`` fields (field 2), ready to be
    concatenated with other traces' under one scope by :func:`wrap_trace_spans`."""
    tid = trace_id.to_bytes(16, "big")
    state = _trace_state(3, trace_state)
    return b"".join([_spec_span(tid, state, spec) for spec in specs])


_stage_heads: dict[str, tuple[bytes, bytes, bytes]] = {}


def _stage_head(name: str) -> tuple[bytes, bytes, bytes]:
    """(name and kind fields, the ``inferprof.stage`` attribute, that attribute followed
    by an unset status and the flags: the end of a span with no other attributes) of a
    stage's span."""
    head = _stage_heads.get(name)
    if head is None:
        stage_attr = _attributes(9, {ATTR_STAGE: name})
        head = (_str(5, SPAN_NAME_PREFIX + name) + _KIND_INTERNAL, stage_attr,
                stage_attr + _STATUS_UNSET + _FLAGS_LOCAL)
        if len(_stage_heads) < _MAX_CACHED_ATTRIBUTES:
            _stage_heads[name] = head
    return head


def batch_stage_body(st: Any, attrs: Mapping[str, Any]) -> bytes:
    """A batch stage's span after its ids (name, kind, times, ``attrs``, error, status,
    flags): the same bytes in every member's copy, so a batch encodes it once."""
    end = st.end
    out = [_stage_head(st.name)[0], _pack_times(0x39, st.start or 0, 0x41, end or 0)]
    if st.error is None:
        out += (_attributes(9, attrs), _STATUS_UNSET, _FLAGS_LOCAL)
        return b"".join(out)
    status, events, extra = _error_parts(st.error, end)
    out.append(_attributes(9, {**attrs, **extra} if extra else attrs))
    out += map(_event, events)
    out += (_status(status), _FLAGS_LOCAL)
    return b"".join(out)


def encode_request_trace(
    trace_id: int,
    head: Sequence[SpanSpec],
    stages: Sequence[Any],
    root: int,
    end: int,
    copies: Sequence[tuple[Sequence[Any], Any]] = (),
    trace_state: Any = None,
) -> bytes:
    """A kept request's trace, the bytes :func:`encode_trace_spans` gives for the specs
    ``Runtime._request_trace`` builds (``spans.stage_spec`` per stage), written with no
    spec tuple or merged attribute dict per stage (the tests compare both paths): ``head``,
    the request span's spec (or none); ``stages``, its stage records, children of ``root``
    unless nested, ending at ``end`` if still open; ``copies``, per batch copied under the
    request (``children`` encoding), its stage records and ``body(stage)``, the stage's
    :func:`batch_stage_body`. Each copy draws a span id (in the spec path's order) and has
    for parent the copy of its stage's parent, else ``root``."""
    tid = trace_id.to_bytes(16, "big")
    state = _trace_state(3, trace_state)
    out = [_spec_span(tid, state, spec) for spec in head]
    root_b = root.to_bytes(8, "big")
    head_ids = b"\x0a\x10" + tid + b"\x12\x08"
    to_parent = state + b"\x22\x08"
    # A stage span is written as its pieces, after its length (field 2 of ScopeSpans)
    # worked out from theirs: no payload joined on its own and copied again.
    fixed = len(head_ids) + 8 + len(to_parent) + 8 + _TIMES_SIZE
    for st in stages:
        attrs = st.attrs
        if st.error is not None or ATTR_STAGE in attrs:  # rare: the general path
            out.append(_spec_span(tid, state, stage_spec(st, root, end)))
            continue
        names, stage_attr, tail = _stage_head(st.name)
        parent = st.parent
        if attrs:
            tail = stage_attr + _attributes(9, attrs) + _STATUS_UNSET_FLAGS_LOCAL
        n = fixed + len(names) + len(tail)
        out += (
            bytes((0x12, (n & 0x7F) | 0x80, n >> 7)) if 0x80 <= n < 0x4000
            else b"\x12" + _varint(n),
            head_ids, (st.span_id or span_id_of(st)).to_bytes(8, "big"), to_parent,
            (parent.span_id or span_id_of(parent)).to_bytes(8, "big")
            if parent is not None else root_b,
            names, _pack_times(0x39, st.start or 0, 0x41, st.end or end or 0), tail,
        )
    for batch_stages, body in copies:
        copy_ids: dict[Any, bytes] = {}
        for st in batch_stages:
            copy_id = (_getrandbits(64) or 1).to_bytes(8, "big")  # Runtime's new_span_id()
            copy_ids[st] = copy_id
            parent = st.parent
            out.append(_span_field(b"".join((
                head_ids, copy_id, state, b"\x22\x08",
                copy_ids.get(parent, root_b) if parent is not None else root_b, body(st),
            ))))
    return b"".join(out)


def wrap_trace_spans(traces: Sequence[tuple[Any, bytes]]) -> bytes:
    """Serialized ``ExportTraceServiceRequest`` from (runtime, :func:`encode_trace_spans`
    bytes) pairs: grouped under each runtime's resource and instrumentation scope."""
    groups: dict[tuple[int, int], tuple[Any, Any, list[bytes]]] = {}
    for runtime, encoded in traces:
        resource, scope = runtime._resource, runtime._scope
        key = (id(resource), id(scope))
        group = groups.get(key)
        if group is None:
            group = groups[key] = (resource, scope, [])
        group[2].append(encoded)
    out = []
    for resource, scope, parts in groups.values():
        scope_body = _scope_fields(scope) + b"".join(parts) + _str(3, scope.schema_url)
        out.append(_ld(1, _resource_fields(resource) + _ld(2, scope_body)
                       + _str(3, resource.schema_url)))
    return b"".join(out)


def encode_traces(traces: Sequence[tuple[Any, tuple]]) -> bytes:
    """Serialized ``ExportTraceServiceRequest`` for inferprof's traces.

    ``traces``: (runtime, (trace id, span specs, trace state)) pairs, the specs being
    those ``Runtime._spans`` turns into ``ReadableSpan`` objects. The message equals
    ``encode_request`` of those spans (tests compare them); it is built without them.
    """
    return wrap_trace_spans([(rt, encode_trace_spans(*trace)) for rt, trace in traces])


__all__ = [
    "batch_stage_body",
    "encode_request",
    "encode_request_trace",
    "encode_trace_spans",
    "encode_traces",
    "wrap_trace_spans",
]
