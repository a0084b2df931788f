"""The Prometheus EngineCollector: families, labels and values of contract §5."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inferprof import semconv as sc
from inferprof.collector.engine import HISTOGRAM_BOUNDS, Engine
from inferprof.collector.metrics import EngineCollector
from tests.collector.synth import FakeClock, TraceBuilder, gpu_metrics


@pytest.fixture
def scraped():
    clock = FakeClock()
    engine = Engine(clock=clock)
    b = TraceBuilder()
    for i in range(120):
        # queue dominates: verdict batching; one request of weight 3.
        b.sequential(
            i * 0.1,
            [("queue", 0.020 + 0.0001 * i), ("compute", 0.003)],
            weight=3.0 if i == 0 else None,
        )
    b.span("orphan", 0, 1, attrs={sc.ATTR_STAGE: "Bad"})
    engine.ingest_traces(b.export())
    clock.tick(5)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, window_s=300))
    text = generate_latest(registry).decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def _samples(families, name, suffix=""):
    return [s for s in families[name].samples if s.name == name + suffix]


def test_histograms_are_weighted_and_cumulative(scraped):
    _, fam = scraped
    name = sc.PROM_STAGE_DURATION.removesuffix("_seconds") + "_seconds"
    buckets = [s for s in _samples(fam, name, "_bucket") if s.labels["stage"] == "queue"]
    assert [s.labels["le"] for s in buckets][-1] == "+Inf"
    assert len(buckets) == len(HISTOGRAM_BOUNDS) + 1
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and counts[-1] == 122  # 119 + weight 3
    le_10ms = next(s.value for s in buckets if s.labels["le"] == "0.01")
    le_25ms = next(s.value for s in buckets if s.labels["le"] == "0.025")
    le_50ms = next(s.value for s in buckets if s.labels["le"] == "0.05")
    # queue = 20 ms + 0.1 ms * i: i = 0..50 are <= 25 ms, i = 0 weighs 3.
    assert le_10ms == 0 and le_25ms == 51 + 2 and le_50ms == 122
    req = _samples(fam, sc.PROM_REQUEST_DURATION, "_count")
    assert req[0].value == 122 and "stage" not in req[0].labels


def test_quantiles_shares_and_one_hot_verdict(scraped):
    _, fam = scraped
    q = {
        (s.labels["stage"], s.labels["quantile"]): s.value
        for s in _samples(fam, sc.PROM_STAGE_QUANTILE)
    }
    assert q[("compute", "0.5")] == pytest.approx(0.003, rel=0.01)
    assert ("queue", "0.99") in q and ("unattributed", "0.5") in q
    shares = {s.labels["stage"]: s.value for s in _samples(fam, sc.PROM_STAGE_SHARE_OF_P95)}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["queue"] > 0.8
    verdicts = {s.labels["verdict"]: s.value for s in _samples(fam, sc.PROM_BOTTLENECK)}
    assert set(verdicts) == set(sc.VERDICTS)
    assert verdicts == {v: (1.0 if v == sc.VERDICT_BATCHING else 0.0) for v in sc.VERDICTS}
    labels = _samples(fam, sc.PROM_BOTTLENECK)[0].labels
    assert labels["service"] == "svc" and labels["model"] == "m"


def test_self_metrics(scraped):
    _, fam = scraped
    base = sc.PROM_SPANS_RECEIVED.removesuffix("_total")
    assert _samples(fam, base, "_total")[0].value == 361
    dropped = _samples(fam, sc.PROM_SPANS_DROPPED.removesuffix("_total"), "_total")
    counts = {s.labels["reason"]: s.value for s in dropped}
    # every reason is there from the start, at 0, so the first drop shows in rate()
    assert counts[sc.DROP_INVALID_STAGE] == 1 and len(counts) == 14
    assert all(v == 0 for r, v in counts.items() if r != sc.DROP_INVALID_STAGE)
    assert _samples(fam, sc.PROM_TRACES_INCOMPLETE.removesuffix("_total"), "_total")[0].value == 0
    gpu = sc.PROM_GPU_SAMPLES_RECEIVED.removesuffix("_total")
    assert _samples(fam, gpu, "_total")[0].value == 0  # present before the first sample
    partial = sc.PROM_TRITON_REQUESTS_PARTIAL.removesuffix("_total")
    assert _samples(fam, partial, "_total")[0].value == 0


def test_series_reclaimed_counted():
    clock = FakeClock()
    engine = Engine(clock=clock, max_series=1, windows_s=(60.0,), slice_s=10.0)
    for model, idle in (("a", 100.0), ("b", 0.0)):
        b = TraceBuilder()
        b.sequential(0.0, [("compute", 0.01)], model=model)
        engine.ingest_traces(b.export())
        clock.tick(5.0)
        engine.advance()  # folded now
        clock.tick(idle)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, window_s=60))
    fam = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    reclaimed = sc.PROM_SERIES_RECLAIMED.removesuffix("_total")
    assert _samples(fam, reclaimed, "_total")[0].value == 1
    models = {s.labels.get("model") for s in _samples(fam, sc.PROM_REQUEST_DURATION, "_count")}
    assert models == {"b"}


def test_gpu_samples_received_counted():
    engine = Engine(clock=FakeClock())
    engine.ingest_metrics(gpu_metrics([(0.0, 0.5), (0.1, 0.6), (0.2, float("nan"))]))
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, window_s=300))
    fam = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    gpu = sc.PROM_GPU_SAMPLES_RECEIVED.removesuffix("_total")
    assert _samples(fam, gpu, "_total")[0].value == 2  # the NaN point is rejected


def test_exposition_passes_promtool(scraped):
    text, _ = scraped
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text.encode(), capture_output=True, check=False
    )
    problems = [
        line
        for line in result.stderr.decode().splitlines() + result.stdout.decode().splitlines()
        # The contract (§5) names this gauge's label ``quantile``; promtool's lint prefers
        # that label on summaries only. Everything else must be clean.
        if line.strip() and 'non-summary metrics should not have "quantile" label' not in line
    ]
    assert problems == []


def test_the_overflow_series_is_rendered_and_counted():
    # The engine folds the pairs past its cap into service="__overflow__"; /metrics, which
    # renders as many pairs as the engine keeps, must show it and count what went there.
    clock = FakeClock()
    engine = Engine(clock=clock, max_series=2)
    b = TraceBuilder()
    for i, model in enumerate("abcdc"):
        b.sequential(i * 0.1, [("compute", 0.01)], model=model)
    engine.ingest_traces(b.export())
    clock.tick(5)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, max_series=2))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    pairs = {(s.labels["service"], s.labels["model"]) for s in fams[sc.PROM_BOTTLENECK].samples}
    assert pairs == {("svc", "a"), ("svc", "b"), (sc.OVERFLOW_SERIES, "")}
    req = {s.labels["service"]: s.value for s in fams[sc.PROM_REQUEST_DURATION].samples
           if s.name.endswith("_count") and s.labels["service"] == sc.OVERFLOW_SERIES}
    assert req[sc.OVERFLOW_SERIES] == 3
    overflow = _samples(fams, sc.PROM_SERIES_OVERFLOW.removesuffix("_total"), "_total")
    assert overflow[0].value == 3


def test_series_cap_and_bad_arguments():
    clock = FakeClock()
    engine = Engine(clock=clock)
    b = TraceBuilder()
    for model in "abc":
        b.sequential(0.0, [("compute", 0.01)], model=model)
    engine.ingest_traces(b.export())
    clock.tick(5)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, max_series=2))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    models = {s.labels["model"] for s in fams[sc.PROM_BOTTLENECK].samples}
    assert models == {"a", "b"}
    with pytest.raises(ValueError):
        EngineCollector(engine, window_s=0)
    with pytest.raises(ValueError):
        EngineCollector(engine, max_series=0)


def test_queue_behind_batches_gauge(scraped):
    from tests.collector.test_queueing import _worker_bound

    _, fam = scraped
    # one request at a time there: no queue ever waits behind another request's compute
    (alone,) = _samples(fam, sc.PROM_QUEUE_BEHIND_BATCHES)
    assert alone.value == 0.0
    clock = FakeClock()
    engine = Engine(clock=clock)
    engine.ingest_traces(_worker_bound().export())
    clock.tick(5)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, window_s=300))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    (sample,) = _samples(families, sc.PROM_QUEUE_BEHIND_BATCHES)
    doc = engine.breakdown("svc", "m", 300)
    assert sample.value == pytest.approx(doc["queue"]["behind_batches"]) and sample.value > 0.9
    assert sample.labels == {"service": "svc", "model": "m"}


def test_request_quantile_gauge_is_the_breakdowns_latency(scraped):
    text, fam = scraped
    q = {s.labels["quantile"]: s for s in _samples(fam, sc.PROM_REQUEST_QUANTILE)}
    assert set(q) == {"0.5", "0.95", "0.99"}
    assert q["0.95"].labels == {"service": "svc", "model": "m", "quantile": "0.95"}
    # queue 20-31.9 ms + compute 3 ms, one request weighing 3: p95 near 33.3 ms
    assert q["0.95"].value == pytest.approx(0.003 + 0.020 + 0.0001 * 113, rel=0.02)
    assert q["0.5"].value < q["0.95"].value < q["0.99"].value
    assert "End-to-end request latency quantile over the last 300 s" in text


def _scraped_engine(n: int, window_s: float, **engine_options):
    """(engine, clock, registry): ``n`` queue+compute requests 0.1 s apart, folded, and a
    registry whose scrapes read the engine over ``window_s``."""
    clock = FakeClock()
    engine = Engine(clock=clock, **engine_options)
    b = TraceBuilder()
    for i in range(n):
        b.sequential(i * 0.1, [("queue", 0.02), ("compute", 0.003)])
    engine.ingest_traces(b.export())
    clock.tick(5)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, window_s=window_s))
    return engine, clock, registry


def test_a_window_longer_than_retention_is_read_and_named_as_the_retention():
    engine, _, registry = _scraped_engine(50, 300, windows_s=(10.0,), slice_s=1.0)
    text = generate_latest(registry).decode()
    assert "Per-stage latency quantile over the last 10 s." in text
    assert "over the last 300 s" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (p95,) = [s for s in _samples(families, sc.PROM_REQUEST_QUANTILE)
              if s.labels["quantile"] == "0.95"]
    assert p95.value == pytest.approx(engine.breakdown("svc", "m", 10)["latency"]["p95"])


def test_request_errors_counter():
    clock = FakeClock()
    engine = Engine(clock=clock)
    b = TraceBuilder()
    for i in range(20):
        req = b.request(i * 0.01, i * 0.01 + 0.02, status=2 if i < 5 else 0)
        b.stage(req, "compute", i * 0.01, i * 0.01 + 0.02)
    engine.ingest_traces(b.export())
    clock.tick(5)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, window_s=300))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    name = sc.PROM_REQUEST_ERRORS.removesuffix("_total")
    (sample,) = _samples(families, name, "_total")
    assert sample.value == 5.0 and sample.labels == {"service": "svc", "model": "m"}


def test_windowed_series_and_the_verdict_leave_together_when_a_service_goes_quiet():
    # A service that stopped sending: its quantile and share gauges leave the scrape once
    # the window holds none of its requests, and so does its verdict (not an everlasting
    # "unknown" = 1 on dashboards); the cumulative histogram stays.
    _, clock, registry = _scraped_engine(120, 60, windows_s=(60.0,), slice_s=10.0)

    def present():
        families = {f.name: f for f in text_string_to_metric_families(
            generate_latest(registry).decode())}
        return {name for name in (sc.PROM_STAGE_QUANTILE, sc.PROM_STAGE_SHARE_OF_P95,
                                  sc.PROM_BOTTLENECK)
                if name in families and families[name].samples}, families

    now, _ = present()
    assert now == {sc.PROM_STAGE_QUANTILE, sc.PROM_STAGE_SHARE_OF_P95, sc.PROM_BOTTLENECK}
    clock.tick(200)
    later, families = present()
    assert later == set()
    hist = sc.PROM_REQUEST_DURATION
    assert next(s for s in families[hist].samples if s.name == hist + "_count").value == 120
