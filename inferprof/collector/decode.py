"""Decoding OTLP/HTTP request bodies: content types, gzip, size limits, responses.

Guarantees: every failure is a :class:`BodyError` carrying the HTTP status the
OTLP/HTTP spec asks for (400 malformed, 413 too large, 415 unsupported media type
or encoding) and a short reason; no input makes these functions raise anything
else. The decompressed size is bounded as well as the wire size, so a gzip bomb
costs at most ``max_bytes`` of memory.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any, Literal

from google.protobuf import json_format
from google.protobuf.message import Message
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from inferprof import semconv

Format = Literal["protobuf", "json"]
FORMAT_PROTOBUF: Format = "protobuf"
FORMAT_JSON: Format = "json"

CONTENT_TYPE_PROTOBUF = "application/x-protobuf"
CONTENT_TYPE_JSON = "application/json"
# media type (lower-case, without parameters) -> body format
_MEDIA_TYPES: dict[str, Format] = {
    CONTENT_TYPE_PROTOBUF: FORMAT_PROTOBUF,
    "application/protobuf": FORMAT_PROTOBUF,
    CONTENT_TYPE_JSON: FORMAT_JSON,
}
_IDENTITY_ENCODINGS = frozenset({"", "identity"})
_GZIP_ENCODINGS = frozenset({"gzip", "x-gzip"})
_DEFLATE_ENCODINGS = frozenset({"deflate"})

# HTTP statuses of the failures.
STATUS_BAD_REQUEST = 400
STATUS_TOO_LARGE = 413
STATUS_UNSUPPORTED = 415

_REQUEST_TYPES: dict[str, type[Message]] = {
    semconv.SIGNAL_TRACES: trace_service_pb2.ExportTraceServiceRequest,
    semconv.SIGNAL_METRICS: metrics_service_pb2.ExportMetricsServiceRequest,
    semconv.SIGNAL_LOGS: logs_service_pb2.ExportLogsServiceRequest,
}
_RESPONSE_TYPES: dict[str, type[Message]] = {
    semconv.SIGNAL_TRACES: trace_service_pb2.ExportTraceServiceResponse,
    semconv.SIGNAL_METRICS: metrics_service_pb2.ExportMetricsServiceResponse,
    semconv.SIGNAL_LOGS: logs_service_pb2.ExportLogsServiceResponse,
}
# partial_success field counting what was rejected, per signal.
_REJECTED_FIELD = {
    semconv.SIGNAL_TRACES: "rejected_spans",
    semconv.SIGNAL_METRICS: "rejected_data_points",
    semconv.SIGNAL_LOGS: "rejected_log_records",
}


class BodyError(ValueError):
    """A request body that cannot be accepted; ``status`` is the HTTP answer."""

    def __init__(self, status: int, reason: str, outcome: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.outcome = outcome  # label value of inferprof_otlp_requests_total


def format_of(content_type: str | None) -> Format | None:
    """The body format of a ``Content-Type`` header; None for an unknown one."""
    return _MEDIA_TYPES.get((content_type or "").split(";", 1)[0].strip().lower())


def body_format(content_type: str | None) -> Format:
    """The body format of a ``Content-Type`` header, or 415."""
    fmt = format_of(content_type)
    if fmt is None:
        raise BodyError(
            STATUS_UNSUPPORTED,
            f"unsupported content type {content_type!r}: use {CONTENT_TYPE_PROTOBUF} "
            f"or {CONTENT_TYPE_JSON}",
            semconv.OUTCOME_UNSUPPORTED,
        )
    return fmt


def decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """Undo ``Content-Encoding`` (identity, gzip, deflate), never producing more than
    ``max_bytes`` (413 past that)."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in _IDENTITY_ENCODINGS:
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
        return body
    if encoding in _GZIP_ENCODINGS:
        wbits = 16 + zlib.MAX_WBITS
    elif encoding in _DEFLATE_ENCODINGS:
        wbits = zlib.MAX_WBITS  # zlib-wrapped, as RFC 9110 defines "deflate"
    else:
        raise BodyError(
            STATUS_UNSUPPORTED,
            f"unsupported content encoding {content_encoding!r}: use gzip, deflate or identity",
            semconv.OUTCOME_UNSUPPORTED,
        )
    out = bytearray()
    data = body
    try:
        # Loop over concatenated gzip members (RFC 1952 allows several).
        while True:
            d = zlib.decompressobj(wbits)
            out += d.decompress(data, max_bytes - len(out) + 1)
            if len(out) > max_bytes or d.unconsumed_tail:
                raise _too_large(max_bytes, decompressed=True)
            if not d.eof:
                raise BodyError(
                    STATUS_BAD_REQUEST,
                    f"truncated {encoding} body",
                    semconv.OUTCOME_BAD_REQUEST,
                )
            data = d.unused_data
            if not data or wbits == zlib.MAX_WBITS:
                break
    except zlib.error as exc:
        raise BodyError(
            STATUS_BAD_REQUEST, f"corrupt {encoding} body: {exc}", semconv.OUTCOME_BAD_REQUEST
        ) from None
    return bytes(out)


