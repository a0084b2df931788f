"""Triton Inference Server's own OpenTelemetry spans, translated into contract stages.

Triton (``--trace-config mode=opentelemetry``, level ``TIMESTAMPS``) emits no
``inferprof.stage``; it records each request's timeline as span events. Per request it
exports, checked on Triton 2.51 (pytriton 0.7.0):

* ``InferRequest`` — the top-level span (SERVER), from reading the request to sending the
  answer (``HTTP_RECV_*``/``GRPC_WAITREAD_*``, ``INFER_RESPONSE_COMPLETE``,
  ``HTTP_SEND_*``/``GRPC_SEND_*``); a child of the caller's span when a trace context came
  with the request;
* the **model span**, named after the model, a child of ``InferRequest``, with attribute
  ``triton.model_name`` and events ``REQUEST_START``, ``QUEUE_START``, ``REQUEST_END``;
* ``compute``, a child of the model span, with events ``COMPUTE_START``,
  ``COMPUTE_INPUT_END``, ``COMPUTE_OUTPUT_START``, ``COMPUTE_END``.

**Recognition.** Only spans of the instrumentation scope ``triton-server`` (the name of
Triton's tracer, fixed in its source, whatever ``service.name`` the operator set) are
looked at, so an export from any other instrumentation pays one string comparison per
scope, never a read of its spans' names or events. Within that scope: a span named
``InferRequest`` is Triton's request span, one carrying ``triton.model_name`` a model span,
one named ``compute`` a compute span. A span that carries ``inferprof.stage`` is never
translated.

**Translation.** The request span of the Triton service is ``InferRequest`` (whatever its
kind; a request span by the contract's local-root rule: its parent is in the caller's
service, or absent), with ``inferprof.model.name`` = its model span's ``triton.model_name``.
Its stages come from the events of its one model span and that span's one ``compute``
child:

=========  ===================================================
``queue``  ``QUEUE_START`` (model span) -> ``COMPUTE_START``
``h2d``    ``COMPUTE_START`` -> ``COMPUTE_INPUT_END``
``compute`` ``COMPUTE_INPUT_END`` -> ``COMPUTE_OUTPUT_START``
``d2h``    ``COMPUTE_OUTPUT_START`` -> ``COMPUTE_END``
=========  ===================================================

The rest of ``InferRequest`` (reading the body, scheduling, building and sending the
response) is ``unattributed``: Triton's receive events lie *before* the span starts
(``GRPC_WAITREAD_START`` seconds before, the handler waiting for the next call), so they
bound no part of it honestly.

A stage is derived only when both its events are present exactly once, in order, and
within ``InferRequest``; otherwise it is left out (never negative, never outside the
request) and the request counts as *partial*. A request with no model span, or more than
one directly under it, is not translated (it stays ignored, as before). Ensembles and BLS
children are not split: an ensemble's top model span has no ``compute`` child (the
request is partial, its time ``unattributed``), and the child requests of BLS or of
ensemble steps, further down, are not requests of their own.
"""

from __future__ import annotations

from typing import Any, Final

from inferprof import semconv as sc

#: Instrumentation scope (tracer name) of every span Triton itself creates.
SCOPE: Final = "triton-server"
SPAN_REQUEST: Final = "InferRequest"
SPAN_COMPUTE: Final = "compute"
ATTR_MODEL_NAME: Final = "triton.model_name"
EVENT_QUEUE_START: Final = "QUEUE_START"
EVENT_COMPUTE_START: Final = "COMPUTE_START"
EVENT_COMPUTE_INPUT_END: Final = "COMPUTE_INPUT_END"
EVENT_COMPUTE_OUTPUT_START: Final = "COMPUTE_OUTPUT_START"
EVENT_COMPUTE_END: Final = "COMPUTE_END"
_COMPUTE_EVENTS: Final = (
    EVENT_COMPUTE_START,
    EVENT_COMPUTE_INPUT_END,
    EVENT_COMPUTE_OUTPUT_START,
    EVENT_COMPUTE_END,
)

#: Kinds of record kept per recognised span.
REQUEST: Final = 0
MODEL: Final = 1
COMPUTE: Final = 2

_REQUEST_RECORD: Final = (REQUEST,)

#: The stages derived from one request, in order, between consecutive timestamps of
#: (QUEUE_START, COMPUTE_START, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END).
STAGES: Final = (sc.STAGE_QUEUE, sc.STAGE_H2D, sc.STAGE_COMPUTE, sc.STAGE_D2H)


def _event_times(span: Any, names: tuple[str, ...]) -> list[int | None]:
    """Times of the events ``names`` on ``span``; None for one absent or repeated."""
    times: list[int | None] = [None] * len(names)
    seen: set[str] = set()
    for ev in span.events:
        name = ev.name
        if name in names:
            i = names.index(name)
            times[i] = None if name in seen else ev.time_unix_nano
            seen.add(name)
    return times


def read_span(span: Any) -> tuple | None:
    """The record of a span of Triton's scope, or None when it is none of Triton's three.

    Events are read here, and only for model and compute spans.
    """
    name = span.name
    if name == SPAN_REQUEST:
        return _REQUEST_RECORD
    if name == SPAN_COMPUTE:
        return (COMPUTE, *_event_times(span, _COMPUTE_EVENTS))
    for kv in span.attributes:
        if kv.key == ATTR_MODEL_NAME:
            model = kv.value.string_value or None
            (queue_start,) = _event_times(span, (EVENT_QUEUE_START,))
            return (MODEL, model, queue_start)
    return None


def translate(
    spans: dict[bytes, tuple], records: dict[bytes, tuple], requests: set[bytes] | list[bytes]
) -> dict[bytes, tuple[str | None, list[tuple[str, int, int]], int]]:
    """For each Triton request span among ``requests``: (model name, derived stages as
    (stage, start ns, end ns), number of Triton spans used).

    ``spans``: the trace's span records (parent id first, then start, end);
    ``records``: span id -> :func:`read_span`'s record, for the trace's Triton spans.
    """
    children: dict[bytes, list[bytes]] = {}
    for sid, rec in records.items():
        if rec[0] != REQUEST:
            children.setdefault(spans[sid][0], []).append(sid)
    out: dict[bytes, tuple[str | None, list[tuple[str, int, int]], int]] = {}
    for rid in requests:
        rec = records.get(rid)
        if rec is None or rec[0] != REQUEST:
            continue
        models = [c for c in children.get(rid, ()) if records[c][0] == MODEL]
        if len(models) != 1:
            continue
        (model_sid,) = models
        _, model, queue_start = records[model_sid]
        computes = [c for c in children.get(model_sid, ()) if records[c][0] == COMPUTE]
        times: list[int | None] = [queue_start]
        if len(computes) == 1:
            times.extend(records[computes[0]][1:])
        else:  # an ensemble's model span (none), or something unexpected (several)
            times.extend((None,) * len(_COMPUTE_EVENTS))
        _, req_start, req_end = spans[rid][:3]
        stages = []
        for stage, s, e in zip(STAGES, times, times[1:], strict=False):
            if s is not None and e is not None and req_start <= s <= e <= req_end:
                stages.append((stage, s, e))
        out[rid] = (model, stages, 2 if len(computes) == 1 else 1)
    return out


__all__ = [
    "ATTR_MODEL_NAME",
    "SCOPE",
    "SPAN_COMPUTE",
    "SPAN_REQUEST",
    "STAGES",
    "read_span",
    "translate",
]
