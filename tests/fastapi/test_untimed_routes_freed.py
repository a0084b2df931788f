"""Routes rebuilt at runtime (a model's routes mounted and unmounted, a router rebuilt) do
not fill the middleware's bound on the routes it learns: a freed route is forgotten and
frees its place, and its id, once another object's, is not read as its (contract §15)."""

from __future__ import annotations

import asyncio
import gc

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

import inferprof
from inferprof import semconv
from inferprof.fastapi import InferprofMiddleware, middleware
from tests.instrumentation.helpers import captured
from tests.instrumentation.test_summaries import MemoryExporter, decode

_UNTIMED = semconv.METRIC_SUMMARY_REQUEST_UNTIMED
_REQ = semconv.METRIC_SUMMARY_REQUEST_DURATION
_MODEL = semconv.ATTR_MODEL_NAME
REBUILDS = 12
BOUND = 3


async def _infer(request):
    return JSONResponse({"ok": True})


def test_routes_freed_at_runtime_are_forgotten_and_new_ones_still_counted(monkeypatch):
    # Each rebuild replaces the app's one route by a new Route object (the old one freed),
    # then serves a timed request (the route learns its model) and an untimed one (counted
    # if the route was learnt). With the bound at 3 routes, every rebuild's untimed
    # request is counted only if freed routes give their places back.
    app = Starlette(routes=[])
    mw = InferprofMiddleware(app, model_name="m")
    timed = iter([True, False] * REBUILDS)
    monkeypatch.setattr(middleware, "timed_share",
                        lambda rt, key, context=None: 1.0 if next(timed) else 0.0)
    monkeypatch.setattr(middleware, "_MAX_ROUTES", BOUND)
    exporter = MemoryExporter()
    held = []
    with captured(mode="production", max_timed_rate=100, summary_exporter=exporter,
                  summary_interval_s=3600, untimed_stages=False):

        async def run() -> None:
            transport = httpx.ASGITransport(app=mw)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                for _ in range(REBUILDS):
                    app.router.routes[:] = [Route("/infer", _infer, methods=["POST"])]
                    gc.collect()
                    for _ in range(2):
                        r = await c.post("/infer", json={})
                        assert r.status_code == 200
                    held.append(len(mw._route_models))

        asyncio.run(run())
        inferprof.shutdown()
    got = decode(exporter.exports)
    untimed = sum(d["count"] for d in got.get(_UNTIMED, {}).values())
    timed_points = {dict(k).get(_MODEL): d["count"] for k, d in got[_REQ].items()}
    assert untimed == REBUILDS, (untimed, held)
    assert timed_points == {"m": REBUILDS}
    # The map holds the live route (and the one being replaced, until collected), not
    # every route ever seen.
    assert max(held) <= 2, held


def test_an_object_that_takes_no_weak_reference_is_held_as_it_is():
    # None (a request no route matched) and objects without weak references keep their
    # state for the process's life: held, their ids stay theirs.
    models, refs = {1: "m"}, {}
    for route in (None, ("not", "weak")):
        assert middleware._route_ref(route, 1, models, refs, set()) is route
    assert models == {1: "m"}
