"""The collector's folding engine: OTLP in, per-stage breakdowns out.

Receivers hand decoded OTLP exports to ``Engine.ingest_traces`` /
``Engine.ingest_metrics`` (from any thread). Spans are assembled into requests
(``assembly``); a finalised request is folded, in batches with numpy, into

* relative-error quantile sketches per (service, model, stage) and for end-to-end
  latency (``sketch``), one set per time slice of ``slice_s`` seconds;
* the tail-attribution sketch (``attribution``), per slice as well;
* cumulative Prometheus histograms, padding totals and compute-span windows for the GPU
  join (``verdict``).

Readers (``breakdown``, ``services``, ``EngineCollector``) merge the slices inside the
window they ask for. A request lands in the slice of the collector-clock time it was
finalised at, so windows are "what the collector finalised in the last N seconds" and
do not depend on the services' clocks.

Memory is bounded: spans pending in unfinished traces by ``max_pending_spans`` (an
export that would exceed it raises ``Overloaded`` before anything of it is accepted;
with nothing pending any one export is taken, so the bound is that plus one export, whose
size ``--max-body-bytes`` limits; near the cap, while a sender is starved of its share of
the recent intake, the others are held to three quarters of it, ``admission``),
slices by the largest window, (service, model) series by ``max_series`` (the rest fold
into ``service="__overflow__"``; at the cap, a new pair takes the slot of the series idle
longest, once nothing of it is left in any retained slice), distinct stage names by
``max_stages`` (at most ``attribution.MAX_STAGE_COLUMNS``).
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from inferprof import semconv as sc
from inferprof.collector import cost as _cost
from inferprof.collector.admission import DEFAULT_RESERVE_FRACTION, FairShare, sender_of
from inferprof.collector.assembly import Assembler, Finalised
from inferprof.collector.attribution import (
    COL_BITS,
    COL_E2E,
    COL_STAGE0,
    COL_TRACED,
    COL_WEIGHT,
    DEFAULT_MAX_STAGES,
    MAX_MAX_STAGES,
    MIN_MAX_STAGES,
    partition,
    tail_codes,
    tail_shares,
)
from inferprof.collector.examples import ExampleStore
from inferprof.collector.exemplars import Exemplar, ExemplarStore
from inferprof.collector.fleet import FleetStore, FleetTables, split_tables
from inferprof.collector.generation import GenerationFold
from inferprof.collector.gpu_samples import DROP_INVALID, GpuSamples
from inferprof.collector.labels import bounded, utf8_bytes
from inferprof.collector.queueing import combine, partial, union
from inferprof.collector.records import EngineStats, IngestResult
from inferprof.collector.sketch import (
    KEY_BITS,
    KeyMapping,
    TimeSlice,
    concat_reduce,
    gather,
    rank_index,
    reduce_codes,
    split_groups,
)
from inferprof.collector.verdict import decide, gpu_evidence, is_gpu_metric, normalize_gpu_id

#: Upper bounds (seconds) of the Prometheus histogram buckets: 0.5 ms .. 60 s, the
#: range of serving latencies from a single small-model stage to a long generation.
HISTOGRAM_BOUNDS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_BOUNDS = np.asarray(HISTOGRAM_BOUNDS)
_NB = len(HISTOGRAM_BOUNDS) + 1
STAGE_BITS = 10
_STAGE_MASK = (1 << STAGE_BITS) - 1
_Q_LOCAL = KEY_BITS + STAGE_BITS
#: Stage index 0 is end-to-end latency in the quantile store, 1 is ``unattributed``.
_E2E = 0
_UNATTRIBUTED = 1
#: UTF-8 bytes of (service, model) names per series, on average over ``max_series``: the
#: names of all series together are bounded by ``max_series`` times this, a new pair past
#: it going to the overflow series as one past ``max_series`` does.
SERIES_NAME_BYTES = 64
#: Compute windows kept per (slice, series) for the GPU join.
_MAX_COMPUTE_WINDOWS = 5_000
#: Per (slice, series): a uniform sample of _MAX_QUEUE_ROWS queue spans (48 KB) and the
#: union of the batch work windows in at most _MAX_WORK_ROWS intervals (96 KB).
_MAX_QUEUE_ROWS = 1_000
_MAX_WORK_ROWS = 4_000
_INSTANCE_BITS = (1 << 52) - 1  # an instance's code, exact as a float64
#: Temporary stage ids of stage names beyond max_stages (dropped when folding).
_NO_COLUMN = 1 << 20
_NS = 1e-9
_INT64_LIMIT = 1 << 63
_LOW32 = (1 << 32) - 1
#: Pause between two shares of a backlog: the lock is then free for ingest and readers
#: (Python's locks are not fair: a thread taking one again at once usually wins it).
_YIELD_S = 0.001


def _instance_codes(fin: Finalised) -> list[float]:
    """Per request, a number naming its service instance (host.name and
    service.instance.id): a queue waits only for its own instance's batches."""
    return [float(hash(i) & _INSTANCE_BITS) for i in fin.instance]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause CPython's cyclic garbage collector for one export or one finalisation.

    Every protobuf field read allocates a wrapper object, so collections of the young
    generation run every few hundred spans, and each one traverses the span records kept
    since the last one; the engine's records form no reference cycles, so those
    collections find nothing. Measured: a third of the ingest cost (benchmarks/
    collector_ingest.py). Reference counting still frees everything as usual; the
    collector runs again at the next allocation after the pause. A collector the
    application disabled itself is left disabled.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Overloaded(Exception):
    """Raised by ``ingest_traces`` when accepting the export would exceed
    ``max_pending_spans``. Nothing of that export was accepted: the receiver should
    answer with back-pressure (HTTP 429 / gRPC RESOURCE_EXHAUSTED) and let the client
    retry."""

    def __init__(self, pending: int, incoming: int, limit: int, cap: int | None = None) -> None:
        if cap is None or limit >= cap:
            reason = f"max_pending_spans={limit}"
        else:
            reason = (f"{limit} of max_pending_spans={cap}: the rest is kept for a sender "
                      "starved of its share of the recent intake")
        super().__init__(
            f"collector overloaded: {pending} spans pending + {incoming} incoming exceeds "
            f"{reason}"
        )
        self.pending = pending
        self.incoming = incoming
        self.limit = limit


