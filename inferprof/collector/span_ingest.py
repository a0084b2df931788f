"""Span-by-span ingest: each span of a scope read once (``wire.SpanRecord``), checked, and
kept pending in its trace (``traces.Trace``), linked (``links``) or handed to the engine's
step timeline; the reference the columnar path (``column_ingest``) must match, and the
path of every span that one leaves (traces split over exports, late and re-sent spans,
linked batch spans, Triton's scope, generation and engine step spans, malformed spans).

A request span is a candidate when it is a SERVER or CONSUMER span, says
``inferprof.request=true``, is an engine's own request span or Triton's; which candidates
are request spans is decided when the trace is finalised (``traces.local_roots``). A trace
becomes due ``settle_s`` after the export that brought its latest candidate, on the
collector's clock (see ``assembly``)."""

from __future__ import annotations

from typing import Any

from inferprof import semconv as sc
from inferprof.collector import gen_spans as _gen
from inferprof.collector import triton_spans as _triton
from inferprof.collector.assembler_state import Export
from inferprof.collector.links import LinkIndex
from inferprof.collector.packed import Packed
from inferprof.collector.traces import (
    CANDIDATE_KINDS,
    DAY_NS,
    FLAG_ERROR,
    OTLP_FLAGS,
    STATUS_ERROR,
    ZERO_SPAN,
    ZERO_TRACE,
    Trace,
)
from inferprof.collector.wire import EMPTY, SpanRecord

_DEFAULT_SERVICE = "unknown_service"


def resource_of(rs: Any) -> tuple[str, str, str]:
    """(service.name, host.name, service.instance.id) of a ResourceSpans."""
    service = _DEFAULT_SERVICE
    host = ""
    instance = ""
    for kv in rs.resource.attributes:
        k = kv.key
        if k == sc.RESOURCE_SERVICE_NAME:
            service = kv.value.string_value or _DEFAULT_SERVICE
        elif k == sc.RESOURCE_HOST_NAME:
            host = kv.value.string_value
        elif k == sc.RESOURCE_SERVICE_INSTANCE_ID:
            instance = kv.value.string_value
    return service, host, instance


def _triton_span(trace: Trace, span: Any, sid: bytes) -> bool:
    """Keep what a span of Triton's scope says; whether it is Triton's request span."""
    trec = _triton.read_span(span)
    if trec is None:
        return False
    if trace.triton is None:
        trace.triton = {sid: trec}
    else:
        trace.triton[sid] = trec
    return bool(trec[0] == _triton.REQUEST)


def _reject_malformed(ex: Export, tid: bytes, sid: bytes, start: int, end: int,
                      is_open: bool) -> None:
    """Reject a span of an invalid id (of a trace not open: ``is_open`` False) or an
    invalid duration, the id's reason first."""
    if (not is_open and (len(tid) != 16 or tid == ZERO_TRACE)) or len(sid) != 8 or (
            sid == ZERO_SPAN):
        ex.reject(sc.DROP_INVALID_ID,
                  f"span {sid.hex()!r} in trace {tid.hex()!r}: invalid trace or span id")
    elif end < start:
        ex.reject(sc.DROP_NEGATIVE_DURATION, f"span {sid.hex()}: end time before start time")
    else:
        ex.reject(sc.DROP_ABSURD_DURATION, f"span {sid.hex()}: duration over one day")


def _reject_held(ex: Export, tid: bytes, sid: bytes, held: dict, max_spans: int) -> None:
    """Reject a span of an open trace (whose spans are ``held``): its id is there already,
    or the trace has ``max_spans``."""
    if sid in held:
        ex.reject(sc.DROP_DUPLICATE, f"span {sid.hex()}: duplicate span id in trace {tid.hex()}")
    else:
        ex.reject(sc.DROP_TRACE_TOO_LARGE, f"trace {tid.hex()}: more than {max_spans} spans")


