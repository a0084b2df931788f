"""In-process summaries (contract §15) folded by the engine: against exact computation
over every request, against the same requests sent as traces, combined with traces of
some of them without counting anything twice, merged across engines, and bad input."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2

from inferprof import semconv as sc
from inferprof.collector import summaries as sm
from inferprof.collector.attribution import exact_tail_shares
from inferprof.collector.engine import Engine
from inferprof.collector.sketch import MAX_VALUE, exact_weighted_quantile
from inferprof.timing import partition
from tests.collector.summary_synth import SummaryBuilder
from tests.collector.synth import BASE_UNIX, FakeClock, TraceBuilder, gpu_metrics
from tests.collector.test_server_fixtures import breakdown, running_app

QS = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
WEIGHTS = (1.0, 2.0, 4.0)


def _requests(n: int, seed: int = 0, dist: str = "lognormal") -> list[dict]:
    """Requests with a queue, a compute and sometimes a postprocess stage (which, one
    time in ten, overlaps compute), in integer ns from the builders' base; weights of
    1, 2 and 4; one in twenty in error; two models."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if dist == "lognormal":
            q, c = rng.lognormal(math.log(0.01), 1.0), rng.lognormal(math.log(0.03), 0.4)
        else:  # bimodal: a slow queue for one request in ten
            q = rng.uniform(0.05, 0.5) if rng.random() < 0.1 else rng.uniform(0.001, 0.003)
            c = rng.uniform(0.02, 0.03)
        qn, cn = int(q * 1e9), int(c * 1e9)
        start = i * 1_000_000
        spans = [("queue", start, start + qn), ("compute", start + qn, start + qn + cn)]
        end = start + qn + cn + int(rng.uniform(0.0001, 0.002) * 1e9)
        if rng.random() < 0.3:
            p0 = start + qn + cn - (cn // 2 if rng.random() < 0.1 else 0)
            spans.append(("postprocess", p0, p0 + int(rng.uniform(0.0005, 0.002) * 1e9)))
            end = max(end, spans[-1][2] + 1000)
        out.append({
            "start": start, "end": end, "spans": spans,
            "weight": WEIGHTS[i % 3], "error": i % 20 == 0, "model": "m" if i % 4 else "n",
        })
    return out


def _summaries(reqs: list[dict], scale: int = 7) -> SummaryBuilder:
    b = SummaryBuilder(scale)
    for r in reqs:
        b.add(r["start"], r["end"], r["spans"], weight=r["weight"], model=r["model"],
              error=r["error"])
    return b


def _traces(reqs: list[dict], *, counted: bool = False, gpu: bool = False,
            service: str = "svc", factor: float = 1.0) -> TraceBuilder:
    """Traces of ``reqs``, weighted ``factor`` times their weight (a sample of them)."""
    b = TraceBuilder(service=service)
    extra = {sc.ATTR_SUMMARY_COUNTED: True} if counted else {}
    for k, r in enumerate(reqs):
        ref = b.request(r["start"] * 1e-9, r["end"] * 1e-9, model=r["model"],
                        weight=r["weight"] * factor, status=2 if r["error"] else 0, **extra)
        for stage, s, e in r["spans"]:
            attrs = {"gpu_id": "GPU-0", "batch_id": f"b{k}", "effective": 30, "padded": 40
                     } if gpu and stage == "compute" else {}
            b.stage(ref, stage, s * 1e-9, e * 1e-9, **attrs)
    return b


def _engine(**kw) -> Engine:
    return Engine(clock=FakeClock(BASE_UNIX + 100), settle_s=0.0, **kw)


def _exact(reqs: list[dict], model: str | None = None) -> dict:
    """Exact weighted figures over every request (of ``model``, or all)."""
    e2e, w, stage_vals, exclusive = [], [], {}, []
    for r in reqs:
        if model is not None and r["model"] != model:
            continue
        times, excl, unatt = partition(r["start"], r["end"], r["spans"])
        x = (r["end"] - r["start"]) * 1e-9
        e2e.append(x)
        w.append(r["weight"])
        for stage, t in [*times.items(), (sc.STAGE_UNATTRIBUTED, unatt)]:
            stage_vals.setdefault(stage, ([], []))
            stage_vals[stage][0].append(t)
            stage_vals[stage][1].append(r["weight"])
        exclusive.append({**excl, sc.STAGE_UNATTRIBUTED: unatt})
    p95 = exact_weighted_quantile(e2e, w, 0.95)
    return {
        "requests": sum(w),
        "errors": sum(r["weight"] for r in reqs if r["error"]
                      and (model is None or r["model"] == model)),
        "latency": {k: exact_weighted_quantile(e2e, w, q) for k, q in QS.items()},
        "stages": {s: {k: exact_weighted_quantile(v, ww, q) for k, q in QS.items()}
                   for s, (v, ww) in stage_vals.items()},
        "counts": {s: sum(ww) for s, (_, ww) in stage_vals.items()},
        "shares": exact_tail_shares(e2e, w, exclusive, p95),
    }


def _assert_matches_exact(doc: dict, exact: dict, bound: float = 0.01) -> None:
    assert doc["requests"] == round(exact["requests"])
    assert doc["errors"] == round(exact["errors"])
    for k in QS:
        assert doc["latency"][k] == pytest.approx(exact["latency"][k], rel=bound)
    rows = {s["stage"]: s for s in doc["stages"]}
    assert set(rows) == set(exact["stages"])
    for stage, qs in exact["stages"].items():
        assert rows[stage]["count"] == round(exact["counts"][stage])
        for k, v in qs.items():
            assert rows[stage][k] == pytest.approx(v, rel=bound, abs=1e-9), (stage, k)
        assert rows[stage]["share_of_p95"] == pytest.approx(
            exact["shares"].get(stage, 0.0), abs=0.01), stage
    assert sum(s["share_of_p95"] for s in doc["stages"]) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("dist", ["lognormal", "bimodal"])
@pytest.mark.parametrize("scale", [7, 8, 4])
def test_summaries_give_the_exact_weighted_breakdown(dist, scale):
    # The documented bound: the bucket's half-width in relative terms plus the sketch's
    # accuracy; under 1% from scale 7 on, coarser scales cost accuracy accordingly.
    base = 2.0 ** (2.0**-scale)
    bound = max(0.01, (base - 1) / (base + 1) + 0.005 + 1e-9)
    reqs = _requests(3000, seed=1, dist=dist)
    engine = _engine()
    # Split over several exports and data point sets, as a producer's intervals are.
    for part in np.array_split(np.arange(len(reqs)), 4):
        result = engine.ingest_metrics(_summaries([reqs[i] for i in part], scale).export())
        assert result.rejected_spans == 0 and result.accepted_spans > 0, result.errors
    _assert_matches_exact(engine.breakdown("svc", window_s=None), _exact(reqs), bound)
    _assert_matches_exact(engine.breakdown("svc", "m", window_s=None), _exact(reqs, "m"), bound)
    assert engine.stats.requests_finalised == 0  # no trace was folded
    # The Prometheus histograms: every request's weight once, the exact weighted sums.
    hist = {(m, st): (c, t) for _, m, st, c, t in engine.histograms()}
    for model in ("m", "n"):
        mine = [r for r in reqs if r["model"] == model]
        counts, total = hist[(model, None)]
        assert counts.sum() == pytest.approx(sum(r["weight"] for r in mine))
        assert total == pytest.approx(sum(r["weight"] * (r["end"] - r["start"]) * 1e-9
                                          for r in mine), rel=1e-9)
        counts, total = hist[(model, "queue")]
        assert counts.sum() == pytest.approx(sum(r["weight"] for r in mine))
    assert (engine.request_errors() and sum(e for *_, e in engine.request_errors())
            == pytest.approx(_exact(reqs)["errors"]))


@pytest.mark.parametrize("dist", ["lognormal", "bimodal"])
@pytest.mark.parametrize("every", [1, 5])
def test_summaries_with_sampled_traces_give_the_breakdown_of_all_traces(dist, every):
    # Production: summaries count every request, traces of some (marked counted, weighted
    # by how they were kept) bring what only traces carry (here: what the queue waits
    # behind, which the verdict reads). Against a collector fed every request's trace.
    reqs = _requests(2000, seed=2, dist=dist)
    production, all_traces = _engine(), _engine()
    production.ingest_metrics(_summaries(reqs).export())
    production.ingest_traces(_traces(reqs[::every], counted=True, factor=every).export())
    all_traces.ingest_traces(_traces(reqs).export())
    for e in (production, all_traces):
        e.flush()
    a = production.breakdown("svc", window_s=None)
    b = all_traces.breakdown("svc", window_s=None)
    assert a["verdict"]["bottleneck"] == b["verdict"]["bottleneck"]
    assert (a["requests"], a["errors"], a["traced_requests"]) == (
        b["requests"], b["errors"], b["traced_requests"])
    for row_a, row_b in zip(a["stages"], b["stages"], strict=True):
        assert row_a["stage"] == row_b["stage"]
        assert row_a["count"] == row_b["count"]
        assert row_a["p95"] == pytest.approx(row_b["p95"], rel=0.02)
        assert row_a["share_of_p95"] == pytest.approx(row_b["share_of_p95"], abs=0.01)


def test_traces_marked_counted_add_examples_and_gpu_but_count_nothing_twice():
    reqs = _requests(1500, seed=3)
    traced = reqs[::10]
    engine, only_summaries = _engine(), _engine()
    for e in (engine, only_summaries):
        e.ingest_metrics(_summaries(reqs).export())
    engine.ingest_traces(_traces(traced, counted=True, gpu=True).export())
    span = (reqs[-1]["end"]) * 1e-9
    engine.ingest_metrics(gpu_metrics([(t, 0.9) for t in np.arange(0.0, span, 0.01)]))
    engine.flush()
    doc = engine.breakdown("svc", window_s=None)
    ref = only_summaries.breakdown("svc", window_s=None)
    _assert_matches_exact(doc, _exact(reqs))
    for key in ("requests", "errors", "traced_requests", "latency", "stages"):
        assert doc[key] == ref[key], key
    assert engine.stats.requests_finalised == len(traced)
    # What only traces carry comes from the traces.
    assert doc["examples"] and not ref["examples"]
    assert doc["gpu"]["samples"] > 0 and doc["gpu"]["utilization_during_compute"]["p50"] == 0.9
    assert doc["padding"]["batches"] == len(traced) and doc["padding"]["waste_ratio"] == 0.25
    assert doc["queue"]["behind_batches"] is not None and ref["queue"] is None
    assert not ref["padding"]["batches"]
    assert any(e is not None for e in engine.histogram_exemplars("svc", "m", None))
    assert not any(only_summaries.histogram_exemplars("svc", "m", None))
    # Histograms, error counters, services and fleet tables: the summaries' alone.
    hist = {(s, m, st): (c.tolist(), t) for s, m, st, c, t in engine.histograms()}
    assert hist == {(s, m, st): (c.tolist(), t) for s, m, st, c, t in only_summaries.histograms()}
    assert engine.request_errors() == only_summaries.request_errors()
    assert engine.services() == only_summaries.services()
    assert _fleet(engine) == _fleet(only_summaries)


def test_traces_not_marked_counted_are_counted_beside_summaries():
    # Other producers (or requests a process does not summarise) still count by trace.
    reqs = _requests(600, seed=4)
    engine = _engine()
    engine.ingest_metrics(_summaries(reqs[:400]).export())
    engine.ingest_traces(_traces(reqs[400:]).export())
    engine.flush()
    _assert_matches_exact(engine.breakdown("svc", window_s=None), _exact(reqs))


def _fleet(engine: Engine) -> dict:
    out = {}
    for key, t in engine.fleet_tables().items():
        out[key] = {"stages": t.stages, "sums": t.sums, "tail": t.tail,
                    "tail_e2e": t.tail_e2e, "tail_traced": t.tail_traced}
    return out


def _add(into: dict, other: dict) -> None:
    for k, v in other.items():
        if isinstance(v, dict):
            _add(into.setdefault(k, {}), v)
        else:
            into[k] = into.get(k, 0.0) + v


def _close(a, b) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _close(a[k], b[k])
    else:
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12)


