"""The stage API: ``inferprof.stage()``, ``inferprof.request()``, ``inferprof.current_request()``.

``stage(name, **attrs)`` is a context manager (``with`` / ``async with``) and a decorator
(sync and async functions). Inside a request (opened by the FastAPI middleware or by
``inferprof.request()``) it records a stage of that request; inside a batch
(``inferprof.batch()`` or a ``DynamicBatcher``'s function) a stage of that batch. Outside
both, it becomes an ordinary OpenTelemetry span — a child of whatever span is current — when
inferprof is configured, and does nothing when it is not.

Exceptions are recorded on the stage (status ERROR, an ``exception`` event) and re-raised
unchanged. ``asyncio.CancelledError`` is recorded as ``inferprof.cancelled = true``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import random
import time
from collections.abc import Callable, Mapping
from contextvars import Token
from typing import Any, Literal

from opentelemetry import context as context_api
from opentelemetry import propagate
from opentelemetry import trace as trace_api
from opentelemetry.trace import SpanKind, Status, StatusCode

from inferprof import semconv
from inferprof.instrumentation.active import active_runtime
from inferprof.instrumentation.device import (
    begin_device_stage,
    host_timed,
    parse_cuda_device,
)
from inferprof.instrumentation.records import (
    SCOPE,
    UNTIMED,
    RequestRecord,
    RequestSpan,
    StageRecord,
    SummaryRecord,
    attach_span,
    current_otel_context,
    detach_context,
    in_quiet_step,
)

_logger = logging.getLogger(__name__)
_time_ns = time.time_ns
_random = random.random
_VALID: set[str] = set()
_VALID_MAX = 4096
#: Most stages recorded per request (and per batch); the rest are counted in
#: ``inferprof.stages.dropped`` on the request span (batch: on its batch-stage spans).
MAX_STAGES = 1024


_warned_outlived = False


def _warn_outlived(owner: Any) -> None:
    global _warned_outlived
    if _warned_outlived:
        return
    _warned_outlived = True
    _logger.warning(
        "inferprof: a stage was entered in the context of a request that has ended (%s): a "
        "task started inside that request (a batching loop started by the first request?) "
        "inherited it. The stage is recorded as a span of its own, in no request (the "
        "collector counts such traces as incomplete and drops them). Start such tasks in a "
        "fresh context: contextvars.Context().run(loop.create_task, coro) (docs/batching.md)",
        getattr(owner, "name", "?"))


def reset_scope(token: Token) -> None:
    """``SCOPE.reset(token)``; outside the context that set it, ``SCOPE.set(None)``."""
    try:
        SCOPE.reset(token)
    except ValueError:  # exited in another context
        SCOPE.set(None)


def check_stage(name: str) -> None:
    if name in _VALID:
        return
    semconv.validate_stage(name)
    if len(_VALID) < _VALID_MAX:
        _VALID.add(name)


class Stage(StageRecord):
    """One use of ``inferprof.stage()``. ``set_attribute()`` adds to the stage's span.

    Inside a request or a batch, the Stage object is itself the stage's record the first
    time it is entered (one object per stage where a separate record made two); entering
    the same Stage again records into a new record.
    """

    __slots__ = ("_otel_token", "_rec", "_span", "_timing", "_token", "_where")
    _rec: StageRecord | None
    _token: Any
    _otel_token: Any
    _timing: Any

    def __init__(self, name: str, device: Any, attrs: dict) -> None:
        self.name = name
        self.attrs = attrs
        self.span_id = 0
        self.start = 0
        self._where = device  # where the work runs (``stage(device=...)``); None: the host
        self._rec: StageRecord | None = None
        self._span: Any = None
        self._timing: Any = None

    def set_attribute(self, key: str, value: Any) -> None:
        rec = self._rec
        if rec is not None:
            rec.attrs[key] = value
        elif self._span is not None:
            self._span.set_attribute(key, value)
        else:  # before or after the block: this stage's own attributes
            self.attrs[key] = value

    # --- context manager -------------------------------------------------------------
    def __enter__(self) -> Stage:
        scope = SCOPE.get()
        if scope is None:
            # (else a production step: its stages are not sent; one that ended, exited in
            # another thread, names this one no more)
            if not in_quiet_step():
                self._enter_standalone()
            return self
        if scope is UNTIMED:  # a request production mode does not time
            return self
        owner, parent = scope
        if owner.__class__ is SummaryRecord:  # untimed, summarised (records.SummaryRecord)
            self._timing = _summarised_stage(owner, self.name, self._where)
            if self._timing is not None:
                self._timing.start = _time_ns()
            return self
        if owner.finished:
            # A task started inside a request and outliving it (a batching loop started
            # lazily by the first request) inherited its scope: that request has ended,
            # and stages recorded into it would be lost. Outside any request, then.
            _warn_outlived(owner)
            # A new trace where the current span is that ended request's; under any other
            # (an outer stage of this kind, a span of the user's), as usual.
            current = trace_api.get_current_span()
            self._enter_standalone(root=getattr(current, "_rec", None) is owner)
            return self
        stages = owner.stages
        if len(stages) >= MAX_STAGES:
            # A runaway loop of stages (a per-token stage on a long stream) must not grow a
            # request without bound: count the excess on the owner instead of recording it.
            owner.stages_dropped += 1
            return self
        if self.start:  # entered before: this use gets a record of its own
            rec = StageRecord(self.name, parent, 0, dict(self.attrs))
        else:
            rec = self
            self.parent = parent
            self.end = self.error = self.device = None
        stages.append(rec)
        self._rec = rec
        self._token = SCOPE.set((owner, rec))
        if self._where is not None:
            self._begin_device(rec)
        rec.start = _time_ns()
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        rec = self._rec
        if rec is not None:
            rec.end = _time_ns()
            if self._timing is not None:
                self._end_device()
                self._timing = None
            if exc is not None:
                rec.error = exc
            token = self._token
            try:
                SCOPE.reset(token)
            except ValueError:  # exited in another context (e.g. an async generator)
                old = token.old_value
                SCOPE.set(None if old is Token.MISSING else old)
            # The record stays in its owner's list: drop what would make cycles with it.
            self._rec = self._token = None
        elif self._span is not None:
            self._exit_standalone(exc)
        elif self._timing is not None:  # untimed, summarised: a SummaryStage
            self._timing.end = _time_ns()
            self._timing = None
        return False

    async def __aenter__(self) -> Stage:
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> Literal[False]:
        return self.__exit__(exc_type, exc, tb)

    # --- decorator ---------------------------------------------------------------------
    def __call__(self, fn: Callable) -> Callable:
        name, device, attrs = self.name, self._where, self.attrs
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                with Stage(name, device, dict(attrs)):
                    return await fn(*args, **kwargs)

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with Stage(name, device, dict(attrs)):
                return fn(*args, **kwargs)

        return wrapper

    # --- pieces off the hot path -------------------------------------------------------
    def _enter_standalone(self, root: bool = False) -> None:
        """A span of the stage's own; ``root``: a new trace, not under the current span
        (which is then an ended request's)."""
        rt = active_runtime()
        if rt is None:
            return
        try:
            attrs = {semconv.ATTR_STAGE: self.name}
            attrs.update(self.attrs)
            self._span = rt.tracer.start_span(
                semconv.span_name(self.name), attributes=attrs,
                context=context_api.Context() if root else None,
            )
            self._otel_token = context_api.attach(trace_api.set_span_in_context(self._span))
        except Exception:
            _logger.exception("inferprof could not start a stage span")
            self._span = None

    def _exit_standalone(self, exc: BaseException | None) -> None:
        span = self._span
        try:
            if exc is not None:
                if isinstance(exc, asyncio.CancelledError):
                    span.set_attribute(semconv.ATTR_CANCELLED, True)
                else:
                    span.record_exception(exc, escaped=True)
                    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            span.end()
            context_api.detach(self._otel_token)
        except Exception:
            _logger.exception("inferprof could not end a stage span")

    def _begin_device(self, rec: StageRecord) -> None:
        try:
            self._timing = begin_device_stage(rec, self._where)
        except Exception:
            _logger.exception("inferprof could not start device timing; using host time")

    def _end_device(self) -> None:
        try:
            self._timing.end()
        except Exception:
            _logger.exception("inferprof could not end device timing; using host time")
            if self._rec is not None:
                self._rec.device = None


def stage(name: str, *, device: Any = None, **attributes: Any) -> Stage:
    """Time a stage: ``with inferprof.stage("tokenize"):`` or ``@inferprof.stage("postprocess")``.

    ``device``: where the stage's work runs. ``None``/``"cpu"``: host timers. A CUDA device
    (``"cuda"``, ``"cuda:1"``, an int, a ``torch.device``): CUDA events recorded on the
    current stream and resolved when the batch (or request) ends, so asynchronous kernel
    launches are timed by when the GPU ran them, not when Python queued them.
    """
    if name not in _VALID:
        check_stage(name)
    if device is not None:
        parse_cuda_device(device)  # ValueError for a bad device, at the call site
    elif (scope := SCOPE.get()) is not None and (owner := scope[0]).__class__ is SummaryRecord:
        # A request left untimed, summarised: its stage's name and times, nothing else
        # (_summarised_stage, inline: once or more per request)
        stages = owner.stages
        if len(stages) >= MAX_STAGES:
            return _noop(name)  # type: ignore[return-value]  # (as a Stage records none)
        summarised = _new_stage(SummaryStage)
        summarised.name = name
        summarised.start = 0
        summarised.end = summarised._use = None
        stages.append(summarised)
        return summarised  # type: ignore[return-value]
    elif not attributes and (
        scope is UNTIMED
        or (scope is None and (active_runtime() is None or in_quiet_step()))
    ):
        # Off / unconfigured, outside any request, in a request not timed, or in a
        # production step that holds no scope (records.QUIET): a shared do-nothing object,
        # so the uninstrumented path costs no allocation.
        return _noop(name)  # type: ignore[return-value]
    # Stage(name, device, attributes), without the class call (once or more per request)
    st = _new_stage(Stage)
    st.name = name
    st.attrs = attributes
    st.span_id = st.start = 0
    st._where = device
    st._rec = st._span = st._timing = None
    return st


_new_stage = object.__new__


def _noop(name: str) -> NoopStage:
    noop = _NOOPS.get(name)
    if noop is None:
        noop = _NOOPS[name] = NoopStage(name)
    return noop


class SummaryStage:
    """A stage of a request left untimed and summarised (``records.SummaryRecord``): its
    name and host times, for the summaries; what ``stage()`` returns in such a request
    (``device``, attributes and nesting are not recorded: the summaries hold none).

    Its first use is its own record; entered again (a stage object reused in a loop), each
    use records into a new one in the request of the current scope, as a ``Stage`` does:
    a timed request's summary holds one stage span per use."""

    __slots__ = ("_use", "end", "name", "start")
    name: str
    start: int  # 0: not entered
    end: int | None  # None: not exited
    _use: SummaryStage | None  # the record of a use after the first, while it runs

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def __enter__(self) -> SummaryStage:
        if self.start:
            self._again()
        else:
            self.start = _time_ns()
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        use = self._use
        if use is None:
            self.end = _time_ns()
        else:
            use.end = _time_ns()
            self._use = None
        return False

    async def __aenter__(self) -> SummaryStage:
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> Literal[False]:
        return self.__exit__(exc_type, exc, tb)

    def _again(self) -> None:
        """A use after the first: a record of its own, in the request of the current scope
        (none outside one: then nothing is recorded)."""
        scope = SCOPE.get()
        use = None
        if scope is not None and scope[0].__class__ is SummaryRecord:
            use = _summarised_stage(scope[0], self.name, None)
            if use is not None:
                use.start = _time_ns()
        self._use = use if use is not None else _DISCARDED

    def __call__(self, fn: Callable) -> Callable:
        return Stage(self.name, None, {})(fn)

def _summarised_stage(owner: SummaryRecord, name: str, device: Any) -> SummaryStage | None:
    """A new stage of ``owner`` (not entered yet: ``start`` 0), or None: past
    ``MAX_STAGES`` (not recorded, as a timed request's Stage records none past it), or a
    device-timed stage (CUDA events, which a host time is not; a device its timed likes
    time by the host, ``"cpu"`` or CUDA without torch, is the host's), where the request
    cannot be summarised as its timed likes are: then ``owner.broken``, only counted."""
    stages = owner.stages
    if len(stages) >= MAX_STAGES:
        return None
    if device is not None and not host_timed(device):
        owner.broken = True
        return None
    st = _new_stage(SummaryStage)
    st.name = name
    st.start = 0
    st.end = st._use = None
    stages.append(st)
    return st


#: Where a SummaryStage's later use records, when it records nothing (outside the
#: request, or past MAX_STAGES): a record in no request.
_DISCARDED = _new_stage(SummaryStage)
_DISCARDED.name = ""
_DISCARDED.start = 0
_DISCARDED.end = _DISCARDED._use = None


class NoopStage:
    """``stage()`` when nothing is recorded. As a decorator it defers to a real Stage, which
    decides at each call (inferprof may be configured after the decorated function is
    defined)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def __enter__(self) -> NoopStage:
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        return False

    async def __aenter__(self) -> NoopStage:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> Literal[False]:
        return False

    def __call__(self, fn: Callable) -> Callable:
        return Stage(self.name, None, {})(fn)


_NOOPS: dict[str, NoopStage] = {}


# --- requests --------------------------------------------------------------------------------


def _live_server_span(span: Any) -> Any:
    """``span`` (the current one) if another instrumentation opened it as this request's
    SERVER or CONSUMER span (opentelemetry-instrumentation-fastapi, -grpc...), else None."""
    if not span.is_recording():
        return None
    kind = getattr(span, "kind", None)
    if kind is SpanKind.SERVER or kind is SpanKind.CONSUMER:
        return span
    return None


def under_live_span(context: Any) -> bool:
    """Whether ``context`` (the current OpenTelemetry context) holds another
    instrumentation's request span, which inferprof would enrich: its sampler, not
    production mode's timing budget, decides about that request."""
    return bool(context) and _live_server_span(trace_api.get_current_span(context)) is not None


def timed_share(rt: Any, key: object, context: Any = None) -> float:
    """Production mode's timing budget for one request of ``key``: the probability it was
    timed with (1.0 with no budget, under it, or under another instrumentation's request
    span, whose sampler decides), or 0.0 when it is not to be timed (counted).
    ``context``: the current OpenTelemetry context, when the caller has it already."""
    budget = rt.timing_budget
    if budget is None:
        return 1.0
    if context is None:
        context = current_otel_context()
    # (under_live_span, inline: once a request; most requests hold no context)
    if context and _live_server_span(trace_api.get_current_span(context)) is not None:
        return 1.0
    share = budget.share(key)
    if share < 1.0 and _random() >= share:
        rt.stats.untimed += 1
        return 0.0
    return share


def begin_request(
    rt: Any,
    name: str,
    kind: SpanKind,
    attrs: dict,
    parent: trace_api.SpanContext | None = None,
    start: int | None = None,
    context: Any = None,
    cls: type[RequestRecord] = RequestRecord,
) -> RequestRecord:
    """Open a request record (middleware and ``request()`` share this). ``context``: the
    current OpenTelemetry context, when the caller has it already; ``cls``: the record's
    class (a subclass holding the caller's own per-request state)."""
    if context is None:
        context = current_otel_context()
    # An empty context (the usual case in a server) has no span: skip the lookups.
    current = trace_api.get_current_span(context) if context else None
    live = _live_server_span(current) if current is not None else None
    start = start if start is not None else _time_ns()
    if live is not None:
        sc = live.get_span_context()
        rec = cls(
            rt,
            name,
            kind,
            sc.trace_id,
            sc.span_id,
            None,
            start,
            attrs,
            bool(sc.trace_flags.sampled),
        )
        rec.live_span = live
        rec.emit_request_span = False
        weight = rt.live_weight(live) if rec.head else 1.0
        if weight != 1.0:
            attrs[semconv.ATTR_SAMPLE_WEIGHT] = weight
        rec.weight_hint = weight
        if attrs:
            live.set_attributes(attrs)
        return rec
    if parent is None and current is not None:
        sc = current.get_span_context()
        parent = sc if sc.is_valid else None
    return rt.start_request(name, kind, attrs, parent, start, cls)


class RequestScope:
    """One use of ``inferprof.request()``; ``with`` yields the request handle (or None)."""

    __slots__ = ("_otel_token", "_rec", "_rt", "_token", "attrs", "carrier", "kind", "name")
    _token: Any
    _otel_token: Any

    def __init__(
        self, name: str, kind: SpanKind, attrs: dict, carrier: Mapping[str, str] | None
    ) -> None:
        self.name = name
        self.kind = kind
        self.attrs = attrs
        self.carrier = carrier
        self._rec: RequestRecord | None = None
        self._token = None
        self._otel_token = None

    def __enter__(self) -> RequestRecord | None:
        scope = SCOPE.get()
        if scope is not None:
            if isinstance(scope[0], RequestRecord):
                scope[0].set_attributes(self.attrs)  # nested: one request, more attributes
                return scope[0]
            if scope is UNTIMED or scope[0].__class__ is SummaryRecord:
                return None  # nested in a request production mode does not time
        rt = active_runtime()
        if rt is None:
            return None
        share = timed_share(rt, (self.name, self.attrs.get(semconv.ATTR_MODEL_NAME)))
        if not share:
            self._rec = None
            if self.carrier is not None:  # downstream calls continue the caller's trace
                try:
                    self._otel_token = context_api.attach(propagate.extract(self.carrier))
                except Exception:
                    _logger.exception("inferprof could not read a request's trace context")
            self._token = SCOPE.set(UNTIMED)
            return None
        try:
            parent = None
            if self.carrier is not None:
                parent = trace_api.get_current_span(
                    propagate.extract(self.carrier)
                ).get_span_context()
                parent = parent if parent.is_valid else None
            context = current_otel_context()
            rec = begin_request(rt, self.name, self.kind, dict(self.attrs), parent, None, context)
            if share < 1.0:
                rec.weight_hint = 1.0 / share  # timed with probability `share`
            if rec.live_span is None:
                self._otel_token = attach_span(RequestSpan(rec), context)
        except Exception:
            _logger.exception("inferprof could not open a request")
            return None
        self._rec = rec
        self._rt = rt
        self._token = SCOPE.set((rec, None))
        return rec

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        rec = self._rec
        if rec is None:
            if self._token is not None:  # a request not timed
                reset_scope(self._token)
                self._token = None
                if self._otel_token is not None:
                    detach_context(self._otel_token)
                    self._otel_token = None
            return False
        rec.end = _time_ns()
        if exc is not None:
            rec.error = exc
        try:
            SCOPE.reset(self._token)
        except ValueError:
            SCOPE.set(None)
        if self._otel_token is not None:
            detach_context(self._otel_token)
        self._rt.finish_request(rec)
        return False

    async def __aenter__(self) -> RequestRecord | None:
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> Literal[False]:
        return self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: Callable) -> Callable:
        name, kind, attrs = self.name, self.kind, self.attrs
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                with RequestScope(name, kind, attrs, None):
                    return await fn(*args, **kwargs)

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with RequestScope(name, kind, attrs, None):
                return fn(*args, **kwargs)

        return wrapper


