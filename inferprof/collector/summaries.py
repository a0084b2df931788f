"""In-process summaries (contract §15): every timed request's figures, as OTLP metrics.

A process in ``production`` mode keeps only some of its timed requests as traces, but
summarises all of them into three OTLP ExponentialHistogram metrics (DELTA temporality)
every few seconds: end-to-end latency per request, stage time per (request, stage), and
per end-to-end bucket the stages' exclusive time. This module reads them and folds them
into the engine's current time slice exactly where a fold of the same requests as traces
would put them: request counts and errors, quantile codes (end to end as stage 0, each
stage, ``unattributed``), the tail table, the Prometheus histograms and the fleet tables.

A fourth metric counts the requests a timing budget left untimed, at their end-to-end
latency, and a request-duration data point marked ``inferprof.summary.untimed_counted``
holds timed requests whose untimed siblings that metric counts. Both go into request-level
figures (request counts, errors, end-to-end quantiles and histograms) once per request,
not weighted: those figures are then exact. The stage figures and the tail table still
come from the timed requests alone, weighted; the tail table's per-bucket traced counts
and weights come from the request-duration points, marked or not.

Accuracy: an exponential bucket at scale ``s`` spans a factor ``base = 2**(2**-s)``; its
representative ``2 * base**(i+1) / (1 + base)`` lies within ``(base - 1) / (base + 1)``
of every value in it (0.27% at the producers' default scale 7), and the sketch key of
that representative adds the sketch's own relative accuracy (0.5% by default): together
under the contract's 1%. Coarser scales are accepted and cost accuracy accordingly.

Bad input: a data point that does not follow §15 (wrong type or temporality, a scale
outside [-10, 20], more than ``MAX_BUCKETS`` buckets, negative values, a count that is
not the sum of its buckets, a sum above what its buckets can hold, a bucket above
``sketch.MAX_VALUE``, a bad weight, stage, model, error or mark attribute, a weight or
stage on an untimed point, a mark off the request-duration metric) is rejected with its
reason and the rest of the export is kept. Memory does not grow with what is sent: buckets fold
into the sketches' bounded key space, series are capped by ``max_series`` and stage names
by ``max_stages`` like traced ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferprof import semconv as sc
from inferprof.collector.attribution import COL_E2E, COL_STAGE0, COL_TRACED, COL_WEIGHT, tail_codes
from inferprof.collector.layout import _BOUNDS, _E2E, _NB, _Q_LOCAL, _UNATTRIBUTED, STAGE_BITS
from inferprof.collector.sketch import KEY_BITS, MAX_VALUE, MIN_VALUE, KeyMapping, reduce_codes
from inferprof.timing import MAX_SUMMARY_SCALE, MIN_SUMMARY_SCALE, exp_log_representative

#: What each data point of the four metrics is (a timed request's, a stage's, a tail row,
#: an untimed request's).
KIND_REQUEST = 0
KIND_STAGE = 1
KIND_TAIL = 2
KIND_UNTIMED = 3
_KINDS = {sc.METRIC_SUMMARY_REQUEST_DURATION: KIND_REQUEST,
          sc.METRIC_SUMMARY_STAGE_DURATION: KIND_STAGE, sc.METRIC_SUMMARY_STAGE_TAIL: KIND_TAIL,
          sc.METRIC_SUMMARY_REQUEST_UNTIMED: KIND_UNTIMED}
#: Data points counted per request at their end-to-end latency.
_REQUEST_KINDS = (KIND_REQUEST, KIND_UNTIMED)
MIN_SCALE = MIN_SUMMARY_SCALE
MAX_SCALE = MAX_SUMMARY_SCALE
#: Positive (and negative) buckets one data point may carry. The sketch range
#: [1 ns, 1e6 s] takes about 6,400 buckets at scale 7, 12,800 at scale 8.
MAX_BUCKETS = 16_384
_DELTA = 1  # opentelemetry.proto.metrics.v1.AggregationTemporality DELTA
_NO_RECORDED_VALUE = 1  # DataPointFlags.FLAG_NO_RECORDED_VALUE
_LN2 = math.log(2.0)
_LN_MIN = math.log(MIN_VALUE)
_LN_MAX = math.log(MAX_VALUE)
_NS = 1e-9
_DEFAULT_SERVICE = "unknown_service"


def summary_kind(name: str) -> int | None:
    """``KIND_*`` of a summary metric's name; None for any other metric."""
    return _KINDS.get(name)


