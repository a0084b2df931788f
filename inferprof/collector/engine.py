"""The collector's folding engine: OTLP in, per-stage breakdowns out.

Receivers hand decoded OTLP exports to ``Engine.ingest_traces`` /
``Engine.ingest_metrics`` (from any thread). Spans are assembled into requests
(``assembly``); a finalised request is folded, in batches with numpy, into

* relative-error quantile sketches per (service, model, stage) and for end-to-end
  latency (``sketch``), one set per time slice of ``slice_s`` seconds;
* the tail-attribution sketch (``attribution``), per slice as well;
* cumulative Prometheus histograms, padding totals and compute-span windows for the GPU
  join (``verdict``).

In ``production`` mode services also send summaries of every request they timed (contract
§15): ``ingest_metrics`` folds them into the current slice where the same requests' traces
would go (``summaries``), and a trace marked ``inferprof.summary.counted`` adds only what
traces alone carry.

The engine is in parts: ``series`` (series ids and stage columns), ``fold`` (finalised
requests into a slice), ``summaries`` (summary data points into a slice) and ``document``
(a breakdown from the slices), mixins of :class:`Engine`; ``layout`` holds the bounds and
code layouts they share.

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
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from inferprof import semconv as sc
from inferprof.collector import cost as _cost
from inferprof.collector.admission import DEFAULT_RESERVE_FRACTION, FairShare, sender_of
from inferprof.collector.assembly import Assembler
from inferprof.collector.attribution import (
    DEFAULT_MAX_STAGES,
    MAX_MAX_STAGES,
    MIN_MAX_STAGES,
)
from inferprof.collector.document import DocumentPart
from inferprof.collector.examples import ExampleStore
from inferprof.collector.exemplars import Exemplar, ExemplarStore
from inferprof.collector.fleet import FleetStore, FleetTables, split_tables
from inferprof.collector.fold import FoldPart
from inferprof.collector.generation import GenerationFold
from inferprof.collector.gpu_samples import DROP_INVALID, GpuSamples
from inferprof.collector.labels import bounded
from inferprof.collector.layout import (
    _E2E,
    _NB,
    _Q_LOCAL,
    _YIELD_S,
    HISTOGRAM_BOUNDS,
    STAGE_BITS,
)
from inferprof.collector.records import EngineStats, IngestResult
from inferprof.collector.series import SeriesPart
from inferprof.collector.sketch import (
    KeyMapping,
    TimeSlice,
)
from inferprof.collector.summaries import SummaryPart, read_metric, service_of, summary_kind
from inferprof.collector.verdict import is_gpu_metric, normalize_gpu_id

_log = logging.getLogger(__name__)


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


def _check_limits(**limits: Any) -> None:
    for name, value in limits.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_flags(**flags: Any) -> None:
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")


def _check_max_stages(max_stages: Any) -> None:
    if (
        not isinstance(max_stages, int)
        or isinstance(max_stages, bool)
        or not MIN_MAX_STAGES <= max_stages <= MAX_MAX_STAGES
    ):
        raise ValueError(
            f"max_stages must be an integer from {MIN_MAX_STAGES} (the contract's stages"
            f" and unattributed) to {MAX_MAX_STAGES}, got {max_stages!r}"
        )


def _checked_prices(prices: Iterable[tuple[str, float]]) -> dict[str, float]:
    by_model = dict(prices)
    for model, price in by_model.items():
        if not isinstance(model, str) or not _cost.valid_price(price):
            raise ValueError(
                "gpu_hour_prices must be (GPU model or '', price >= 0) pairs, got "
                f"{model!r}: {price!r}"
            )
    return by_model


def _positive(name: str, value: float) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not value > 0
        or not math.isfinite(value)
    ):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


class Engine(SeriesPart, FoldPart, SummaryPart, DocumentPart):
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
        self._init_times(settle_s, trace_timeout_s, slice_s, windows_s, retention_s)
        _check_limits(
            max_series=max_series, max_spans_per_trace=max_spans_per_trace,
            max_links_per_span=max_links_per_span, max_pending_spans=max_pending_spans,
            max_gpu_samples=max_gpu_samples, max_gpus_per_host=max_gpus_per_host,
            max_gpu_hosts=max_gpu_hosts,
        )
        _check_max_stages(max_stages)
        _check_flags(triton_spans=triton_spans, share_pending_cap=share_pending_cap)
        self.max_stages = max_stages
        # Random keys of the queue-span sample (uniform; seeded: a run is repeatable).
        self._rng = np.random.default_rng(0)
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
        self._init_series(max_series)
        self._init_stores(max_gpu_samples, max_gpus_per_host, max_gpu_hosts, gpu_hour_prices)

    def _init_stores(self, max_gpu_samples: int, max_gpus_per_host: int, max_gpu_hosts: int,
                     gpu_hour_prices: Iterable[tuple[str, float]]) -> None:
        """What the engine keeps of what it folds (time slices, fleet tables, histograms,
        GPU samples, examples, exemplars, cost) and its counters."""
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
        self.gpu_hour_prices = _checked_prices(gpu_hour_prices)
        self._finalised = 0
        #: requests counted from summaries (timed, unweighted; untimed) and summary data
        #: points rejected
        self._summary_requests = 0
        self._summary_untimed = 0
        self._summary_rejected = 0
        self._overflow = 0
        self._next_advance = 0.0
        self._next_gpu_prune = -math.inf

    def _init_times(self, settle_s: float, trace_timeout_s: float, slice_s: float,
                    windows_s: tuple[float, ...], retention_s: float | None) -> None:
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

    # --- ingest --------------------------------------------------------------------
    def ingest_traces(
        self, request: Any, peer: str | None = None, payload: bytes | None = None
    ) -> IngestResult:
        """Assemble and fold an OTLP traces export. ``peer``: the client's address, which
        names the sender of an export holding several resources (admission.py).
        ``payload``: the protobuf bytes ``request`` was parsed from, when at hand: the
        spans are read off them, which costs less than reading the message."""
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
                accepted, rejected, errors = self._asm.ingest(request, payload)
                now = self.clock()
                fair.admitted(sender, accepted, now)
                if now >= self._next_advance:
                    self._advance(now)
        return IngestResult(accepted, rejected, tuple(errors))

    def ingest_metrics(self, request: Any) -> IngestResult:
        """Keep the GPU samples (contract §4) of an OTLP metrics export, and fold its
        summaries (contract §15, ``summaries.py``) into the current slice.

        The engines' KV-cache gauge (contract §14) goes to the generation store. Other
        metrics are ignored (neither accepted nor rejected); summary data points that do
        not follow §15 are rejected with their reason, the rest kept; GPU data points with a
        non-finite value or without ``hw.id``, with a timestamp outside the retention or
        too far ahead, or past the caps on hosts, GPUs and their metrics are rejected and
        counted (``gpu_samples.py``). ``accepted_spans`` / ``rejected_spans`` count data
        points here. Raises :class:`GpuSamplesFull`, keeping nothing, when the samples
        would pass ``max_gpu_samples``.
        """
        gpu_metrics = []
        kv_cache = []
        summaries = []
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
                    if summary_kind(metric.name) is not None:
                        summaries.append((rm.resource, metric))
                        continue
                    kind = metric.WhichOneof("data")
                    if kind not in ("gauge", "sum") or not is_gpu_metric(metric.name):
                        continue
                    points = getattr(metric, kind).data_points
                    gpu_metrics.append((host, metric.name, points))
                    incoming += len(points)
        accepted = rejected = 0
        errors: list[str] = []
        # Summaries are read and checked outside the lock (the mapping never changes).
        summary_points = []
        for resource, metric in summaries:
            valid, ok, bad = read_metric(service_of(resource), metric, self.mapping, errors)
            summary_points.extend(valid)
            accepted += ok
            rejected += bad
        summary_rejected = rejected
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
            self._summary_rejected += summary_rejected
            with _gc_paused():
                self._fold_summaries(summary_points, now)
            oldest = now - self.retention_s if finite else -math.inf
            for host, name, points in gpu_metrics:
                ok, bad = self._keep_gpu_points(host, name, points, now, oldest, errors)
                accepted += ok
                rejected += bad
        return IngestResult(accepted, rejected, tuple(errors))

    def _keep_gpu_points(self, host: str, name: str, points: Any, now: float, oldest: float,
                         errors: list[str]) -> tuple[int, int]:
        """Keep one GPU metric's data points: (accepted, rejected), the first reasons
        appended to ``errors``."""
        samples = self._gpu
        accepted = rejected = 0
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
                why = samples.add(host, hw_id, name, dp.time_unix_nano * 1e-9, v, now, oldest)
                if why is None:
                    # a name past the bound could name no price: not kept
                    if gpu_model and bounded(gpu_model) is gpu_model:
                        self._cost.model_of(host, normalize_gpu_id(hw_id), gpu_model)
                    accepted += 1
                    continue
            rejected += 1
            if len(errors) < 5:
                errors.append(f"{name[:100]} data point: {why}")
        return accepted, rejected

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
                    held = self._asm.pending
                    self._asm.discard(sc.DROP_SHUTDOWN)
                    _log.warning(
                        "flush stopped after %g s: %d spans still held were dropped "
                        "(inferprof_spans_dropped_total{reason=\"%s\"})",
                        timeout_s, held, sc.DROP_SHUTDOWN,
                    )
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
                summary_requests=self._summary_requests,
                summary_untimed_requests=self._summary_untimed,
                summary_points_rejected=self._summary_rejected,
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

__all__ = [
    "HISTOGRAM_BOUNDS", "Engine", "EngineStats", "GpuSamplesFull", "IngestResult", "Overloaded",
]
