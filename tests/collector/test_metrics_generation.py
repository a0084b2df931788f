"""Prometheus exposition of the generation series (contract §7, §14)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inferprof import semconv as sc
from inferprof.collector.engine import HISTOGRAM_BOUNDS, Engine
from inferprof.collector.generation import GENAI_TTFT_BOUNDS
from inferprof.collector.metrics import EngineCollector
from tests.collector.gen_synth import inferprof_exports, simulate, truth_itl, truth_ttft
from tests.collector.synth import FakeClock, TraceBuilder
from tests.collector.test_generation import _fold


@pytest.fixture(scope="module")
def scraped():
    scen = simulate(np.random.default_rng(21), n_requests=150, n_steps=2000, prefill_every=0.2,
                    weights=(1.0, 2.0))
    engine = _fold(inferprof_exports(scen))
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, window_s=300))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return scen, engine, text, families


def _value(families, name, suffix, **labels):
    matches = [s.value for s in families[name].samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, suffix, labels, matches)
    return matches[0]


def test_histograms_count_weighted_requests_and_gaps(scraped):
    scen, _, _, fam = scraped
    ttft, w = truth_ttft(scen)
    for name in (sc.PROM_TTFT, sc.PROM_GEN_AI_TTFT):
        assert _value(fam, name, "_count", service="llm", model="m") == pytest.approx(w.sum())
        assert _value(fam, name, "_sum", service="llm", model="m") == pytest.approx(
            float(np.dot(ttft, w)))
    # buckets: the inferprof histogram uses the request histogram's, GenAI its own
    le = {s.labels["le"] for s in fam[sc.PROM_TTFT].samples if s.name.endswith("_bucket")}
    assert len(le) == len(HISTOGRAM_BOUNDS) + 1
    le = {s.labels["le"] for s in fam[sc.PROM_GEN_AI_TTFT].samples if s.name.endswith("_bucket")}
    assert len(le) == len(GENAI_TTFT_BOUNDS) + 1
    itl, iw, _ = truth_itl(scen)
    assert _value(fam, sc.PROM_ITL, "_count", service="llm", model="m") == pytest.approx(iw.sum())
    below = float(iw[itl <= 0.01].sum())
    assert _value(fam, sc.PROM_ITL, "_bucket", service="llm", model="m", le="0.01") == (
        pytest.approx(below))
    for name in (sc.PROM_TPOT, sc.PROM_GEN_AI_TPOT, sc.PROM_GEN_AI_REQUEST_DURATION):
        assert _value(fam, name, "_count", service="llm", model="m") > 0
    steps = fam[sc.PROM_ENGINE_STEPS_RECEIVED.removesuffix("_total")]
    assert [s.value for s in steps.samples if s.name.endswith("_total")] == [len(scen.steps)]


def test_share_gauges_equal_the_breakdown_and_sum_to_one(scraped):
    _, engine, _, fam = scraped
    gen = engine.breakdown("llm", "m")["generation"]
    for family, label, items, key in (
        (sc.PROM_TTFT_SHARE_OF_P95, sc.PROM_LABEL_STAGE, gen["ttft"]["stages"], "stage"),
        (sc.PROM_ITL_SHARE_OF_P95, sc.PROM_LABEL_CAUSE, gen["itl"]["causes"], "cause"),
    ):
        got = {s.labels[label]: s.value for s in fam[family].samples}
        assert got == pytest.approx({it[key]: it["share_of_p95"] for it in items})
        assert sum(got.values()) == pytest.approx(1.0)
    assert set(got) == set(sc.ITL_CAUSES)


def test_generation_exposition_passes_promtool(scraped):
    _, _, text, _ = scraped
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed (Debian package prometheus; .ci/run installs it)")
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text.encode(), capture_output=True, check=False
    )
    problems = [
        line for line in result.stderr.decode().splitlines() + result.stdout.decode().splitlines()
        if line.strip() and 'non-summary metrics should not have "quantile" label' not in line
    ]
    assert problems == []


def test_series_without_generating_requests_have_no_generation_series():
    clock = FakeClock()
    engine = Engine(clock=clock)
    b = TraceBuilder()
    for i in range(20):
        b.sequential(i * 0.1, [("queue", 0.01), ("compute", 0.003)])
    engine.ingest_traces(b.export())
    clock.tick(5)
    assert "generation" not in engine.breakdown("svc")
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    text = generate_latest(registry).decode()
    assert f"{sc.PROM_TTFT}_count" not in text and sc.PROM_ITL_SHARE_OF_P95 + "{" not in text


def test_generation_series_stay_within_the_series_cap():
    """Past --max-series the generating requests fold into the overflow series like the
    rest; /metrics renders at most the cap and the overflow series."""
    scen = simulate(np.random.default_rng(22), n_requests=30, n_steps=800)
    exports = [*inferprof_exports(scen, service="a"), *inferprof_exports(scen, service="b"),
               *inferprof_exports(scen, service="c")]
    engine = _fold(exports, max_series=2)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, window_s=300, max_series=2))
    fam = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    services = {s.labels["service"] for s in fam[sc.PROM_TTFT].samples}
    assert services == {"a", "b", sc.OVERFLOW_SERIES}
    overflow = engine.breakdown(sc.OVERFLOW_SERIES)["generation"]
    assert overflow["requests"] == 30
