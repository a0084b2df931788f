"""``InferprofMiddleware``: pure ASGI middleware opening one request per HTTP request.

It times ``receive`` by wrapping the ASGI ``receive`` callable (from the app's first read to
the last body chunk) and ``serialize`` by wrapping ``send`` (from ``http.response.start``
to the last body chunk), counting ``inferprof.bytes`` both ways, without buffering: a
streaming response (SSE, ``StreamingResponse``) flows through chunk by chunk and
``serialize`` covers the whole stream. The request ends when the last body chunk has been
handed to the server, so background tasks that run afterwards are not counted as latency.

Streamed responses (``text/event-stream``, or a body sent in several messages without
``content-length``) are
timed chunk by chunk for generation (contract §7, §14): the time each chunk carrying
generated content was handed to the server becomes an entry of
``inferprof.gen.emit_offsets_s``, one token per chunk unless the app says otherwise
(:func:`chunk_tokens`). These times win over the step API's own emissions
(``inferprof.Engine``): a token's time is when it leaves the service. A client that goes
away mid-stream marks the request ``inferprof.cancelled``; what was recorded is kept.

When ``opentelemetry-instrumentation-fastapi`` (or any ASGI instrumentation) already opened
a SERVER span for the request, that span is enriched (model name, sample weight) and
inferprof's stages hang under it, instead of a second request span being created.

In ``production`` mode a request the timing budget leaves untimed records nothing, but is
counted in the summaries at its end-to-end latency (contract §15, "Requests not timed")
when its route is counted: the route's last timed request was summarised, under the one
model its timed requests name (learnt at their end, :meth:`InferprofMiddleware._learn`;
requests that end before an answer starts apart from the others).

Nothing about the request's content (bodies, header values) is recorded unless
``record_content=True``; then only a prefix of each body (``content_max_bytes``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from operator import itemgetter
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import propagate
from opentelemetry import trace as trace_api
from opentelemetry.semconv.attributes import http_attributes, url_attributes
from opentelemetry.trace import SpanKind

from inferprof import semconv
from inferprof.fastapi._fastapi_compat import native_tracing
from inferprof.instrumentation.active import active_runtime
from inferprof.instrumentation.config import excluded_paths_setting, resolve
from inferprof.instrumentation.generation import COMPACT_AT, generation_attributes, merge_pairs
from inferprof.instrumentation.records import (
    SCOPE,
    UNTIMED,
    RequestRecord,
    RequestSpan,
    StageRecord,
    attach_span,
    current_otel_context,
    detach_context,
    ends_in_error,
)
from inferprof.instrumentation.runtime import Runtime
from inferprof.instrumentation.stage import begin_request, reset_scope, timed_share

_logger = logging.getLogger(__name__)
_time_ns = time.time_ns
_PROPAGATION_HEADERS = frozenset((b"traceparent", b"tracestate", b"baggage"))
_header_name = itemgetter(0)
_STAGE_RECEIVE = semconv.STAGE_RECEIVE
_STAGE_SERIALIZE = semconv.STAGE_SERIALIZE
_ATTR_BYTES = semconv.ATTR_BYTES
_MODEL_NAME = semconv.ATTR_MODEL_NAME
_METHOD = http_attributes.HTTP_REQUEST_METHOD
_PATH = url_attributes.URL_PATH
_SCHEME = url_attributes.URL_SCHEME
_ROUTE = http_attributes.HTTP_ROUTE
_STATUS_CODE = http_attributes.HTTP_RESPONSE_STATUS_CODE
_SERVER = SpanKind.SERVER
# Streamed responses (generation timing): not streamed, a chunked body, server-sent events.
_NOT_STREAMED, _CHUNKED, _SSE = 0, 1, 2
#: The chunk that ends an OpenAI-style event stream (no content).
_SSE_DONE = (b"data: [DONE]", b"data:[DONE]")
#: How an event stream's usual chunk starts: a data: field holding a JSON object.
_SSE_JSON = (b"data: {", b"data:{")
#: Emission times send()'s short path appends to at most: one more goes through
#: _chunk_sent(), which merges at COMPACT_AT.
_FAST_TIMES_MAX = COMPACT_AT - 1
#: Routes whose untimed requests the middleware counts (contract §15), at most: past it,
#: a route not yet seen is not counted.
_MAX_ROUTES = 1024
#: A route's state in ``InferprofMiddleware._route_models``: unseen, or (as a record's
#: ``summary_model``) not summarised. The other states: a model (``str`` or None), its
#: untimed requests counted under it; ``(model,)``, not counted while its last timed request
#: was not summarised; ``_MIXED``, not counted for good (two models, a generation, or an
#: unanswered request with no stage span). Keyed by ``id(route)``, ``~id(route)`` for the
#: route's requests that end before an answer starts.
_UNCOUNTED: Any = object()
_MIXED: Any = object()
# A counted untimed request's send() is a plain function returning the server's awaitable,
# not a coroutine of its own, and a closure, not an object: each would cost about as much
# as the rest of the count. So its end is when the last body chunk is handed to the
# server's send, not when that returns (as for a timed request).

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Content:
    """Body prefixes of one request, kept only when content recording is opted in."""

    __slots__ = ("limit", "request", "response")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.request = bytearray()
        self.response = bytearray()

    def add(self, buf: bytearray, body: bytes) -> None:
        if len(buf) < self.limit:
            buf += body[: self.limit - len(buf)]


class _HttpRequest(RequestRecord):
    """The record of one HTTP request, holding the middleware's state too, and the wrapped
    ``receive``/``send`` the app is given (bound methods): one object per request where
    a separate exchange object and two closures made four.

    ``receive`` and ``serialize`` are kept as timestamps on the record, and the HTTP
    attributes (route, status) as the values they come from: their stage records and
    attributes are made in :meth:`_complete`, only for a request whose trace is kept (in
    ``production`` mode most are not).
    """

    __slots__ = (
        "_otel_token",
        "_receive",
        "_scope_token",
        "_send",
        "chunk_merged",
        "chunk_times",
        "chunk_tokens",
        "content",
        "disconnected",
        "live_scope",
        "next_tokens",
        "received",
        "recv_end",
        "recv_start",
        "root_path",
        "route",
        "route_model",
        "sent",
        "ser_end",
        "ser_start",
        "sse_times",
        "status",
        "stream",
        "summary_model",
    )

    async def receive(self) -> Message:
        if self.recv_end:  # the body is in: later reads (disconnect listeners) pass through
            message = await self._receive()
            if message["type"] == "http.disconnect" and not self.ser_end:
                self.disconnected = True  # the client left before the response's end
            return message
        t0 = _time_ns()
        message = await self._receive()
        if message["type"] == "http.request":
            if not self.recv_start:
                self.recv_start = t0
            body = message.get("body")
            if body:
                self.received += len(body)
                if self.content is not None:
                    self.content.add(self.content.request, body)
            if not message.get("more_body", False):
                self.recv_end = _time_ns()
        elif message["type"] == "http.disconnect" and not self.ser_end:
            self.disconnected = True
        return message

    async def send(self, message: Message) -> None:
        times = self.sse_times
        if times is not None:
            # The usual chunk of an event stream: one token, as a data: field holding a
            # JSON object (so not [DONE]); what the general path below does for it, in
            # fewer steps. Any other chunk takes the general path.
            body = message.get("body")
            if (body.__class__ is bytes and message.get("more_body")
                    and message["type"] == "http.response.body"
                    and body.startswith(_SSE_JSON)):
                self.sent += len(body)
                handed = _time_ns()
                try:
                    await self._send(message)
                except OSError:
                    if not self.ser_end:
                        self.disconnected = True
                    raise
                times.append(handed)
                if len(times) >= _FAST_TIMES_MAX:
                    self.sse_times = None  # the next one may need merging (_chunk_sent)
                return
        if message["type"] == "http.response.body":
            body = message.get("body")
            more = message.get("more_body", False)
            if body:
                self.sent += len(body)
                if self.content is not None:
                    self.content.add(self.content.response, body)
            if self.live_scope is not None and not more:
                # The outer instrumentation (opentelemetry-instrumentation-asgi) ends its
                # span when the last body chunk passes it: its attributes go on now.
                self._enrich_live()
            stream = self.stream
            # When a chunk of a stream leaves: handed to the server, which writes it to the
            # socket in this call (a time taken after the call may follow the client's read)
            handed = 0
            if stream and body:
                if stream == _SSE:
                    # content: a data: field other than the [DONE] OpenAI-style streams
                    # end with (comments, keep-alives and bare event: lines dispatch nothing).
                    # find(), not `in`: bytes.__contains__ tries the operand as an int first
                    # and builds a TypeError for every chunk.
                    text = body if type(body) is bytes else bytes(body)  # (ASGI: bytes)
                    if text.find(b"data:") != -1 and text.strip() not in _SSE_DONE:
                        handed = _time_ns()
                # a body in one message is not a stream, whatever its headers
                elif more or self.chunk_times:
                    handed = _time_ns()
            try:
                await self._send(message)
            except OSError:  # ASGI 2.4 servers: the client went away mid-response
                if not self.ser_end:
                    self.disconnected = True
                raise
            if handed:  # (not for a chunk the server refused)
                times = self.chunk_times
                if (times is not None and self.next_tokens == 1 and self.chunk_tokens is None
                        and len(times) < _FAST_TIMES_MAX):
                    times.append(handed)  # the usual chunk: what _chunk_sent() does for it
                else:
                    self._chunk_sent(handed)
            if stream == _SSE:
                self.sse_times = self._fast_times()
            if not more and not self.ser_end:
                self.ser_end = _time_ns()  # also the request's end: the last byte handed over
            return
        if message["type"] == "http.response.start":
            self.status = message.get("status")
            self.ser_start = _time_ns()
            self.stream = stream = _stream_kind(message.get("headers"))
            if stream == _SSE and self.content is None and self.chunk_times is None:
                self.chunk_times = []  # (empty: no emission, as None)
                self.sse_times = self._fast_times()
        await self._send(message)

    def _fast_times(self) -> list[int] | None:
        """``chunk_times`` while the next chunk of an event stream takes send()'s short
        path: one token, no body recorded, no merge due."""
        times = self.chunk_times
        if (times is not None and self.next_tokens == 1 and self.chunk_tokens is None
                and self.content is None and len(times) < _FAST_TIMES_MAX):
            return times
        return None

    def _chunk_sent(self, when: int) -> None:
        """A chunk of generated content was handed to the server at ``when``: one emission
        (none for a chunk the app said carries no token)."""
        tokens, self.next_tokens = self.next_tokens, 1
        if not tokens:
            return
        times = self.chunk_times
        if times is None:
            times = self.chunk_times = []
        times.append(when)
        counts = self.chunk_tokens
        if counts is not None:
            counts.append(tokens)
        elif tokens != 1:
            counts = self.chunk_tokens = [1] * (len(times) - 1)
            counts.append(tokens)
        if len(times) >= COMPACT_AT:  # a runaway stream: bounded memory (generation module)
            if counts is None:
                counts = self.chunk_tokens = [1] * len(times)
            self.chunk_merged += merge_pairs(times, counts)

    def _summary_parts(self, flat: list) -> bool:
        # What _complete() makes, for a request with no engine stages (the runtime does
        # not summarise those): receive and serialize, and an error for a 5xx answer.
        ser_start = self.ser_start
        if self.recv_start and self.received:
            if ser_start:  # the usual case: both
                flat += (_STAGE_RECEIVE, self.recv_start, self.recv_end,
                         _STAGE_SERIALIZE, ser_start, self.ser_end)
            else:
                flat += (_STAGE_RECEIVE, self.recv_start, self.recv_end)
        elif ser_start:
            flat += (_STAGE_SERIALIZE, ser_start, self.ser_end)
        error = self.error
        if error is None:  # _complete() makes a 5xx answer the error
            status = self.status
            return status is not None and status >= 500
        return ends_in_error(error)

    def _summarised(self, model: str | None) -> bool:
        self.summary_model = model
        return self.route_model == model  # a state other than a model equals none

    def _complete(self) -> None:
        # A body-less request (GET; or a streaming response listening for disconnects)
        # has nothing to time: no `receive` stage for it.
        if self.recv_start and self.received:
            self.stages.insert(
                0,
                _ended_stage(_STAGE_RECEIVE, self.recv_start, self.recv_end, self.received),
            )
        if self.ser_start:
            start = self.ser_start
            if self.chunk_times and self.generation is not None:
                # A stream the engine's stages cover (queue, prefill, decode): serialize is
                # what follows its last token, so that the stages do not overlap (§14).
                start = min(self.chunk_times[-1], self.ser_end or start)
            self.stages.append(_ended_stage(_STAGE_SERIALIZE, start, self.ser_end, self.sent))
        status = self.status
        if status is not None and status >= 500 and self.error is None:
            self.error = f"HTTP {status}"
        generation = None
        if self.chunk_times or self.generation is not None:
            generation = generation_attributes(self, self._emissions())
        if self.live_span is not None:  # another instrumentation's span
            if self.live_scope is not None:  # no last body chunk went out (the app failed)
                self._enrich_live()
            if generation:  # on it while it records (it may have ended at the last chunk)
                self.set_attributes(generation)
            return
        # Our own request span: its attributes go straight into the record (what
        # set_attribute() does, minus the check for a live span).
        self._http_attributes(self.attrs.__setitem__)
        if generation:
            self.attrs.update(generation)

    def _emissions(self) -> tuple[list[int], list[int] | None, int] | None:
        """When the response's tokens left: each streamed chunk's time; for a generation
        the engine recorded (the step API) answered in one body, the response's end."""
        if self.chunk_times:
            return self.chunk_times, self.chunk_tokens, self.chunk_merged
        gen = self.generation
        if gen is not None and gen.output and self.ser_end and not self.stream:
            return [self.ser_end], [gen.output], 0
        return None

    def _enrich_live(self) -> None:
        """The HTTP attributes on another instrumentation's request span, while it still
        records (once)."""
        scope, self.live_scope = self.live_scope, None
        try:
            self.route = _route_template(scope, self.root_path or "")
        except Exception:
            _logger.exception("inferprof could not find the request's route")
        self._http_attributes(self.set_attribute)

    def _http_attributes(self, set_attribute: Callable[[str, Any], None]) -> None:
        if self.route:
            set_attribute(_ROUTE, self.route)
        if self.disconnected:  # e.g. a user stopping a streamed generation
            set_attribute(semconv.ATTR_CANCELLED, True)
        if self.status is not None:
            set_attribute(_STATUS_CODE, self.status)
        content = self.content
        if content is not None:
            set_attribute(
                semconv.ATTR_REQUEST_BODY, bytes(content.request).decode("utf-8", "replace")
            )
            set_attribute(
                semconv.ATTR_RESPONSE_BODY, bytes(content.response).decode("utf-8", "replace")
            )
            self.content = None


