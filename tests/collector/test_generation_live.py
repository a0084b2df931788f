"""``inferprof collect`` end to end with generation traces: OTLP/HTTP in, the breakdown's
``generation`` section and the §7 series out, on a real CollectorApp."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from inferprof import semconv as sc
from tests.collector.gen_synth import inferprof_exports, quantiles, simulate, truth_ttft
from tests.collector.test_server_fixtures import breakdown, running_app


def test_live_collector_serves_the_generation_section_and_series():
    scen = simulate(np.random.default_rng(41), n_requests=80, n_steps=1200, prefill_every=0.2)
    with running_app() as app:
        for export in inferprof_exports(scen):
            resp = httpx.post(f"{app.otlp_http_endpoint}/v1/traces",
                              content=export.SerializeToString(),
                              headers={"content-type": "application/x-protobuf"})
            assert resp.status_code == 200, resp.text
        app.engine.flush()
        resp = breakdown(app, "llm")
        assert resp.status_code == 200
        gen = resp.json()["generation"]
        truth = quantiles(*truth_ttft(scen))
        assert gen["ttft"]["p95"] == pytest.approx(truth["p95"], rel=0.01)
        assert gen["requests"] == 80 and gen["verdict"]["bottleneck"] == sc.VERDICT_SCHEDULING
        text = httpx.get(f"{app.api_url}/metrics").text
        assert f'{sc.PROM_TTFT}_count{{model="m",service="llm"}} 80.0' in text
        labels = '{cause="prefill_interference",model="m",service="llm"}'
        assert f"{sc.PROM_ITL_SHARE_OF_P95}{labels}" in text
        assert f"{sc.PROM_GEN_AI_REQUEST_DURATION}_bucket" in text
