"""The OTLP/gRPC receiver: ``TraceService/Export``, ``MetricsService/Export`` and
``LogsService/Export`` (logs are received only to be forwarded).

Handlers are registered with identity deserialisers so the receiver sees the
request's original bytes: it parses them itself (malformed protobuf ->
``INVALID_ARGUMENT`` with a reason, instead of grpc's opaque internal error) and
can forward them unchanged. Overload answers ``RESOURCE_EXHAUSTED`` with a
``RetryInfo`` delay (which the OTLP exporters honour and retry on); more
concurrent calls than ``max_concurrent_requests`` are refused by grpc itself with
``RESOURCE_EXHAUSTED``.
"""

from __future__ import annotations

import errno
import logging
import socket
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import duration_pb2

from inferprof import semconv
from inferprof.collector.auth import GrpcAuthInterceptor
from inferprof.collector.decode import FORMAT_PROTOBUF, BodyError, encode_response, parse_request

if TYPE_CHECKING:  # pragma: no cover
    from inferprof.collector.intake import Intake

_log = logging.getLogger(__name__)

_SERVICES = {
    semconv.SIGNAL_TRACES: "opentelemetry.proto.collector.trace.v1.TraceService",
    semconv.SIGNAL_METRICS: "opentelemetry.proto.collector.metrics.v1.MetricsService",
    semconv.SIGNAL_LOGS: "opentelemetry.proto.collector.logs.v1.LogsService",
}
# Trailing-metadata keys that carry the retry delay: the standard rich-status
# details and the key the Python OTLP exporter reads.
_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_RETRY_INFO_KEY = "google.rpc.retryinfo-bin"


def _retry_metadata(retry_after_s: float, message: str) -> tuple[tuple[str, bytes], ...]:
    from google.protobuf import any_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2

    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(retry_after_s * 1e9))
    info = error_details_pb2.RetryInfo(retry_delay=delay)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message, details=[detail])
    return (
        (_STATUS_DETAILS_KEY, status.SerializeToString()),
        (_RETRY_INFO_KEY, info.SerializeToString()),
    )


class _ExportHandler:
    def __init__(self, intake: Intake, signal: str) -> None:
        self._intake = intake
        self._signal = signal

    def __call__(self, payload: bytes, context: grpc.ServicerContext) -> bytes:
        metrics = self._intake.metrics
        metrics.enter(semconv.TRANSPORT_GRPC)
        try:
            return self._export(payload, context)
        finally:
            metrics.leave(semconv.TRANSPORT_GRPC)

    def _export(self, payload: bytes, context: grpc.ServicerContext) -> bytes:
        intake = self._intake
        transport = semconv.TRANSPORT_GRPC
        intake.metrics.observe_body(transport, self._signal, len(payload))
        try:
            message = parse_request(payload, FORMAT_PROTOBUF, self._signal)
        except BodyError as exc:
            intake.metrics.request(transport, self._signal, exc.outcome)
            intake.metrics.decode_error(transport, "protobuf")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.reason)
        outcome = intake.ingest(transport, self._signal, message, payload, _peer_host(context))
        if outcome.overloaded:
            context.set_trailing_metadata(
                _retry_metadata(intake.retry_after_s, outcome.error_message)
            )
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, outcome.error_message)
        if outcome.failed:
            context.abort(grpc.StatusCode.INTERNAL, outcome.error_message)
        body, _ = encode_response(
            self._signal,
            FORMAT_PROTOBUF,
            rejected=outcome.rejected,
            error_message=outcome.error_message,
        )
        return body


def _peer_host(context: grpc.ServicerContext) -> str | None:
    """The client's address without its port: ``ipv4:10.0.0.7:51234`` -> ``10.0.0.7``."""
    try:
        peer = context.peer()
    except Exception:  # a peer we cannot name shares the unnamed sender's slot
        return None
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rsplit(":", 1)[0]
        return host.strip("[]")
    return peer


def _handlers(intake: Intake) -> list[grpc.GenericRpcHandler]:
    out = []
    for signal, service in _SERVICES.items():
        handler = grpc.unary_unary_rpc_method_handler(
            _ExportHandler(intake, signal),
            request_deserializer=None,  # keep the wire bytes
            response_serializer=None,
        )
        out.append(grpc.method_handlers_generic_handler(service, {"Export": handler}))
    return out


class GrpcReceiver:
    """A grpcio server bound at construction (so the port is known at once)."""

    def __init__(
        self,
        intake: Intake,
        *,
        host: str,
        port: int,
        workers: int,
        max_concurrent_requests: int,
        max_message_bytes: int,
        auth_token: str | None = None,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
    ) -> None:
        interceptors: list[Any] = []
        if auth_token:
            interceptors.append(
                GrpcAuthInterceptor(
                    auth_token,
                    on_reject=lambda method: intake.metrics.request(
                        semconv.TRANSPORT_GRPC, _signal_of(method), semconv.OUTCOME_UNAUTHENTICATED
                    ),
                )
            )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="inferprof-grpc"),
            handlers=_handlers(intake),
            interceptors=interceptors,
            maximum_concurrent_rpcs=max_concurrent_requests,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),  # a port in use must fail, not be shared
            ],
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if port:
            _check_free(host, port, address)
        try:
            if tls_cert is not None and tls_key is not None:
                creds = grpc.ssl_server_credentials([(tls_key, tls_cert)])
                self.port = self._server.add_secure_port(address, creds)
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:  # grpcio raises this when it cannot bind
            raise OSError(f"cannot listen for OTLP/gRPC on {address}: {exc}") from exc
        if not self.port:
            raise OSError(f"cannot listen for OTLP/gRPC on {address}")

    def start(self) -> None:
        self._server.start()

    def stop(self, grace_s: float = 2.0) -> None:
        self._server.stop(grace_s).wait(grace_s + 1.0)


def _check_free(host: str, port: int, address: str) -> None:
    """Raise the collector's own error for a port in use, before grpc's core logs a
    C-level error line of its own about it (the bind below still decides)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise OSError(
                f"cannot listen for OTLP/gRPC on {address}: address already in use"
            ) from None
        # anything else (a name to resolve, an address not here): grpc's bind decides


def _signal_of(method: str) -> str:
    for signal, service in _SERVICES.items():
        if (method or "").startswith(f"/{service}/"):
            return signal
    return semconv.SIGNAL_TRACES


__all__ = ["GrpcReceiver"]