def test_fleet_tables_of_three_engines_fed_disjoint_thirds_sum_to_one_engines():
    reqs = _requests(1800, seed=5)
    whole = _engine()
    whole.ingest_metrics(_summaries(reqs).export())
    total: dict = {}
    for third in range(3):
        engine = _engine()
        engine.ingest_metrics(_summaries(reqs[third::3]).export())
        _add(total, _fleet(engine))
    _close(total, _fleet(whole))


def _point(metric, **change):
    """A copy of ``metric`` whose first data point is changed by ``change``."""
    m = type(metric)()
    m.CopyFrom(metric)
    dp = m.exponential_histogram.data_points[0]
    for key, value in change.items():
        if key == "attrs":
            del dp.attributes[:]
            dp.attributes.extend(value)
        elif key == "offset":
            dp.positive.offset = value
        elif key == "negative":
            dp.negative.bucket_counts.extend(value)
        elif key == "buckets":
            del dp.positive.bucket_counts[:]
            dp.positive.bucket_counts.extend(value)
            dp.count = dp.zero_count + sum(value)
        else:
            setattr(dp, key, value)
    del m.exponential_histogram.data_points[1:]
    return m


def _bad_metrics(metrics) -> list[tuple[object, str]]:
    from tests.collector.synth import attributes

    request, stage = metrics[0], metrics[1]
    cumulative = type(request)()
    cumulative.CopyFrom(request)
    cumulative.exponential_histogram.aggregation_temporality = 2
    gauge = type(request)(name=sc.METRIC_SUMMARY_REQUEST_DURATION)
    gauge.gauge.data_points.add().as_double = 1.0
    first = request.exponential_histogram.data_points[0]
    return [
        (_point(request, scale=21), "scale 21"),
        (_point(request, sum=float("nan")), "sum"),
        (_point(request, sum=-1.0), "sum"),
        # a sum no values in its buckets add up to (+Inf in the histogram sums at worst)
        (_point(request, sum=1e308), "sum is above"),
        (_point(request, negative=[3]), "negative"),
        (_point(request, count=10**6), "count"),
        (_point(request, buckets=[1] * (sm.MAX_BUCKETS + 1)), f"more than {sm.MAX_BUCKETS}"),
        (_point(request, buckets=[1], offset=2**30), f"above {MAX_VALUE:g}"),
        (_point(request, attrs=attributes({sc.ATTR_SAMPLE_WEIGHT: 0.5})), "weight"),
        (_point(request, attrs=attributes({sc.ATTR_SAMPLE_WEIGHT: float("nan")})), "weight"),
        # two values "at most 0.5 s", which would be read as zeros
        (_point(request, zero_count=first.zero_count + 2, count=first.count + 2,
                zero_threshold=0.5), "zero_threshold"),
        # 2 requests of weight 1e308 would sum to +Inf in every weighted count
        (_point(request, attrs=attributes({sc.ATTR_SAMPLE_WEIGHT: 1e308})), "2**56"),
        (_point(request, attrs=attributes({sc.ATTR_MODEL_NAME: 3})), "not a string"),
        (_point(request, attrs=attributes({sc.ATTR_REQUEST_ERROR: "yes"})), "not a bool"),
        (_point(stage, attrs=attributes({sc.ATTR_MODEL_NAME: "m"})), "no inferprof.stage"),
        (_point(stage, attrs=attributes({sc.ATTR_STAGE: "Bad Stage"})), "invalid"),
        (_point(stage, attrs=attributes({sc.ATTR_STAGE: "queue\n"})), "invalid"),
        (cumulative, "DELTA"),
        (gauge, "ExponentialHistogram"),
    ]


