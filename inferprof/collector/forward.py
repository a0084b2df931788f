"""Re-exporting everything received to downstream OTLP endpoints (Jaeger, Tempo, a collector).

Each destination has its own bounded queue and sender thread. Receivers hand over
the request's protobuf bytes with :meth:`Forwarder.submit`, which never blocks:
when the queue is full, in exports or in bytes, the payload is dropped and counted,
so a slow or dead downstream costs ingest nothing and holds a bounded amount of memory. A
payload that fails to send is retried a few
times (for retryable failures only) and then dropped and counted. Drops are
visible as ``inferprof_forward_dropped_total{destination,reason}``.

Payloads are forwarded byte for byte as received over OTLP/protobuf (OTLP/JSON
requests are forwarded as their protobuf encoding), including spans the engine
ignores: inferprof sits in the pipeline without filtering it.
"""

from __future__ import annotations

import gzip
import logging
import pathlib
import queue
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from inferprof import semconv
from inferprof.collector.settings import FORWARD_COMPRESSIONS, validate_forward_url

_log = logging.getLogger(__name__)

GRPC_METHODS = {
    semconv.SIGNAL_TRACES: "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    semconv.SIGNAL_METRICS: "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
    semconv.SIGNAL_LOGS: "/opentelemetry.proto.collector.logs.v1.LogsService/Export",
}
HTTP_PATHS = {
    semconv.SIGNAL_TRACES: "/v1/traces",
    semconv.SIGNAL_METRICS: "/v1/metrics",
    semconv.SIGNAL_LOGS: "/v1/logs",
}

DROP_QUEUE_FULL = "queue_full"
DROP_SEND_FAILED = "send_failed"
DROP_SHUTDOWN = "shutdown"

_MAX_ATTEMPTS = 3
_BACKOFF_S = 0.2
_RETRYABLE_HTTP = frozenset({429, 502, 503, 504})


class _RetryableError(Exception):
    pass


class _GrpcSender:
    def __init__(
        self,
        target: str,
        *,
        secure: bool,
        ca_file: str | None,
        headers: Sequence[tuple[str, str]],
        compress: bool,
    ) -> None:
        import grpc

        self._grpc = grpc
        if secure:
            roots = pathlib.Path(ca_file).read_bytes() if ca_file else None
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(roots))
        else:
            self._channel = grpc.insecure_channel(target)
        # Identity (de)serialisers: the payload is already protobuf bytes.
        self._calls = {
            signal: self._channel.unary_unary(
                method, request_serializer=None, response_deserializer=None
            )
            for signal, method in GRPC_METHODS.items()
        }
        self._metadata = tuple(headers)
        self._compression = grpc.Compression.Gzip if compress else grpc.Compression.NoCompression
        self._retryable = {
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.ABORTED,
        }

    def send(self, signal: str, payload: bytes, timeout_s: float) -> None:
        try:
            self._calls[signal](
                payload, timeout=timeout_s, metadata=self._metadata, compression=self._compression
            )
        except self._grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code in self._retryable:
                raise _RetryableError(str(code)) from exc
            raise

    def close(self) -> None:
        self._channel.close()


class _HttpSender:
    def __init__(
        self,
        base_url: str,
        *,
        ca_file: str | None,
        headers: Sequence[tuple[str, str]],
        compress: bool,
    ) -> None:
        self._base = base_url.rstrip("/")
        self._headers = {**dict(headers), "Content-Type": "application/x-protobuf"}
        self._gzip = compress
        if compress:
            self._headers["Content-Encoding"] = "gzip"
        self._context = (
            ssl.create_default_context(cafile=ca_file) if base_url.startswith("https") else None
        )

    def send(self, signal: str, payload: bytes, timeout_s: float) -> None:
        req = urllib.request.Request(
            self._base + HTTP_PATHS[signal],
            data=gzip.compress(payload, 6) if self._gzip else payload,
            method="POST",
            headers=self._headers,
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s, context=self._context) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code in _RETRYABLE_HTTP:
                raise _RetryableError(f"HTTP {exc.code}") from exc
            raise
        except (urllib.error.URLError, OSError) as exc:
            raise _RetryableError(str(exc)) from exc

    def close(self) -> None:
        pass