@dataclass(frozen=True)
class SummaryPoint:
    """One valid data point: its series and stage, and its buckets as sketch keys.

    ``keys`` (sketch keys, 0: the zero bucket), ``values`` (the buckets' representative
    seconds) and ``counts`` are per non-empty bucket; ``total``: the data point's ``sum``
    (seconds; None when absent, and for tail rows). ``once``: its requests count once in
    request-level figures (an untimed point, or a request-duration point marked
    ``inferprof.summary.untimed_counted``), else ``weight`` times.
    """

    kind: int
    service: str
    model: str
    stage: str
    error: bool
    weight: float
    keys: np.ndarray
    values: np.ndarray
    counts: np.ndarray
    total: float | None
    count: int
    once: bool = False

    @property
    def request_weight(self) -> float:
        """The weight of each of its requests in request counts, errors, end-to-end
        quantiles and histograms."""
        return 1.0 if self.once else self.weight


def representatives(scale: int, index: np.ndarray) -> np.ndarray:
    """The representative value ``2 * base**(i+1) / (1 + base)`` of exponential buckets
    ``index`` at ``scale`` (``timing.exp_representative``), clamped to the sketch's range
    in logarithms: ``base**i`` overflows a float at coarse scales."""
    return np.exp(np.clip(exp_log_representative(index, scale), _LN_MIN, _LN_MAX))


def _attributes(kind: int, attributes: Iterable[Any]
                ) -> tuple[str, str, bool, float, bool] | str:
    """(model, stage, error, weight, once) of a data point, or why they are not valid."""
    model = stage = ""
    error = once = False
    weight = 1.0
    for kv in attributes:
        key, value = kv.key, kv.value
        which = value.WhichOneof("value")
        if key == sc.ATTR_MODEL_NAME:
            if which != "string_value":
                return f"{sc.ATTR_MODEL_NAME} is not a string"
            model = value.string_value
        elif key == sc.ATTR_SAMPLE_WEIGHT:
            if kind == KIND_UNTIMED:
                return f"{sc.ATTR_SAMPLE_WEIGHT} on an untimed request (each counts once)"
            w = value.double_value if which == "double_value" else (
                value.int_value if which == "int_value" else None)
            if w is None or not 1 <= w <= sc.MAX_SAMPLE_WEIGHT:
                return f"{sc.ATTR_SAMPLE_WEIGHT} must be a number in [1, 2**56]"
            weight = float(w)
        elif key == sc.ATTR_STAGE:
            if kind == KIND_UNTIMED:
                return f"{sc.ATTR_STAGE} on an untimed request (it has no stage figures)"
            stage = value.string_value if which == "string_value" else ""
            if not sc.STAGE_NAME_PATTERN.match(stage):
                return f"invalid {sc.ATTR_STAGE} value {stage[:100]!r}"
        elif key == sc.ATTR_REQUEST_ERROR:
            if which != "bool_value":
                return f"{sc.ATTR_REQUEST_ERROR} is not a bool"
            error = value.bool_value
        elif key == sc.ATTR_SUMMARY_UNTIMED_COUNTED:
            if kind != KIND_REQUEST:
                return (f"{sc.ATTR_SUMMARY_UNTIMED_COUNTED} outside "
                        f"{sc.METRIC_SUMMARY_REQUEST_DURATION}")
            if which != "bool_value":
                return f"{sc.ATTR_SUMMARY_UNTIMED_COUNTED} is not a bool"
            once = value.bool_value
    if kind not in _REQUEST_KINDS and not stage:
        return f"no {sc.ATTR_STAGE} attribute"
    return model, stage, error, weight, once or kind == KIND_UNTIMED


def _buckets(dp: Any) -> tuple[np.ndarray, np.ndarray] | str:
    """(indices, counts) of a data point's non-empty positive buckets, or why they are
    not valid."""
    if not MIN_SCALE <= dp.scale <= MAX_SCALE:
        return f"scale {dp.scale} outside [{MIN_SCALE}, {MAX_SCALE}]"
    raw = dp.positive.bucket_counts
    if len(raw) > MAX_BUCKETS or len(dp.negative.bucket_counts) > MAX_BUCKETS:
        return f"more than {MAX_BUCKETS} buckets"
    if any(dp.negative.bucket_counts):
        return "negative values (latencies are >= 0)"
    if dp.zero_count and not dp.zero_threshold <= MIN_VALUE:
        # its values are read as zeros: a wider zero bucket would shorten them unseen
        return f"zero_threshold {dp.zero_threshold:g} above {MIN_VALUE:g} (zero_count: zeros)"
    counts = np.asarray(raw, dtype=np.uint64)
    if sum(raw) + dp.zero_count != dp.count:  # exact integers: no uint64 wrap-around
        return "count is not zero_count plus the bucket counts"
    if dp.HasField("sum") and not (math.isfinite(dp.sum) and dp.sum >= 0):
        return "sum is not a finite number >= 0"
    nonzero = np.flatnonzero(counts)
    index = dp.positive.offset + nonzero.astype(np.int64)
    if nonzero.size and index[-1] * (_LN2 * 2.0 ** -dp.scale) >= _LN_MAX:
        return f"a bucket above {MAX_VALUE:g} s"
    return index, counts[nonzero].astype(np.float64)