@pytest.mark.parametrize("case", range(19))
def test_a_bad_summary_data_point_is_rejected_with_its_reason_the_rest_kept(case):
    reqs = _requests(2000, seed=6)
    good = _summaries(reqs)
    metrics = good.metrics()
    bad, reason = _bad_metrics(_summaries(_requests(50, seed=7)).metrics())[case]
    engine = _engine()
    result = engine.ingest_metrics(good.export(metrics=[*metrics, bad]))
    n_bad = len(getattr(bad, bad.WhichOneof("data")).data_points)
    assert result.rejected_spans == n_bad
    assert result.accepted_spans == sum(
        len(m.exponential_histogram.data_points) for m in metrics)
    assert any(reason in e for e in result.errors), result.errors
    assert engine.stats.summary_points_rejected == n_bad
    assert engine.stats.summary_requests == len(reqs)
    _assert_matches_exact(engine.breakdown("svc", window_s=None), _exact(reqs))


def test_summaries_respect_the_series_and_stage_caps():
    engine = _engine(max_series=2, max_stages=sm_min_stages() + 1)
    for i in range(4):
        b = SummaryBuilder()
        b.add(0, 10_000_000, [("queue", 0, 4_000_000), (f"custom{i}", 4_000_000, 9_000_000)])
        engine.ingest_metrics(b.export(service=f"svc{i}"))
    assert [s["service"] for s in engine.services()] == ["__overflow__", "svc0", "svc1"]
    assert engine.stats.series_overflow == 2
    doc = engine.breakdown(sc.OVERFLOW_SERIES, window_s=None)
    assert doc["requests"] == 2
    # One custom stage fits; the others' rows are dropped and their time unattributed.
    rows = {s["stage"]: s for s in engine.breakdown("svc0", window_s=None)["stages"]}
    assert set(rows) == {"queue", "custom0", "unattributed"}
    for service in ("svc1", sc.OVERFLOW_SERIES):
        rows = {s["stage"]: s for s in engine.breakdown(service, window_s=None)["stages"]}
        assert set(rows) == {"queue", "unattributed"}
        assert rows["unattributed"]["share_of_p95"] == pytest.approx(0.6, abs=0.01)
    assert engine.stats.spans_dropped[sc.DROP_TOO_MANY_STAGES] == 3


