"""Error that production mode's tail-biased trace sampling adds to the collector's figures.

    python3 benchmarks/sampling_error.py          # 2 scenarios x 5 seeds x 30,000 requests, ~1 min
    python3 benchmarks/sampling_error.py --quick  # 8,000 requests x 3 seeds, ~10 s

What it measures. A SYNTHETIC dynamic-batching service (receive, tokenize, queue,
batch_assembly, h2d, compute, d2h, postprocess, serialize; one GPU worker, batches closed
when full or ``max_wait`` after the first member) is simulated request by request, in two
scenarios, each with a load step half-way through:

* ``queue-bound``: bursty arrivals (short bursts above the GPU's capacity); the tail is
  pre-batch queuing, and the step makes it worse;
* ``compute-bound``: a bimodal prompt-length mix (a few long prompts pad their whole
  batch); the tail is compute, with queuing behind long batches second.

For each (scenario, seed) the script

1. folds every request (weight 1) through a real ``Engine`` — the *truth*;
2. for each sampler setting, runs the real ``TailSampler`` over the requests in the order
   they end (its threshold is a running estimate, so order matters: after the load step it
   lags), with the head coin flipped per request, and folds only the kept traces, with
   ``inferprof.sample.weight`` on the request span as the runtime writes it, through a
   fresh ``Engine``;
3. compares the sampled breakdown with the truth: relative error of end-to-end p50/p95/p99,
   the largest relative error of a stage's p95, the largest absolute error of a stage's
   ``share_of_p95`` (percentage points) and whether the verdict is the same.

The ``all kept`` row of each scenario is the sketch's own error: the truth against the
exact figures of the same data (``sketch.exact_weighted_quantile``, exact tail shares),
its verdict taken by ``verdict.decide`` from the exact shares. Sampling rows are measured
against the truth, so the two errors are separated.

Spans use the default ``children`` batch encoding (each member request carries its own
copy of the batch stages). GPU utilisation samples (the busy fraction of each 100 ms) are
sent in full to every engine: metrics are not sampled. Head coins use common random
numbers across settings (a request head-kept at 1% is head-kept at 5%); the overload
guard's extra coin comes from ``random``, seeded per run. Every figure is reproducible
from ``--seed``.

The rows "N% of requests timed" add production mode's timing budget (``max_timed_rate``)
to the default sampler: a route serving 4x or 10x its budget has that share of its
requests timed, at random (coins of their own); the sampler sees those alone and a kept
trace's weight is divided by the share. Their "tail kept, at weight 1" column counts the
slow requests kept at the weight of a timed slow request (1 / the share).

The production rows (``--production-only`` for them alone) simulate one replica's
``--window`` seconds (default 60) of each scenario under production mode's defaults: the
real ``TimingBudget`` at the default ``max_timed_rate`` (and with every request timed),
the default sampler over the timed requests. A real ``Engine`` reads them: from the
kept traces alone, as before summaries, and from the summaries of every timed request
(contract §15, built by the producer's own accumulator ``instrumentation.summaries`` and
encoded by the SDK's OTLP encoder) plus the same traces, marked
``inferprof.summary.counted``; under a budget, a third time from the same summaries, traces
and every untimed request counted (``inferprof.summary.request.untimed``, the timed ones
marked ``inferprof.summary.untimed_counted``, as the middleware does on a counted route
with ``untimed_stages=False``), and a fourth time as the middleware does by default
(``untimed_stages``): every request summarised with its stages at weight 1, untimed
or not, plus the traces of the share timed at ``max_timed_rate_summarised`` (what the
middleware times on such a route; its "timed" and "traces kept" columns are those).
Each against the exact figures of every request in the window:
request count, e2e p95, worst stage p95, worst ``share_of_p95`` and the verdict (taken from
the exact shares with the document's GPU and queue evidence).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.resources import Resource as SdkResource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferprof import semconv as sc
from inferprof._config import (
    DEFAULT_MAX_TIMED_RATE,
    DEFAULT_MAX_TIMED_RATE_SUMMARISED,
    DEFAULT_SAMPLE_RATE,
    DEFAULT_TAIL_QUANTILE,
)
from inferprof.collector.engine import Engine
from inferprof.collector.sketch import exact_weighted_quantile
from inferprof.collector.verdict import decide
from inferprof.instrumentation.accounting import Stats
from inferprof.instrumentation.sampling import TailSampler, TimingBudget
from inferprof.instrumentation.summaries import Summaries
from tests.collector.synth import (
    BASE_UNIX,
    SERVER,
    FakeClock,
    TraceBuilder,
    attributes,
    gpu_metrics,
)

SERVICE = "synthetic"
MODEL = "m"
REQUEST_NAME = "POST /infer"
GPU_ID = "GPU-0"
#: Stages of every request, in serving-path order: stage k covers [bounds[k], bounds[k+1]].
STAGES = (
    sc.STAGE_RECEIVE,
    sc.STAGE_TOKENIZE,
    sc.STAGE_QUEUE,
    sc.STAGE_BATCH_ASSEMBLY,
    sc.STAGE_H2D,
    sc.STAGE_COMPUTE,
    sc.STAGE_D2H,
    sc.STAGE_POSTPROCESS,
    sc.STAGE_SERIALIZE,
)
GPU_SAMPLE_PERIOD_S = 0.1
DEFAULT_SETTING = (DEFAULT_SAMPLE_RATE, DEFAULT_TAIL_QUANTILE)
_GRID = (
    (0.01, 0.9),
    (0.02, 0.9),
    (0.05, 0.9),
    (0.01, 0.95),
    (0.02, 0.95),
    (0.05, 0.95),
    (0.02, 0.99),
)
#: The default sampler behind production mode's timing budget (``max_timed_rate``): a
#: route serving 4x and 10x the budget has a quarter and a tenth of its requests timed,
#: at random; the sampler sees only those, and their weights carry the inverse share.
_TIMED = ((*DEFAULT_SETTING, 0.25), (*DEFAULT_SETTING, 0.1))
#: (sample_rate, tail_quantile[, share of requests timed]) measured; the runtime's default
#: always among them.
SETTINGS = (*(_GRID if DEFAULT_SETTING in _GRID else (*_GRID, DEFAULT_SETTING)), *_TIMED)
#: Requests per OTLP export fed to the engines.
EXPORT_REQUESTS = 2000


# --- the synthetic service ---------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    rate: float  # arrivals/s before the step
    step: float  # rate multiplier for the second half of the requests
    burst: float  # rate multiplier during bursts (1: no bursts)
    calm_s: float  # mean calm period between bursts
    burst_s: float  # mean burst length
    long_share: float  # share of long prompts
    short_tokens: float  # median prompt length, short and long
    long_tokens: float
    max_batch: int
    max_wait_s: float
    compute_base_s: float  # per batch
    compute_per_token_s: float  # per padded token


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            name="queue-bound",
            description="bursty arrivals (x1.9 bursts, 0.15 s every ~0.6 s), "
            "load step x1.25 half-way; prompts ~96 tokens; batches of <= 16",
            rate=2200.0,
            step=1.25,
            burst=1.9,
            calm_s=0.6,
            burst_s=0.15,
            long_share=0.0,
            short_tokens=96.0,
            long_tokens=96.0,
            max_batch=16,
            max_wait_s=0.002,
            compute_base_s=0.0015,
            compute_per_token_s=0.5e-6,
        ),
        Scenario(
            name="compute-bound",
            description="steady arrivals, load step x1.25 half-way; 8% long prompts "
            "(~1024 tokens, the rest ~64) pad their batch; batches of <= 8",
            rate=300.0,
            step=1.25,
            burst=1.0,
            calm_s=1.0,
            burst_s=0.0,
            long_share=0.08,
            short_tokens=64.0,
            long_tokens=1024.0,
            max_batch=8,
            max_wait_s=0.002,
            compute_base_s=0.001,
            compute_per_token_s=2e-6,
        ),
    )
}


@dataclass(frozen=True)
class Workload:
    """One simulated run, times in integer nanoseconds from ``BASE_UNIX``."""

    bounds: np.ndarray  # (n, len(STAGES) + 1): arrival, stage boundaries, end
    batch: np.ndarray  # (n,) batch number of each request
    batch_size: np.ndarray  # (batches,)
    gpu_samples: list[tuple[float, float]]  # (t seconds, utilisation 0..1)

    @property
    def e2e_ns(self) -> np.ndarray:
        return self.bounds[:, -1] - self.bounds[:, 0]

    @property
    def stage_ns(self) -> np.ndarray:
        return np.diff(self.bounds, axis=1)


def _arrivals(scen: Scenario, n: int, rng: np.random.Generator) -> np.ndarray:
    """Markov-modulated Poisson arrivals (calm / burst), the rate stepped up after n/2."""
    parts: list[np.ndarray] = []
    t = 0.0
    count = 0
    burst = False
    while count < n:
        dur = rng.exponential(scen.burst_s if burst else scen.calm_s) if scen.burst_s else 1.0
        rate = scen.rate * (scen.burst if burst else 1.0) * (scen.step if count >= n // 2 else 1.0)
        k = int(rng.poisson(rate * dur))
        parts.append(t + np.sort(rng.uniform(0.0, dur, k)))
        count += k
        t += dur
        burst = not burst and scen.burst_s > 0
    return np.concatenate(parts)[:n]


def simulate(scen: Scenario, n: int, rng: np.random.Generator) -> Workload:
    arrival = _arrivals(scen, n, rng)
    long = rng.random(n) < scen.long_share
    tokens = np.where(
        long,
        rng.lognormal(math.log(scen.long_tokens), 0.15, n),
        rng.lognormal(math.log(scen.short_tokens), 0.4, n),
    ).clip(4, 4096)
    receive = rng.lognormal(math.log(200e-6), 0.3, n) + tokens * 0.2e-6
    tokenize = (40e-6 + tokens * 1.5e-6) * rng.lognormal(0.0, 0.2, n)
    postprocess = rng.lognormal(math.log(300e-6), 0.4, n)
    serialize = rng.lognormal(math.log(100e-6), 0.5, n)
    ready = arrival + receive + tokenize

    # One GPU worker: take the oldest ready request when free, wait up to max_wait for
    # more, close the batch when full or at the deadline.
    order = np.argsort(ready, kind="stable")
    r = ready[order]
    close = np.empty(n)
    batch_end = np.empty((n, 4))  # end of batch_assembly, h2d, compute, d2h
    batch = np.empty(n, np.int64)
    sizes: list[int] = []
    busy: list[tuple[float, float]] = []
    gpu_free = 0.0
    j = 0
    while j < n:
        t0 = max(gpu_free, r[j])
        deadline = t0 + scen.max_wait_s
        last = min(j + scen.max_batch, int(np.searchsorted(r, deadline, side="right")))
        size = last - j
        shut = max(t0, r[last - 1]) if size == scen.max_batch else deadline
        members = order[j:last]
        padded = size * float(tokens[members].max())
        assembly = 50e-6 + 5e-6 * size
        h2d = 20e-6 + padded * 0.02e-6
        compute = (scen.compute_base_s + padded * scen.compute_per_token_s) * rng.lognormal(0, 0.05)
        d2h = 20e-6 + padded * 0.005e-6
        ends = np.cumsum([assembly, h2d, compute, d2h]) + shut
        busy.append((ends[1], ends[2]))
        close[members] = shut
        batch_end[members] = ends
        batch[members] = len(sizes)
        sizes.append(size)
        gpu_free = float(ends[3])
        j = last
    done = batch_end[:, 3] + postprocess
    bounds_s = np.column_stack(
        [arrival, arrival + receive, ready, close, batch_end, done, done + serialize]
    )
    bounds = np.round(bounds_s * 1e9).astype(np.int64)
    return Workload(bounds, batch, np.asarray(sizes), _gpu_samples(np.asarray(busy)))


def _gpu_samples(busy: np.ndarray) -> list[tuple[float, float]]:
    """Utilisation as NVML reports it: the busy fraction of each sampling period."""
    start, end = busy[:, 0], busy[:, 1]
    done_before = np.concatenate([[0.0], np.cumsum(end - start)])

    def busy_until(t: np.ndarray) -> np.ndarray:  # compute time in [0, t]
        i = np.searchsorted(start, t, side="right") - 1
        ok = i >= 0
        out = np.zeros_like(t)
        out[ok] = done_before[i[ok]] + np.minimum(t[ok] - start[i[ok]], (end - start)[i[ok]])
        return out

    ts = np.arange(GPU_SAMPLE_PERIOD_S, end[-1] + GPU_SAMPLE_PERIOD_S, GPU_SAMPLE_PERIOD_S)
    util = np.diff(busy_until(np.concatenate([[0.0], ts]))) / GPU_SAMPLE_PERIOD_S
    return list(zip(ts.tolist(), util.clip(0.0, 1.0).tolist()))


# --- spans, as inferprof's runtime would emit them ----------------------------------------


class Spans:
    """Each request's spans, built (protobuf) the first time they are asked for and reused
    by every engine."""

    def __init__(self, w: Workload) -> None:
        base = round(BASE_UNIX * 1e9)
        self._w = w
        self._bounds = w.bounds + base
        self._tmpl = {
            stage: trace_pb2.Span(
                name=sc.span_name(stage), attributes=attributes({sc.ATTR_STAGE: stage})
            )
            for stage in STAGES
        }
        self._request_tmpl = trace_pb2.Span(
            name=REQUEST_NAME, kind=SERVER, attributes=attributes({sc.ATTR_MODEL_NAME: MODEL})
        )
        self._batch_attrs: dict[int, list[KeyValue]] = {}
        self._gpu_attr = attributes({sc.ATTR_GPU_ID: GPU_ID})
        self._built: dict[int, tuple[trace_pb2.Span, list[trace_pb2.Span]]] = {}

    def _build(self, i: int) -> tuple[trace_pb2.Span, list[trace_pb2.Span]]:
        built = self._built.get(i)
        if built is not None:
            return built
        w = self._w
        trace_id = (i + 1).to_bytes(16, "big")
        req_id = ((i + 1) << 4).to_bytes(8, "big")
        b = self._bounds[i].tolist()
        req = trace_pb2.Span()
        req.CopyFrom(self._request_tmpl)
        req.trace_id, req.span_id = trace_id, req_id
        req.start_time_unix_nano, req.end_time_unix_nano = b[0], b[-1]
        batch = int(w.batch[i])
        batch_attrs = self._batch_attrs.get(batch)
        if batch_attrs is None:
            batch_attrs = self._batch_attrs[batch] = attributes(
                {sc.ATTR_BATCH_ID: f"b{batch}", sc.ATTR_BATCH_SIZE: int(w.batch_size[batch])})
        children = []
        for k, stage in enumerate(STAGES):
            s = trace_pb2.Span()
            s.CopyFrom(self._tmpl[stage])
            s.trace_id, s.parent_span_id = trace_id, req_id
            s.span_id = (((i + 1) << 4) + k + 1).to_bytes(8, "big")
            s.start_time_unix_nano, s.end_time_unix_nano = b[k], b[k + 1]
            if stage in sc.BATCH_STAGES:
                s.attributes.extend(batch_attrs)
                if stage == sc.STAGE_COMPUTE:
                    s.attributes.extend(self._gpu_attr)
            children.append(s)
        built = self._built[i] = (req, children)
        return built

    def stages(self, i: int) -> list[trace_pb2.Span]:
        return self._build(i)[1]

    def request(self, i: int, weight: float, counted: bool = False) -> trace_pb2.Span:
        """The request span, with its weight (the runtime writes it only when it is not
        1) and, for a request its summaries count, ``inferprof.summary.counted``."""
        span = self._build(i)[0]
        if weight == 1.0 and not counted:
            return span
        marked = trace_pb2.Span()
        marked.CopyFrom(span)
        if weight != 1.0:
            marked.attributes.append(
                KeyValue(key=sc.ATTR_SAMPLE_WEIGHT, value=AnyValue(double_value=float(weight)))
            )
        if counted:
            marked.attributes.append(
                KeyValue(key=sc.ATTR_SUMMARY_COUNTED, value=AnyValue(bool_value=True)))
        return marked


def breakdown(w: Workload, spans: Spans, order: np.ndarray, weights: np.ndarray) -> dict:
    """The engine's breakdown of the requests with a finite weight, fed in ``order``."""
    clock = FakeClock()
    engine = Engine(clock=clock, settle_s=0.0, retention_s=math.inf)
    engine.ingest_metrics(gpu_metrics(w.gpu_samples, hw_id=GPU_ID))
    builder = TraceBuilder(SERVICE)
    kept = 0

    def send(chunk: list[trace_pb2.Span]) -> None:
        result = engine.ingest_traces(builder.export(chunk))
        assert result.rejected_spans == 0, result
        clock.tick(1.0)  # lets the engine finalise as it goes

    chunk: list[trace_pb2.Span] = []
    for i in order.tolist():
        weight = weights[i]
        if math.isnan(weight):
            continue
        chunk.append(spans.request(i, weight))
        chunk.extend(spans.stages(i))
        kept += 1
        if kept % EXPORT_REQUESTS == 0:
            send(chunk)
            chunk = []
    if chunk:
        send(chunk)
    engine.flush()
    doc = engine.breakdown(SERVICE, window_s=None)
    assert doc is not None and doc["traced_requests"] == kept, doc
    return doc