def request(
    *,
    model: str | None = None,
    name: str | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    carrier: Mapping[str, str] | None = None,
    **attributes: Any,
) -> RequestScope:
    """Open a request span for a non-HTTP entry point (queue consumer, gRPC handler, script).

    ``carrier``: message headers to extract W3C ``traceparent``/``tracestate`` from. Nested
    inside another request it opens nothing and adds its attributes to the outer request.
    """
    if model is not None:
        if not isinstance(model, str):
            raise ValueError(f"model must be a string, got {model!r}")
        attributes[semconv.ATTR_MODEL_NAME] = model
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not isinstance(kind, SpanKind):
        raise ValueError(f"kind must be an opentelemetry.trace.SpanKind, got {kind!r}")
    return RequestScope(name or semconv.REQUEST_SPAN_NAME, kind, attributes, carrier)


def current_request() -> RequestRecord | None:
    """The request being handled in this context, or None."""
    scope = SCOPE.get()
    if scope is None:
        return None
    owner = scope[0]
    return owner if isinstance(owner, RequestRecord) else None


__all__ = [
    "NoopStage",
    "RequestScope",
    "Stage",
    "SummaryStage",
    "begin_request",
    "check_stage",
    "current_request",
    "request",
    "reset_scope",
    "stage",
    "timed_share",
    "under_live_span",
]