def sm_min_stages() -> int:
    return len(sc.CANONICAL_STAGES) + 1


def test_representatives_lie_inside_their_buckets_at_every_scale():
    # In logarithms: at scale -10 a bucket spans a factor 2**1024, past a float.
    for scale in (sm.MIN_SCALE, -3, 0, 3, 7, sm.MAX_SCALE):
        index = np.arange(-50, 50)
        log_rep = np.log(sm.representatives(scale, index))
        ln_base = math.log(2) * 2.0**-scale
        lo = np.minimum(index * ln_base, math.log(MAX_VALUE))  # clamped to the sketch range
        hi = np.maximum((index + 1) * ln_base, math.log(1e-9))
        assert ((log_rep >= lo - 1e-9) & (log_rep <= hi + 1e-9)).all(), scale


def test_summaries_sent_as_otlp_json_over_http_are_folded():
    reqs = _requests(400, seed=8)
    body = json_format.MessageToDict(_summaries(reqs).export(service="json-svc"))
    with running_app() as app:
        resp = httpx.post(f"{app.otlp_http_endpoint}/v1/metrics", content=json.dumps(body),
                          headers={"content-type": "application/json"})
        assert resp.status_code == 200, resp.text
        assert "partialSuccess" not in resp.json()
        doc = breakdown(app, "json-svc", window=600).json()
        _assert_matches_exact(doc, _exact(reqs))
        # A bad data point answers a partial success naming it.
        bad = _summaries(reqs[:5]).export(service="json-svc")
        metric = bad.resource_metrics[0].scope_metrics[0].metrics[0]
        point = metric.exponential_histogram.data_points[0]
        point.scale = 99
        pb = httpx.post(f"{app.otlp_http_endpoint}/v1/metrics", content=bad.SerializeToString(),
                        headers={"content-type": "application/x-protobuf"})
        answer = metrics_service_pb2.ExportMetricsServiceResponse.FromString(pb.content)
        assert answer.partial_success.rejected_data_points == 1
        assert "scale 99" in answer.partial_success.error_message
        # What arrived, on the self-metrics: the requests counted, the point rejected.
        text = httpx.get(f"{app.api_url}/metrics").text
        assert f"{sc.PROM_SUMMARISED_REQUESTS} {len(reqs) + 5 - point.count}.0" in text
        assert f"{sc.PROM_SUMMARIES_REJECTED} 1.0" in text



