"""Production mode's timing budget: above ``max_timed_rate`` requests a second per route, a
random share of requests is timed, the rest cost what ``off`` costs, and the kept traces'
weights include the share so that weighted figures stay unbiased."""

import asyncio
import logging
import math
import os
import random

import httpx
import pytest
from fastapi import FastAPI

import inferprof
import inferprof.fastapi
from inferprof import semconv
from inferprof.batching.hooks import enqueue
from inferprof.instrumentation import sampling
from inferprof.instrumentation.sampling import TimingBudget
from tests.instrumentation.helpers import captured


class Clock:
    """Moved by the test, and by ``step`` at each reading: the budget reads it once a
    request, so ``step`` sets a steady request rate (1 / step a second; 0: frozen)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.step = 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _over_budget(clock: Clock, key: object, rate: int) -> None:
    """Give the active runtime a budget of 100 a second on ``clock``, from now on moving
    at ``rate`` requests a second, steady, and run two tenths of a second of ``key``'s: its
    next requests are timed at 100 / ``rate`` rounded down to a power of two (a steady
    rate: within each period's cap at that share)."""
    rt = inferprof._config.active_runtime()
    rt.timing_budget = TimingBudget(100, clock=clock)
    clock.step = 1 / rate
    for _ in range(rate // 5):
        rt.timing_budget.share(key)


def test_share_is_the_budget_over_the_previous_periods_rate():
    clock = Clock()
    budget = TimingBudget(100, clock=clock)
    for _ in range(400):
        budget.share("/a")
    for _ in range(50):
        budget.share("/b")
    clock.now += 1.0
    assert budget.share("/a") == pytest.approx(0.25)  # 400 a second, 100 to time
    assert budget.share("/b") == 1.0  # under budget: every request
    assert budget.share("/new") == 1.0
    clock.now += 1.0  # a quiet second for /a (one request): back to every request
    assert budget.share("/a") == 1.0


def test_within_a_period_requests_past_its_budget_are_timed_at_the_budget_over_the_count():
    # The first period, or a burst above the last period's rate: the share drawn is known
    # before each draw (so the weights stay exact), and a period times about its budget
    # (rate x 0.1 s) plus half of it per doubling of the requests past it.
    clock = Clock()
    budget = TimingBudget(100, clock=clock)
    shares = [budget.share("/a") for _ in range(400)]
    assert shares[:10] == [1.0] * 10  # the period's budget: 10, timed in full
    for n, share in enumerate(shares[10:], start=11):
        assert share <= 10 / n < 2 * share  # the cap over the count, a power of two
        assert math.log2(share) == int(math.log2(share))
    assert 36 <= sum(shares) <= 38  # 10 + 5 x log2(40): timed in expectation, not 400
    # a route marked summarised, capped at its own rate (10 a second: 1 a period)
    budget = TimingBudget(100, clock=clock, summarised_rate=10)
    budget.summarised("/s", True)
    clock.now += 1.0
    budget.share("/s")  # a new period: the mark applies
    clock.now += 1.0
    shares = [budget.share("/s") for _ in range(64)]
    assert shares[0] == 1.0 and shares[1:3] == [0.5, 0.25] and shares[63] == 2.0**-6
    assert sum(shares) < 1 + 0.5 * 6 + 0.01
    # a steady rate is not capped: each period's count times its share stays in budget
    clock.step = 1 / 300
    shares = [budget.share("/a") for _ in range(600)]
    assert set(shares[60:]) == {0.25}
    # keys past the first _BUDGET_MAX_KEYS share the rare keys' budget, capped alike
    clock.step = 0.0
    clock.now += 1.0
    busy = TimingBudget(100, clock=clock)
    for i in range(sampling._BUDGET_MAX_KEYS):
        busy.share(f"/k{i}")
    rare = [busy.share(f"/id/{i}") for i in range(100)]
    assert rare[:10] == [1.0] * 10 and rare[99] == 2.0**-4


def test_a_route_under_a_rate_below_ten_a_second_is_timed_in_full():
    # Under 10 a second, a tenth's budget is under one request: each tenth still times its
    # first request in full, so a route under its rate is timed in full, as it was before
    # the cap within the tenth (sparse traffic included).
    clock = Clock()
    for rate, summarised, per_second in ((1, None, 1), (2, None, 1), (5, None, 2), (100, 2, 1)):
        budget = TimingBudget(rate, clock=clock, summarised_rate=summarised)
        budget.summarised("/a", True)
        clock.step = 1 / per_second
        assert [budget.share("/a") for _ in range(20)] == [1.0] * 20, (rate, summarised)
    clock.step = 0.0
    clock.now += 1.0
    burst = [budget.share("/a") for _ in range(8)]  # 8 at once: capped from the second
    assert burst == [1.0, 0.5, 0.25, 0.25, 0.125, 0.125, 0.125, 0.125]


def test_the_rate_is_the_mean_over_an_idle_spell():
    clock = Clock()
    budget = TimingBudget(10, clock=clock)
    for _ in range(100):
        budget.share("/a")
    clock.now += 5.0  # the period ends at the first request after it: 100 in 5 s
    assert budget.share("/a") == pytest.approx(0.5)  # 20 a second, twice the budget


def test_keys_beyond_the_cap_are_counted_with_the_rare_ones_and_memory_stays_bounded(
        monkeypatch):
    monkeypatch.setattr(sampling, "_BUDGET_MAX_KEYS", 8)
    clock = Clock()
    budget = TimingBudget(10, clock=clock)
    for i in range(1000):
        budget.share(f"/items/{i}")
    assert len(budget._counts) <= 9
    clock.now += 1.0
    # 1 000 paths seen once (8 counted on their own, 992 past the cap): one budget of 10,
    # a share of 10/1000 rounded down to a power of two
    assert budget.share("/items/5000") == 2.0**-7
    assert budget.share("/items/3") == 2.0**-7


def test_paths_with_ids_are_capped_like_one_route():
    random.seed(21)
    clock = Clock()
    budget = TimingBudget(100, clock=clock)
    timed = {}
    for rate in (300, 1000, 5000):
        start = clock.now
        n = 0
        for i in range(2 * rate):  # two seconds of requests, each to a path of its own
            clock.now = start + i / rate
            n += random.random() < budget.share(f"/v1/jobs/{rate}-{i}")
        timed[rate] = n / 2
    # in the first tenth of a second of each rate, the first 64 paths timed in full (each
    # a key of its own, seen once) and the others at the rare keys' budget over their
    # count so far; then 50 to 100 a second (the share rounded down to a power of two)
    assert timed[300] <= 0.7 * 300
    assert 40 <= timed[1000] <= 160
    assert 40 <= timed[5000] <= 400
    # a route seen more than once per period keeps a budget of its own beside them
    clock.now += 1.0
    budget.share("/v1/warm")  # a fresh period starts here
    for i in range(100):  # a tenth of a second: 1 000 a second of each
        budget.share(f"/v1/jobs/x-{i}")
        budget.share("/v1/generate")
        clock.now += 0.001
    # 0.1 and 0.1/1.01, rounded down to a power of two
    assert budget.share("/v1/generate") == 2.0**-4
    assert budget.share("/v1/jobs/new") == 2.0**-4


def test_shares_are_powers_of_two_at_most_the_budget_over_the_rate():
    clock = Clock()
    budget = TimingBudget(100, clock=clock)
    for n in (101, 150, 199, 200, 201, 399, 400, 401, 1000, 12345):
        for _ in range(n):
            budget.share("/a")
        clock.now += 1.0
        share = budget.share("/a")
        assert share <= 100 / n < 2 * share  # the largest power of two under the share
        assert math.log2(share) == int(math.log2(share))
        clock.now += 1.0
        budget.share("/a")  # a quiet second: back to every request
        clock.now += 1.0


@pytest.mark.parametrize("bad", [-1, float("inf"), "100", True])
def test_bad_max_timed_rate_is_refused(bad):
    with pytest.raises(ValueError, match="max_timed_rate"):
        inferprof.configure(mode="production", max_timed_rate=bad, span_exporter=None,
                            set_global=False, metric_readers=[])


def test_settings_and_environment(monkeypatch, caplog):
    with captured(mode="production") as _:
        rt = inferprof._config.active_runtime()
        assert rt.timing_budget is not None and rt.timing_budget.rate == 100.0
    with captured(mode="production", max_timed_rate=0):
        assert inferprof._config.active_runtime().timing_budget is None
    with captured(mode="full"):  # full mode times and traces every request
        assert inferprof._config.active_runtime().timing_budget is None
    monkeypatch.setenv("INFERPROF_MAX_TIMED_RATE", "250")
    with captured(mode="production"):
        assert inferprof._config.active_runtime().timing_budget.rate == 250.0
    monkeypatch.setenv("INFERPROF_MAX_TIMED_RATE", "lots")
    with caplog.at_level(logging.WARNING), captured(mode="production") as _:
        assert inferprof._config.active_runtime().timing_budget.rate == 100.0
    assert "INFERPROF_MAX_TIMED_RATE" in caplog.text


def _app(record: list) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/run")
    async def run(body: dict):
        with inferprof.stage("tokenize"):
            pass
        handle = enqueue(depth=0)
        record.append((inferprof.current_request(), handle.request))
        with inferprof.request(model="inner") as nested:  # nested: the same request
            record.append(nested)
        with inferprof.stage("postprocess"):
            pass
        return {"ok": body["i"]}

    inferprof.fastapi.instrument(app, model_name="m")
    return app


async def _post(app: FastAPI, n: int) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        for i in range(n):
            assert (await c.post("/v1/run", json={"i": i})).status_code == 200


def test_requests_over_budget_are_timed_at_the_share_and_weighted_by_its_inverse(caplog):
    random.seed(5)
    clock = Clock()
    record: list = []
    app = _app(record)
    # sample_rate 1: every timed request is kept, so the kept traces are the timed ones
    with captured(mode="production", sample_rate=1.0) as cap:
        with caplog.at_level(logging.WARNING, logger="inferprof"):
            _over_budget(clock, "/v1/run", 300)  # 300 a second: a quarter timed
            asyncio.run(_post(app, 400))
        requests = cap.requests()
        spans = cap.spans()
        snap = inferprof.instrumentation.stats()
    timed = 400 - snap.requests_untimed
    assert len(requests) == timed
    assert 60 <= timed <= 140  # binomial(400, 0.25): 100 +- 4.3 sd
    assert {r.attributes[semconv.ATTR_SAMPLE_WEIGHT] for r in requests} == {4.0}
    # every span belongs to a timed request's trace: an untimed request's stages made
    # no span of their own (outside any request they would have)
    traces = {r.context.trace_id for r in requests}
    assert {s.context.trace_id for s in spans} == traces
    assert len(cap.stages("tokenize")) == len(cap.stages("postprocess")) == timed
    assert len(cap.stages("queue")) == timed
    # in an untimed request: no request handle, a queue handle that records nothing, and a
    # nested inferprof.request() that opens nothing (not a request of its own)
    handles = [r for r in record if isinstance(r, tuple)]
    nested = [r for r in record if not isinstance(r, tuple)]
    assert sum(1 for cur, q in handles if cur is None and q is None) == 400 - timed
    assert sum(1 for n in nested if n is None) == 400 - timed
    assert not any(s.attributes.get(semconv.ATTR_MODEL_NAME) == "inner" and
                   s.attributes.get(semconv.ATTR_REQUEST) for s in spans)
    assert "ended" not in caplog.text
    # FastAPI keeps endpoint functions (and so this list, in run()'s closure) in a cache
    record.clear()


def test_untimed_members_of_a_batch_are_counted_in_its_size_and_copy_nothing():
    random.seed(9)
    clock = Clock()
    app = FastAPI()

    async def model(items):
        return [x * 2 for x in items]

    batcher = inferprof.DynamicBatcher(model, max_batch_size=8, max_delay_ms=20)

    @app.post("/v1/run")
    async def run(body: dict):
        return {"y": await batcher.submit(body["i"])}

    inferprof.fastapi.instrument(app)

    async def burst() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for _ in range(10):
                codes = await asyncio.gather(*(c.post("/v1/run", json={"i": i})
                                               for i in range(8)))
                assert all(r.status_code == 200 for r in codes)
        await batcher.stop()

    with captured(mode="production", sample_rate=1.0) as cap:
        _over_budget(clock, "/v1/run", 300)  # a quarter of the 80 requests timed
        asyncio.run(burst())
        requests = cap.requests()
        assemblies = cap.stages(semconv.STAGE_BATCH_ASSEMBLY)
    assert 0 < len(requests) < 40
    assert {r.attributes[semconv.ATTR_SAMPLE_WEIGHT] for r in requests} == {4.0}
    # each timed member carries its batch's stages; the batch size counts every member
    assert len(assemblies) == len(requests)
    copies: dict = {}
    sizes: dict = {}
    for a in assemblies:
        batch_id = a.attributes[semconv.ATTR_BATCH_ID]
        copies[batch_id] = copies.get(batch_id, 0) + 1
        sizes[batch_id] = a.attributes[semconv.ATTR_BATCH_SIZE]
    assert all(copies[b] <= sizes[b] for b in copies)
    assert any(copies[b] < sizes[b] for b in copies)  # timed and untimed in one batch


def test_a_context_value_does_not_bypass_the_budget_but_another_request_span_does():
    from opentelemetry import baggage
    from opentelemetry import context as context_api

    from tests.fastapi.test_middleware import _app_with_fastapi_tracing

    random.seed(13)
    clock = Clock()
    record: list = []
    app = _app(record)
    with captured(mode="production", sample_rate=1.0) as cap:
        rt = inferprof._config.active_runtime()
        _over_budget(clock, "/v1/run", 300)
        # baggage set for the whole process (no span): requests are still budgeted
        token = context_api.attach(baggage.set_baggage("tenant", "a"))
        try:
            asyncio.run(_post(app, 200))
        finally:
            context_api.detach(token)
        assert 0 < len(cap.requests()) < 100
        record.clear()
        # FastAPI's own request span (fastapi_tracing=True): inferprof enriches it, and
        # its sampler (always on here) decides, so every request is recorded
        traced = _app_with_fastapi_tracing(cap.provider, fastapi_tracing=True)
        cap.clear()
        untimed = rt.stats.untimed
        for _ in range(400):
            rt.timing_budget.share("/v1/run")
        clock.now += 1.0

        async def post() -> None:
            transport = httpx.ASGITransport(app=traced)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                for _ in range(50):
                    await c.post("/v1/run", json={"prompt": "a b"})

        asyncio.run(post())
        assert rt.stats.untimed == untimed
        assert len(cap.stages("tokenize")) == 50


def test_top_level_requests_are_budgeted_by_name_and_model_and_stay_unbiased(cap):
    from inferprof.instrumentation.records import SCOPE

    random.seed(17)
    rng = random.Random(17)
    clock = Clock()
    inferprof.configure(tracer_provider=cap.provider, mode="production", sample_rate=0.05,
                        tail_quantile=0.9)
    _over_budget(clock, (semconv.REQUEST_SPAN_NAME, "m"), 300)  # a quarter timed
    n, untimed = 4000, 0
    for _ in range(n):
        with inferprof.request(model="m") as req:
            with inferprof.stage("compute"):
                pass
            if req is None:
                untimed += 1
            else:  # a synthetic latency, lognormal around 3 ms
                req.start -= int(rng.lognormvariate(15, 1.0))
        assert SCOPE.get() is None
    assert untimed == inferprof.instrumentation.stats().requests_untimed
    assert 0.2 * n < n - untimed < 0.3 * n
    weights = [r.attributes.get(semconv.ATTR_SAMPLE_WEIGHT, 1.0) for r in cap.requests()]
    # 1/0.25 for a slow request (or the sampler's warm-up), 1/(0.25 x 0.05) for a fast one
    assert set(weights) == {4.0, 80.0}
    assert abs(sum(weights) - n) / n < 0.2  # unbiased (sd ~ 7%)
    assert len(cap.stages("compute")) == len(weights)


def test_an_untimed_request_passes_its_trace_context_downstream():
    from opentelemetry import trace as trace_api

    from inferprof.triton import _call

    random.seed(3)
    clock = Clock()
    trace_id = 0x0AF7651916CD43DD8448EB211C80319C
    seen: list = []
    app = FastAPI()

    @app.post("/v1/run")
    async def run(body: dict):
        call = _call.begin({})
        current = trace_api.get_current_span().get_span_context()
        seen.append((inferprof.current_request() is None, call, current))
        if call is not None:
            call.end()
        return {}

    inferprof.fastapi.instrument(app)
    headers = {"traceparent": f"00-{trace_id:032x}-b7ad6b7169203331-01"}

    async def post(n: int) -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for _ in range(n):
                await c.post("/v1/run", json={}, headers=headers)

    with captured(mode="production", sample_rate=1.0) as cap:
        _over_budget(clock, "/v1/run", 1000)  # a tenth timed
        asyncio.run(post(40))
        networks = cap.stages(semconv.STAGE_NETWORK)
    untimed = [(call, current) for none, call, current in seen if none]
    assert untimed and len(untimed) < 40
    for call, current in untimed:
        # nothing recorded, and the caller's trace goes on to Triton and to any
        # OpenTelemetry-instrumented client
        assert call.rec is None and call.span is None
        assert call.context.trace_id == trace_id == current.trace_id
    assert len(networks) == 40 - len(untimed)  # the timed ones' network stages
    assert trace_api.get_current_span().get_span_context().is_valid is False
    seen.clear()


def test_threads_sharing_a_budget_get_valid_shares_and_memory_stays_bounded():
    # (The race the roll guards against, a dict growing under its loop, is too narrow to
    # hit on purpose here: this checks the budget under threads, not that race.)
    import itertools
    import sys
    import threading

    ticks = itertools.count()
    # a clock 10 µs on at every read: the budget rolls every 10 000 calls, mid-traffic
    budget = TimingBudget(50, clock=lambda: next(ticks) * 1e-5)
    errors: list = []
    shares: list = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, mid-roll included
    try:
        def work(t: int) -> None:
            try:
                for i in range(20000):
                    shares.append(budget.share(f"/k/{t}-{i % 200}" if i % 3 else "/hot"))
            except Exception as exc:  # share() must never raise
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors
    assert len(shares) == 80000 and all(0.0 < s <= 1.0 for s in shares)
    assert min(shares) < 1.0  # the budget did cut in
    assert len(budget._counts) <= sampling._BUDGET_MAX_KEYS + 1


class CpuClock:
    """The process's CPU seconds, advanced by the test."""

    def __init__(self) -> None:
        self.cpu = 10.0

    def __call__(self) -> float:
        return self.cpu


def _period(budget: TimingBudget, clock: Clock, cpu: CpuClock, requests: int,
            cpu_per_request: float, key: object = "/a") -> float:
    """One period of ``requests`` costing the process ``cpu_per_request`` each; the share
    the next request is timed with."""
    for _ in range(requests):
        budget.share(key)
        cpu.cpu += cpu_per_request
    clock.now += 0.1
    return budget.share(key)


def test_the_cpu_guard_times_every_request_of_a_service_whose_requests_cost_milliseconds():
    clock, cpu = Clock(), CpuClock()
    budget = TimingBudget(None, clock=clock, max_cpu=0.02, cpu_clock=cpu)
    # 2.5 ms of CPU a request: 60 µs of timing is 2.4%... of which 2% allowed: not all
    assert _period(budget, clock, cpu, 200, 2.5e-3) == 0.5
    # 5 ms a request: 1.2%, every request timed, however many there are
    assert _period(budget, clock, cpu, 2000, 5e-3) == 1.0
    assert all(budget.share(f"/r{i}") == 1.0 for i in range(100))


def test_the_cpu_guard_share_keeps_timing_within_its_share_of_the_cpu():
    clock, cpu = Clock(), CpuClock()
    budget = TimingBudget(None, clock=clock, max_cpu=0.03, cpu_clock=cpu)
    for per_request in (20e-6, 110e-6, 430e-6, 1.1e-3, 1.9e-3, 10e-3):
        share = _period(budget, clock, cpu, 500, per_request)
        wanted = 0.03 * per_request / sampling.TIMED_REQUEST_CPU_S
        if wanted >= 1:
            assert share == 1.0
        else:  # the largest power of two at most the share that fits the CPU
            assert share <= wanted < 2 * share
            assert math.log2(share) == int(math.log2(share))
        # what timing costs at that share, in the guard's own estimate, fits the cap
        assert share * sampling.TIMED_REQUEST_CPU_S <= 0.03 * per_request or share == 1.0


def test_with_both_caps_a_request_is_timed_with_the_smaller_share():
    clock, cpu = Clock(), CpuClock()
    budget = TimingBudget(100, clock=clock, max_cpu=0.03, cpu_clock=cpu)
    # 1 000 a second (100 in the period) at 1 ms each: the rate cap 1/16 (100/s of
    # 1 000/s, rounded), the guard 1/2 (0.03 * 1 ms / 60 µs)
    assert _period(budget, clock, cpu, 100, 1e-3) == 2.0**-4
    # the same rate at 100 µs a request: the guard's 2**-5 is smaller
    assert _period(budget, clock, cpu, 100, 100e-6) == 2.0**-5


def test_the_cpu_guard_setting_and_its_weights(monkeypatch):
    monkeypatch.setenv("INFERPROF_MAX_TIMING_CPU", "0.02")
    with captured(mode="production", max_timed_rate=0):
        rt = inferprof._config.active_runtime()
        assert rt.timing_budget is not None and rt.timing_budget.max_cpu == 0.02
        assert rt.timing_budget.rate is None
    with captured(mode="production", max_timed_rate=0, max_timing_cpu=0):
        assert inferprof._config.active_runtime().timing_budget is None  # every request
    with pytest.raises(ValueError, match="max_timing_cpu"):
        inferprof.configure(mode="production", max_timing_cpu=1.5)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
def test_a_child_forked_while_a_thread_holds_the_budgets_lock_can_still_time_requests():
    budget = TimingBudget(100)
    tail = sampling.TailSampler(0.05, 0.9)
    budget._lock.acquire()  # a thread of the parent's inside _roll() / decide() at the fork
    tail._lock.acquire()
    try:
        pid = os.fork()
        if pid == 0:  # the child: both must answer, not wait for ever
            ok = budget._lock.acquire(timeout=2) and tail._lock.acquire(timeout=2)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        budget._lock.release()
        tail._lock.release()
    assert os.waitstatus_to_exitcode(status) == 0
