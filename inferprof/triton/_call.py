"""One Triton call recorded as a ``network`` stage: begun in the caller's context, ended
wherever the call completes.

``inferprof.stage()`` is a context manager bound to the context that entered it. A Triton
call can end elsewhere: in a gRPC thread (``async_infer``'s callback), in a gevent greenlet
(HTTP ``async_infer``), or when a stream's responses run out. So a call records its stage
directly, the way ``inferprof.stage`` would have: inside a request or a batch, as a leaf
stage record of its owner (appended when the call starts; its end set when the call ends,
from any thread); outside both, as an ordinary OpenTelemetry span (a child of the current
span) when inferprof is configured; and not at all when it is not.

The span context a call propagates to Triton is the stage's own, so Triton's spans nest
under the ``network`` span: a request stage's span id is drawn when the call starts
(``span_id_of``) and is the id its span is emitted with. Nothing here raises into the
application: failures are logged and the call proceeds unrecorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from typing import Any

from opentelemetry import propagate
from opentelemetry import trace as trace_api
from opentelemetry.trace import Status, StatusCode

from inferprof import semconv
from inferprof.instrumentation.active import active_runtime
from inferprof.instrumentation.records import (
    SCOPE,
    UNTIMED,
    RequestRecord,
    StageRecord,
    SummaryRecord,
    current_otel_context,
    in_quiet_step,
    span_id_of,
)
from inferprof.instrumentation.stage import MAX_STAGES

_logger = logging.getLogger(__name__)
_time_ns = time.time_ns
_SAMPLED = trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED)
_NOT_SAMPLED = trace_api.TraceFlags(trace_api.TraceFlags.DEFAULT)
_NETWORK = semconv.STAGE_NETWORK
_REQUEST_BYTES = semconv.ATTR_TRITON_REQUEST_BYTES
_RESPONSE_BYTES = semconv.ATTR_TRITON_RESPONSE_BYTES

#: The span context the Triton call running in this context propagates; the client plugin
#: (``_plugin.TraceContextPlugin``) reads it while the client builds the call's headers.
OUTGOING: ContextVar[trace_api.SpanContext | None] = ContextVar(
    "inferprof_triton_outgoing", default=None
)


def with_trace_context(headers: Any, context: trace_api.SpanContext) -> dict:
    """A copy of ``headers`` (a dict or None) with ``context`` injected by the global
    OpenTelemetry propagator (W3C ``traceparent``/``tracestate`` by default; the current
    baggage too), replacing the same headers in any letter case. The caller's dict is
    never modified: an application that reuses one headers dict for every call must not
    find the trace context of an earlier call in it."""
    carrier: dict[str, str] = {}
    propagate.inject(
        carrier,
        context=trace_api.set_span_in_context(
            trace_api.NonRecordingSpan(context), current_otel_context()
        ),
    )
    if headers:
        out = {k: v for k, v in headers.items() if k.lower() not in carrier}
        out.update(carrier)
        return out
    return carrier


def recording() -> bool:
    """Whether a call made here would be recorded: the check a call costs when it is not."""
    return SCOPE.get() is not None or active_runtime() is not None


class NetworkCall:
    """A call's ``network`` stage. ``context``: the span context to propagate (None: none).

    ``end()`` may be called from any thread, once; later calls do nothing.
    """

    __slots__ = ("context", "ended", "rec", "request_bytes", "response_bytes", "span")

    def __init__(self, rec: StageRecord | None, span: Any, context: Any) -> None:
        self.rec = rec
        self.span = span
        self.context = context
        self.ended = False
        self.request_bytes: int | None = None
        self.response_bytes: int | None = None

    def set_attributes(self, attributes: dict) -> None:
        rec = self.rec
        if rec is not None:
            # A copy, rebound in one step: the call may end (on a gRPC thread) after its
            # request did, while the request's spans are being built from this dict.
            attrs = dict(rec.attrs)
            attrs.update(attributes)
            rec.attrs = attrs
        elif self.span is not None:
            try:
                self.span.set_attributes(attributes)
            except Exception:
                _logger.exception("inferprof could not set an attribute on a Triton call's span")

    def add_bytes(self, sent: int | None = None, received: int | None = None) -> None:
        """Count tensor bytes sent / received (None: not known, leaves the count as it is)."""
        if sent is not None:
            self.request_bytes = (self.request_bytes or 0) + sent
        if received is not None:
            self.response_bytes = (self.response_bytes or 0) + received

    def end(self, error: BaseException | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        end = _time_ns()
        try:
            self._put_bytes()
            rec = self.rec
            if rec is not None:
                rec.end = end
                if error is not None:
                    rec.error = error
            elif self.span is not None:
                _end_span(self.span, error, end)
        except Exception:
            _logger.exception("inferprof could not end a Triton call's stage")

    def _put_bytes(self) -> None:
        sent, received = self.request_bytes, self.response_bytes
        if sent is None and received is None:
            return
        attrs = {semconv.ATTR_BYTES: (sent or 0) + (received or 0)}
        if sent is not None:
            attrs[_REQUEST_BYTES] = sent
        if received is not None:
            attrs[_RESPONSE_BYTES] = received
        self.set_attributes(attrs)


def _end_span(span: Any, error: BaseException | None, end: int) -> None:
    if error is not None:
        if isinstance(error, asyncio.CancelledError):
            span.set_attribute(semconv.ATTR_CANCELLED, True)
        else:
            span.record_exception(error, escaped=True)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end(end_time=end)


def begin(attrs: dict) -> NetworkCall | None:
    """Start a call's ``network`` stage here; None when nothing is recorded."""
    try:
        scope = SCOPE.get()
        if scope is not None:
            if scope is UNTIMED:  # a request production mode does not time
                return _untimed_call()
            if scope[0].__class__ is SummaryRecord:
                # Untimed, summarised: a call's stages are not recorded that way, so the
                # request is only counted (records.SummaryRecord)
                scope[0].broken = True
                return _untimed_call()
            return _begin_in_scope(scope, attrs)
        rt = active_runtime()
        if rt is None:
            return None
        if in_quiet_step():  # a production step's stages are not sent (records.QUIET)
            return _untimed_call()
        return _begin_standalone(rt, attrs)
    except Exception:
        _logger.exception("inferprof could not start a Triton call's stage")
        return None


