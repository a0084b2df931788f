"""Trace assembly: from OTLP spans to finalised requests with their stage spans.

Spans are grouped by trace id as they arrive, in any order and over any number of
exports. One pass over each span pulls only what the breakdown needs (ids, times, kind,
flags, trace state and a handful of ``inferprof.*`` attributes); everything else is
left in the protobuf.

Attribution (contract §2):

* a **request span** is a SERVER or CONSUMER span whose parent is absent, remote
  (OTLP span flags) or in another service, or any span with ``inferprof.request=true``;
* a stage span without links belongs to the nearest request span among its ancestors;
* a stage span *with* links (batch encoding (b)) belongs to every request span it links
  to, whichever trace and export those arrive in, before or after the batch span;
* batch encoding (a) (the stage span repeated under each member) needs nothing special.

A request is final once its request span has arrived and ``settle_s`` has passed on the
collector's clock (arrival time, not the span's own timestamps, so clock skew between a
service and the collector does not matter). Traces that never see a request span, and
linked batch spans whose members never arrive, are evicted after ``trace_timeout_s``.

A request span with no stage span and no ``inferprof.*`` attribute (health checks,
metric scrapes on an instrumented server) is not an inference request and is ignored.

Cost: everything held is kept in arrival (clock) order beside its dict: traces in
schedules of (time, ids) per export, finalised traces, link index entries and batches
seen in ordered dicts, so finding what is due or expired costs what it removes, not
what is retained. One ``advance`` call does at most ``budget`` units of work (a span
folded or dropped, an entry forgotten) and says whether more is left (``backlog``), so
the caller can hold its lock for a bounded time and come back for the rest.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from inferprof import semconv as sc
from inferprof.collector import gen_spans as _gen
from inferprof.collector import triton_spans as _triton
from inferprof.collector.cost import member_share
from inferprof.collector.verdict import normalize_gpu_id
from inferprof.collector.wire import EMPTY, Columns, SpanReader, SpanRecord, id_bytes, records_of

_DAY_NS = 86_400 * 1_000_000_000
_ZERO_TRACE = bytes(16)
_ZERO_SPAN = bytes(8)
_KIND_SERVER = 2
_KIND_CONSUMER = 5
#: Span kinds that make a request-span candidate (besides ``inferprof.request=true``).
_CANDIDATE_KINDS = frozenset({_KIND_SERVER, _KIND_CONSUMER})
_FLAG_HAS_IS_REMOTE = 0x100
_FLAG_IS_REMOTE = 0x200
#: The OTLP span flags inferprof reads (trace flags, has-is-remote, is-remote); OTLP
#: reserves the bits above, so they are masked off before _FLAG_ERROR goes in.
_OTLP_FLAGS = 0x3FF
#: Not an OTLP flag: the span's status is ERROR.
_FLAG_ERROR = 0x10000
_STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
_DEFAULT_SERVICE = "unknown_service"
_MAX_ERRORS = 5
#: Batches already counted for padding are remembered this long (seconds).
_BATCH_MEMORY_S = 120.0
#: Work one ``Assembler.advance`` call does at most by default: spans finalised or
#: dropped plus entries forgotten (see ``advance``).
DEFAULT_ADVANCE_BUDGET = 5_000

_PADDING_STAGES = frozenset({sc.STAGE_BATCH_ASSEMBLY, sc.STAGE_COMPUTE})
_COMPUTE_STAGES = frozenset(sc.COMPUTE_STAGES)
#: A batch's work: what the worker is busy with while later requests queue behind it.
_WORK_STAGES = frozenset(sc.COMPUTE_STAGES | sc.TRANSFER_STAGES)
_MODEL = sc.ATTR_MODEL_NAME
_BATCH_ID = sc.ATTR_BATCH_ID
_MAX_WEIGHT = sc.MAX_SAMPLE_WEIGHT
_EFFECTIVE = sc.ATTR_TOKENS_EFFECTIVE
_PADDED = sc.ATTR_TOKENS_PADDED
_GPU_ID = sc.ATTR_GPU_ID
_BATCH_SIZE = sc.ATTR_BATCH_SIZE
_BEHIND_S = sc.ATTR_QUEUE_BEHIND_BATCHES_S
_PROMPT_TOKENS = sc.ATTR_TOKENS_PROMPT
_GEN_AI_PROMPT_TOKENS = sc.ATTR_GEN_AI_USAGE_PROMPT_TOKENS
_QUEUE = sc.STAGE_QUEUE
#: The attributes a span of a trace assembled by columns may carry (see
#: ``Assembler._ingest_columns``): none makes a span a request, a step or a generating one.
_SIMPLE_KEYS = frozenset(
    {
        sc.ATTR_SAMPLE_WEIGHT,
        _MODEL,
        _BATCH_ID,
        _EFFECTIVE,
        _PADDED,
        _GPU_ID,
        _BATCH_SIZE,
        _BEHIND_S,
        sc.ATTR_SUMMARY_COUNTED,
        _PROMPT_TOKENS,
        _GEN_AI_PROMPT_TOKENS,
    }
)
_ZERO_TRACE_V = np.zeros(1, "V16")[0]


def _pop_older(d: OrderedDict, horizon: float) -> Iterator:
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


class _Schedule:
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


def trace_state_weight(trace_state: str) -> float | None:
    """Adjusted count from an OpenTelemetry ``ot=th:<hex>`` tracestate, or None.

    The threshold T is the hex string padded right with zeros to 14 digits; the
    sampling probability is ``1 - T / 2**56`` and the adjusted count its inverse.
    """
    if not trace_state or "ot=" not in trace_state:
        return None
    for member in trace_state.split(","):
        key, _, value = member.strip().partition("=")
        if key != sc.TRACESTATE_OT_KEY:
            continue
        for sub in value.split(";"):
            sk, _, sv = sub.partition(":")
            if sk != sc.TRACESTATE_THRESHOLD_KEY:
                continue
            if not sv or len(sv) > 14:
                return None
            try:
                threshold = int(sv.ljust(14, "0"), 16)
            except ValueError:
                return None
            probability = 1.0 - threshold / float(1 << 56)
            return 1.0 / probability if probability > 0 else None
    return None


def _request_fields(extra: dict | None, flags: int, trace_state: str | None) -> tuple:
    """A request row's (model, weight, error, counted, prompt tokens) from its request
    span's wanted attributes, flags (``_FLAG_ERROR`` set: status ERROR) and trace state."""
    model = extra.get(sc.ATTR_MODEL_NAME) if extra else None
    if model is None and extra:
        model = _gen.model_of(extra)
    weight = None
    if extra:
        w = extra.get(sc.ATTR_SAMPLE_WEIGHT)
        if (
            isinstance(w, (int, float))
            and not isinstance(w, bool)
            and 1 <= w <= _MAX_WEIGHT
        ):
            weight = float(w)
    if weight is None:
        weight = (trace_state and trace_state_weight(trace_state)) or 1.0
    tokens = extra.get(_PROMPT_TOKENS) if extra else None
    if tokens is None and extra:
        tokens = extra.get(_GEN_AI_PROMPT_TOKENS)
    return (
        model,
        weight,
        1 if flags & _FLAG_ERROR else 0,
        1 if extra and extra.get(sc.ATTR_SUMMARY_COUNTED) is True else 0,
        tokens if type(tokens) is int and tokens > 0 else 0,
    )


