"""Tail-biased trace sampling for ``production`` mode, with unbiased weights.

Every timed request (all of them, up to :class:`TimingBudget`'s rate per route) is kept, at
its end, with probability 1 when its latency is at or above a running estimate of the
``tail_quantile`` of recent latencies (per request name and model), else with probability
``sample_rate``.

Overload guard: the estimate lags when latency climbs (a queue building up under
overload), and then nearly every request is "slow" — keeping them all would spend the
most telemetry CPU exactly when the service has none to spare (measured on the demo: the
kept fraction went from 15% to 34% and tipped an 80%-loaded service into overload). So when
more than ``_TAIL_BUDGET`` x (1 - ``tail_quantile``) of the last ``_GUARD_PERIODS`` x
``refresh`` requests were slow (long enough that chance alone never trips it: with the
defaults, 2x the expected share over 256 requests is a 5-sigma event), slow requests are kept
with the probability that brings the rate back to that
budget (never below ``sample_rate``; head-sampled ones always), and carry its inverse as
weight. The probability is fixed before the request it applies to, so weights stay exact. The
kept request span carries
``inferprof.sample.weight = 1 / probability``, so weighted counts, quantiles and shares
computed by the collector stay unbiased whatever the estimate's error: a wrong threshold
costs only efficiency (more or fewer traces kept), never correctness.

The coin for the ``sample_rate`` part is flipped when the request *starts* (the "head"
decision), so services downstream see ``sampled=1`` in ``traceparent`` exactly for the
requests kept regardless of latency and those traces are complete end to end; tail-kept
traces are complete within this service.

The estimate is the empirical quantile of a ring buffer of the last ``window`` latencies,
recomputed every ``refresh`` requests (numpy partition, about 20 µs per refresh of 2048
values — well under 1 µs per request amortised). The ring buffer is an ``array.array``,
which numpy reads without a copy: storing one latency into it costs a plain index store,
where a numpy item store cost a conversion per request. Until ``warmup`` latencies have been seen
every trace is kept (weight 1).
"""

from __future__ import annotations

import array
import math
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

_DEFAULT_WINDOW = 2048
_DEFAULT_REFRESH = 64
_DEFAULT_WARMUP = 64
#: Slow requests kept at full rate up to this multiple of their expected share.
_TAIL_BUDGET = 2.0
#: Refresh periods the slow share is measured over.
_GUARD_PERIODS = 4
#: Distinct (name, model) keys with their own threshold (16 KiB each); later keys share one.
_MAX_KEYS = 256
_OVERFLOW_KEY = ("<overflow>",)


#: Samplers and budgets whose lock a forked child must not inherit held (a thread of the
#: parent's inside ``decide()`` or ``_roll()`` at the fork would leave it held for ever).
_LOCKED: weakref.WeakSet[Any] = weakref.WeakSet()


def _fresh_locks_after_fork() -> None:
    for obj in list(_LOCKED):
        obj._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_after_fork)


