"""``InferprofMiddleware``: pure ASGI middleware opening one request per HTTP request.

Each request gets a record (:class:`inferprof.fastapi.exchange.HttpRequest`) whose wrapped
``receive`` and ``send`` time ``receive`` (from the app's first read to the last body
chunk) and ``serialize`` (from ``http.response.start`` to the last body chunk), without
buffering: a streaming response flows through chunk by chunk, each chunk of a streamed
generation timed as an emission (contract §7, §14). The request ends when the last body
chunk has been handed to the server, so background tasks that run afterwards are not
counted as latency. Its span is named after the route that served it
(:mod:`inferprof.fastapi.routes`).

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
import weakref
from collections.abc import Awaitable, Callable
from operator import itemgetter
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import propagate
from opentelemetry import trace as trace_api
from opentelemetry.semconv.attributes import http_attributes, url_attributes
from opentelemetry.trace import SpanKind

from inferprof import semconv
from inferprof.fastapi._fastapi_compat import native_tracing
from inferprof.fastapi.exchange import (
    NOT_STREAMED,
    Content,
    HttpRequest,
    Message,
    Receive,
    Scope,
    Send,
)
from inferprof.fastapi.routes import route_template
from inferprof.instrumentation.active import active_runtime
from inferprof.instrumentation.config import excluded_paths_setting, resolve
from inferprof.instrumentation.records import (
    NO_BATCHES,
    SCOPE,
    SUMMARISED_UNTIMED,
    UNTIMED,
    RequestRecord,
    RequestSpan,
    SummaryRecord,
    attach_span,
    current_otel_context,
    detach_context,
    ends_in_error,
)
from inferprof.instrumentation.runtime import Runtime
from inferprof.instrumentation.stage import begin_request, reset_scope, timed_share

_logger = logging.getLogger(__name__)
_time_ns = time.time_ns
_new_summary = object.__new__
_PROPAGATION_HEADERS = frozenset((b"traceparent", b"tracestate", b"baggage"))
_header_name = itemgetter(0)
_MODEL_NAME = semconv.ATTR_MODEL_NAME
_METHOD = http_attributes.HTTP_REQUEST_METHOD
_PATH = url_attributes.URL_PATH
_SCHEME = url_attributes.URL_SCHEME
_SERVER = SpanKind.SERVER
_STAGE_RECEIVE = semconv.STAGE_RECEIVE
_STAGE_SERIALIZE = semconv.STAGE_SERIALIZE
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

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_UNSEEN: Any = object()
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
        #: requests; ``_route_refs`` holds a weak reference to each route, which forgets
        #: its state when the route is freed (before its id can be another's): routes
        #: rebuilt at runtime (models mounted and unmounted) do not fill the bound
        self._route_models: dict[int, Any] = {}
        self._route_refs: dict[int, Any] = {}
        #: keys of counted routes whose untimed requests are counted only, not summarised
        #: with their stages: one of them held what a SummaryRecord cannot record
        self._counted_only: set[int] = set()
        #: path -> {key: its ``_route_refs`` entry} of the routes at that path (equal to
        #: their template) whose untimed requests are not summarised with their stages,
        #: routes of other methods at the path sharing its key in the timing budget: the
        #: budget caps the path at ``max_timed_rate_summarised`` only while there are
        #: none (``_path_summarised``)
        self._unsummarised_at: dict[str, dict[int, Any]] = {}
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
        if outer is not None and (outer is UNTIMED or isinstance(outer[0], RequestRecord)
                                  or outer[0].__class__ is SummaryRecord):
            await self.app(scope, receive, send)  # installed twice
            return
        context = current_otel_context()
        if context and rt.production and _sampled_out_elsewhere(rt, scope, context):
            await self._serve_unrecorded(scope, receive, send)
            return
        # production mode's timing budget (none: every request is timed)
        share = timed_share(rt, path, context) if rt.timing_budget is not None else 1.0
        if not share:
            # Not timed: no span, no trace; its stages record nothing, as with inferprof
            # off, or, summarised, their names and times alone. A trace context it came
            # with stays current, for the calls it makes downstream.
            summaries = rt.summaries
            summary = None
            if summaries is not None:  # counted, when its route is (contract §15)
                start = _time_ns()
                error: bool | None = None  # (None: by no exception: _untimed_error)
                answer = [0, 0, 0, 0, 0, 0, 0]  # (what it holds: _summarising's docstring)
                if rt.untimed_stages:
                    summary, receive, send = _summarising(receive, send, answer)
                else:
                    send = _counting_send(send, answer)
            otel_token = _attach_incoming(scope)
            token = SCOPE.set(UNTIMED if summary is None else (summary, None))
            try:
                await self.app(scope, receive, send)
            except BaseException as exc:
                if summaries is not None:
                    error = _untimed_error(exc, answer, send)
                raise
            finally:
                try:  # (reset_scope, inline)
                    SCOPE.reset(token)
                except ValueError:  # exited in another context
                    SCOPE.set(None)
                if otel_token is not None:
                    detach_context(otel_token)
                if summaries is not None:
                    self._count_untimed(rt, scope, start, answer, error, summary)
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

    async def _serve_unrecorded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve a request under another instrumentation's request span that its sampler
        did not keep, in a trace whose kept requests it weights: they count this one, so
        it is neither timed nor counted (a nested request() or stage records nothing)."""
        token = SCOPE.set(UNTIMED)
        try:
            await self.app(scope, receive, send)
        finally:
            reset_scope(token)

    def _count_untimed(self, rt: Runtime, scope: Scope, start: int, answer: list,
                       error: bool | None, summary: SummaryRecord | None) -> None:
        """Count an untimed request that ended (``answer``: its status, 0 when none
        started, and when its last body chunk was handed over) if its route is counted,
        under the route's model (contract §15); with its stages (``summary``), unless
        the route's untimed requests are only counted (one was ``broken``)."""
        key = id(scope.get("route"))
        if not answer[0]:  # (one not answered: the route's unanswered requests, apart)
            key = ~key
        model = self._route_models.get(key, _UNCOUNTED)
        if model is None or model.__class__ is str:
            try:
                end = answer[1] or _time_ns()
                if error is None:  # no exception: a batch's failure, else a 5xx answer
                    # (an exception is the error, a 5xx answer or not: a cancellation
                    # is none, as a timed request's error, HttpRequest._summary_parts)
                    if summary is not None and summary.error is not None:
                        error = summary.error
                    else:
                        error = answer[0] >= 500
                if summary is not None:
                    if summary.broken:  # what its timed likes hold, it could not record
                        self._counted_only.add(key)
                        # (its timed requests give its figures again: timed at full rate)
                        path = scope.get("path", "")
                        if answer[0] and _fixed_path(scope, path):
                            self._path_summarised(path, key, False)
                        rt.timing_budget.summarised(path, False)  # type: ignore[union-attr]
                    elif key not in self._counted_only:
                        # receive and serialize as HttpRequest._summary_parts gives a timed
                        # request's; one cut short ends with the request
                        # (after its stages, in this order, as a timed request's are:
                        # the summaries' data points follow the spans' order)
                        t = answer[3]
                        parts = [_STAGE_RECEIVE, t, answer[4] or end] if t and answer[5] else []
                        t = answer[2]
                        if t:
                            parts += (_STAGE_SERIALIZE, t, answer[1] or end)
                        if rt.summarise_untimed(summary, start, end, error, model, parts):
                            return
                rt.summaries.add_untimed((start, end, error, model))  # type: ignore[union-attr]
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
    ) -> HttpRequest:
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
            rec = begin_request(rt, method, _SERVER, attrs, parent, start, context, HttpRequest)
            if rec.live_span is not None and rt.production and not self._warned_foreign_span:
                self._warn_foreign_span(rec.live_span)
            # Another instrumentation's span gets the HTTP attributes before it ends (send()).
            rec.live_scope = scope if rec.live_span is not None else None
        else:  # nothing current (the usual case): straight to a new record
            rec = rt.start_request(method, _SERVER, attrs, parent, start, HttpRequest)
            rec.live_scope = None
        rec.recv_start = rec.recv_end = rec.received = 0
        rec.ser_start = rec.ser_end = rec.sent = 0
        rec.status = rec.route = None
        rec.route_model = rec.summary_model = _UNCOUNTED  # (_close sets them when it counts)
        rec.disconnected = False
        rec.stream = NOT_STREAMED
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
        rec.content = Content(nbytes) if nbytes else None
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

    def _close(self, rt: Runtime, scope: Scope, rec: HttpRequest) -> None:
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
                template = route_template(scope, rec.root_path or "")
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
        # (its mark when the route is counted: its untimed likes summarised or counted)
        rec.untimed_mark = (
            SUMMARISED_UNTIMED if rt.untimed_stages and key not in self._counted_only else True
        )
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
            if rt.untimed_stages and rec.ser_start:
                self._budget_route(rt, scope, key)
        except Exception:
            _logger.exception("inferprof could not follow a route's model")

    def _budget_route(self, rt: Runtime, scope: Scope, key: int) -> None:
        """After an answered timed request: whether the budget caps its path at the rate of
        routes whose untimed requests are summarised with their stages (the route counted
        and not turned to counting only, nor any other route at its path; a path with
        parameters in it is left at ``max_timed_rate``: each of its values would be a key
        of the budget's own: ``_fixed_path``)."""
        path = scope.get("path", "")
        if not _fixed_path(scope, path):
            return
        state = self._route_models.get(key, _UNCOUNTED)
        summarised = (state is None or state.__class__ is str) and key not in self._counted_only
        if not summarised or path in self._unsummarised_at:
            summarised = self._path_summarised(path, key, summarised)
        rt.timing_budget.summarised(path, summarised)  # type: ignore[union-attr]

    def _path_summarised(self, path: str, key: int, summarised: bool) -> bool:
        """Whether the budget may cap ``path`` at the rate of summarised routes, now that
        its route ``key`` is ``summarised`` or not: when every route at it is (a GET and
        a POST route of one path are one key of the budget; a route whose untimed requests
        are counted only, or not at all, has its figures from its timed requests). A route
        not summarised is remembered here while the middleware follows it (``_learn``;
        one freed, or whose id another route took since, is forgotten)."""
        refs = self._route_refs
        others = self._unsummarised_at.get(path)
        if others is None:
            if summarised:
                return True
            if key in refs and len(self._unsummarised_at) < _MAX_ROUTES:
                self._unsummarised_at[path] = {key: refs[key]}
            return False
        if summarised:
            others.pop(key, None)
        elif key in refs:
            others[key] = refs[key]
        for other, ref in list(others.items()):
            if refs.get(other) is not ref:  # freed (its id maybe another route's since)
                del others[other]
        if others:
            return False
        del self._unsummarised_at[path]
        return summarised

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
                self._route_refs[key] = _route_ref(
                    route, key, models, self._route_refs, self._counted_only)
                models[key] = model
        elif state.__class__ is tuple:
            models[key] = model if state[0] == model else _MIXED
        elif state is not _MIXED:
            models[key] = _MIXED


