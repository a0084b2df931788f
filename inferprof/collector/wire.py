"""Reading the fields trace assembly uses off OTLP spans, at the least cost per span.

With the upb runtime every field read through a message allocates a Python object, and
an attribute costs three of them (the ``KeyValue``, its ``AnyValue``, the key) before its
value is read: the attribute reads were most of the engine's cost per span.

So, when the export's serialized bytes are at hand (the receivers have them), they are
parsed a second time, in C, with a *lean* schema (:func:`lean_export`): the OTLP messages
down to ``Span``, each declaring only the fields assembly reads, under their OTLP names
and numbers, so a lean span reads like a ``Span``. Attributes, links and events stay
unparsed: a lean span's ``attributes`` are the serialized ``KeyValue`` entries, as
``bytes``; everything not declared (names, events, resources, scopes) is skipped. The
lean parse only ever runs on bytes protobuf has parsed already with the full schema: the
receivers reject malformed bodies, with their reason, before anything is read, and the
same bytes parse under the lean schema (same field numbers and wire types; a field of
another wire type is an unknown field under both), with the values the full parse reads.

:class:`AttributeReader` decodes those entries with protobuf itself (``KeyValue`` parsed
from the entry's bytes: what the full message holds) and remembers what an entry gives by
its bytes: an export repeats the same few entries (stage names, model, batch size), so
most cost one dict lookup. That memory is bounded (:data:`_CACHE_MAX` entries of at most
:data:`_CACHE_ENTRY_BYTES` bytes) and shares no mutable value between spans.

:func:`read_attributes` reads the ``KeyValue`` messages of a full ``Span``, for exports
whose bytes are not at hand (OTLP/JSON, files); both give the same result.
"""

from __future__ import annotations

import struct
from struct import Struct
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from inferprof import semconv as sc
from inferprof.collector import gen_spans as _gen

#: Attributes read from span attributes besides ``inferprof.stage`` (compared on its
#: own, first: most spans that carry anything carry it); all others are skipped without
#: decoding their value.
WANTED = frozenset(
    {
        sc.ATTR_REQUEST,
        sc.ATTR_SAMPLE_WEIGHT,
        sc.ATTR_MODEL_NAME,
        sc.ATTR_BATCH_ID,
        sc.ATTR_TOKENS_EFFECTIVE,
        sc.ATTR_TOKENS_PADDED,
        sc.ATTR_GPU_ID,
        sc.ATTR_BATCH_SIZE,
        sc.ATTR_QUEUE_BEHIND_BATCHES_S,
        sc.ATTR_SUMMARY_COUNTED,
        *_gen.REQUEST_KEYS,
        *_gen.STEP_KEYS,
    }
)
_STRING_KEYS = frozenset({sc.ATTR_MODEL_NAME, sc.ATTR_BATCH_ID, sc.ATTR_GPU_ID, sc.ATTR_ENGINE_ID})
_ARRAY_KEYS = _gen.ARRAY_KEYS
_INT_KEYS = frozenset({sc.ATTR_TOKENS_EFFECTIVE, sc.ATTR_TOKENS_PADDED, sc.ATTR_BATCH_SIZE})

#: Stage attribute present with no value (AnyValue unset).
EMPTY = object()

#: What assembly reads of a span: (trace id, span id, parent span id, start ns, end ns,
#: kind, flags (the OTLP field, unmasked), status code, trace state, stage (None: no
#: ``inferprof.stage``; :data:`EMPTY`: present without a value; else its value as sent),
#: the wanted attributes' values (None: none of them), number of links (0 where there is
#: no stage), position in its ``ScopeSpans``). Flags, status code and trace state may be
#: None: read them off the ``Span`` message. The dict of wanted values may be shared by
#: the spans that sent the same attributes: never changed in place.
SpanRecord = tuple[
    bytes, bytes, bytes, int, int, int, "int | None", "int | None", "str | None", Any,
    "dict[str, Any] | None", int, int,
]


def _any_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _stage_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else EMPTY