class Finalised:
    """Requests finalised by one ``Assembler.advance`` call, column by column.

    Columns rather than one object per request: the engine folds them with numpy, and a
    per-request record with per-request dicts cost more than the folding itself. Numeric
    columns are ``array.array`` (numpy reads them without a copy; times are unsigned
    64-bit like OTLP's).

    Per request ``i``: ``service[i]``, ``model[i]`` (the attribute's value as sent: the
    engine turns anything but a string into ""), ``weight[i]``, ``start[i]`` and
    ``end[i]`` (ns), ``error[i]`` (1: the request span's status is ERROR). Per stage span
    attributed to a request (a linked batch span once per member): ``span_key`` = request
    index << 32 | stage number (one append instead of two; the number indexes
    ``Assembler.stage_names``), ``span_start``, ``span_end`` (ns). ``batches``: (request index,
    effective, padded) of batches seen first here;
    ``compute``: (request index, (host, gpu id, start s, end s)) of compute-stage spans,
    deduplicated per batch. ``instance`` per request: its resource's (host.name,
    service.instance.id). ``work``: flat (request index, start s, end s) of work spans
    (``h2d``, compute stages, ``d2h``), once per batch id; ``work_share``: flat (request
    index, seconds) per member request of such a span with a batch id: its duration over
    ``inferprof.batch.size`` (the whole duration, once, when the size is missing), so
    that the weighted sum estimates the batch work of the requests not sampled too.
    ``queue_behind``: flat (span position, seconds) of ``queue`` spans whose batcher
    reported ``inferprof.queue.behind_batches_s``; the position indexes ``span_key``.
    ``trace_id`` per request: its trace's id (16 bytes), for the examples and exemplars
    that point at it. ``tokens`` per request: its request span's ``inferprof.tokens.prompt``
    (0: not given). ``device``: flat (request index, stage number, seconds, share) per work
    span (``h2d``, compute stages, ``d2h``) attributed to a request, every member of a batch
    included: the span's duration and the request's share of it (``cost.member_share``).
    ``counted`` per request: 1 when its request span says ``inferprof.summary.counted``
    (contract §15): its process's summaries count it, so its trace only adds what
    summaries do not carry.
    """

    __slots__ = (
        "batches",
        "compute",
        "counted",
        "device",
        "end",
        "error",
        "gen",
        "instance",
        "model",
        "queue_behind",
        "service",
        "span_end",
        "span_key",
        "span_start",
        "start",
        "tokens",
        "trace_id",
        "weight",
        "work",
        "work_share",
    )

    def __init__(self) -> None:
        self.service: list[str] = []
        self.model: list[Any] = []
        self.weight = array("d")
        self.start = array("Q")
        self.end = array("Q")
        self.error = array("B")
        self.counted = array("B")
        self.span_key = array("q")
        self.span_start = array("Q")
        self.span_end = array("Q")
        self.batches: list[tuple[int, int, int]] = []
        self.compute: list[tuple[int, tuple[str, str, float, float]]] = []
        self.instance: list[tuple[str, str]] = []
        self.work = array("d")  # flat (request index, start s, end s) triples
        self.work_share = array("d")  # flat (request index, seconds) pairs
        self.queue_behind = array("d")  # flat (span position, seconds) pairs
        self.trace_id: list[bytes] = []
        #: (request index, its wanted attributes) of generating requests (gen_spans).
        self.gen: list[tuple[int, dict]] = []
        self.tokens = array("q")
        self.device = array("d")  # flat (request index, stage number, seconds, share)

    def __len__(self) -> int:
        return len(self.start)


def _local_roots(trace: _Trace) -> set[bytes]:
    """The trace's request spans: candidates marked ``inferprof.request``, without a
    parent, with a remote parent, or whose parent belongs to another service."""
    spans = trace.spans
    requests: set[bytes] = set()
    for sid in trace.candidates:
        parent, _, _, _, resource, extra, _, flags, _ = spans[sid]
        if extra is not None and extra.get(sc.ATTR_REQUEST) is True:
            requests.add(sid)
            continue
        if not parent or parent == _ZERO_SPAN:
            requests.add(sid)
            continue
        if flags & _FLAG_HAS_IS_REMOTE and flags & _FLAG_IS_REMOTE:
            requests.add(sid)
            continue
        p = spans.get(parent)
        if p is None or p[4][0] != resource[0]:
            requests.add(sid)
    return requests


class _Trace:
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


class _Block:
    """The traces of one scope of one export assembled by columns (``_ingest_columns``):
    each is one request span and its stage spans (every one a child of it), maybe other
    spans, all in that scope. Per trace ``j`` (in order of first span): its id, request
    span id, the positions of its spans in the scope (``pos[ptr[j]:ptr[j + 1]]``, in
    order), of its stage spans (``st_pos[st_ptr[j]:st_ptr[j + 1]]``) and its request
    span's (``cand[j]``)."""

    __slots__ = ("cand", "cols", "ignored", "n", "pos", "ptr", "resource", "rid", "sn",
                 "st_extra", "st_pos", "st_ptr", "st_work", "tids")

    def __init__(self, cols: Columns, resource: tuple, tids: list[bytes], cand: np.ndarray,
                 pos: np.ndarray, ptr: np.ndarray, st_pos: np.ndarray, st_ptr: np.ndarray,
                 sn: np.ndarray, work: np.ndarray, has_extra: np.ndarray) -> None:
        self.cols = cols
        self.resource = resource
        self.tids = tids
        self.cand = cand
        rid = cols.sid[cand].astype("<u8").tobytes()
        self.rid = [rid[i:i + 8] for i in range(0, len(rid), 8)]
        self.pos = pos
        self.ptr = ptr
        self.n = np.diff(ptr)
        self.st_pos = st_pos
        self.st_ptr = st_ptr
        #: per span: its stage number (-1: none)
        self.sn = sn
        #: per stage span (in st_pos order): a work stage, has wanted attributes
        self.st_work = work
        self.st_extra = has_extra
        self.ignored = self.n - np.diff(st_ptr) - 1

    def record(self, j: int) -> tuple:
        """Trace ``j``'s request span as a ``_Trace.spans`` value."""
        cols = self.cols
        k = int(self.cand[j])
        _, extra, _, code, flags = cols.entries[int(cols.tail[k])]
        flags &= _OTLP_FLAGS
        if code == _STATUS_ERROR:
            flags |= _FLAG_ERROR
        parent = id_bytes(cols.parent[k]) if cols.has_parent[k] else b""
        trace_state = cols.trace_state[k] if cols.trace_state is not None else ""
        return (parent, int(cols.start[k]), int(cols.end[k]), None, self.resource, extra,
                True, flags, trace_state)


class _EntryReads:
    """What ``Assembler._stage_attrs`` reads of each entry of attributes (stage and wanted
    values) of ``entries`` numbered ``used``, as arrays over them; ``res``: the resource."""

    __slots__ = ("b_key", "behind", "by_size", "c_key", "eff_pad", "eff_share", "gpu",
                 "has_bid", "is_queue", "is_work", "model_of", "pad_ok", "size")

    def __init__(self, used: list[int], entries: list[tuple], res: tuple) -> None:
        n_ent = len(used)
        self.behind = np.full(n_ent, np.nan)  # a valid inferprof.queue.behind_batches_s
        self.is_queue = np.zeros(n_ent, bool)
        self.pad_ok = np.zeros(n_ent, bool)  # effective and padded tokens counted
        self.eff_pad = np.zeros((n_ent, 2), np.int64)
        self.is_work = np.zeros(n_ent, bool)
        self.has_bid = np.zeros(n_ent, bool)
        self.size = np.zeros(n_ent)  # > 0: a valid batch size
        self.by_size = np.ones(n_ent)  # member_share without tokens
        self.eff_share = np.zeros(n_ent, np.int64)  # > 0: effective tokens for member_share
        self.gpu: list[Any] = [None] * n_ent
        self.model_of: list[Any] = [None] * n_ent
        #: the batch's padding and work keys in ``seen_batches`` (None: no batch id)
        self.b_key: list[Any] = [None] * n_ent
        self.c_key: list[Any] = [None] * n_ent
        for i, ent in enumerate(used):
            self._read(i, entries[ent][0], entries[ent][1], res)

    def _read(self, i: int, st_name: str, extra: dict, res: tuple) -> None:
        self.model_of[i] = extra.get(_MODEL)
        if st_name == _QUEUE:
            self.is_queue[i] = True
            b = extra.get(_BEHIND_S)
            if type(b) in (float, int) and math.isfinite(b) and b >= 0:
                self.behind[i] = float(b)
            return
        batch_id = extra.get(_BATCH_ID)
        self.has_bid[i] = batch_id is not None
        eff = extra.get(_EFFECTIVE)
        if st_name in _PADDING_STAGES:
            pad = extra.get(_PADDED)
            if isinstance(eff, int) and isinstance(pad, int) and pad > 0:
                self.pad_ok[i] = True
                self.eff_pad[i] = (eff, pad)
                if batch_id is not None:
                    self.b_key[i] = (*res, "b", batch_id)
        if st_name in _WORK_STAGES:
            self.is_work[i] = True
            bs = extra.get(_BATCH_SIZE)
            if type(bs) is int and bs > 0:
                self.size[i] = bs
                self.by_size[i] = 1.0 / bs
            if type(eff) is int and eff > 0:
                self.eff_share[i] = eff
            if st_name in _COMPUTE_STAGES:
                self.gpu[i] = extra.get(_GPU_ID)
            if batch_id is not None:
                self.c_key[i] = (*res, "c", st_name, batch_id)


