"""``InferprofMiddleware``: pure ASGI middleware opening one request per HTTP request.

It times ``receive`` by wrapping the ASGI ``receive`` callable (from the app's first read to
the last body chunk) and ``serialize`` by wrapping ``send`` (from ``http.response.start``
to the last body chunk), counting ``inferprof.bytes`` both ways, without buffering: a
streaming response (SSE, ``StreamingResponse``) flows through chunk by chunk and
``serialize`` covers the whole stream. The request ends when the last body chunk has been
handed to the server, so background tasks that run afterwards are not counted as latency.

When ``opentelemetry-instrumentation-fastapi`` (or any ASGI instrumentation) already opened
a SERVER span for the request, that span is enriched (model name, sample weight) and
inferprof's stages hang under it, instead of a second request span being created.

Nothing about the request's content (bodies, header values) is recorded unless
``record_content=True``; then only a prefix of each body (``content_max_bytes``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import propagate
from opentelemetry import trace as trace_api
from opentelemetry.semconv.attributes import http_attributes, url_attributes
from opentelemetry.trace import SpanKind

from inferprof import _config, semconv
from inferprof.instrumentation.records import SCOPE, RequestRecord, StageRecord
from inferprof.instrumentation.runtime import Runtime, new_span_id
from inferprof.instrumentation.stage import begin_request

_logger = logging.getLogger(__name__)
_time_ns = time.time_ns
_PROPAGATION_HEADERS = frozenset((b"traceparent", b"tracestate", b"baggage"))
_STAGE_RECEIVE = semconv.STAGE_RECEIVE
_STAGE_SERIALIZE = semconv.STAGE_SERIALIZE
_ATTR_BYTES = semconv.ATTR_BYTES
_METHOD = http_attributes.HTTP_REQUEST_METHOD
_PATH = url_attributes.URL_PATH
_SCHEME = url_attributes.URL_SCHEME

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Exchange:
    """Per-request state, and the wrapped ``receive``/``send`` the app is given (bound
    methods: fewer objects per request than two closures and their cells)."""

    __slots__ = (
        "rec",
        "receive_stage",
        "received",
        "serialize_stage",
        "sent",
        "status",
        "request_body",
        "response_body",
        "last_byte",
        "limit",
        "_receive",
        "_send",
    )

    def __init__(self, rec: RequestRecord, limit: int | None, receive: Receive,
                 send: Send) -> None:
        self.rec = rec
        self.receive_stage: StageRecord | None = None
        self.received = 0
        self.serialize_stage: StageRecord | None = None
        self.sent = 0
        self.status: int | None = None
        self.limit = limit  # None: record no content
        self.request_body = bytearray() if limit else None
        self.response_body = bytearray() if limit else None
        self.last_byte: int | None = None
        self._receive = receive
        self._send = send

    async def receive(self) -> Message:
        st = self.receive_stage
        if st is not None and st.end is not None:
            return await self._receive()
        t0 = _time_ns()
        message = await self._receive()
        if message.get("type") == "http.request":
            if st is None:
                st = self.receive_stage = StageRecord(_STAGE_RECEIVE, new_span_id(), None, t0, {})
            body = message.get("body") or b""
            self.received += len(body)
            if self.request_body is not None and len(self.request_body) < self.limit:
                self.request_body += body[: self.limit - len(self.request_body)]
            if not message.get("more_body", False):
                st.end = _time_ns()
                st.attrs[_ATTR_BYTES] = self.received
                # A body-less request (GET; or a streaming response listening for
                # disconnects) has nothing to time: no `receive` stage for it.
                if self.received:
                    self.rec.stages.append(st)
        return message

    async def send(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.body":
            body = message.get("body") or b""
            self.sent += len(body)
            if self.response_body is not None and len(self.response_body) < self.limit:
                self.response_body += body[: self.limit - len(self.response_body)]
            await self._send(message)
            if not message.get("more_body", False):
                now = _time_ns()
                st = self.serialize_stage
                if st is not None and st.end is None:
                    st.end = now
                    st.attrs[_ATTR_BYTES] = self.sent
                self.last_byte = now
            return
        if kind == "http.response.start":
            self.status = message.get("status")
            st = self.serialize_stage = StageRecord(
                _STAGE_SERIALIZE, new_span_id(), None, _time_ns(), {}
            )
            self.rec.stages.append(st)
        await self._send(message)


class InferprofMiddleware:
    """ASGI middleware: ``app.add_middleware(InferprofMiddleware, model_name="m")``.

    Options (each defaults to ``configure()``'s setting, then its environment variable):

    * ``excluded_paths``: paths served untraced (exact match; an entry ending in ``*`` is a
      prefix). Default ``/healthz /health /livez /readyz /metrics /favicon.ico``;
      env ``INFERPROF_EXCLUDED_PATHS`` (comma separated).
    * ``model_name``: ``inferprof.model.name`` on every request span.
    * ``tracer_provider`` / ``meter_provider``: use these instead of ``configure()``'s.
    * ``record_content`` / ``content_max_bytes``: opt in to recording body prefixes.
    * ``span_name``: ``callable(scope) -> str`` overriding ``"<METHOD> <route>"``.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        excluded_paths: Any = None,
        model_name: str | None = None,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        record_content: bool | None = None,
        content_max_bytes: int | None = None,
        span_name: Callable[[Scope], str] | None = None,
    ) -> None:
        if model_name is not None and not isinstance(model_name, str):
            raise ValueError(f"model_name must be a string, got {model_name!r}")
        if span_name is not None and not callable(span_name):
            raise ValueError(f"span_name must be callable, got {span_name!r}")
        if record_content is not None and not isinstance(record_content, bool):
            raise ValueError(f"record_content must be a bool, got {record_content!r}")
        self.app = app
        paths = (
            _config.excluded_paths_setting(excluded_paths) if excluded_paths is not None else None
        )
        # None: follow the runtime's configuration (configure(excluded_paths=...) / env).
        self._excluded_paths = split_paths(paths) if paths is not None else None
        self.model_name = model_name
        self._record_content = record_content
        self._content_max_bytes = content_max_bytes
        if content_max_bytes is not None and (
            isinstance(content_max_bytes, bool)
            or not isinstance(content_max_bytes, int)
            or content_max_bytes < 1
        ):
            raise ValueError(f"content_max_bytes must be a positive int, got {content_max_bytes!r}")
        self._span_name = span_name
        self._runtime: Runtime | None = None
        if tracer_provider is not None:
            config = _config._resolve(
                record_content=record_content,
                content_max_bytes=content_max_bytes,
                excluded_paths=paths,
                owns=False,
            )
            self._runtime = Runtime(config, tracer_provider, meter_provider)

    def _excluded(self, path: str, rt: Runtime) -> bool:
        exact, prefixes = self._excluded_paths or rt.excluded_paths
        if path in exact:
            return True
        for prefix in prefixes:
            if path.startswith(prefix):
                return True
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rt = self._runtime
        if rt is None:
            rt = _config.active_runtime()
        if rt is None or not rt.enabled or self._excluded(scope.get("path", ""), rt):
            await self.app(scope, receive, send)
            return
        outer = SCOPE.get()
        if outer is not None and isinstance(outer[0], RequestRecord):  # installed twice
            await self.app(scope, receive, send)
            return
        try:
            ex, token, otel_token = self._open(rt, scope, receive, send)
        except Exception:
            _logger.exception("inferprof could not open a request; serving it untraced")
            await self.app(scope, receive, send)
            return
        rec = ex.rec
        try:
            await self.app(scope, ex.receive, ex.send)
        except BaseException as exc:
            rec.error = exc
            raise
        finally:
            self._close(rt, scope, ex, token, otel_token)

    # --- open / close --------------------------------------------------------------------
    def _open(
        self, rt: Runtime, scope: Scope, receive: Receive, send: Send
    ) -> tuple[_Exchange, Any, Any]:
        start = _time_ns()
        parent = None
        carrier = {}
        for key, value in scope.get("headers") or ():
            if key in _PROPAGATION_HEADERS:
                carrier[key.decode("latin-1")] = value.decode("latin-1")
        if carrier:
            sc = trace_api.get_current_span(propagate.extract(carrier)).get_span_context()
            parent = sc if sc.is_valid else None
        method = scope.get("method", "GET")
        attrs: dict[str, Any] = {
            _METHOD: method,
            _PATH: scope.get("path", ""),
            _SCHEME: scope.get("scheme", "http"),
        }
        if self.model_name is not None:
            attrs[semconv.ATTR_MODEL_NAME] = self.model_name
        rec = begin_request(rt, method, SpanKind.SERVER, attrs, parent, start)
        record_content = self._record_content
        if record_content is None:
            record_content = rt.config.record_content
        limit = None
        if record_content:
            limit = self._content_max_bytes or rt.config.content_max_bytes
        ex = _Exchange(rec, limit, receive, send)
        token = SCOPE.set((rec, None))
        otel_token = None
        if rec.live_span is None:
            # One attach per request (not per stage): downstream clients inject our
            # traceparent and other instrumentations parent their spans on the request.
            otel_token = context_api.attach(
                trace_api.set_span_in_context(trace_api.NonRecordingSpan(rec.span_context))
            )
        return ex, token, otel_token

    def _close(self, rt: Runtime, scope: Scope, ex: _Exchange, token: Any, otel_token: Any) -> None:
        rec = ex.rec
        now = _time_ns()
        try:
            SCOPE.reset(token)
        except ValueError:
            SCOPE.set(None)
        if otel_token is not None:
            try:
                context_api.detach(otel_token)
            except Exception:
                pass
        try:
            st = ex.receive_stage
            if st is not None and st.end is None and ex.received:  # the body was cut short
                st.end = now
                st.attrs[semconv.ATTR_BYTES] = ex.received
                rec.stages.append(st)
            st = ex.serialize_stage
            if st is not None and st.end is None:  # the app failed mid-response
                st.end = now
                st.attrs[semconv.ATTR_BYTES] = ex.sent
            route = scope.get("route")
            template = getattr(route, "path", None) if route is not None else None
            if template:
                rec.set_attribute(http_attributes.HTTP_ROUTE, template)
            if rec.live_span is None:
                if self._span_name is not None:
                    rec.name = self._span_name(scope)
                elif template:
                    rec.name = f"{rec.name} {template}"
            if ex.status is not None:
                rec.set_attribute(http_attributes.HTTP_RESPONSE_STATUS_CODE, ex.status)
                if ex.status >= 500 and rec.error is None:
                    rec.error = f"HTTP {ex.status}"
            if ex.limit:
                rec.set_attribute(
                    semconv.ATTR_REQUEST_BODY, bytes(ex.request_body).decode("utf-8", "replace")
                )
                rec.set_attribute(
                    semconv.ATTR_RESPONSE_BODY, bytes(ex.response_body).decode("utf-8", "replace")
                )
        except Exception:
            _logger.exception("inferprof could not finish a request's attributes")
        rec.end = ex.last_byte or now
        rt.finish_request(rec)


def split_paths(paths: tuple[str, ...]) -> tuple[frozenset, tuple]:
    """Excluded paths as (exact matches, prefixes); a trailing ``*`` marks a prefix."""
    return frozenset(p for p in paths if not p.endswith("*")), tuple(
        p[:-1] for p in paths if p.endswith("*")
    )


def instrument(app: Any, **options: Any) -> Any:
    """``inferprof.fastapi.instrument(app, model_name="m")``: add the middleware; returns app."""
    if not hasattr(app, "add_middleware"):
        raise ValueError(f"instrument() needs a Starlette/FastAPI app, got {app!r}")
    app.add_middleware(InferprofMiddleware, **options)
    return app


__all__ = ["InferprofMiddleware", "instrument"]
