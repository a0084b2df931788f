"""Requests a timing budget left untimed (contract §15, "Requests not timed") and the mark
on timed requests that then count once: folded by the engine, request counts, errors and
end-to-end quantiles are exact over every request served, while the stage figures and the
tail table still come from the timed requests, weighted."""

from __future__ import annotations

import math

import grpc
import httpx
import numpy as np
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc

from inferprof import semconv as sc
from inferprof.collector import fleet
from inferprof.collector.attribution import exact_tail_shares
from inferprof.collector.sketch import exact_weighted_quantile
from inferprof.report.command import build_documents
from inferprof.report.dump import write_pb
from inferprof.timing import partition
from tests.collector.summary_synth import SummaryBuilder
from tests.collector.synth import attributes
from tests.collector.test_server_fixtures import breakdown, running_app
from tests.collector.test_summaries import (
    QS,
    _add,
    _assert_matches_exact,
    _close,
    _engine,
    _fleet,
    _point,
    _requests,
)


def _served(n: int, seed: int) -> list[dict]:
    """Requests served, each timed or not as a budget of share ``1 / weight`` would leave
    them, with the slow ones timed half as often (a budget spent under load): so the
    timed requests, weighted, misestimate the counts and the tail.

    Model ``m``'s requests on route ``a`` are counted (the timed marked, the untimed
    counted); those on route ``b``, and every request of ``n``, are not: their untimed
    requests are sent nowhere and their timed ones count ``weight`` times."""
    rng = np.random.default_rng(seed)
    reqs = _requests(n, seed=seed)
    median = float(np.median([r["end"] - r["start"] for r in reqs]))
    for i, r in enumerate(reqs):
        slow = r["end"] - r["start"] > median
        r["timed"] = bool(rng.random() < (0.5 if slow else 1.0) / r["weight"])
        r["counted"] = r["model"] == "m" and i % 3 != 0
    return reqs


def _summaries(reqs: list[dict], *, marks: bool = True, untimed: bool = True,
               scale: int = 7) -> SummaryBuilder:
    b = SummaryBuilder(scale)
    for r in reqs:
        if r["timed"]:
            b.add(r["start"], r["end"], r["spans"], weight=r["weight"], model=r["model"],
                  error=r["error"], marked=marks and r["counted"])
        elif untimed and r["counted"]:
            b.add_untimed(r["start"], r["end"], model=r["model"], error=r["error"])
    return b


def _exact(reqs: list[dict], model: str | None = None) -> dict:
    """Exact figures over the requests the data points stand for: in request-level
    figures an untimed counted request once, a timed marked one once, a timed unmarked
    one ``weight`` times (untimed uncounted ones: not at all); in stage figures and
    shares the timed ones, weighted, above the request-level p95."""
    e2e, w = [], []
    errors = 0.0
    timed_e2e, timed_w, stage_vals, exclusive = [], [], {}, []
    for r in reqs:
        if model is not None and r["model"] != model:
            continue
        if not r["timed"] and not r["counted"]:
            continue
        x = (r["end"] - r["start"]) * 1e-9
        once = 1.0 if r["counted"] else r["weight"]
        e2e.append(x)
        w.append(once)
        errors += once if r["error"] else 0.0
        if not r["timed"]:
            continue
        times, excl, unatt = partition(r["start"], r["end"], r["spans"])
        timed_e2e.append(x)
        timed_w.append(r["weight"])
        for stage, t in [*times.items(), (sc.STAGE_UNATTRIBUTED, unatt)]:
            stage_vals.setdefault(stage, ([], []))
            stage_vals[stage][0].append(t)
            stage_vals[stage][1].append(r["weight"])
        exclusive.append({**excl, sc.STAGE_UNATTRIBUTED: unatt})
    p95 = exact_weighted_quantile(e2e, w, 0.95)
    return {
        "requests": sum(w),
        "errors": errors,
        "latency": {k: exact_weighted_quantile(e2e, w, q) for k, q in QS.items()},
        "stages": {s: {k: exact_weighted_quantile(v, ww, q) for k, q in QS.items()}
                   for s, (v, ww) in stage_vals.items()},
        "counts": {s: sum(ww) for s, (_, ww) in stage_vals.items()},
        "shares": exact_tail_shares(timed_e2e, timed_w, exclusive, p95),
        "e2e_sum": float(np.dot(e2e, w)),
    }