def tail_sample(
    w: Workload, order: np.ndarray, coins: np.ndarray, sample_rate: float, tail_quantile: float,
    timed: float = 1.0, timing_coins: np.ndarray | None = None,
) -> np.ndarray:
    """Each request's weight under a real ``TailSampler`` (NaN: not kept).

    ``coins`` are uniform draws: the head decision is ``coin < sample_rate``. With
    ``timed`` < 1, only the requests whose ``timing_coins`` draw is below it are timed (the
    timing budget's share): the sampler sees those alone, and their weights are divided
    by ``timed``, as the runtime writes them.
    """
    sampler = TailSampler(sample_rate, tail_quantile)
    key = (REQUEST_NAME, MODEL)  # the runtime's key: (request name, model)
    e2e = w.e2e_ns.tolist()
    head = (coins < sample_rate).tolist()
    is_timed = (timing_coins < timed).tolist() if timed < 1.0 else [True] * len(e2e)
    weights = np.full(len(e2e), np.nan)
    for i in order.tolist():
        if not is_timed[i]:
            continue
        weight = sampler.decide(e2e[i], head[i], key)
        if weight is not None:
            weights[i] = weight / timed
    return weights


# --- figures and errors ----------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    latency: dict[str, float]  # p50, p95, p99 of e2e, seconds
    stage_p95: dict[str, float]
    shares: dict[str, float]  # share_of_p95 per stage
    verdict: str