class _Packed:
    """A trace of a :class:`_Block`, held as such until it is finalised or another span
    of it comes (``unpack``)."""

    __slots__ = ("block", "created", "due", "j", "n")

    late = False
    triton = None

    def __init__(self, block: _Block, j: int, n: int, due: float, created: float) -> None:
        self.block = block
        self.j = j
        self.n = n
        self.due: float | None = due
        self.created = created

    def __len__(self) -> int:
        return self.n

    @property
    def rid(self) -> bytes:
        return self.block.rid[self.j]

    def unpack(self) -> _Trace:
        """The trace as ``_ingest_spans`` would have assembled it."""
        block, j = self.block, self.j
        cols = block.cols
        trace = _Trace(self.created)
        trace.due = self.due
        spans = trace.spans
        cand = int(block.cand[j])
        resource = block.resource
        entries = cols.entries
        for k in block.pos[block.ptr[j]:block.ptr[j + 1]].tolist():
            sid = id_bytes(cols.sid[k])
            if k == cand:
                spans[sid] = block.record(j)
                trace.candidates.append(sid)
                continue
            sn = int(block.sn[k])
            parent = id_bytes(cols.parent[k]) if cols.has_parent[k] else b""
            spans[sid] = (parent, int(cols.start[k]), int(cols.end[k]),
                          sn if sn >= 0 else None, resource,
                          entries[int(cols.tail[k])][1], False, 0, None)
        return trace


class _Export:
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

    def __init__(self, asm: Assembler, now: float) -> None:
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


def _resource_of(rs: Any) -> tuple[str, str, str]:
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


def _triton_span(trace: _Trace, span: Any, sid: bytes) -> bool:
    """Keep what a span of Triton's scope says; whether it is Triton's request span."""
    trec = _triton.read_span(span)
    if trec is None:
        return False
    if trace.triton is None:
        trace.triton = {sid: trec}
    else:
        trace.triton[sid] = trec
    return bool(trec[0] == _triton.REQUEST)