def _route_ref(route: Any, key: int, models: dict[int, Any], refs: dict[int, Any],
               counted_only: set[int]) -> Any:
    """A weak reference to ``route`` that forgets ``key`` in ``models``, ``refs`` and
    ``counted_only`` when the route is freed; the route itself when it takes no weak
    reference (None, an object with ``__slots__``): held, its id stays its own."""

    def forget(_: Any) -> None:
        models.pop(key, None)
        refs.pop(key, None)
        counted_only.discard(key)

    try:
        return weakref.ref(route, forget)
    except TypeError:
        return route


def _fixed_path(scope: Scope, path: str) -> bool:
    """Whether ``path`` is the template of the route that served it (``_budget_route``'s
    paths; under a root path, a mount's included, the root path and the template)."""
    template = getattr(scope.get("route"), "path", None)
    if template.__class__ is not str:
        return False
    return path == template or path == (scope.get("root_path") or "") + template


def _untimed_error(exc: BaseException, answer: list, send: Send) -> bool | None:
    """Whether an untimed request that raised ``exc`` ended in error, as a timed one would
    (``answer``: the middleware's list; ``send``: the one the app was given); None when
    its client had left, which makes no error of it (a timed request's ``disconnected``;
    then the failure of a batch it joined says, as it stays a timed member's error): once
    the answer started, as Starlette raises it, or the server's ``send`` raised it for a
    body chunk (``_refused``), or, summarised, as the wrapped receive and send saw it.
    With no answer started the server answers 500, a timed request's error."""
    if not (answer[6] or (answer[0] and (_client_gone(exc) or _refused(exc, send)))):
        return ends_in_error(exc)
    if not answer[0] and isinstance(exc, Exception):
        return True
    return None


