"""Summaries of every timed request, exported as OTLP metrics (contract §15).

In ``production`` mode most timed requests are not kept as traces; their timings reach the
collector folded into three exponential histograms instead (request duration, stage time,
and stage exclusive time per end-to-end bucket), exported every ``summary_interval_s``
with DELTA temporality. Kept traces of summarised requests carry
``inferprof.summary.counted``, so the collector counts every request once.

Cost on the request's thread: one flat tuple of primitives (the stage spans' names and
times) appended to a bounded deque (:meth:`Summaries.add`); it holds no reference to a
record, so the records of a request not kept die with it, as before. A daemon thread does
the rest, vectorised over the requests waiting: it folds them about each second (sooner
when many wait) and exports once an interval:
``inferprof.timing.partition_many`` (``partition``, the collector's definition of stage
and exclusive time, with numpy), bucketing with ``inferprof.timing.exp_index``, and the
export. Memory is bounded: at most ``max_pending`` requests wait to be folded (past
that they are dropped and counted: ``summary_dropped``), and the folded state is one
bucket map per (model, weight, stage) key, at most ``max_keys`` of them. An exporter that
fails or hangs costs the summaries it held (counted), never the service: it runs on the
daemon thread, and :meth:`Summaries.close` waits for it only up to its timeout.

Requests a timing budget left untimed may be counted too (:meth:`Summaries.add_untimed`:
a four-tuple on a bounded deque of its own), into a fourth histogram of their end-to-end
latencies in the same export; timed entries then say whether their untimed siblings are
counted (contract §15, "Requests not timed").
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from itertools import chain
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from inferprof import semconv
from inferprof.instrumentation import _otel_compat as compat
from inferprof.instrumentation import summary_otlp
from inferprof.timing import (
    DEFAULT_SUMMARY_SCALE,
    MIN_SUMMARY_SCALE,
    exp_index,
    partition_many,
)

_logger = logging.getLogger(__name__)

#: Seconds between two exports, by default.
DEFAULT_SUMMARY_INTERVAL_S = 5.0
#: Requests waiting to be folded, at most (each a small tuple).
_DEFAULT_MAX_PENDING = 65536
#: Distinct (model, weight, error or stage) keys folded between two exports, at most.
_DEFAULT_MAX_KEYS = 4096
#: Buckets of one data point, at most: past it the export's scale is lowered (never at
#: scale 7 for latencies between a microsecond and an hour).
_MAX_BUCKETS = 8192
#: Requests waiting that wake the export thread to fold them before the next fold is due
#: (a fold has a fixed cost of its own; this bounds the waiting requests' memory, and the
#: tuples a young garbage collection finds alive: a few thousand of them make a
#: collection run in a service that summarises every request).
_FOLD_AT = 2048
#: Seconds between two folds' starts, about (none runs while an export does; an interval
#: shorter than this folds each interval). A fold runs on the service's cores and delays the
#: requests in flight while it runs: one fold of a whole interval at the demo's saturation
#: delayed enough of them to move the p99; folded each second, a fold is a fifth of that,
#: and the waiting tuples no longer make young collections run (docs/overhead.md).
_FOLD_EVERY_S = 1.0
#: Seconds a process exiting without inferprof.shutdown() waits for its last export, at
#: most.
_EXIT_TIMEOUT_S = 5.0
#: The end of a stage still running when its request ended (a ``links`` batch's): after
#: the request, where the collector will clip it.
OPEN_END = 1 << 62

_NS = 1e-9
#: Cells a fold counts into a dense array whatever its input's size, and per value beyond
#: that (``_bucket_rows``); past both it sorts them instead.
_DENSE_CELLS = 1 << 16
_DENSE_PER_VALUE = 4
_FIRST, _SECOND, _ERROR, _MODEL, _WEIGHT, _SPANS, _MARK = (itemgetter(i) for i in range(7))
#: (model, weight, stage name) or (model, weight, error flag, mark): one data point's key.
_Key = tuple[Any, ...]
_UNATTRIBUTED = semconv.STAGE_UNATTRIBUTED
#: (requests, stages, tail, untimed): the four tables of data points an export holds.
_Tables = tuple["dict[_Key, _Buckets]", "dict[_Key, _Buckets]", "dict[_Key, _Buckets]",
                "dict[_Key, _Buckets]"]


class _Buckets:
    """One data point's state: its bucket counts (``counts[i]`` the count of bucket
    ``lo + i``, dense, non-zero at both ends; empty: none), zero count, sum, min, max.

    Dense, in numpy: a fold adds each data point's buckets in one step (:meth:`add`),
    where a Python step per (data point, bucket) was most of a fold's time."""

    __slots__ = ("counts", "lo", "max", "min", "sum", "zero")

    def __init__(self) -> None:
        self.counts: npt.NDArray[np.int64] = _NO_COUNTS
        self.lo = 0
        self.zero = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, lo: int, row: npt.NDArray[np.int64]) -> None:
        """Add ``row``, the counts of buckets ``lo, lo + 1, ...`` (non-zero at both ends;
        not kept: copied where it would be)."""
        counts = self.counts
        n = len(counts)
        hi = lo + len(row)
        first = self.lo
        if not n:
            self.counts, self.lo = row.copy(), lo
        elif first <= lo and hi <= first + n:
            counts[lo - first:hi - first] += row
        else:  # a wider range: grown to hold both
            low = min(lo, first)
            grown = np.zeros(max(hi, first + n) - low, np.int64)
            grown[first - low:first - low + n] = counts
            grown[lo - low:hi - low] += row
            self.counts, self.lo = grown, low