def _begin_in_scope(scope: tuple, attrs: dict) -> NetworkCall:
    owner, parent = scope
    request = isinstance(owner, RequestRecord)
    if len(owner.stages) >= MAX_STAGES:
        # Past the cap (see inferprof.stage): counted, not recorded; Triton's spans then
        # hang under the request span itself.
        owner.stages_dropped += 1
        return NetworkCall(None, None, owner.span_context if request else None)
    rec = StageRecord(_NETWORK, parent, 0, attrs)
    if request:
        flags = _SAMPLED if owner.head else _NOT_SAMPLED
        state = owner.trace_state
        if owner.live_span is not None:  # another instrumentation's request span
            state = owner.live_span.get_span_context().trace_state
        context = trace_api.SpanContext(owner.trace_id, span_id_of(rec), False, flags, state)
    elif owner.encoding == semconv.BATCH_ENCODING_LINKS and owner.trace_id:
        # The batch's stages form a trace of their own: Triton's spans join it.
        context = trace_api.SpanContext(owner.trace_id, span_id_of(rec), False, _SAMPLED)
    else:
        # ``children`` encoding: the stage is copied under every member request, each copy
        # with an id of its own, so there is no one span for Triton's spans to hang under.
        context = None
    owner.stages.append(rec)
    rec.start = _time_ns()
    return NetworkCall(rec, None, context)


def _untimed_call() -> NetworkCall:
    """In a request production mode does not time: nothing recorded, and the trace
    context it came with (current, if it had one) goes on to Triton."""
    context = trace_api.get_current_span(current_otel_context()).get_span_context()
    return NetworkCall(None, None, context if context.is_valid else None)


def _begin_standalone(rt: Any, attrs: dict) -> NetworkCall | None:
    span_attrs = {semconv.ATTR_STAGE: _NETWORK}
    span_attrs.update(attrs)
    span = rt.tracer.start_span(semconv.span_name(_NETWORK), attributes=span_attrs)
    context = span.get_span_context()
    return NetworkCall(None, span, context if context.is_valid else None)


__all__ = ["OUTGOING", "NetworkCall", "begin", "recording", "with_trace_context"]