REQS = _served(3000, seed=21)
MINE = [r for r in REQS if r["model"] == "m" and r["counted"]]


def test_the_population_is_one_where_weighting_the_timed_requests_misleads():
    # What the tests below prove is only worth something if the timed requests,
    # weighted, do not already give the exact figures.
    timed = [r for r in MINE if r["timed"]]
    assert 300 < len(timed) < len(MINE) - 600
    estimate = sum(r["weight"] for r in timed)
    assert abs(estimate - len(MINE)) > 0.1 * len(MINE)
    e2e = [(r["end"] - r["start"]) * 1e-9 for r in MINE]
    p95 = exact_weighted_quantile(e2e, [1.0] * len(e2e), 0.95)
    weighted = exact_weighted_quantile([(r["end"] - r["start"]) * 1e-9 for r in timed],
                                       [r["weight"] for r in timed], 0.95)
    assert abs(weighted / p95 - 1) > 0.05


@pytest.mark.parametrize("scale", [7, 4])
def test_untimed_and_marked_requests_give_exact_request_figures(scale):
    base = 2.0 ** (2.0**-scale)
    bound = max(0.01, (base - 1) / (base + 1) + 0.005 + 1e-9)
    engine = _engine()
    for part in np.array_split(np.arange(len(REQS)), 3):
        result = engine.ingest_metrics(_summaries([REQS[i] for i in part], scale=scale).export())
        assert result.rejected_spans == 0 and result.accepted_spans > 0, result.errors
    # The service, each model (m: marked and unmarked together), and what each counts.
    _assert_matches_exact(engine.breakdown("svc", window_s=None), _exact(REQS), bound)
    for model in ("m", "n"):
        _assert_matches_exact(engine.breakdown("svc", model, window_s=None),
                              _exact(REQS, model), bound)
    only_counted = [r for r in REQS if r["counted"]]
    exact = _exact(only_counted)
    assert exact["requests"] == len(only_counted)  # every one once: exact
    assert exact["errors"] == sum(r["error"] for r in only_counted)
    untimed = sum(1 for r in REQS if not r["timed"] and r["counted"])
    assert engine.stats.summary_untimed_requests == untimed
    assert engine.stats.summary_requests == sum(r["timed"] for r in REQS)
    assert engine.breakdown("svc", window_s=None)["traced_requests"] == sum(
        r["timed"] for r in REQS)
    # The Prometheus histograms: end to end once per counted request, the stages weighted.
    hist = {(m, st): (c, t) for _, m, st, c, t in engine.histograms()}
    for model in ("m", "n"):
        counts, total = hist[(model, None)]
        ex = _exact(REQS, model)
        assert counts.sum() == pytest.approx(ex["requests"])
        assert total == pytest.approx(ex["e2e_sum"], rel=1e-9)
        counts, _ = hist[(model, "queue")]
        assert counts.sum() == pytest.approx(
            sum(r["weight"] for r in REQS if r["timed"] and r["model"] == model))
    errors = {m: e for _, m, e in engine.request_errors()}
    assert errors == {m: pytest.approx(_exact(REQS, m)["errors"]) for m in ("m", "n")}
    (svc,) = engine.services()
    assert svc["requests"] == pytest.approx(_exact(REQS)["requests"])


