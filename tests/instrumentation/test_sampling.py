import random

import numpy as np
import pytest

import inferprof
from inferprof import semconv
from inferprof.instrumentation.sampling import TailSampler


@pytest.mark.parametrize("dist", ["lognormal", "bimodal", "uniform"])
def test_weighted_count_of_kept_requests_estimates_the_true_count(dist):
    rng = np.random.default_rng(7)
    random.seed(7)
    n = 20000
    if dist == "lognormal":
        lat = rng.lognormal(mean=16, sigma=0.8, size=n)
    elif dist == "bimodal":
        lat = np.where(rng.random(n) < 0.9, rng.normal(5e6, 5e5, n), rng.normal(5e7, 5e6, n))
    else:
        lat = rng.uniform(1e6, 2e6, n)
    sampler = TailSampler(sample_rate=0.1, tail_quantile=0.9)
    kept_weight, kept, slow_total, slow_kept = 0.0, 0, 0, 0
    p90 = np.quantile(lat, 0.9)
    for x in lat.astype(np.int64):
        w = sampler.decide(int(x), random.random() < 0.1)
        if w is not None:
            kept += 1
            kept_weight += w
        if x >= p90 * 1.05:
            slow_total += 1
            slow_kept += w is not None
    assert abs(kept_weight - n) / n < 0.05  # unbiased (sd ~ 2%)
    assert kept < 0.3 * n  # and actually sampling
    assert slow_kept / slow_total > 0.97  # the tail is kept (all but warm-up noise)


def test_weights_are_exactly_one_or_inverse_rate():
    sampler = TailSampler(sample_rate=0.25, tail_quantile=0.5, warmup=4, refresh=1)
    for x in (10, 20, 30, 40):
        assert sampler.decide(x, head=False) == 1.0  # warm-up keeps everything
    assert sampler.decide(1000, head=False) == 1.0  # slow: always
    assert sampler.decide(1, head=False) is None  # fast, coin says no
    assert sampler.decide(1, head=True) == 4.0  # fast, coin says yes


def test_thresholds_are_per_key():
    sampler = TailSampler(sample_rate=0.5, tail_quantile=0.9, warmup=8, refresh=1)
    for _ in range(16):
        sampler.decide(1_000, False, key="fast-model")
        sampler.decide(1_000_000, False, key="slow-model")
    assert sampler.threshold("fast-model") == 1_000
    assert sampler.threshold("slow-model") == 1_000_000
    assert sampler.threshold("other") is None


@pytest.mark.parametrize("kwargs", [{"sample_rate": 0}, {"sample_rate": 1.1}, {"tail_quantile": 0}])
def test_bad_sampler_arguments(kwargs):
    args = {"sample_rate": 0.1, "tail_quantile": 0.9, **kwargs}
    with pytest.raises(ValueError):
        TailSampler(**args)


def test_production_mode_end_to_end_weights_and_tail(cap):
    inferprof.configure(
        tracer_provider=cap.provider, mode="production", sample_rate=0.2, tail_quantile=0.9,
        max_timed_rate=0,  # every request timed: the tail sampler alone decides
    )
    random.seed(11)
    rng = np.random.default_rng(11)
    n = 3000
    latencies = rng.lognormal(mean=15, sigma=1.0, size=n).astype(np.int64)
    for i, lat in enumerate(latencies):
        with inferprof.request(model="m", i=i) as req:
            with inferprof.stage("compute"):
                pass
            req.start -= int(lat)  # synthetic latency, as if the request had taken `lat` ns
    requests = cap.requests()
    weights = [r.attributes.get(semconv.ATTR_SAMPLE_WEIGHT, 1.0) for r in requests]
    assert set(weights) <= {1.0, 5.0}
    assert abs(sum(weights) - n) / n < 0.1
    assert len(requests) < 0.45 * n
    # every kept request has its stages; no orphan stage spans from discarded ones
    assert len(cap.stages("compute")) == len(requests)
    kept = {r.attributes["i"] for r in requests}
    slowest = np.argsort(latencies)[-int(0.05 * n) :]
    assert all(int(i) in kept for i in slowest if i >= 100)  # past warm-up, the tail is kept
    snap = inferprof.instrumentation.stats()
    assert snap.traces_kept == len(requests)
    assert snap.traces_kept + snap.traces_discarded == n


def test_production_mode_head_decision_sets_traceparent_sampled_flag(cap):
    inferprof.configure(tracer_provider=cap.provider, mode="production", sample_rate=0.5,
                        max_timed_rate=0)
    flags = []
    for _ in range(400):
        with inferprof.request() as req:
            flags.append(req.span_context.trace_flags.sampled)
    assert 100 < sum(flags) < 300