def _refused(exc: BaseException, wrapper: Any) -> bool:
    """Whether ``exc`` is an ``OSError`` that the server's ``send`` (the one ``wrapper``,
    ``_summarising``'s or ``_counting_send``'s, hands messages to) raised for a body chunk:
    an ASGI 2.4 server's, the client gone, which a timed request's send() catches
    (``HttpRequest.send``; one for the answer's start is an error there). The wrappers
    return the server's awaitable, catching nothing (a coroutine per chunk would cost as
    much as the rest): the traceback says, on this exceptional path only. False when it
    cannot tell (a server's ``send`` that is no coroutine function leaves no frame)."""
    if not isinstance(exc, OSError):
        return False
    try:
        server = wrapper.__closure__[wrapper.__code__.co_freevars.index("send")].cell_contents
        func = getattr(server, "__func__", server)
        code = getattr(func, "__code__", None) or type(server).__call__.__code__
    except (AttributeError, IndexError, TypeError, ValueError):
        return False
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code is code:  # the server's send raised it (or what it called)
            names = code.co_varnames[:code.co_argcount]
            message = frame.f_locals.get(names[-1]) if names else None
            return not (isinstance(message, dict)
                        and message.get("type") == "http.response.start")
        tb = tb.tb_next
    return False


def _counting_send(send: Send, answer: list) -> Callable[[Message], Awaitable[None]]:
    """``send`` for a request left untimed and only counted: its status (``answer[0]``;
    0: no answer started) and when its last body chunk was handed over (``answer[1]``).
    A closure returning the server's awaitable: by the module's constants."""

    def counting_send(message: Message) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            answer[0] = message.get("status") or -1
        elif not answer[1] and not message.get("more_body", False):
            answer[1] = _time_ns()
        return send(message)

    return counting_send