def test_untimed_points_and_marks_leave_stage_figures_and_the_tail_table_alone():
    # The same timed data points with and without untimed ones and marks: every stage
    # row's count and quantiles, the traced counts and the tail table are the same; only
    # the request-level figures (and the p95 the shares are read above) move.
    with_untimed, timed_only = _engine(), _engine()
    with_untimed.ingest_metrics(_summaries(REQS).export())
    timed_only.ingest_metrics(_summaries(REQS, marks=False, untimed=False).export())
    a = with_untimed.breakdown("svc", "m", window_s=None)
    b = timed_only.breakdown("svc", "m", window_s=None)
    keep = ("stage", "count", "p50", "p95", "p99")
    assert [{k: s[k] for k in keep} for s in a["stages"]] == [
        {k: s[k] for k in keep} for s in b["stages"]]
    assert a["traced_requests"] == b["traced_requests"]
    assert a["requests"] != b["requests"] and a["latency"] != b["latency"]
    ta, tb = _fleet(with_untimed), _fleet(timed_only)
    for key in ta:
        for table in ("tail", "tail_e2e", "tail_traced"):
            assert ta[key][table] == tb[key][table], (key, table)
        stages = {s: v for s, v in ta[key]["stages"].items() if s != fleet.E2E}
        assert stages == {s: v for s, v in tb[key]["stages"].items() if s != fleet.E2E}


def test_a_series_of_untimed_requests_alone_reads_back_without_stages():
    b = SummaryBuilder()
    for i in range(100):
        b.add_untimed(0, (i + 1) * 1_000_000, model="u", error=i < 7)
    engine = _engine()
    result = engine.ingest_metrics(b.export())
    assert result.rejected_spans == 0
    doc = engine.breakdown("svc", "u", window_s=None)
    assert (doc["requests"], doc["errors"], doc["traced_requests"]) == (100, 7, 0)
    assert doc["latency"]["p50"] == pytest.approx(0.050, rel=0.01)
    assert doc["latency"]["p95"] == pytest.approx(0.095, rel=0.01)
    assert doc["stages"] == [] and doc["examples"] == []
    assert doc["verdict"]["bottleneck"] == "unknown"


def test_fleet_tables_with_untimed_requests_sum_across_engines_and_read_back_exact():
    whole = _engine()
    whole.ingest_metrics(_summaries(REQS).export())
    total: dict = {}
    for third in range(3):
        engine = _engine()
        engine.ingest_metrics(_summaries(REQS[third::3]).export())
        _add(total, _fleet(engine))
    _close(total, _fleet(whole))
    # The fleet document of those tables: the engine's request count, quantiles, shares.
    tables = whole.fleet_tables()[("svc", "m")]
    doc = fleet.document("svc", "m", None, tables, whole.mapping)
    ref = whole.breakdown("svc", "m", window_s=None)
    assert doc["requests"] == ref["requests"] == _exact(REQS, "m")["requests"]
    assert doc["latency"] == ref["latency"]
    assert doc["traced_requests"] == ref["traced_requests"]
    for row, ref_row in zip(doc["stages"], ref["stages"], strict=True):
        assert row["stage"] == ref_row["stage"]
        assert row["share_of_p95"] == pytest.approx(ref_row["share_of_p95"], abs=1e-9)


def test_inferprof_report_of_a_file_of_summaries_counts_the_untimed_requests(tmp_path):
    # The offline report folds a dump's metrics exports through the same engine.
    path = tmp_path / "run.pb"
    write_pb(path, [_summaries([REQS[i] for i in part]).export()
                    for part in np.array_split(np.arange(len(REQS)), 3)])
    docs = {doc["model"]: doc for doc in build_documents([path], service="svc")}
    assert set(docs) == {"m", "n"}
    for model, doc in docs.items():
        _assert_matches_exact(doc, _exact(REQS, model))