def test_number_of_threshold_windows_is_bounded():
    from inferprof.instrumentation import sampling

    sampler = TailSampler(sample_rate=0.5, tail_quantile=0.9, window=8, warmup=2)
    for i in range(sampling._MAX_KEYS + 50):
        sampler.decide(1000, False, key=f"route-{i}")
    assert len(sampler._windows) == sampling._MAX_KEYS + 1


def test_overload_guard_bounds_the_kept_fraction_and_keeps_weights_unbiased():
    # Latency climbing steadily (a queue building up): each request is slower than the
    # lagging p90 estimate, so without the guard every trace would be kept.
    random.seed(3)
    n = 20000
    sampler = TailSampler(sample_rate=0.05, tail_quantile=0.9)
    kept, weight = 0, 0.0
    for i in range(n):
        head = random.random() < 0.05
        w = sampler.decide(1_000_000 + 1_000 * i, head)
        if w is not None:
            kept += 1
            weight += w
    assert kept < 0.25 * n  # budget: 2 x 10% of requests kept for being slow (+ warm-up)
    assert abs(weight - n) / n < 0.05  # each kept one stands for 1/p requests


def test_overload_guard_keeps_head_sampled_requests():
    sampler = TailSampler(sample_rate=0.05, tail_quantile=0.9, warmup=8, refresh=8)
    for i in range(200):  # climbing: trips the guard
        sampler.decide(1_000 + i, head=False)
    assert any(w.tail_p < 1.0 for w in sampler._windows.values())  # the guard is on
    # A slow request whose head coin said "sampled" (downstream saw sampled=1) is kept.
    assert all(sampler.decide(10_000 + i, head=True) is not None for i in range(50))


def test_steady_latencies_never_trip_the_overload_guard():
    rng = np.random.default_rng(5)
    sampler = TailSampler(sample_rate=0.05, tail_quantile=0.9)
    weights = {sampler.decide(int(x), random.random() < 0.05)
               for x in rng.lognormal(15, 1.0, 30000)}
    assert weights <= {None, 1.0, 20.0}


class _Reference:
    """The sampler's rule (module docstring) written out plainly, one key: what decide()
    must return, call for call."""

    def __init__(self, sample_rate, tail_quantile, window, refresh, warmup):
        self.rate, self.q = sample_rate, tail_quantile
        self.window, self.refresh, self.warmup = window, refresh, min(warmup, window)
        self.latencies: list[int] = []
        self.threshold = None
        self.slow = 0
        self.recent: list[int] = []
        self.tail_p = 1.0

    def decide(self, latency, head):
        threshold, tail_p = self.threshold, self.tail_p
        self.latencies.append(latency)
        n = len(self.latencies)
        if threshold is None:
            slow, refresh = True, n >= self.warmup
        else:
            slow = latency >= threshold
            self.slow += slow
            refresh = n % self.refresh == 0
        if refresh:
            last = sorted(self.latencies[-self.window:])
            self.threshold = last[min(int(self.q * len(last)), len(last) - 1)]
            self.recent = [*self.recent, self.slow][-4:]
            self.slow = 0
            share = sum(self.recent) / (len(self.recent) * self.refresh)
            budget = 2.0 * (1.0 - self.q)
            self.tail_p = 1.0 if len(self.recent) < 4 or share <= budget else budget / share
        if slow:
            if tail_p >= 1.0 or threshold is None:
                return 1.0
            if tail_p <= self.rate:
                return 1.0 / self.rate if head else None
            if head or random.random() < (tail_p - self.rate) / (1.0 - self.rate):
                return 1.0 / tail_p
            return None
        return 1.0 / self.rate if head else None


@pytest.mark.parametrize("window,refresh,warmup", [(64, 8, 8), (50, 7, 10), (16, 4, 30)])
def test_decisions_are_those_of_the_rule_call_for_call(window, refresh, warmup):
    # Steady latencies, then a climb that trips the overload guard, then steady again;
    # the guard's coin drawn from the same seed on both sides.
    rng = np.random.default_rng(11)
    steady = rng.lognormal(12, 0.5, 600).astype(int)
    climb = (200_000 + 2_000 * np.arange(600)).astype(int)
    latencies = [int(x) for x in (*steady, *climb, *steady)]
    heads = rng.random(len(latencies)) < 0.1
    sampler = TailSampler(0.1, 0.9, window=window, refresh=refresh, warmup=warmup)
    reference = _Reference(0.1, 0.9, window, refresh, warmup)
    got, want = [], []
    for i, (latency, head) in enumerate(zip(latencies, heads, strict=True)):
        random.seed(i)
        got.append(sampler.decide(latency, bool(head), key="k"))
        random.seed(i)
        want.append(reference.decide(latency, bool(head)))
        assert sampler.threshold("k") == reference.threshold, i
    assert got == want
    weights = set(got)
    assert {None, 1.0, 10.0} < weights  # every branch taken, the guard's weights too