def _most(scale: int, index: np.ndarray, counts: np.ndarray) -> float:
    """The largest sum the buckets can hold: every value at its bucket's upper end (at
    most ``MAX_VALUE``), with room for rounding."""
    upper = np.exp(np.minimum((index + 1) * (_LN2 * 2.0 ** -scale), _LN_MAX))
    return float(np.dot(counts, upper)) * (1.0 + 1e-9)


def read_point(kind: int, service: str, dp: Any, mapping: KeyMapping) -> SummaryPoint | str | None:
    """A data point of a summary metric as a :class:`SummaryPoint`; the reason it is not
    valid; or None for one that holds nothing (no requests, or no recorded value)."""
    attrs = _attributes(kind, dp.attributes)
    if isinstance(attrs, str):
        return attrs
    buckets = _buckets(dp)
    if isinstance(buckets, str):
        return buckets
    if dp.count == 0 or dp.flags & _NO_RECORDED_VALUE:
        return None
    model, stage, error, weight, once = attrs
    index, counts = buckets
    if kind != KIND_TAIL and dp.HasField("sum") and dp.sum > _most(dp.scale, index, counts):
        # A larger sum would reach the cumulative histogram sums and stay there.
        return "sum is above what its buckets can hold"
    values = representatives(dp.scale, index)
    keys = mapping.key(values)
    if dp.zero_count:
        keys = np.concatenate(([0], keys))
        values = np.concatenate(([0.0], values))
        counts = np.concatenate(([float(dp.zero_count)], counts))
    total = dp.sum if dp.HasField("sum") and kind != KIND_TAIL else None
    return SummaryPoint(kind, service, model, stage, error, weight, keys, values, counts,
                        total, int(dp.count), once)


def read_metric(service: str, metric: Any, mapping: KeyMapping, errors: list[str]
                ) -> tuple[list[SummaryPoint], int, int]:
    """The valid data points of one summary metric, how many were accepted (empty ones
    included) and rejected; reasons appended to ``errors`` (the first five)."""
    kind = _KINDS[metric.name]
    which = metric.WhichOneof("data")
    points = getattr(metric, which).data_points if which else ()
    why = None
    if which != "exponential_histogram":
        why = "not an ExponentialHistogram"
    elif metric.exponential_histogram.aggregation_temporality != _DELTA:
        why = "aggregation temporality is not DELTA"
    if why is not None:
        if len(errors) < 5:
            errors.append(f"{metric.name}: {why}")
        return [], 0, len(points)
    out: list[SummaryPoint] = []
    rejected = 0
    for i, dp in enumerate(points):
        point = read_point(kind, service, dp, mapping)
        if isinstance(point, str):
            rejected += 1
            if len(errors) < 5:
                errors.append(f"{metric.name} data point {i}: {point}")
        elif point is not None:
            out.append(point)
    return out, len(points) - rejected, rejected


def service_of(resource: Any) -> str:
    for kv in resource.attributes:
        if kv.key == sc.RESOURCE_SERVICE_NAME:
            return kv.value.string_value or _DEFAULT_SERVICE
    return _DEFAULT_SERVICE


class _Rows:
    """Columns gathered from a batch of data points, concatenated once."""

    def __init__(self) -> None:
        self.q: list[tuple[np.ndarray, ...]] = []  # (series, stage, key, weight)
        self.t: list[tuple[np.ndarray, ...]] = []  # (series, key, column, value)
        self.h: list[tuple[np.ndarray, ...]] = []  # (series << STAGE_BITS | stage, value, w)
        self.s: list[tuple[int, int, float, bool]] = []  # (series, stage, sum, histogram)

    def quantiles(self, sid: int, stage: int, p: SummaryPoint, w: np.ndarray) -> None:
        n = p.keys.size
        self.q.append((np.full(n, sid), np.full(n, stage), p.keys, w))

    def tail(self, sid: int, p: SummaryPoint, col: int, values: np.ndarray) -> None:
        n = p.keys.size
        self.t.append((np.full(n, sid), p.keys, np.full(n, col), values))

    def histogram(self, sid: int, stage: int, p: SummaryPoint, weight: float) -> None:
        """Every request of ``p`` at ``weight``, in the histograms and their sums."""
        self.h.append((np.full(p.keys.size, sid << STAGE_BITS | stage), p.values,
                       p.counts * weight))
        total = p.total if p.total is not None else float(np.dot(p.values, p.counts))
        self.s.append((sid, stage, total * weight, stage != _UNATTRIBUTED))


