"""Trace assembly: from OTLP spans to finalised requests with their stage spans.

Spans are grouped by trace id as they arrive, in any order and over any number of
exports. One pass over each span pulls only what the breakdown needs (ids, times, kind,
flags, trace state and a handful of ``inferprof.*`` attributes); everything else is
left in the protobuf. :class:`Assembler` is what the engine drives: ``ingest`` takes an
export, ``advance`` hands back the requests that are final (``finalised.Finalised``). Its
steps are in one module each, over the state they share (``assembler_state``):

* ``traces``: a trace held span by span, the schedules, which spans are request spans
  and which request a stage span belongs to (contract §2);
* ``span_ingest``: a scope's spans one at a time; ``column_ingest``: a scope's common
  traces at once, as numpy columns, held packed (``packed``);
* ``links``: linked batch stage spans (batch encoding (b)), under each member they link;
* ``finalise``: a due trace into its requests' rows; ``packed_finalise``: the same for
  the packed traces due together, with numpy.

A request is final once its request span has arrived and ``settle_s`` has passed on the
collector's clock (arrival time, not the span's own timestamps, so clock skew between a
service and the collector does not matter). Traces that never see a request span, and
linked batch spans whose members never arrive, are evicted after ``trace_timeout_s``.

Cost: everything held is kept in arrival (clock) order beside its dict: traces in
schedules of (time, ids) per export, finalised traces, link index entries and batches
seen in ordered dicts, so finding what is due or expired costs what it removes, not
what is retained. One ``advance`` call does at most ``budget`` units of work (a span
folded or dropped, an entry forgotten) and says whether more is left (``backlog``), so
the caller can hold its lock for a bounded time and come back for the rest.
"""

from __future__ import annotations

import math
from typing import Any

from inferprof import semconv as sc
from inferprof.collector import triton_spans as _triton
from inferprof.collector.assembler_state import Export
from inferprof.collector.column_ingest import ColumnIngest
from inferprof.collector.finalised import Finalised, trace_state_weight
from inferprof.collector.packed import Packed
from inferprof.collector.packed_finalise import PackedFinaliser
from inferprof.collector.span_ingest import resource_of
from inferprof.collector.traces import Trace, pop_older
from inferprof.collector.wire import records_of

#: Batches already counted for padding are remembered this long (seconds).
_BATCH_MEMORY_S = 120.0
#: Work one ``Assembler.advance`` call does at most by default: spans finalised or
#: dropped plus entries forgotten (see ``advance``).
DEFAULT_ADVANCE_BUDGET = 5_000


