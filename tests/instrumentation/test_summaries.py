"""Production mode's summaries (contract §15): every timed request folded into three
exponential histograms, exported as OTLP metrics.

The figures are checked against exact computation from the requests' own timings: with
``sample_rate=1`` every timed request is also kept as a trace, and the trace's spans are
what the collector would fold, so stage times, exclusive times and end-to-end latencies
computed from them (``inferprof.timing.partition``, the collector's own function) must
give exactly the summaries' counts, bucket by bucket."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter, defaultdict

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricExportResult,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind, StatusCode

import inferprof
import inferprof.fastapi
from inferprof import semconv, timing
from inferprof.batching import hooks
from inferprof.fastapi import exchange, middleware
from inferprof.instrumentation import stage as stage_module
from inferprof.instrumentation import summaries as summaries_module
from inferprof.instrumentation.accounting import Stats
from inferprof.instrumentation.sampling import TimingBudget
from inferprof.instrumentation.summaries import Summaries
from inferprof.timing import DEFAULT_SUMMARY_SCALE, exp_index, partition
from tests.instrumentation.helpers import captured

MS = 1_000_000


class MemoryExporter(MetricExporter):
    """Keeps every export; ``block`` makes export wait on it (a hanging backend);
    ``fail`` makes it raise."""

    def __init__(self, *, block: threading.Event | None = None, fail: bool = False) -> None:
        super().__init__()
        self.exports: list = []
        self.called = threading.Event()
        self.block = block
        self.fail = fail
        self.shut = False

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
        self.called.set()
        if self.block is not None:
            self.block.wait(30)
        if self.fail:
            raise ConnectionError("backend down")
        self.exports.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self.shut = True


class FakeClock:
    """The instrumentation's clock, moved by the test: stage timings are known."""

    def __init__(self) -> None:
        self.now = 1_700_000_000 * 10**9

    def __call__(self) -> int:
        return self.now

    def tick(self, ns: int) -> None:
        self.now += ns


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(stage_module, "_time_ns", c)
    monkeypatch.setattr(hooks, "_time_ns", c)
    monkeypatch.setattr(middleware, "_time_ns", c)
    monkeypatch.setattr(exchange, "_time_ns", c)
    return c


# --- decoding and exact computation --------------------------------------------------------


def _key(attrs) -> tuple:
    return tuple(sorted(attrs.items()))


def decode(exports) -> dict:
    """metric name -> data point attributes -> {"zero", "buckets" {(scale, index): n},
    "count"}, summed over the (DELTA) exports."""
    out: dict = defaultdict(lambda: defaultdict(
        lambda: {"zero": 0, "buckets": Counter(), "count": 0}))
    for data in exports:
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                assert sm.scope.name == semconv.INSTRUMENTATION_SCOPE
                for metric in sm.metrics:
                    assert metric.data.aggregation_temporality is AggregationTemporality.DELTA
                    for p in metric.data.data_points:
                        d = out[metric.name][_key(p.attributes)]
                        d["zero"] += p.zero_count
                        d["count"] += p.count
                        assert p.count == p.zero_count + sum(p.positive.bucket_counts)
                        for j, n in enumerate(p.positive.bucket_counts):
                            if n:
                                d["buckets"][(p.scale, p.positive.offset + j)] += n
    return {name: dict(points) for name, points in out.items()}


def _is_request(span) -> bool:
    return span.kind in (SpanKind.SERVER, SpanKind.CONSUMER) or bool(
        (span.attributes or {}).get(semconv.ATTR_REQUEST))


def exact(spans) -> dict:
    """What the summaries must hold, computed from the traces as the collector reads them
    (§6): each request's stage spans (own, children copies, linked batch spans)."""
    requests = {(s.context.trace_id, s.context.span_id): s for s in spans if _is_request(s)}
    by_id = {(s.context.trace_id, s.context.span_id): s for s in spans}
    stages_of: dict = defaultdict(list)
    model_of: dict = {}
    for s in spans:
        attrs = s.attributes or {}
        if semconv.ATTR_STAGE not in attrs:
            continue
        if s.links:  # links encoding: the batch span counts for every member it names
            owners = [(ln.context.trace_id, ln.context.span_id) for ln in s.links]
        else:
            cur = s
            while (cur.context.trace_id, cur.context.span_id) not in requests:
                cur = by_id[(cur.context.trace_id, cur.parent.span_id)]
            owners = [(cur.context.trace_id, cur.context.span_id)]
        for owner in owners:
            if owner in requests:
                stages_of[owner].append((attrs[semconv.ATTR_STAGE], s.start_time, s.end_time))
                if semconv.ATTR_MODEL_NAME in attrs:
                    model_of.setdefault(owner, attrs[semconv.ATTR_MODEL_NAME])
    out: dict = defaultdict(lambda: defaultdict(
        lambda: {"zero": 0, "buckets": Counter(), "count": 0}))
    scale = DEFAULT_SUMMARY_SCALE

    def add(metric, attrs, value, amount=1):
        d = out[metric][_key(attrs)]
        d["count"] += amount
        if value > 0:
            d["buckets"][(scale, int(exp_index([value], scale)[0]))] += amount
        else:
            d["zero"] += amount

    for rid, r in requests.items():
        if not stages_of[rid]:
            continue
        attrs = r.attributes or {}
        base = {}
        model = attrs.get(semconv.ATTR_MODEL_NAME, model_of.get(rid))
        if model is not None:
            base[semconv.ATTR_MODEL_NAME] = model
        weight = attrs.get(semconv.ATTR_SAMPLE_WEIGHT, 1.0)
        if weight != 1.0:
            base[semconv.ATTR_SAMPLE_WEIGHT] = weight
        e2e = (r.end_time - r.start_time) * 1e-9
        error = r.status.status_code is StatusCode.ERROR
        add(semconv.METRIC_SUMMARY_REQUEST_DURATION,
            {**base, **({semconv.ATTR_REQUEST_ERROR: True} if error else {})}, e2e)
        stage_time, exclusive, unattributed = partition(r.start_time, r.end_time,
                                                        stages_of[rid])
        stage_time[semconv.STAGE_UNATTRIBUTED] = unattributed
        exclusive[semconv.STAGE_UNATTRIBUTED] = unattributed
        for stage, value in stage_time.items():
            add(semconv.METRIC_SUMMARY_STAGE_DURATION, {**base, semconv.ATTR_STAGE: stage},
                value)
        for stage, value in exclusive.items():
            ns = round(value * 1e9)
            if ns:
                add(semconv.METRIC_SUMMARY_STAGE_TAIL, {**base, semconv.ATTR_STAGE: stage},
                    e2e, ns)
    return {name: dict(points) for name, points in out.items()}