def _wanted_value(k: str, v: Any) -> Any:
    """The value of wanted attribute ``k``: the contract's type read first, the generic
    decode only when the sender used another type."""
    if k in _STRING_KEYS:
        return v.string_value or _any_value(v)
    if k in _ARRAY_KEYS:
        return _gen.array_value(v)
    if k in _INT_KEYS:
        return v.int_value or _any_value(v)
    return _any_value(v)


def read_attributes(attributes: Any) -> tuple[Any, dict[str, Any] | None]:
    """A span's stage (None: none; :data:`EMPTY`: present without a value) and the
    values of the attributes the engine reads (None: none of them), from its
    ``KeyValue`` messages."""
    stage = None
    extra = None
    attr_stage = sc.ATTR_STAGE
    for kv in attributes:
        k = kv.key
        if k == attr_stage:
            v = kv.value
            stage = v.string_value or _stage_value(v)
        elif k in WANTED:
            value = _wanted_value(k, kv.value)
            if extra is None:
                extra = {k: value}
            else:
                extra[k] = value
    return stage, extra


# What one attribute entry is.
_SKIP = 0
_STAGE = 1
_VALUE = 2

_CACHE_MAX = 4096
_CACHE_ENTRY_BYTES = 256
#: Value types an entry may share between spans (immutable); EMPTY's type included.
_SHAREABLE = frozenset({str, int, float, bool, bytes, type(None), type(EMPTY)})


class AttributeReader:
    """Decodes a lean span's serialized attribute entries, as :func:`read_attributes`
    does its messages. One per engine; not thread-safe (the engine serialises calls)."""

    def __init__(self) -> None:
        self._known: dict[bytes, tuple[int, str, Any]] = {}

    def read(self, entries: Any) -> tuple[Any, dict[str, Any] | None]:
        stage = None
        extra = None
        known = self._known.get
        for kvb in entries:
            what, k, value = known(kvb) or self._entry(kvb)
            if what == _STAGE:
                stage = value
            elif what:
                if extra is None:
                    extra = {k: value}
                else:
                    extra[k] = value
        return stage, extra

    def _entry(self, kvb: bytes) -> tuple[int, str, Any]:
        """What one entry gives, decoded; remembered when small and immutable."""
        kv = KeyValue.FromString(kvb)
        k = kv.key
        if k == sc.ATTR_STAGE:
            v = kv.value
            entry: tuple[int, str, Any] = (_STAGE, k, v.string_value or _stage_value(v))
        elif k in WANTED:
            entry = (_VALUE, k, _wanted_value(k, kv.value))
        else:
            entry = (_SKIP, k, None)
        if len(kvb) <= _CACHE_ENTRY_BYTES and type(entry[2]) in _SHAREABLE:
            known = self._known
            if len(known) >= _CACHE_MAX:
                known.clear()
            known[kvb] = entry
        return entry


def records_of(spans: Any) -> list[SpanRecord]:
    """The records of decoded ``Span`` messages. Flags, status code and trace state,
    which only request spans need, are left None (read them off the message)."""
    out: list[SpanRecord] = []
    for k, span in enumerate(spans):
        stage, extra = read_attributes(span.attributes)
        out.append((
            span.trace_id, span.span_id, span.parent_span_id, span.start_time_unix_nano,
            span.end_time_unix_nano, span.kind, None, None, None, stage, extra,
            len(span.links) if stage is not None else 0, k,
        ))
    return out