_points = st.builds(
    dict,
    scale=st.integers(-40, 40),
    offset=st.integers(-(2**31), 2**31 - 1),
    buckets=st.lists(st.integers(0, 2**64 - 1), max_size=40),
    negative=st.lists(st.integers(0, 3), max_size=3),
    zero=st.integers(0, 2**64 - 1),
    count=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    total=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    weight=st.one_of(st.none(), st.floats(allow_nan=True), st.integers(-5, 10**6),
                     st.booleans(), st.text(max_size=3)),
    stage=st.one_of(st.none(), st.sampled_from(["queue", "unattributed", "Bad", ""]),
                    st.integers(-5, 5)),
    kind=st.sampled_from(sorted(sc.SUMMARY_METRICS)),
    temporality=st.sampled_from([0, 1, 2]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_points, min_size=1, max_size=4))
def test_any_summary_data_point_is_folded_or_rejected_never_raises(points):
    from tests.collector.synth import attributes

    request = metrics_service_pb2.ExportMetricsServiceRequest()
    scope = request.resource_metrics.add().scope_metrics.add()
    for p in points:
        metric = scope.metrics.add(name=p["kind"])
        metric.exponential_histogram.aggregation_temporality = p["temporality"]
        dp = metric.exponential_histogram.data_points.add(scale=p["scale"], zero_count=p["zero"])
        dp.positive.offset = p["offset"]
        dp.positive.bucket_counts.extend(p["buckets"])
        dp.negative.bucket_counts.extend(p["negative"])
        consistent = p["zero"] + sum(p["buckets"]) + sum(p["negative"])
        if p["count"] is not None:
            dp.count = p["count"]
        elif consistent < 2**64:  # else a count that cannot be right
            dp.count = consistent
        if p["total"] is not None:
            dp.sum = p["total"]
        dp.attributes.extend(attributes({sc.ATTR_SAMPLE_WEIGHT: p["weight"],
                                         sc.ATTR_STAGE: p["stage"]}))
    engine = _engine()
    result = engine.ingest_metrics(request)
    assert result.accepted_spans + result.rejected_spans == len(points)
    assert len(result.errors) == min(result.rejected_spans, 5)
    doc = engine.breakdown("unknown_service", window_s=None)
    if doc is not None:  # what was folded reads back as a document
        assert doc["requests"] >= 0


def test_overflow_and_cut_names_count_requests_once_with_summaries_and_marked_traces():
    # inferprof_series_overflow_total and inferprof_labels_truncated_total count requests:
    # a summarised request is one, whatever its data points, and its marked trace adds none.
    long_model = "m" * 300
    reqs = [{**r, "model": long_model} for r in _requests(90, seed=9)]
    engine = _engine(max_series=1)
    first = [{**r, "model": "m"} for r in _requests(10, seed=8)]  # the one series
    engine.ingest_metrics(_summaries(first).export(service="first"))
    engine.ingest_metrics(_summaries(reqs).export(service="svc"))
    engine.ingest_traces(_traces(reqs[:30], counted=True).export())
    engine.flush()
    assert engine.stats.series_overflow == len(reqs)
    assert engine.stats.labels_truncated["model"] == len(reqs)
    assert engine.breakdown(sc.OVERFLOW_SERIES, window_s=None)["requests"] == sum(
        r["weight"] for r in reqs)