def figures(doc: dict) -> Figures:
    stages = {s["stage"]: s for s in doc["stages"]}
    return Figures(
        latency=dict(doc["latency"]),
        stage_p95={name: stages[name]["p95"] for name in STAGES},
        shares={name: s["share_of_p95"] for name, s in stages.items()},
        verdict=doc["verdict"]["bottleneck"],
    )


def _exact(values: np.ndarray, q: float) -> float:
    out = exact_weighted_quantile(values, None, q)
    assert out is not None
    return out


def exact_figures(w: Workload, gpu: dict, queue: dict | None = None) -> Figures:
    """Exact figures of the same data; the verdict from exact shares, ``gpu`` and the
    ``queue`` section (what the queue waited behind, read from traces)."""
    e2e = w.e2e_ns * 1e-9
    stage = w.stage_ns * 1e-9
    latency = {name: _exact(e2e, q) for name, q in zip(("p50", "p95", "p99"), sc.QUANTILES)}
    tail = e2e >= latency["p95"]
    shares = dict(zip(STAGES, (stage[tail].sum(axis=0) / e2e[tail].sum()).tolist()))
    shares[sc.STAGE_UNATTRIBUTED] = 0.0  # stages are back to back
    return Figures(
        latency=latency,
        stage_p95={name: _exact(stage[:, k], 0.95) for k, name in enumerate(STAGES)},
        shares=shares,
        verdict=decide(shares, len(e2e), int(tail.sum()), gpu, queue)["bottleneck"],
    )