class Assembler(ColumnIngest, PackedFinaliser):
    """Spans in (``ingest``), finalised requests out (``advance``). Its settings
    (``AssemblyState``, keyword arguments): ``settle_s``, ``trace_timeout_s``,
    ``max_spans_per_trace``, ``max_links_per_span``, ``clock``, ``triton_spans`` and
    ``steps``. Not thread-safe; the engine serialises calls."""

    #: Read exports as columns and assemble the common case with numpy
    #: (``_ingest_columns``); False: span by span (the reference the tests compare with).
    columnar = True
    #: Scopes of fewer spans go span by span even so: there, numpy's cost per call is
    #: more than what reading columns saves (``benchmarks/collector_ingest.py`` with
    #: small exports).
    columnar_min_spans = 384

    def ingest(self, request: Any, payload: bytes | None = None) -> tuple[int, int, list[str]]:
        """Take an OTLP traces export: (spans accepted, spans rejected, the first few
        reasons). Spans are kept pending in their traces until those are due.

        ``payload``: the serialized export ``request`` was parsed from, if at hand: the
        spans are then read off it (``wire.SpanReader``), which costs less than reading
        them off ``request``."""
        ex = Export(self, self.clock())
        triton_on = self.triton_spans
        columnar = self.columnar
        reader = self._reader
        if payload is None and columnar:
            # Serializing (in C) and reading the bytes costs less than reading the message.
            payload = request.SerializeToString()
        scopes = reader.lean_scopes(request, payload) if payload is not None else None
        n = 0
        base = 0  # position of the scope's first span in the export
        for rs in request.resource_spans:
            resource = resource_of(rs)
            for ss in rs.scope_spans:
                spans = ss.spans
                # Triton's spans are told by their scope: other scopes' spans are never
                # asked for their name or events.
                triton = triton_on and ss.scope.name == _triton.SCOPE
                records = None
                if scopes is not None:
                    lean = scopes[n]
                    cols = (
                        reader.columns(lean)
                        if columnar and not triton and len(lean) >= self.columnar_min_spans
                        else None
                    )
                    if cols is not None and self._ingest_columns(ex, cols, spans, resource,
                                                                 base):
                        n += 1
                        base += len(cols)
                        continue
                    records = reader.records(lean)
                n += 1
                if records is None:
                    records = records_of(spans)
                # Every span is accepted unless rejected (and counted) in _ingest_spans.
                ex.seen += len(records)
                self._ingest_spans(ex, records, spans, resource, triton, base)
                base += len(records)
        accepted = ex.seen - ex.rejected
        self._created.add(ex.now, ex.created)
        if ex.packed:  # in the order of the spans that made them due, as one pass would
            order = sorted(range(len(ex.due_at)), key=ex.due_at.__getitem__)
            ex.made_due = [ex.made_due[i] for i in order]
        self._due.add(ex.due, ex.made_due)
        self.received += accepted + ex.rejected
        self.accepted += accepted
        self.pending += accepted - ex.unpending + ex.link_pending
        return accepted, ex.rejected, ex.errors

    def advance(
        self, now: float, *, everything: bool = False, budget: int = DEFAULT_ADVANCE_BUDGET
    ) -> Finalised:
        """Finalise the traces due at ``now``, evict those past ``trace_timeout_s`` and
        forget what is older than it; ``everything``: finalise or evict all that is held
        (shutdown, the end of a file).

        At most about ``budget`` units of work per call: a span finalised or evicted, an
        index entry or finalised trace forgotten (a trace is never split, so one trace
        larger than what is left may go over). ``backlog`` says whether work was left for
        the next call; oldest first, so nothing waits longer than the calls it takes.
        """
        out = Finalised()
        # Packed traces to finalise, in order: together, with numpy (``_finalise_packed``).
        run: list[tuple[bytes, Packed]] = []
        if everything:
            left = self._finalise_all(out, run, now, budget)
        else:
            left = self._finalise_due(out, run, now, budget)
            if left > 0:
                left = self._expire_created(now, left)
        if run:
            self._finalise_packed(run, out, now)
        if left > 0:
            left = self._expire_links(math.inf if everything else now - self.trace_timeout_s,
                                      left)
        if left > 0:
            left = self._forget(now, everything, left)
        self.backlog = left <= 0
        return out

    def _finalise_one(self, tid: bytes, trace: Any, run: list[tuple[bytes, Packed]],
                      out: Finalised, now: float) -> None:
        """Finalise ``trace`` into ``out``, in order: a packed one joins ``run`` (finalised
        together later), unless batch spans are linked to it; any other takes the run so
        far first."""
        if trace.__class__ is Packed:
            links = self.links
            if not (links and (tid, trace.rid) in links):
                run.append((tid, trace))
                return
            trace = trace.unpack()  # with linked batch spans: the general way
        if run:
            self._finalise_packed(run, out, now)
            run.clear()
        self._finalise(tid, trace, out, now)

    def _finalise_all(self, out: Finalised, run: list[tuple[bytes, Packed]], now: float,
                      left: int) -> int:
        """Finalise, or evict if not due, every trace held while ``left`` (work units)
        lasts; returns what is left."""
        traces = self.traces
        while traces and left > 0:
            tid, trace = traces.popitem()
            left -= len(trace) + self.link_count.get(tid, 0)
            if trace.due is not None:
                self._finalise_one(tid, trace, run, out, now)
            else:
                self._expire(tid, trace)
        if not traces:
            self._due.clear()
            self._created.clear()
        return left

    def _finalise_due(self, out: Finalised, run: list[tuple[bytes, Packed]], now: float,
                      left: int) -> int:
        """Finalise the traces due at ``now``, oldest first, while ``left`` lasts."""
        traces = self.traces
        for due, tid in self._due.take(now):
            trace = traces.get(tid)
            left -= 1
            if trace is not None and trace.due == due:
                del traces[tid]
                left -= len(trace) + self.link_count.get(tid, 0)
                self._finalise_one(tid, trace, run, out, now)
            # else: finalised already, or due later (it has another entry)
            if left <= 0:
                break
        return left

    def _expire_created(self, now: float, left: int) -> int:
        """Evict the traces opened before ``trace_timeout_s`` that never became due,
        oldest first, while ``left`` lasts."""
        traces = self.traces
        for created, tid in self._created.take(now - self.trace_timeout_s):
            trace = traces.get(tid)
            left -= 1
            if trace is not None and trace.created == created and trace.due is None:
                del traces[tid]
                left -= len(trace.spans)
                self._expire(tid, trace)
            # else: finalised already, or a later trace of that id, or due
            if left <= 0:
                break
        return left

    def _forget(self, now: float, everything: bool, left: int) -> int:
        """Forget, while ``left`` lasts, the traces finalised before ``trace_timeout_s``
        (unless finalising ``everything``) and the batches seen before
        ``_BATCH_MEMORY_S``."""
        if not everything:
            counted = self.counted
            for tid in pop_older(self.recent_done, now - self.trace_timeout_s):
                counted.pop(tid, None)
                left -= 1
                if left <= 0:
                    return left
        for _ in pop_older(self.seen_batches, now - _BATCH_MEMORY_S):
            left -= 1
            if left <= 0:
                break
        return left

    def _expire(self, tid: bytes, trace: Trace) -> None:
        """A trace evicted without a request span: its spans are ``late`` (their request
        was finalised before), ``incomplete_trace`` (stage spans with no request) or
        ignored."""
        n = len(trace.spans)
        self.pending -= n
        if trace.late or tid in self.recent_done:
            self._drop(sc.DROP_LATE, n)
        elif trace.has_stage():
            self.incomplete += 1
            self._drop(sc.DROP_INCOMPLETE_TRACE, n)
        else:
            self.ignored += n

    def discard(self, reason: str) -> None:
        """Drop everything held (pending spans, linked batch spans), counted under
        ``reason``; what was finalised is kept."""
        self._drop(reason, self.pending)
        self.pending = 0
        self.traces.clear()
        self.links.clear()
        self.link_created.clear()
        self.link_late.clear()
        self.link_refs.clear()
        self.link_count.clear()
        self._due.clear()
        self._created.clear()
        self.backlog = False


__all__ = ["DEFAULT_ADVANCE_BUDGET", "Assembler", "Finalised", "trace_state_weight"]