class _Window:
    __slots__ = ("buf", "due", "n", "recent_slow", "slow", "tail_p", "threshold")

    def __init__(self, size: int, warmup: int) -> None:
        self.buf = array.array("q", bytes(8 * size))
        self.n = 0
        #: the count of latencies at which the threshold is next recomputed: the warm-up's
        #: end, then every multiple of ``refresh``
        self.due = warmup
        self.threshold: int | None = None
        self.slow = 0  # slow requests in the current refresh period
        self.recent_slow: list[int] = []  # ... in the previous _GUARD_PERIODS periods
        self.tail_p = 1.0  # keep probability of a slow request, from the previous period


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
        self._tail_budget = _TAIL_BUDGET * (1.0 - tail_quantile)
        self._windows: dict[object, _Window] = {}
        self._lock = threading.Lock()
        _LOCKED.add(self)

    def threshold(self, key: object = None) -> int | None:
        """Current latency threshold (ns) for ``key``; None while warming up."""
        w = self._windows.get(key)
        return w.threshold if w is not None else None

    def _new_window(self, key: object) -> _Window:
        w = None
        if len(self._windows) >= _MAX_KEYS:
            key = _OVERFLOW_KEY  # unbounded names must not grow memory
            w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = _Window(self._window, self._warmup)
        return w

    def decide(self, latency_ns: int, head: bool, key: object = None) -> float | None:
        """Weight to record if the trace is kept, or None to discard it.

        ``head`` is the request's own coin flip with probability ``sample_rate``. The
        threshold used comes from earlier requests only, so the keep probability of this
        one is exactly 1 (slow) or ``sample_rate`` (fast).
        """
        with self._lock:
            w = self._windows.get(key)
            if w is None:
                w = self._new_window(key)
            n = w.n
            w.buf[n % self._window] = latency_ns
            w.n = n = n + 1
            threshold = w.threshold
            if threshold is not None and latency_ns < threshold and n != w.due:
                return self._fast_weight if head else None  # the usual case: fast
            tail_p = w.tail_p
            slow = threshold is None or latency_ns >= threshold
            if slow and threshold is not None:
                w.slow += 1
            if n == w.due:
                self._refresh_window(w, n)
        if slow:
            if tail_p >= 1.0 or threshold is None:
                return 1.0
            # Overload guard (module docstring): keep with probability p = max(tail_p,
            # sample_rate), head-sampled requests always: P(head or extra coin) = p.
            rate = self.sample_rate
            if tail_p <= rate:
                return self._fast_weight if head else None
            if head or random.random() < (tail_p - rate) / (1.0 - rate):
                return 1.0 / tail_p
            return None
        return self._fast_weight if head else None

    def _refresh_window(self, w: _Window, n: int) -> None:
        """The ``n``-th latency of ``w`` is in: a new threshold and guard probability, for
        the requests that follow (the lock held)."""
        filled = np.frombuffer(w.buf, dtype=np.int64)[: min(n, self._window)]
        k = min(int(self.tail_quantile * len(filled)), len(filled) - 1)
        w.threshold = int(np.partition(filled, k)[k])
        w.due = n - n % self._refresh + self._refresh  # the next multiple of refresh
        recent = w.recent_slow
        recent.append(w.slow)
        if len(recent) > _GUARD_PERIODS:
            del recent[0]
        w.slow = 0
        share = sum(recent) / (len(recent) * self._refresh)
        if len(recent) < _GUARD_PERIODS or share <= self._tail_budget:
            w.tail_p = 1.0
        else:
            w.tail_p = self._tail_budget / share


#: Seconds over which a key's request rate is counted for :class:`TimingBudget`. Short, so
#: that its share follows a change of rate within a tenth of a second, not a second (and
#: within the period, its cap bounds what a burst is timed at).
_BUDGET_PERIOD_S = 0.1
#: Keys (paths, request names) counted on their own per period; later keys are counted
#: with the rare ones (:class:`TimingBudget`), so memory stays bounded.
_BUDGET_MAX_KEYS = 64
#: The budget of the keys seen once in a period (paths with ids in them, rare routes).
_RARE_KEY = ("<rare>",)


def _period_cap(rate: float) -> float:
    """Requests of a key a period times in full, at ``rate`` a second (at least one: a
    route under its budget, sparse traffic included, is timed in full whatever the rate)."""
    return max(1.0, rate * _BUDGET_PERIOD_S)


def _power_of_two_below(share: float) -> float:
    """The largest power of two at most ``share`` (0 < share < 1)."""
    _, exponent = math.frexp(share)
    return math.ldexp(1.0, exponent - 1)


#: CPU seconds a timed request costs the process, for :class:`TimingBudget`'s CPU guard:
#: its records, summary and share of kept traces on an event loop that shares its core
#: with the model (docs/overhead.md, "The timing budget"), rounded up.
TIMED_REQUEST_CPU_S = 60e-6
#: The guard's share never falls below this (a process whose CPU per request is tiny
#: still times some of them).
_MIN_GUARD_SHARE = 2.0 ** -10


def cpu_guard_share(cpu_s: float, requests: int, max_cpu: float,
                    cost_s: float = TIMED_REQUEST_CPU_S) -> float:
    """The share of requests to time so that timing them costs at most ``max_cpu`` of the
    process's CPU, from the CPU it spent (``cpu_s``) on ``requests`` requests: 1 when a
    request's CPU is large enough, else that share rounded down to a power of two."""
    if requests <= 0 or cpu_s <= 0:
        return 1.0
    share = max_cpu * cpu_s / (cost_s * requests)
    if share >= 1.0:
        return 1.0
    return _power_of_two_below(max(share, _MIN_GUARD_SHARE))