class SpanIngest(LinkIndex):
    """The span-by-span ingest steps of ``Assembler``."""

    def _ingest_spans(self, ex: Export, records: list[SpanRecord], spans: Any,
                      resource: tuple, triton: bool, base: int = 0) -> None:
        """``records``: those of ``spans``, the ``Span`` messages, read only for links,
        Triton's spans and what a record leaves out. ``base``: the position of the scope's
        first span in the export. What only rare spans need (rejections, engine steps, a
        new stage name, links) is in calls of its own: the common span costs none."""
        now = ex.now
        traces = self.traces
        stage_index = self.stage_index
        max_spans = self.max_spans_per_trace
        recent_done = self.recent_done
        step_sink = self.steps
        for (tid, sid, parent, start, end, kind, span_flags, status, trace_state, stage,
             extra, n_links, k) in records:
            # A trace already open has a valid id: only a new one is checked.
            trace = traces.get(tid)
            if trace.__class__ is Packed:  # another span of it: held span by span now
                trace = traces[tid] = trace.unpack()
            if (
                (trace is None and (len(tid) != 16 or tid == ZERO_TRACE))
                or len(sid) != 8
                or sid == ZERO_SPAN
                or not 0 <= end - start <= DAY_NS
            ):
                _reject_malformed(ex, tid, sid, start, end, trace is not None)
                continue
            if extra is not None and step_sink is not None and _gen.is_step_span(
                    extra, stage, parent):
                self._step_span(ex, tid, trace, resource, extra, stage, start, end)
                continue
            sidx = None
            if stage is not None:
                # Stage name -> its number; a name not seen before is checked.
                try:
                    sidx = stage_index.get(stage)
                except TypeError:  # an array or map value: no stage name
                    sidx = None
                if sidx is None:
                    sidx, extra = self._unknown_stage(ex, stage, sid, extra)
                    if sidx == -1:
                        continue
                # Links matter on stage spans only: batch encoding (b), attributed
                # through its links only.
                if sidx is not None and n_links:
                    self._link_span(ex, spans[k].links, tid, sid, (sidx, start, end, resource,
                                                                   extra, (tid, sid)))
                    continue
            if trace is None:
                trace = traces[tid] = Trace(now)
                ex.created.append(tid)
                if tid in recent_done:
                    trace.late = True
            elif sid in trace.spans or len(trace.spans) >= max_spans:
                _reject_held(ex, tid, sid, trace.spans, max_spans)
                continue
            triton_request = triton and sidx is None and _triton_span(trace, spans[k], sid)
            if kind in CANDIDATE_KINDS or (extra is not None and (
                    extra.get(sc.ATTR_REQUEST) is True or _gen.is_engine_request(extra))
            ) or triton_request:
                trace.candidates.append(sid)
                if trace.due is None or ex.due > trace.due:
                    trace.due = ex.due
                    ex.made_due.append(tid)
                    ex.due_at.append(base + k)
                # Only request spans need the trace state, the is-remote bits and the
                # status.
                if status is None:  # a record of the message: read there
                    span = spans[k]
                    span_flags, status, trace_state = span.flags, span.status.code, span.trace_state
                flags = span_flags & OTLP_FLAGS
                if status == STATUS_ERROR:
                    flags |= FLAG_ERROR
                trace.spans[sid] = (parent, start, end, sidx, resource, extra,
                                    True, flags, trace_state)
            else:
                trace.spans[sid] = (parent, start, end, sidx, resource, extra,
                                    False, 0, None)

    def _unknown_stage(self, ex: Export, stage: Any, sid: bytes,
                       extra: dict | None) -> tuple[int | None, dict | None]:
        """(stage number, wanted attributes) of a span whose stage value is not numbered
        yet: a valid name gets the next number; an empty one (present but empty) no
        number, though the span still "carries an inferprof attribute" (see
        ``TraceFinaliser._request_alone``); a bad one is rejected (number -1)."""
        if stage is EMPTY:
            return None, {**(extra or {}), sc.ATTR_STAGE: None}
        sidx = self._new_stage(ex, stage, sid)
        return (-1 if sidx is None else sidx), extra

    def _step_span(self, ex: Export, tid: bytes, trace: Trace | None, resource: tuple,
                   extra: dict, stage: Any, start: int, end: int) -> None:
        """An engine step (or a device stage of one): to the engine's timeline, never
        pending (its trace has no request)."""
        ex.unpending += 1
        if stage is not None:
            self.ignored += 1
            return
        why = self.steps.add_step(resource, extra, start, end, ex.now)
        if why is not None:
            ex.unpending -= 1  # rejected, not accepted
            ex.reject(sc.DROP_INVALID_STEPS, f"engine steps span in trace {tid.hex()}: {why}")
            return
        # Device stages sent without the engine id came first.
        stray = self.traces.pop(tid, None) if trace is not None else None
        if stray is not None:
            n_stray = len(stray.spans)
            self.pending -= n_stray
            self.ignored += n_stray

    def _new_stage(self, ex: Export, stage: Any, sid: bytes) -> int | None:
        """The number of a stage name not seen before; None (rejected) for a bad one."""
        if (
            isinstance(stage, str)
            and sc.STAGE_NAME_PATTERN.match(stage)
            and stage != sc.STAGE_UNATTRIBUTED
        ):
            sidx = self.stage_index[stage] = len(self.stage_names)
            self.stage_names.append(stage)
            return sidx
        ex.reject(sc.DROP_INVALID_STAGE, f"span {sid.hex()}: invalid stage value {stage!r}")
        return None


__all__ = ["SpanIngest", "resource_of"]
