"""Tail-biased trace sampling for ``production`` mode, with unbiased weights.

Every request is timed; at its end the trace is kept with probability 1 when its latency is
at or above a running estimate of the ``tail_quantile`` of recent latencies (per request
name and model), else with probability ``sample_rate``. The kept request span carries
``inferprof.sample.weight = 1 / probability``, so weighted counts, quantiles and shares
computed by the collector stay unbiased whatever the estimate's error: a wrong threshold
costs only efficiency (more or fewer traces kept), never correctness.

The coin for the ``sample_rate`` part is flipped when the request *starts* (the "head"
decision), so services downstream see ``sampled=1`` in ``traceparent`` exactly for the
requests kept regardless of latency and those traces are complete end to end; tail-kept
traces are complete within this service.

The estimate is the empirical quantile of a ring buffer of the last ``window`` latencies,
recomputed every ``refresh`` requests (numpy partition, about 20 µs per refresh of 2048
values — well under 1 µs per request amortised). Until ``warmup`` latencies have been seen
every trace is kept (weight 1).
"""

from __future__ import annotations

import threading

import numpy as np

_DEFAULT_WINDOW = 2048
_DEFAULT_REFRESH = 64
_DEFAULT_WARMUP = 64
#: Distinct (name, model) keys with their own threshold (16 KiB each); later keys share one.
_MAX_KEYS = 256
_OVERFLOW_KEY = ("<overflow>",)


class _Window:
    __slots__ = ("buf", "n", "threshold")

    def __init__(self, size: int) -> None:
        self.buf = np.zeros(size, dtype=np.int64)
        self.n = 0
        self.threshold: int | None = None


class TailSampler:
    """Decides, at request end, whether to keep a trace and with which weight."""

    def __init__(
        self,
        sample_rate: float,
        tail_quantile: float,
        *,
        window: int = _DEFAULT_WINDOW,
        refresh: int = _DEFAULT_REFRESH,
        warmup: int = _DEFAULT_WARMUP,
    ) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if not 0.0 < tail_quantile <= 1.0:
            raise ValueError(f"tail_quantile must be in (0, 1], got {tail_quantile!r}")
        if window < 1 or refresh < 1 or warmup < 1:
            raise ValueError("window, refresh and warmup must be >= 1")
        self.sample_rate = sample_rate
        self.tail_quantile = tail_quantile
        self._window = window
        self._refresh = refresh
        self._warmup = min(warmup, window)
        self._fast_weight = 1.0 / sample_rate
        self._windows: dict[object, _Window] = {}
        self._lock = threading.Lock()

    def threshold(self, key: object = None) -> int | None:
        """Current latency threshold (ns) for ``key``; None while warming up."""
        w = self._windows.get(key)
        return w.threshold if w is not None else None

    def decide(self, latency_ns: int, head: bool, key: object = None) -> float | None:
        """Weight to record if the trace is kept, or None to discard it.

        ``head`` is the request's own coin flip with probability ``sample_rate``. The
        threshold used comes from earlier requests only, so the keep probability of this
        one is exactly 1 (slow) or ``sample_rate`` (fast).
        """
        with self._lock:
            w = self._windows.get(key)
            if w is None:
                if len(self._windows) >= _MAX_KEYS:
                    key = _OVERFLOW_KEY  # unbounded names must not grow memory
                    w = self._windows.get(key)
                if w is None:
                    w = self._windows[key] = _Window(self._window)
            threshold = w.threshold
            w.buf[w.n % self._window] = latency_ns
            w.n += 1
            if w.n >= self._warmup and (w.n % self._refresh == 0 or threshold is None):
                filled = w.buf[: min(w.n, self._window)]
                k = min(int(self.tail_quantile * len(filled)), len(filled) - 1)
                w.threshold = int(np.partition(filled, k)[k])
        if threshold is None or latency_ns >= threshold:
            return 1.0
        return self._fast_weight if head else None


__all__ = ["TailSampler"]
