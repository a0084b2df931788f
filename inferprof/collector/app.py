"""``CollectorApp``: the running collector — receivers, API, forwarding, the engine's clock.

``start()`` binds every listener (failing at once if a port is taken), starts the
gRPC server, the HTTP servers and a background thread that advances the engine,
and returns. ``stop()`` stops accepting, finalises what the engine holds, drains
the forwarding queues (bounded by a timeout) and stops the API last.

Guarantee on ingest: a 2xx / OK answer means the engine accepted the request
(possibly with a partial rejection it reports); an overloaded engine answers 429 /
``RESOURCE_EXHAUSTED`` before accepting anything, so the exporter retries and no
span is silently lost.
"""

from __future__ import annotations

import logging
import pathlib
import threading
from typing import TYPE_CHECKING, Any

from inferprof import semconv
from inferprof._optional import require
from inferprof.collector.http_server import PATH_LOGS, PATH_METRICS
from inferprof.collector.intake import IngestOutcome, Intake, TransportMetrics
from inferprof.collector.settings import CollectorSettings

if TYPE_CHECKING:  # the receivers and forwarders are imported when the collector starts
    from inferprof.collector.forward import ForwardSet

_log = logging.getLogger(__name__)


def _url_host(host: str) -> str:
    # A wildcard bind is reachable locally; name an address clients can dial.
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class CollectorApp:
    """The collector as an object: tests and the demo start it on port 0 and read the ports.

    ``settings`` defaults to :meth:`CollectorSettings.from_env`; ``engine`` defaults
    to an :class:`~inferprof.collector.engine.Engine` built from the settings.
    ``registry`` is the Prometheus registry ``/metrics`` serves (a fresh one by
    default, so several apps in one process do not collide).
    """

    def __init__(
        self,
        settings: CollectorSettings | None = None,
        engine: Any | None = None,
        *,
        registry: Any | None = None,
    ) -> None:
        self.settings = settings if settings is not None else CollectorSettings.from_env()
        if engine is None:
            from inferprof.collector.engine import Engine

            engine = Engine(**self.settings.engine_kwargs())
        self.engine = engine
        prom = require("prometheus_client", "collector")
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self.metrics = TransportMetrics(self.registry)
        self._started = False
        self._stopped = False
        self._lock = threading.Lock()
        self._advance_stop = threading.Event()
        self._advance_thread: threading.Thread | None = None
        self._grpc: Any = None
        self._http: Any = None
        self._forwarders: Any = None
        self._ports: dict[str, int] = {}

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> CollectorApp:
        """Bind and start everything; returns once every listener accepts connections."""
        with self._lock:
            if self._started:
                raise RuntimeError("CollectorApp.start() called twice")
            self._started = True
        try:
            self._start()
        except BaseException:
            self._shutdown(flush=False)
            raise
        return self

    def _start(self) -> None:
        from inferprof.collector.grpc_server import GrpcReceiver
        from inferprof.collector.http_server import HttpServers

        s = self.settings
        token, cert, key = self._credentials()
        self._register_engine_collector()
        self._forwarders = self._make_forwarders()
        intake = Intake(self.engine, self.metrics, self._forwarders, s.retry_after_s)

        self._grpc = GrpcReceiver(
            intake,
            host=s.grpc_bind_host,
            port=s.grpc_port,
            workers=s.grpc_workers,
            max_concurrent_requests=s.max_concurrent_requests,
            max_message_bytes=s.max_body_bytes,
            auth_token=token,
            tls_cert=cert,
            tls_key=key,
        )
        self._ports["grpc"] = self._grpc.port

        self._http = HttpServers(tls_cert=s.tls_cert, tls_key=s.tls_key)
        otlp, api = self._http_apps(intake, token)
        self._ports["http"] = self._http.add(otlp, s.http_bind_host, s.http_port, "OTLP/HTTP")
        self._ports["api"] = self._http.add(api, s.api_bind_host, s.api_port, "the API")

        self._forwarders.start()
        self._grpc.start()
        self._http.start()
        self._advance_thread = threading.Thread(
            target=self._advance_loop, name="inferprof-engine-advance", daemon=True
        )
        self._advance_thread.start()
        _log.info(
            "inferprof collector listening: OTLP/gRPC %s, OTLP/HTTP %s, API %s",
            self._bound(s.grpc_bind_host, "grpc", self.otlp_grpc_endpoint),
            self._bound(s.http_bind_host, "http", self.otlp_http_endpoint),
            self._bound(s.api_bind_host, "api", self.api_url),
        )

    def _credentials(self) -> tuple[str | None, bytes | None, bytes | None]:
        """The bearer token (warning when gRPC clients cannot send it), and the TLS
        certificate and key read from their files (None: no TLS)."""
        s = self.settings
        token = s.resolved_auth_token()
        if token and not token.isascii():
            _log.warning(
                "the bearer token is not ASCII: OTLP/HTTP clients can send it (as its UTF-8 "
                "bytes), but gRPC metadata values are printable ASCII, so no OTLP/gRPC "
                "client can: use an ASCII token to authenticate gRPC exporters")
        cert = key = None
        if s.tls_enabled:
            cert = pathlib.Path(s.tls_cert).read_bytes()  # type: ignore[arg-type]
            key = pathlib.Path(s.tls_key).read_bytes()  # type: ignore[arg-type]
        return token, cert, key

    def _make_forwarders(self) -> ForwardSet:
        """A forwarder per ``--forward`` destination, its queue exposed as metrics (not
        started)."""
        from inferprof.collector.forward import Forwarder, ForwardSet

        s = self.settings
        if s.forward and s.forward_queue_bytes < s.max_body_bytes:
            _log.warning(
                "--forward-queue-bytes %d is below --max-body-bytes %d: an export larger "
                "than the forwarding queue is never forwarded (dropped and counted)",
                s.forward_queue_bytes, s.max_body_bytes)
        forwarders = []
        for url in s.forward:
            f = Forwarder(
                url,
                queue_size=s.forward_queue_size,
                queue_bytes=s.forward_queue_bytes,
                timeout_s=s.forward_timeout_s,
                compression=s.forward_compression,
                headers=s.forward_headers,
                ca_file=s.forward_ca,
                on_sent=self.metrics.sent,
                on_dropped=self.metrics.dropped,
            )
            self.metrics.forward_queue.labels(f.destination).set_function(f.queue_length)
            self.metrics.forward_queue_bytes.labels(f.destination).set_function(f.queue_bytes)
            forwarders.append(f)
        return ForwardSet(forwarders)

    def _http_apps(self, intake: Intake, token: str | None) -> tuple[Any, Any]:
        """The OTLP/HTTP and API applications, behind the bearer token when there is one."""
        from inferprof.collector.http_server import api_app, otlp_app

        s = self.settings
        otlp = otlp_app(
            intake,
            max_body_bytes=s.max_body_bytes,
            max_concurrent_requests=s.max_concurrent_requests,
            body_timeout_s=s.body_timeout_s,
        )
        if s.metrics_window_s > max(s.windows_s):
            _log.warning(
                "--metrics-window-s %g is longer than the longest of --windows-s (%g s, what "
                "the collector keeps): /metrics and the API's default window cover the "
                "last %g s", s.metrics_window_s, max(s.windows_s), max(s.windows_s))
        fleet = None
        if s.fleet_metrics:
            from inferprof.collector.fleet import FleetExposition

            fleet = FleetExposition(self.engine, s.max_series)
        api = api_app(self.engine, self.registry, default_window_s=s.metrics_window_s,
                      trace_url=s.trace_url, fleet_metrics=fleet)
        if token:
            from inferprof.collector.auth import BearerAuthMiddleware

            otlp = BearerAuthMiddleware(otlp, token=token, on_reject=self._http_rejected,
                                        otlp=True)
            api = BearerAuthMiddleware(api, token=token)
        return otlp, api

    def _bound(self, host: str, key: str, url: str) -> str:
        """What a listener is bound to, as the start-up line says it: the URL to dial, and
        for a wildcard bind that it listens on every interface (not only the loopback
        address the URL names)."""
        if host in ("0.0.0.0", "", "::"):
            shown = f"[{host}]" if host == "::" else (host or "0.0.0.0")
            return f"{shown}:{self._ports[key]} (all interfaces; locally {url})"
        return url

    def _register_engine_collector(self) -> None:
        try:
            from inferprof.collector.metrics import EngineCollector
        except ImportError:  # pragma: no cover - ships with the engine
            _log.warning("inferprof.collector.metrics is missing; /metrics has self-metrics only")
            return
        self.registry.register(
            EngineCollector(
                self.engine,
                window_s=self.settings.metrics_window_s,
                max_series=self.settings.max_series,
            )
        )

    def _http_rejected(self, path: str) -> None:
        signal = {
            PATH_METRICS: semconv.SIGNAL_METRICS,
            PATH_LOGS: semconv.SIGNAL_LOGS,
        }.get(path, semconv.SIGNAL_TRACES)
        self.metrics.request(semconv.TRANSPORT_HTTP, signal, semconv.OUTCOME_UNAUTHENTICATED)

    def _advance_loop(self) -> None:
        interval = self.settings.advance_interval_s
        while not self._advance_stop.wait(interval):
            try:
                self.engine.advance()
            except Exception:  # keep the clock running; one bad fold must not stop all
                _log.exception("engine.advance() failed")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop receiving, flush the engine, drain forwarding, stop the API. Idempotent.

        Each step takes ``timeout_s`` at most (the gRPC grace period 2 s at most, the
        HTTP servers twice, when connections must be closed by force): the flush folds
        what it can in that time and drops and counts the rest (``shutdown``), the
        forwarding queues send what they can and drop and count the rest."""
        with self._lock:
            if not self._started or self._stopped:
                return
            self._stopped = True
        self._shutdown(flush=True, timeout_s=timeout_s)

    def _shutdown(self, *, flush: bool, timeout_s: float = 5.0) -> None:
        if self._grpc is not None:
            _quietly(lambda: self._grpc.stop(grace_s=min(2.0, timeout_s)), "gRPC receiver")
        self._advance_stop.set()
        if self._advance_thread is not None:
            self._advance_thread.join(timeout_s)
        if flush:
            _quietly(lambda: self.engine.flush(timeout_s), "engine flush")
        if self._forwarders is not None:
            _quietly(lambda: self._forwarders.stop(timeout_s), "forwarders")
        if self._http is not None:
            _quietly(lambda: self._http.stop(timeout_s), "HTTP listeners")

    def __enter__(self) -> CollectorApp:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- addresses ------------------------------------------------------------------------
    def _url(self, scheme_plain: str, host: str, key: str) -> str:
        if key not in self._ports:
            raise RuntimeError("CollectorApp is not started")
        scheme = scheme_plain + ("s" if self.settings.tls_enabled else "")
        return f"{scheme}://{_url_host(host)}:{self._ports[key]}"

    @property
    def otlp_grpc_port(self) -> int:
        return self._ports["grpc"]

    @property
    def otlp_http_port(self) -> int:
        return self._ports["http"]

    @property
    def api_port(self) -> int:
        return self._ports["api"]

    @property
    def otlp_grpc_endpoint(self) -> str:
        """``http(s)://host:port`` for an OTLP gRPC exporter's ``endpoint``."""
        return self._url("http", self.settings.grpc_bind_host, "grpc")

    @property
    def otlp_http_endpoint(self) -> str:
        """Base URL of the OTLP/HTTP receiver (append ``/v1/traces`` or ``/v1/metrics``)."""
        return self._url("http", self.settings.http_bind_host, "http")

    @property
    def api_url(self) -> str:
        """Base URL of ``/metrics``, ``/api/v1/*`` and ``/healthz``."""
        return self._url("http", self.settings.api_bind_host, "api")


def _quietly(fn: Any, what: str) -> None:
    try:
        fn()
    except Exception:
        _log.exception("stopping %s failed", what)


__all__ = ["CollectorApp", "IngestOutcome", "Intake", "TransportMetrics"]