def assert_summaries_match(exporter, spans):
    got, want = decode(exporter.exports), exact(spans)
    _merge_marked(got)
    assert set(got) == set(want)
    for metric in want:
        assert set(got[metric]) == set(want[metric]), metric
        for key, w in want[metric].items():
            assert got[metric][key] == w, (metric, key)


def _merge_marked(got) -> None:
    """Request-duration data points with and without the mark of untimed siblings counted
    (test_summaries_untimed.py tests it), as one."""
    points = got.get(semconv.METRIC_SUMMARY_REQUEST_DURATION, {})
    for key in [k for k in points if (semconv.ATTR_SUMMARY_UNTIMED_COUNTED, True) in k]:
        d = points.pop(key)
        plain = points.setdefault(
            tuple(kv for kv in key if kv[0] != semconv.ATTR_SUMMARY_UNTIMED_COUNTED),
            {"zero": 0, "buckets": Counter(), "count": 0})
        plain["zero"] += d["zero"]
        plain["count"] += d["count"]
        plain["buckets"] += d["buckets"]


# --- a service -----------------------------------------------------------------------------


async def _service(clock: FakeClock, n: int, errors: set[int]) -> None:
    """``n`` requests of known stage timings: tokenize, a zero-length stage on some, a
    queue, a batch of up to three (batch_assembly, compute), postprocess with a nested
    detokenize (overlapping stages), some ending in an error."""
    loop = asyncio.get_running_loop()
    queue: list = []

    async def one(i: int) -> None:
        try:
            async with inferprof.request(model="m" if i % 3 else "n"):
                with inferprof.stage("tokenize"):
                    clock.tick(MS + 37_000 * i)
                if i % 4 == 0:
                    with inferprof.stage("lookup"):
                        pass  # the clock does not move: a zero-length stage
                handle = inferprof.enqueue(depth=len(queue))
                fut = loop.create_future()
                queue.append((handle, fut))
                await fut
                with inferprof.stage("postprocess"):
                    clock.tick(MS // 2 + 11_000 * i)
                    with inferprof.stage("detokenize"):
                        clock.tick(MS // 5 + 7_000 * i)
                    clock.tick(13_000)
                if i in errors:
                    raise RuntimeError("boom")
        except RuntimeError:
            pass

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    while not all(t.done() for t in tasks):
        for _ in range(3):
            await asyncio.sleep(0)
        if not queue:
            continue
        group, queue[:] = queue[:3], queue[3:]
        clock.tick(300_000)
        with inferprof.batch([h for h, _ in group], max_size=4) as b:
            with b.stage("batch_assembly"):
                clock.tick(100_000 + 1_000 * len(group))
            with inferprof.stage("compute"):
                clock.tick(2 * MS + 50_000 * len(queue))
        for _, fut in group:
            fut.set_result(None)
    await asyncio.gather(*tasks)


@pytest.fixture(params=["dense", "sorted"])
def fold_counting(request, monkeypatch):
    """The fold's two ways of counting (request, stage) pairs and (data point, bucket)
    cells: into dense arrays (the usual case) or by sorting them (many distinct ones)."""
    if request.param == "sorted":
        monkeypatch.setattr(timing, "_DENSE_KEYS", 0)
        monkeypatch.setattr(timing, "_DENSE_PER_SPAN", 0)
        monkeypatch.setattr(summaries_module, "_DENSE_CELLS", 0)
        monkeypatch.setattr(summaries_module, "_DENSE_PER_VALUE", 0)
    return request.param


@pytest.mark.parametrize("encoding", ["children", "links"])
def test_summaries_equal_exact_figures_from_every_requests_timings(clock, encoding,
                                                                   fold_counting):
    exporter = MemoryExporter()
    with captured(mode="production", max_timed_rate=0, sample_rate=1.0,
                  batch_encoding=encoding, summary_exporter=exporter,
                  summary_interval_s=3600) as cap:
        asyncio.run(_service(clock, 40, errors={5, 11, 30}))
        inferprof.shutdown()  # flushes the last interval's summaries
        spans = cap.spans()
        snap = inferprof.instrumentation.stats()
    assert snap.requests_summarised == 40 and snap.summaries_dropped == 0
    assert snap.summary_exports == 1 and exporter.shut
    requests = [s for s in spans if _is_request(s)]
    assert len(requests) == 40
    assert all(r.attributes[semconv.ATTR_SUMMARY_COUNTED] is True for r in requests)
    got = decode(exporter.exports)
    # counts: every request once, its errors apart, every stage it entered once
    req = got[semconv.METRIC_SUMMARY_REQUEST_DURATION]
    assert sum(d["count"] for d in req.values()) == 40
    errors = [d["count"] for k, d in req.items() if (semconv.ATTR_REQUEST_ERROR, True) in k]
    assert sum(errors) == 3
    stage_counts = Counter()
    for k, d in got[semconv.METRIC_SUMMARY_STAGE_DURATION].items():
        stage_counts[dict(k)[semconv.ATTR_STAGE]] += d["count"]
    assert stage_counts == {
        "tokenize": 40, "queue": 40, "batch_assembly": 40, "compute": 40, "postprocess": 40,
        "detokenize": 40, "lookup": 10, "unattributed": 40,
    }
    zero = sum(d["zero"] for k, d in got[semconv.METRIC_SUMMARY_STAGE_DURATION].items()
               if dict(k)[semconv.ATTR_STAGE] == "lookup")
    assert zero == 10  # entered, for 0 s
    # per bucket, everything equals exact computation from the traces
    assert_summaries_match(exporter, spans)
    # the tail metric: per end-to-end bucket, the stages' exclusive ns sum to the bucket's
    # end-to-end ns (the partition is exact), rounding aside
    tail = got[semconv.METRIC_SUMMARY_STAGE_TAIL]
    per_bucket = Counter()
    for d in tail.values():
        per_bucket.update(d["buckets"])
    e2e_ns = Counter()
    for r in requests:
        idx = int(exp_index([(r.end_time - r.start_time) * 1e-9])[0])
        e2e_ns[(DEFAULT_SUMMARY_SCALE, idx)] += r.end_time - r.start_time
    assert set(per_bucket) == set(e2e_ns)
    for b, ns in e2e_ns.items():
        assert abs(per_bucket[b] - ns) <= 8 * 40  # at most 0.5 ns per (request, stage)
    # the resource is the runtime's
    (data,) = exporter.exports
    assert data.resource_metrics[0].resource is cap.provider.resource


def test_weights_of_the_timing_budget_split_the_data_points(clock):
    exporter = MemoryExporter()
    budget_clock = [100.0]
    with captured(mode="production", max_timed_rate=0, sample_rate=1.0, summary_exporter=exporter,
                  summary_interval_s=3600) as cap:
        rt = inferprof._config.active_runtime()
        rt.timing_budget = TimingBudget(100, clock=lambda: budget_clock[0])
        # 300 a second, steady: a share of 1/3, rounded down to 1/4 (30 requests a tenth of
        # a second, within a period's budget of 10 at that share)
        for _ in range(60):
            rt.timing_budget.share((semconv.REQUEST_SPAN_NAME, "m"))
            budget_clock[0] += 1 / 300
        timed = 0
        for i in range(400):
            budget_clock[0] += 1 / 300
            with inferprof.request(model="m") as req:
                timed += req is not None
                with inferprof.stage("compute"):
                    clock.tick(MS + 1000 * (i % 50))
        inferprof.shutdown()
        spans = cap.spans()
        snap = inferprof.instrumentation.stats()
    assert 60 <= timed <= 140 and snap.requests_summarised == timed
    got = decode(exporter.exports)
    (key,) = got[semconv.METRIC_SUMMARY_REQUEST_DURATION]
    assert dict(key) == {semconv.ATTR_MODEL_NAME: "m", semconv.ATTR_SAMPLE_WEIGHT: 4.0}
    assert got[semconv.METRIC_SUMMARY_REQUEST_DURATION][key]["count"] == timed
    assert_summaries_match(exporter, spans)


def test_requests_not_kept_are_counted_and_kept_ones_carry_the_mark(clock):
    exporter = MemoryExporter()
    with captured(mode="production", max_timed_rate=0, sample_rate=0.05, tail_quantile=0.9,
                  summary_exporter=exporter, summary_interval_s=3600) as cap:
        for i in range(500):
            with inferprof.request(model="m"):
                with inferprof.stage("compute"):
                    clock.tick(MS + 10_000 * ((i * 7919) % 97))
        inferprof.shutdown()
        requests = [s for s in cap.spans() if _is_request(s)]
        snap = inferprof.instrumentation.stats()
    assert snap.requests_summarised == 500
    assert snap.traces_kept == len(requests) < 250  # the tail and 5%: most are not kept
    assert all(r.attributes[semconv.ATTR_SUMMARY_COUNTED] is True for r in requests)
    got = decode(exporter.exports)
    assert sum(d["count"] for d in got[semconv.METRIC_SUMMARY_REQUEST_DURATION].values()) == 500
    compute = [d for k, d in got[semconv.METRIC_SUMMARY_STAGE_DURATION].items()
               if dict(k)[semconv.ATTR_STAGE] == "compute"]
    want = Counter(int(exp_index([(MS + 10_000 * ((i * 7919) % 97)) * 1e-9])[0])
                   for i in range(500))
    assert sum((d["buckets"] for d in compute), Counter()) == Counter(
        {(DEFAULT_SUMMARY_SCALE, i): n for i, n in want.items()})


def test_http_requests_get_receive_serialize_and_5xx_errors(clock):
    app = FastAPI()

    @app.post("/v1/run")
    async def run(body: dict):
        with inferprof.stage("compute"):
            clock.tick(2 * MS)
        if body["i"] % 5 == 0:
            from fastapi.responses import JSONResponse

            return JSONResponse({"error": "x"}, status_code=503)
        return {"ok": body["i"]}

    inferprof.fastapi.instrument(app, model_name="m")

    async def post() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for i in range(20):
                await c.post("/v1/run", json={"i": i})

    exporter = MemoryExporter()
    with captured(mode="production", max_timed_rate=0, sample_rate=1.0, summary_exporter=exporter,
                  summary_interval_s=3600) as cap:
        asyncio.run(post())
        inferprof.shutdown()
        spans = cap.spans()
    got = decode(exporter.exports)
    req = got[semconv.METRIC_SUMMARY_REQUEST_DURATION]
    errors = sum(d["count"] for k, d in req.items() if (semconv.ATTR_REQUEST_ERROR, True) in k)
    assert errors == 4
    stages = {dict(k)[semconv.ATTR_STAGE] for k in got[semconv.METRIC_SUMMARY_STAGE_DURATION]}
    assert stages == {"receive", "compute", "serialize", "unattributed"}
    assert_summaries_match(exporter, spans)


def test_requests_the_collector_reads_otherwise_are_not_summarised(clock):
    exporter = MemoryExporter()
    with captured(mode="production", max_timed_rate=0, sample_rate=1.0, summary_exporter=exporter,
                  summary_interval_s=3600) as cap:
        tracer = cap.provider.get_tracer("another-instrumentation")
        # under another instrumentation's request span (inferprof enriches it)
        with tracer.start_as_current_span("GET /x", kind=SpanKind.SERVER):
            with inferprof.request(model="m"):
                with inferprof.stage("compute"):
                    clock.tick(MS)
        # the step API: stages from the engine's steps (§14)
        engine = inferprof.Engine("e1")
        gen = engine.request(prompt_tokens=3)
        with engine.step() as step:
            step.prefill(gen, 3)
            clock.tick(MS)
        gen.finish()
        # no stage span at all: the collector counts it by its attributes
        with inferprof.request(model="m"):
            clock.tick(MS)
        # and one summarised, for contrast
        with inferprof.request(model="m"):
            with inferprof.stage("compute"):
                clock.tick(MS)
        inferprof.shutdown()
        spans = cap.spans()
        snap = inferprof.instrumentation.stats()
    assert snap.requests_summarised == 1
    got = decode(exporter.exports)
    assert sum(d["count"] for d in got[semconv.METRIC_SUMMARY_REQUEST_DURATION].values()) == 1
    marked = [s for s in spans if (s.attributes or {}).get(semconv.ATTR_SUMMARY_COUNTED)]
    assert len(marked) == 1
    assert len([s for s in spans if _is_request(s)]) == 4  # the other three: traces only


def _entry(i: int) -> tuple:
    start = 10**18 + i * MS
    return (start, start + MS, False, "m", 1.0, ("compute", start, start + MS), False)


def test_a_full_buffer_drops_and_counts_and_never_blocks():
    release = threading.Event()
    exporter = MemoryExporter(block=release)
    stats = Stats()
    s = Summaries(exporter, None, None, stats, interval_s=0.01, max_pending=50)
    try:
        assert s.add(_entry(0))
        assert exporter.called.wait(10)  # the export thread is now stuck in export()
        t0 = time.perf_counter()
        added = sum(s.add(_entry(i)) for i in range(1, 201))
        elapsed = time.perf_counter() - t0
        assert added == 50 and stats.summary_dropped == 150
        assert elapsed < 1.0  # 200 calls; none waited for the exporter
    finally:
        release.set()
        s.close(10)
    assert stats.summarised == 51
    assert stats.summary_exports == 2 and stats.summary_dropped == 150
    total = sum(p.count for data in exporter.exports for rm in data.resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics
                if m.name == semconv.METRIC_SUMMARY_REQUEST_DURATION for p in m.data.data_points)
    assert total == 51


_SCOPE = InstrumentationScope(semconv.INSTRUMENTATION_SCOPE)


def _stage_entry(i: int, model: str, stage: str) -> tuple:
    start = 10**18 + i * MS
    return (start, start + MS, False, model, 1.0, (stage, start, start + MS), False)


def test_a_request_past_the_key_bound_is_dropped_whole_not_partly_folded():
    # Request 0 needs 4 data points (its duration, its stage and unattributed times, its
    # stage's tail); request 1 shares two of them and needs two more: past max_keys=4, so
    # it is dropped whole (counted), never counted in the duration without its stages.
    exporter = MemoryExporter()
    stats = Stats()
    s = Summaries(exporter, None, _SCOPE, stats, interval_s=3600, max_keys=4)
    assert s.add(_stage_entry(0, "m", "compute"))
    assert s.add(_stage_entry(1, "m", "queue"))
    s.close(10)
    assert stats.summarised == 2 and stats.summary_dropped == 1
    got = decode(exporter.exports)
    assert [d["count"] for d in got[semconv.METRIC_SUMMARY_REQUEST_DURATION].values()] == [1]
    stages = {dict(k)[semconv.ATTR_STAGE]: d["count"]
              for k, d in got[semconv.METRIC_SUMMARY_STAGE_DURATION].items()}
    assert stages == {"compute": 1, "unattributed": 1}
    tail = {dict(k)[semconv.ATTR_STAGE]: sum(d["buckets"].values())
            for k, d in got[semconv.METRIC_SUMMARY_STAGE_TAIL].items()}
    assert tail == {"compute": MS}


@pytest.mark.parametrize("folds", [1, 3])
def test_requests_past_the_key_bound_leave_every_data_point_consistent(folds):
    # Many models and stages, a small bound: whatever is folded is whole requests (each
    # model's duration count equals its unattributed count, its tail ns sum to its
    # requests' end-to-end ns), and folded + dropped is every request.
    import random

    rng = random.Random(7)
    exporter = MemoryExporter()
    stats = Stats()
    s = Summaries(exporter, None, _SCOPE, stats, interval_s=3600, max_keys=40)
    n = 300
    entries = [_stage_entry(i, f"m{rng.randrange(12)}", f"s{rng.randrange(6)}")
               for i in range(n)]
    for part in range(folds):
        for e in entries[part * n // folds:(part + 1) * n // folds]:
            assert s.add(e)
        s._fold()  # the export thread's fold, between the adds
    s.close(10)
    got = decode(exporter.exports)
    by_model: dict = defaultdict(Counter)
    for k, d in got[semconv.METRIC_SUMMARY_REQUEST_DURATION].items():
        by_model[dict(k)[semconv.ATTR_MODEL_NAME]]["requests"] += d["count"]
    for k, d in got[semconv.METRIC_SUMMARY_STAGE_DURATION].items():
        a = dict(k)
        by_model[a[semconv.ATTR_MODEL_NAME]][a[semconv.ATTR_STAGE]] += d["count"]
    for k, d in got[semconv.METRIC_SUMMARY_STAGE_TAIL].items():
        by_model[dict(k)[semconv.ATTR_MODEL_NAME]]["tail_ns"] += sum(d["buckets"].values())
    folded = sum(c["requests"] for c in by_model.values())
    assert 0 < folded < n
    assert folded + stats.summary_dropped == n
    for c in by_model.values():
        assert c["unattributed"] == c["requests"]
        assert sum(v for k, v in c.items() if k.startswith("s")) == c["requests"]
        assert c["tail_ns"] == c["requests"] * MS


def _spread_entry(i: int, ns: int) -> tuple:
    start = 10**18 + i * 10 * MS
    return (start, start + 2 * ns, False, "m", 1.0, ("compute", start, start + ns), False)


def _buckets_by_point(exports) -> dict:
    return {(name, k): (d["zero"], dict(d["buckets"]), d["count"])
            for name, points in decode(exports).items() for k, d in points.items()}


def test_folds_that_widen_each_data_points_range_equal_one_fold(fold_counting):
    # Stage times from 3 µs to 40 ms, folded in an order that widens every data point's
    # buckets downwards, upwards and inside (each fold adds into the counts the earlier
    # ones left), give the same export, bucket for bucket, as one fold of them all; and
    # both equal the buckets computed value by value.
    import random

    rng = random.Random(3)
    times = [int(3_000 * 1.3 ** rng.uniform(0, 35)) for _ in range(400)]
    entries = [_spread_entry(i, ns) for i, ns in enumerate(times)]
    o = sorted(range(400), key=lambda i: times[i])
    parts = [
        [i for k, i in enumerate(o[100:250]) if k % 3],  # the middle
        o[:100] + o[100:250:3],  # lower, into the middle's range: grown, overlapping
        [i for k, i in enumerate(o[250:]) if k % 5],  # higher: grown
        o[250::5],  # inside the range: added in place
        [],  # nothing new
    ]
    exports = []
    for folds in ([list(range(400))], parts):
        exporter = MemoryExporter()
        s = Summaries(exporter, None, _SCOPE, Stats(), interval_s=3600)
        for part in folds:
            for i in part:
                assert s.add(entries[i])
            s._fold()
        s.close(10)
        exports.append(_buckets_by_point(exporter.exports))
    assert exports[0] == exports[1]
    got = exports[0][(semconv.METRIC_SUMMARY_STAGE_DURATION,
                      _key({semconv.ATTR_MODEL_NAME: "m", semconv.ATTR_STAGE: "compute"}))]
    want = Counter((DEFAULT_SUMMARY_SCALE, int(exp_index([ns * 1e-9])[0])) for ns in times)
    assert got == (0, dict(want), 400)


def test_an_export_past_the_bucket_bound_is_downscaled_exactly(monkeypatch):
    # Past _MAX_BUCKETS the export's scale is lowered: bucket i becomes i >> shift (OTLP's
    # downscaling), the counts summed, none lost.
    monkeypatch.setattr(summaries_module, "_MAX_BUCKETS", 64)
    times = [3_000 * 2 ** (k / 7) for k in range(0, 140, 3)]  # 3 µs to ~3 s: 20 octaves
    exporter = MemoryExporter()
    s = Summaries(exporter, None, _SCOPE, Stats(), interval_s=3600)
    for i, ns in enumerate(times):
        assert s.add(_spread_entry(i, int(ns)))
        if i % 9 == 0:
            s._fold()
    s.close(10)
    (data,) = exporter.exports
    (metric,) = [m for m in data.resource_metrics[0].scope_metrics[0].metrics
                 if m.name == semconv.METRIC_SUMMARY_STAGE_DURATION]
    (point,) = [p for p in metric.data.data_points
                if p.attributes[semconv.ATTR_STAGE] == "compute"]
    shift = DEFAULT_SUMMARY_SCALE - point.scale
    assert shift > 0 and len(point.positive.bucket_counts) <= 64
    want = Counter(int(exp_index([int(ns) * 1e-9])[0]) >> shift for ns in times)
    got = {point.positive.offset + j: n
           for j, n in enumerate(point.positive.bucket_counts) if n}
    assert got == dict(want) and point.count == len(times)
    assert point.positive.bucket_counts[0] and point.positive.bucket_counts[-1]


class _Name(str):
    """A model name of a ``str`` subclass (an enum's, ``numpy.str_``): a string on the wire."""


@pytest.mark.parametrize("max_buckets", [8192, 48])
def test_the_request_built_from_the_state_is_the_sdk_encoders(monkeypatch, max_buckets):
    # The OTLP/HTTP export's request message, built straight from the state, equals what
    # the SDK's encoder makes of the SDK's metric objects: models (one None), weights,
    # errors, marks, zero-length stages, untimed requests counted; downscaled too.
    import random

    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.sdk.resources import Resource

    monkeypatch.setattr(summaries_module, "_MAX_BUCKETS", max_buckets)
    rng = random.Random(11)
    s = Summaries(MemoryExporter(), Resource({"service.name": "svc", "n": 3}), _SCOPE,
                  Stats(), interval_s=3600)
    for i in range(300):
        start = 10**18 + i * MS
        ns = int(2_000 * 1.4 ** rng.uniform(0, 30))
        stage = ("compute" if i % 3 else "queue", start, start + (0 if i % 17 == 0 else ns))
        s.add((start, start + 2 * ns + 1, i % 7 == 0, rng.choice(["a", _Name("b"), None]),
               rng.choice([1.0, 4.0]), stage, i % 5 == 0))
        s.add_untimed((start, start + ns, i % 9 == 0, "a"))
        if i % 100 == 99:
            s._fold()
    tables = (s._requests, s._stages, s._tail, s._counted)
    assert all(tables)
    built = s._request(tables, 5, 6)
    assert built == encode_metrics(s._metrics_data(tables, 5, 6))
    assert max_buckets == 8192 or built.resource_metrics[0].scope_metrics[0].metrics[
        0].exponential_histogram.data_points[0].scale < DEFAULT_SUMMARY_SCALE
    s.close(10)


@pytest.mark.parametrize("encoder", ["built", "sdk"])
def test_an_otlp_http_exporter_posts_the_summaries_to_a_real_receiver(monkeypatch, encoder):
    # The SDK's OTLP/HTTP metric exporter posts the request built from the state; should
    # building it fail, the SDK's objects and encoder still deliver the same figures.
    import http.server

    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    bodies: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        if encoder == "sdk":
            def broken(*args, **kwargs):
                raise RuntimeError("not built")

            monkeypatch.setattr(summaries_module.summary_otlp, "request", broken)
        exporter = OTLPMetricExporter(
            endpoint=f"http://127.0.0.1:{server.server_address[1]}/v1/metrics")
        from opentelemetry.sdk.resources import Resource

        stats = Stats()
        s = Summaries(exporter, Resource({"service.name": "svc"}), _SCOPE, stats,
                      interval_s=3600)
        assert s._send_request is not None  # (the SDK's exporter: the request is built)
        for i in range(3):
            assert s.add(_stage_entry(i, "m", "compute"))
        s.close(10)
        assert stats.summary_exports == 1 and stats.summary_dropped == 0
        (body,) = bodies
        request = ExportMetricsServiceRequest.FromString(body)
        (metrics,) = [sm.metrics for rm in request.resource_metrics for sm in rm.scope_metrics]
        counts = {m.name: sum(p.count for p in m.exponential_histogram.data_points)
                  for m in metrics}
        assert counts == {semconv.METRIC_SUMMARY_REQUEST_DURATION: 3,
                          semconv.METRIC_SUMMARY_STAGE_DURATION: 6,  # compute, unattributed
                          semconv.METRIC_SUMMARY_STAGE_TAIL: 3 * MS}  # (ns)
    finally:
        server.shutdown()
        server.server_close()


def test_a_failing_exporter_is_counted_and_the_service_runs_on(clock):
    exporter = MemoryExporter(fail=True)
    with captured(mode="production", max_timed_rate=0, sample_rate=0.05, summary_exporter=exporter,
                  summary_interval_s=3600):
        for _ in range(30):
            with inferprof.request(model="m"):
                with inferprof.stage("compute"):
                    clock.tick(MS)
        inferprof.shutdown()
        snap = inferprof.instrumentation.stats()
    assert snap.requests_summarised == 30
    assert snap.summary_exports == 0 and snap.summary_exports_failed == 1
    assert snap.summaries_dropped == 30


def test_a_hanging_exporter_costs_shutdown_its_timeout_only(clock):
    release = threading.Event()
    exporter = MemoryExporter(block=release)
    try:
        with captured(mode="production", max_timed_rate=0, summary_exporter=exporter,
                      summary_interval_s=0.05):
            with inferprof.request(model="m"):
                with inferprof.stage("compute"):
                    clock.tick(MS)
            assert exporter.called.wait(10)  # stuck in export from now on
            rt = inferprof._config.active_runtime()
            t0 = time.perf_counter()
            for _ in range(200):
                with inferprof.request(model="m"):
                    with inferprof.stage("compute"):
                        clock.tick(MS)
            assert time.perf_counter() - t0 < 2.0
            t0 = time.perf_counter()
            inferprof.shutdown(timeout_millis=1000)
            assert time.perf_counter() - t0 < 2.0
            snap = inferprof.instrumentation.stats()
    finally:
        release.set()
    assert snap.requests_summarised == 201
    # the one in the hanging export and the 200 waiting behind it: not known to arrive
    assert snap.summaries_dropped == 201
    rt.summaries._thread.join(5)  # the export returns once released: it counts nothing
    after = rt.stats.snapshot()
    assert (after.summaries_dropped, after.summary_exports) == (201, 0)


def test_requests_being_folded_when_close_gives_up_count_as_dropped_once(monkeypatch):
    # close() gives up while the export thread folds (not yet exporting): the requests it
    # took off the queue count as dropped, and nothing more when the fold and its export
    # end later: every request summarised is counted once, exported or dropped.
    release = threading.Event()
    folding = threading.Event()
    real = summaries_module.partition_many

    def slow_partition(*args):
        folding.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(summaries_module, "partition_many", slow_partition)
    exporter = MemoryExporter()
    stats = Stats()
    s = Summaries(exporter, None, _SCOPE, stats, interval_s=3600)
    try:
        for i in range(3):
            assert s.add(_entry(i))
        s._wake.set()
        assert folding.wait(10)
        s.close(0.2)
        assert stats.summary_dropped == 3
    finally:
        release.set()
    s._thread.join(10)
    assert (stats.summarised, stats.summary_dropped, stats.summary_exports) == (3, 3, 0)


def test_settings_and_environment(monkeypatch, caplog):
    exporter = MemoryExporter()
    with captured(mode="production", summary_exporter=exporter):
        rt = inferprof._config.active_runtime()
        assert rt.summaries is not None and rt.summaries.interval_s == 5.0
    with captured(mode="production", summaries=False, summary_exporter=exporter):
        assert inferprof._config.active_runtime().summaries is None
    with captured(mode="full", summary_exporter=exporter):  # production mode only
        assert inferprof._config.active_runtime().summaries is None
    monkeypatch.setenv("INFERPROF_SUMMARY_INTERVAL", "0.5")
    with captured(mode="production", summary_exporter=exporter):
        assert inferprof._config.active_runtime().summaries.interval_s == 0.5
    monkeypatch.setenv("INFERPROF_SUMMARIES", "false")
    with captured(mode="production", summary_exporter=exporter):
        assert inferprof._config.active_runtime().summaries is None
    monkeypatch.setenv("INFERPROF_SUMMARIES", "maybe")
    monkeypatch.setenv("INFERPROF_SUMMARY_INTERVAL", "-3")
    with captured(mode="production", summary_exporter=exporter):
        assert inferprof._config.active_runtime().summaries.interval_s == 5.0
    assert "INFERPROF_SUMMARIES" in caplog.text and "INFERPROF_SUMMARY_INTERVAL" in caplog.text
    for bad in ({"summaries": "yes"}, {"summary_interval_s": 0}, {"summary_interval_s": -1.0}):
        with pytest.raises(ValueError):
            inferprof.configure(mode="production", **bad)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX only")
def test_a_forked_child_summarises_its_own_requests_on_a_thread_of_its_own():
    exporter = MemoryExporter()
    stats = Stats()
    s = Summaries(exporter, None, None, stats, interval_s=3600)
    try:
        assert s.add(_entry(0))  # the parent's: the child must not send it
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 if its summaries work and hold its own
            ok = False
            try:
                assert s._thread.is_alive()
                assert s.add(_entry(1)) and s.add(_entry(2))
                s.close(10)
                (data,) = exporter.exports
                (metric,) = [m for m in data.resource_metrics[0].scope_metrics[0].metrics
                             if m.name == semconv.METRIC_SUMMARY_REQUEST_DURATION]
                ok = sum(p.count for p in metric.data.data_points) == 2
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        s.close(10)
    assert stats.summary_exports == 1 and len(exporter.exports) == 1


def test_a_cancelled_request_is_no_error_in_its_summary_as_in_its_trace(clock):
    # A cancelled request (a client gone, a timeout) ends with status UNSET and
    # inferprof.cancelled, not ERROR: its summary must not count an error its trace would
    # not.
    exporter = MemoryExporter()

    async def service() -> None:
        async def one(i: int) -> None:
            async with inferprof.request(model="m"):
                with inferprof.stage("compute"):
                    clock.tick(MS * (i + 1))
                if i % 2:
                    await asyncio.sleep(3600)  # cancelled here

        tasks = [asyncio.create_task(one(i)) for i in range(6)]
        for _ in range(5):
            await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    with captured(mode="production", max_timed_rate=0, sample_rate=1.0, summary_exporter=exporter,
                  summary_interval_s=3600) as cap:
        asyncio.run(service())
        inferprof.shutdown()
        spans = cap.spans()
    requests = [s for s in spans if _is_request(s)]
    assert len(requests) == 6
    assert sum(bool((r.attributes or {}).get(semconv.ATTR_CANCELLED)) for r in requests) == 3
    assert all(r.status.status_code is not StatusCode.ERROR for r in requests)
    got = decode(exporter.exports)
    (key,) = got[semconv.METRIC_SUMMARY_REQUEST_DURATION]  # no error data point
    assert dict(key) == {semconv.ATTR_MODEL_NAME: "m"}
    assert_summaries_match(exporter, spans)


def test_requests_past_the_fold_threshold_wake_the_thread_whatever_the_interleaving(
        monkeypatch):
    # Two request threads appending around the threshold: the second appends between the
    # first's append and its length check, so neither sees the threshold itself. The
    # waiting requests must still be folded before the interval (not held up to it, past
    # it dropped when the buffer fills). (No fold each second here: the threshold's.)
    from collections import deque

    monkeypatch.setattr(summaries_module, "_FOLD_EVERY_S", 3600.0)
    stats = Stats()
    s = Summaries(MemoryExporter(), None, None, stats, interval_s=3600, max_pending=64)

    class Preempted(deque):
        def append(self, entry):
            super().append(entry)
            if len(self) == s._fold_at and not getattr(self, "interleaved", False):
                self.interleaved = True
                s.add(_entry(999))  # another thread, between this append and its check

    try:
        s._pending = Preempted()
        for i in range(s._fold_at):
            assert s.add(_entry(i))
        deadline = time.monotonic() + 5
        while s._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not s._pending, "the waiting requests were not folded"
    finally:
        s.close(5)


def test_waiting_requests_are_folded_each_period_and_exported_each_interval(monkeypatch):
    # A fold runs on the service's cores and delays the requests in flight for as long as
    # it runs: the summaries fold what waits every _FOLD_EVERY_S, a fraction of what
    # an interval holds at a time, and export once an interval, all of it.
    monkeypatch.setattr(summaries_module, "_FOLD_EVERY_S", 0.05)
    stats = Stats()
    exporter = MemoryExporter()
    s = Summaries(exporter, None, None, stats, interval_s=3600)
    try:
        for batch in range(3):
            for i in range(10):
                assert s.add(_entry(10 * batch + i))
            deadline = time.monotonic() + 5
            while s._folded < 10 * (batch + 1) and time.monotonic() < deadline:
                time.sleep(0.01)
            with s._account:
                assert not s._pending, "the waiting requests were not folded"
                assert s._folded == 10 * (batch + 1)  # folded, not exported: the interval's
            assert not exporter.exports
    finally:
        s.close(5)
    assert stats.summary_exports == 1 and not stats.summary_dropped
    (count,) = [p.count for data in exporter.exports for rm in data.resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics
                if m.name == semconv.METRIC_SUMMARY_REQUEST_DURATION
                for p in m.data.data_points]
    assert count == 30


def test_a_request_ending_as_the_summaries_close_is_exported_or_counted_dropped():
    # A request's thread passes add()'s check, then shutdown closes the summaries (their
    # last fold and export done) before its append: that request must count as dropped,
    # not vanish while counted as summarised (its kept trace marked counted).
    from collections import deque

    stats = Stats()
    exporter = MemoryExporter()
    s = Summaries(exporter, None, None, stats, interval_s=3600)

    class LateAppend(deque):
        def append(self, entry):
            s.close(5)  # the shutdown thread, between the check and the append
            super().append(entry)

    assert s.add(_entry(0))
    s._pending = LateAppend(s._pending)
    s.add(_entry(1))
    exported = sum(p.count for data in exporter.exports for rm in data.resource_metrics
                   for sm in rm.scope_metrics for m in sm.metrics
                   if m.name == semconv.METRIC_SUMMARY_REQUEST_DURATION
                   for p in m.data.data_points)
    assert exported == 1
    assert stats.summarised == 2
    assert stats.summary_dropped == 1


def test_the_summaries_model_is_the_one_the_collector_reads_off_the_trace(clock):
    # The collector's model for a request: inferprof.model.name, else the GenAI names
    # (gen_ai.response.model, then gen_ai.request.model), else a stage span's; one that
    # is not a string is none. The summary's data points must name the same series.
    exporter = MemoryExporter()
    cases = [
        ({semconv.ATTR_GEN_AI_REQUEST_MODEL: "llama"}, {}, "llama"),
        ({semconv.ATTR_GEN_AI_REQUEST_MODEL: "a", semconv.ATTR_GEN_AI_RESPONSE_MODEL: "b"},
         {}, "b"),
        ({}, {semconv.ATTR_MODEL_NAME: "from-stage"}, "from-stage"),
        ({semconv.ATTR_MODEL_NAME: 3}, {}, None),
    ]
    with captured(mode="production", max_timed_rate=0, sample_rate=1.0, summary_exporter=exporter,
                  summary_interval_s=3600):
        for request_attrs, stage_attrs, _ in cases:
            with inferprof.request(**request_attrs):
                with inferprof.stage("compute", **stage_attrs):
                    clock.tick(MS)
        inferprof.shutdown()
    got = decode(exporter.exports)[semconv.METRIC_SUMMARY_REQUEST_DURATION]
    models = Counter(dict(k).get(semconv.ATTR_MODEL_NAME) for k, d in got.items()
                     for _ in range(d["count"]))
    assert models == Counter(want for _, _, want in cases)


def test_a_process_exiting_without_shutdown_still_exports_its_last_summaries(tmp_path):
    # The SDK flushes the kept traces at exit (marked counted); the last interval's
    # summaries must go too, or those requests count nowhere.
    import subprocess
    import sys
    import textwrap

    out = tmp_path / "exported"
    script = textwrap.dedent(f"""
        import inferprof
        from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter)

        class FileExporter(MetricExporter):
            def export(self, metrics_data, timeout_millis=10_000, **kwargs):
                n = sum(p.count for rm in metrics_data.resource_metrics
                        for sm in rm.scope_metrics for m in sm.metrics
                        if m.name == {semconv.METRIC_SUMMARY_REQUEST_DURATION!r}
                        for p in m.data.data_points)
                with open({str(out)!r}, "a") as f:
                    f.write(f"{{n}}\\n")
                return MetricExportResult.SUCCESS

            def force_flush(self, timeout_millis=10_000):
                return True

            def shutdown(self, timeout_millis=30_000, **kwargs):
                pass

        inferprof.configure(mode="production", sample_rate=1.0, summary_interval_s=3600,
                            summary_exporter=FileExporter(), metric_readers=[],
                            span_exporter=InMemorySpanExporter())
        for _ in range(3):
            with inferprof.request(model="m"), inferprof.stage("compute"):
                pass
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60, env=env, cwd=root)
    assert out.read_text().split() == ["3"]


def test_untimed_stages_setting_and_environment(monkeypatch, caplog):
    exporter = MemoryExporter()
    with captured(mode="production", summary_exporter=exporter):  # on by default
        assert inferprof._config.active_runtime().untimed_stages is True
    with captured(mode="production", untimed_stages=False, summary_exporter=exporter):
        assert inferprof._config.active_runtime().untimed_stages is False
    with captured(mode="production", summaries=False, summary_exporter=exporter):
        assert inferprof._config.active_runtime().untimed_stages is False  # no summaries
    with captured(mode="full", summary_exporter=exporter):
        assert inferprof._config.active_runtime().untimed_stages is False
    monkeypatch.setenv("INFERPROF_UNTIMED_STAGES", "false")
    with captured(mode="production", summary_exporter=exporter):
        assert inferprof._config.active_runtime().untimed_stages is False
    monkeypatch.setenv("INFERPROF_UNTIMED_STAGES", "perhaps")
    with captured(mode="production", summary_exporter=exporter):
        assert inferprof._config.active_runtime().untimed_stages is True
    assert "INFERPROF_UNTIMED_STAGES" in caplog.text
    with pytest.raises(ValueError):
        inferprof.configure(mode="production", untimed_stages="yes")
