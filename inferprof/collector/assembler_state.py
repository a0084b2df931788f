"""The assembler's state, shared by the steps of ``Assembler`` (each in its own module:
``links``, ``span_ingest``, ``column_ingest``, ``finalise``, ``packed_finalise``): the traces
held and their schedules, the link index, what was finalised recently, the stage names
numbered so far and the counters; and :class:`Export`, what one export's ingest counts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from inferprof.collector.traces import Schedule, Trace
from inferprof.collector.wire import SpanReader

_MAX_ERRORS = 5


class AssemblyState:
    """What ``Assembler`` holds and counts; its steps read and update it in place. Not
    thread-safe; the engine serialises calls."""

    def __init__(
        self,
        *,
        settle_s: float,
        trace_timeout_s: float,
        max_spans_per_trace: int,
        max_links_per_span: int = 1024,
        clock: Callable[[], float],
        triton_spans: bool = True,
        steps: Any = None,
    ) -> None:
        self.settle_s = settle_s
        #: Where engine step spans go (``steps.StepIndex``); None: kept as other spans.
        self.steps = steps
        #: Translate Triton's own spans into stages (see ``triton_spans``).
        self.triton_spans = triton_spans
        self.trace_timeout_s = trace_timeout_s
        self.max_spans_per_trace = max_spans_per_trace
        #: Links read per linked batch span; the rest are dropped (``too_many_links``).
        self.max_links_per_span = max_links_per_span
        self.clock = clock
        self.traces: dict[bytes, Trace] = {}
        # Trace ids by the time their trace becomes due (settles) and by creation time.
        self._due = Schedule()
        self._created = Schedule()
        # (trace id, span id) of a member request -> linked batch stage spans
        self.links: dict[tuple[bytes, bytes], list[tuple]] = {}
        self.link_created: OrderedDict[tuple[bytes, bytes], float] = OrderedDict()
        # Index entries opened for a request finalised in the last trace_timeout_s (a
        # batch span that came after its member was folded): ``late`` when they expire.
        self.link_late: set[tuple[bytes, bytes]] = set()
        # linked span identity -> index entries still referring to it
        self.link_refs: dict[tuple[bytes, bytes], int] = {}
        # member trace id -> index entries naming it: at most max_spans_per_trace, like
        # the trace's own spans (they are folded with it, in one share of work)
        self.link_count: dict[bytes, int] = {}
        # Finalised traces, for ``trace_timeout_s``: trace id -> when (clock order), and
        # trace id -> the request spans counted (a re-sent export must not count twice).
        self.recent_done: OrderedDict[bytes, float] = OrderedDict()
        self.counted: dict[bytes, tuple[bytes, ...]] = {}
        self.seen_batches: OrderedDict[Any, float] = OrderedDict()
        self.pending = 0
        #: The last ``advance`` stopped at its budget: more is due now.
        self.backlog = False
        # Valid stage names seen, numbered in order of appearance: records and
        # finalised columns carry the number, so the engine maps names once, not per span.
        self.stage_index: dict[str, int] = {}
        self.stage_names: list[str] = []
        self.dropped: dict[str, int] = {}
        self.received = 0
        self.accepted = 0
        self.ignored = 0
        self.incomplete = 0
        #: Triton requests counted with fewer than the four stages derived.
        self.triton_partial = 0
        self._reader = SpanReader()

    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def _stage_number(self, stage: str) -> int:
        sidx = self.stage_index.get(stage)
        if sidx is None:
            sidx = self.stage_index[stage] = len(self.stage_names)
            self.stage_names.append(stage)
        return sidx


class Export:
    """What one export's ingest counts as it goes."""

    __slots__ = (
        "asm",
        "created",
        "due",
        "due_at",
        "errors",
        "link_pending",
        "made_due",
        "now",
        "packed",
        "rejected",
        "seen",
        "unpending",
    )

    def __init__(self, asm: AssemblyState, now: float) -> None:
        self.asm = asm
        self.now = now
        self.due = now + asm.settle_s
        #: traces opened and traces made due by this export, for the schedules
        self.created: list[bytes] = []
        self.made_due: list[bytes] = []
        #: each made_due entry's position in the export (scopes' spans numbered in order)
        self.due_at: list[int] = []
        #: traces were assembled by columns (``made_due`` is then sorted by ``due_at``)
        self.packed = False
        self.seen = 0
        self.rejected = 0
        #: accepted spans that are not pending: engine step spans and their device stages
        self.unpending = 0
        self.link_pending = 0
        self.errors: list[str] = []

    def reject(self, reason: str, why: str) -> None:
        self.rejected += 1
        self.asm._drop(reason)
        self.note(why)

    def note(self, why: str) -> None:
        if len(self.errors) < _MAX_ERRORS:
            self.errors.append(why)


__all__ = ["AssemblyState", "Export"]