@dataclass(frozen=True)
class Errors:
    kept: float  # fraction of requests kept
    tail_kept: float  # fraction of the requests at or above the exact e2e p95 kept ...
    tail_exact: float  # ... and kept with weight 1
    e2e: tuple[float, ...]  # relative error of p50, p95, p99
    stage_p95: float  # largest relative error of a stage's p95 ...
    stage_p95_at: str  # ... and that stage
    share_pp: float  # largest absolute error of a share_of_p95, percentage points
    verdict_ok: bool


def compare(
    got: Figures, ref: Figures, kept: float, tail_kept: float, tail_exact: float
) -> Errors:
    def rel(a: float, b: float) -> float:
        return abs(a - b) / b

    names = set(got.shares) | set(ref.shares)
    stage_err, stage = max(
        (rel(got.stage_p95[s], ref.stage_p95[s]), s) for s in STAGES if ref.stage_p95[s] > 0
    )
    return Errors(
        kept=kept,
        tail_kept=tail_kept,
        tail_exact=tail_exact,
        e2e=tuple(rel(got.latency[q], ref.latency[q]) for q in ("p50", "p95", "p99")),
        stage_p95=stage_err,
        stage_p95_at=stage,
        share_pp=100.0
        * max(abs(got.shares.get(s, 0.0) - ref.shares.get(s, 0.0)) for s in names),
        verdict_ok=got.verdict == ref.verdict,
    )