class _FileSender:
    """Appends exports to an inferprof protobuf dump, so a run can be recorded by
    ``inferprof collect --forward file:///path`` and read later by ``inferprof report``.
    Logs are not part of the dump format and are skipped."""

    def __init__(self, path: str) -> None:
        from inferprof.collector.otlp_json import PB_KIND_METRICS, PB_KIND_TRACES, PB_MAGIC

        self._kinds = {
            semconv.SIGNAL_TRACES: PB_KIND_TRACES, semconv.SIGNAL_METRICS: PB_KIND_METRICS,
        }
        self._fh = open(path, "ab")  # noqa: SIM115 - held open for the forwarder's lifetime
        if self._fh.tell() == 0:
            self._fh.write(PB_MAGIC)
            self._fh.flush()

    def send(self, signal: str, payload: bytes, timeout_s: float) -> None:
        from inferprof.collector.otlp_json import pb_record

        kind = self._kinds.get(signal)
        if kind is not None:
            self._fh.write(pb_record(kind, payload))
            self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def destination_label(url: str) -> str:
    """``scheme://host:port[/path]`` without credentials, for metric labels and logs."""
    scheme, _, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    netloc = netloc.rsplit("@", 1)[-1]
    return f"{scheme}://{netloc}{slash}{path}"


