"""Production mode's middleware counts the requests its timing budget leaves untimed
(contract §15, "Requests not timed"), on routes whose timed requests are summarised under
one model, and marks those routes' timed requests: with an in-memory metric exporter, the
exported untimed and marked counts are exactly the requests served, errors included, and
buckets are those of the requests' own latencies."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from opentelemetry import propagate

import inferprof
import inferprof.fastapi
from inferprof import semconv
from inferprof.fastapi import middleware
from inferprof.timing import DEFAULT_SUMMARY_SCALE, exp_index
from tests.fastapi.budget_helpers import budgeted_capture
from tests.instrumentation.helpers import captured
from tests.instrumentation.test_summaries import FakeClock, MemoryExporter, decode

MS = 1_000_000
_REQ = semconv.METRIC_SUMMARY_REQUEST_DURATION
_UNTIMED = semconv.METRIC_SUMMARY_REQUEST_UNTIMED
_MODEL = semconv.ATTR_MODEL_NAME
_ERROR = semconv.ATTR_REQUEST_ERROR
_MARK = semconv.ATTR_SUMMARY_UNTIMED_COUNTED
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _app(clock: FakeClock, log: list) -> FastAPI:
    """/a (model "a": some 503 and 500 answers), /b (model "b"), /mixed (models "x" and
    "y"). Each handler logs (route, model, timed, latency ns, error) and moves the clock
    by the request's latency. (Requests that end in an exception before any answer are
    not counted untimed: test_untimed_unanswered.py.)"""
    app = FastAPI()

    def serve(route: str, model: str, i: int, error: bool) -> None:
        req = inferprof.current_request()  # None: not timed
        if req is not None:
            req.set_attribute(_MODEL, model)
        ns = (1 + i % 9) * MS + 7_919 * i
        with inferprof.stage("compute"):
            clock.tick(ns)
        log.append((route, model, req is not None, ns, error))

    @app.post("/a")
    async def a(body: dict):
        i = body["i"]
        serve("/a", "a", i, i % 5 == 0 or i % 7 == 0)
        if i % 7 == 0:
            return JSONResponse({"error": "failed"}, status_code=500)
        if i % 5 == 0:
            return JSONResponse({"error": "overloaded"}, status_code=503)
        return {"i": i}

    @app.post("/b")
    async def b(body: dict):
        serve("/b", "b", body["i"], False)
        headers: dict = {}
        propagate.inject(headers)  # what a downstream call would carry
        return {"i": body["i"], "traceparent": headers.get("traceparent")}

    @app.post("/mixed")
    async def mixed(body: dict):
        i = body["i"]
        serve("/mixed", "x" if i % 2 else "y", i, False)
        return {"i": i}

    inferprof.fastapi.instrument(app)
    return app


async def _send(app: FastAPI, requests: list[tuple[str, int]]) -> list[int]:
    """The answers' statuses; the requests carry a caller's traceparent one in three, and
    /b's answers must name the caller's trace for those (timed or not, counted or not)."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        statuses = []
        for k, (path, i) in enumerate(requests):
            headers = {"traceparent": TRACEPARENT} if k % 3 == 0 else {}
            if path == "/nope":
                r = await c.get(path, headers=headers)
            else:
                r = await c.post(path, json={"i": i}, headers=headers)
            statuses.append(r.status_code)
            if path == "/b" and headers:
                assert r.json()["traceparent"].split("-")[1] == TRACEPARENT.split("-")[1]
        return statuses


def _buckets(latencies_ns) -> Counter:
    return Counter((DEFAULT_SUMMARY_SCALE, int(exp_index([ns * 1e-9])[0])) for ns in latencies_ns)