def _summarising(receive: Receive, send: Send,
                 answer: list) -> tuple[SummaryRecord, Receive, Send]:
    """The record of a request left untimed and summarised, and the ``receive`` and
    ``send`` to serve it with, timing its ``receive`` and ``serialize`` as
    :class:`HttpRequest` does a timed request's, into ``answer``: its status (0: no
    answer started), when the server took its last body chunk, when its answer started,
    its body's first read and last chunk, whether it had a body, and whether the client
    left before the answer's end (a timed request's ``disconnected``: a disconnect read,
    the last body chunk refused with ``OSError``; an earlier chunk refused, Starlette's
    streaming responses raise ``ClientDisconnect``, which the middleware reads, and
    others the ``OSError``: ``_refused``)."""
    # (SummaryRecord(), without the class call: once a request)
    summary = _new_summary(SummaryRecord)
    summary.stages = []
    summary.batches = NO_BATCHES
    summary.broken = False
    summary.error = None

    def summarising_send(message: Message) -> Awaitable[None]:
        kind = message["type"]
        if kind == "http.response.start":
            answer[0] = message.get("status") or -1  # (0: no answer started)
            answer[2] = _time_ns()
        elif not answer[1] and kind == "http.response.body" and not message.get("more_body"):
            return _last_chunk_sent(send(message), answer)
        return send(message)

    async def summarising_receive() -> Message:
        # from the app's first read to the last body chunk (HttpRequest.receive)
        if answer[4]:  # the body is in: later reads (disconnect listeners) pass through
            message = await receive()
            if message["type"] == "http.disconnect" and not answer[1]:
                answer[6] = 1  # the client left before the answer's end
            return message
        t0 = _time_ns()
        message = await receive()
        if message["type"] == "http.request":
            if not answer[3]:
                answer[3] = t0
            if message.get("body"):
                answer[5] = 1
            if not message.get("more_body", False):
                answer[4] = _time_ns()
        elif message["type"] == "http.disconnect" and not answer[1]:
            answer[6] = 1
        return message

    return summary, summarising_receive, summarising_send


async def _last_chunk_sent(sent: Awaitable[None], answer: list) -> None:
    try:
        await sent
    except OSError:  # an ASGI 2.4 server's: the client left (HttpRequest.send)
        answer[6] = 1
        raise
    answer[1] = _time_ns()  # the request's end, and serialize's (HttpRequest.send)


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


__all__ = ["InferprofMiddleware", "instrument"]