class TimingBudget:
    """Caps the requests ``production`` mode times at ``rate`` per second per key (the
    HTTP path, or an ``inferprof.request()``'s name and model): above it, each request is
    timed with probability ``rate / (the key's requests per second)`` rounded down to a
    power of two, counted over the previous tenth of a second, and within the current
    tenth, once the key's requests in it pass its budget for a tenth (``rate`` x 0.1), at
    most that budget over their count so far (so the first tenth after an idle
    spell and bursts above the last tenth's rate are not timed in full). (Powers of two: the
    weights ``1 / probability`` then take few distinct values, and the summaries split
    their data points by weight, contract §15.) A request not timed costs about what
    ``off`` costs; a timed one carries the inverse of that probability in its weight, so
    weighted figures stay unbiased. The probability comes from earlier requests only, so it
    is exact for the request it is drawn for, whatever the counts' races between threads.

    Keys seen once in a period (a path with an id in it makes a key per request; a route
    at a few requests a second) share one budget, as do keys beyond the first
    ``_BUDGET_MAX_KEYS`` of a period: a service whose paths carry ids is capped like one
    with a single route. So the telemetry CPU is bounded in absolute terms: a process
    serving 2,000 requests a second on one route times ``rate`` of them, not 2,000
    (docs/overhead.md, "The timing budget").

    The CPU guard (``max_cpu``) caps what timing costs relative to what the process
    spends: at each period's end the process's CPU time over the period, divided by the
    requests of every key, gives the CPU per request, and the share timed in the next
    period is the one at which ``TIMED_REQUEST_CPU_S`` per timed request stays within
    ``max_cpu`` of it (:func:`cpu_guard_share`: 1 for a service whose requests cost
    milliseconds, a power of two below 1 for one whose requests cost as little as their
    timing). With both caps a request is timed with the smaller share. ``rate`` None:
    the guard alone.

    Keys marked :meth:`summarised` (a route whose untimed requests are summarised with
    their stage times: the summaries hold all its requests, timed or not, so timing only
    feeds its traces) are capped at ``summarised_rate`` instead, when it is set and below
    ``rate``. At most ``_BUDGET_MAX_KEYS`` keys are marked; others keep ``rate``.
    """

    __slots__ = ("__weakref__", "_cap", "_clock", "_counts", "_cpu_clock", "_cpu_start",
                 "_default", "_guard", "_lock", "_low_cap", "_low_keys", "_period_end",
                 "_period_start", "_shares", "_summarised_keys", "max_cpu", "rate",
                 "summarised_rate")

    def __init__(
        self,
        rate: float | None,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_cpu: float | None = None,
        cpu_clock: Callable[[], float] = time.process_time,
        summarised_rate: float | None = None,
    ) -> None:
        if rate is not None and not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate!r}")
        if max_cpu is not None and not 0 < max_cpu <= 1:
            raise ValueError(f"max_cpu must be in (0, 1], got {max_cpu!r}")
        if rate is None and max_cpu is None:
            raise ValueError("a timing budget needs a rate, a CPU share or both")
        if summarised_rate is not None and not summarised_rate > 0:
            raise ValueError(f"summarised_rate must be > 0, got {summarised_rate!r}")
        #: requests timed per second per key; None: no such cap
        self.rate = float(rate) if rate is not None else None
        #: share of the process's CPU that timing may cost; None: no such cap
        self.max_cpu = max_cpu
        #: the CPU guard's share for every key (1: every request), from the last period
        self._guard = 1.0
        self._cpu_clock = cpu_clock
        self._cpu_start = cpu_clock()
        #: requests per key in the current period
        self._counts: dict[object, int] = {}
        #: share timed per key seen more than once in the previous period
        self._shares: dict[object, float] = {}
        #: requests timed per second for the keys marked summarised; None: ``rate``
        self.summarised_rate = float(summarised_rate) if summarised_rate is not None else None
        self._summarised_keys: set[object] = set()
        #: share timed for any other key: the rare keys' budget over their requests
        self._default = 1.0
        #: requests of a key timed in full per period (``rate`` over a period; none: inf),
        #: the same for the keys marked summarised (``_low_keys``, from the last period)
        self._cap = self._low_cap = (
            _period_cap(self.rate) if self.rate is not None else math.inf)
        self._low_keys: Any = ()
        self._clock = clock
        now = clock()
        self._period_start = now
        self._period_end = now + _BUDGET_PERIOD_S
        self._lock = threading.Lock()
        _LOCKED.add(self)

    def share(self, key: object) -> float:
        """Probability with which this request of ``key`` is to be timed (1: always).
        Never raises: on any error the request is timed (weight unchanged)."""
        try:
            now = self._clock()
            if now >= self._period_end:
                self._roll(now)
            counts = self._counts
            n = counts.get(key)
            if n is not None:
                n += 1
                counts[key] = n
            elif len(counts) < _BUDGET_MAX_KEYS:
                counts[key] = n = 1
            else:  # unbounded keys must not grow memory: counted with the rare ones
                n = counts[_RARE_KEY] = counts.get(_RARE_KEY, 0) + 1
                share = self._default
                if share * n > self._cap:  # past the period's budget (below)
                    share = _power_of_two_below(self._cap / n)
                return min(share, self._guard)
            share = self._shares.get(key, self._default)
            # Past the key's budget for this period (a burst, the first period after an
            # idle spell): at most that budget over the count so far, known before the
            # draw, so the weight stays exact; a period then times about
            # cap x (1 + log2(n / cap) / 2) in expectation. (The smaller cap first: one
            # comparison for most requests.)
            if share * n > self._low_cap:
                cap = self._low_cap if key in self._low_keys else self._cap
                if share * n > cap:
                    share = _power_of_two_below(cap / n)
            # both powers of two: the smaller is the probability of either cap's draw
            return share if share <= self._guard else self._guard
        except Exception:  # telemetry never fails a request
            return 1.0

    def summarised(self, key: object, on: bool) -> None:
        """Mark ``key`` as a route whose untimed requests are summarised with their stages
        (``on``), capped at ``summarised_rate`` from the next period, or unmark it."""
        keys = self._summarised_keys
        if on:
            if key not in keys and len(keys) < _BUDGET_MAX_KEYS:
                keys.add(key)
        else:
            keys.discard(key)

    def _roll(self, now: float) -> None:
        with self._lock:
            if now < self._period_end:  # another thread rolled it
                return
            # Swapped first, then copied in one C-level step: threads still counting into
            # the old dict cannot change it under the loop below.
            counts, self._counts = self._counts, {}
            counts = counts.copy()
            if self.max_cpu is not None:
                cpu = self._cpu_clock()
                self._guard = cpu_guard_share(cpu - self._cpu_start, sum(counts.values()),
                                              self.max_cpu)
                self._cpu_start = cpu
            if self.rate is None:
                self._period_start = now
                self._period_end = now + _BUDGET_PERIOD_S
                return
            # The period ends at the first request after its end: after an idle spell it
            # is longer than one, and the rate is the mean over it.
            budget = self.rate * (now - self._period_start)
            rare = counts.pop(_RARE_KEY, 0)
            own = {}
            for key, n in counts.items():
                if n > 1:
                    own[key] = n
                else:
                    rare += 1
            default = _power_of_two_below(budget / rare) if rare > budget else 1.0
            # Keys over their budget get their share; under it, 1 (stored only when the
            # default, for the keys absent, is less).
            shares = {}
            low = self.summarised_rate
            marked: Any = ()
            low_budget = budget
            self._low_cap = self._cap
            if low is not None and low < self.rate and self._summarised_keys:
                marked = self._summarised_keys
                low_budget = low * (now - self._period_start)
                self._low_cap = _period_cap(low)
            self._low_keys = frozenset(marked)
            for key, n in own.items():
                b = low_budget if key in marked else budget
                if n > b:
                    shares[key] = _power_of_two_below(b / n)
                elif default < 1.0:
                    shares[key] = 1.0
            self._default = default
            self._shares = shares
            self._period_start = now
            self._period_end = now + _BUDGET_PERIOD_S


__all__ = ["TIMED_REQUEST_CPU_S", "TailSampler", "TimingBudget", "cpu_guard_share"]