@dataclass(frozen=True)
class Run:
    """One (scenario, seed): the truth and each setting's errors against it."""

    truth: Figures
    sketch: Errors  # the truth against the exact figures
    sampled: dict[tuple[float, float], Figures]
    errors: dict[tuple[float, float], Errors]  # sampled against the truth


def run(
    scenario: Scenario,
    n: int,
    seed: int,
    settings: Sequence[tuple[float, float]] = SETTINGS,
) -> Run:
    """Simulate ``n`` requests, fold them all, then each setting's sample; compare."""
    rng = np.random.default_rng([seed, zlib.crc32(scenario.name.encode())])
    w = simulate(scenario, n, rng)
    coins = rng.random(n)
    order = np.argsort(w.bounds[:, -1], kind="stable")  # decided, and exported, at the end
    spans = Spans(w)
    truth_doc = breakdown(w, spans, order, np.ones(n))
    truth = figures(truth_doc)
    exact = exact_figures(w, truth_doc["gpu"])
    sketch = compare(truth, exact, 1.0, 1.0, 1.0)
    tail = w.e2e_ns * 1e-9 >= exact.latency["p95"]
    # the timing budget's coins: a stream of their own, so the other settings' draws (and
    # their figures) are those of the runs before the budget existed
    timing_coins = np.random.default_rng([seed, zlib.crc32(scenario.name.encode()), 1]).random(n)
    sampled = {}
    errors = {}
    for k, setting in enumerate(settings):
        rate, q = setting[:2]
        timed = setting[2] if len(setting) > 2 else 1.0
        random.seed(seed * 1000 + k)  # the overload guard's coin
        weights = tail_sample(w, order, coins, rate, q, timed, timing_coins)
        kept = float(np.mean(~np.isnan(weights)))
        tail_kept = float(np.mean(~np.isnan(weights[tail])))
        # at the weight a slow request of this setting gets when kept for being slow
        tail_exact = float(np.mean(weights[tail] == 1.0 / timed))
        sampled[setting] = got = figures(breakdown(w, spans, order, weights))
        errors[setting] = compare(got, truth, kept, tail_kept, tail_exact)
    return Run(truth, sketch, sampled, errors)


# --- the default production pipeline: summaries of every timed request + sampled traces ---

#: Seconds of one replica's traffic in the production rows' window.
WINDOW_S = 60.0
#: The production rows' pipeline whose untimed requests are counted (§15's fourth metric).
UNTIMED_COUNTED = "summaries, untimed counted, + traces"
#: The production rows' default pipeline: untimed requests summarised with their stages.
UNTIMED_SUMMARISED = "summaries, untimed summarised (default), + traces"


def window_requests(scen: Scenario, window_s: float) -> int:
    """About how many requests the scenario serves in ``window_s`` (its mean rate)."""
    burst = 1.0
    if scen.burst_s:
        burst = (scen.calm_s + scen.burst * scen.burst_s) / (scen.calm_s + scen.burst_s)
    return round(window_s * scen.rate * burst * (1.0 + scen.step) / 2.0)