class GpuSamplesFull(Overloaded):
    """Raised by ``ingest_metrics`` when keeping the export's GPU samples would exceed
    ``max_gpu_samples``; nothing of it was kept (HTTP 429 / gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, retained: int, incoming: int, cap: int) -> None:
        Exception.__init__(
            self,
            f"collector overloaded: {retained} GPU samples retained + {incoming} incoming "
            f"exceeds max_gpu_samples={cap}",
        )
        self.pending = retained
        self.incoming = incoming
        self.limit = cap


def _positive(name: str, value: float) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not value > 0
        or not math.isfinite(value)
    ):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


class Engine:
    """Assembles spans into requests and folds them into windowed sketches.

    Thread-safe: every public method takes the engine's lock.
    """

    def __init__(
        self,
        *,
        settle_s: float = 2.0,
        trace_timeout_s: float = 60.0,
        windows_s: tuple[float, ...] = (60.0, 300.0, 900.0),
        slice_s: float = 10.0,
        relative_accuracy: float = 0.005,
        max_series: int = 1000,
        max_stages: int = DEFAULT_MAX_STAGES,
        max_spans_per_trace: int = 10_000,
        max_links_per_span: int = 1024,
        max_pending_spans: int = 1_000_000,
        max_gpu_samples: int = 1_000_000,
        max_gpus_per_host: int = 64,
        max_gpu_hosts: int = 1024,
        retention_s: float | None = None,
        triton_spans: bool = True,
        share_pending_cap: bool = True,
        gpu_hour_prices: Iterable[tuple[str, float]] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(settle_s, (int, float)) or settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {settle_s!r}")
        self.settle_s = float(settle_s)
        self.trace_timeout_s = _positive("trace_timeout_s", trace_timeout_s)
        self.slice_s = _positive("slice_s", slice_s)
        if not windows_s:
            raise ValueError("windows_s must name at least one window")
        self.windows_s = tuple(_positive("windows_s", w) for w in windows_s)
        self.retention_s = max(self.windows_s) if retention_s is None else float(retention_s)
        if not self.retention_s > 0:  # math.inf keeps everything (offline reports)
            raise ValueError(f"retention_s must be > 0 or math.inf, got {retention_s!r}")
        for name, value in (
            ("max_series", max_series),
            ("max_spans_per_trace", max_spans_per_trace),
            ("max_links_per_span", max_links_per_span),
            ("max_pending_spans", max_pending_spans),
            ("max_gpu_samples", max_gpu_samples),
            ("max_gpus_per_host", max_gpus_per_host),
            ("max_gpu_hosts", max_gpu_hosts),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (
            not isinstance(max_stages, int)
            or isinstance(max_stages, bool)
            or not MIN_MAX_STAGES <= max_stages <= MAX_MAX_STAGES
        ):
            raise ValueError(
                f"max_stages must be an integer from {MIN_MAX_STAGES} (the contract's stages"
                f" and unattributed) to {MAX_MAX_STAGES}, got {max_stages!r}"
            )
        self.max_stages = max_stages
        # Random keys of the queue-span sample (uniform; seeded: a run is repeatable).
        self._rng = np.random.default_rng(0)
        flags = (("triton_spans", triton_spans), ("share_pending_cap", share_pending_cap))
        for name, flag in flags:
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        self.max_series = max_series
        self.max_pending_spans = max_pending_spans
        # Spans stay pending about settle_s; a sender retrying after a refusal (1 s
        # Retry-After, then the exporters' backoff) is still "trying" for a while.
        self._fair = FairShare(
            max_pending_spans,
            tau_s=max(self.settle_s, 1.0),
            active_s=max(10.0, 4 * self.settle_s),
            reserve_fraction=DEFAULT_RESERVE_FRACTION if share_pending_cap else 0.0,
        )
        self.mapping = KeyMapping(relative_accuracy)
        self.clock = clock
        self._lock = threading.RLock()
        # Generating requests (contract §7): their figures, and the engine step spans
        # they join, kept as long as a trace stays open.
        self._gen = GenerationFold(
            self.mapping,
            retention_s=self.retention_s,
            step_retention_s=self.trace_timeout_s + self.settle_s,
            histogram_bounds=HISTOGRAM_BOUNDS,
        )
        self._asm = Assembler(
            settle_s=self.settle_s,
            trace_timeout_s=self.trace_timeout_s,
            max_spans_per_trace=max_spans_per_trace,
            max_links_per_span=max_links_per_span,
            clock=clock,
            triton_spans=triton_spans,
            steps=self._gen.steps,
        )
        self._stage_names: list[str] = ["", sc.STAGE_UNATTRIBUTED, *sc.CANONICAL_STAGES]
        self._stage_index = {name: i for i, name in enumerate(self._stage_names) if name}
        # Assembler stage number -> stage column (-1: not mapped yet).
        self._col_of = np.empty(0, np.int64)
        self._series: dict[tuple[str, str], int] = {}
        self._series_keys: list[tuple[str, str]] = []
        self._series_requests: list[float] = []
        #: weighted requests with an ERROR status per series, since start (a counter)
        self._series_errors: list[float] = []
        #: collector-clock time each series was last folded into (reclaiming idle ones)
        self._series_last: list[float] = []
        #: UTF-8 bytes of the series' names together, bounded so that /metrics, which
        #: repeats them on every row of their series, is bounded in bytes as in series
        self._series_bytes = 0
        self._max_series_bytes = max_series * SERIES_NAME_BYTES
        #: "service" / "model" -> requests whose name was cut (labels.bounded)
        self._truncated = {"service": 0, "model": 0}
        #: no series becomes reclaimable before this time (a scan that found none)
        self._reclaim_after = -math.inf
        self._reclaimed = 0
        self._slices: dict[int, TimeSlice] = {}
        #: the sketch tables since start, for the fleet exposition (fleet.py)
        self._fleet = FleetStore(_Q_LOCAL, STAGE_BITS)
        self._hist: dict[tuple[int, int], np.ndarray] = {}
        self._hist_sum: dict[tuple[int, int], float] = {}
        self._gpu = GpuSamples(
            max_samples=max_gpu_samples, max_gpus_per_host=max_gpus_per_host,
            max_hosts=max_gpu_hosts,
        )
        #: the slowest traced requests per (slice, series), for the breakdown's examples
        self._examples = ExampleStore(collapse=not math.isfinite(self.retention_s))
        #: per histogram bucket, a request's trace id (OpenMetrics exemplars)
        self._exemplars = ExemplarStore(_NB)
        #: GPU-seconds per (slice, series, stage), GPU models, prices (cost.py)
        self._cost = _cost.CostStore()
        #: price per GPU-hour by hw.model ("": any other GPU)
        self.gpu_hour_prices = dict(gpu_hour_prices)
        for model, price in self.gpu_hour_prices.items():
            if not isinstance(model, str) or not _cost.valid_price(price):
                raise ValueError(
                    "gpu_hour_prices must be (GPU model or '', price >= 0) pairs, got "
                    f"{model!r}: {price!r}"
                )
        self._finalised = 0
        self._overflow = 0
        self._next_advance = 0.0
        self._next_gpu_prune = -math.inf

    # --- ingest --------------------------------------------------------------------
    def ingest_traces(self, request: Any, peer: str | None = None) -> IngestResult:
        """Assemble and fold an OTLP traces export. ``peer``: the client's address, which
        names the sender of an export holding several resources (admission.py)."""
        incoming = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        sender = sender_of(request, peer)
        with self._lock:
            pending = self._asm.pending
            fair = self._fair
            if pending + incoming > self.max_pending_spans - fair.reserve:
                # Near the cap: the limit depends on the sender's share of the intake.
                limit = fair.limit(sender, self.clock())
                if pending + incoming > limit:
                    # Finalise what is due first: the pressure may be only apparent.
                    self._advance(self.clock())
                    pending = self._asm.pending
                    # With nothing pending an export is taken whatever its size (the
                    # body limit bounds it): refused, it could never fit and its sender
                    # would retry it forever.
                    if pending and pending + incoming > limit:
                        raise Overloaded(pending, incoming, limit, self.max_pending_spans)
            with _gc_paused():
                accepted, rejected, errors = self._asm.ingest(request)
                now = self.clock()
                fair.admitted(sender, accepted, now)
                if now >= self._next_advance:
                    self._advance(now)
        return IngestResult(accepted, rejected, tuple(errors))

    def ingest_metrics(self, request: Any) -> IngestResult:
        """Keep the GPU samples (contract §4) of an OTLP metrics export.

        The engines' KV-cache gauge (contract §14) goes to the generation store. Other
        metrics are ignored (neither accepted nor rejected); GPU data points with a
        non-finite value or without ``hw.id``, with a timestamp outside the retention or
        too far ahead, or past the caps on hosts, GPUs and their metrics are rejected and
        counted (``gpu_samples.py``). ``accepted_spans`` / ``rejected_spans`` count data
        points here. Raises :class:`GpuSamplesFull`, keeping nothing, when the samples
        would pass ``max_gpu_samples``.
        """
        gpu_metrics = []
        kv_cache = []
        incoming = 0
        for rm in request.resource_metrics:
            host = ""
            for kv in rm.resource.attributes:
                if kv.key == sc.RESOURCE_HOST_NAME:
                    host = kv.value.string_value
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == sc.METRIC_ENGINE_KV_CACHE_USAGE:
                        kv_cache.append((rm.resource, metric))
                        continue
                    kind = metric.WhichOneof("data")
                    if kind not in ("gauge", "sum") or not is_gpu_metric(metric.name):
                        continue
                    points = getattr(metric, kind).data_points
                    gpu_metrics.append((host, metric.name, points))
                    incoming += len(points)
        accepted = rejected = 0
        errors: list[str] = []
        with self._lock:
            samples = self._gpu
            now = self.clock()
            finite = math.isfinite(self.retention_s)
            if not samples.has_room(incoming):
                if finite:  # what is past the retention makes room first
                    samples.prune(now - self.retention_s)
                if not samples.has_room(incoming):
                    raise GpuSamplesFull(samples.total, incoming, samples.max_samples)
            for resource, metric in kv_cache:
                ok, bad = self._gen.ingest_kv(resource, metric, now)
                accepted += ok
                rejected += bad
            oldest = now - self.retention_s if finite else -math.inf
            for host, name, points in gpu_metrics:
                for dp in points:
                    hw_id = gpu_model = ""
                    for kv in dp.attributes:
                        if kv.key == sc.ATTR_HW_ID:
                            hw_id = kv.value.string_value
                        elif kv.key == sc.ATTR_HW_MODEL:
                            gpu_model = kv.value.string_value
                    v = dp.as_double if dp.WhichOneof("value") == "as_double" else float(dp.as_int)
                    if not math.isfinite(v) or not hw_id:
                        samples.reject(DROP_INVALID)
                        why = "non-finite value" if hw_id else f"no {sc.ATTR_HW_ID}"
                    else:
                        why = samples.add(host, hw_id, name, dp.time_unix_nano * 1e-9, v,
                                          now, oldest)
                        if why is None:
                            # a name past the bound could name no price: not kept
                            if gpu_model and bounded(gpu_model) is gpu_model:
                                self._cost.model_of(host, normalize_gpu_id(hw_id), gpu_model)
                            accepted += 1
                            continue
                    rejected += 1
                    if len(errors) < 5:
                        errors.append(f"{name[:100]} data point: {why}")
        return IngestResult(accepted, rejected, tuple(errors))

    # --- finalisation ----------------------------------------------------------------
    def advance(self, now: float | None = None) -> None:
        """Fold everything due at ``now`` and forget what expired by then."""
        self._catch_up(self.clock() if now is None else now)

    def _catch_up(self, now: float) -> None:
        """``_advance`` until nothing due at ``now`` is left, one budget at a time
        (``Assembler.advance``), letting ingest and readers take the lock in between: a
        burst of due or expired traces is worked off without holding everyone up."""
        while True:
            with self._lock, _gc_paused():
                self._advance(now)
                if not self._asm.backlog:
                    return
            time.sleep(_YIELD_S)

    def flush(self, timeout_s: float | None = None) -> None:
        """Fold everything held, as if every trace had settled. The lock is taken a
        bounded time at a time, so readers and ingest go on meanwhile. ``timeout_s``: after
        that long, what is still held is dropped and counted (``semconv.DROP_SHUTDOWN``)
        instead: a collector stopping must not wait behind an unbounded backlog."""
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock, _gc_paused():
                now = self.clock()
                self._fold(self._asm.advance(now, everything=True), now)
                if not self._asm.backlog:
                    return
                if time.monotonic() >= deadline:
                    self._asm.discard(sc.DROP_SHUTDOWN)
                    return
            time.sleep(_YIELD_S)

    def _advance(self, now: float) -> None:
        self._fold(self._asm.advance(now), now)
        # With work left (a burst came due at once), the next ingest does the next share.
        pause = 0.0 if self._asm.backlog else min(1.0, self.settle_s / 2 or 1.0)
        self._next_advance = now + pause
        if math.isfinite(self.retention_s):
            oldest = math.floor((now - self.retention_s) / self.slice_s)
            for idx in [i for i in self._slices if i < oldest]:
                del self._slices[idx]
            self._examples.prune(oldest)
            self._cost.prune(oldest)
            if now >= self._next_gpu_prune:  # once a second
                self._next_gpu_prune = now + 1.0
                self._gpu.prune(now - self.retention_s)
            self._gen.prune(oldest, now)

    def _series_id(self, service: str, model: str, now: float) -> int:
        """The series of a (service, model) pair not found as it came: new, one whose
        names are too long (cut: ``labels.py``), or past a cap (the overflow series)."""
        cut_service, cut_model = bounded(service), bounded(model)
        if cut_service is not service:
            self._truncated["service"] += 1
        if cut_model is not model:
            self._truncated["model"] += 1
        key = (cut_service, cut_model)
        sid = self._series.get(key)
        if sid is None:
            size = utf8_bytes(cut_service) + utf8_bytes(cut_model)
            if (len(self._series) >= self.max_series
                    or self._series_bytes + size > self._max_series_bytes):
                sid = self._reclaim(now, size)
                if sid is not None:
                    self._series[key] = sid
                    self._series_keys[sid] = key
                    self._series_last[sid] = now
                    self._series_bytes += size
                    return sid
                key = (sc.OVERFLOW_SERIES, "")
                sid = self._series.get(key)
                if sid is not None:
                    return sid
                size = utf8_bytes(sc.OVERFLOW_SERIES)
            sid = len(self._series_keys)
            self._series[key] = sid
            self._series_keys.append(key)
            self._series_requests.append(0.0)
            self._series_errors.append(0.0)
            self._series_last.append(now)
            self._series_bytes += size
        return sid

    def _reclaim(self, now: float, size: int = 0) -> int | None:
        """Free the slot of the series idle longest, if it has been idle long enough that
        no retained slice holds any of it (folded more than ``retention_s + slice_s``
        ago); None when no series has. Its cumulative histograms leave ``/metrics`` with
        it (a returning pair starts them again from zero: a counter reset to
        Prometheus)."""
        if now < self._reclaim_after or not math.isfinite(self.retention_s):
            return None
        horizon = self.retention_s + self.slice_s
        overflow = self._series.get((sc.OVERFLOW_SERIES, ""))
        last = self._series_last
        sid = min(
            (i for i in range(len(self._series_keys)) if i != overflow),
            key=last.__getitem__,
            default=None,
        )
        if sid is None or last[sid] + horizon > now:
            # Nothing reclaimable before the idlest series is: no scan until then.
            self._reclaim_after = (last[sid] + horizon) if sid is not None else math.inf
            return None
        old = self._series_keys[sid]
        if self._series_bytes - sum(map(utf8_bytes, old)) + size > self._max_series_bytes:
            return None  # the new pair's names would not fit in the idlest one's room
        self._series_bytes -= sum(map(utf8_bytes, old))
        del self._series[old]  # the caller puts the new pair in its slot
        self._series_requests[sid] = 0.0
        self._series_errors[sid] = 0.0
        for hk in [hk for hk in self._hist if hk[0] == sid]:
            del self._hist[hk]
            del self._hist_sum[hk]
        self._examples.forget_series(sid)
        self._exemplars.forget_series(sid)
        self._gen.forget_series(sid)
        self._cost.forget_series(sid)
        self._fleet.forget_series(sid)
        self._reclaimed += 1
        return sid

    def _stage_id(self, stage: str) -> int | None:
        idx = self._stage_index.get(stage)
        if idx is None:
            # _stage_names[0] is "" (no stage): max_stages names take max_stages + 1.
            if len(self._stage_names) > self.max_stages:
                return None
            idx = len(self._stage_names)
            self._stage_names.append(stage)
            self._stage_index[stage] = idx
        return idx

    def _stage_columns(self, asm_ids: np.ndarray) -> np.ndarray:
        """Stage column of each assembler stage number (``Assembler.stage_names``).

        Names get a column on first fold, in order of first appearance among the spans
        folded. Names beyond ``max_stages`` map to ``_NO_COLUMN + number``
        (distinct per name, so that their drop is counted once per (request, stage) like
        every other per-stage figure; ``_fold`` moves their time to ``unattributed``).
        """
        names = self._asm.stage_names
        col_of = self._col_of
        if col_of.size < len(names):
            col_of = self._col_of = np.concatenate(
                [col_of, np.full(len(names) - col_of.size, -1, np.int64)]
            )
        cols = col_of[asm_ids]
        if cols.size and cols.min() < 0:
            unknown = asm_ids[cols < 0]
            uniq, first = np.unique(unknown, return_index=True)
            for aid in uniq[np.argsort(first)].tolist():
                idx = self._stage_id(names[aid])
                col_of[aid] = _NO_COLUMN + aid if idx is None else idx
            cols = col_of[asm_ids]
        return cols

    def _column_name(self, col: int) -> str:
        if col >= _NO_COLUMN:
            return self._asm.stage_names[col - _NO_COLUMN]
        return self._stage_names[col]

    def _partition(
        self, fin: Finalised, stage: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``attribution.partition`` of every request of ``fin`` at once, with numpy.

        ``stage``: the column of each stage span. Returns per request ``e2e`` and
        ``unattributed`` (seconds), and per (request, stage) pair, request-major: request
        index, stage column, stage time and exclusive time (seconds). Durations are
        summed in integer nanoseconds, as ``partition`` does. Exclusive time equals stage
        time unless a request's stage spans overlap; those few requests go through the
        exact sweep of ``partition``.
        """
        n = len(fin)
        req_start = np.frombuffer(fin.start, np.uint64)
        req_end = np.frombuffer(fin.end, np.uint64)
        span_start = np.frombuffer(fin.span_start, np.uint64)
        span_end = np.frombuffer(fin.span_end, np.uint64)
        # OTLP times are unsigned; past 2**63 ns (year 2262) use exact Python integers.
        if max(req_end.max(initial=0), span_end.max(initial=0)) >= _INT64_LIMIT:
            return self._partition_slow(fin, stage)
        req_start = req_start.astype(np.int64)
        req_end = req_end.astype(np.int64)
        span_start = span_start.astype(np.int64)
        span_end = span_end.astype(np.int64)
        span_req = np.frombuffer(fin.span_key, np.int64) >> 32
        n_ids = int(stage.max()) + 1 if stage.size else 1
        # Clip each stage span to its request; durations in integer ns (exact sums).
        cs = np.maximum(span_start, req_start[span_req])
        ce = np.minimum(span_end, req_end[span_req])
        d = ce - cs
        dn = np.maximum(d, 0)
        # Sum per (request, stage): sort by a packed code, reduce runs.
        code = span_req * n_ids + stage
        order = np.argsort(code, kind="stable")
        sorted_code = code[order]
        if sorted_code.size:
            first = np.flatnonzero(np.concatenate(([True], sorted_code[1:] != sorted_code[:-1])))
            pair_code = sorted_code[first]
            pair_ns = np.add.reduceat(dn[order], first)
            # A (request, stage) none of whose spans overlaps the request is absent (§6);
            # a zero-length span inside it was entered, for 0 s.
            met = (d > 0) | (
                (span_start == span_end)
                & (span_start >= req_start[span_req])
                & (span_start <= req_end[span_req])
            )
            inside = np.maximum.reduceat(met[order].astype(np.int8), first) > 0
            if not inside.all():
                self._asm._drop(sc.DROP_OUTSIDE_REQUEST, int(inside.size - inside.sum()))
                pair_code, pair_ns = pair_code[inside], pair_ns[inside]
        else:
            pair_code = pair_ns = np.empty(0, np.int64)
        pair_req = pair_code // n_ids
        pair_stage = pair_code % n_ids
        covered = np.zeros(n, np.int64)
        np.add.at(covered, pair_req, pair_ns)
        e2e_ns = req_end - req_start
        pair_time = pair_ns * _NS
        pair_excl = pair_time.copy()
        unattributed = (e2e_ns - covered) * _NS
        # Overlap: in start order, some span starts before the previous one ends.
        pos = np.flatnonzero(d > 0)
        if pos.size > 1:
            o = np.lexsort((cs[pos], span_req[pos]))
            rr = span_req[pos][o]
            bad = (rr[1:] == rr[:-1]) & (cs[pos][o][1:] < ce[pos][o][:-1])
            if bad.any():
                for i in np.unique(rr[1:][bad]).tolist():
                    lo = int(np.searchsorted(sorted_code, i * n_ids))
                    hi = int(np.searchsorted(sorted_code, (i + 1) * n_ids))
                    members = np.sort(order[lo:hi]).tolist()
                    intervals = [
                        (self._column_name(int(stage[j])), fin.span_start[j], fin.span_end[j])
                        for j in members
                    ]
                    _, exclusive, unatt = partition(fin.start[i], fin.end[i], intervals)
                    plo = int(np.searchsorted(pair_req, i))
                    phi = int(np.searchsorted(pair_req, i + 1))
                    for j in range(plo, phi):
                        pair_excl[j] = exclusive[self._column_name(int(pair_stage[j]))]
                    unattributed[i] = unatt
        return e2e_ns * _NS, unattributed, pair_req, pair_stage, pair_time, pair_excl

    def _partition_slow(
        self, fin: Finalised, stage: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = len(fin)
        per_req: list[list[tuple[str, int, int]]] = [[] for _ in range(n)]
        col_of: dict[str, int] = {}
        for key, col, s, e in zip(fin.span_key, stage.tolist(), fin.span_start, fin.span_end,
                                  strict=False):
            r = key >> 32
            name = self._column_name(col)
            per_req[r].append((name, s, e))
            col_of[name] = col
        e2e, unatt, pr, ps, pt, pe = [], [], [], [], [], []
        for i in range(n):
            stage_time, exclusive, u = partition(fin.start[i], fin.end[i], per_req[i])
            absent = {name for name, _, _ in per_req[i]} - stage_time.keys()
            if absent:
                self._asm._drop(sc.DROP_OUTSIDE_REQUEST, len(absent))
            e2e.append((fin.end[i] - fin.start[i]) * _NS)
            unatt.append(u)
            for name in sorted(stage_time, key=col_of.__getitem__):
                pr.append(i)
                ps.append(col_of[name])
                pt.append(stage_time[name])
                pe.append(exclusive[name])
        return (
            np.asarray(e2e, np.float64),
            np.asarray(unatt, np.float64),
            np.asarray(pr, np.int64),
            np.asarray(ps, np.int64),
            np.asarray(pt, np.float64),
            np.asarray(pe, np.float64),
        )

    def _fold(self, fin: Finalised, now: float) -> None:
        n = len(fin)
        if not n:
            return
        index = int(now // self.slice_s)
        slice_ = self._slices.get(index)
        if slice_ is None:
            slice_ = self._slices[index] = TimeSlice(index)
        # Per request: series (a dict lookup each; requests, not spans).
        overflow_key = (sc.OVERFLOW_SERIES, "")
        series_id = self._series_id
        series_keys = self._series_keys
        series_requests = self._series_requests
        series_last = self._series_last
        known = self._series.get
        # A model attribute that is not a string (or none at all) is "".
        models = [m if isinstance(m, str) else "" for m in fin.model]
        series: list[int] = []
        for key in zip(fin.service, models, strict=False):
            sid = known(key)
            if sid is None:  # a new series, or one folded into the overflow series
                sid = series_id(*key, now)
                if series_keys[sid] == overflow_key and key != overflow_key:
                    self._overflow += 1
            # Now, not after the loop: a series folded here must not be reclaimed for a
            # new one further down the same fold.
            series_last[sid] = now
            series.append(sid)
        for sid, w in zip(series, fin.weight, strict=False):
            series_requests[sid] += w
        if any(fin.error):
            errors = slice_.errors
            for sid, w, err in zip(series, fin.weight, fin.error, strict=False):
                if err:
                    errors[sid] += w
                    self._series_errors[sid] += w
        for row, eff, pad in fin.batches:
            acc = slice_.padding.setdefault(series[row], [0, 0, 0])
            acc[0] += eff
            acc[1] += pad
            acc[2] += 1
        if fin.compute:
            by_row: dict[int, list] = {}
            for row, window in fin.compute:
                by_row.setdefault(row, []).append(window)
            for row in sorted(by_row):
                windows = slice_.compute[series[row]]
                if len(windows) < _MAX_COMPUTE_WINDOWS:
                    windows.extend(by_row[row])
        self._finalised += n

        stage = self._stage_columns(np.frombuffer(fin.span_key, np.int64) & _LOW32)
        gpu_seconds = None
        if fin.device:
            device = np.frombuffer(fin.device, np.float64).reshape(-1, 4)
            if fin.gen:  # a generating request's share of its engine's steps
                device = device.copy()
                self._gen.device_shares(fin, self._asm.stage_names, device, now)
            cols = self._stage_columns(device[:, 1].astype(np.int64))
            gpu_seconds = self._cost.add(index, np.asarray(series, np.int64),
                                         np.frombuffer(fin.weight, np.float64), device, cols,
                                         cols < _NO_COLUMN)
        queue_col = self._stage_index.get(sc.STAGE_QUEUE)
        is_queue = stage == queue_col if queue_col is not None else None
        if fin.work or (is_queue is not None and is_queue.any()):
            self._keep_queue_and_work(fin, slice_, series, is_queue)
        req_e2e, unattributed, pair_req, pair_stage, pair_time, pair_excl = self._partition(
            fin, stage
        )
        if pair_stage.size and pair_stage.max() >= _NO_COLUMN:
            keep = pair_stage < _NO_COLUMN
            self._asm._drop(sc.DROP_TOO_MANY_STAGES, int(keep.size - keep.sum()))
            # A dropped stage's exclusive time becomes its request's `unattributed`, so
            # that every request's parts still sum to its e2e (and the shares to 1).
            np.add.at(unattributed, pair_req[~keep], pair_excl[~keep])
            pair_req, pair_stage = pair_req[keep], pair_stage[keep]
            pair_time, pair_excl = pair_time[keep], pair_excl[keep]
        req_series = np.asarray(series, np.int64)
        req_w = np.frombuffer(fin.weight, np.float64)
        # Per (request, stage) entries, ``unattributed`` first: request-major within
        # each kind, so equal codes accumulate in request order.
        pr = np.concatenate([np.arange(n), pair_req])
        ps = np.concatenate([np.full(n, _UNATTRIBUTED, np.int64), pair_stage])
        pt = np.concatenate([unattributed, pair_time])
        pe = np.concatenate([unattributed, pair_excl])
        mapping = self.mapping
        self._examples.add(index, req_series, fin.trace_id, req_e2e, pr, ps, pt, pe,
                           gpu_seconds)

        # Quantile sketches: end-to-end (stage 0) and per stage.
        q_series = np.concatenate([req_series, req_series[pr]])
        q_stage = np.concatenate([np.zeros(n, np.int64), ps])
        q_val = np.concatenate([req_e2e, pt])
        q_w = np.concatenate([req_w, req_w[pr]])
        q_codes = (q_series << _Q_LOCAL) | (q_stage << KEY_BITS) | mapping.key(q_val)
        q_reduced = reduce_codes(q_codes, q_w)
        slice_.q_chunks.append(q_reduced)

        # Tail attribution: per request traced/weight/e2e columns, per stage exclusive time.
        e2e_key = mapping.key(req_e2e)
        t_series = np.concatenate([req_series] * 3 + [req_series[pr]])
        t_key = np.concatenate([e2e_key] * 3 + [e2e_key[pr]])
        t_cols = np.concatenate(
            [
                np.full(n, COL_TRACED, np.int64),
                np.full(n, COL_WEIGHT, np.int64),
                np.full(n, COL_E2E, np.int64),
                COL_STAGE0 + ps,
            ]
        )
        t_vals = np.concatenate([np.ones(n), req_w, req_w * req_e2e, req_w[pr] * pe])
        t_reduced = reduce_codes(tail_codes(t_series, t_key, t_cols), t_vals)
        slice_.t_chunks.append(t_reduced)
        self._fleet.add(
            q_reduced, t_reduced, reduce_codes((q_series << STAGE_BITS) | q_stage, q_w * q_val)
        )
        if len(slice_.q_chunks) > 16:
            slice_.quantile_store()
            slice_.tail_store()

        # Cumulative Prometheus histograms (no unattributed pseudo-stage there).
        keep = q_stage != _UNATTRIBUTED
        hs, hst, hv, hw = q_series[keep], q_stage[keep], q_val[keep], q_w[keep]
        pair = (hs << STAGE_BITS) | hst
        bucket = np.searchsorted(_BOUNDS, hv, side="left")
        h_codes = pair * _NB + bucket
        q_row = np.concatenate([np.arange(n), pr])[keep]
        self._exemplars.add(pair, bucket, hv, q_row, fin.trace_id, now, (STAGE_BITS, _STAGE_MASK))
        uniq, sums = reduce_codes(h_codes, hw)
        for code, w in zip(uniq.tolist(), sums.tolist(), strict=False):
            p, bucket = divmod(code, _NB)
            key = (p >> STAGE_BITS, p & _STAGE_MASK)
            arr = self._hist.get(key)
            if arr is None:
                arr = self._hist[key] = np.zeros(_NB)
                self._hist_sum[key] = 0.0
            arr[bucket] += w
        uniq, sums = reduce_codes(pair, hw * hv)
        for p, s in zip(uniq.tolist(), sums.tolist(), strict=False):
            self._hist_sum[(p >> STAGE_BITS, p & _STAGE_MASK)] += s
        if fin.gen:
            self._gen.fold(fin, series, self._asm.stage_names, index, now)

    def _keep_queue_and_work(
        self, fin: Finalised, slice_: TimeSlice, series: list[int], is_queue: np.ndarray | None
    ) -> None:
        """Queue spans, batch work and the weighted work estimate of this fold
        (queueing.py), per (slice, series): a uniform sample of at most _MAX_QUEUE_ROWS
        queue spans (the smallest random keys), the union of all the work windows (at
        most _MAX_WORK_ROWS intervals: past that the shortest gaps are closed), the sum
        of the work windows' durations and the work estimate. The offline engine
        (unlimited retention) keeps every queue span and gap."""
        codes = np.asarray(_instance_codes(fin))
        sids = np.asarray(series, np.int64)
        parts: dict[int, list] = defaultdict(lambda: [None, None, 0.0, 0.0])
        if is_queue is not None and is_queue.any():
            rows = (np.frombuffer(fin.span_key, np.int64) >> 32)[is_queue]
            start = np.frombuffer(fin.span_start, np.uint64)[is_queue].astype(np.float64) * _NS
            end = np.frombuffer(fin.span_end, np.uint64)[is_queue].astype(np.float64) * _NS
            weight = np.frombuffer(fin.weight, np.float64)[rows]
            keys = self._rng.random(rows.size)
            # What the batcher itself measured (inferprof.queue.behind_batches_s), NaN
            # where it did not: those spans are compared with the work windows instead.
            reported = np.full(is_queue.size, np.nan)
            if fin.queue_behind:
                pairs = np.frombuffer(fin.queue_behind, np.float64).reshape(-1, 2)
                reported[pairs[:, 0].astype(np.int64)] = pairs[:, 1]
            rows_q = np.stack([codes[rows], start, end, weight, reported[is_queue], keys], axis=1)
            sid = sids[rows]
            for one in np.unique(sid).tolist():
                parts[one][0] = rows_q[sid == one]
        if fin.work:
            work = np.frombuffer(fin.work, np.float64).reshape(-1, 3)
            rows = work[:, 0].astype(np.int64)
            rows_w = np.stack([codes[rows], work[:, 1], work[:, 2]], axis=1)
            # Copies of one window (a linked span without batch id, Triton's batched
            # requests) once: sorted, then a row equal to the one before it goes.
            order = np.lexsort((rows_w[:, 2], rows_w[:, 1], rows_w[:, 0], sids[rows]))
            rows_w, sid = rows_w[order], sids[rows][order]
            keep = np.ones(sid.size, bool)
            keep[1:] = (np.diff(rows_w, axis=0) != 0).any(axis=1) | (sid[1:] != sid[:-1])
            rows_w, sid = rows_w[keep], sid[keep]
            bounds = np.flatnonzero(np.diff(sid)) + 1
            for chunk in np.split(np.arange(sid.size), bounds):
                w = rows_w[chunk]
                one = parts[int(sid[chunk[0]])]
                one[1] = w
                one[2] = float(np.clip(w[:, 2] - w[:, 1], 0.0, None).sum())
        if fin.work_share:
            share = np.frombuffer(fin.work_share, np.float64).reshape(-1, 2)
            rows = share[:, 0].astype(np.int64)
            part = np.frombuffer(fin.weight, np.float64)[rows] * share[:, 1]
            sid = sids[rows]
            for one in np.unique(sid).tolist():
                parts[one][3] = float(part[sid == one].sum())
        online = math.isfinite(self.retention_s)
        for one, (queue, work, seen, estimate) in parts.items():
            if queue is not None:
                kept = slice_.queue.get(one)
                queue = queue if kept is None else np.concatenate([kept, queue])
                if online and queue.shape[0] > _MAX_QUEUE_ROWS:
                    smallest = np.argpartition(queue[:, 5], _MAX_QUEUE_ROWS)[:_MAX_QUEUE_ROWS]
                    queue = queue[smallest]
                slice_.queue[one] = queue
            if work is not None:
                kept = slice_.work.get(one)
                work = union(work if kept is None else np.concatenate([kept, work]),
                             _MAX_WORK_ROWS if online else None)
                slice_.work[one] = work
            slice_.work_seen[one] += seen
            slice_.work_estimate[one] += estimate
            slice_.queue_version[one] += 1

    # --- readers -------------------------------------------------------------------------
    def pending_spans(self) -> int:
        with self._lock:
            return self._asm.pending

    @property
    def stats(self) -> EngineStats:
        with self._lock:
            asm = self._asm
            return EngineStats(
                spans_received=asm.received,
                spans_accepted=asm.accepted,
                spans_dropped=dict(asm.dropped),
                spans_ignored=asm.ignored,
                traces_incomplete=asm.incomplete,
                triton_requests_partial=asm.triton_partial,
                requests_finalised=self._finalised,
                series_overflow=self._overflow,
                series=len(self._series),
                series_reclaimed=self._reclaimed,
                gpu_samples_received=self._gpu.received,
                gpu_samples_dropped=dict(self._gpu.dropped),
                gpu_samples=self._gpu.total,
                labels_truncated=dict(self._truncated),
                engine_steps_received=self._gen.steps.steps_received,
                engine_steps_dropped=self._gen.steps.dropped,
                pending_spans=asm.pending,
                pending_traces=len(asm.traces),
            )

    def services(self) -> list[dict]:
        """Every service seen, its models and its (weighted) requests since start."""
        self._catch_up(self.clock())
        with self._lock:
            by_service: dict[str, dict] = {}
            for (service, model), sid in self._series.items():
                entry = by_service.setdefault(
                    service, {"service": service, "models": [], "requests": 0.0}
                )
                entry["models"].append(model)
                entry["requests"] += self._series_requests[sid]
            out = []
            for service in sorted(by_service):
                entry = by_service[service]
                entry["models"].sort()
                entry["requests"] = round(entry["requests"])
                out.append(entry)
            return out

    def series(self) -> list[tuple[str, str]]:
        """Every (service, model) tracked, in slot order (first appearance, but for a
        pair in a reclaimed slot)."""
        with self._lock:
            return list(self._series_keys)

    def histograms(self) -> list[tuple[str, str, str | None, np.ndarray, float]]:
        """Cumulative histograms: (service, model, stage or None for e2e, bucket counts, sum).

        Bucket counts are per bucket (not cumulative), for ``HISTOGRAM_BOUNDS`` + ``+Inf``.
        """
        with self._lock:
            out = []
            for (sid, stage), arr in self._hist.items():
                service, model = self._series_keys[sid]
                name = None if stage == _E2E else self._stage_names[stage]
                out.append((service, model, name, arr.copy(), self._hist_sum[(sid, stage)]))
            return out

    def fleet_tables(self) -> dict[tuple[str, str], FleetTables]:
        """Per (service, model), the quantile and tail tables since start (fleet.py)."""
        with self._lock:
            q, t, sums = self._fleet.tables()
            per_sid = split_tables(q, t, sums, _Q_LOCAL, STAGE_BITS, self._stage_names, _E2E)
            return {self._series_keys[sid]: tables for sid, tables in per_sid.items()}

    def histogram_exemplars(
        self, service: str, model: str, stage: str | None
    ) -> list[Exemplar | None]:
        """Per bucket of one histogram (as ``histograms``), its exemplar: (trace id hex,
        seconds, collector time) of a request in that bucket, or None."""
        with self._lock:
            sid = self._series.get((service, model))
            idx = _E2E if stage is None else self._stage_index.get(stage)
            if sid is None or idx is None:
                return [None] * _NB
            return self._exemplars.get(sid, idx)

    def generation_histograms(self) -> list[tuple[str, str, int, tuple, np.ndarray, float]]:
        """Cumulative histograms of generating requests: (service, model, histogram id
        (``generation.H_*``), bucket bounds, per-bucket weights with +Inf last, sum)."""
        with self._lock:
            return [
                (*self._series_keys[sid], h, self._gen.bounds[h], counts, total)
                for sid, h, counts, total in self._gen.histograms()
            ]

    def request_errors(self) -> list[tuple[str, str, float]]:
        """(service, model, weighted requests whose request span has status ERROR) per
        series, since start (a Prometheus counter; a reclaimed series starts again)."""
        with self._lock:
            pairs = zip(self._series_keys, self._series_errors, strict=False)
            return [(*key, total) for key, total in pairs]

    def breakdown(
        self, service: str, model: str | None = None, window_s: float | None = 300.0
    ) -> dict | None:
        """Contract §5 document for ``service`` (all its models when ``model`` is None)
        over the last ``window_s`` seconds (all retained data when None); None when the
        service (or that model of it) was never seen."""
        if window_s is not None:
            _positive("window_s", window_s)
        now = self.clock()
        self._catch_up(now)
        with self._lock:
            sids = [
                sid
                for (s, m), sid in self._series.items()
                if s == service and (model is None or m == model)
            ]
            if not sids:
                return None
            models = {self._series_keys[sid][1] for sid in sids}
            if window_s is None:
                slices = list(self._slices.values())
                since = None
            else:
                first = math.floor((now - window_s) / self.slice_s) + 1
                slices = [sl for idx, sl in self._slices.items() if idx >= first]
                since = now - window_s
            return self._document(
                service,
                model if model is not None else (next(iter(models)) if len(models) == 1 else None),
                window_s,
                sids,
                slices,
                since,
            )

    def _queue_partial(self, sl: TimeSlice, sid: int) -> tuple:
        """``queueing.partial`` of one slice's queue spans of one series, against the
        work windows of that slice and its neighbours (a queue waits behind batches
        folded a little earlier or later); cached until one of the three changes."""
        near = [self._slices.get(sl.index + d) for d in (-1, 0, 1)]
        versions = tuple(n.queue_version.get(sid, 0) if n is not None else -1 for n in near)
        cached = sl.queue_cache.get(sid)
        if cached is not None and cached[0] == versions:
            return cached[1]
        work = [n.work[sid] for n in near if n is not None and sid in n.work]
        queue = sl.queue.get(sid)
        result = partial(
            queue[:, :5] if queue is not None else np.empty((0, 5)),
            np.concatenate(work) if work else np.empty((0, 3)),
            sl.work_seen.get(sid, 0.0),
            sl.work_estimate.get(sid, 0.0),
        )
        sl.queue_cache[sid] = (versions, result)
        return result

    def _document(self, service, model, window_s, sids, slices, since) -> dict:
        q_parts = []
        t_parts = []
        padding = [0, 0, 0]
        errors = 0.0
        compute: list[tuple[str, str, float, float]] = []
        partials = []
        for sl in slices:
            q_parts.extend(gather(sl.quantile_store(), sids, _Q_LOCAL))
            t_parts.extend(gather(sl.tail_store(), sids, KEY_BITS + COL_BITS))
            for sid in sids:
                errors += sl.errors.get(sid, 0.0)
                acc = sl.padding.get(sid)
                if acc:
                    for i in range(3):
                        padding[i] += acc[i]
                compute.extend(sl.compute.get(sid, ()))
                if sid in sl.queue_version:
                    partials.append(self._queue_partial(sl, sid))
        per_stage = split_groups(*concat_reduce(q_parts))

        def quantiles(stage: int) -> tuple[float, dict[str, float | None], int | None]:
            if stage not in per_stage:
                return 0.0, {"p50": None, "p95": None, "p99": None}, None
            k, w = per_stage[stage]
            cum = np.cumsum(w)
            values = self.mapping.value(k)
            idx = [rank_index(cum, q) for q in sc.QUANTILES]
            return (
                float(cum[-1]),
                {name: float(values[i])
                 for name, i in zip(("p50", "p95", "p99"), idx, strict=False)},
                int(k[idx[1]]),
            )

        requests, latency, p95_key = quantiles(_E2E)
        e2e_keys = {}
        if _E2E in per_stage:
            k, w = per_stage[_E2E]
            cum = np.cumsum(w)
            e2e_keys = {q: int(k[rank_index(cum, q)]) for q in (0.5, 0.99)}
        if t_parts:
            t_codes = np.concatenate([p[0] for p in t_parts])
            t_vals = np.concatenate([p[1] for p in t_parts])
        else:
            t_codes, t_vals = np.empty(0, np.int64), np.empty(0)
        names = self._stage_names
        shares, tail_traced, _ = tail_shares(t_codes, t_vals, p95_key or 0, names)
        shares.pop("", None)
        _, traced, _ = tail_shares(t_codes, t_vals, 0, ())
        # Extension: the same attribution above p50 and p99 (report's stacked chart).
        shares50 = tail_shares(t_codes, t_vals, e2e_keys.get(0.5, 0), names)[0]
        shares99 = tail_shares(t_codes, t_vals, e2e_keys.get(0.99, 0), names)[0]

        order = {name: i for i, name in enumerate(sc.CANONICAL_STAGES)}
        present = [names[i] for i in per_stage if i not in (_E2E, _UNATTRIBUTED)]
        present.sort(key=lambda s: (order.get(s, len(order)), s))
        stages = []
        for name in [*present, sc.STAGE_UNATTRIBUTED]:
            idx = self._stage_index[name]
            count, qs, _ = quantiles(idx)
            if name == sc.STAGE_UNATTRIBUTED and idx not in per_stage:
                continue
            stages.append(
                {
                    "stage": name,
                    "count": round(count),
                    **qs,
                    "share_of_p95": float(shares.get(name, 0.0)),
                    "share_of_p50": float(shares50.get(name, 0.0)),
                    "share_of_p99": float(shares99.get(name, 0.0)),
                }
            )
        gpu = gpu_evidence(self._gpu, compute, since)
        # The slowest end to end, then per stage in the stages' order.
        examples = self._examples.document(
            [sl.index for sl in slices],
            sids,
            names,
            lambda s: (s == sc.STAGE_UNATTRIBUTED, order.get(s, len(order)), s),
        )
        cost = _cost.section(
            {names[c]: v for c, v in self._cost.totals([sl.index for sl in slices], sids).items()},
            requests,
            sc.COMPUTE_STAGES.__contains__,
            self._gpu.during(sc.METRIC_GPU_POWER_DRAW, compute),
            self._cost.price(self.gpu_hour_prices, compute),
            lambda s: (order.get(s, len(order)), s),
        )
        eff, pad, batches = padding
        doc = {
            "service": service,
            "model": model,
            # What the document covers: a window longer than the retention covers only
            # what is retained (None: everything retained, the offline report's case).
            "window_s": (
                None if window_s is None else float(min(window_s, self.retention_s))
            ),
            "requests": round(requests),
            "errors": round(errors),
            "traced_requests": int(traced),
            "latency": latency,
            "stages": stages,
            "gpu": gpu,
            "queue": combine(partials),
            "padding": {
                "effective_tokens": eff,
                "padded_tokens": pad,
                "waste_ratio": (1.0 - eff / pad) if pad else None,
                "batches": batches,
            },
        }
        doc["verdict"] = decide(shares, int(traced), int(tail_traced), gpu, doc["queue"])
        doc["examples"] = examples
        generation = self._gen.section(sids, [sl.index for sl in slices], doc["verdict"])
        if generation is not None:
            doc["generation"] = generation
        if cost is not None:
            doc["cost"] = cost
        return doc


__all__ = [
    "HISTOGRAM_BOUNDS", "Engine", "EngineStats", "GpuSamplesFull", "IngestResult", "Overloaded",
]