def parse_request(data: bytes, fmt: Format, signal: str) -> Message:
    """Parse an Export{Trace,Metrics}ServiceRequest from protobuf or OTLP/JSON bytes."""
    if fmt == FORMAT_JSON:
        # Imported outside the try: a missing module is a server fault, not a bad body.
        from inferprof.collector import otlp_json
    try:
        if fmt == FORMAT_PROTOBUF:
            return _REQUEST_TYPES[signal].FromString(data)
        doc = json.loads(data)
        if signal == semconv.SIGNAL_TRACES:
            return otlp_json.parse_trace_request_json(doc)
        if signal == semconv.SIGNAL_METRICS:
            return otlp_json.parse_metrics_request_json(doc)
        return _parse_logs_json(doc)
    except BodyError:
        raise
    except RecursionError:
        reason = "body is nested too deeply"
    except Exception as exc:  # DecodeError, JSONDecodeError, UnicodeDecodeError, ValueError, ...
        # Our own checks raise plain ValueErrors whose message is the reason; other
        # errors (the JSON and protobuf parsers') keep their type's name.
        reason = str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}"
    raise BodyError(
        STATUS_BAD_REQUEST,
        f"malformed OTLP {fmt} {signal} request: {_clip(reason)}",
        semconv.OUTCOME_BAD_REQUEST,
    )


def decode_request(
    body: bytes,
    *,
    content_type: str | None,
    content_encoding: str | None,
    signal: str,
    max_bytes: int,
) -> tuple[Message, Format]:
    """Body bytes as received -> (request message, format to answer in)."""
    fmt = body_format(content_type)
    data = decompress(body, content_encoding, max_bytes)
    return parse_request(data, fmt, signal), fmt


def encode_response(
    signal: str, fmt: Format, *, rejected: int = 0, error_message: str = ""
) -> tuple[bytes, str]:
    """The Export*ServiceResponse for a (partially) successful export, as (body, content type).

    ``partial_success`` is set only when something was rejected or there is a
    message, as the OTLP spec asks: an empty response means full success.
    """
    response = _RESPONSE_TYPES[signal]()
    if rejected or error_message:
        partial = response.partial_success
        setattr(partial, _REJECTED_FIELD[signal], rejected)
        partial.error_message = error_message
    if fmt == FORMAT_JSON:
        doc = json_format.MessageToDict(response)  # lowerCamelCase keys, as OTLP/JSON wants
        return json.dumps(doc).encode(), CONTENT_TYPE_JSON
    return response.SerializeToString(), CONTENT_TYPE_PROTOBUF


#: HTTP status -> the google.rpc.Code a ``Status`` body carries (gRPC's own mapping).
_RPC_CODES = {400: 3, 401: 16, 408: 4, 413: 8, 415: 3, 429: 8, 500: 13}  # INVALID_ARGUMENT,
# UNAUTHENTICATED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT,
# RESOURCE_EXHAUSTED, INTERNAL


def error_body(reason: str, fmt: Format | None, status: int = 400) -> tuple[bytes, str]:
    """A ``google.rpc.Status`` body for a failed request (HTTP ``status``), in the
    request's format (plain JSON ``{"code", "message"}`` when the format itself was not
    understood)."""
    from google.rpc import status_pb2

    code = _RPC_CODES.get(status, 2)  # UNKNOWN
    if fmt == FORMAT_PROTOBUF:
        return (status_pb2.Status(code=code, message=reason).SerializeToString(),
                CONTENT_TYPE_PROTOBUF)
    return json.dumps({"code": code, "message": reason}).encode(), CONTENT_TYPE_JSON


def _parse_logs_json(doc: Any) -> Message:
    """OTLP/JSON logs -> ExportLogsServiceRequest (logs are only forwarded, so the
    engine's JSON parser does not cover them). OTLP/JSON writes trace and span ids as
    hex where the proto3 JSON mapping expects base64; everything else maps directly."""
    if not isinstance(doc, dict):
        raise ValueError("an OTLP/JSON logs request is a JSON object")
    for rl in doc.get("resourceLogs") or ():
        for sl in (rl or {}).get("scopeLogs") or ():
            for record in (sl or {}).get("logRecords") or ():
                for key in ("traceId", "spanId"):
                    value = record.get(key) if isinstance(record, dict) else None
                    if isinstance(value, str) and value:
                        record[key] = base64.b64encode(bytes.fromhex(value)).decode()
    request = logs_service_pb2.ExportLogsServiceRequest()
    json_format.ParseDict(doc, request, ignore_unknown_fields=True)
    return request


def _too_large(max_bytes: int, decompressed: bool = False) -> BodyError:
    what = "decompressed body" if decompressed else "body"
    return BodyError(
        STATUS_TOO_LARGE,
        f"{what} exceeds the limit of {max_bytes} bytes",
        semconv.OUTCOME_TOO_LARGE,
    )


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def too_large(max_bytes: int) -> BodyError:
    """The 413 error for a body whose wire size is over ``max_bytes``."""
    return _too_large(max_bytes)


__all__ = [
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPE_PROTOBUF",
    "FORMAT_JSON",
    "FORMAT_PROTOBUF",
    "BodyError",
    "body_format",
    "decode_request",
    "decompress",
    "encode_response",
    "error_body",
    "parse_request",
    "too_large",
]