# --- reading the serialized export ---------------------------------------------------

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "inferprof.collector.wire"
_B, _S, _I32, _F64, _F32, _MSG = (
    _F.TYPE_BYTES, _F.TYPE_STRING, _F.TYPE_INT32, _F.TYPE_FIXED64, _F.TYPE_FIXED32,
    _F.TYPE_MESSAGE,
)
#: What assembly reads of a span, with OTLP's names and numbers (the kind, an open enum
#: in proto3, is an int32 on the wire and as read); attributes and links unparsed.
_SPAN_FIELDS = [
    ("trace_id", 1, _B, False, None),
    ("span_id", 2, _B, False, None),
    ("trace_state", 3, _S, False, None),
    ("parent_span_id", 4, _B, False, None),
    ("kind", 6, _I32, False, None),
    ("start_time_unix_nano", 7, _F64, False, None),
    ("end_time_unix_nano", 8, _F64, False, None),
    ("attributes", 9, _B, True, None),
    ("links", 13, _B, True, None),
    ("status", 15, _MSG, False, "Status"),
    ("flags", 16, _F32, False, None),
]
_LEAN = (
    ("Status", [("code", 3, _I32, False, None)]),
    ("Span", _SPAN_FIELDS),
    # The export down to each span's bytes.
    ("ScopeSpans", [("spans", 2, _B, True, None)]),
    ("ResourceSpans", [("scope_spans", 2, _MSG, True, "ScopeSpans")]),
    ("ExportTraceServiceRequest", [("resource_spans", 1, _MSG, True, "ResourceSpans")]),
)
#: The same span fields with presence (proto2), to parse the part of a span after its
#: times: the fields read before them must not be there again (the last would win).
_TAIL = (("Status", [("code", 3, _I32, False, None)]), ("Span", _SPAN_FIELDS))
_HEAD_FIELDS = ("trace_id", "span_id", "trace_state", "parent_span_id", "kind",
                "start_time_unix_nano", "end_time_unix_nano")


def _message_classes(package: str, syntax: str, messages: Any) -> dict[str, Any]:
    proto = descriptor_pb2.FileDescriptorProto(
        name=f"{package.replace('.', '/')}.proto", package=package, syntax=syntax
    )
    for message, fields in messages:
        m = proto.message_type.add(name=message)
        for name, number, ftype, repeated, type_name in fields:
            f = m.field.add(
                name=name,
                number=number,
                type=ftype,
                label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL,
            )
            if type_name:
                f.type_name = f".{package}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {
        message: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{message}"))
        for message, _ in messages
    }


_lean = _message_classes(_PACKAGE, "proto3", _LEAN)
_LeanExport = _lean["ExportTraceServiceRequest"]
_LeanSpan = _lean["Span"]
_TailSpan = _message_classes(f"{_PACKAGE}.tail", "proto2", _TAIL)["Span"]

#: The first 30 bytes of a span as exporters write them: trace id's tag and length,
#: trace id, span id's tag and length, span id, the next field's tag and length byte.
_IDS = Struct("<H16sH8sBB").unpack_from
_TRACE_ID_16 = 0x100A  # field 1, length-delimited; 16 bytes (little-endian pair)
_SPAN_ID_8 = 0x0812  # field 2, length-delimited; 8 bytes
_PARENT = Struct("<8sBB").unpack_from  # a parent span id, the next tag and length byte
_TIMES = Struct("<QxQ").unpack_from  # start, the end's tag, end
_TAIL_CACHE_MAX = 4096
_TAIL_CACHE_ENTRY_BYTES = 512