def _columns(parts: list[tuple[np.ndarray, ...]], width: int) -> list[np.ndarray]:
    if not parts:
        return [np.empty(0, np.int64)] * (width - 1) + [np.empty(0)]
    return [np.concatenate([p[i] for p in parts]) for i in range(width)]


class SummaryPart:
    """Part of :class:`~inferprof.collector.engine.Engine` (a mixin: it reads the
    engine's state): summary data points folded into the current slice."""

    def _summary_series(self, p: SummaryPoint, count: int, now: float) -> int:
        key = (p.service, p.model)
        sid = self._series.get(key)
        if sid is None:
            sid = self._series_id(p.service, p.model, now, count)
            if self._series_keys[sid] == (sc.OVERFLOW_SERIES, "") and key[0] != sc.OVERFLOW_SERIES:
                self._overflow += count
        self._series_last[sid] = now
        return sid

    def _fold_summaries(self, points: list[SummaryPoint], now: float) -> None:
        """Fold valid summary data points into the slice of ``now``, as a fold of the
        same requests' traces would (``fold.FoldPart._fold``)."""
        if not points:
            return
        slice_ = self._slice_at(now)
        rows = _Rows()
        for p in points:
            request = p.kind in _REQUEST_KINDS
            sid = self._summary_series(p, p.count if request else 0, now)
            w = p.counts * p.weight
            if request:
                per = p.request_weight
                rows.quantiles(sid, _E2E, p, p.counts * per)
                rows.histogram(sid, _E2E, p, per)
                if p.kind == KIND_REQUEST:
                    # The tail table's rows are the timed requests', weighted as the
                    # stage exclusive times beside them, whatever the request figures.
                    rows.tail(sid, p, COL_TRACED, p.counts)
                    rows.tail(sid, p, COL_WEIGHT, w)
                    self._summary_requests += p.count
                else:
                    self._summary_untimed += p.count
                self._series_requests[sid] += p.count * per
                if p.error:
                    slice_.errors[sid] += p.count * per
                    self._series_errors[sid] += p.count * per
                continue
            col = self._stage_id(p.stage)
            if p.kind == KIND_TAIL:
                # A stage past max_stages: its time is unattributed, as for traces.
                ns = p.counts * (_NS * p.weight)
                rows.tail(sid, p, COL_STAGE0 + (_UNATTRIBUTED if col is None else col), ns)
                rows.tail(sid, p, COL_E2E, ns)
            elif col is None:
                self._asm._drop(sc.DROP_TOO_MANY_STAGES, p.count)
            else:
                rows.quantiles(sid, col, p, w)
                rows.histogram(sid, col, p, p.weight)
        self._fold_rows(rows, slice_)

    def _fold_rows(self, rows: _Rows, slice_: Any) -> None:
        series, stage, keys, w = _columns(rows.q, 4)
        q = reduce_codes((series << _Q_LOCAL) | (stage << KEY_BITS) | keys, w)
        series, keys, cols, values = _columns(rows.t, 4)
        t = reduce_codes(tail_codes(series, keys, cols), values)
        slice_.q_chunks.append(q)
        slice_.t_chunks.append(t)
        if len(slice_.q_chunks) > 16:
            slice_.quantile_store()
            slice_.tail_store()
        pairs = np.asarray([sid << STAGE_BITS | st for sid, st, _, _ in rows.s], np.int64)
        sums = np.asarray([v for _, _, v, _ in rows.s], np.float64)
        self._fleet.add(q, t, reduce_codes(pairs, sums))
        if rows.h:
            pair, values, w = _columns(rows.h, 3)
            pair, values = pair.astype(np.int64), values.astype(np.float64)
            keep = (pair & ((1 << STAGE_BITS) - 1)) != _UNATTRIBUTED
            bucket = np.searchsorted(_BOUNDS, values[keep], side="left")
            counted = np.asarray([h for _, _, _, h in rows.s], bool)
            self._add_histograms(pair[keep] * _NB + bucket, w[keep], pairs[counted],
                                 sums[counted])


__all__ = [
    "KIND_REQUEST", "KIND_STAGE", "KIND_TAIL", "KIND_UNTIMED", "MAX_BUCKETS", "MAX_SCALE",
    "MIN_SCALE",
    "SummaryPart", "SummaryPoint", "read_metric", "read_point", "representatives", "service_of",
    "summary_kind",
]
