"""``max_timed_rate_summarised``: on a route whose untimed requests are summarised with their
stage times, every request is in the summaries whether it is timed or not, so its timed
requests only feed traces, and the timing budget caps them at a lower rate (default 10 a
second) than ``max_timed_rate`` (100). A route turned to counting only (its requests hold
what a summarised record cannot) and a path with parameters in it keep ``max_timed_rate``.
Real ``TimingBudget`` objects on a clock the test moves; real FastAPI apps in-process."""

from __future__ import annotations

import asyncio
import gc
import logging
import random

import httpx
import pytest
from fastapi import FastAPI

import inferprof
import inferprof.fastapi
from inferprof import semconv
from inferprof.batching import hooks
from inferprof.instrumentation.device import EventDevice
from inferprof.instrumentation.sampling import TimingBudget
from tests.fastapi.budget_helpers import BudgetClock
from tests.fastapi.test_untimed_summarised import _app, _send
from tests.instrumentation.helpers import captured
from tests.instrumentation.test_device import SyntheticEvent, SyntheticStream
from tests.instrumentation.test_summaries import MemoryExporter

_MODEL = semconv.ATTR_MODEL_NAME


def _period(budget: TimingBudget, clock: BudgetClock, per_key: dict[str, int]) -> None:
    """One second in which each key had ``per_key`` requests (the period before it ended
    first); the next period's shares follow from it."""
    clock.now += 1.0
    budget.share("<roll>")
    for key, n in per_key.items():
        for _ in range(n):
            budget.share(key)
    clock.now += 1.0


def test_a_key_marked_summarised_is_timed_at_the_lower_rate():
    clock = BudgetClock()
    budget = TimingBudget(100, clock=clock, summarised_rate=10)
    budget.summarised("/a", True)
    _period(budget, clock, {"/a": 360, "/b": 360})
    assert budget.share("/a") == 2.0 ** -6  # 10 of 360: 1/36, rounded down to 1/64
    assert budget.share("/b") == 0.25  # 100 of 360
    # Under the lower rate, every request is timed, marked or not
    _period(budget, clock, {"/a": 8, "/b": 8})
    assert budget.share("/a") == budget.share("/b") == 1.0
    # Unmarked (its route turned to counting only): max_timed_rate again
    budget.summarised("/a", False)
    _period(budget, clock, {"/a": 360})
    assert budget.share("/a") == 0.25


def test_a_summarised_rate_at_or_above_the_rate_changes_nothing_and_marks_stay_bounded():
    clock = BudgetClock()
    budget = TimingBudget(100, clock=clock, summarised_rate=200)
    budget.summarised("/a", True)
    _period(budget, clock, {"/a": 360})
    assert budget.share("/a") == 0.25
    # At most 64 keys marked: later ones keep max_timed_rate, memory stays bounded
    low = TimingBudget(100, clock=clock, summarised_rate=10)
    for i in range(1000):
        low.summarised(f"/p{i}", True)
    assert len(low._summarised_keys) == 64
    _period(low, clock, {"/p0": 360, "/p999": 360})
    assert low.share("/p0") == 2.0 ** -6 and low.share("/p999") == 0.25
    with pytest.raises(ValueError, match="summarised_rate"):
        TimingBudget(100, summarised_rate=0)


def _summarised_capture(exporter):
    return captured(mode="production", max_timed_rate=100, max_timed_rate_summarised=10,
                    sample_rate=0.05, summary_exporter=exporter, summary_interval_s=3600)


def _budget(rt) -> BudgetClock:
    """The runtime's budget, rebuilt as configure() built it, on a clock the test moves."""
    clock = BudgetClock()
    old = rt.timing_budget
    rt.timing_budget = TimingBudget(old.rate, clock=clock, summarised_rate=old.summarised_rate)
    return clock


def test_a_summarised_route_is_timed_at_the_lower_rate_and_still_summarised_in_full(
        clock, monkeypatch):
    random.seed(3)
    monkeypatch.setattr(hooks, "_time_ns", clock)
    log: list = []
    app = _app(clock, log)
    with _summarised_capture(MemoryExporter()) as _:
        rt = inferprof._config.active_runtime()
        budget_clock = _budget(rt)
        asyncio.run(_send(app, [0]))  # under the budget: timed; the route is learnt
        _period(rt.timing_budget, budget_clock, {"/work": 360})
        assert rt.timing_budget.share("/work") == 2.0 ** -6
        n = 400
        asyncio.run(_send(app, list(range(1, n + 1))))
        snap = inferprof.instrumentation.stats()
    timed = sum(1 for _, t in log[1:] if t)
    # at 1/64 (expected 6); at max_timed_rate's 1/4 it would be ~100
    assert timed <= 20, timed
    # and every request is in the summaries all the same
    assert snap.requests_untimed_summarised == n - timed
    assert snap.requests_summarised == n + 1
    assert snap.summaries_dropped == 0