def _bad(metrics) -> list[tuple[object, str]]:
    by_name = {m.name: m for m in metrics}
    request = by_name[sc.METRIC_SUMMARY_REQUEST_DURATION]
    stage = by_name[sc.METRIC_SUMMARY_STAGE_DURATION]
    tail = by_name[sc.METRIC_SUMMARY_STAGE_TAIL]
    untimed = by_name[sc.METRIC_SUMMARY_REQUEST_UNTIMED]
    mark = sc.ATTR_SUMMARY_UNTIMED_COUNTED
    return [
        (_point(untimed, attrs=attributes({sc.ATTR_SAMPLE_WEIGHT: 2.0})), "sample.weight on"),
        (_point(untimed, attrs=attributes({sc.ATTR_SAMPLE_WEIGHT: 1.0})), "sample.weight on"),
        (_point(untimed, attrs=attributes({sc.ATTR_STAGE: "queue"})), "inferprof.stage on"),
        (_point(untimed, attrs=attributes({sc.ATTR_REQUEST_ERROR: 1})), "error is not a bool"),
        (_point(untimed, attrs=attributes({mark: True})), f"{mark} outside"),
        (_point(untimed, scale=-11), "scale -11"),
        (_point(untimed, negative=[1]), "negative"),
        (_point(untimed, sum=1e308), "sum is above"),
        (_point(request, attrs=attributes({mark: "true"})), f"{mark} is not a bool"),
        (_point(request, attrs=attributes({mark: 1})), f"{mark} is not a bool"),
        (_point(stage, attrs=attributes({sc.ATTR_STAGE: "queue", mark: True})),
         f"{mark} outside"),
        (_point(tail, attrs=attributes({sc.ATTR_STAGE: "queue", mark: False})),
         f"{mark} outside"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_a_bad_untimed_point_or_mark_is_rejected_with_its_reason_the_rest_kept(case):
    good = _summaries(REQS)
    metrics = good.metrics()
    bad, reason = _bad(_summaries(REQS[:60]).metrics())[case]
    engine = _engine()
    result = engine.ingest_metrics(good.export(metrics=[*metrics, bad]))
    assert result.rejected_spans == 1
    assert result.accepted_spans == sum(
        len(m.exponential_histogram.data_points) for m in metrics)
    assert any(reason in e for e in result.errors), result.errors
    assert engine.stats.summary_points_rejected == 1
    _assert_matches_exact(engine.breakdown("svc", window_s=None), _exact(REQS))


def test_untimed_requests_over_grpc_reach_the_breakdown_and_metrics_of_a_running_collector():
    reqs = _served(1500, seed=22)
    request = _summaries(reqs).export(service="untimed-svc")
    with running_app() as app:
        with grpc.insecure_channel(f"127.0.0.1:{app.otlp_grpc_port}") as channel:
            answer = metrics_service_pb2_grpc.MetricsServiceStub(channel).Export(
                request, timeout=10)
        assert not answer.HasField("partial_success")
        for model in (None, "m"):
            params = {"window": 600} if model is None else {"window": 600, "model": model}
            doc = breakdown(app, "untimed-svc", **params).json()
            _assert_matches_exact(doc, _exact(reqs, model))
        text = httpx.get(f"{app.api_url}/metrics").text
        untimed = sum(1 for r in reqs if not r["timed"] and r["counted"])
        assert untimed > 0
        assert f"{sc.PROM_SUMMARISED_UNTIMED} {untimed}.0" in text
        assert f"{sc.PROM_SUMMARISED_REQUESTS} {sum(r['timed'] for r in reqs)}.0" in text
        m = _exact(reqs, "m")
        labels = 'model="m",service="untimed-svc"'
        assert f"{sc.PROM_REQUEST_ERRORS}{{{labels}}} {m['errors']}" in text
        count = f"{sc.PROM_REQUEST_DURATION}_count{{{labels}}} {m['requests']}"
        assert count in text, [ln for ln in text.splitlines() if "duration_seconds_count" in ln]
        assert math.isfinite(m["e2e_sum"])