def test_untimed_and_marked_requests_count_every_request_exactly_once(clock):
    log: list = []
    app = _app(clock, log)
    exporter = MemoryExporter()
    paths = ("/a", "/b", "/mixed", "/nope")
    with budgeted_capture(exporter, sample_rate=0.05) as (cap, rt, budget_clock):
        # Warm-up, under the budget: every request timed. Each route's first timed request
        # is summarised before any state is known, so it is not marked; /mixed sees both
        # of its models.
        warm = [("/a", 1), ("/b", 1), ("/mixed", 1), ("/mixed", 2), ("/nope", 0)]
        asyncio.run(_send(app, warm))
        assert len(log) == 4 and all(timed for _, _, timed, _, _ in log)
        # 800 a second on every route: a share of 1/8, most requests untimed
        for path in paths:
            for _ in range(800):
                rt.timing_budget.share(path)
        budget_clock.now += 1.0
        n = 160
        sent = [(path, i) for i in range(n) for path in paths]
        statuses = asyncio.run(_send(app, sent))
        inferprof.shutdown()
        snap = inferprof.instrumentation.stats()
        assert not cap.requests() or all(
            s.attributes.get(semconv.ATTR_SUMMARY_COUNTED) for s in cap.requests())

    assert statuses.count(404) == n
    log = log[4:]  # the warm-up's
    timed = Counter(route for route, _, t, _, _ in log if t)
    untimed_log = [e for e in log if not e[2]]
    nope_timed = snap.requests_summarised - len(warm) - sum(timed.values())
    assert len(untimed_log) > n  # most requests untimed
    assert snap.requests_untimed == len(untimed_log) + (n - nope_timed)
    got = decode(exporter.exports)

    # untimed: /a and /b by (model, error) bucket by bucket; /nope under no model; /mixed
    # not at all
    want: dict = {}
    for route, model, _, ns, error in untimed_log:
        if route == "/mixed":
            continue
        key = ((_MODEL, model), (_ERROR, True)) if error else ((_MODEL, model),)
        want.setdefault(key, []).append(ns)
    nope = got[_UNTIMED].pop((), None)  # no model, no error (404s)
    assert nope is not None and nope["count"] == n - nope_timed == nope["zero"]
    assert set(got[_UNTIMED]) == set(want)
    for key, latencies in want.items():
        d = got[_UNTIMED][key]
        assert d["count"] == len(latencies) and d["zero"] == 0
        assert d["buckets"] == _buckets(latencies), key
    assert snap.requests_untimed_counted == len(untimed_log) - sum(
        1 for e in untimed_log if e[0] == "/mixed") + (n - nope_timed)

    # timed: marked on /a, /b and /nope after the warm-up; unmarked: the warm-up's (weight
    # 1) and /mixed's (the budget's weight)
    marked: Counter = Counter()
    unmarked: Counter = Counter()
    for key, d in got[_REQ].items():
        attrs = dict(key)
        weighted = attrs.get(semconv.ATTR_SAMPLE_WEIGHT, 1.0) > 1
        (marked if attrs.get(_MARK) else unmarked)[
            (attrs.get(_MODEL), attrs.get(_ERROR, False), weighted)] += d["count"]
    want_marked: Counter = Counter()
    want_unmarked: Counter = Counter({("a", False, False): 1, ("b", False, False): 1,
                                      ("x", False, False): 1, ("y", False, False): 1,
                                      (None, False, False): 1})
    for route, model, t, _, error in log:
        if t:
            (want_unmarked if route == "/mixed" else want_marked)[(model, error, True)] += 1
    want_marked[(None, False, True)] += nope_timed
    assert marked == want_marked
    assert unmarked == want_unmarked

    # every request once: untimed + marked, plus the warm-up and /mixed's timed ones
    for route, model in (("/a", "a"), ("/b", "b")):
        counted = sum(d["count"] for k, d in got[_UNTIMED].items() if dict(k)[_MODEL] == model)
        counted += sum(c for (m, _, _), c in marked.items() if m == model)
        assert counted == n, route
        errors = sum(d["count"] for k, d in got[_UNTIMED].items()
                     if dict(k)[_MODEL] == model and dict(k).get(_ERROR))
        errors += sum(c for (m, e, _), c in marked.items() if m == model and e)
        assert errors == (sum(1 for i in range(n) if i % 5 == 0 or i % 7 == 0)
                          if model == "a" else 0)
    assert nope["count"] + marked[(None, False, True)] == n


def test_a_route_is_counted_while_its_last_timed_request_was_summarised_under_one_model(
        clock, monkeypatch):
    # Which requests are timed is scripted (the budget's draw, replaced); each step's
    # outcome follows the route rule of contract §15 exactly.
    app = FastAPI()

    @app.get("/r/{how}")
    async def r(how: str):
        if how == "fail":  # before any stage, no body, no answer: not summarised if timed
            raise RuntimeError("handler failed")
        req = inferprof.current_request()
        if req is not None:
            req.set_attribute(_MODEL, "m2" if how == "m2" else "m")
        with inferprof.stage("compute"):
            clock.tick(MS)
        return {}

    @app.get("/s")
    async def s():
        with inferprof.stage("compute"):
            clock.tick(MS)
        return {}

    inferprof.fastapi.instrument(app)
    steps = [  # (timed, path, what the summaries get)
        (True, "/r/ok", "unmarked m"),  # unseen route: counted under m from now on
        (False, "/r/ok", "untimed m"),
        (True, "/r/ok", "marked m"),
        (True, "/r/fail", None),  # unanswered, no stage span: the route's unanswered part
        #                           is not counted for good, its answered part unchanged
        (False, "/r/ok", "untimed m"),
        (True, "/r/ok", "marked m"),
        (False, "/r/fail", None),  # unanswered: not counted (its timed likes: weighted)
        (True, "/r/m2", "unmarked m2"),  # a second model: not counted for good
        (False, "/r/ok", None),
        (True, "/r/ok", "unmarked m"),
        (False, "/r/ok", None),
        (True, "/s", "unmarked -"),  # past the routes' bound (1): never counted
        (False, "/s", None),
        (True, "/s", "unmarked -"),
    ]
    script = iter(timed for timed, _, _ in steps)
    monkeypatch.setattr(middleware, "timed_share",
                        lambda rt, key, context=None: 1.0 if next(script) else 0.0)
    monkeypatch.setattr(middleware, "_MAX_ROUTES", 1)
    exporter = MemoryExporter()
    with captured(mode="production", max_timed_rate=100, summary_exporter=exporter,
                  summary_interval_s=3600, untimed_stages=False):

        async def run() -> None:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                for _, path, _ in steps:
                    await c.get(path)

        asyncio.run(run())
        inferprof.shutdown()
    got = decode(exporter.exports)
    seen: Counter = Counter()
    for key, d in got.get(_UNTIMED, {}).items():
        attrs = dict(key)
        seen[" ".join(["untimed", attrs.get(_MODEL, "-")] + ["error"] * attrs.get(_ERROR, 0))
             ] += d["count"]
    for key, d in got[_REQ].items():
        attrs = dict(key)
        assert _ERROR not in attrs
        seen[f"{'marked' if attrs.get(_MARK) else 'unmarked'} {attrs.get(_MODEL, '-')}"] += (
            d["count"])
    assert seen == Counter(want for _, _, want in steps if want is not None)