def test_a_route_turned_to_counting_only_is_timed_at_max_timed_rate_again(
        clock, monkeypatch):
    monkeypatch.setattr(hooks, "_time_ns", clock)
    log: list = []
    app = _app(clock, log, device_from=1)  # requests from 1 on hold a device stage
    with _summarised_capture(MemoryExporter()) as _:
        rt = inferprof._config.active_runtime()
        budget_clock = _budget(rt)
        asyncio.run(_send(app, [0]))
        _period(rt.timing_budget, budget_clock, {"/work": 360})
        assert rt.timing_budget.share("/work") == 2.0 ** -6
        # An untimed request with a device stage turns the route to counting only: its
        # figures come from its timed requests again, at max_timed_rate
        random.seed(1)
        for i in range(1, 200):
            asyncio.run(_send(app, [i]))
            if any(not t for j, t in log if j >= 1):
                break
        assert any(not t for j, t in log if j >= 1), "no request went untimed"
        _period(rt.timing_budget, budget_clock, {"/work": 360})
        assert rt.timing_budget.share("/work") == 0.25


def test_a_path_with_parameters_keeps_max_timed_rate(monkeypatch):
    app = FastAPI()

    @app.get("/items/{i}")
    async def item(i: int):
        with inferprof.stage("lookup"):
            pass
        return {"i": i}

    inferprof.fastapi.instrument(app, model_name="m")

    async def get(n: int) -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for _ in range(n):
                assert (await c.get("/items/7")).status_code == 200

    with _summarised_capture(MemoryExporter()) as _:
        rt = inferprof._config.active_runtime()
        budget_clock = _budget(rt)
        asyncio.run(get(3))  # timed, summarised: the route is counted
        _period(rt.timing_budget, budget_clock, {"/items/7": 360})
        # each value of {i} would be a key of the budget's own: not marked
        assert rt.timing_budget.share("/items/7") == 0.25


def test_the_setting_and_its_environment_variable(monkeypatch, caplog):
    def production(**options):
        return captured(mode="production", summary_exporter=MemoryExporter(), **options)

    with production():
        budget = inferprof._config.active_runtime().timing_budget
        assert budget.rate == 100.0 and budget.summarised_rate == 10.0
    with production(max_timed_rate_summarised=0):
        assert inferprof._config.active_runtime().timing_budget.summarised_rate is None
    # Untimed requests only counted: the timed ones give the figures, at max_timed_rate
    with production(untimed_stages=False):
        assert inferprof._config.active_runtime().timing_budget.summarised_rate is None
    # No summaries: nothing but the timed requests gives figures
    with captured(mode="production"):
        assert inferprof._config.active_runtime().timing_budget.summarised_rate is None
    monkeypatch.setenv("INFERPROF_MAX_TIMED_RATE_SUMMARISED", "25")
    with production():
        assert inferprof._config.active_runtime().timing_budget.summarised_rate == 25.0
    monkeypatch.setenv("INFERPROF_MAX_TIMED_RATE_SUMMARISED", "lots")
    with caplog.at_level(logging.WARNING), production():
        assert inferprof._config.active_runtime().timing_budget.summarised_rate == 10.0
    assert "INFERPROF_MAX_TIMED_RATE_SUMMARISED" in caplog.text
    assert "0: max_timed_rate's" in caplog.text  # (not "no limit": 0 is not that here)
    with pytest.raises(ValueError, match=r"max_timed_rate_summarised.*0: max_timed_rate's"):
        inferprof.configure(mode="production", max_timed_rate_summarised=-1,
                            span_exporter=None, set_global=False, metric_readers=[])


def _two_routes_on_one_path() -> FastAPI:
    """POST /work: summarised under one model; GET /work (another route, the same path and
    so the same key of the budget): its timed requests name the model of the query
    string, two models turning its untimed requests to not counted at all."""
    app = FastAPI()

    @app.post("/work")
    async def post():
        req = inferprof.current_request()
        if req is not None:
            req.set_attribute(_MODEL, "m")
        with inferprof.stage("compute"):
            pass
        return {}

    @app.get("/work")
    async def get(m: str):
        req = inferprof.current_request()
        if req is not None:
            req.set_attribute(_MODEL, m)
        with inferprof.stage("compute"):
            pass
        return {}

    inferprof.fastapi.instrument(app)
    return app


async def _calls(app: FastAPI, calls: list[tuple[str, str]]) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        for method, url in calls:
            assert (await c.request(method, url)).status_code == 200


@pytest.mark.parametrize("order", ["post last", "post first"])
def test_a_path_shared_with_a_route_not_summarised_keeps_max_timed_rate(order):
    # GET /work's untimed requests are not counted (two models): its figures come from
    # its timed requests alone, so the path (the budget's key for both routes) must stay
    # at max_timed_rate, whichever route's timed request came last.
    app = _two_routes_on_one_path()
    post, gets = ("POST", "/work"), [("GET", "/work?m=a"), ("GET", "/work?m=b")]
    calls = [*gets, post, post] if order == "post last" else [post, *gets, post]
    with _summarised_capture(MemoryExporter()) as _:
        rt = inferprof._config.active_runtime()
        budget_clock = _budget(rt)
        asyncio.run(_calls(app, calls))  # all under the budget: timed
        _period(rt.timing_budget, budget_clock, {"/work": 360})
        assert rt.timing_budget.share("/work") == 0.25
        # and still after more of the summarised route's timed requests
        asyncio.run(_calls(app, [("POST", "/work")] * 3))
        _period(rt.timing_budget, budget_clock, {"/work": 360})
        assert rt.timing_budget.share("/work") == 0.25