_NO_COUNTS: npt.NDArray[np.int64] = np.zeros(0, np.int64)
_NO_COUNTS.flags.writeable = False  # (shared: replaced, never added into)


class Summaries:
    """The accumulator and its export thread, for one runtime.

    ``exporter``: an SDK ``MetricExporter`` (``export(MetricsData, timeout_millis=)``);
    ``resource``/``scope``: the runtime's; ``stats``: the runtime's counters.
    """

    def __init__(
        self,
        exporter: Any,
        resource: Any,
        scope: Any,
        stats: Any,
        *,
        interval_s: float = DEFAULT_SUMMARY_INTERVAL_S,
        scale: int = DEFAULT_SUMMARY_SCALE,
        max_pending: int = _DEFAULT_MAX_PENDING,
        max_keys: int = _DEFAULT_MAX_KEYS,
        export_timeout_s: float | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self._exporter = exporter
        #: ``send(request) -> ok`` where the exporter takes a request message (the SDK's
        #: OTLP/HTTP one): the export skips the SDK's metric objects and encoder
        self._send_request = compat.metrics_request_sender(exporter)
        #: (resource, the request's frame: resource and scope, no metric), per resource
        self._frame: tuple[Any, Any] | None = None
        #: the resource its exports carry (a forked child's runtime gives it its own)
        self.resource = resource
        self._scope = scope
        self._stats = stats
        self.interval_s = float(interval_s)
        self.scale = scale
        self._max_pending = max_pending
        self._max_keys = max_keys
        self._export_timeout_s = (
            export_timeout_s if export_timeout_s is not None else max(1.0, self.interval_s)
        )
        self._pending: deque[tuple[Any, ...]] = deque()
        #: untimed requests waiting to be folded (add_untimed), bounded as _pending
        self._untimed: deque[tuple[Any, ...]] = deque()
        self._closed = False
        # Folded since the last export; touched by the export thread only.
        self._requests: dict[_Key, _Buckets] = {}
        self._stages: dict[_Key, _Buckets] = {}
        self._tail: dict[_Key, _Buckets] = {}
        self._counted: dict[_Key, _Buckets] = {}  # the untimed requests'
        self._folded = 0  # requests in the state above
        self._folding = 0  # requests taken off the queue by the fold under way
        self._in_flight = 0  # requests in the export under way
        #: close() gave up waiting for the export thread and counted what it held
        self._abandoned = False
        self._account = threading.Lock()
        self._last_export = time.time_ns()
        self._fold_at = min(_FOLD_AT, max(1, max_pending // 2))
        self._start_thread()
        if hasattr(os, "register_at_fork"):
            weak = weakref.WeakMethod(self._after_fork)
            os.register_at_fork(after_in_child=lambda: (m := weak()) and m())
        # A process exiting without inferprof.shutdown(): the SDK's own exit handler
        # flushes the kept traces (marked counted); the last interval's summaries must
        # go too, or those requests count nowhere. (Registered after the providers: it
        # runs before theirs.)
        at_exit = weakref.WeakMethod(self._at_exit)
        atexit.register(lambda: (m := at_exit()) and m())

    def _start_thread(self) -> None:
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(
            target=self._run, name="inferprof-summaries", daemon=True
        )
        self._thread.start()

    def _after_fork(self) -> None:
        # A pre-forking server: the parent's summaries are the parent's to send, and the
        # child's thread did not survive the fork.
        if self._closed:
            return
        self._pending, self._untimed = deque(), deque()
        self._requests, self._stages, self._tail, self._counted = {}, {}, {}, {}
        self._folded = self._folding = self._in_flight = 0
        self._account = threading.Lock()  # the parent's export thread may have held it
        self._last_export = time.time_ns()
        self._start_thread()

    # --- the request's thread -----------------------------------------------------------
    def add(self, entry: tuple[Any, ...]) -> bool:
        """Queue one finished request, ``(start_ns, end_ns, error, model, weight, spans,
        untimed_counted)`` with ``spans`` a flat tuple ``(stage, start_ns, end_ns, stage,
        ...)`` of the stage spans its trace would hold (primitives only: a queued entry
        keeps no record alive) and ``untimed_counted`` whether its untimed siblings are
        counted (:meth:`add_untimed`): its request-duration data point then carries
        ``inferprof.summary.untimed_counted``. False (counted as dropped) when full or
        closed."""
        pending = self._pending
        if len(pending) >= self._max_pending or self._closed:
            self._stats.summary_dropped += 1
            return False
        pending.append(entry)
        self._stats.summarised += 1
        # At or past the threshold (another thread may have appended between this
        # append and the check: both would miss an exact match).
        if len(pending) >= self._fold_at and not self._wake.is_set():
            self._wake.set()
        if self._closed and not self._thread.is_alive():
            # Closed between the check above and the append, after the last fold: no
            # fold will take it, so it counts as dropped (as an export that failed).
            self._drain()
        return True

    def add_untimed(self, entry: tuple[Any, ...]) -> bool:
        """Count one finished request that was not timed, ``(start_ns, end_ns, error,
        model)``, in ``inferprof.summary.request.untimed`` at its end-to-end latency.
        False (counted as dropped) when full or closed."""
        pending = self._untimed
        if len(pending) >= self._max_pending or self._closed:
            self._stats.summary_dropped += 1
            return False
        pending.append(entry)
        self._stats.untimed_counted += 1
        if len(pending) >= self._fold_at and not self._wake.is_set():
            self._wake.set()
        if self._closed and not self._thread.is_alive():
            self._drain()  # (as in add())
        return True

    def _drain(self) -> None:
        """Count what waits to be folded as dropped, once the export thread is done.
        Entry by entry: request threads may drain at the same time."""
        n = 0
        for pending in (self._pending, self._untimed):
            while True:
                try:
                    pending.popleft()
                except IndexError:
                    break
                n += 1
        if n:
            self._stats.summary_dropped += n

    # --- the export thread --------------------------------------------------------------
    def _run(self) -> None:
        next_export = time.monotonic() + self.interval_s
        fold_every = min(self.interval_s, _FOLD_EVERY_S)
        next_fold = time.monotonic() + fold_every
        while True:
            self._wake.wait(max(0.0, min(next_export, next_fold) - time.monotonic()))
            self._wake.clear()
            stop = self._stop
            next_fold = time.monotonic() + fold_every  # (set first: a fold that raised
            try:  # must not leave it in the past, the loop spinning)
                self._fold()
                if stop or time.monotonic() >= next_export:
                    next_export = time.monotonic() + self.interval_s
                    self._export()
            except Exception:  # never let the thread die: later summaries still count
                _logger.exception("inferprof could not fold or export its summaries")
            if stop:
                return

    def _fold(self) -> None:
        pending, untimed = self._pending, self._untimed
        n, u = len(pending), len(untimed)
        if not n and not u:
            return
        with self._account:  # close() counts them whichever side of the fold they are
            entries = [pending.popleft() for _ in range(n)]
            counted = [untimed.popleft() for _ in range(u)]
            self._folding = n + u
        dropped = 0
        if n:
            try:
                dropped = self._fold_entries(entries)
            except Exception:
                _logger.exception("inferprof could not summarise %d requests", n)
                dropped = n
        if u:
            try:
                dropped += self._fold_untimed(counted)
            except Exception:
                _logger.exception("inferprof could not count %d untimed requests", u)
                dropped += u
        with self._account:
            self._folding = 0
            if self._abandoned:  # close() counted these as dropped when it gave up
                return
            self._stats.summary_dropped += dropped
            self._folded += n + u - dropped

    def _fold_entries(self, entries: list[tuple[Any, ...]]) -> int:
        """Fold requests into the state; returns how many were dropped (past the key
        bound, whole: ``_past_bound``)."""
        # C-level passes over the entries (map, itemgetter, chain): a Python loop per
        # request or per span would cost more than the rest of the fold.
        n = len(entries)
        starts = np.fromiter(map(_FIRST, entries), np.int64, n)
        ends = np.fromiter(map(_SECOND, entries), np.int64, n)
        flats = list(map(_SPANS, entries))
        spans = list(chain.from_iterable(flats))
        names = spans[0::3]
        codes = dict.fromkeys([_UNATTRIBUTED, *dict.fromkeys(names)])
        for i, name in enumerate(codes):
            codes[name] = i
        stage_code = np.fromiter(map(codes.__getitem__, names), np.int64, len(names))
        counts = np.fromiter(map(len, flats), np.int64, n) // 3
        pair_req, pair_stage, stage_ns, excl_ns, unatt_ns = partition_many(
            starts, ends, np.repeat(np.arange(n), counts), stage_code,
            np.array(spans[1::3], dtype=np.int64), np.array(spans[2::3], dtype=np.int64))
        # unattributed: one more pair per request, stage and exclusive time alike
        unatt = codes[_UNATTRIBUTED]
        pair_req = np.concatenate([pair_req, np.arange(n)])
        pair_stage = np.concatenate([pair_stage, np.full(n, unatt)])
        stage_ns = np.concatenate([stage_ns, unatt_ns])
        excl_ns = np.concatenate([excl_ns, unatt_ns])
        e2e: npt.NDArray[np.float64] = (ends - starts).astype(np.float64) * _NS

        # Data point keys: (model, weight) per request, then with error or stage.
        models = list(map(_MODEL, entries))
        if not {type(m) for m in set(models)} <= {str, type(None)}:
            models = [_model(m) for m in models]
        pairs = list(zip(models, map(_WEIGHT, entries), strict=True))
        series = dict.fromkeys(pairs)
        for i, key in enumerate(series):
            series[key] = i
        req_series = np.fromiter(map(series.__getitem__, pairs), np.int64, n)
        errors = np.fromiter(map(_ERROR, entries), bool, n)
        marks = np.fromiter(map(_MARK, entries), bool, n)
        series_keys = list(series)
        req_group = req_series * 4 + errors * 2 + marks
        req_keys = [(*series_keys[g >> 2], bool(g & 2), bool(g & 1))
                    for g in range(4 * len(series))]
        n_codes = len(codes)
        names_by_code = list(codes)
        pair_group = req_series[pair_req] * n_codes + pair_stage
        pair_keys = [(*series_keys[g // n_codes], names_by_code[g % n_codes])
                     for g in range(len(series) * n_codes)]

        amounts = np.rint(excl_ns)
        some = amounts > 0
        lost = self._past_bound(req_keys, req_group, pair_keys, pair_group, pair_req, some)
        e2e_req = e2e
        if lost is not None:
            req_group, e2e_req = req_group[~lost], e2e[~lost]
            kept = ~lost[pair_req]
            pair_req, pair_group, stage_ns = pair_req[kept], pair_group[kept], stage_ns[kept]
            amounts, some = amounts[kept], some[kept]
        self._fold_values(self._requests, req_keys, req_group, e2e_req)
        self._fold_values(self._stages, pair_keys, pair_group, stage_ns * _NS)
        self._fold_values(self._tail, pair_keys, pair_group[some], e2e[pair_req[some]],
                          amounts[some], extreme_unit=1e9)
        return int(lost.sum()) if lost is not None else 0

    def _fold_untimed(self, entries: list[tuple[Any, ...]]) -> int:
        """Fold untimed requests into their own metric's state, one data point per
        (model, error); returns how many were dropped (their data point past the key
        bound)."""
        n = len(entries)
        e2e = (np.fromiter(map(_SECOND, entries), np.int64, n)
               - np.fromiter(map(_FIRST, entries), np.int64, n)).astype(np.float64) * _NS
        models = list(map(_MODEL, entries))
        codes = dict.fromkeys(models)
        if not {type(m) for m in codes} <= {str, type(None)}:
            models = [_model(m) for m in models]
            codes = dict.fromkeys(models)
        errors = np.fromiter(map(_ERROR, entries), bool, n)
        if len(codes) == 1:  # the usual case: one model
            gid = errors.astype(np.int64)
        else:
            for i, model in enumerate(codes):
                codes[model] = i
            gid = np.fromiter(map(codes.__getitem__, models), np.int64, n) * 2 + errors
        keys = [(model, 1.0, error) for model in codes for error in (False, True)]
        lost = self._fold_values(self._counted, keys, gid, e2e)
        return int(np.isin(gid, list(lost)).sum()) if lost else 0

    def _keys_used(self) -> int:
        return len(self._requests) + len(self._stages) + len(self._tail) + len(self._counted)

    def _past_bound(self, req_keys: list[_Key], req_group: npt.NDArray[np.int64],
                    pair_keys: list[_Key], pair_group: npt.NDArray[np.int64],
                    pair_req: npt.NDArray[np.int64],
                    tail: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_] | None:
        """The requests not folded because a data point of theirs is past the key bound
        (None when every one fits). A request is folded whole or not at all, first come
        first served: a data point holding a part of the requests another one counts
        would bias the collector's shares and tail attribution."""
        tables = (self._requests, self._stages, self._tail)
        used = self._keys_used()
        new = {(t, g) for t, keys, gid in ((0, req_keys, req_group),
                                           (1, pair_keys, pair_group),
                                           (2, pair_keys, pair_group[tail]))
               for g in np.flatnonzero(np.bincount(gid)).tolist() if keys[g] not in tables[t]}
        if used + len(new) <= self._max_keys:
            return None
        # Past the bound (rare: keys are few): request by request, in order.
        n = len(req_group)
        order = np.argsort(pair_req, kind="stable")
        bounds = np.searchsorted(pair_req[order], np.arange(n + 1)).tolist()
        groups, tails = pair_group[order].tolist(), tail[order].tolist()
        lost = np.zeros(n, dtype=bool)
        for i, g in enumerate(req_group.tolist()):
            need = {(0, g)}
            for j in range(bounds[i], bounds[i + 1]):
                need.add((1, groups[j]))
                if tails[j]:
                    need.add((2, groups[j]))
            fresh = need & new
            if used + len(fresh) <= self._max_keys:
                used += len(fresh)
                new -= fresh
            else:
                lost[i] = True
        return lost

    def _fold_values(self, table: dict[_Key, _Buckets], keys: list[_Key],
                     gid: npt.NDArray[np.int64], values: npt.NDArray[np.float64],
                     amounts: npt.NDArray[np.float64] | None = None,
                     extreme_unit: float = 1.0) -> set[int]:
        """Count each row's value (or add its amount, at the bucket of its value) in the
        data point ``keys[gid]``; returns the groups past the key bound (not folded).
        ``extreme_unit``: what min and max are multiplied by."""
        if not len(gid):
            return set()
        slots: dict[int, _Buckets] = {}
        lost: set[int] = set()
        for g in np.flatnonzero(np.bincount(gid)).tolist():  # the groups present, sorted
            b = self._slot(table, keys[g])
            if b is None:
                lost.add(g)
            else:
                slots[g] = b
        if lost:
            keep = ~np.isin(gid, list(lost))
            gid, values = gid[keep], values[keep]
            amounts = amounts[keep] if amounts is not None else None
            if not len(gid):
                return lost
        size = int(gid.max()) + 1
        pos = values > 0
        sums = np.bincount(gid, weights=values if amounts is None else amounts, minlength=size)
        zero = np.bincount(gid[~pos], weights=None if amounts is None else amounts[~pos],
                           minlength=size)
        low = np.full(size, np.inf)
        np.minimum.at(low, gid, values)
        high = np.full(size, -np.inf)
        np.maximum.at(high, gid, values)
        if pos.any():
            idx = exp_index(values[pos], self.scale)
            lo = int(idx.min())
            width = int(idx.max()) - lo + 1
            for g, first, row in _bucket_rows(gid[pos] * width + (idx - lo), size, width,
                                              None if amounts is None else amounts[pos]):
                slots[g].add(lo + first, row)
        for g, b in slots.items():
            b.zero += int(zero[g])
            b.sum += float(sums[g])
            b.min = min(b.min, float(low[g]) * extreme_unit)
            b.max = max(b.max, float(high[g]) * extreme_unit)
        return lost

    def _slot(self, table: dict[_Key, _Buckets], key: _Key) -> _Buckets | None:
        b = table.get(key)
        if b is None:
            if self._keys_used() >= self._max_keys:
                return None
            b = table[key] = _Buckets()
        return b

    def _export(self) -> None:
        now = time.time_ns()
        start, self._last_export = self._last_export, now
        tables = (self._requests, self._stages, self._tail, self._counted)
        with self._account:  # in the export from now on, for close()
            folded, self._folded = self._folded, 0
            self._in_flight = folded
        self._requests, self._stages, self._tail, self._counted = {}, {}, {}, {}
        if not tables[0] and not tables[3]:
            self._in_flight = 0
            return
        try:
            ok = self._send(tables, start, now)
        except Exception:
            _logger.exception("inferprof could not export its summaries")
            ok = False
        with self._account:
            self._in_flight = 0
            if self._abandoned:  # close() counted these as dropped when it gave up
                return
            if ok:
                self._stats.summary_exports += 1
            else:
                self._stats.summary_export_failed += 1
                self._stats.summary_dropped += folded

    def _send(self, tables: _Tables, start: int, now: int) -> bool:
        """Export the tables: as a request message where the exporter takes one, else as
        the SDK's metric objects."""
        send = self._send_request
        if send is not None:
            try:
                request = self._request(tables, start, now)
            except Exception:  # (the SDK's objects and encoder, then: never lost)
                _logger.exception("inferprof could not encode its summaries; the SDK will")
            else:
                return send(request)
        data = self._metrics_data(tables, start, now)
        return _succeeded(self._exporter.export(
            data, timeout_millis=self._export_timeout_s * 1000))

    def _series(self, tables: _Tables) -> tuple[int, list[tuple[str, str, list[_Point]]]]:
        """The export's scale, and ``(name, unit, points)`` for each metric with data
        points, each point at that scale."""
        scale = self._export_scale(tables)
        shift = self.scale - scale
        series = []
        for (name, unit, extra), table in zip(_METRICS, tables, strict=True):
            points = [_point_of(_attributes(key[0], key[1], extra(*key[2:])), b, shift)
                      for key, b in table.items()]
            if points:
                series.append((name, unit, points))
        return scale, series

    def _metrics_data(self, tables: _Tables, start: int, now: int) -> Any:
        """The export as the SDK's metric objects, for any ``MetricExporter``."""
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            ExponentialHistogram,
            Metric,
            MetricsData,
            ResourceMetrics,
            ScopeMetrics,
        )

        scale, series = self._series(tables)
        metrics = [
            Metric(name=name, description=None, unit=unit, data=ExponentialHistogram(
                data_points=[_sdk_point(p, start, now, scale) for p in points],
                aggregation_temporality=AggregationTemporality.DELTA,
            ))
            for name, unit, points in series
        ]
        return MetricsData(resource_metrics=[ResourceMetrics(
            resource=self.resource,
            scope_metrics=[ScopeMetrics(scope=self._scope, metrics=metrics, schema_url="")],
            schema_url="",
        )])

    def _request(self, tables: _Tables, start: int, now: int) -> Any:
        """The export as the OTLP request message the SDK's encoder would make of
        :meth:`_metrics_data`, built straight from the state (``summary_otlp``), for the
        OTLP/HTTP exporter (``_send_request``): a fraction of the CPU."""
        frame = self._frame
        if frame is None or frame[0] is not self.resource:
            frame = self._frame = (self.resource, summary_otlp.frame(self.resource,
                                                                     self._scope))
        scale, series = self._series(tables)
        return summary_otlp.request(frame[1], series, start, now, scale)

    def _export_scale(self, tables: Iterable[dict[_Key, _Buckets]]) -> int:
        """The export's scale: the summaries' own, lowered until every data point fits in
        ``_MAX_BUCKETS`` (one scale for all, so the tail metric's buckets stay those of
        the request metric)."""
        span = 0
        for table in tables:
            for b in table.values():
                span = max(span, len(b.counts))
        scale = self.scale
        while span > _MAX_BUCKETS and scale > MIN_SUMMARY_SCALE:
            scale -= 1
            span = (span >> 1) + 1
        return scale

    # --- lifecycle ----------------------------------------------------------------------
    def _at_exit(self) -> None:
        if not self._closed:
            self.close(min(_EXIT_TIMEOUT_S, self._export_timeout_s))

    def close(self, timeout_s: float) -> None:
        """Fold and export what is left, within ``timeout_s``; what is not exported by
        then is counted as dropped. No more requests are taken."""
        self._closed = True
        self._stop = True
        self._wake.set()
        self._thread.join(max(0.0, timeout_s))
        if self._thread.is_alive():
            # An export that hangs: what it holds is not known to arrive, so it counts as
            # dropped with the rest, and the export, should it end later, counts nothing.
            with self._account:
                self._abandoned = True
                left = (len(self._pending) + len(self._untimed) + self._folding
                        + self._folded + self._in_flight)
            self._stats.summary_dropped += left
            _logger.warning(
                "inferprof's summary exporter did not finish within %.1f s: %d requests "
                "not summarised", timeout_s, left)
            return
        self._drain()  # requests whose add() had passed its check before close
        try:
            self._exporter.shutdown(timeout_millis=max(0.0, timeout_s) * 1000)
        except Exception:
            _logger.exception("inferprof could not shut its summary exporter down")


def _bucket_rows(cells: npt.NDArray[np.int64], groups: int, width: int,
                 amounts: npt.NDArray[np.float64] | None) -> list[tuple[int, int, Any]]:
    """Each group's buckets, from ``cells`` (``group * width + bucket``, buckets from 0):
    ``(group, first bucket, counts from it)`` for the groups with any, in order, the
    counts ``int64``, non-zero at both ends (each cell's count, or its summed
    ``amounts``: whole numbers). Counted into a dense grid when it is not much larger
    than the input (linear time), else sorted (``np.unique``)."""
    if groups * width <= max(_DENSE_PER_VALUE * len(cells), _DENSE_CELLS):
        grid = np.bincount(cells, weights=amounts, minlength=groups * width)
        grid = grid.astype(np.int64).reshape(groups, width)
        some = grid != 0
        firsts = some.argmax(axis=1).tolist()
        ends = (width - some[:, ::-1].argmax(axis=1)).tolist()
        return [(g, firsts[g], grid[g, firsts[g]:ends[g]])
                for g in np.flatnonzero(some.any(axis=1)).tolist()]
    present, inverse = np.unique(cells, return_inverse=True)
    totals = np.bincount(inverse, weights=amounts).astype(np.int64)
    owner = present // width
    bounds = np.searchsorted(owner, np.arange(groups + 1)).tolist()
    rows = []
    for g in np.flatnonzero(np.diff(bounds)).tolist():
        at = present[bounds[g]:bounds[g + 1]] - g * width
        first = int(at[0])
        row = np.zeros(int(at[-1]) - first + 1, np.int64)
        row[at - first] = totals[bounds[g]:bounds[g + 1]]
        rows.append((g, first, row))
    return rows


def _succeeded(result: Any) -> bool:
    from opentelemetry.sdk.metrics.export import MetricExportResult

    return result is None or result is MetricExportResult.SUCCESS


def _error_attr(error: bool, mark: bool = False) -> dict[str, Any]:
    attrs: dict[str, Any] = {semconv.ATTR_REQUEST_ERROR: True} if error else {}
    if mark:
        attrs[semconv.ATTR_SUMMARY_UNTIMED_COUNTED] = True
    return attrs


def _stage_attr(stage: str) -> dict[str, Any]:
    return {semconv.ATTR_STAGE: stage}


def _attributes(model: str | None, weight: float, extra: dict[str, Any]) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    if model is not None:
        attrs[semconv.ATTR_MODEL_NAME] = model
    if weight != 1.0:
        attrs[semconv.ATTR_SAMPLE_WEIGHT] = float(weight)
    attrs.update(extra)
    return attrs


class _Point(NamedTuple):
    """One data point as exported: its attributes, bucket offset and counts (at the
    export's scale), its count (``total``), zero count, sum, min and max (0 when it
    holds no value)."""

    attrs: dict[str, Any]
    offset: int
    counts: list[int]
    total: int
    zero: int
    sum: float
    min: float
    max: float


def _point_of(attrs: dict[str, Any], b: _Buckets, shift: int) -> _Point:
    """``b`` as exported, its buckets downscaled by ``shift`` (OTLP's: bucket ``i`` to
    ``i >> shift``)."""
    counts, lo = b.counts, b.lo
    if not len(counts):
        lo = 0
    elif shift:
        at = np.arange(lo, lo + len(counts)) >> shift
        lo = lo >> shift
        merged = np.zeros(int(at[-1]) - lo + 1, np.int64)
        np.add.at(merged, at - lo, counts)
        counts = merged
    dense = counts.tolist()
    return _Point(attrs, lo, dense, sum(dense) + b.zero, b.zero, b.sum,
                  b.min if b.min != math.inf else 0.0,
                  b.max if b.max != -math.inf else 0.0)


def _sdk_point(p: _Point, start: int, now: int, scale: int) -> Any:
    from opentelemetry.sdk.metrics.export import Buckets, ExponentialHistogramDataPoint

    return ExponentialHistogramDataPoint(
        attributes=p.attrs,
        start_time_unix_nano=start,
        time_unix_nano=now,
        count=p.total,
        sum=p.sum,
        scale=scale,
        zero_count=p.zero,
        positive=Buckets(offset=p.offset, bucket_counts=p.counts),
        negative=Buckets(offset=0, bucket_counts=[]),
        flags=0,
        min=p.min,
        max=p.max,
    )


def _model(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else str(value)


#: The exported metrics, in order: (name, unit, a data point's own attributes from the
#: rest of its key), one per table (requests, stages, tail, untimed).
_METRICS: tuple[tuple[str, str, Callable[..., dict[str, Any]]], ...] = (
    (semconv.METRIC_SUMMARY_REQUEST_DURATION, "s", _error_attr),
    (semconv.METRIC_SUMMARY_STAGE_DURATION, "s", _stage_attr),
    (semconv.METRIC_SUMMARY_STAGE_TAIL, "ns", _stage_attr),
    (semconv.METRIC_SUMMARY_REQUEST_UNTIMED, "s", _error_attr),
)

__all__ = ["DEFAULT_SUMMARY_INTERVAL_S", "OPEN_END", "Summaries"]