def _route_template(scope: Scope, open_root: str) -> str | None:
    """The path template of the route that served the request, mount prefixes included
    (``/v1/generate/{m}`` for ``app.mount("/v1", sub)``); None when no route matched.

    Starlette's router records the route it matched in ``scope["route"]``; a mounted
    app's router overwrites it with its own and extends ``root_path`` by the mount's
    path, which is where the prefix comes from. FastAPI 0.16x records only its own
    routes there (not ``/docs``, ``/openapi.json`` or mounted non-Starlette apps): for
    those the app's routes are matched again here.
    """
    root = scope.get("root_path") or ""
    prefix = root[len(open_root):] if root != open_root and root.startswith(open_root) else ""
    route = scope.get("route")
    if route is None:
        route, prefix = _match_route(scope, open_root, prefix)
        if route is None:
            return None
    path = getattr(route, "path", None)
    if not isinstance(path, str):
        return None
    if prefix and _is_mount(route) and prefix.endswith(path):
        return prefix  # the matched route is a mount, already in root_path
    return prefix + path


def _match_route(scope: Scope, open_root: str, prefix: str) -> tuple[Any, str]:
    """(route, prefix) of the app's route that fully matches the request, else (None, "")."""
    routes = getattr(scope.get("app"), "routes", None)
    if not routes:  # a pure ASGI app: no routes to match
        return None, ""
    routing = _starlette_routing()
    if routing is None:
        return None, ""
    # As served (the innermost Starlette app, its root_path); then from the root path the
    # request came in with (a mount whose app is not a Starlette app extends root_path
    # without a router of its own).
    candidates = [(scope, prefix)]
    if prefix:
        candidates.append(({**scope, "root_path": open_root}, ""))
    for candidate, candidate_prefix in candidates:
        for route in routes:
            try:
                match, _ = route.matches(candidate)
            except Exception:
                continue
            if match is routing.Match.FULL:
                return route, candidate_prefix
    return None, ""