def test_a_path_of_two_summarised_routes_is_timed_at_the_lower_rate():
    app = _two_routes_on_one_path()
    with _summarised_capture(MemoryExporter()) as _:
        rt = inferprof._config.active_runtime()
        budget_clock = _budget(rt)
        asyncio.run(_calls(app, [("GET", "/work?m=m"), ("POST", "/work")] * 2))
        _period(rt.timing_budget, budget_clock, {"/work": 360})
        assert rt.timing_budget.share("/work") == 2.0 ** -6


def _work_app() -> FastAPI:
    app = FastAPI()

    @app.post("/work")
    async def work():
        with inferprof.stage("compute"):
            pass
        return {}

    return app


@pytest.mark.parametrize("where", ["mount", "server root path", "both"])
def test_a_route_under_a_mount_or_a_root_path_is_timed_at_the_lower_rate(where):
    # Its path is still one key of the budget: the mount's prefix and the root path the
    # server gives (uvicorn --root-path: in the request's path too, as ASGI has it)
    # included.
    if where == "server root path":
        app, root, path = _work_app(), "/api", "/api/work"
    else:
        app = FastAPI()
        app.mount("/sub", _work_app())
        root, path = ("", "/sub/work") if where == "mount" else ("/api", "/api/sub/work")
    inferprof.fastapi.instrument(app)

    async def post(n: int) -> None:
        transport = httpx.ASGITransport(app=app, root_path=root)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            for _ in range(n):
                assert (await c.post(path)).status_code == 200

    with _summarised_capture(MemoryExporter()) as _:
        rt = inferprof._config.active_runtime()
        budget_clock = _budget(rt)
        asyncio.run(post(3))
        _period(rt.timing_budget, budget_clock, {path: 360})
        assert rt.timing_budget.share(path) == 2.0 ** -6


def test_a_path_shared_with_a_route_turned_to_counting_only_keeps_max_timed_rate():
    # GET /work's untimed requests hold a device stage, which a summarised record cannot
    # time: the first of them turns it to counting only, and the summarised POST /work's
    # timed requests after it must not cap their shared path at the lower rate again.
    app = FastAPI()
    log: list = []

    @app.post("/work")
    async def post():
        with inferprof.stage("compute"):
            pass
        return {}

    @app.get("/work")
    async def get():
        device = EventDevice(lambda: SyntheticEvent(SyntheticStream()))
        with inferprof.stage("h2d", device=device):
            pass
        log.append(inferprof.current_request() is not None)
        return {}

    inferprof.fastapi.instrument(app)
    with _summarised_capture(MemoryExporter()) as _:
        rt = inferprof._config.active_runtime()
        budget_clock = _budget(rt)
        asyncio.run(_calls(app, [("GET", "/work"), ("POST", "/work")]))  # timed: learnt
        _period(rt.timing_budget, budget_clock, {"/work": 360})
        assert rt.timing_budget.share("/work") == 2.0 ** -6
        random.seed(1)
        for _ in range(200):
            asyncio.run(_calls(app, [("GET", "/work")]))
            if not log[-1]:
                break
        assert not log[-1], "no GET went untimed"
        _period(rt.timing_budget, budget_clock, {"/work": 1})  # under the budget again
        asyncio.run(_calls(app, [("POST", "/work")] * 2))  # timed
        _period(rt.timing_budget, budget_clock, {"/work": 360})
        assert rt.timing_budget.share("/work") == 0.25


def test_a_route_not_summarised_that_is_freed_no_longer_holds_its_path_back():
    # Routes rebuilt at runtime: once GET /work (not counted: two models) is gone, the
    # summarised POST /work alone is at its path, which its timed requests mark again.
    app = _two_routes_on_one_path()
    with _summarised_capture(MemoryExporter()) as _:
        rt = inferprof._config.active_runtime()
        budget_clock = _budget(rt)
        asyncio.run(_calls(app, [("GET", "/work?m=a"), ("GET", "/work?m=b"),
                                 ("POST", "/work")]))
        _period(rt.timing_budget, budget_clock, {"/work": 360})
        assert rt.timing_budget.share("/work") == 0.25
        app.router.routes[:] = [r for r in app.router.routes
                                if getattr(r, "methods", None) != {"GET"}]
        gc.collect()
        _period(rt.timing_budget, budget_clock, {"/work": 1})  # under the budget again
        asyncio.run(_calls(app, [("POST", "/work")]))
        _period(rt.timing_budget, budget_clock, {"/work": 360})
        assert rt.timing_budget.share("/work") == 2.0 ** -6