def timing_shares(w: Workload, rate: float | None) -> np.ndarray:
    """Each request's probability of being timed under the real ``TimingBudget`` of
    ``rate`` per second (None or 0: every request timed), asked at its arrival."""
    n = len(w.bounds)
    if not rate:
        return np.ones(n)
    now = [0.0]
    budget = TimingBudget(rate, clock=lambda: now[0])
    arrival = (w.bounds[:, 0] * 1e-9).tolist()
    shares = np.empty(n)
    for i in np.argsort(w.bounds[:, 0], kind="stable").tolist():
        now[0] = arrival[i]
        shares[i] = budget.share(REQUEST_NAME)
    return shares


class _Kept(MetricExporter):
    """Keeps what the summaries export (an in-memory metric exporter)."""

    def __init__(self) -> None:
        super().__init__()
        self.exports: list = []

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
        self.exports.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        return None


def summary_exports(w: Workload, timed: np.ndarray, weights: np.ndarray,
                    untimed_counted: bool = False) -> list[ExportMetricsServiceRequest]:
    """Contract §15's metrics over the ``timed`` requests, each at its weight, from the
    producer's own accumulator (``instrumentation.summaries.Summaries``: ``timing.partition``
    and ``timing.exp_index`` at scale 7), encoded by the SDK's OTLP encoder.
    ``untimed_counted``: the others counted too (``inferprof.summary.request.untimed``,
    what the middleware does on a counted route), the timed ones marked."""
    exporter = _Kept()
    stats = Stats()
    rows = np.flatnonzero(timed).tolist()
    summaries = Summaries(
        exporter, SdkResource({sc.RESOURCE_SERVICE_NAME: SERVICE}),
        InstrumentationScope(sc.INSTRUMENTATION_SCOPE), stats, interval_s=3600.0,
        max_pending=len(timed) + 1)
    bounds = (w.bounds + round(BASE_UNIX * 1e9)).tolist()
    for i in rows:
        b = bounds[i]
        spans = tuple(x for k, stage in enumerate(STAGES) for x in (stage, b[k], b[k + 1]))
        summaries.add((b[0], b[-1], False, MODEL, float(weights[i]), spans, untimed_counted))
    if untimed_counted:
        for i in np.flatnonzero(~timed).tolist():
            b = bounds[i]
            summaries.add_untimed((b[0], b[-1], False, MODEL))
    summaries.close(600.0)
    assert stats.summarised == len(rows) and not stats.summary_dropped, stats
    return [encode_metrics(data) for data in exporter.exports]


def production_breakdown(w: Workload, spans: Spans, order: np.ndarray, timed: np.ndarray,
                         shares: np.ndarray, trace_weights: np.ndarray,
                         untimed_counted: bool = False) -> dict:
    """The engine's breakdown from the summaries of the ``timed`` requests (weight
    1/share; with ``untimed_counted`` the others counted too) and the kept traces
    (``trace_weights``, NaN: not kept), marked counted."""
    engine = Engine(clock=FakeClock(), settle_s=0.0, retention_s=math.inf)
    engine.ingest_metrics(gpu_metrics(w.gpu_samples, hw_id=GPU_ID))
    for export in summary_exports(w, timed, 1.0 / shares, untimed_counted):
        result = engine.ingest_metrics(export)
        assert result.rejected_spans == 0, result
    builder = TraceBuilder(SERVICE)
    chunk: list[trace_pb2.Span] = []
    for i in order.tolist():
        if not math.isnan(trace_weights[i]):
            chunk.append(spans.request(i, trace_weights[i], counted=True))
            chunk.extend(spans.stages(i))
        if len(chunk) >= EXPORT_REQUESTS * 10:
            engine.ingest_traces(builder.export(chunk))
            chunk = []
    if chunk:
        engine.ingest_traces(builder.export(chunk))
    engine.flush()
    doc = engine.breakdown(SERVICE, window_s=None)
    assert doc is not None
    return doc


@dataclass(frozen=True)
class ProductionErrors:
    """One window's errors against the exact figures of every request in it."""

    n: int  # requests in the window
    timed: float  # share of requests timed (summarised)
    errors: Errors  # e2e, stage p95, shares, verdict; ``kept`` = traces kept / requests
    requests: float  # relative error of the request count