class Forwarder:
    """One downstream destination: a bounded queue drained by a daemon thread."""

    def __init__(
        self,
        url: str,
        *,
        queue_size: int,
        timeout_s: float,
        queue_bytes: int = 64 * 1024 * 1024,
        headers: Sequence[tuple[str, str]] = (),
        ca_file: str | None = None,
        compression: str = "gzip",
        on_sent: Callable[[str, str], None] | None = None,
        on_dropped: Callable[[str, str, int], None] | None = None,
    ) -> None:
        validate_forward_url(url)
        if compression not in FORWARD_COMPRESSIONS:
            raise ValueError(
                f"compression must be one of {FORWARD_COMPRESSIONS}, got {compression!r}"
            )
        if queue_size < 1:
            raise ValueError(f"queue_size must be positive, got {queue_size!r}")
        if queue_bytes < 1:
            raise ValueError(f"queue_bytes must be positive, got {queue_bytes!r}")
        self._max_bytes = queue_bytes
        #: bytes of the payloads queued (not yet taken by the sender thread)
        self._bytes = 0
        self._bytes_lock = threading.Lock()
        self.url = url
        self.destination = destination_label(url)
        self._timeout_s = timeout_s
        self._queue: queue.Queue[tuple[str, bytes]] = queue.Queue(maxsize=queue_size)
        self._on_sent = on_sent or (lambda dest, signal: None)
        self._on_dropped = on_dropped or (lambda dest, reason, n: None)
        for reason in (DROP_QUEUE_FULL, DROP_SEND_FAILED, DROP_SHUTDOWN):
            self._count_drop(reason, 0)  # each drop series from the start, at 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._busy = 0
        scheme, _, rest = url.partition("://")
        if scheme in ("otlp-grpc", "otlp-grpcs"):
            self._sender: Any = _GrpcSender(
                rest.split("/", 1)[0],
                secure=scheme == "otlp-grpcs",
                ca_file=ca_file,
                headers=headers,
                compress=compression == "gzip",
            )
        elif scheme == "file":
            self._sender = _FileSender(urllib.parse.unquote(rest))
        else:
            self._sender = _HttpSender(
                url, ca_file=ca_file, headers=headers, compress=compression == "gzip"
            )

    def queue_length(self) -> int:
        return self._queue.qsize()

    def queue_bytes(self) -> int:
        return self._bytes

    def submit(self, signal: str, payload: bytes) -> bool:
        """Queue ``payload`` for sending; never blocks. False (and counted) when the queue
        is full: ``queue_size`` exports, or ``queue_bytes`` bytes with this one."""
        size = len(payload)
        with self._bytes_lock:
            fits = self._bytes + size <= self._max_bytes
            if fits:
                try:
                    self._queue.put_nowait((signal, payload))
                    self._bytes += size
                except queue.Full:
                    fits = False
        if not fits:
            self._count_drop(DROP_QUEUE_FULL, 1)
        return fits

    def _taken(self, payload: bytes) -> None:
        with self._bytes_lock:
            self._bytes -= len(payload)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"inferprof-forward {self.destination}", daemon=True
        )
        self._thread.start()

    def idle(self) -> bool:
        """Nothing queued and nothing being sent."""
        return not (self._queue.qsize() or self._busy)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued for up to ``timeout_s``, then drop (and count) the rest.

        A send still in flight at the deadline (a downstream that hangs) is abandoned to
        its daemon thread: stopping takes ``timeout_s`` at most, whatever the downstream
        does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.idle():
            time.sleep(0.02)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        left = 0
        while True:
            try:
                _, payload = self._queue.get_nowait()
                self._taken(payload)
                left += 1
            except queue.Empty:
                break
        if left:
            self._count_drop(DROP_SHUTDOWN, left)
        try:
            self._sender.close()
        except Exception:  # closing a broken channel must not fail shutdown
            _log.debug("closing forwarder %s failed", self.destination, exc_info=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                signal, payload = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self._taken(payload)
            self._busy = 1
            try:
                self._send_with_retries(signal, payload)
            finally:
                self._busy = 0

    def _send_with_retries(self, signal: str, payload: bytes) -> None:
        for attempt in range(_MAX_ATTEMPTS):
            try:
                self._sender.send(signal, payload, self._timeout_s)
                try:
                    self._on_sent(self.destination, signal)
                except Exception:  # a metrics hiccup must not fail the send
                    _log.debug("forward sent hook failed", exc_info=True)
                return
            except _RetryableError as exc:
                last = exc
                if attempt + 1 < _MAX_ATTEMPTS and self._stop.wait(_BACKOFF_S * 2**attempt):
                    break
            except Exception as exc:  # non-retryable: the downstream refused this payload
                last = exc
                break
        _log.warning(
            "forwarding to %s failed, payload dropped: %s", self.destination, _reason(last)
        )
        self._count_drop(DROP_SEND_FAILED, 1)

    def _count_drop(self, reason: str, n: int) -> None:
        try:
            self._on_dropped(self.destination, reason, n)
        except Exception:  # a metrics hiccup must not fail the drop
            _log.debug("forward drop hook failed", exc_info=True)


class ForwardSet:
    """All destinations; :meth:`submit` fans a payload out to each."""

    def __init__(self, forwarders: Sequence[Forwarder]) -> None:
        self.forwarders = tuple(forwarders)

    def __bool__(self) -> bool:
        return bool(self.forwarders)

    def submit(self, signal: str, payload: bytes) -> None:
        for f in self.forwarders:
            f.submit(signal, payload)

    def start(self) -> None:
        for f in self.forwarders:
            f.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Drain every destination at once for up to ``timeout_s`` in all, then stop each
        (``Forwarder.stop``): a hung destination does not take the others' time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(f.idle() for f in self.forwarders):
            time.sleep(0.02)
        for f in self.forwarders:
            f.stop(0.0)



def _reason(exc: BaseException) -> str:
    """One line for a failed send: a gRPC error's code and details (its str() is a
    multi-line dump of the call), else the exception as it prints."""
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    if callable(code) and callable(details):
        try:
            name = getattr(code(), "name", code())
            return f"{name}: {details()}"
        except Exception:  # not a grpc.RpcError after all
            pass
    return " ".join(str(exc).split()) or type(exc).__name__

__all__ = ["DROP_QUEUE_FULL", "DROP_SEND_FAILED", "ForwardSet", "Forwarder", "destination_label"]
