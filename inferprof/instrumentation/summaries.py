"""Summaries of every timed request, exported as OTLP metrics (contract §15).

In ``production`` mode most timed requests are not kept as traces; their timings reach the
collector folded into three exponential histograms instead (request duration, stage time,
and stage exclusive time per end-to-end bucket), exported every ``summary_interval_s``
with DELTA temporality. Kept traces of summarised requests carry
``inferprof.summary.counted``, so the collector counts every request once.

Cost on the request's thread: one tuple appended to a bounded deque (:meth:`Summaries.add`).
A daemon thread does the rest: ``inferprof.timing.partition`` (the collector's own
definition of stage and exclusive time), bucketing with ``inferprof.timing.exp_index``,
and the export. Memory is bounded: at most ``max_pending`` requests wait to be folded (past
that they are dropped and counted: ``summary_dropped``), and the folded state is one
bucket map per (model, weight, stage) key, at most ``max_keys`` of them. An exporter that
fails or hangs costs the summaries it held (counted), never the service: it runs on the
daemon thread, and :meth:`Summaries.close` waits for it only up to its timeout.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from inferprof import semconv
from inferprof.timing import DEFAULT_SUMMARY_SCALE, MIN_SUMMARY_SCALE, exp_index, partition

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
#: Seconds between two folds of the waiting requests (exports happen on a fold).
_FOLD_PERIOD_S = 0.5
#: A stage still running when the request ended (``links`` batches): it ends after it.
_OPEN_END = 1 << 62

_NS = 1e-9
#: (model, weight, error flag or stage name): one data point's key.
_Key = tuple[Any, ...]
_UNATTRIBUTED = semconv.STAGE_UNATTRIBUTED


class _Buckets:
    """One data point's state: bucket index -> count, zero count, sum, min, max."""

    __slots__ = ("counts", "max", "min", "sum", "zero")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.zero = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add_values(self, values: list[float], scale: int) -> None:
        """Count each value in its bucket (values <= 0 in the zero bucket)."""
        arr = np.asarray(values, dtype=np.float64)
        pos = arr[arr > 0]
        self.zero += len(arr) - len(pos)
        self.sum += float(arr.sum())
        self.min = min(self.min, float(arr.min()))
        self.max = max(self.max, float(arr.max()))
        if len(pos):
            self._add(exp_index(pos, scale), None)

    def add_amounts(self, e2e: list[float], amounts: list[int], scale: int) -> None:
        """Add each amount to the bucket of its end-to-end latency (tail metric)."""
        arr = np.asarray(e2e, dtype=np.float64)
        amt = np.asarray(amounts, dtype=np.int64)
        pos = arr > 0
        self.zero += int(amt[~pos].sum())
        total = int(amt.sum())
        self.sum += total
        self.min = min(self.min, float(arr.min()) * 1e9)
        self.max = max(self.max, float(arr.max()) * 1e9)
        if pos.any():
            self._add(exp_index(arr[pos], scale), amt[pos])

    def _add(self, idx: np.ndarray, amounts: np.ndarray | None) -> None:
        lo = int(idx.min())
        if amounts is None:
            per = np.bincount(idx - lo)
        else:
            per = np.zeros(int(idx.max()) - lo + 1, dtype=np.int64)
            np.add.at(per, idx - lo, amounts)
        counts = self.counts
        for off in np.flatnonzero(per).tolist():
            i = lo + off
            counts[i] = counts.get(i, 0) + int(per[off])

    @property
    def count(self) -> int:
        return sum(self.counts.values()) + self.zero


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
        self._resource = resource
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
        self._closed = False
        # Folded since the last export; touched by the export thread only.
        self._requests: dict[_Key, _Buckets] = {}
        self._stages: dict[_Key, _Buckets] = {}
        self._tail: dict[_Key, _Buckets] = {}
        self._folded = 0  # requests in the state above
        self._last_export = time.time_ns()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(
            target=self._run, name="inferprof-summaries", daemon=True
        )
        self._thread.start()

    # --- the request's thread -----------------------------------------------------------
    def add(self, entry: tuple[Any, ...]) -> bool:
        """Queue one finished request: ``(start, end, error, model, weight, own stage
        records, batches' stage records, extra spans)`` (:func:`stage_spans` reads the
        last three on the export thread). False (counted as dropped) when full or
        closed."""
        pending = self._pending
        if len(pending) >= self._max_pending or self._closed:
            self._stats.summary_dropped += 1
            return False
        pending.append(entry)
        self._stats.summarised += 1
        return True

    # --- the export thread --------------------------------------------------------------
    def _run(self) -> None:
        next_export = time.monotonic() + self.interval_s
        while True:
            self._wake.wait(_FOLD_PERIOD_S)
            stop = self._stop
            try:
                self._fold()
                if stop or time.monotonic() >= next_export:
                    next_export = time.monotonic() + self.interval_s
                    self._export()
            except Exception:  # never let the thread die: later summaries still count
                _logger.exception("inferprof could not fold or export its summaries")
            if stop:
                return

    def _fold(self) -> None:
        pending = self._pending
        n = len(pending)
        if not n:
            return
        scale = self.scale
        req_vals: dict[_Key, list[float]] = {}
        stage_vals: dict[_Key, list[float]] = {}
        tail_e2e: dict[_Key, list[float]] = {}
        tail_amt: dict[_Key, list[int]] = {}
        folded = 0
        for _ in range(n):
            start, end, error, model, weight, own, batches, extra = pending.popleft()
            try:
                spans = stage_spans(own, batches, extra, end)
                stage_time, exclusive, unattributed = partition(start, end, spans)
                if model is not None and not isinstance(model, str):
                    model = str(model)
            except Exception:
                _logger.exception("inferprof could not summarise a request")
                self._stats.summary_dropped += 1
                continue
            e2e = (end - start) * _NS
            key = (model, weight)
            req_vals.setdefault((*key, error), []).append(e2e)
            stage_time[_UNATTRIBUTED] = unattributed
            exclusive[_UNATTRIBUTED] = unattributed
            for stage, value in stage_time.items():
                stage_vals.setdefault((*key, stage), []).append(value)
            for stage, value in exclusive.items():
                ns = round(value * 1e9)
                if ns:
                    skey = (*key, stage)
                    tail_e2e.setdefault(skey, []).append(e2e)
                    tail_amt.setdefault(skey, []).append(ns)
            folded += 1
        dropped = 0
        for k, vals in req_vals.items():
            b = self._slot(self._requests, k)
            if b is None:
                dropped += len(vals)
            else:
                b.add_values(vals, scale)
        for k, vals in stage_vals.items():
            b = self._slot(self._stages, k)
            if b is not None:
                b.add_values(vals, scale)
        for k, vals in tail_e2e.items():
            b = self._slot(self._tail, k)
            if b is not None:
                b.add_amounts(vals, tail_amt[k], scale)
        # A request is counted by its request-duration data point: one past the key
        # bound is lost (its stages may be partly folded; the collector counts requests
        # from the request-duration metric).
        self._stats.summary_dropped += dropped
        self._folded += folded - dropped

    def _slot(self, table: dict[_Key, _Buckets], key: _Key) -> _Buckets | None:
        b = table.get(key)
        if b is None:
            if len(self._requests) + len(self._stages) + len(self._tail) >= self._max_keys:
                return None
            b = table[key] = _Buckets()
        return b

    def _export(self) -> None:
        now = time.time_ns()
        start, self._last_export = self._last_export, now
        requests, stages, tail = self._requests, self._stages, self._tail
        folded, self._folded = self._folded, 0
        self._requests, self._stages, self._tail = {}, {}, {}
        if not requests:
            return
        data = self._metrics_data(requests, stages, tail, start, now)
        try:
            result = self._exporter.export(
                data, timeout_millis=self._export_timeout_s * 1000
            )
            ok = _succeeded(result)
        except Exception:
            _logger.exception("inferprof could not export its summaries")
            ok = False
        if ok:
            self._stats.summary_exports += 1
        else:
            self._stats.summary_export_failed += 1
            self._stats.summary_dropped += folded

    def _metrics_data(self, requests: dict[_Key, _Buckets], stages: dict[_Key, _Buckets],
                      tail: dict[_Key, _Buckets], start: int,
                      now: int) -> Any:
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            ExponentialHistogram,
            Metric,
            MetricsData,
            ResourceMetrics,
            ScopeMetrics,
        )

        scale = self._export_scale((requests, stages, tail))
        shift = self.scale - scale
        metrics = []
        for name, unit, table, extra in (
            (semconv.METRIC_SUMMARY_REQUEST_DURATION, "s", requests, _error_attr),
            (semconv.METRIC_SUMMARY_STAGE_DURATION, "s", stages, _stage_attr),
            (semconv.METRIC_SUMMARY_STAGE_TAIL, "ns", tail, _stage_attr),
        ):
            points = [
                _point(b, _attributes(model, weight, extra(last)), start, now, scale, shift)
                for (model, weight, last), b in table.items()
            ]
            if points:
                metrics.append(Metric(
                    name=name, description=None, unit=unit,
                    data=ExponentialHistogram(
                        data_points=points,
                        aggregation_temporality=AggregationTemporality.DELTA,
                    ),
                ))
        return MetricsData(resource_metrics=[ResourceMetrics(
            resource=self._resource,
            scope_metrics=[ScopeMetrics(scope=self._scope, metrics=metrics, schema_url="")],
            schema_url="",
        )])

    def _export_scale(self, tables: Iterable[dict[_Key, _Buckets]]) -> int:
        """The export's scale: the summaries' own, lowered until every data point fits in
        ``_MAX_BUCKETS`` (one scale for all, so the tail metric's buckets stay those of
        the request metric)."""
        span = 0
        for table in tables:
            for b in table.values():
                if b.counts:
                    span = max(span, max(b.counts) - min(b.counts) + 1)
        scale = self.scale
        while span > _MAX_BUCKETS and scale > MIN_SUMMARY_SCALE:
            scale -= 1
            span = (span >> 1) + 1
        return scale

    # --- lifecycle ----------------------------------------------------------------------
    def close(self, timeout_s: float) -> None:
        """Fold and export what is left, within ``timeout_s``; what is not exported by
        then is counted as dropped. No more requests are taken."""
        self._closed = True
        self._stop = True
        self._wake.set()
        self._thread.join(max(0.0, timeout_s))
        if self._thread.is_alive():
            left = len(self._pending) + self._folded
            self._stats.summary_dropped += left
            _logger.warning(
                "inferprof's summary exporter did not finish within %.1f s: %d requests "
                "not summarised", timeout_s, left)
            return
        try:
            self._exporter.shutdown(timeout_millis=max(0.0, timeout_s) * 1000)
        except Exception:
            _logger.exception("inferprof could not shut its summary exporter down")


