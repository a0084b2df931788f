"""HTTP listeners of the collector: the OTLP/HTTP receiver and the API/Prometheus endpoint.

Both are Starlette apps served by uvicorn on one asyncio loop in a background
thread, so :meth:`HttpServers.start` returns once the sockets accept connections.
Sockets are bound in the caller's thread first: a port already in use fails
``start()`` at once, and port 0 gives an ephemeral port known before serving.

Decoding and folding are CPU work; they run in Starlette's thread pool so the
loop keeps answering ``/healthz`` and ``/metrics`` while a large export is parsed.

An OTLP/HTTP body is read in full, within a deadline, before the export takes one of
the ``max_concurrent_requests`` processing slots: clients that send their bodies slowly
hold no slot, and are cut off with 408 at the deadline. What bodies being read hold
together is bounded in bytes (as much as the processing slots may hold), not in count:
a count could be filled by connections trickling a byte each, as the slots were; a
connection costs the server memory whether its body is being read or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from inferprof import semconv
from inferprof._optional import require
from inferprof.collector.decode import (
    FORMAT_PROTOBUF,
    BodyError,
    body_format,
    decompress,
    encode_response,
    error_body,
    parse_request,
    too_large,
)
from inferprof.collector.examples import with_links

if TYPE_CHECKING:  # pragma: no cover
    from prometheus_client import CollectorRegistry

    from inferprof.collector.intake import Intake

_log = logging.getLogger(__name__)

PATH_TRACES = "/v1/traces"
PATH_METRICS = "/v1/metrics"
PATH_LOGS = "/v1/logs"
PATH_HEALTHZ = "/healthz"
PATH_METRICS_SCRAPE = "/metrics"
#: the fleet families (collector/fleet.py), with --fleet-metrics: a scrape of its own
PATH_FLEET_METRICS_SCRAPE = "/metrics/fleet"
PATH_BREAKDOWN = "/api/v1/breakdown"
PATH_SERVICES = "/api/v1/services"


def _json(status: int, doc: Any, headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import Response

    return Response(
        json.dumps(doc), status_code=status, media_type="application/json", headers=headers
    )


# --- OTLP/HTTP receiver ---------------------------------------------------------------


class _ReadersFull(Exception):
    """The bodies being read together hold as many bytes as the processing slots may."""


def otlp_app(
    intake: Intake, *, max_body_bytes: int, max_concurrent_requests: int,
    body_timeout_s: float = 10.0,
) -> Any:
    """The ASGI app serving ``POST /v1/traces``, ``/v1/metrics`` and ``/v1/logs``."""
    require("starlette", "collector")
    from starlette.applications import Starlette
    from starlette.routing import Route

    receiver = _OtlpReceiver(intake, max_body_bytes, max_concurrent_requests, body_timeout_s)

    async def healthz(request: Any) -> Any:
        return _json(200, {"status": "ok"})

    return Starlette(
        routes=[
            Route(PATH_TRACES, receiver.endpoint(semconv.SIGNAL_TRACES), methods=["POST"]),
            Route(PATH_METRICS, receiver.endpoint(semconv.SIGNAL_METRICS), methods=["POST"]),
            Route(PATH_LOGS, receiver.endpoint(semconv.SIGNAL_LOGS), methods=["POST"]),
            Route(PATH_HEALTHZ, healthz, methods=["GET"]),
        ]
    )


class _OtlpReceiver:
    """The OTLP/HTTP export endpoints: read a body within its deadline, then decode and
    ingest it in one of the bounded processing slots, answering as OTLP/HTTP says."""

    def __init__(self, intake: Intake, max_body_bytes: int, max_concurrent_requests: int,
                 body_timeout_s: float) -> None:
        from starlette.concurrency import run_in_threadpool
        from starlette.requests import ClientDisconnect
        from starlette.responses import Response

        self.intake = intake
        self.max_body_bytes = max_body_bytes
        self.max_concurrent_requests = max_concurrent_requests
        self.body_timeout_s = body_timeout_s
        self.in_flight = 0  # requests being decoded/ingested; bounded to keep memory bounded
        self.buffered = 0  # bytes of the bodies being read (before a processing slot is taken)
        self.max_buffered = max_concurrent_requests * max_body_bytes
        self._response = Response
        self._disconnect = ClientDisconnect
        self._in_threadpool = run_in_threadpool

    # --- answers --------------------------------------------------------------------------
    def fail(self, signal: str, exc: BodyError, fmt: Any) -> Any:
        self.intake.metrics.request(_HTTP, signal, exc.outcome)
        if exc.status == 400:
            self.intake.metrics.decode_error(_HTTP, fmt or "unknown")
        body, ctype = error_body(exc.reason, fmt, exc.status)
        return self._response(body, status_code=exc.status, media_type=ctype)

    def overloaded(self, signal: str, message: str, fmt: Any, *, count: bool = True) -> Any:
        if count:  # the intake has counted overloads the engine reported
            self.intake.metrics.request(_HTTP, signal, semconv.OUTCOME_OVERLOADED)
        body, ctype = error_body(message, fmt, 429)
        retry = str(max(1, math.ceil(self.intake.retry_after_s)))
        return self._response(body, status_code=429, media_type=ctype,
                              headers={"Retry-After": retry})

    def timed_out(self, signal: str, fmt: Any) -> Any:
        self.intake.metrics.request(_HTTP, signal, semconv.OUTCOME_BODY_TIMEOUT)
        body, ctype = error_body(
            f"the request body did not arrive within {self.body_timeout_s:g} s "
            "(--body-timeout-s)", fmt, 408)
        # The rest of the body may still be on its way: the connection cannot be reused.
        return self._response(body, status_code=408, media_type=ctype,
                              headers={"Connection": "close"})

    def answer(self, signal: str, fmt: Any, outcome: Any) -> Any:
        """The response to an export the intake took (or refused)."""
        if outcome.overloaded:
            return self.overloaded(signal, outcome.error_message, fmt, count=False)
        if outcome.failed:
            body, ctype = error_body(outcome.error_message, fmt, 500)
            return self._response(body, status_code=500, media_type=ctype)
        body, ctype = encode_response(
            signal, fmt, rejected=outcome.rejected, error_message=outcome.error_message
        )
        return self._response(body, status_code=200, media_type=ctype)

    # --- one export -----------------------------------------------------------------------
    def endpoint(self, signal: str) -> Callable[[Any], Any]:
        async def handle(request: Any) -> Any:
            fmt = None
            try:
                fmt = body_format(request.headers.get("content-type"))
                length = request.headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
                    raise too_large(self.max_body_bytes)
            except BodyError as exc:
                return self.fail(signal, exc, fmt)
            self.intake.metrics.enter(_HTTP)
            try:
                return await self.receive(signal, request, fmt)
            finally:
                self.intake.metrics.leave(_HTTP)

        return handle

    async def read_body(self, request: Any, chunks: bytearray) -> None:
        async for chunk in request.stream():
            chunks += chunk
            self.buffered += len(chunk)
            if len(chunks) > self.max_body_bytes:
                raise too_large(self.max_body_bytes)
            if self.buffered > self.max_buffered:
                raise _ReadersFull

    async def receive(self, signal: str, request: Any, fmt: Any) -> Any:
        """Read the body within the deadline, then process it in a processing slot."""
        chunks = bytearray()
        try:
            await asyncio.wait_for(self.read_body(request, chunks), self.body_timeout_s)
        except self._disconnect:
            return self._response(status_code=400)
        except asyncio.TimeoutError:
            return self.timed_out(signal, fmt)
        except _ReadersFull:
            return self.overloaded(signal, "too many exports being received; retry later", fmt)
        except BodyError as exc:
            return self.fail(signal, exc, fmt)
        finally:
            self.buffered -= len(chunks)
        if self.in_flight >= self.max_concurrent_requests:
            return self.overloaded(signal, "too many concurrent exports; retry later", fmt)
        self.in_flight += 1
        try:
            self.intake.metrics.observe_body(_HTTP, signal, len(chunks))
            outcome = await self._in_threadpool(
                self.decode_and_ingest, signal, bytes(chunks), fmt,
                request.headers.get("content-encoding"),
                request.client.host if request.client else None,
            )
        except BodyError as exc:
            return self.fail(signal, exc, fmt)
        finally:
            self.in_flight -= 1
        return self.answer(signal, fmt, outcome)

    def decode_and_ingest(
        self, signal: str, raw: bytes, fmt: Any, encoding: str | None, peer: str | None
    ) -> Any:
        data = decompress(raw, encoding, self.max_body_bytes)
        message = parse_request(data, fmt, signal)
        # Forward protobuf bytes: the decompressed body itself when it was protobuf.
        payload = data if fmt == FORMAT_PROTOBUF else None
        return self.intake.ingest(_HTTP, signal, message, payload, peer)


_HTTP = semconv.TRANSPORT_HTTP


# --- API and Prometheus endpoint -----------------------------------------------------------


def api_app(
    engine: Any, registry: CollectorRegistry, *, default_window_s: float,
    trace_url: str | None = None,
    fleet_metrics: Callable[[], bytes] | None = None,
) -> Any:
    """The ASGI app serving ``/metrics``, ``/api/v1/breakdown``, ``/api/v1/services`` and
    ``/healthz``; ``trace_url``: a template (``examples.link``) giving the breakdown's
    examples a ``url``; ``fleet_metrics``: renders ``/metrics/fleet`` (absent: 404)."""
    require("starlette", "collector")
    prometheus_client = require("prometheus_client", "collector")
    from prometheus_client.exposition import choose_encoder
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    del prometheus_client  # imported for its error message only

    async def metrics(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        body = await run_in_threadpool(encoder, registry)
        return Response(body, media_type=content_type)

    async def breakdown(request: Request) -> Response:
        params = request.query_params
        service = params.get("service")
        if not service:
            return _json(400, {"error": "query parameter 'service' is required"})
        # model= (empty) selects the requests without a model, as `inferprof report
        # --model ''` does; no model parameter: all the service's models.
        model = params.get("model")
        window_s: float | None = default_window_s
        raw_window = params.get("window")
        if raw_window is not None:
            try:
                window_s = float(raw_window)
            except ValueError:
                window_s = math.nan
            if not math.isfinite(window_s) or window_s <= 0:
                return _json(
                    400,
                    {"error": f"window must be a positive number of seconds, got {raw_window!r}"},
                )
        try:
            doc = await run_in_threadpool(engine.breakdown, service, model, window_s)
        except ValueError as exc:  # e.g. a window the engine does not keep
            return _json(400, {"error": str(exc)})
        if doc is None:
            what = f"service {service!r}" + (f" with model {model!r}" if model is not None else "")
            return _json(
                404,
                {
                    "error": f"unknown {what}: no request of it in the collector's retained "
                    "data (never seen, or idle past the retention and its series reclaimed)"
                },
            )
        return _json(200, with_links(doc, trace_url))

    async def services(request: Request) -> Response:
        return _json(200, {"services": await run_in_threadpool(engine.services)})

    async def healthz(request: Request) -> Response:
        return _json(200, {"status": "ok"})

    routes = [
        Route(PATH_METRICS_SCRAPE, metrics, methods=["GET"]),
        Route(PATH_BREAKDOWN, breakdown, methods=["GET"]),
        Route(PATH_SERVICES, services, methods=["GET"]),
        Route(PATH_HEALTHZ, healthz, methods=["GET"]),
    ]
    if fleet_metrics is not None:
        render = fleet_metrics

        async def fleet(request: Request) -> Response:
            body = await run_in_threadpool(render)
            return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

        routes.append(Route(PATH_FLEET_METRICS_SCRAPE, fleet, methods=["GET"]))
    return Starlette(routes=routes)


# --- serving ---------------------------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``OSError`` if the port is taken)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(512)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class HttpServers:
    """Several uvicorn servers on one event loop in one daemon thread."""

    def __init__(self, *, tls_cert: str | None = None, tls_key: str | None = None) -> None:
        self._uvicorn = require("uvicorn", "collector")
        self._tls = (tls_cert, tls_key)
        self._servers: list[tuple[Any, socket.socket]] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None

    def add(self, app: Any, host: str, port: int, what: str = "HTTP") -> int:
        """Bind ``app`` to ``host:port`` now; returns the bound port. ``what`` names the
        listener in the error when the port cannot be had."""
        try:
            sock = bind_socket(host, port)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen for {what} on {host}:{port}: "
                                     f"{exc.strerror or exc}") from exc
        config = self._uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=self._tls[0],
            ssl_keyfile=self._tls[1],
            timeout_graceful_shutdown=2,
            server_header=False,
        )
        self._servers.append((self._uvicorn.Server(config), sock))
        return sock.getsockname()[1]

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name="inferprof-http", daemon=True)
        self._thread.start()
        self._thread.join(0)
        deadline = timeout_s
        waited = 0.0
        while waited < deadline:
            if self._error is not None:
                raise RuntimeError(f"HTTP listener failed to start: {self._error}") from self._error
            if all(server.started for server, _ in self._servers):
                return
            if not self._thread.is_alive():
                break
            threading.Event().wait(0.01)
            waited += 0.01
        raise RuntimeError("HTTP listeners did not start in time")

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            await asyncio.gather(*(server.serve(sockets=[sock]) for server, sock in self._servers))

        try:
            asyncio.run(main())
        except BaseException as exc:
            self._error = exc
            _log.exception("inferprof HTTP listeners stopped with an error")

    def stop(self, timeout_s: float = 5.0) -> None:
        for server, _ in self._servers:
            server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                for server, _ in self._servers:
                    server.force_exit = True
                self._thread.join(timeout_s)
        for _, sock in self._servers:
            try:
                sock.close()
            except OSError:
                pass


__all__ = ["HttpServers", "api_app", "bind_socket", "otlp_app"]
