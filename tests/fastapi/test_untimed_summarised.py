"""Production mode's default (``untimed_stages``): the requests the timing budget leaves
untimed are summarised with their stage times (``records.SummaryRecord``), every request of
a counted route at weight 1 and unmarked. With an in-memory metric exporter and a clock
the test moves, every stage's exported histogram holds exactly one value per request
served, timed or not, in the bucket of that request's own stage time; what a summarised
record cannot hold (a device-timed stage) turns its route to counting only."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
from fastapi import FastAPI

import inferprof
import inferprof.fastapi
from inferprof import semconv
from inferprof.batching import hooks
from inferprof.instrumentation.device import EventDevice
from inferprof.timing import DEFAULT_SUMMARY_SCALE, exp_index
from tests.fastapi.budget_helpers import budgeted_capture
from tests.instrumentation.test_device import SyntheticEvent, SyntheticStream
from tests.instrumentation.test_summaries import MemoryExporter, decode

MS = 1_000_000
_REQ = semconv.METRIC_SUMMARY_REQUEST_DURATION
_STAGE = semconv.METRIC_SUMMARY_STAGE_DURATION
_UNTIMED = semconv.METRIC_SUMMARY_REQUEST_UNTIMED
_MODEL = semconv.ATTR_MODEL_NAME
_MARK = semconv.ATTR_SUMMARY_UNTIMED_COUNTED
_WEIGHT = semconv.ATTR_SAMPLE_WEIGHT


def _durations(i: int) -> dict[str, int]:
    """Request ``i``'s stage times (ns), as the handler spends them on the test's clock."""
    return {
        "tokenize": (1 + i % 5) * MS,
        "queue": (2 + i % 3) * MS + 1_000 * i,
        "compute": (4 + i % 7) * MS + 3_001 * i,
        "postprocess": (1 + i % 2) * MS + 17 * i,
    }


def _app(clock, log: list, device_from: int | None = None) -> FastAPI:
    """POST /work: tokenize (``with``), a batch of its own through the hooks (queue and
    compute), postprocess (a decorated function). Requests from ``device_from`` on also
    enter a device-timed stage, which a summarised record cannot time."""
    app = FastAPI()

    @inferprof.stage("postprocess")
    def postprocess(i: int) -> None:
        clock.tick(_durations(i)["postprocess"])

    @app.post("/work")
    async def work(body: dict):
        i = body["i"]
        d = _durations(i)
        req = inferprof.current_request()  # None: not timed
        if req is not None:
            req.set_attribute(_MODEL, "m")
        with inferprof.stage("tokenize"):
            clock.tick(d["tokenize"])
        handle = inferprof.enqueue()
        clock.tick(d["queue"])
        with inferprof.batch([handle]) as b, b.stage("compute"):
            clock.tick(d["compute"])
        postprocess(i)
        if device_from is not None and i >= device_from:
            # (events of its own: timed by them, timed or not, with or without CUDA here)
            device = EventDevice(lambda: SyntheticEvent(SyntheticStream()))
            with inferprof.stage("h2d", device=device):
                pass
        log.append((i, req is not None))
        return {"i": i}

    inferprof.fastapi.instrument(app)
    return app


async def _send(app: FastAPI, ids: list[int]) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        for i in ids:
            assert (await c.post("/work", json={"i": i})).status_code == 200


def _over_budget(rt, budget_clock) -> None:
    """800 a second on the route: a share of 1/8, most requests untimed."""
    for _ in range(800):
        rt.timing_budget.share("/work")
    budget_clock.now += 1.0


def _bucket(ns: int) -> tuple[int, int]:
    return (DEFAULT_SUMMARY_SCALE, int(exp_index([ns * 1e-9])[0]))


def test_every_request_timed_or_not_is_summarised_with_its_own_stage_times(
        clock, monkeypatch):
    monkeypatch.setattr(hooks, "_time_ns", clock)
    log: list = []
    app = _app(clock, log)
    exporter = MemoryExporter()
    with budgeted_capture(exporter, sample_rate=0.05, untimed_stages=True) as (
            cap, rt, budget_clock):
        asyncio.run(_send(app, [0]))  # under the budget: timed, teaches the route "m"
        _over_budget(rt, budget_clock)
        n = 240
        asyncio.run(_send(app, list(range(1, n + 1))))
        inferprof.shutdown()
        snap = inferprof.instrumentation.stats()
    timed = sum(1 for _, t in log if t)
    assert 1 < timed < n / 3, timed  # most untimed
    assert snap.requests_untimed_summarised == len(log) - timed
    assert snap.requests_untimed_counted == 0 and snap.summaries_dropped == 0
    got = decode(exporter.exports)
    assert _UNTIMED not in got  # none only counted
    # Every request once, at weight 1 and unmarked (the warm-up's too: under the budget)
    assert {k: d["count"] for k, d in got[_REQ].items()} == {((_MODEL, "m"),): n + 1}
    # Each stage: one value per request, in the bucket of its own time
    for name in ("tokenize", "queue", "compute", "postprocess"):
        want = Counter(_bucket(_durations(i)[name]) for i in range(n + 1))
        d = got[_STAGE][((_MODEL, "m"), (semconv.ATTR_STAGE, name))]
        assert d["count"] == n + 1 and d["zero"] == 0, name
        assert d["buckets"] == want, name
    # receive and serialize, timed as for a timed request (the clock stands still there)
    for name in ("receive", "serialize"):
        d = got[_STAGE][((_MODEL, "m"), (semconv.ATTR_STAGE, name))]
        assert d["count"] == d["zero"] == n + 1, name
    # Only the timed share left traces to keep: kept ones say they are counted already
    assert all(s.attributes.get(semconv.ATTR_SUMMARY_COUNTED) for s in cap.requests())


def test_a_stage_a_summarised_record_cannot_time_turns_the_route_to_counting(
        clock, monkeypatch):
    # A device-timed stage (CUDA events) from request 100 on: that untimed request is only
    # counted, and so are the route's untimed requests from then on; its timed requests
    # are then marked and weighted again (contract §15), and every request still counts
    # exactly once.
    monkeypatch.setattr(hooks, "_time_ns", clock)
    log: list = []
    app = _app(clock, log, device_from=100)
    exporter = MemoryExporter()
    with budgeted_capture(exporter, sample_rate=0.05, untimed_stages=True) as (
            _cap, rt, budget_clock):
        asyncio.run(_send(app, [0]))
        _over_budget(rt, budget_clock)
        n = 200
        asyncio.run(_send(app, list(range(1, n + 1))))
        inferprof.shutdown()
        snap = inferprof.instrumentation.stats()
    untimed_before = sum(1 for i, t in log if not t and i < 100)
    untimed_after = sum(1 for i, t in log if not t and i >= 100)
    assert untimed_before > 50 and untimed_after > 50
    assert snap.requests_untimed_summarised == untimed_before
    assert snap.requests_untimed_counted == untimed_after
    got = decode(exporter.exports)
    assert sum(d["count"] for d in got[_UNTIMED].values()) == untimed_after
    # Timed after the first broken one: marked, at the budget's weight; before: census
    first_broken = min(i for i, t in log if not t and i >= 100)
    timed_after = sum(1 for i, t in log if t and i > first_broken)
    marked = total = 0
    for key, d in got[_REQ].items():
        attrs = dict(key)
        total += d["count"]
        if attrs.get(_MARK):
            marked += d["count"]
            assert attrs.get(_WEIGHT, 1.0) > 1  # the budget's weight, for stage figures
        else:
            assert attrs.get(_WEIGHT, 1.0) == 1.0, attrs
    assert marked == timed_after > 0
    # Each request counted once: summarised (timed or not) or counted untimed
    assert total + untimed_after == n + 1