def _succeeded(result: Any) -> bool:
    from opentelemetry.sdk.metrics.export import MetricExportResult

    return result is None or result is MetricExportResult.SUCCESS


def _error_attr(error: bool) -> dict[str, Any]:
    return {semconv.ATTR_REQUEST_ERROR: True} if error else {}


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


def _point(b: _Buckets, attrs: dict[str, Any], start: int, now: int, scale: int,
           shift: int) -> Any:
    from opentelemetry.sdk.metrics.export import Buckets, ExponentialHistogramDataPoint

    counts = b.counts
    if shift:
        merged: dict[int, int] = {}
        for i, c in counts.items():
            j = i >> shift  # floor: OTLP's downscaling
            merged[j] = merged.get(j, 0) + c
        counts = merged
    if counts:
        lo, hi = min(counts), max(counts)
        dense = [0] * (hi - lo + 1)
        for i, c in counts.items():
            dense[i - lo] = c
    else:
        lo, dense = 0, []
    return ExponentialHistogramDataPoint(
        attributes=attrs,
        start_time_unix_nano=start,
        time_unix_nano=now,
        count=sum(dense) + b.zero,
        sum=b.sum,
        scale=scale,
        zero_count=b.zero,
        positive=Buckets(offset=lo, bucket_counts=dense),
        negative=Buckets(offset=0, bucket_counts=[]),
        flags=0,
        min=b.min if b.min != math.inf else 0.0,
        max=b.max if b.max != -math.inf else 0.0,
    )


def stage_spans(
    own: Iterable[Any], batches: Iterable[Iterable[Any]], extra: Iterable[tuple[str, int, int]],
    end: int,
) -> list[tuple[str, int, int]]:
    """The ``(stage, start_ns, end_ns)`` spans of one request, as its trace would carry
    them: its own stage records (one still open ends with the request, as its span
    does), the stage records of its batches (one still open ends after the request:
    the batch's span will), and ``extra`` spans made at the end (HTTP receive and
    serialize)."""
    spans = [(st.name, st.start, st.end if st.end is not None else end) for st in own]
    for stages in batches:
        spans.extend(
            (st.name, st.start, st.end if st.end is not None else _OPEN_END) for st in stages
        )
    spans.extend(extra)
    return spans


__all__ = ["DEFAULT_SUMMARY_INTERVAL_S", "Summaries", "stage_spans"]