def test_with_every_request_timed_nothing_is_marked_and_nothing_counted_untimed(clock):
    # max_timed_rate=0: no timing budget, no request untimed; summaries as before
    app = FastAPI()

    @app.post("/a")
    async def a(body: dict):
        with inferprof.stage("compute"):
            clock.tick(MS * (1 + body["i"] % 3))
        return {}

    inferprof.fastapi.instrument(app, model_name="m")
    exporter = MemoryExporter()
    with captured(mode="production", max_timed_rate=0, summary_exporter=exporter,
                  summary_interval_s=3600):
        asyncio.run(_send(app, [("/a", i) for i in range(30)]))
        inferprof.shutdown()
        snap = inferprof.instrumentation.stats()
    assert snap.requests_summarised == 30 and not snap.requests_untimed_counted
    got = decode(exporter.exports)
    assert _UNTIMED not in got
    assert {k: d["count"] for k, d in got[_REQ].items()} == {((_MODEL, "m"),): 30}


def test_the_collector_counts_every_request_served_exactly(clock):
    # End to end: the summaries (and the kept traces) of a service whose requests are
    # mostly untimed, encoded by the SDK's OTLP encoders and folded by the collector's
    # engine, give the request count and errors of every request served, and end-to-end
    # quantiles to the buckets' accuracy.
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from inferprof.collector.engine import Engine
    from inferprof.collector.sketch import exact_weighted_quantile
    from tests.collector.synth import FakeClock as SecondsClock

    log: list = []
    app = _app(clock, log)
    exporter = MemoryExporter()
    paths = ("/a", "/b", "/nope")
    n = 200
    with budgeted_capture(exporter, sample_rate=0.05) as (cap, rt, budget_clock):
        asyncio.run(_send(app, [(p, 1) for p in paths]))  # every route learns its model
        for path in paths:
            for _ in range(1600):
                rt.timing_budget.share(path)
        budget_clock.now += 1.0
        asyncio.run(_send(app, [(p, i) for i in range(n) for p in paths]))
        inferprof.shutdown()
        spans = cap.spans()
        service = cap.provider.resource.attributes[semconv.RESOURCE_SERVICE_NAME]
        snap = inferprof.instrumentation.stats()
    assert snap.requests_untimed > 2 * n  # most requests untimed
    served = len(paths) * (n + 1)
    # the handlers' latencies, and 0 for the 404s (no handler: the clock does not move)
    e2e = [ns * 1e-9 for _, _, _, ns, _ in log] + [0.0] * (n + 1)
    errors = sum(1 for route, _, _, _, error in log if error)
    assert len(e2e) == served and errors == sum(
        1 for i in [1, *range(n)] if i % 5 == 0 or i % 7 == 0)
    engine = Engine(clock=SecondsClock(clock.now * 1e-9 + 60), settle_s=0.0)
    for data in exporter.exports:
        result = engine.ingest_metrics(encode_metrics(data))
        assert result.rejected_spans == 0, result.errors
    assert spans  # a few kept traces: marked counted, drill-down only
    result = engine.ingest_traces(encode_spans(spans))
    assert result.rejected_spans == 0, result.errors
    engine.flush()
    doc = engine.breakdown(service, window_s=None)
    assert doc["requests"] == served
    assert doc["errors"] == errors
    for k, q in {"p50": 0.5, "p95": 0.95, "p99": 0.99}.items():
        assert doc["latency"][k] == pytest.approx(exact_weighted_quantile(e2e, None, q),
                                                  rel=0.01), k
