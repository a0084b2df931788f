"""OTLP/JSON decoding, and reading OTLP files (JSON lines or inferprof's protobuf dumps).

OTLP/JSON is protobuf's canonical JSON mapping with the OTLP specification's
exceptions: trace and span ids are lower-case **hex** (not base64), enums are integers,
64-bit integers may be strings or numbers, field names are lowerCamelCase (the original
snake_case names are accepted too) and unknown fields are ignored. Trace exports are
converted by constructing the messages directly (the bulk of the traffic; several times
faster than ``json_format``); anything that converter does not expect, and metrics
exports, go through ``google.protobuf.json_format`` after the ids are rewritten to the
base64 it expects, so every field follows the protobuf mapping exactly.

Every malformed input raises ``ValueError`` with the reason (``UnicodeDecodeError`` and
``json.JSONDecodeError`` are ``ValueError`` subclasses too); nothing else escapes.

Files: ``iter_otlp_file`` reads what the OpenTelemetry Collector's ``file`` exporter
writes with ``format: json`` (one ``{"resourceSpans": ...}`` or ``{"resourceMetrics":
...}`` document per line; ``.gz`` compressed too) or ``format: proto`` (each message
after a 4-byte big-endian length, one signal per file), and inferprof's own
length-delimited protobuf dumps (``inferprof.report.dump.write_pb``): the magic line
``PB_MAGIC`` then, per
export, one kind byte (``T`` traces, ``M`` metrics), a varint length and the serialized
``Export*ServiceRequest``.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue as _AnyValue
from opentelemetry.proto.common.v1.common_pb2 import ArrayValue as _ArrayValue
from opentelemetry.proto.common.v1.common_pb2 import KeyValue as _KeyValue
from opentelemetry.proto.common.v1.common_pb2 import KeyValueList as _KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span as _Span
from opentelemetry.proto.trace.v1.trace_pb2 import Status as _Status

PB_MAGIC = b"INFERPROF-OTLP-PB 1\n"
PB_KIND_TRACES = b"T"
PB_KIND_METRICS = b"M"

OtlpRequest = ExportTraceServiceRequest | ExportMetricsServiceRequest

_ID_FIELDS = {
    "traceId": 16,
    "trace_id": 16,
    "spanId": 8,
    "span_id": 8,
    "parentSpanId": 8,
    "parent_span_id": 8,
}


def _pb_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def pb_record(kind: bytes, payload: bytes) -> bytes:
    """One record of the protobuf dump: ``kind`` (``PB_KIND_*``), a varint length, the bytes."""
    return kind + _pb_varint(len(payload)) + payload


def _hex_to_b64(value: Any, size: int, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a hex string, got {type(value).__name__}")
    if value == "":
        return ""
    if len(value) != 2 * size:
        raise ValueError(f"{where}: expected {2 * size} hex digits, got {len(value)}")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{where}: {value!r} is not hex") from None
    return base64.b64encode(raw).decode("ascii")


def _fix_ids(obj: dict, where: str) -> None:
    for key, size in _ID_FIELDS.items():
        if key in obj:
            obj[key] = _hex_to_b64(obj[key], size, f"{where}.{key}")


def _items(obj: dict, names: tuple[str, ...], where: str) -> list[dict]:
    """The object list under the first of ``names`` in ``obj``, as shallow copies stored
    back into ``obj``: ids are rewritten in the copies, never in the caller's document,
    at the cost of one small dict copy per object instead of a deep copy of everything.
    ``where``: the path of ``obj`` in the document ("" for the document itself)."""
    for name in names:
        if name in obj:
            value = obj[name]
            path = f"{where}.{name}" if where else name
            if value is None:
                return []
            if not isinstance(value, list):
                raise ValueError(f"{path}: expected a list")
            copies = []
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    raise ValueError(f"{path}[{i}]: expected an object")
                copies.append(dict(item))
            obj[name] = copies
            return copies
    return []


def _load(data: bytes | str | dict) -> dict:
    if isinstance(data, dict):
        return dict(data)  # shallow: see _items
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data).decode("utf-8")
    if isinstance(data, (list, int, float, bool)) or data is None:  # JSON, parsed already
        raise ValueError("OTLP/JSON: the document must be a JSON object")
    if not isinstance(data, str):
        raise ValueError(f"OTLP/JSON: expected bytes, str or dict, got {type(data).__name__}")
    try:
        doc = json.loads(data)
    except RecursionError:
        raise ValueError("OTLP/JSON: document nested too deeply") from None
    if not isinstance(doc, dict):
        raise ValueError("OTLP/JSON: the document must be a JSON object")
    return doc


def _parse(doc: dict, message: Any, what: str) -> Any:
    try:
        return json_format.ParseDict(doc, message, ignore_unknown_fields=True)
    except (
        json_format.ParseError,
        TypeError,
        AttributeError,
        RecursionError,
        OverflowError,
    ) as exc:
        raise ValueError(f"malformed OTLP/JSON {what}: {exc}") from None


# --- fast path for traces ---------------------------------------------------------------
#
# ``json_format.ParseDict`` walks descriptors in Python: ~30k spans/s. Trace exports are
# the bulk of what the collector and ``inferprof report`` read, so they are converted
# here by constructing the messages directly (~10x faster). Anything this converter
# does not expect (a type mismatch, a value out of range, an enum name it does not know)
# makes it give up, and the document goes through ``json_format`` as before, which
# either accepts it or raises the precise error: the result is the same either way.


class _GiveUp(Exception):
    pass


def _field(obj: dict, camel: str, snake: str) -> Any:
    value = obj.get(camel)
    return obj.get(snake) if value is None else value


def _int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        return int(value)
    raise _GiveUp


def _id(value: Any, size: int) -> bytes:
    if value is None or value == "":
        return b""
    if not isinstance(value, str) or len(value) != 2 * size:
        raise _GiveUp
    return bytes.fromhex(value)


def _enum(value: Any, enum: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        return enum.Value(value)
    raise _GiveUp


def _any(value: Any) -> Any:
    if not isinstance(value, dict) or len(value) > 1:
        raise _GiveUp
    if not value:
        return _AnyValue()
    ((key, v),) = value.items()
    if key in ("stringValue", "string_value"):
        return _AnyValue(string_value=v)
    if key in ("intValue", "int_value"):
        return _AnyValue(int_value=_int(v))
    if key in ("doubleValue", "double_value"):
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise _GiveUp
        return _AnyValue(double_value=float(v))
    if key in ("boolValue", "bool_value"):
        if not isinstance(v, bool):
            raise _GiveUp
        return _AnyValue(bool_value=v)
    if key in ("arrayValue", "array_value"):
        return _AnyValue(array_value=_ArrayValue(values=[_any(x) for x in _seq(v, "values")]))
    if key in ("kvlistValue", "kvlist_value"):
        return _AnyValue(
            kvlist_value=_KeyValueList(
                values=_attrs(v.get("values") if isinstance(v, dict) else _bad())
            )
        )
    if key in ("bytesValue", "bytes_value"):
        if not isinstance(v, str):
            raise _GiveUp
        return _AnyValue(bytes_value=base64.b64decode(v, validate=True))
    raise _GiveUp


def _bad() -> Any:
    raise _GiveUp


def _seq(obj: Any, key: str) -> list:
    if not isinstance(obj, dict):
        raise _GiveUp
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _GiveUp
    return value


def _attrs(items: Any) -> list:
    if items is None:
        return []
    if not isinstance(items, list):
        raise _GiveUp
    out = []
    for kv in items:
        if not isinstance(kv, dict):
            raise _GiveUp
        value = kv.get("value")
        out.append(_KeyValue(key=kv.get("key"), value=_any(value) if value is not None else None))
    return out


def _dropped(obj: dict) -> int:
    return _int(_field(obj, "droppedAttributesCount", "dropped_attributes_count") or 0)


_Event = _Span.Event
_Link = _Span.Link


def _span(d: Any) -> Any:
    if not isinstance(d, dict):
        raise _GiveUp
    status = d.get("status")
    if status is not None and not isinstance(status, dict):
        raise _GiveUp
    return _Span(
        trace_id=_id(_field(d, "traceId", "trace_id"), 16),
        span_id=_id(_field(d, "spanId", "span_id"), 8),
        trace_state=_field(d, "traceState", "trace_state"),
        parent_span_id=_id(_field(d, "parentSpanId", "parent_span_id"), 8),
        flags=_int(d.get("flags") or 0),
        name=d.get("name"),
        kind=_enum(d.get("kind"), _Span.SpanKind),
        start_time_unix_nano=_int(_field(d, "startTimeUnixNano", "start_time_unix_nano") or 0),
        end_time_unix_nano=_int(_field(d, "endTimeUnixNano", "end_time_unix_nano") or 0),
        attributes=_attrs(d.get("attributes")),
        dropped_attributes_count=_dropped(d),
        events=[
            _Event(
                time_unix_nano=_int(_field(e, "timeUnixNano", "time_unix_nano") or 0),
                name=e.get("name"),
                attributes=_attrs(e.get("attributes")),
                dropped_attributes_count=_dropped(e),
            )
            for e in _seq(d, "events")
            if isinstance(e, dict) or _bad()
        ],
        dropped_events_count=_int(_field(d, "droppedEventsCount", "dropped_events_count") or 0),
        links=[
            _Link(
                trace_id=_id(_field(k, "traceId", "trace_id"), 16),
                span_id=_id(_field(k, "spanId", "span_id"), 8),
                trace_state=_field(k, "traceState", "trace_state"),
                attributes=_attrs(k.get("attributes")),
                dropped_attributes_count=_dropped(k),
                flags=_int(k.get("flags") or 0),
            )
            for k in _seq(d, "links")
            if isinstance(k, dict) or _bad()
        ],
        dropped_links_count=_int(_field(d, "droppedLinksCount", "dropped_links_count") or 0),
        status=None
        if status is None
        else _Status(
            message=status.get("message"), code=_enum(status.get("code"), _Status.StatusCode)
        ),
    )


def _fast_trace_request(doc: dict) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    for rs in _seq(doc, "resourceSpans") or _seq(doc, "resource_spans"):
        if not isinstance(rs, dict):
            raise _GiveUp
        out_rs = req.resource_spans.add()
        resource = rs.get("resource")
        if resource is not None:
            if not isinstance(resource, dict):
                raise _GiveUp
            out_rs.resource.SetInParent()
            out_rs.resource.attributes.extend(_attrs(resource.get("attributes")))
            out_rs.resource.dropped_attributes_count = _dropped(resource)
        schema = _field(rs, "schemaUrl", "schema_url")
        if schema is not None:
            out_rs.schema_url = schema
        for ss in _seq(rs, "scopeSpans") or _seq(rs, "scope_spans"):
            if not isinstance(ss, dict):
                raise _GiveUp
            out_ss = out_rs.scope_spans.add()
            scope = ss.get("scope")
            if scope is not None:
                if not isinstance(scope, dict):
                    raise _GiveUp
                out_ss.scope.SetInParent()
                if scope.get("name") is not None:
                    out_ss.scope.name = scope["name"]
                if scope.get("version") is not None:
                    out_ss.scope.version = scope["version"]
                out_ss.scope.attributes.extend(_attrs(scope.get("attributes")))
                out_ss.scope.dropped_attributes_count = _dropped(scope)
            schema = _field(ss, "schemaUrl", "schema_url")
            if schema is not None:
                out_ss.schema_url = schema
            out_ss.spans.extend([_span(sp) for sp in _seq(ss, "spans")])
    return req


def parse_trace_request_json(data: bytes | str | dict) -> ExportTraceServiceRequest:
    """Decode an OTLP/JSON ``ExportTraceServiceRequest``; ``ValueError`` if malformed."""
    doc = _load(data)
    try:
        return _fast_trace_request(doc)
    except Exception:
        pass
    for i, rs in enumerate(_items(doc, ("resourceSpans", "resource_spans"), "")):
        for j, ss in enumerate(_items(rs, ("scopeSpans", "scope_spans"), f"resourceSpans[{i}]")):
            where = f"resourceSpans[{i}].scopeSpans[{j}]"
            for k, span in enumerate(_items(ss, ("spans",), where)):
                _fix_ids(span, f"{where}.spans[{k}]")
                for m, link in enumerate(_items(span, ("links",), f"{where}.spans[{k}]")):
                    _fix_ids(link, f"{where}.spans[{k}].links[{m}]")
    return _parse(doc, ExportTraceServiceRequest(), "trace export")


_POINT_KINDS = (
    "gauge",
    "sum",
    "histogram",
    "exponentialHistogram",
    "exponential_histogram",
    "summary",
)


def parse_metrics_request_json(data: bytes | str | dict) -> ExportMetricsServiceRequest:
    """Decode an OTLP/JSON ``ExportMetricsServiceRequest``; ``ValueError`` if malformed."""
    doc = _load(data)
    for i, rm in enumerate(_items(doc, ("resourceMetrics", "resource_metrics"), "")):
        for j, sm in enumerate(
            _items(rm, ("scopeMetrics", "scope_metrics"), f"resourceMetrics[{i}]")
        ):
            where = f"resourceMetrics[{i}].scopeMetrics[{j}]"
            for k, metric in enumerate(_items(sm, ("metrics",), where)):
                for kind in _POINT_KINDS:
                    body = metric.get(kind)
                    if not isinstance(body, dict):
                        continue
                    body = metric[kind] = dict(body)
                    pw = f"{where}.metrics[{k}].{kind}"
                    for p, point in enumerate(_items(body, ("dataPoints", "data_points"), pw)):
                        for e, ex in enumerate(
                            _items(point, ("exemplars",), f"{pw}.dataPoints[{p}]")
                        ):
                            _fix_ids(ex, f"{pw}.dataPoints[{p}].exemplars[{e}]")
    return _parse(doc, ExportMetricsServiceRequest(), "metrics export")


def parse_json_line(line: bytes | str) -> OtlpRequest | None:
    """One line of a collector file-exporter file: a trace or metrics export, or None
    for other signals (logs, profiles) and blank lines."""
    if isinstance(line, (str, bytes)) and not line.strip():
        return None
    doc = _load(line)
    if "resourceSpans" in doc or "resource_spans" in doc:
        return parse_trace_request_json(doc)
    if "resourceMetrics" in doc or "resource_metrics" in doc:
        return parse_metrics_request_json(doc)
    return None


def _open(path: str | os.PathLike):
    with open(path, "rb") as probe:
        head = probe.read(2)
    if head == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _read_varint(fh) -> int | None:
    shift = result = 0
    while True:
        b = fh.read(1)
        if not b:
            if shift:
                raise ValueError("truncated length prefix in protobuf dump")
            return None
        result |= (b[0] & 0x7F) << shift
        if not b[0] & 0x80:
            return result
        shift += 7
        if shift > 63:
            raise ValueError("invalid length prefix in protobuf dump")


def iter_otlp_file(
    path: str | os.PathLike, *, on_bytes: Callable[[int], None] | None = None
) -> Iterator[OtlpRequest]:
    """Yield every trace and metrics export in ``path``.

    ``on_bytes(n)`` is called with the (compressed) bytes consumed so far, for progress
    bars. Raises ``ValueError`` naming the file and line/record on malformed content.
    """
    with _open(path) as fh:
        raw = getattr(fh, "fileobj", None) or fh
        first = fh.read(len(PB_MAGIC))
        if first == PB_MAGIC:
            yield from _iter_pb(fh, path, raw, on_bytes)
            return
        if first and first.lstrip()[:1] not in (b"{", b""):
            yield from _iter_collector_proto(first, fh, path, raw, on_bytes)
            return
        lineno = 0
        rest = first  # the sniffed bytes may hold a whole short line, and more
        while True:
            nl = rest.find(b"\n")
            if nl >= 0:
                buf, rest = rest[: nl + 1], rest[nl + 1 :]
            else:
                buf, rest = rest + fh.readline(), b""
            if not buf:
                return
            lineno += 1
            try:
                req = parse_json_line(buf)
            except ValueError as exc:
                raise ValueError(f"{os.fspath(path)}:{lineno}: {exc}") from None
            if req is not None:
                yield req
            if on_bytes is not None:
                on_bytes(raw.tell())


def _decode_record(cls, payload: bytes, path, record: int) -> OtlpRequest:
    try:
        return cls.FromString(payload)
    except DecodeError as exc:
        raise ValueError(f"{os.fspath(path)}: record {record}: {exc}") from None


def _iter_pb(fh, path, raw, on_bytes) -> Iterator[OtlpRequest]:
    record = 0
    while True:
        kind = fh.read(1)
        if not kind:
            return
        record += 1
        size = _read_varint(fh)
        payload = fh.read(size or 0)
        if size is None or len(payload) != size:
            raise ValueError(f"{os.fspath(path)}: record {record} is truncated")
        cls = {
            PB_KIND_TRACES: ExportTraceServiceRequest,
            PB_KIND_METRICS: ExportMetricsServiceRequest,
        }.get(kind)
        if cls is None:
            raise ValueError(f"{os.fspath(path)}: record {record} has unknown kind {kind!r}")
        yield _decode_record(cls, payload, path, record)
        if on_bytes is not None:
            on_bytes(raw.tell())


def _signal_of(payload: bytes) -> type | None:
    """The export class a collector proto record is, when the record says: traces when it
    decodes as spans (preferring traces with valid-length ids when it also decodes as
    metrics), metrics when it decodes as metrics with data; None for a record that holds
    neither (resources or scopes only), which decodes the same either way."""
    try:
        req = ExportTraceServiceRequest.FromString(payload)
        spans = [sp for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans]
    except DecodeError:
        spans = []
    try:
        mreq = ExportMetricsServiceRequest.FromString(payload)
        metrics = [
            m
            for rm in mreq.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.WhichOneof("data") is not None
        ]
    except DecodeError:
        metrics = []
    if spans and metrics:
        valid = all(len(sp.trace_id) == 16 and len(sp.span_id) == 8 for sp in spans)
        return ExportTraceServiceRequest if valid else ExportMetricsServiceRequest
    if spans:
        return ExportTraceServiceRequest
    if metrics:
        return ExportMetricsServiceRequest
    return None


def _iter_collector_proto(first: bytes, fh, path, raw, on_bytes) -> Iterator[OtlpRequest]:
    """The collector file exporter's ``format: proto``: each message preceded by its
    length as a 4-byte big-endian integer; one signal per file, recognised from the first
    message that holds spans or metrics (records before it, with neither, are held until
    then; a file with neither anywhere reads as traces)."""
    pending = first
    record = 0
    cls = None
    held: list[tuple[int, bytes]] = []
    while True:
        head = pending + fh.read(4 - len(pending)) if len(pending) < 4 else pending[:4]
        rest = b"" if len(pending) < 4 else pending[4:]
        pending = b""
        if not head:
            break
        record += 1
        if len(head) < 4:
            raise ValueError(f"{os.fspath(path)}: record {record} is truncated")
        size = int.from_bytes(head, "big")
        if len(rest) >= size:  # small records: the sniffed bytes hold more than this one
            payload, pending = rest[:size], rest[size:]
        else:
            payload = rest + fh.read(size - len(rest))
        if len(payload) != size:
            raise ValueError(
                f"{os.fspath(path)}: not OTLP JSON lines, an inferprof dump, or a complete "
                f"collector proto file (record {record} is truncated)"
            )
        if cls is None:
            cls = _signal_of(payload)
            if cls is None:
                held.append((record, payload))
                continue
            for n, earlier in held:
                yield _decode_record(cls, earlier, path, n)
            held.clear()  # (their bytes are counted with this record's, just below)
        yield _decode_record(cls, payload, path, record)
        if on_bytes is not None:
            on_bytes(raw.tell())
    for n, earlier in held:  # nothing said which signal: empty either way
        yield _decode_record(ExportTraceServiceRequest, earlier, path, n)
    if held and on_bytes is not None:
        on_bytes(raw.tell())


def to_json(request: OtlpRequest) -> dict:
    """OTLP/JSON of an export (hex ids, integer enums, camelCase) — the inverse of the
    parsers, used to write collector-compatible files and in round-trip tests."""
    doc = json_format.MessageToDict(request, use_integers_for_enums=True)

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            for key, value in obj.items():
                if key in _ID_FIELDS and isinstance(value, str):
                    obj[key] = binascii.hexlify(base64.b64decode(value)).decode("ascii")
                else:
                    walk(value)
        elif isinstance(obj, list):
            for item in obj:
                walk(item)

    walk(doc)
    return doc


__all__ = [
    "PB_MAGIC",
    "iter_otlp_file",
    "parse_json_line",
    "parse_metrics_request_json",
    "parse_trace_request_json",
    "pb_record",
    "to_json",
]
