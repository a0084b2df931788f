"""The GPU samples (contract §4) the collector retains for the verdict's GPU join.

Samples are kept by (``host.name``, ``hw.id``, metric), appended as they arrive. Memory
and the work of a scrape are bounded:

* at most ``max_samples`` samples in all: the engine refuses an export that would pass
  it whole (:meth:`GpuSamples.has_room`; answered 429 / ``RESOURCE_EXHAUSTED``) unless
  nothing is retained; at most ``MAX_SAMPLES_PER_SERIES`` per series, the oldest going first;
* at most ``max_hosts`` hosts, ``max_gpus_per_host`` GPUs per host and
  ``MAX_METRICS_PER_GPU`` metrics per GPU: samples of one more are rejected, counted by
  reason, and the rest of the export is kept (a retry could not fit them either until
  older GPUs' samples leave the retention);
* timestamps older than the retention, or more than ``MAX_FUTURE_S`` ahead of the
  collector's clock, are rejected and counted: the first would be pruned at once, the
  second never;
* host names, GPU ids and metric names longer than ``semconv.MAX_LABEL_BYTES`` are
  rejected and counted.

Readers find a GPU's series through an index by (GPU, metric), and count the samples of
a window from per-second totals, so a scrape reading hundreds of breakdowns costs what
the GPUs their compute spans name cost, not what every retained series costs. Not
thread-safe: the engine locks.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from inferprof import semconv as sc
from inferprof.collector.verdict import is_device_uuid, normalize_gpu_id

#: GPU samples kept per (GPU, metric) at most; the oldest go first.
MAX_SAMPLES_PER_SERIES = 200_000
#: Metrics kept per GPU: the contract's seven and DCGM's profiling fields fit.
MAX_METRICS_PER_GPU = 32
#: How far ahead of the collector's clock a sample's timestamp may be (clock skew).
MAX_FUTURE_S = 300.0

# Why a sample was not kept (label values of inferprof_gpu_samples_dropped_total).
DROP_INVALID = "invalid"
DROP_TOO_OLD = "too_old"
DROP_FUTURE = "future"
DROP_LABEL_TOO_LONG = "label_too_long"
DROP_TOO_MANY_HOSTS = "too_many_hosts"
DROP_TOO_MANY_GPUS = "too_many_gpus"
DROP_TOO_MANY_METRICS = "too_many_metrics"
#: the oldest samples of a series at MAX_SAMPLES_PER_SERIES, dropped for newer ones
DROP_SERIES_FULL = "series_full"
DROP_REASONS = (
    DROP_INVALID, DROP_TOO_OLD, DROP_FUTURE, DROP_LABEL_TOO_LONG, DROP_TOO_MANY_HOSTS,
    DROP_TOO_MANY_GPUS, DROP_TOO_MANY_METRICS, DROP_SERIES_FULL,
)

Key = tuple[str, str, str]


def _too_long(value: str) -> bool:
    # len() counts characters, at most 4 UTF-8 bytes each: encode only the doubtful.
    limit = sc.MAX_LABEL_BYTES
    return len(value) > limit and (len(value) > 4 * limit or len(value.encode()) > limit)


class GpuSamples:
    """GPU samples by (host, hw.id, metric), bounded as the module docstring says."""

    def __init__(
        self,
        *,
        max_samples: int = 1_000_000,
        max_gpus_per_host: int = 64,
        max_hosts: int = 1024,
    ) -> None:
        self.max_samples = max_samples
        self.max_gpus_per_host = max_gpus_per_host
        self.max_hosts = max_hosts
        self._data: dict[Key, tuple[list[float], list[float]]] = {}
        self._version: dict[Key, int] = defaultdict(int)
        self._sorted: dict[Key, tuple[int, np.ndarray, np.ndarray, float]] = {}
        #: host -> GPU -> metrics with retained samples
        self._hosts: dict[str, dict[str, set[str]]] = {}
        #: (GPU, metric) -> the keys of that GPU's series of that metric, any host
        self._by_gpu: dict[tuple[str, str], dict[Key, None]] = defaultdict(dict)
        #: whole second -> samples retained with a timestamp in it
        self._per_second: dict[int, int] = defaultdict(int)
        #: each series' earliest timestamp, and a heap of (that timestamp, series) (older
        #: entries of a series are skipped): pruning finds what is due without a scan
        self._first: dict[Key, float] = {}
        self._expiry: list[tuple[float, Key]] = []
        #: series whose samples did not arrive in time order (pruned by a scan of theirs)
        self._unsorted: set[Key] = set()
        self.total = 0
        self.received = 0
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)

    # --- writing -------------------------------------------------------------------------
    def has_room(self, incoming: int) -> bool:
        """Whether ``incoming`` more samples fit (any number fits when none is retained:
        refused, a large export could never get in)."""
        return not self.total or self.total + incoming <= self.max_samples

    def add(
        self, host: str, hw_id: str, metric: str, t: float, value: float,
        now: float, oldest: float,
    ) -> str | None:
        """Keep one sample; None, or the reason (``DROP_*``) it was rejected (counted).
        ``oldest``: the earliest timestamp kept (``-math.inf``: no limit)."""
        reason = None
        if t < oldest:
            reason = DROP_TOO_OLD
        elif t > now + MAX_FUTURE_S:
            reason = DROP_FUTURE
        elif _too_long(host) or _too_long(hw_id) or _too_long(metric):
            reason = DROP_LABEL_TOO_LONG
        if reason is None:
            key = (host, normalize_gpu_id(hw_id), metric)
            series = self._data.get(key)
            if series is None:
                reason = self._new_series(key)
                series = self._data.get(key)
        if reason is not None:
            self.dropped[reason] += 1
            return reason
        assert series is not None
        if len(series[0]) >= MAX_SAMPLES_PER_SERIES:
            cut = MAX_SAMPLES_PER_SERIES // 10
            self._forget(series[0][:cut])
            del series[0][:cut]
            del series[1][:cut]
            self.dropped[DROP_SERIES_FULL] += cut
            self._set_first(key, series[0])
        ts = series[0]
        if ts and t < ts[-1]:
            self._unsorted.add(key)
        ts.append(t)
        series[1].append(value)
        first = self._first.get(key)
        if first is None or t < first:
            self._first[key] = t
            heapq.heappush(self._expiry, (t, key))
        self._per_second[math.floor(t)] += 1
        self._version[key] += 1
        self.total += 1
        self.received += 1
        return None

    def reject(self, reason: str) -> None:
        self.dropped[reason] += 1

    def _new_series(self, key: Key) -> str | None:
        host, gpu, metric = key
        gpus = self._hosts.get(host)
        if gpus is None:
            if len(self._hosts) >= self.max_hosts:
                return DROP_TOO_MANY_HOSTS
            gpus = self._hosts[host] = {}
        metrics = gpus.get(gpu)
        if metrics is None:
            if len(gpus) >= self.max_gpus_per_host:
                return DROP_TOO_MANY_GPUS
            metrics = gpus[gpu] = set()
        if len(metrics) >= MAX_METRICS_PER_GPU:
            return DROP_TOO_MANY_METRICS
        metrics.add(metric)
        self._data[key] = ([], [])
        self._by_gpu[(gpu, metric)][key] = None
        return None

    def _forget(self, times: Iterable[float]) -> None:
        """Take samples at ``times`` out of the per-second totals and the total."""
        per_second = self._per_second
        n = 0
        for t in times:
            second = math.floor(t)
            left = per_second[second] - 1
            if left:
                per_second[second] = left
            else:
                del per_second[second]
            n += 1
        self.total -= n

    def _set_first(self, key: Key, ts: list[float]) -> None:
        first = min(ts) if key in self._unsorted else ts[0]
        self._first[key] = first
        heapq.heappush(self._expiry, (first, key))

    def prune(self, oldest: float) -> None:
        """Drop the samples older than ``oldest``, and the series, GPUs and hosts left
        with none. Costs what it removes: only the series holding such samples are read."""
        expiry = self._expiry
        while expiry and expiry[0][0] < oldest:
            first, key = heapq.heappop(expiry)
            if self._first.get(key) != first:
                continue  # the series went, or its earliest sample changed since
            ts, vs = self._data[key]
            if key in self._unsorted:
                keep = [i for i, t in enumerate(ts) if t >= oldest]
                self._forget([t for t in ts if t < oldest])
                ts[:], vs[:] = [ts[i] for i in keep], [vs[i] for i in keep]
            else:
                cut = bisect_left(ts, oldest)
                self._forget(ts[:cut])
                del ts[:cut]
                del vs[:cut]
            self._version[key] += 1
            if not ts:
                self._drop_series(key)
                continue
            self._set_first(key, ts)

    def _drop_series(self, key: Key) -> None:
        host, gpu, metric = key
        del self._data[key]
        self._sorted.pop(key, None)
        self._first.pop(key, None)
        self._unsorted.discard(key)
        del self._version[key]
        index = self._by_gpu[(gpu, metric)]
        index.pop(key, None)
        if not index:
            del self._by_gpu[(gpu, metric)]
        gpus = self._hosts[host]
        gpus[gpu].discard(metric)
        if not gpus[gpu]:
            del gpus[gpu]
            if not gpus:
                del self._hosts[host]

    # --- reading -------------------------------------------------------------------------
    def _arrays(self, key: Key) -> tuple[np.ndarray, np.ndarray, float]:
        """Times (sorted), values and median sampling period of one series."""
        version = self._version[key]
        cached = self._sorted.get(key)
        if cached is None or cached[0] != version:
            ts, vs = self._data[key]
            t = np.asarray(ts)
            v = np.asarray(vs)
            order = np.argsort(t, kind="stable")
            t, v = t[order], v[order]
            period = float(np.median(np.diff(t))) if t.size > 1 else 0.0
            cached = self._sorted[key] = (version, t, v, period)
        return cached[1], cached[2], cached[3]

    def count(self, since: float | None = None) -> int:
        """Samples retained with a timestamp from ``since`` on (all when None), to the
        second: the samples of the second ``since`` falls in count whole."""
        if since is None:
            return self.total
        first = math.floor(since)
        return sum(n for second, n in self._per_second.items() if second >= first)

    def during(
        self, metric: str, intervals: Iterable[tuple[str, str, float, float]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Values of ``metric`` joined to compute ``intervals`` (host, gpu, start, end),
        and each value's weight: the sampling period of its series, the GPU time one
        sample stands for. A GPU sampled every 100 ms beside one sampled every 10 ms then
        weighs by its compute time, not by how often its sampler reads it. A series of
        one sample has no period: it gets the median period of the others (1 s if none).
        """
        by_gpu: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
        for host, gpu, s, e in intervals:
            by_gpu[(host, gpu)].append((s, e))
        values: list[np.ndarray] = []
        periods: list[float] = []
        for (host, gpu), spans in by_gpu.items():
            if host and not is_device_uuid(gpu):
                # A short id joins on its host (or samples naming none): two lookups.
                keys: Iterable[Key] = [
                    k for k in ((host, gpu, metric), ("", gpu, metric)) if k in self._data]
            else:  # a device UUID, or a span naming no host: that GPU on any host
                keys = self._by_gpu.get((gpu, metric), ())
            for key in keys:
                t, v, period = self._arrays(key)
                iv = np.asarray(spans)
                lo = np.searchsorted(t, iv[:, 0], side="right")
                # max(): an empty interval must not cancel another one's count.
                hi = np.maximum(np.searchsorted(t, iv[:, 1] + period, side="left"), lo)
                diff = np.zeros(t.size + 1, dtype=np.int64)
                np.add.at(diff, lo, 1)
                np.add.at(diff, hi, -1)
                mask = np.cumsum(diff[:-1]) > 0
                values.append(v[mask])
                periods.append(period)
        if not values:
            return np.empty(0), np.empty(0)
        known = [p for p in periods if p > 0]
        fallback = float(np.median(known)) if known else 1.0
        weights = [
            np.full(vals.size, p if p > 0 else fallback)
            for vals, p in zip(values, periods, strict=False)
        ]
        return np.concatenate(values), np.concatenate(weights)


__all__ = [
    "DROP_REASONS", "MAX_FUTURE_S", "MAX_METRICS_PER_GPU", "MAX_SAMPLES_PER_SERIES",
    "GpuSamples",
]
