"""What the assembler holds per trace until it is finalised or evicted.

A :class:`Trace` keeps, per span id, only what the breakdown needs (ids, times, stage,
resource, flags, trace state and the wanted ``inferprof.*`` attributes); everything else is
left in the protobuf.

Its request spans (contract §2, :func:`local_roots`): a SERVER or CONSUMER span whose parent
is absent, remote (OTLP span flags) or in another service, or any span with
``inferprof.request=true``. A stage span without links belongs to the nearest request span
among its ancestors (:func:`find_owner`).

Cost: traces are found by time through a :class:`Schedule` per kind of deadline (one (time,
ids) entry per export), and the other clock-ordered records through :func:`pop_older`, so
finding what is due or expired costs what it removes, not what is retained.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator

from inferprof import semconv as sc

DAY_NS = 86_400 * 1_000_000_000
ZERO_TRACE = bytes(16)
ZERO_SPAN = bytes(8)
KIND_SERVER = 2
KIND_CONSUMER = 5
#: Span kinds that make a request-span candidate (besides ``inferprof.request=true``).
CANDIDATE_KINDS = frozenset({KIND_SERVER, KIND_CONSUMER})
FLAG_HAS_IS_REMOTE = 0x100
FLAG_IS_REMOTE = 0x200
#: The OTLP span flags inferprof reads (trace flags, has-is-remote, is-remote); OTLP
#: reserves the bits above, so they are masked off before FLAG_ERROR goes in.
OTLP_FLAGS = 0x3FF
#: Not an OTLP flag: the span's status is ERROR.
FLAG_ERROR = 0x10000
STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


def pop_older(d: OrderedDict, horizon: float) -> Iterator:
    """Remove and yield, one at a time, the leading keys of ``d`` whose value is below
    ``horizon``; the caller stops when it has done enough.

    ``d`` is filled in clock order, so they are at the front. An ``OrderedDict`` finds its
    first key in O(1); a plain dict's ``next(iter(d))`` rescans the slots its deleted
    leading keys left behind, which made each removal cost O(removed so far).
    """
    while d:
        key = next(iter(d))
        if d[key] >= horizon:
            return
        d.popitem(last=False)
        yield key


class Schedule:
    """Trace ids by time, in clock order: one (time, ids) entry per ingest call.

    Entries are not removed when their trace goes (the reader checks the trace still
    has that time): a trace costs one list slot here, and each entry is looked at once.
    """

    __slots__ = ("_entries", "_pos")

    def __init__(self) -> None:
        self._entries: deque[tuple[float, list[bytes]]] = deque()
        self._pos = 0  # ids of the first entry already taken

    def add(self, t: float, ids: list[bytes]) -> None:
        if ids:
            self._entries.append((t, ids))

    def take(self, until: float) -> Iterator[tuple[float, bytes]]:
        """Remove and yield (time, id) with time <= ``until``, oldest first, one at a
        time: what the caller does not ask for stays."""
        entries = self._entries
        while entries:
            t, ids = entries[0]
            if t > until:
                return
            while self._pos < len(ids):
                self._pos += 1
                yield t, ids[self._pos - 1]
            entries.popleft()
            self._pos = 0

    def clear(self) -> None:
        self._entries.clear()
        self._pos = 0


class Trace:
    """A trace held span by span: its spans by id, its request-span candidates, when it
    is due (None: no request-span candidate yet) and when it was opened."""

    __slots__ = ("candidates", "created", "due", "late", "spans", "triton")

    def __init__(self, created: float) -> None:
        # span id -> (parent id, start, end, stage index, resource, extra, is_candidate,
        # flags, trace state). ``stage index``: into Assembler.stage_names, None for a
        # span that is no stage span. ``extra``: the wanted attributes other than the
        # stage, or None (most stage spans carry nothing else: no dict for them).
        self.spans: dict[bytes, tuple] = {}
        self.candidates: list[bytes] = []
        self.due: float | None = None
        self.created = created
        #: Opened for a trace finalised in the last ``trace_timeout_s``: its spans came
        #: after their request was folded (counted ``late`` if no request span comes).
        self.late = False
        # span id -> triton_spans.read_span record, for Triton's own spans (None: none).
        self.triton: dict[bytes, tuple] | None = None

    def has_stage(self) -> bool:
        # Asked only of expired traces: cheaper than a flag set per span on ingest.
        return any(rec[3] is not None for rec in self.spans.values())

    def __len__(self) -> int:
        return len(self.spans)


def local_roots(trace: Trace) -> set[bytes]:
    """The trace's request spans: candidates marked ``inferprof.request``, without a
    parent, with a remote parent, or whose parent belongs to another service."""
    spans = trace.spans
    requests: set[bytes] = set()
    for sid in trace.candidates:
        parent, _, _, _, resource, extra, _, flags, _ = spans[sid]
        if extra is not None and extra.get(sc.ATTR_REQUEST) is True:
            requests.add(sid)
            continue
        if not parent or parent == ZERO_SPAN:
            requests.add(sid)
            continue
        if flags & FLAG_HAS_IS_REMOTE and flags & FLAG_IS_REMOTE:
            requests.add(sid)
            continue
        p = spans.get(parent)
        if p is None or p[4][0] != resource[0]:
            requests.add(sid)
    return requests


def find_owner(sid: bytes, spans: dict, requests: set, memo: dict) -> bytes | None:
    """The request span among ``requests`` nearest above span ``sid`` (None: none); the
    ancestors walked are remembered in ``memo``, so the spans of one trace do not walk the
    same ancestors twice."""
    path = []
    cur: bytes | None = spans[sid][0]
    result = None
    depth = 0
    while cur:
        if cur in memo:
            result = memo[cur]
            break
        if cur in requests:
            result = cur
            break
        path.append(cur)
        rec = spans.get(cur)
        depth += 1
        if rec is None or depth > 10_000:
            break
        cur = rec[0]
    for p in path:
        memo[p] = result
    return result


__all__ = [
    "CANDIDATE_KINDS",
    "DAY_NS",
    "FLAG_ERROR",
    "FLAG_HAS_IS_REMOTE",
    "FLAG_IS_REMOTE",
    "KIND_CONSUMER",
    "KIND_SERVER",
    "OTLP_FLAGS",
    "STATUS_ERROR",
    "ZERO_SPAN",
    "ZERO_TRACE",
    "Schedule",
    "Trace",
    "find_owner",
    "local_roots",
    "pop_older",
]