class SpanReader:
    """Span records off the serialized export (see the module docstring). One per
    engine; not thread-safe (the engine serialises calls)."""

    def __init__(self) -> None:
        self.attributes = AttributeReader()
        # A span's bytes after its times -> (stage, wanted values, links, status code,
        # flags), or None where fields read before the times come again.
        self._tails: dict[bytes, tuple | None] = {}
        # The same for ``columns``: tail -> its number in a table of entries.
        self._tail_index: dict[bytes, int] = {}
        self._tail_table: list[tuple] = []

    def scan(self, request: Any, payload: bytes) -> list[list[SpanRecord]] | None:
        """The records of each ``ScopeSpans`` of ``request``, in order, read off
        ``payload``, the bytes ``request`` was parsed from. None when ``payload`` does not
        parse, or does not hold as many resources, scopes and spans as ``request`` (it
        was not what ``request`` was parsed from): then read ``request``."""
        scopes = self.lean_scopes(request, payload)
        if scopes is None:
            return None
        out = []
        for spans in scopes:
            try:
                out.append(self._records(spans))
            except DecodeError:  # not from a message protobuf parsed: read the message
                return None
        return out

    @staticmethod
    def lean_scopes(request: Any, payload: bytes) -> list[Any] | None:
        """The serialized spans of each ``ScopeSpans`` of ``request``, in order, off
        ``payload``; None as for :meth:`scan`."""
        try:
            lean = _LeanExport.FromString(payload)
        except DecodeError:
            return None
        out = []
        lean_rs = lean.resource_spans
        if len(lean_rs) != len(request.resource_spans):
            return None
        for lrs, rs in zip(lean_rs, request.resource_spans, strict=True):
            lean_ss = lrs.scope_spans
            if len(lean_ss) != len(rs.scope_spans):
                return None
            for lss, ss in zip(lean_ss, rs.scope_spans, strict=True):
                spans = lss.spans
                if len(spans) != len(ss.spans):
                    return None
                out.append(spans)
        return out

    def records(self, spans: Any) -> list[SpanRecord] | None:
        """The records of one scope's serialized spans; None where one does not parse."""
        try:
            return self._records(spans)
        except DecodeError:
            return None

    def columns(self, spans: Any) -> Columns | None:
        """One scope's serialized spans as columns (:class:`Columns`), read with numpy;
        None unless every span is laid out as :meth:`_records` reads it fast, with a parent
        id of 8 bytes or none, and a tail whose values are immutable (then read the
        records)."""
        spans = list(spans)
        n = len(spans)
        if not n:
            return None
        lens = np.fromiter(map(len, spans), np.int64, n)
        joined = b"".join(spans)
        off = np.zeros(n, np.int64)
        np.cumsum(lens[:-1], out=off[1:])
        stop = off + lens
        # Zero padding: a read past a short span's end is caught by the last check.
        buf = np.frombuffer(joined + bytes(64), np.uint8)
        last = buf.size - 1

        def at(pos: np.ndarray) -> np.ndarray:
            return buf[np.minimum(pos, last)].astype(np.int64)

        ok = (at(off) == 0x0A) & (at(off + 1) == 16) & (at(off + 18) == 0x12) & (
            at(off + 19) == 8)
        p = off + 28
        c = at(p)
        nb = at(p + 1)
        has_ts = c == 0x1A
        ok &= ~has_ts | (nb <= 0x7F)
        p = np.where(has_ts, p + 2 + nb, p)
        c = at(p)
        nb = at(p + 1)
        has_parent = c == 0x22
        ok &= ~has_parent | (nb == 8)
        parent_at = p + 2
        p = np.where(has_parent, p + 10, p)
        c = at(p)
        nb = at(p + 1)
        is_name = c == 0x2A
        m = at(p + 2)
        long_name = is_name & (nb > 0x7F)
        ok &= ~long_name | (m <= 0x7F)
        p = np.where(is_name, np.where(long_name, p + 3 + ((nb & 0x7F) | (m << 7)), p + 2 + nb),
                     p)
        c = at(p)
        is_kind = c == 0x30
        kind = np.where(is_kind, at(p + 1), 0)
        ok &= kind <= 0x7F
        p = np.where(is_kind, p + 2, p)
        ok &= (at(p) == 0x39) & (at(p + 9) == 0x41) & (p + 18 <= stop)
        if not ok.all():
            return None
        tid = buf[(off + 2)[:, None] + _R16].view("V16").ravel()
        sid = buf[(off + 20)[:, None] + _R8].view("<u8").ravel()
        parent = np.where(has_parent, buf[parent_at[:, None] + _R8].view("<u8").ravel(), 0)
        start = buf[(p + 1)[:, None] + _R8].view("<u8").ravel()
        end = buf[(p + 10)[:, None] + _R8].view("<u8").ravel()
        # Each span's tail once as bytes: the distinct ones are decoded (or found).
        each = [joined[a:b] for a, b in zip((p + 18).tolist(), stop.tolist(), strict=True)]
        got = self._tail_entries(each)
        if got is None:
            return None
        ids, entries = got
        trace_state: list[str] | None = None
        if has_ts.any():
            try:
                trace_state = [
                    joined[a + 30:a + 30 + k].decode() if h else ""
                    for a, k, h in zip(off.tolist(), at(off + 29).tolist(), has_ts.tolist(),
                                       strict=True)
                ]
            except ValueError:
                return None
        return Columns(tid, sid, parent, has_parent, start, end, kind,
                       ids, entries, trace_state)

    def _records(self, spans: Any) -> list[SpanRecord]:
        # The hot loop. A span as every OTLP exporter writes it starts with its ids, trace
        # state, parent, name and kind, then its times (fields 1 to 8, in order, each
        # once, short): read here with a few byte compares. What follows (attributes,
        # events, links, status, flags) repeats from span to span, so it is decoded once
        # per distinct value (``_tail``). Any other layout: the span is parsed (``_span``).
        out: list[SpanRecord] = []
        tails = self._tails.get
        tail_of = self._tail
        for k, sb in enumerate(spans):
            try:
                h1, tid, h2, sid, c, n = _IDS(sb)
                if h1 != _TRACE_ID_16 or h2 != _SPAN_ID_8:
                    raise _Other
                p = 28
                trace_state = ""
                if c == 0x1A:  # trace state
                    if n > 0x7F:
                        raise _Other
                    trace_state = sb[30:30 + n].decode()
                    p = 30 + n
                    c = sb[p]
                    n = sb[p + 1]
                parent = b""
                if c == 0x22:  # parent span id
                    if n == 8:
                        parent, c, n = _PARENT(sb, p + 2)
                        p += 10
                    else:
                        if n > 0x7F:
                            raise _Other
                        parent = sb[p + 2:p + 2 + n]
                        p += 2 + n
                        c = sb[p]
                        n = sb[p + 1]
                if c == 0x2A:  # name: skipped
                    if n < 0x80:
                        p += 2 + n
                    else:
                        m = sb[p + 2]
                        if m > 0x7F:
                            raise _Other
                        p += 3 + ((n & 0x7F) | m << 7)
                    c = sb[p]
                kind = 0
                if c == 0x30:  # kind
                    kind = sb[p + 1]
                    if kind > 0x7F:
                        raise _Other
                    p += 2
                    c = sb[p]
                if c != 0x39 or sb[p + 9] != 0x41:
                    raise _Other
                start, end = _TIMES(sb, p + 1)
                tail = sb[p + 18:]
                t: Any = tails(tail, _NO_TAIL)
                if t is _NO_TAIL:
                    t = tail_of(tail)
                if t is None:
                    raise _Other
                stage, extra, n_links, code, flags = t
                out.append((tid, sid, parent, start, end, kind, flags, code,
                            trace_state, stage, extra, n_links, k))
            except (_Other, IndexError, ValueError, struct.error):
                out.append(self._span(sb, k))
        return out

    def _tail_entries(self, each: list[bytes]) -> tuple[np.ndarray, list[tuple]] | None:
        """Each tail's entry: (per tail, its number in the entries), the entries used;
        each tail found by its bytes in the reader's bounded table, decoded when new. None
        where one does not parse, repeats a field read before it or holds a mutable
        value."""
        n = len(each)
        index = self._tail_index
        table = self._tail_table
        if len(table) >= _TAIL_CACHE_MAX:
            index.clear()
            table.clear()
        numbers = list(map(index.get, each))
        if None in numbers:
            for k in [k for k, i in enumerate(numbers) if i is None]:
                tail = each[k]
                i = index.get(tail)
                if i is None:
                    t = self._decode_tail(tail)
                    if t is None or t is _UNPARSED or not _immutable(t):
                        return None
                    i = len(table)
                    table.append(t)
                    if len(tail) <= _TAIL_CACHE_ENTRY_BYTES:
                        index[tail] = i
                numbers[k] = i
        at_table = np.fromiter(numbers, np.int64, n)
        present = np.zeros(len(table), bool)
        present[at_table] = True
        used = np.flatnonzero(present)
        ids = (np.cumsum(present) - 1)[at_table]
        entries = [table[i] for i in used.tolist()]
        return ids, entries

    def _decode_tail(self, tail: bytes) -> Any:
        """What the part of a span after its times gives; None when it holds a field
        read before them; :data:`_UNPARSED` when it does not parse."""
        try:
            m = _TailSpan.FromString(tail)
        except DecodeError:
            return _UNPARSED
        if any(m.HasField(f) for f in _HEAD_FIELDS):
            return None
        stage, extra = self.attributes.read(m.attributes)
        return (stage, extra, len(m.links), m.status.code, m.flags)

    def _tail(self, tail: bytes) -> tuple | None:
        """:meth:`_decode_tail`, remembered (when small and immutable); None for a tail
        that does not parse as well."""
        entry = self._decode_tail(tail)
        if entry is _UNPARSED:
            return None
        if entry is not None and not _immutable(entry):
            return entry  # not remembered: a mutable value is decoded for each span
        if len(tail) <= _TAIL_CACHE_ENTRY_BYTES:
            tails = self._tails
            if len(tails) >= _TAIL_CACHE_MAX:
                tails.clear()
            tails[tail] = entry
        return entry

    def _span(self, sb: bytes, k: int) -> SpanRecord:
        """The record of a span in any other layout, parsed."""
        m = _LeanSpan.FromString(sb)
        stage, extra = self.attributes.read(m.attributes)
        return (m.trace_id, m.span_id, m.parent_span_id, m.start_time_unix_nano,
                m.end_time_unix_nano, m.kind, m.flags, m.status.code, m.trace_state, stage,
                extra, len(m.links), k)