def production_run(scenario: Scenario, seed: int, window_s: float = WINDOW_S,
                   rate: float | None = DEFAULT_MAX_TIMED_RATE) -> dict[str, ProductionErrors]:
    """One replica's window of ``scenario`` under production mode's defaults (the timing
    budget ``rate``, the default sampler), read by a collector from traces alone (before
    summaries) and from summaries plus the same traces; both against the exact figures."""
    rng = np.random.default_rng([seed, zlib.crc32(scenario.name.encode()), 2])
    w = simulate(scenario, window_requests(scenario, window_s), rng)
    n = len(w.bounds)
    coins, timing_coins = rng.random(n), rng.random(n)
    order = np.argsort(w.bounds[:, -1], kind="stable")

    def traced(rate: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Timing shares, which requests were timed and their kept traces' weights
        (NaN: none) under a budget of ``rate``, the same coins for every rate."""
        shares = timing_shares(w, rate)
        timed = timing_coins < shares
        random.seed(seed * 1000 + 999)  # the overload guard's coin
        sampler = TailSampler(*DEFAULT_SETTING)
        e2e = w.e2e_ns.tolist()
        head = (coins < DEFAULT_SETTING[0]).tolist()
        trace_weights = np.full(n, np.nan)
        for i in order.tolist():
            if timed[i]:
                weight = sampler.decide(e2e[i], head[i], (REQUEST_NAME, MODEL))
                if weight is not None:
                    trace_weights[i] = weight / shares[i]
        return shares, timed, trace_weights

    shares, timed, trace_weights = traced(rate)
    spans = Spans(w)
    tail = w.e2e_ns * 1e-9 >= np.quantile(w.e2e_ns * 1e-9, 0.95)
    out = {}
    docs = [
        ("traces only", breakdown(w, spans, order, trace_weights)),
        ("summaries + traces", production_breakdown(w, spans, order, timed, shares,
                                                    trace_weights)),
    ]
    # (name, document, which requests were timed, their traces' weights)
    runs = [(name, doc, timed, trace_weights) for name, doc in docs]
    if not timed.all():  # untimed requests to count
        runs.append((UNTIMED_COUNTED, production_breakdown(
            w, spans, order, timed, shares, trace_weights, untimed_counted=True),
            timed, trace_weights))
        # Every request summarised at weight 1 (the timed ones too: no mark), and the
        # traces of the share timed at the rate of such routes (max_timed_rate_summarised)
        low = DEFAULT_MAX_TIMED_RATE_SUMMARISED
        s_timed, s_weights = timed, trace_weights
        if low and rate and low < rate:
            _, s_timed, s_weights = traced(low)
        runs.append((UNTIMED_SUMMARISED, production_breakdown(
            w, spans, order, np.ones(n, dtype=bool), np.ones(n), s_weights),
            s_timed, s_weights))
    for name, doc, t, weights in runs:
        exact = exact_figures(w, doc["gpu"], doc["queue"])
        errs = compare(figures(doc), exact, float(np.mean(~np.isnan(weights))),
                       float(np.mean(~np.isnan(weights[tail]))), float(np.mean(t[tail])))
        out[name] = ProductionErrors(n, float(t.mean()), errs, abs(doc["requests"] - n) / n)
    return out


def _production_table(args: argparse.Namespace) -> list[str]:
    lines = [
        "| scenario: collector reads | requests in window | timed | traces kept "
        "| requests err | e2e p95 err | max stage p95 err | max share_of_p95 err (pp) "
        "| verdict same |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    # The default timing budget, and none (every request timed: the summaries' goal).
    budgets = dict.fromkeys([DEFAULT_MAX_TIMED_RATE or None, None])
    for name, rate in ((n, r) for n in args.scenarios for r in budgets):
        scen = SCENARIOS[name]
        runs = [production_run(scen, args.seed + s, args.window, rate)
                for s in range(args.seeds)]
        budget = f"budget {rate:g}/s" if rate else "every request timed"
        for pipeline in ("traces only", "summaries + traces", UNTIMED_COUNTED,
                         UNTIMED_SUMMARISED):
            errs = [r[pipeline] for r in runs if pipeline in r]
            if not errs:
                continue
            worst = max(errs, key=lambda e: e.errors.stage_p95)
            lines.append(
                f"| {scen.name}, {budget}: {pipeline} | {int(np.median([e.n for e in errs])):,} "
                f"| {np.median([e.timed for e in errs]):.1%} "
                f"| {np.median([e.errors.kept for e in errs]):.1%} "
                f"| {_pct([e.requests for e in errs], 2)} "
                f"| {_pct([e.errors.e2e[1] for e in errs])} "
                f"| {_pct([e.errors.stage_p95 for e in errs])} ({worst.errors.stage_p95_at}) "
                f"| {np.median([e.errors.share_pp for e in errs]):.2f} / "
                f"{max(e.errors.share_pp for e in errs):.2f} "
                f"| {sum(e.errors.verdict_ok for e in errs)}/{len(errs)} |"
            )
    return lines


# --- report ---------------------------------------------------------------------------


def _pct(values: Sequence[float], digits: int = 1) -> str:
    return f"{np.median(values):.{digits}%} / {max(values):.{digits}%}"


def _row(label: str, errs: Sequence[Errors]) -> str:
    worst = max(errs, key=lambda e: e.stage_p95)
    cells = [
        f"{np.median([e.kept for e in errs]):.1%}",
        f"{np.median([e.tail_kept for e in errs]):.0%}, "
        f"{np.median([e.tail_exact for e in errs]):.0%}",
        *(_pct([e.e2e[i] for e in errs]) for i in range(3)),
        f"{_pct([e.stage_p95 for e in errs])} ({worst.stage_p95_at})",
        f"{np.median([e.share_pp for e in errs]):.2f} / {max(e.share_pp for e in errs):.2f}",
        f"{sum(e.verdict_ok for e in errs)}/{len(errs)}",
    ]
    return f"| {label} | " + " | ".join(cells) + " |"


def _runs(args: argparse.Namespace) -> Iterator[tuple[Scenario, list[Run]]]:
    for name in args.scenarios:
        scen = SCENARIOS[name]
        yield scen, [run(scen, args.n, args.seed + s) for s in range(args.seeds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, help="requests per run (default 30,000)")
    parser.add_argument("--seeds", type=int, help="runs per scenario (default 5)")
    parser.add_argument("--seed", type=int, default=1, help="first seed")
    parser.add_argument(
        "--scenarios", type=lambda s: s.split(","), default=list(SCENARIOS), metavar="A,B"
    )
    parser.add_argument("--quick", action="store_true",
                        help="defaults --n 8000 --seeds 3 --window 10")
    parser.add_argument("--window", type=float,
                        help="seconds of one replica's traffic in the production rows "
                        f"(default {WINDOW_S:g})")
    parser.add_argument("--production-only", action="store_true",
                        help="only the production rows (summaries + traces)")
    args = parser.parse_args()
    args.window = args.window or (10.0 if args.quick else WINDOW_S)
    args.n = args.n or (8_000 if args.quick else 30_000)
    args.seeds = args.seeds or (3 if args.quick else 5)
    for name in args.scenarios:
        if name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    t0 = time.perf_counter()
    if not args.production_only:
        _sampling_tables(args)
    budget = f"{DEFAULT_MAX_TIMED_RATE:g}/s" if DEFAULT_MAX_TIMED_RATE else "none"
    budget += (f"; the default pipeline's traces at {DEFAULT_MAX_TIMED_RATE_SUMMARISED:g}/s, "
               "max_timed_rate_summarised")
    print(
        f"\nThe default production pipeline, one replica's {args.window:g}-second window "
        f"(timing budget {budget}, sampler {DEFAULT_SETTING[0]:g}, {DEFAULT_SETTING[1]:g}), "
        f"seeds {args.seed}..{args.seed + args.seeds - 1}: errors against the exact figures "
        "of every request in the window (median / worst over seeds). `traces only`: the "
        "collector reads the kept traces alone (before summaries); `summaries + traces`: the "
        "summaries of every timed request (contract §15) plus the same traces, marked "
        "counted.\n"
    )
    print("\n".join(_production_table(args)))
    print(f"\n{time.perf_counter() - t0:.0f} s")


def _sampling_tables(args: argparse.Namespace) -> None:
    print(
        f"SYNTHETIC workload: {args.n:,} requests per run, seeds {args.seed}.."
        f"{args.seed + args.seeds - 1}. Each cell: median / worst over seeds.\n"
        "Sampling rows: error of the sampled breakdown against the engine's breakdown of all "
        "requests (truth).\n`all kept` rows: the engine's own (sketch) error against the "
        "exact figures of the same data.\n"
    )
    header = (
        "| scenario: sample_rate, tail_quantile | kept | tail kept, at weight 1 | e2e p50 err "
        "| e2e p95 err | e2e p99 err | max stage p95 err | max share_of_p95 err (pp) "
        "| verdict same |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for scen, runs in _runs(args):
        t = runs[0].truth
        top = sorted(t.shares.items(), key=lambda kv: -kv[1])[:3]
        verdicts = sorted({r.truth.verdict for r in runs})
        notes.append(
            f"- `{scen.name}`: {scen.description}. Truth (seed {args.seed}): e2e p50 / p95 / p99 "
            + " / ".join(f"{t.latency[q] * 1e3:.1f}" for q in ("p50", "p95", "p99"))
            + " ms; share_of_p95 "
            + ", ".join(f"{s} {v:.0%}" for s, v in top)
            + f"; verdict over all seeds: {' / '.join(verdicts)}."
        )
        lines.append(_row(f"{scen.name}: all kept (sketch error)", [r.sketch for r in runs]))
        for setting in SETTINGS:
            mark = " (default)" if setting == DEFAULT_SETTING else ""
            if len(setting) > 2:
                mark = f", {setting[2]:.0%} of requests timed"
            label = f"{scen.name}: {setting[0]:g}, {setting[1]:g}{mark}"
            lines.append(_row(label, [r.errors[setting] for r in runs]))
    print("\n".join(notes) + "\n")
    print("\n".join(lines))
    print(
        "\nkept: fraction of traces kept (median over seeds). tail kept, at weight 1: of the "
        "requests at or above the exact e2e p95, the fraction the sampler kept, and kept "
        "with weight 1 (medians); the rest of the tail is stood for by head-sampled or "
        "overload-guard traces of weight > 1, the source of the noise in the tail figures. "
        "Quantile errors move in "
        "steps of about 1%, the sketch's bucket width. max stage p95 err: over the nine "
        "stages, the stage in brackets is where the worst seed's largest error was. "
        "max share_of_p95 err: over all stages, absolute, in percentage points. verdict "
        "same: seeds whose verdict equals the reference's."
    )


if __name__ == "__main__":
    main()