def _starlette_routing() -> Any:
    """``starlette.routing``, or None without Starlette; imported once, on first use (a
    route matched again per request must not run the import machinery each time)."""
    global _routing
    if _routing is _UNSEEN:
        try:
            from starlette import routing as found
        except ImportError:
            found = None  # type: ignore[assignment]
        _routing = found
    return _routing


_UNSEEN: Any = object()
_routing: Any = _UNSEEN
_client_disconnect: Any = _UNSEEN


def _client_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says the client went away: Starlette's ``ClientDisconnect``, which
    its request reads raise on ``http.disconnect`` and its streaming responses raise when
    an ASGI 2.4 server's ``send`` raises ``OSError``. (An ``OSError`` of its own may be the
    app's: a failed upstream call is an error.) Read on an exception's path only."""
    global _client_disconnect
    if _client_disconnect is _UNSEEN:
        try:
            from starlette.requests import ClientDisconnect as found
        except ImportError:
            found = None  # type: ignore[assignment,misc]
        _client_disconnect = found
    return _client_disconnect is not None and isinstance(exc, _client_disconnect)


def _is_mount(route: Any) -> bool:
    routing = _starlette_routing()
    return routing is not None and isinstance(route, routing.Mount)


def _stream_kind(headers: Any) -> int:
    """How a response is sent, from its ``http.response.start`` headers (lower-case names,
    as ASGI servers and Starlette send them)."""
    if not headers:
        return _CHUNKED
    fields = dict(headers)
    if fields.get(b"content-type", b"")[:17].lower() == b"text/event-stream":
        return _SSE
    return _NOT_STREAMED if b"content-length" in fields else _CHUNKED


def chunk_tokens(tokens: int) -> None:
    """The next body chunk of the current request's streamed response carries ``tokens``
    output tokens (default: one per chunk); 0: it carries none and is no emission (an
    OpenAI-style chat stream's first chunk, which names the role only). Call it before
    yielding the chunk; a no-op outside a request the middleware times."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
    scope = SCOPE.get()
    if scope is not None and isinstance(scope[0], _HttpRequest):
        rec = scope[0]
        rec.next_tokens = tokens
        rec.sse_times = None  # the next chunk takes send()'s general path


def _ended_stage(name: str, start: int, end: int, nbytes: int) -> StageRecord:
    st = StageRecord(name, None, start, {_ATTR_BYTES: nbytes})
    st.end = end
    return st


class InferprofMiddleware:
    """ASGI middleware: ``app.add_middleware(InferprofMiddleware, model_name="m")``.

    Options (each defaults to ``configure()``'s setting, then its environment variable):

    * ``excluded_paths``: paths served untraced (exact match; an entry ending in ``*`` is a
      prefix). Default ``/healthz /health /livez /readyz /metrics /favicon.ico`` and
      FastAPI's ``/docs /docs/oauth2-redirect /redoc /openapi.json``;
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
        _fastapi_tracing: bool = False,
    ) -> None:
        if model_name is not None and not isinstance(model_name, str):
            raise ValueError(f"model_name must be a string, got {model_name!r}")
        if span_name is not None and not callable(span_name):
            raise ValueError(f"span_name must be callable, got {span_name!r}")
        if record_content is not None and not isinstance(record_content, bool):
            raise ValueError(f"record_content must be a bool, got {record_content!r}")
        self.app = app
        paths = (
            excluded_paths_setting(excluded_paths) if excluded_paths is not None else None
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
        self._warned_foreign_span = False
        #: instrument(app, fastapi_tracing=True): FastAPI's spans were kept on purpose
        self._fastapi_tracing = _fastapi_tracing
        self._runtime: Runtime | None = None
        #: id(route) -> the route's state (_UNCOUNTED's comment), learnt from its timed
        #: requests; ``_route_refs`` holds the routes, so that their ids stay theirs
        self._route_models: dict[int, Any] = {}
        self._route_refs: dict[int, Any] = {}
        #: (runtime, _content_limit_for(runtime)), worked out once per runtime
        self._content_limit: tuple[Runtime, int] | None = None
        if tracer_provider is not None:
            config = resolve(
                record_content=record_content,
                content_max_bytes=content_max_bytes,
                excluded_paths=paths,
                owns=False,
            )
            self._runtime = Runtime(config, tracer_provider, meter_provider)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rt = self._runtime
        if rt is None:
            rt = active_runtime()
        if rt is None or not rt.enabled:
            await self.app(scope, receive, send)
            return
        exact, prefixes = self._excluded_paths or rt.excluded_paths
        path = scope.get("path", "")
        if path in exact or (prefixes and path.startswith(prefixes)):
            await self.app(scope, receive, send)
            return
        outer = SCOPE.get()
        if outer is not None and (outer is UNTIMED or isinstance(outer[0], RequestRecord)):
            await self.app(scope, receive, send)  # installed twice
            return
        context = current_otel_context()
        if context and rt.production and _sampled_out_elsewhere(rt, scope, context):
            # Another instrumentation's request span that its sampler did not keep, in a
            # trace whose kept requests it weights: they count this one, so it is neither
            # timed nor counted (a nested request() or stage records nothing).
            token = SCOPE.set(UNTIMED)
            try:
                await self.app(scope, receive, send)
            finally:
                reset_scope(token)
            return
        # production mode's timing budget (none: every request is timed)
        share = timed_share(rt, path, context) if rt.timing_budget is not None else 1.0
        if not share:
            # Not timed: its stages record nothing, as with inferprof off; a trace context
            # it came with stays current, for the calls it makes downstream.
            summaries = rt.summaries
            if summaries is not None:  # counted, when its route is (contract §15)
                start = _time_ns()
                error = False
                answer = [0, 0]  # its status; when its last body chunk was handed over

                # (why a closure returning the server's awaitable: by the module's constants)
                def send(message: Message, send: Send = send, answer: list = answer
                         ) -> Awaitable[None]:
                    if message["type"] == "http.response.start":
                        answer[0] = message.get("status") or -1  # (0: no answer started)
                    elif not answer[1] and not message.get("more_body", False):
                        answer[1] = _time_ns()
                    return send(message)
            otel_token = _attach_incoming(scope)
            token = SCOPE.set(UNTIMED)
            try:
                await self.app(scope, receive, send)
            except BaseException as exc:
                if summaries is not None:
                    # A client gone after the answer started is no error (a timed
                    # request's send() and receive() see it: `disconnected`).
                    error = ends_in_error(exc) and not (answer[0] and _client_gone(exc))
                raise
            finally:
                reset_scope(token)
                if otel_token is not None:
                    detach_context(otel_token)
                if summaries is not None:
                    self._count_untimed(summaries, scope, start, answer, error)
            return
        try:
            rec = self._open(rt, scope, receive, send, path, context)
        except Exception:
            _logger.exception("inferprof could not open a request; serving it untraced")
            await self.app(scope, receive, send)
            return
        if share < 1.0:
            rec.weight_hint = 1.0 / share  # its weight: timed with probability `share`
        try:
            await self.app(scope, rec.receive, rec.send)
        except BaseException as exc:
            if not rec.disconnected:  # else the client left: cancelled, not failed
                rec.error = exc
            if rec.status is None and isinstance(exc, Exception):
                # No response started: the server (or Starlette's ServerErrorMiddleware,
                # outside this one) answers 500.
                rec.status = 500
            raise
        finally:
            self._close(rt, scope, rec)

    def _count_untimed(self, summaries: Any, scope: Scope, start: int, answer: list,
                       error: bool) -> None:
        """Count an untimed request that ended (``answer``: its status, 0 when none
        started, and when its last body chunk was handed over) if its route is counted,
        under the route's model (contract §15)."""
        key = id(scope.get("route"))
        # (one not answered: the route's unanswered requests, learnt apart)
        model = self._route_models.get(key if answer[0] else ~key, _UNCOUNTED)
        if model is None or model.__class__ is str:
            try:
                summaries.add_untimed((start, answer[1] or _time_ns(),
                                       error or answer[0] >= 500, model))
            except Exception:  # (a status that is no number)
                _logger.exception("inferprof could not count a request")

    # --- open / close --------------------------------------------------------------------
    def _content_limit_for(self, rt: Runtime) -> int:
        """Bytes of each body to record for ``rt``'s requests; 0: record no content."""
        record_content = self._record_content
        if record_content is None:
            record_content = rt.config.record_content
        if not record_content:
            return 0
        return self._content_max_bytes or rt.config.content_max_bytes

    def _open(
        self, rt: Runtime, scope: Scope, receive: Receive, send: Send, path: str, context: Any
    ) -> _HttpRequest:
        start = _time_ns()
        parent = None
        headers = scope.get("headers")
        # (_incoming_carrier's check, inline: most requests carry no trace context)
        if headers and not _PROPAGATION_HEADERS.isdisjoint(map(_header_name, headers)):
            carrier = _incoming_carrier(scope)
            if carrier is not None:
                sc = trace_api.get_current_span(propagate.extract(carrier)).get_span_context()
                parent = sc if sc.is_valid else None
        method = scope.get("method", "GET")
        attrs: dict[str, Any] = {
            _METHOD: method,
            _PATH: path,
            _SCHEME: scope.get("scheme", "http"),
        }
        if self.model_name is not None:
            attrs[_MODEL_NAME] = self.model_name
        if context:  # maybe another instrumentation's server span to enrich
            rec = begin_request(rt, method, _SERVER, attrs, parent, start, context, _HttpRequest)
            if rec.live_span is not None and rt.production and not self._warned_foreign_span:
                self._warn_foreign_span(rec.live_span)
            # Another instrumentation's span gets the HTTP attributes before it ends (send()).
            rec.live_scope = scope if rec.live_span is not None else None
        else:  # nothing current (the usual case): straight to a new record
            rec = rt.start_request(method, _SERVER, attrs, parent, start, _HttpRequest)
            rec.live_scope = None
        rec.recv_start = rec.recv_end = rec.received = 0
        rec.ser_start = rec.ser_end = rec.sent = 0
        rec.status = rec.route = None
        rec.route_model = rec.summary_model = _UNCOUNTED  # (_close sets them when it counts)
        rec.disconnected = False
        rec.stream = _NOT_STREAMED
        rec.chunk_times = rec.chunk_tokens = rec.sse_times = None
        rec.chunk_merged = 0
        rec.next_tokens = 1
        rec.root_path = scope.get("root_path")  # as the request came in (mounts extend it)
        rec._receive = receive
        rec._send = send
        limit = self._content_limit
        if limit is None or limit[0] is not rt:
            limit = self._content_limit = (rt, self._content_limit_for(rt))
        nbytes = limit[1]
        rec.content = _Content(nbytes) if nbytes else None
        rec._scope_token = SCOPE.set((rec, None))
        # One attach per request (not per stage): downstream clients inject our
        # traceparent and other instrumentations parent their spans on the request.
        rec._otel_token = attach_span(RequestSpan(rec), context) if rec.live_span is None else None
        return rec

    def _warn_foreign_span(self, span: Any) -> None:
        self._warned_foreign_span = True
        scope = getattr(getattr(span, "instrumentation_scope", None), "name", None) or "?"
        hint = (" Turn FastAPI's own tracing off: inferprof.fastapi.instrument(app) does, or"
                " FastAPI(telemetry={'tracing': False})."
                if scope == "fastapi" and not self._fastapi_tracing else "")
        _logger.warning(
            "inferprof production mode: the request span is made by another instrumentation "
            "(%s), so its sampler, not inferprof's tail sampler, decides which traces are "
            "exported (with the default sampler: all of them).%s", scope, hint)

    def _close(self, rt: Runtime, scope: Scope, rec: _HttpRequest) -> None:
        now = _time_ns()
        try:
            SCOPE.reset(rec._scope_token)
        except ValueError:
            SCOPE.set(None)
        if rec._otel_token is not None:
            detach_context(rec._otel_token)
        if rec.recv_start and not rec.recv_end:  # the body was cut short
            rec.recv_end = now
        if rec.ser_start and not rec.ser_end:  # the app failed mid-response
            rec.ser_end = now
        try:
            # The name (and the tail sampler's key) needs the route now; the rest of the
            # HTTP attributes waits for _complete().
            route = scope.get("route")
            if route is not None and scope.get("root_path") is rec.root_path:
                template = getattr(route, "path", None)  # no mount crossed: the usual case
            else:
                template = _route_template(scope, rec.root_path or "")
            rec.route = template
            if rec.live_span is None:
                if self._span_name is not None:
                    rec.name = self._span_name(scope)
                elif template:
                    rec.name = f"{rec.name} {template}"
        except Exception:
            _logger.exception("inferprof could not name a request")
        rec.end = rec.ser_end or now
        if rt.summaries is None or rt.timing_budget is None:  # no request goes untimed
            rt.finish_request(rec)
            return
        # What the route's untimed requests are counted under, for the mark on this one
        # (_summarised), then what this one teaches about the route.
        # A route's requests that end before an answer starts are learnt apart (key ~id):
        # one may have no stage span (a body-less request failing first), so not be
        # summarised, when its likes with an answer (a serialize stage at least) are.
        route = scope.get("route")
        key = id(route) if rec.ser_start else ~id(route)
        rec.route_model = self._route_models.get(key, _UNCOUNTED)
        rec.summary_model = _UNCOUNTED
        generation = rec.generation is not None  # (finish_request may unset it)
        rt.finish_request(rec)
        try:
            model = rec.summary_model
            if generation:
                # A generation of the engine step API is not summarised, and an untimed
                # one cannot be told from the route's other requests: not counted for good.
                self._learn(route, ~key, _MIXED)
                model = _MIXED
            elif model is _UNCOUNTED and not rec.ser_start:
                model = _MIXED  # no stage span: its untimed likes cannot be told apart
            self._learn(route, key, model)
        except Exception:
            _logger.exception("inferprof could not follow a route's model")

    def _learn(self, route: Any, key: int, model: Any) -> None:
        """A timed request of ``route`` (``key``) was summarised under ``model``
        (``_UNCOUNTED``: not summarised; ``_MIXED``: not to be counted for good): the
        route's state from now on (contract §15: counted while its last timed request was
        summarised, under the one model its timed requests name)."""
        models = self._route_models
        state = models.get(key, _UNCOUNTED)
        if state is model or state == model:  # the usual case: nothing changes
            return
        if model is _UNCOUNTED:
            if state is None or state.__class__ is str:
                models[key] = (state,)
        elif state is _UNCOUNTED:
            if len(models) < _MAX_ROUTES:
                self._route_refs[key] = route
                models[key] = model
        elif state.__class__ is tuple:
            models[key] = model if state[0] == model else _MIXED
        elif state is not _MIXED:
            models[key] = _MIXED


def _incoming_carrier(scope: Scope) -> dict[str, str] | None:
    """The request's ``traceparent``/``tracestate``/``baggage`` headers; None without any.
    Most requests carry no trace context: one C-level pass over the header names decides,
    instead of a Python loop over every header."""
    headers = scope.get("headers") or ()
    if _PROPAGATION_HEADERS.isdisjoint(map(_header_name, headers)):
        return None
    carrier = {}
    for key, value in headers:
        if key in _PROPAGATION_HEADERS:
            carrier[key.decode("latin-1")] = value.decode("latin-1")
    return carrier


def _sampled_out_elsewhere(rt: Runtime, scope: Scope, context: Any) -> bool:
    """Whether the request runs under a span another instrumentation of this process opened
    for it (not an extracted caller's context: those are remote) and its sampler did not
    keep, while the ones it keeps carry a weight above 1 (``inferprof.sample.weight``, a
    root under a ratio sampler): those count this request, which inferprof must not count
    again (contract §15). With a weight of 1 (a caller's decision followed, by
    ``ParentBased``) nothing stands for it, and inferprof records it as usual."""
    try:
        span = trace_api.get_current_span(context)
        if span.is_recording():
            return False
        sc = span.get_span_context()
        if not sc.is_valid or sc.is_remote:
            return False
        parent = None
        carrier = _incoming_carrier(scope)
        if carrier is not None:  # the caller's context the other instrumentation continued
            caller = trace_api.get_current_span(propagate.extract(carrier)).get_span_context()
            parent = caller if caller.is_valid else None
        return rt.sampled_weight(parent) > 1.0
    except Exception:
        _logger.exception("inferprof could not read another instrumentation's span")
        return False


def _attach_incoming(scope: Scope) -> Any:
    """Make a request's incoming trace context current (a request production mode does not
    time: downstream calls continue the caller's trace); the token, or None."""
    try:
        carrier = _incoming_carrier(scope)
        if carrier is None:
            return None
        return context_api.attach(propagate.extract(carrier))
    except Exception:
        _logger.exception("inferprof could not read a request's trace context")
        return None


def split_paths(paths: tuple[str, ...]) -> tuple[frozenset, tuple]:
    """Excluded paths as (exact matches, prefixes); a trailing ``*`` marks a prefix."""
    return frozenset(p for p in paths if not p.endswith("*")), tuple(
        p[:-1] for p in paths if p.endswith("*")
    )


def instrument(app: Any, *, fastapi_tracing: bool = False, **options: Any) -> Any:
    """``inferprof.fastapi.instrument(app, model_name="m")``: add the middleware; returns app.

    FastAPI releases with built-in telemetry (0.16x, ``fastapi.telemetry``) wrap every
    request in a SERVER span of their own as soon as a global tracer provider exists,
    which ``inferprof.configure()`` installs. inferprof would then enrich that span
    instead of making its own, and in production mode FastAPI's sampler, not inferprof's
    tail sampler, would decide what is exported. So ``instrument()`` turns FastAPI's
    request tracing off (its metrics and logs are left as they are); pass
    ``fastapi_tracing=True`` to keep FastAPI's spans, with inferprof's attributes and
    stages on them. Options are :class:`InferprofMiddleware`'s.
    """
    if not hasattr(app, "add_middleware"):
        raise ValueError(f"instrument() needs a Starlette/FastAPI app, got {app!r}")
    if not isinstance(fastapi_tracing, bool):
        raise ValueError(f"fastapi_tracing must be a bool, got {fastapi_tracing!r}")
    if options.get("excluded_paths") is not None:
        # Starlette builds the middleware on the first request: a bad setting would only
        # surface there, failing that request. Checked here, it fails at start-up.
        excluded_paths_setting(options["excluded_paths"])
    if fastapi_tracing:
        app.add_middleware(InferprofMiddleware, _fastapi_tracing=True, **options)
    else:
        app.add_middleware(InferprofMiddleware, **options)
        _native_tracing_off(app)
    return app


def _native_tracing_off(app: Any) -> None:
    # FastAPI reads "tracing" per request (fastapi/telemetry/_asgi.py, NativeTelemetry).
    config = native_tracing(app)
    if config is not None and config.get("tracing"):
        config["tracing"] = False
        _logger.info("inferprof: FastAPI's own request tracing turned off; inferprof's "
                     "middleware makes the request span (instrument(app, "
                     "fastapi_tracing=True) keeps FastAPI's)")


__all__ = ["InferprofMiddleware", "chunk_tokens", "instrument"]