class Columns:
    """One scope's spans as columns (:meth:`SpanReader.columns`), in the scope's order:
    ``tid`` (16-byte void), ``sid``, ``parent`` (the ids' bytes read as little-endian
    uint64; ``parent`` 0 where ``has_parent`` is False), ``start``, ``end`` (uint64 ns),
    ``kind``; ``tail`` numbers each span's ``entries`` item: (stage, wanted values, number
    of links, status code, flags), as :meth:`SpanReader._tail` gives; ``trace_state`` per
    span (None: no span has one)."""

    __slots__ = ("end", "entries", "has_parent", "kind", "parent", "sid", "start", "tail",
                 "tid", "trace_state")

    def __init__(self, tid: np.ndarray, sid: np.ndarray, parent: np.ndarray,
                 has_parent: np.ndarray, start: np.ndarray, end: np.ndarray, kind: np.ndarray,
                 tail: np.ndarray, entries: list[tuple], trace_state: list[str] | None) -> None:
        self.tid = tid
        self.sid = sid
        self.parent = parent
        self.has_parent = has_parent
        self.start = start
        self.end = end
        self.kind = kind
        self.tail = tail
        self.entries = entries
        self.trace_state = trace_state

    def __len__(self) -> int:
        return int(self.sid.size)

    def take(self, at: np.ndarray) -> Columns:
        """The spans at positions ``at``, in that order, with only the entries they use."""
        used, tail = np.unique(self.tail[at], return_inverse=True)
        ts = self.trace_state
        return Columns(self.tid[at], self.sid[at], self.parent[at], self.has_parent[at],
                       self.start[at], self.end[at], self.kind[at], tail.ravel(),
                       [self.entries[i] for i in used.tolist()],
                       None if ts is None else [ts[k] for k in at.tolist()])

    def record(self, k: int) -> SpanRecord:
        """Span ``k``'s record, as :meth:`SpanReader._records` reads it."""
        stage, extra, n_links, code, flags = self.entries[int(self.tail[k])]
        return (self.tid[k].tobytes(), id_bytes(self.sid[k]),
                id_bytes(self.parent[k]) if self.has_parent[k] else b"",
                int(self.start[k]), int(self.end[k]), int(self.kind[k]), flags, code,
                self.trace_state[k] if self.trace_state is not None else "", stage, extra,
                n_links, k)


def id_bytes(x: Any) -> bytes:
    """A span id read as a little-endian uint64, as its 8 bytes."""
    return int(x).to_bytes(8, "little")


def _immutable(entry: tuple) -> bool:
    stage, extra = entry[0], entry[1]
    return type(stage) in _SHAREABLE and (
        extra is None or all(type(v) in _SHAREABLE for v in extra.values()))


_R8 = np.arange(8)
_R16 = np.arange(16)


class _Other(Exception):
    """A span not in the layout the fast path reads."""


_NO_TAIL = object()
_UNPARSED = object()


__all__ = [
    "EMPTY", "WANTED", "AttributeReader", "Columns", "SpanReader", "SpanRecord", "id_bytes",
    "read_attributes", "records_of",
]
