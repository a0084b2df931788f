"""Fleet tables: three engines' /metrics summed by ``le`` give the breakdown of one
engine fed all the requests (quantiles, shares, counts and verdict)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferprof import semconv as sc
from inferprof.collector.engine import Engine
from inferprof.collector.fleet import (
    E2E,
    FLEET_MAX_S,
    FLEET_MIN_S,
    Buckets,
    FleetExposition,
    tables_from_sums,
)
from inferprof.collector.sketch import KeyMapping
from tests.collector.fleet_workload import engine_fed, exports, fleet_document, summed_scrapes
from tests.collector.synth import FakeClock
from tests.collector.test_server_fixtures import running_app


def assert_same_breakdown(fleet: dict, one: dict) -> None:
    """The fleet bounds of issue 23: quantiles within 1%, shares within 1 percentage
    point, the same verdict; counts equal."""
    assert fleet["requests"] == one["requests"]
    assert fleet["traced_requests"] == one["traced_requests"]
    for key in ("p50", "p95", "p99"):
        assert fleet["latency"][key] == pytest.approx(one["latency"][key], rel=0.01)
    by_stage = {st["stage"]: st for st in one["stages"]}
    assert {st["stage"] for st in fleet["stages"]} == set(by_stage)
    for st in fleet["stages"]:
        ref = by_stage[st["stage"]]
        assert st["count"] == ref["count"]
        if st["stage"] != sc.STAGE_UNATTRIBUTED:  # below FLEET_MIN_S: read as the range's end
            for key in ("p50", "p95", "p99"):
                assert st[key] == pytest.approx(ref[key], rel=0.01), (st["stage"], key)
        for key in ("share_of_p50", "share_of_p95", "share_of_p99"):
            assert st[key] == pytest.approx(ref[key], abs=0.01), (st["stage"], key)
    assert fleet["verdict"]["bottleneck"] == one["verdict"]["bottleneck"]


def test_three_engines_summed_by_le_give_the_breakdown_of_one():
    parts = exports(3000, shares=3)
    engines = [engine_fed(p) for p in parts]
    one = engine_fed([r for p in parts for r in p])
    expected = one.breakdown("fleet", "m", window_s=None)
    assert expected["verdict"]["bottleneck"] == sc.VERDICT_BATCHING  # the workload's tail

    got = fleet_document(engines, "fleet", "m")
    assert_same_breakdown(got, expected)
    stage_cum, *_ = summed_scrapes(engines, "fleet", "m")
    # +Inf holds every request's weight (the histograms' _count)
    assert stage_cum[E2E]["+Inf"] == pytest.approx(expected["requests"], abs=0.5)
    # Inside the range the sums are the one engine's own tables: equal, not just close.
    for st, ref in zip(got["stages"], expected["stages"], strict=True):
        if st["stage"] != sc.STAGE_UNATTRIBUTED:
            assert st["p95"] == pytest.approx(ref["p95"], rel=1e-12)
        assert st["share_of_p95"] == pytest.approx(ref["share_of_p95"], abs=1e-9)


def test_every_collector_exposes_the_same_bucket_grid():
    # Classic histograms sum by le only when every collector has every le.
    parts = exports(300, shares=2)
    grids = []
    for p in parts:
        text = FleetExposition(engine_fed(p))().decode()
        grids.append(sorted(
            (s.labels["stage"], s.labels["le"])
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == sc.PROM_FLEET_STAGE_DURATION + "_bucket"
        ))
    assert grids[0] == grids[1]
    buckets = Buckets(KeyMapping(0.005))
    les = [float(x) for x in buckets.labels]
    assert les[1] >= FLEET_MIN_S and les[-2] >= FLEET_MAX_S > les[-3]
    # consecutive bounds a factor gamma apart: the sketch's own buckets
    assert les[2] / les[1] == pytest.approx(buckets.mapping.gamma, rel=1e-9)


def test_the_exposition_parses_and_escapes_label_values():
    engine = engine_fed(exports(20, service='we"ird\\svc')[0])
    families = {
        f.name: f for f in text_string_to_metric_families(FleetExposition(engine)().decode())
    }
    hist = families[sc.PROM_FLEET_REQUEST_DURATION]
    assert hist.type == "histogram"
    count = [s for s in hist.samples if s.name.endswith("_count")]
    assert [s.labels["service"] for s in count] == ['we"ird\\svc']
    assert count[0].value == pytest.approx(engine.breakdown('we"ird\\svc', "m", None)["requests"])
    total = next(s for s in hist.samples if s.name.endswith("_sum")).value
    assert total > 0
    assert families[sc.PROM_FLEET_TAIL_STAGE.removesuffix("_total")].type == "counter"


def test_a_label_off_the_grid_is_refused():
    buckets = Buckets(KeyMapping(0.005))
    with pytest.raises(ValueError, match="relative-accuracy"):
        tables_from_sums(buckets, {E2E: {"0.123": 1.0}}, {}, {}, {})


def test_a_reclaimed_series_leaves_the_fleet_tables():
    clock = FakeClock()
    engine = Engine(settle_s=0.0, clock=clock, max_series=1, windows_s=(10.0,), slice_s=1.0)
    for request in exports(50, service="a")[0]:
        engine.ingest_traces(request)
    engine.flush()
    assert set(engine.fleet_tables()) == {("a", "m")}
    clock.tick(60.0)
    for request in exports(50, service="b")[0]:
        engine.ingest_traces(request)
    engine.flush()
    assert set(engine.fleet_tables()) == {("b", "m")}


def test_tail_buckets_run_from_the_fastest_request_to_inf_on_the_grid():
    buckets = Buckets(KeyMapping(0.005))
    mid = (buckets.lo + buckets.hi) // 2
    table = buckets.clamped({mid: 2.0, buckets.hi + 40: 1.0}, mid)
    assert list(table) == buckets.labels[mid - buckets.lo + 1:]
    assert table[buckets.label(mid)] == 2.0 and table["+Inf"] == 1.0
    assert sum(table.values()) == 3.0
    # a zero-length request and one below the range: the zero bucket, then the whole grid
    table = buckets.clamped({0: 1.0, 5: 1.0}, 0)
    assert list(table) == buckets.labels
    assert table["0.0"] == 1.0 and table[buckets.labels[1]] == 1.0


def test_the_collector_serves_metrics_fleet_only_with_the_flag():
    with running_app() as app:
        assert httpx.get(f"{app.api_url}/metrics/fleet", timeout=10).status_code == 404
    with running_app(fleet_metrics=True) as app:
        for request in exports(30, service="served")[0]:
            app.engine.ingest_traces(request)
        app.engine.flush()
        resp = httpx.get(f"{app.api_url}/metrics/fleet", timeout=10)
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
        families = {f.name for f in text_string_to_metric_families(resp.text)}
        assert sc.PROM_FLEET_REQUEST_DURATION in families
        assert sc.PROM_FLEET_RELATIVE_ACCURACY in families
        # the usual /metrics stays as it was
        assert sc.PROM_FLEET_REQUEST_DURATION not in httpx.get(f"{app.api_url}/metrics").text
