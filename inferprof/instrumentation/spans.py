"""One description of a span: :class:`SpanSpec`, what every encoder consumes.

The runtime describes each span of a kept trace once, as a ``SpanSpec``; the SDK path turns
specs into ``ReadableSpan`` objects (``Runtime._spans``), the API path into spans of a
foreign provider (``Runtime._emit_via_api``), and inferprof's OTLP encoder into protobuf
bytes (``otlp_encode``). :func:`error_parts` is the one translation of a recorded error
into a span's status, events and attributes, shared by all three.
"""

from __future__ import annotations

import asyncio
import random
import traceback
from typing import Any, NamedTuple

from opentelemetry.sdk.trace import Event
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

from inferprof import semconv
from inferprof.instrumentation.records import BatchRecord, StageRecord, span_id_of

UNSET = Status(StatusCode.UNSET)
_getrandbits = random.getrandbits


class SpanSpec(NamedTuple):
    """One span of a trace, before it is built or encoded.

    ``parent``: a ``SpanContext`` (the request's remote or local parent), None (a root), or
    the span id of another span of the same trace. ``error``: None, an exception, a
    message (an error without an exception), or its :func:`error_parts` already.
    """

    name: str
    span_id: int
    parent: SpanContext | int | None
    kind: SpanKind
    start: int
    end: int
    attributes: dict[str, Any]
    error: Any
    links: tuple[Link, ...]


#: ``SpanSpec(*fields)`` without the keyword handling of the generated ``__new__``: specs
#: are built per stage of every kept trace.
new_spec = tuple.__new__


_INTERNAL = SpanKind.INTERNAL
_ATTR_STAGE = semconv.ATTR_STAGE
_span_name = semconv.span_name
_TOKEN_STAGES = frozenset({semconv.STAGE_BATCH_ASSEMBLY}) | semconv.COMPUTE_STAGES


def stage_spec(st: StageRecord, root: int, end: int) -> SpanSpec:
    """The span of a request's stage ``st``: a child of its enclosing stage, else of
    ``root`` (the request span); ``end``, the request's, if the stage is still open."""
    parent = st.parent
    attrs: dict[str, Any] = {_ATTR_STAGE: st.name}
    attrs.update(st.attrs)
    return new_spec(SpanSpec, (
        _span_name(st.name), span_id_of(st),
        span_id_of(parent) if parent is not None else root, _INTERNAL,
        st.start, st.end or end, attrs, st.error, (),
    ))


def batch_stage_attrs(batch: BatchRecord, st: StageRecord) -> dict[str, Any]:
    """The attributes of batch stage ``st``'s span: the stage name, the batch's attributes,
    its token counts on the stages they describe (contract §3), the stage's own."""
    attrs: dict[str, Any] = {_ATTR_STAGE: st.name}
    attrs.update(batch.attrs)
    if batch.stages_dropped:
        attrs[semconv.ATTR_STAGES_DROPPED] = batch.stages_dropped
    if st.name in _TOKEN_STAGES:
        attrs.update(batch.tokens)
    attrs.update(st.attrs)
    return attrs


def new_span_id() -> int:
    # getrandbits(64) is 0 with probability 2**-64; an invalid id would only make one span
    # unexportable, but the check is nearly free.
    return _getrandbits(64) or 1


def new_trace_id() -> int:
    return _getrandbits(128) or 1


def error_parts(error: Any, when: int) -> tuple[Status, tuple[Event, ...], dict[str, Any]]:
    """Status, events and extra attributes for a span that ended with ``error``."""
    if isinstance(error, tuple):  # frozen already (Runtime freezes queued traces' errors)
        return error
    if isinstance(error, str):  # an error without an exception (e.g. an HTTP 5xx response)
        return Status(StatusCode.ERROR, error), (), {}
    if isinstance(error, asyncio.CancelledError):
        return UNSET, (), {semconv.ATTR_CANCELLED: True}
    etype = type(error)
    name = (
        etype.__qualname__
        if etype.__module__ == "builtins"
        else f"{etype.__module__}.{etype.__qualname__}"
    )
    event = Event(
        "exception",
        {
            "exception.type": name,
            "exception.message": str(error),
            "exception.stacktrace": "".join(
                traceback.format_exception(etype, error, error.__traceback__)
            ),
            "exception.escaped": "True",
        },
        timestamp=when,
    )
    return Status(StatusCode.ERROR, f"{etype.__name__}: {error}"), (event,), {}


__all__ = [
    "UNSET",
    "SpanSpec",
    "batch_stage_attrs",
    "error_parts",
    "new_span_id",
    "new_spec",
    "new_trace_id",
    "stage_spec",
]