class Assembler:
    """Not thread-safe; the engine serialises calls."""

    #: Read exports as columns and assemble the common case with numpy
    #: (``_ingest_columns``); False: span by span (the reference the tests compare with).
    columnar = True
    #: Scopes of fewer spans go span by span even so: there, numpy's cost per call is
    #: more than what reading columns saves (``benchmarks/collector_ingest.py`` with
    #: small exports).
    columnar_min_spans = 384

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
        #: Where engine step spans go (``generation.StepIndex``); None: kept as other spans.
        self.steps = steps
        #: Translate Triton's own spans into stages (see ``triton_spans``).
        self.triton_spans = triton_spans
        self.trace_timeout_s = trace_timeout_s
        self.max_spans_per_trace = max_spans_per_trace
        #: Links read per linked batch span; the rest are dropped (``too_many_links``).
        self.max_links_per_span = max_links_per_span
        self.clock = clock
        self.traces: dict[bytes, _Trace] = {}
        # Trace ids by the time their trace becomes due (settles) and by creation time.
        self._due = _Schedule()
        self._created = _Schedule()
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

    # --- ingest ---------------------------------------------------------------------
    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def ingest(self, request: Any, payload: bytes | None = None) -> tuple[int, int, list[str]]:
        """Take an OTLP traces export: (spans accepted, spans rejected, the first few
        reasons). Spans are kept pending in their traces until those are due.

        ``payload``: the serialized export ``request`` was parsed from, if at hand: the
        spans are then read off it (``wire.SpanReader``), which costs less than reading
        them off ``request``."""
        ex = _Export(self, self.clock())
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
            resource = _resource_of(rs)
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

    def _ingest_columns(self, ex: _Export, cols: Columns, spans: Any, resource: tuple,
                        base: int) -> bool:
        """Take one scope's spans read as columns; False (nothing taken) when none of its
        traces can be assembled by columns: then take its records.

        A trace is assembled by columns, with numpy, when all it has in this export is in
        this scope, it is new (not open, not finalised in the last ``trace_timeout_s``) and
        it is the common case: one request span (SERVER or CONSUMER, no parent, no
        stage), stage spans of known names, each a child of it and without links, maybe
        other spans; valid ids and durations, no duplicate span id; only attributes of
        ``_SIMPLE_KEYS``. It is then held as a :class:`_Packed` trace, exactly what
        ``_ingest_spans`` would hold, in less memory, until it is due or another span of it
        comes (``unpack``). The other spans go through ``_ingest_spans``, in order."""
        e_sn, e_ok, e_extra, e_simple, unknown = self._entry_table(cols.entries)
        tail = cols.tail
        start, end, sid, parent = cols.start, cols.end, cols.sid, cols.parent
        kind = cols.kind
        cand = (kind == _KIND_SERVER) | (kind == _KIND_CONSUMER)
        valid = (end >= start) & (end - start <= _DAY_NS) & (sid != 0) & (
            cols.tid != _ZERO_TRACE_V)
        if unknown:
            self._number_stages(cols, unknown, valid & e_simple[tail], e_sn, e_ok, e_simple)
        sn = e_sn[tail]
        is_stage = sn >= 0
        good = e_ok[tail] & valid & ~(cand & is_stage)
        uniq, first, inv = np.unique(cols.tid, return_index=True, return_inverse=True)
        inv = inv.ravel()
        n_groups = uniq.size
        ok = np.bincount(inv, ~good, n_groups) == 0
        ok &= np.bincount(inv, cand, n_groups) == 1
        ok &= np.bincount(inv, is_stage, n_groups) >= 1
        ok &= np.bincount(inv, minlength=n_groups) <= self.max_spans_per_trace
        cand_at = np.zeros(n_groups, np.int64)
        where_cand = np.flatnonzero(cand)
        cand_at[inv[where_cand]] = where_cand
        ok &= parent[cand_at] == 0
        ok &= np.bincount(inv, is_stage & (parent != sid[cand_at][inv]), n_groups) == 0
        by_sid = np.sort(sid)
        if (by_sid[1:] == by_sid[:-1]).any():  # a span id twice: in the same trace?
            o = np.lexsort((sid, inv))
            dup = (inv[o][1:] == inv[o][:-1]) & (sid[o][1:] == sid[o][:-1])
            ok[inv[o][1:][dup]] = False
        groups = np.flatnonzero(ok)
        if not groups.size:
            return False
        groups = groups[np.argsort(first[groups], kind="stable")]
        tid_bytes = uniq[groups].tobytes()
        tids = [tid_bytes[i:i + 16] for i in range(0, len(tid_bytes), 16)]
        traces = self.traces
        recent_done = self.recent_done
        new = [not (t in traces or t in recent_done) for t in tids]
        if not all(new):
            groups = groups[np.asarray(new, bool)]
            if not groups.size:
                return False
            tids = [t for t, keep in zip(tids, new, strict=True) if keep]
        n_packed = groups.size
        j_of = np.full(n_groups, -1, np.int64)
        j_of[groups] = np.arange(n_packed)
        span_j = j_of[inv]
        packed = span_j >= 0
        at = np.flatnonzero(packed)
        pos = at[np.argsort(span_j[at], kind="stable")]
        ptr = np.zeros(n_packed + 1, np.int64)
        np.cumsum(np.bincount(span_j[at], minlength=n_packed), out=ptr[1:])
        st_pos = pos[is_stage[pos]]
        st_ptr = np.zeros(n_packed + 1, np.int64)
        np.cumsum(np.bincount(span_j[st_pos], minlength=n_packed), out=st_ptr[1:])
        work_of = np.fromiter((name in _WORK_STAGES for name in self.stage_names), bool,
                              len(self.stage_names))
        cand = cand_at[groups]
        work, has_extra = work_of[sn[st_pos]], e_extra[tail[st_pos]]
        ex.due_at.extend((cand + base).tolist())
        if packed.all():
            block = _Block(cols, resource, tids, cand, pos, ptr, st_pos, st_ptr, sn, work,
                           has_extra)
        else:
            # Held until due: the packed traces' spans only, not the rest of the scope
            # (rejected, or pending elsewhere), whose memory the pending count leaves out.
            new_at = np.empty(len(cols), np.int64)
            new_at[pos] = np.arange(pos.size)
            block = _Block(cols.take(pos), resource, tids, new_at[cand], new_at[pos], ptr,
                           new_at[st_pos], st_ptr, sn[pos], work, has_extra)
        ex.seen += len(cols)
        ex.packed = True
        now, due = ex.now, ex.due
        made = [_Packed(block, j, n, due, now) for j, n in enumerate(block.n.tolist())]
        ex.made_due.extend(tids)
        self._open_packed(ex, cols, spans, resource, base, packed, tids, made,
                          first[groups])
        return True

    def _open_packed(self, ex: _Export, cols: Columns, spans: Any, resource: tuple,
                     base: int, packed: np.ndarray, tids: list[bytes], made: list[_Packed],
                     firsts: np.ndarray) -> None:
        """Open the packed traces ``made`` (ids ``tids``, first spans at ``firsts``) in the
        order of their first span, between the scope's other spans (those not
        ``packed``), taken span by span, as one pass over the scope would open them."""
        traces = self.traces
        if packed.all():
            traces.update(zip(tids, made, strict=True))
            ex.created.extend(tids)
            return
        n_packed = len(made)
        other = np.flatnonzero(~packed)
        records = [cols.record(k) for k in other.tolist()]
        cut = np.searchsorted(other, firsts).tolist()
        done = 0
        j = 0
        while j < n_packed:
            c = cut[j]
            if c > done:
                self._ingest_spans(ex, records[done:c], spans, resource, False, base)
                done = c
            j_end = j + 1
            while j_end < n_packed and cut[j_end] == c:
                j_end += 1
            traces.update(zip(tids[j:j_end], made[j:j_end], strict=True))
            ex.created.extend(tids[j:j_end])
            j = j_end
        if done < len(records):
            self._ingest_spans(ex, records[done:], spans, resource, False, base)

    def _entry_table(self, entries: list[tuple]) -> tuple:
        """Per entry of a scope's columns: its stage number (-1: none; -2: a name not
        numbered), whether a span of it may be in a packed trace, whether it has wanted
        attributes, whether only those of ``_SIMPLE_KEYS``; and the entries of valid stage
        names not numbered yet."""
        stage_index = self.stage_index
        n_entries = len(entries)
        e_sn = np.full(n_entries, -1, np.int64)
        e_ok = np.ones(n_entries, bool)
        e_extra = np.zeros(n_entries, bool)
        e_simple = np.ones(n_entries, bool)
        unknown: list[int] = []  # entries of valid stage names not seen before
        for i, (stage, extra, n_links, _, _) in enumerate(entries):
            if extra is not None:
                e_extra[i] = True
                if not extra.keys() <= _SIMPLE_KEYS:
                    e_ok[i] = e_simple[i] = False
            if stage is not None:
                try:
                    sidx = stage_index.get(stage)
                except TypeError:
                    sidx = None
                if sidx is None:
                    e_ok[i] = False
                    if (
                        isinstance(stage, str)
                        and sc.STAGE_NAME_PATTERN.match(stage)
                        and stage != sc.STAGE_UNATTRIBUTED
                    ):
                        unknown.append(i)
                    e_sn[i] = -2
                elif n_links:
                    e_ok[i] = False
                else:
                    e_sn[i] = sidx
        return e_sn, e_ok, e_extra, e_simple, unknown

    def _number_stages(self, cols: Columns, unknown: list[int], checked: np.ndarray,
                       e_sn: np.ndarray, e_ok: np.ndarray, e_simple: np.ndarray) -> None:
        """Number the valid stage names of entries ``unknown`` in the order one pass over
        the scope would (at its first span of each name), where each such span is one
        ``checked``: the pass reads its stage (valid ids and times, not an engine step);
        else number none (the pass will)."""
        name_of = {i: cols.entries[i][0] for i in unknown}
        # Each entry's first span, in one pass: one scan per entry would cost the scope's
        # length once per new name.
        used, first_span = np.unique(cols.tail, return_index=True)
        first_of = dict(zip(used.tolist(), first_span.tolist(), strict=True))
        firsts: dict[str, int] = {}
        for i in unknown:
            k = first_of[i]
            name = name_of[i]
            if name not in firsts or k < firsts[name]:
                firsts[name] = k
        if not all(checked[k] for k in firsts.values()):
            return
        for name in sorted(firsts, key=firsts.__getitem__):
            self.stage_index[name] = len(self.stage_names)
            self.stage_names.append(name)
        for i in unknown:
            e_sn[i] = self.stage_index[name_of[i]]
            e_ok[i] = e_simple[i] and not cols.entries[i][2]

    def _ingest_spans(self, ex: _Export, records: list[SpanRecord], spans: Any,
                      resource: tuple, triton: bool, base: int = 0) -> None:
        """``records``: those of ``spans``, the ``Span`` messages, read only for links,
        Triton's spans and what a record leaves out. ``base``: the position of the scope's
        first span in the export."""
        now = ex.now
        traces = self.traces
        stage_index = self.stage_index
        max_spans = self.max_spans_per_trace
        recent_done = self.recent_done
        step_sink = self.steps
        reject = ex.reject
        for (tid, sid, parent, start, end, kind, span_flags, status, trace_state, stage,
             extra, n_links, k) in records:
            # A trace already open has a valid id: only a new one is checked.
            trace = traces.get(tid)
            if trace.__class__ is _Packed:  # another span of it: held span by span now
                trace = traces[tid] = trace.unpack()
            if (
                (trace is None and (len(tid) != 16 or tid == _ZERO_TRACE))
                or len(sid) != 8
                or sid == _ZERO_SPAN
            ):
                reject(sc.DROP_INVALID_ID,
                       f"span {sid.hex()!r} in trace {tid.hex()!r}: invalid trace or span id")
                continue
            if not 0 <= end - start <= _DAY_NS:
                if end < start:
                    reject(sc.DROP_NEGATIVE_DURATION,
                           f"span {sid.hex()}: end time before start time")
                else:
                    reject(sc.DROP_ABSURD_DURATION, f"span {sid.hex()}: duration over one day")
                continue
            if (
                extra is not None
                and step_sink is not None
                and _gen.is_step_span(extra, stage, parent)
            ):
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
                    if stage is EMPTY:
                        # Present but empty: no stage span, though the span still
                        # "carries an inferprof attribute" (see _finalise_trace).
                        extra = {**(extra or {}), sc.ATTR_STAGE: None}
                    else:
                        sidx = self._new_stage(ex, stage, sid)
                        if sidx is None:
                            continue
                # Links matter on stage spans only: batch encoding (b), attributed
                # through its links only.
                if sidx is not None and n_links:
                    self._link_span(ex, spans[k].links, tid, sid, (sidx, start, end, resource,
                                                                   extra, (tid, sid)))
                    continue
            if trace is None:
                trace = traces[tid] = _Trace(now)
                ex.created.append(tid)
                if tid in recent_done:
                    trace.late = True
            else:
                trace_spans = trace.spans
                if sid in trace_spans:
                    reject(sc.DROP_DUPLICATE,
                           f"span {sid.hex()}: duplicate span id in trace {tid.hex()}")
                    continue
                if len(trace_spans) >= max_spans:
                    reject(sc.DROP_TRACE_TOO_LARGE,
                           f"trace {tid.hex()}: more than {max_spans} spans")
                    continue
            triton_request = triton and sidx is None and _triton_span(trace, spans[k], sid)
            if (
                kind in _CANDIDATE_KINDS
                or (extra is not None and extra.get(sc.ATTR_REQUEST) is True)
                or (extra is not None and _gen.is_engine_request(extra))
                or triton_request
            ):
                trace.candidates.append(sid)
                if trace.due is None or ex.due > trace.due:
                    trace.due = ex.due
                    ex.made_due.append(tid)
                    ex.due_at.append(base + k)
                # Only request spans need the trace state, the is-remote bits and the
                # status.
                if status is None:  # a record of the message: read there
                    span = spans[k]
                    span_flags, status, trace_state = (
                        span.flags, span.status.code, span.trace_state)
                flags = span_flags & _OTLP_FLAGS
                if status == _STATUS_ERROR:
                    flags |= _FLAG_ERROR
                trace.spans[sid] = (parent, start, end, sidx, resource, extra,
                                    True, flags, trace_state)
            else:
                trace.spans[sid] = (parent, start, end, sidx, resource, extra,
                                    False, 0, None)

    def _step_span(self, ex: _Export, tid: bytes, trace: _Trace | None, resource: tuple,
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

    def _new_stage(self, ex: _Export, stage: Any, sid: bytes) -> int | None:
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

    def _link_span(self, ex: _Export, span_links: Any, tid: bytes, sid: bytes,
                   record: tuple) -> None:
        """A batch stage span linked to its member requests: pending under each link
        until the member's trace is finalised."""
        ident = record[5]
        link_refs = self.link_refs
        if ident in link_refs:
            ex.reject(sc.DROP_DUPLICATE,
                      f"span {sid.hex()}: duplicate span id in trace {tid.hex()}")
            return
        max_links = self.max_links_per_span
        n_links = len(span_links)
        if n_links > max_links:
            self._drop(sc.DROP_TOO_MANY_LINKS, n_links - max_links)
            ex.note(f"span {sid.hex()}: {n_links} links, only the first {max_links} read "
                    "(max_links_per_span)")
            span_links = span_links[:max_links]
        # One member request linked twice (a sender linking once per item) is still one
        # member: its stage counts once.
        targets = (
            dict.fromkeys((ln.trace_id, ln.span_id) for ln in span_links)
            if n_links > 1
            else ((span_links[0].trace_id, span_links[0].span_id),)
        )
        links = self.links
        link_count = self.link_count
        max_spans = self.max_spans_per_trace
        kept = 0
        for lk in targets:
            # A member trace's index entries count as its own spans do: at most
            # max_spans_per_trace (they are folded with it, in one share of work).
            n_member = link_count.get(lk[0], 0)
            if n_member >= max_spans:
                continue
            link_count[lk[0]] = n_member + 1
            kept += 1
            lst = links.get(lk)
            if lst is None:
                links[lk] = [record]
                self.link_created[lk] = ex.now
                if lk[0] in self.recent_done:
                    self.link_late.add(lk)
            else:
                lst.append(record)
        if kept < len(targets):
            why = (f"span {sid.hex()}: {len(targets) - kept} of its member traces have "
                   f"{max_spans} linked spans already (max_spans_per_trace)")
            if not kept:
                ex.reject(sc.DROP_TRACE_TOO_LARGE, why)
                return
            self._drop(sc.DROP_TRACE_TOO_LARGE, len(targets) - kept)
            ex.note(why)
        link_refs[ident] = kept
        # A linked batch span is pending once per member it links (one index entry
        # each): beyond the one span ``accepted`` counts.
        ex.link_pending += kept - 1

    # --- finalisation ------------------------------------------------------------------
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
        left = budget
        traces = self.traces
        recent_done = self.recent_done
        counted = self.counted
        # Packed traces to finalise, in order: together, with numpy (``_finalise_packed``).
        run: list[tuple[bytes, _Packed]] = []
        links = self.links

        def finalise(tid: bytes, trace: Any) -> None:
            if trace.__class__ is _Packed:
                if not (links and (tid, trace.rid) in links):
                    run.append((tid, trace))
                    return
                trace = trace.unpack()  # with linked batch spans: the general way
            if run:
                self._finalise_packed(run, out, now)
                run.clear()
            self._finalise(tid, trace, out, now)

        if everything:
            while traces and left > 0:
                tid, trace = traces.popitem()
                left -= len(trace) + self.link_count.get(tid, 0)
                if trace.due is not None:
                    finalise(tid, trace)
                else:
                    self._expire(tid, trace)
            if not traces:
                self._due.clear()
                self._created.clear()
        else:
            for due, tid in self._due.take(now):
                trace = traces.get(tid)
                left -= 1
                if trace is not None and trace.due == due:
                    del traces[tid]
                    left -= len(trace) + self.link_count.get(tid, 0)
                    finalise(tid, trace)
                # else: finalised already, or due later (it has another entry)
                if left <= 0:
                    break
            if left > 0:
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
        if run:
            self._finalise_packed(run, out, now)
        # Linked batch spans whose member requests never came (or came and went).
        if left > 0:
            link_horizon = math.inf if everything else now - self.trace_timeout_s
            for lk in _pop_older(self.link_created, link_horizon):
                records = self.links.pop(lk, None)
                left -= 1
                if records:
                    self._uncount(lk[0], len(records))
                late = lk in self.link_late
                if late:
                    self.link_late.discard(lk)
                if records:
                    self._release_linked(records)
                    late = late or lk[0] in recent_done
                    reason = sc.DROP_LATE if late else sc.DROP_ORPHAN_STAGE
                    self._drop(reason, len(records))
                    left -= len(records)
                if left <= 0:
                    break
        if not everything and left > 0:
            for tid in _pop_older(recent_done, now - self.trace_timeout_s):
                counted.pop(tid, None)
                left -= 1
                if left <= 0:
                    break
        if left > 0:
            for _ in _pop_older(self.seen_batches, now - _BATCH_MEMORY_S):
                left -= 1
                if left <= 0:
                    break
        self.backlog = left <= 0
        return out

    def _finalise(self, tid: bytes, trace: _Trace, out: Finalised, now: float) -> None:
        self.pending -= len(trace.spans)
        counted = self.counted
        before = counted.get(tid, ())
        now_counted = self._finalise_trace(tid, trace, out, now, before)
        out.trace_id.extend([tid] * (len(out.start) - len(out.trace_id)))
        counted[tid] = before + now_counted if before else now_counted
        recent_done = self.recent_done
        recent_done[tid] = now
        recent_done.move_to_end(tid)  # keeps clock order

    def _finalise_packed(self, run: list[tuple[bytes, _Packed]], out: Finalised,
                         now: float) -> None:
        """``_finalise`` of each packed trace of ``run``, in order: the same columns, with
        numpy for all but the stage spans that carry attributes."""
        blocks = [t.block for _, t in run]
        i = 0
        n = len(run)
        while i < n:
            block = blocks[i]
            k = i + 1
            while k < n and blocks[k] is block:
                k += 1
            part = run[i:k]
            self._finalise_block(block, [t.j for _, t in part], [tid for tid, _ in part], out,
                                 now)
            i = k

    def _finalise_block(self, block: _Block, js: list[int], tids: list[bytes],
                        out: Finalised, now: float) -> None:
        cols = block.cols
        n = len(js)
        jj = np.asarray(js, np.int64)
        rid = block.rid
        # Bookkeeping per trace, as ``_finalise``: none of these traces was counted or
        # finalised in the last trace_timeout_s (else it would not be packed).
        self.pending -= int(block.n[jj].sum())
        self.ignored += int(block.ignored[jj].sum())
        self.counted.update(zip(tids, [(rid[j],) for j in js], strict=True))
        self.recent_done.update(dict.fromkeys(tids, now))
        r0 = len(out.start)
        model, tokens = self._request_rows(block, jj, tids, out)
        # The stage spans, per request in order, as ``_own_stages``.
        st_lo = block.st_ptr[jj]
        cnt = block.st_ptr[jj + 1] - st_lo
        each = np.repeat(np.arange(n), cnt)
        total = int(cnt.sum())
        q = st_lo[each] + (np.arange(total) - (np.cumsum(cnt) - cnt)[each])
        at = block.st_pos[q]
        rows = r0 + each
        stage = block.sn[at]
        s = cols.start[at]
        e = cols.end[at]
        k0 = len(out.span_key)
        out.span_key.frombytes(((rows << 32) | stage).tobytes())
        out.span_start.frombytes(s.tobytes())
        out.span_end.frombytes(e.tobytes())
        work = block.st_work[q]
        extra_at = np.flatnonzero(block.st_extra[q])
        if work.any():
            dur = np.where(e > s, (e - s).astype(np.float64) * 1e-9, 0.0)
            share = np.ones(total)
        else:
            dur = share = None
        if extra_at.size:
            self._extra_spans(out, block, tids, extra_at, rows, each, at, stage, s, e,
                              model, tokens, share, k0, now)
        if dur is not None:
            w = np.flatnonzero(work)
            device = np.empty((w.size, 4))
            device[:, 0] = rows[w]
            device[:, 1] = stage[w]
            device[:, 2] = dur[w]
            device[:, 3] = share[w]
            out.device.frombytes(device.tobytes())
            # Bare work spans; those with attributes went through _stage_attrs.
            bare = w[~block.st_extra[q][w]]
            if bare.size:
                windows = np.empty((bare.size, 3))
                windows[:, 0] = rows[bare]
                windows[:, 1] = s[bare].astype(np.float64) * 1e-9
                windows[:, 2] = e[bare].astype(np.float64) * 1e-9
                out.work.frombytes(windows.tobytes())

    @staticmethod
    def _request_rows(block: _Block, jj: np.ndarray, tids: list[bytes],
                      out: Finalised) -> tuple[list, list[int]]:
        """One row per request of traces ``jj`` of ``block``, as ``_open_row`` opens it:
        its fields read once per distinct request-span attributes (and trace state).
        Returns the rows' models and prompt tokens."""
        cols = block.cols
        n = jj.size
        cand = block.cand[jj]
        entries = cols.entries
        states = cols.trace_state
        if states is None:
            used, which = np.unique(cols.tail[cand], return_inverse=True)
            keys: list[Any] = used.tolist()
            states_u: list[str] = [""] * len(keys)
        else:
            pairs = list(zip(cols.tail[cand].tolist(), [states[k] for k in cand.tolist()],
                             strict=True))
            number = {p: i for i, p in enumerate(dict.fromkeys(pairs))}
            which = np.fromiter(map(number.__getitem__, pairs), np.int64, n)
            keys = [t for t, _ in number]
            states_u = [st for _, st in number]
        fields = []
        for t, st in zip(keys, states_u, strict=True):
            _, extra, _, code, flags = entries[t]
            flags &= _OTLP_FLAGS
            if code == _STATUS_ERROR:
                flags |= _FLAG_ERROR
            fields.append(_request_fields(extra, flags, st))
        which = which.ravel()
        model_u, weight_u, error_u, counted_u, tokens_u = zip(*fields, strict=True)
        model = [model_u[i] for i in which.tolist()]
        tokens = np.asarray(tokens_u, np.int64)[which].tolist()
        resource = block.resource
        out.service.extend([resource[0]] * n)
        out.instance.extend([resource[1:]] * n)
        out.model.extend(model)
        out.weight.frombytes(np.asarray(weight_u, np.float64)[which].tobytes())
        out.start.frombytes(cols.start[cand].tobytes())
        out.end.frombytes(cols.end[cand].tobytes())
        out.error.frombytes(np.asarray(error_u, np.uint8)[which].tobytes())
        out.counted.frombytes(np.asarray(counted_u, np.uint8)[which].tobytes())
        out.tokens.extend(tokens)
        out.trace_id.extend(tids)
        return model, tokens

    def _extra_spans(self, out: Finalised, block: _Block, tids: list[bytes],
                     xs: np.ndarray, rows: np.ndarray, each: np.ndarray, at: np.ndarray,
                     stage: np.ndarray, s: np.ndarray, e: np.ndarray, model: list,
                     tokens: list[int], share: np.ndarray | None, k0: int,
                     now: float) -> None:
        """``_stage_attrs`` of the stage spans ``xs`` (positions in the run's stage spans
        ``rows``, ``stage``, ``s``, ``e``; ``at`` in the scope, ``each`` the trace in the
        run) of a packed run, which carry attributes, in order, at once: what each entry
        of attributes gives is read once; only "seen before" (``seen_batches``) is
        decided in order, per batch. ``model`` / ``tokens``: the run's requests'. Writes
        each work span's share into ``share``."""
        cols = block.cols
        entries = cols.entries
        res = block.resource
        ent_u, ent_inv = np.unique(cols.tail[at[xs]], return_inverse=True)
        r = _EntryReads(ent_u.tolist(), entries, res)
        behind, is_queue, pad_ok, eff_pad = r.behind, r.is_queue, r.pad_ok, r.eff_pad
        is_work, has_bid, size, by_size = r.is_work, r.has_bid, r.size, r.by_size
        eff_share, gpu, model_of = r.eff_share, r.gpu, r.model_of
        rows_x = rows[xs]
        # Model fallback, in order, for requests that name none.
        if None in model:
            for x, row in enumerate(rows_x.tolist()):
                if out.model[row] is None:
                    out.model[row] = model_of[ent_inv[x]]
        pos_x = k0 + xs
        q = is_queue[ent_inv] & ~np.isnan(behind[ent_inv])
        if q.any():
            pairs = np.empty((int(q.sum()), 2))
            pairs[:, 0] = pos_x[q]
            pairs[:, 1] = behind[ent_inv][q]
            out.queue_behind.frombytes(pairs.tobytes())
        # "Seen before", in order: a key per (span, b: padding / c: work), first use only.
        pad_x = pad_ok[ent_inv]
        work_x = is_work[ent_inv]
        if not (pad_x.any() or work_x.any()):
            return
        first_b, first_c = self._first_uses(r, ent_inv, pad_x, work_x, tids, each[xs],
                                             cols.sid[at[xs]], now)
        if pad_x.any():
            b = np.flatnonzero(pad_x & first_b)
            out.batches.extend(zip(rows_x[b].tolist(), eff_pad[ent_inv[b], 0].tolist(),
                                   eff_pad[ent_inv[b], 1].tolist(), strict=True))
        if not work_x.any():
            return
        w = np.flatnonzero(work_x)
        we = ent_inv[w]
        ws, wend = s[xs[w]], e[xs[w]]
        seconds = np.where(wend > ws, (wend - ws).astype(np.float64) * 1e-9, 0.0)
        # member_share: by tokens where the request's and the batch's are known
        tok = np.asarray(tokens, np.int64)[each[xs[w]]]
        sh = by_size[we].copy()
        by_tok = (tok > 0) & (eff_share[we] > 0)
        for y in np.flatnonzero(by_tok).tolist():
            sh[y] = min(1.0, int(tok[y]) / int(eff_share[we[y]]))
        assert share is not None
        share[xs[w]] = sh
        # work share: per member where the size is known, else once per batch
        bid = has_bid[we]
        sized = size[we] > 0
        fc = first_c[w]
        keep = bid & (sized | fc)
        if keep.any():
            part = np.empty((int(keep.sum()), 2))
            part[:, 0] = rows_x[w][keep]
            part[:, 1] = np.where(sized, seconds / np.where(sized, size[we], 1.0), seconds)[keep]
            out.work_share.frombytes(part.tobytes())
        if fc.any():
            win = np.empty((int(fc.sum()), 3))
            win[:, 0] = rows_x[w][fc]
            win[:, 1] = ws[fc].astype(np.float64) * 1e-9
            win[:, 2] = wend[fc].astype(np.float64) * 1e-9
            out.work.frombytes(win.tobytes())
            for y in np.flatnonzero(fc).tolist():
                g = gpu[we[y]]
                if g:
                    out.compute.append((int(rows_x[w[y]]), (res[1], normalize_gpu_id(str(g)),
                                                            int(ws[y]) * 1e-9,
                                                            int(wend[y]) * 1e-9)))

    def _first_uses(self, r: _EntryReads, ent_inv: np.ndarray, pad_x: np.ndarray,
                    work_x: np.ndarray, tids: list[bytes], trace_of: np.ndarray,
                    sid: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Per stage span of ``_extra_spans`` (``ent_inv``: its entry of ``r``), whether it
        is the first use of its batch's padding key (``pad_x`` spans) and of its work key
        (``work_x`` spans; True where it has none), as ``_stage_attrs`` decides them in
        order; the new keys are remembered in ``seen_batches``, in that order.
        ``trace_of`` / ``sid``: each span's trace in ``tids`` and span id, the key of a
        span without a batch id."""
        n = ent_inv.size
        n_ent = len(r.gpu)
        b_key, c_key = r.b_key, r.c_key
        # Key numbers: per entry where the batch id makes the key, per span (the span
        # itself) where there is none.
        key_ids: dict[Any, int] = {}
        keys: list[Any] = []

        def number(key: Any) -> int:
            k = key_ids.get(key)
            if k is None:
                k = key_ids[key] = len(keys)
                keys.append(key)
            return k

        b_num = np.fromiter((-1 if k is None else number(k) for k in b_key), np.int64, n_ent)
        c_num = np.fromiter((-1 if k is None else number(k) for k in c_key), np.int64, n_ent)
        has_gpu = np.fromiter((bool(g) for g in r.gpu), bool, n_ent)
        ev_b = np.flatnonzero(pad_x)
        ev_c = np.flatnonzero(work_x & ((c_num >= 0) | has_gpu)[ent_inv])
        kb = b_num[ent_inv[ev_b]]
        kc = c_num[ent_inv[ev_c]]
        for ev, kk in ((ev_b, kb), (ev_c, kc)):  # keyed by the span itself
            for y in np.flatnonzero(kk < 0).tolist():
                x = int(ev[y])
                kk[y] = number((tids[int(trace_of[x])], id_bytes(sid[x])))
        ev_x = np.concatenate([ev_b, ev_c])
        ev_kind = np.concatenate([np.zeros(ev_b.size, np.int64), np.ones(ev_c.size, np.int64)])
        order = np.lexsort((ev_kind, ev_x))
        ev_x, ev_kind, ev_key = ev_x[order], ev_kind[order], np.concatenate([kb, kc])[order]
        first_b = np.zeros(n, bool)
        first_c = np.ones(n, bool)  # a work span of no key is always "first"
        if ev_key.size:
            uk, fi = np.unique(ev_key, return_index=True)
            seen = self.seen_batches
            new_key = np.fromiter((keys[k] not in seen for k in uk.tolist()), bool, uk.size)
            is_first = np.zeros(ev_key.size, bool)
            is_first[fi[new_key]] = True
            first_b[ev_x[(ev_kind == 0) & is_first]] = True
            first_c[ev_x[(ev_kind == 1) & ~is_first]] = False
            for k in ev_key[np.sort(fi[new_key])].tolist():  # in the order they came
                seen[keys[k]] = now
        return first_b, first_c

    def _expire(self, tid: bytes, trace: _Trace) -> None:
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

    def _uncount(self, tid: bytes, n: int) -> None:
        left = self.link_count.get(tid, 0) - n
        if left > 0:
            self.link_count[tid] = left
        else:
            self.link_count.pop(tid, None)

    def _release_linked(self, records: list[tuple]) -> None:
        """Each record is one member's use of a linked span: pending once each."""
        refs = self.link_refs
        self.pending -= len(records)
        for rec in records:
            ident = rec[5]
            left = refs.get(ident, 1) - 1
            if left <= 0:
                refs.pop(ident, None)
            else:
                refs[ident] = left

    def _finalise_trace(
        self, tid: bytes, trace: _Trace, out: Finalised, now: float, counted: tuple = ()
    ) -> tuple[bytes, ...]:
        """Fold the trace's requests into ``out``; returns the request span ids counted.

        ``counted``: request spans of this trace finalised before (in the last
        ``trace_timeout_s``). An exporter that re-sends an export (its answer was lost, a
        persistent queue replays it) brings them again: they and their stage spans are
        dropped as duplicates instead of being counted twice. Other request spans of the
        trace (another service's, arriving later) are counted as usual.
        """
        spans = trace.spans
        requests = _local_roots(trace)
        repeated = requests.intersection(counted) if counted else None
        # Request span id -> its row in ``out``; a row is opened by the request's first
        # stage span (or at the end for a request with attributes but no stage span).
        rows: dict[bytes, int] = {}
        self._own_stages(tid, spans, requests, repeated, rows, out, now)
        if repeated:
            requests -= repeated
            self._forget_repeated(tid, repeated)
        translated = (
            _triton.translate(spans, trace.triton, requests) if trace.triton is not None else None
        )
        links = self.links
        for rid in requests:
            linked = links.pop((tid, rid), None) if links else None
            if linked is not None:
                self._linked_stages(tid, rid, linked, spans, rows, out, now)
            if translated and rid not in rows and rid in translated:
                self._triton_stages(rid, translated[rid], spans, rows, out)
            if rid not in rows:
                self._request_alone(spans[rid], out)
        return tuple(requests)

    def _own_stages(self, tid: bytes, spans: dict, requests: set[bytes],
                    repeated: set[bytes] | None, rows: dict[bytes, int], out: Finalised,
                    now: float) -> None:
        """The trace's stage spans, each into its request's row (orphans and the stages
        of repeated requests dropped); other spans counted as ignored."""
        owner_of: dict[bytes, bytes | None] = {}
        add_key = out.span_key.append
        add_start = out.span_start.append
        add_end = out.span_end.append
        ignored = 0
        for sid, (parent, s, e, stage, res, extra, _, _, _) in spans.items():
            if stage is None:
                if sid not in requests:
                    ignored += 1
                continue
            # Common case first: the stage span is a direct child of its request.
            owner = parent if parent in requests else self._owner(sid, spans, requests, owner_of)
            if owner is None:
                self._drop(sc.DROP_ORPHAN_STAGE)
                continue
            if repeated and owner in repeated:
                self._drop(sc.DROP_DUPLICATE)
                continue
            row = rows.get(owner)
            if row is None:
                row = rows[owner] = self._open_row(spans[owner], out)
            add_key(row << 32 | stage)
            add_start(s)
            add_end(e)
            if extra is not None:
                share = self._stage_attrs(out, row, stage, s, e, res, extra, (tid, sid), now,
                                          len(out.span_key) - 1)
                if share is not None:
                    out.device.extend((row, stage, (e - s) * 1e-9 if e > s else 0.0, share))
            elif self.stage_names[stage] in _WORK_STAGES:  # a bare work span: no batch
                out.work.extend((row, s * 1e-9, e * 1e-9))
                out.device.extend((row, stage, (e - s) * 1e-9 if e > s else 0.0, 1.0))
        self.ignored += ignored

    def _forget_repeated(self, tid: bytes, repeated: set[bytes]) -> None:
        """Requests counted before, sent again: dropped, with the batch spans linked to
        them (re-sent with their member)."""
        links = self.links
        self._drop(sc.DROP_DUPLICATE, len(repeated))
        for rid in repeated:
            linked = links.pop((tid, rid), None) if links else None
            if linked is not None:
                self.link_created.pop((tid, rid), None)
                self.link_late.discard((tid, rid))
                self._uncount(tid, len(linked))
                self._release_linked(linked)
                self._drop(sc.DROP_DUPLICATE, len(linked))

    def _linked_stages(self, tid: bytes, rid: bytes, linked: list, spans: dict,
                       rows: dict[bytes, int], out: Finalised, now: float) -> None:
        """Batch stage spans linked to request ``rid`` (the ``links`` encoding)."""
        self.link_created.pop((tid, rid), None)
        self.link_late.discard((tid, rid))
        self._uncount(tid, len(linked))
        self._release_linked(linked)
        row = rows.get(rid)
        if row is None:
            row = rows[rid] = self._open_row(spans[rid], out)
        for stage, s, e, res, extra, ident in linked:
            out.span_key.append(row << 32 | stage)
            out.span_start.append(s)
            out.span_end.append(e)
            if extra is not None:
                share = self._stage_attrs(out, row, stage, s, e, res, extra, ident, now,
                                          len(out.span_key) - 1)
                if share is not None:
                    out.device.extend((row, stage, (e - s) * 1e-9 if e > s else 0.0, share))
            elif self.stage_names[stage] in _WORK_STAGES:
                out.work.extend((row, s * 1e-9, e * 1e-9))
                out.device.extend((row, stage, (e - s) * 1e-9 if e > s else 0.0, 1.0))

    def _triton_stages(self, rid: bytes, translated: tuple, spans: dict,
                       rows: dict[bytes, int], out: Finalised) -> None:
        """A Triton request with no inferprof stage of its own: its derived stages."""
        model, derived, used = translated
        row = rows[rid] = self._open_row(spans[rid], out)
        out.model[row] = model
        for name, s, e in derived:
            number = self._stage_number(name)
            out.span_key.append(row << 32 | number)
            out.span_start.append(s)
            out.span_end.append(e)
            if name in _WORK_STAGES:
                # Requests Triton batched together share these times: the engine
                # keeps one of each (no work_share: Triton traces all or none).
                out.work.extend((row, s * 1e-9, e * 1e-9))
                # Triton's spans give no batch size: each request is charged the
                # whole window (docs/concepts.md, cost).
                out.device.extend((row, number, (e - s) * 1e-9 if e > s else 0.0, 1.0))
        if len(derived) < len(_triton.STAGES):
            self.triton_partial += 1
        self.ignored -= used  # counted as ignored above; they were not

    def _request_alone(self, req: tuple, out: Finalised) -> None:
        """A request span with no stage span: an engine's own request span (vLLM,
        SGLang), whose stages come from its gen_ai.latency.* attributes; one with no
        inferprof.* attribute at all (health checks, metric scrapes) is not an inference
        request."""
        derived = _gen.derived_stages(req[1], req[2], req[5]) if req[5] else None
        if req[3] is None and not _gen.marks_request(req[5]):
            self.ignored += 1
            return
        row = self._open_row(req, out)
        for name, s, e in derived or ():
            out.span_key.append(row << 32 | self._stage_number(name))
            out.span_start.append(s)
            out.span_end.append(e)

    def _stage_number(self, stage: str) -> int:
        sidx = self.stage_index.get(stage)
        if sidx is None:
            sidx = self.stage_index[stage] = len(self.stage_names)
            self.stage_names.append(stage)
        return sidx

    @staticmethod
    def _open_row(req: tuple, out: Finalised) -> int:
        _, start, end, _, resource, extra, _, flags, trace_state = req
        model, weight, error, counted, tokens = _request_fields(extra, flags, trace_state)
        row = len(out.start)
        out.service.append(resource[0])
        out.instance.append(resource[1:])
        out.model.append(model)
        out.weight.append(weight)
        out.start.append(start)
        out.end.append(end)
        out.error.append(error)
        out.counted.append(counted)
        if extra and _gen.is_generating(extra):
            out.gen.append((row, extra))
        out.tokens.append(tokens)
        return row

    def _stage_attrs(
        self,
        out: Finalised,
        row: int,
        stage_id: int,
        s: int,
        e: int,
        res: tuple,
        extra: dict,
        ident: tuple,
        now: float,
        position: int,
    ) -> float | None:
        """Model fallback, padding, batch work and compute windows from a stage span's
        attributes; ``position``: the span's in ``out.span_key``. Returns, for a work
        stage, the request's share of the span (for ``out.device``, which the caller
        extends), else None."""
        stage = self.stage_names[stage_id]
        if out.model[row] is None:
            out.model[row] = extra.get(_MODEL)
        if stage == _QUEUE:
            behind = extra.get(_BEHIND_S)
            if type(behind) in (float, int) and math.isfinite(behind) and behind >= 0:
                out.queue_behind.extend((position, float(behind)))
            return None
        batch_id = extra.get(_BATCH_ID)
        if stage in _PADDING_STAGES:
            eff = extra.get(_EFFECTIVE)
            pad = extra.get(_PADDED)
            if isinstance(eff, int) and isinstance(pad, int) and pad > 0:
                # One count per batch: batch id within the service instance, or the
                # span itself when the batch carries no id.
                key = (*res, "b", batch_id) if batch_id is not None else ident
                if key not in self.seen_batches:
                    self.seen_batches[key] = now
                    out.batches.append((row, eff, pad))
        if stage not in _WORK_STAGES:
            return None
        # Every member's share of the span (cost): not once per batch like the rest.
        share = member_share(out.tokens[row], extra.get(_EFFECTIVE), extra.get(_BATCH_SIZE))
        # Once per batch: its id within the service instance (service.name,
        # host.name, service.instance.id). A span of no batch id is not remembered,
        # unless it names a GPU (a linked span joins the GPU samples once: remembered
        # as itself), and adds nothing to the work estimate: without an id, copies of
        # one batch's span cannot be told from the spans of several batches.
        gpu = extra.get(_GPU_ID) if stage in _COMPUTE_STAGES else None
        if batch_id is not None:
            key: Any = (*res, "c", stage, batch_id)
        else:
            key = ident if gpu else None
        first = key is None or key not in self.seen_batches
        if batch_id is not None:
            size = extra.get(_BATCH_SIZE)
            seconds = (e - s) * 1e-9 if e > s else 0.0
            if type(size) is int and size > 0:  # not a bool
                out.work_share.extend((row, seconds / size))
            elif first:
                out.work_share.extend((row, seconds))
        if first:
            if key is not None:
                self.seen_batches[key] = now
            out.work.extend((row, s * 1e-9, e * 1e-9))
            if gpu:
                out.compute.append((row, (res[1], normalize_gpu_id(str(gpu)), s * 1e-9,
                                          e * 1e-9)))
        return share

    @staticmethod
    def _owner(sid: bytes, spans: dict, requests: set, memo: dict) -> bytes | None:
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


__all__ = ["Assembler", "Finalised", "trace_state_weight"]
