"""Every timed request counted (contract §15), end to end: a real uvicorn FastAPI service in
``production`` mode at its defaults, exporting OTLP/HTTP (traces and summaries) into a
real ``inferprof collect``. The collector's breakdown must count exactly the requests
served, its stage p95s must be within 1% and its shares within 1 point (here: exact, over
§13's tail set) of exact figures computed from every request's own timings (the service
writes them as each request ends), although only a sample of the requests is kept as
traces."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from inferprof import semconv
from inferprof.collector.attribution import exact_tail_shares
from inferprof.collector.settings import CollectorSettings
from inferprof.collector.sketch import KeyMapping, exact_weighted_quantile
from inferprof.timing import exp_index, exp_representative, partition
from tests.integration.test_collector_cli import _start
from tests.integration.test_collector_cli import _stop as _stop_collector
from tests.integration.test_demo_example import _stop as _stop_service
from tests.integration.test_demo_example import start_uvicorn

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 300
SERVICE = "summaries-e2e"
#: Apart by more than a tenth of a second's share of the timing budget (100 a second per
#: route): every request is timed, none weighted.
_PACE_S = 0.012


def _start_service(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    return start_uvicorn("tests.integration.summaries_service:app", env)


def _exact(timings: list[dict]) -> tuple[np.ndarray, dict, list[dict]]:
    """End-to-end seconds, stage times (per stage, one entry per request, NaN where it
    did not enter the stage) and exclusive times (per request) of every request."""
    e2e = np.array([(t["end"] - t["start"]) * 1e-9 for t in timings])
    parts = [partition(t["start"], t["end"], [tuple(s) for s in t["stages"]]) for t in timings]
    names = {name for stage_time, _, _ in parts for name in stage_time} | {
        semconv.STAGE_UNATTRIBUTED}
    stage: dict = {n: np.full(len(timings), np.nan) for n in names}
    exclusive: list[dict] = []
    for i, (stage_time, excl, unatt) in enumerate(parts):
        for n, v in stage_time.items():
            stage[n][i] = v
        stage[semconv.STAGE_UNATTRIBUTED][i] = unatt
        exclusive.append({**excl, semconv.STAGE_UNATTRIBUTED: unatt})
    return e2e, stage, exclusive


def _serve(tmp_path: Path, send: Callable[[httpx.Client, str], None], requests: int,
           env: dict[str, str] | None = None) -> tuple[dict, list[dict]]:
    """The service exporting into a real collector, ``send(client, url)`` run against
    it: the collector's breakdown once it counts ``requests`` (or 20 s on), and the
    lines the service wrote (its timings, then its stats)."""
    timings_file = tmp_path / "timings.jsonl"
    collector, urls = _start(["--grpc-port", "0", "--http-port", "0", "--api-port", "0",
                              "--settle-s", "0.1"])
    try:
        assert {"OTLP/HTTP", "API"} <= set(urls), collector.stdout
        service, url = _start_service({
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": urls["OTLP/HTTP"],
            "INFERPROF_TEST_TIMINGS": str(timings_file),
            **(env or {}),
        })
        # Read as it comes: a full pipe (access log lines, tracebacks) would block it.
        lines: list[str] = []
        drain = threading.Thread(target=lambda: lines.extend(service.stderr), daemon=True)
        drain.start()
        try:
            with httpx.Client(timeout=30) as client:
                send(client, url)
        finally:
            _stop_service(service)  # the lifespan's inferprof.shutdown() flushes
            drain.join(30)
            service.stderr.close()
            errors = "".join(lines)
        assert "Failed to export" not in errors, errors

        def breakdown() -> dict | None:
            r = httpx.get(urls["API"] + "/api/v1/breakdown", params={"service": SERVICE})
            return r.json() if r.status_code == 200 else None

        deadline = time.monotonic() + 20
        body = breakdown()
        while (body is None or body.get("requests", 0) < requests) and (
                time.monotonic() < deadline):
            time.sleep(0.2)
            body = breakdown()
        assert body is not None, "the collector never heard of the service"
    finally:
        code, out = _stop_collector(collector)
    assert code == 0, out
    return body, [json.loads(line) for line in timings_file.read_text().splitlines()]


def _paced(client: httpx.Client, url: str, n: int = REQUESTS) -> None:
    for i in range(n):
        t0 = time.monotonic()
        assert client.post(url + "/v1/work", json={"i": i}).status_code == 200
        time.sleep(max(0.0, _PACE_S - (time.monotonic() - t0)))


def test_the_collector_counts_every_request_and_matches_exact_figures(tmp_path):
    body, lines = _serve(tmp_path, _paced, REQUESTS)
    *timings, last = lines
    assert len(timings) == REQUESTS  # every request was timed (the budget never cut in)
    stats = last["stats"]
    assert stats["requests_summarised"] == REQUESTS and stats["summaries_dropped"] == 0
    # Exactly the requests served, although only a sample was kept as traces.
    assert stats["traces_kept"] < 0.6 * REQUESTS
    assert body["requests"] == REQUESTS
    _assert_exact_figures(body, timings)


def _assert_exact_figures(body: dict, timings: list[dict]) -> None:
    """The breakdown's end-to-end p95 and every stage's count and p95 within 1%, and its
    shares exact over §13's tail set, against every request's own ``timings``."""
    e2e, stage, exclusive = _exact(timings)
    p95 = exact_weighted_quantile(e2e, None, 0.95)
    assert abs(body["latency"]["p95"] - p95) <= 0.01 * p95
    # §13: the tail is the latency sketch's buckets at and above the one holding p95, a
    # summarised request standing for its exponential bucket's representative (§15). The
    # same tail set here, so the shares compare like with like; p95 itself is compared
    # within 1% above.
    mapping = KeyMapping(CollectorSettings().relative_accuracy)
    keys = mapping.key(exp_representative(exp_index(e2e)))
    p95_key = mapping.scalar_key(float(exp_representative(exp_index([p95]))[0]))
    tail_from = float(np.min(e2e[keys >= p95_key]))
    shares = exact_tail_shares(e2e, np.ones(len(e2e)), exclusive, tail_from)
    got = {s["stage"]: s for s in body["stages"]}
    assert set(got) == set(stage)
    for name, values in stage.items():
        entered = values[~np.isnan(values)]
        assert got[name]["count"] == len(entered), name
        want = exact_weighted_quantile(entered, None, 0.95)
        assert abs(got[name]["p95"] - want) <= 0.01 * want + 1e-9, (name, got[name], want)
        # over the same tail set the shares are exact (the tail metric carries every
        # request's exclusive nanoseconds), well inside the 1-point target
        assert abs(got[name]["share_of_p95"] - shares[name]) <= 1e-6, (name, got[name])


#: Over its timing budget: a budget of 10 timed requests a second on the route, against
#: requests sent back to back (about 100 a second here), after a paced warm-up that
#: teaches the middleware the route's model (contract §15: a route is counted once its
#: timed requests are summarised under one model).
_BUDGET = "10"
_WARM_UP = 20
_BURST = 600


def test_over_its_timing_budget_the_collector_counts_every_request_exactly(tmp_path):
    statuses: list[int] = []

    def send(client: httpx.Client, url: str) -> None:
        _paced(client, url, _WARM_UP)
        statuses.extend([200] * _WARM_UP)
        for i in range(_WARM_UP, _WARM_UP + _BURST):
            # Errors answered 503 (a request that raises before its answer starts is not
            # counted untimed, contract §15: its count would be an estimate again).
            body = {"i": i, "fail": "503"} if i % 40 in (3, 17) else {"i": i}
            statuses.append(client.post(url + "/v1/work", json=body).status_code)

    total = _WARM_UP + _BURST
    body, lines = _serve(tmp_path, send, total, {"INFERPROF_MAX_TIMED_RATE": _BUDGET,
                                                 "INFERPROF_UNTIMED_STAGES": "false"})
    *timings, last = lines
    untimed = [t for t in timings if t.get("untimed")]
    timed = [t for t in timings if not t.get("untimed")]
    stats = last["stats"]
    # The budget cut in: most requests were not timed, each counted once all the same.
    assert len(timed) + len(untimed) == total
    assert len(untimed) > total / 2, (len(timed), len(untimed))
    assert stats["requests_untimed_counted"] == len(untimed)
    assert stats["summaries_dropped"] == 0
    failed = sum(1 for s in statuses if s >= 500)
    assert failed == 2 * (_BURST // 40) and sum(t["error"] for t in untimed) > 0
    # Exactly the requests served and the errors among them, not a weighted estimate.
    assert (body["requests"], body["errors"]) == (total, failed)
    assert body["traced_requests"] == len(timed)
    # End to end over every request, timed or not, within the buckets' and sketch's 1%.
    e2e = np.array([(t["end"] - t["start"]) * 1e-9 for t in timings])
    for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
        want = exact_weighted_quantile(e2e, None, q)
        assert abs(body["latency"][name] - want) <= 0.01 * want, (name, body["latency"], want)
    # Stage figures come from the timed requests, weighted: their shares still sum to 1.
    assert sum(s["share_of_p95"] for s in body["stages"]) == pytest.approx(1.0, abs=1e-9)


def test_over_its_timing_budget_every_request_is_summarised_with_its_stages(tmp_path):
    """At the defaults (``untimed_stages`` on) the requests the budget leaves untimed are
    summarised with their stage times: the collector's stage figures match exact ones
    over every request, as when every request is timed, with only the timed share
    traced."""

    def send(client: httpx.Client, url: str) -> None:
        _paced(client, url, _WARM_UP)
        for i in range(_WARM_UP, _WARM_UP + _BURST):
            assert client.post(url + "/v1/work", json={"i": i}).status_code == 200

    total = _WARM_UP + _BURST
    body, lines = _serve(tmp_path, send, total, {"INFERPROF_MAX_TIMED_RATE": _BUDGET})
    *timings, last = lines
    untimed = [t for t in timings if t.get("untimed")]
    stats = last["stats"]
    assert len(timings) == total
    assert len(untimed) > total / 2, len(untimed)  # the budget cut in
    assert all("stages" in t for t in untimed)  # each summarised with its stages
    assert stats["requests_untimed_counted"] == 0  # none only counted
    assert stats["requests_summarised"] == total and stats["summaries_dropped"] == 0
    assert body["requests"] == total
    assert body["traced_requests"] == total  # measured, summarised or traced
    _assert_exact_figures(body, timings)
