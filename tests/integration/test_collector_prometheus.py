"""A real Prometheus scrapes the collector's /metrics; PromQL returns the per-stage p95.

Also checks the shipped alert rules with promtool (syntax and unit tests).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import socket
import subprocess
import time

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from inferprof import semconv as sc
from tests.collector.test_server_fixtures import breakdown, make_requests, running_app

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
BUDGETS = ROOT / "deploy" / "prometheus" / "budgets.yml"
BUDGETS_TEST = ROOT / "deploy" / "prometheus" / "budgets_test.yml"
FLEET = ROOT / "deploy" / "prometheus" / "fleet.yml"
FLEET_TEST = ROOT / "deploy" / "prometheus" / "fleet_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "inferprof-dashboard.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus with a temp config/data dir; yields start(*targets, flags=()) ->
    base URL (``flags``: more command-line flags, e.g. a feature to enable; ``metrics_path``:
    the path scraped)."""
    if PROMETHEUS is None:
        pytest.fail("prometheus is not installed (apt-get install prometheus)")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    procs = []

    def start(*targets: str, flags: tuple[str, ...] = (), metrics_path: str = "/metrics") -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {RULES}\n  - {BUDGETS}\n  - {FLEET}\n"
            "scrape_configs:\n"
            "  - job_name: inferprof\n"
            f"    metrics_path: {metrics_path}\n"
            f"    static_configs:\n      - targets: {json.dumps(list(targets))}\n"
        )
        with open(tmp_path / "prometheus.log", "wb") as log:  # the child keeps its own handle
            procs.append(
                subprocess.Popen(
                    [
                        PROMETHEUS,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={tmp_path / 'data'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                        *flags,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if procs[0].poll() is not None:
                pytest.fail((tmp_path / "prometheus.log").read_text())
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail("prometheus did not become ready")

    try:
        yield start
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _query(url: str, promql: str, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = httpx.get(f"{url}/api/v1/query", params={"query": promql}).json()
        assert resp["status"] == "success", resp
        if resp["data"]["result"]:
            return resp["data"]["result"]
        time.sleep(0.25)
    pytest.fail(f"no result for {promql}")


def test_prometheus_scrapes_the_collector_and_promql_gives_per_stage_p95(prometheus):
    with running_app() as app:
        exporter = OTLPSpanExporter(endpoint=app.otlp_grpc_endpoint, insecure=True, timeout=10)
        try:
            assert exporter.export(make_requests(60, service="prom")) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        doc = breakdown(app, "prom").json()
        expected = {s["stage"]: s["p95"] for s in doc["stages"]}
        url = prometheus(f"127.0.0.1:{app.api_port}")

        q = f'{sc.PROM_STAGE_QUANTILE}{{service="prom",quantile="0.95"}}'
        result = _query(url, q)
        got = {r["metric"]["stage"]: float(r["value"][1]) for r in result}
        for stage in (sc.STAGE_QUEUE, sc.STAGE_COMPUTE, sc.STAGE_TOKENIZE):
            assert got[stage] == pytest.approx(expected[stage], rel=1e-6)
        assert got[sc.STAGE_QUEUE] == pytest.approx(0.100, rel=0.01)
        assert all(r["metric"]["model"] == "m" for r in result)

        # The recording rule from deploy/prometheus/alerts.yml evaluates on the scraped data.
        recorded = _query(url, 'inferprof:stage_p95_seconds{service="prom",stage="queue"}')
        assert float(recorded[0]["value"][1]) == pytest.approx(expected[sc.STAGE_QUEUE], rel=1e-6)
        # ... and so does the page alert's: the breakdown's end-to-end p95, exactly
        page = _query(url, 'inferprof:request_p95_seconds{service="prom"}')
        assert float(page[0]["value"][1]) == pytest.approx(doc["latency"]["p95"], rel=1e-6)
        # The shipped budgets (budgets.yml: 0.5 s for every stage) apply to each stage seen.
        budgets = _query(url, 'inferprof:stage_budget_applied_seconds{service="prom"}')
        assert {r["metric"]["stage"]: float(r["value"][1]) for r in budgets} == {
            stage: 0.5 for stage in got
        }

        # Histograms aggregate across instances: histogram_quantile over them works too.
        hq = _query(
            url,
            "histogram_quantile(0.5, sum by (le) "
            f'({sc.PROM_STAGE_DURATION}_bucket{{service="prom",stage="compute"}}))',
        )
        assert 0.01 <= float(hq[0]["value"][1]) <= 0.025  # 20 ms lies in the (10, 25] ms bucket

        # Transport self-metrics are scraped as well.
        ok = _query(url, 'inferprof_otlp_requests_total{transport="grpc",outcome="ok"}')
        assert float(ok[0]["value"][1]) == 1.0
        # What the alert rules watch exists before anything goes wrong, at 0, so that the
        # first overload or drop is an increase rate() sees.
        overloaded = _query(url, 'inferprof_otlp_requests_total{outcome="overloaded"}')
        assert len(overloaded) == 6 and all(float(r["value"][1]) == 0 for r in overloaded)
        drops = _query(url, 'inferprof_spans_dropped_total{reason="late"}')
        assert float(drops[0]["value"][1]) == 0

        # Every query of the shipped Grafana dashboard is valid PromQL on this data, and the
        # per-stage p95 panel shows the stages.
        dashboard = json.loads(DASHBOARD.read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = (
                    target["expr"]
                    .replace("$service", "prom")
                    .replace("$model", ".*")
                    .replace("$__rate_interval", "1m")
                )
                resp = httpx.get(f"{url}/api/v1/query", params={"query": expr}).json()
                assert resp["status"] == "success", (panel["title"], expr, resp)
        # A stat of the current verdict: an instant query (a range one keeps every verdict
        # that held at any time in the dashboard's range, one tile each).
        (verdict,) = [p for p in dashboard["panels"] if "verdict" in p["title"].lower()]
        assert all(t.get("instant") is True for t in verdict["targets"])
        p95_panel = dashboard["panels"][0]["targets"][0]["expr"]
        stages = _query(url, p95_panel.replace("$service", "prom").replace("$model", ".*"))
        assert {r["metric"]["stage"] for r in stages} >= {"queue", "compute", "tokenize"}
        # the queue panel shows the breakdown's queue.behind_batches
        (queue_panel,) = [p for p in dashboard["panels"] if sc.PROM_QUEUE_BEHIND_BATCHES in
                          p["targets"][0]["expr"]]
        behind = _query(url, queue_panel["targets"][0]["expr"].replace("$service", "prom")
                        .replace("$model", ".*"))
        assert float(behind[0]["value"][1]) == pytest.approx(doc["queue"]["behind_batches"])


def test_prometheus_stores_the_histograms_exemplars_pointing_at_slow_traces(prometheus):
    spans = make_requests(60, service="ex", slow_every=10)
    slow = {format(s.context.trace_id, "032x") for s in spans
            if s.name == sc.span_name(sc.STAGE_QUEUE) and s.end_time - s.start_time > 50e6}
    assert len(slow) == 6
    with running_app() as app:
        exporter = OTLPSpanExporter(endpoint=app.otlp_grpc_endpoint, insecure=True, timeout=10)
        try:
            assert exporter.export(spans) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        breakdown(app, "ex")
        url = prometheus(f"127.0.0.1:{app.api_port}", flags=("--enable-feature=exemplar-storage",))
        query = f'{sc.PROM_STAGE_DURATION}_bucket{{service="ex",stage="queue"}}'
        deadline = time.monotonic() + 20
        found: dict[str, list] = {}
        while time.monotonic() < deadline and not found:
            now = time.time()
            resp = httpx.get(
                f"{url}/api/v1/query_exemplars",
                params={"query": query, "start": now - 600, "end": now + 60},
            ).json()
            assert resp["status"] == "success", resp
            for series in resp["data"]:
                found[series["seriesLabels"]["le"]] = series["exemplars"]
            time.sleep(0.25)
        # The slow queues (100 ms) fall in the (0.05, 0.1] bucket: its exemplar is one of
        # them; the fast ones (10 ms) in (0.005, 0.01].
        assert {ex["labels"]["trace_id"] for ex in found["0.1"]} <= slow
        assert float(found["0.1"][0]["value"]) == pytest.approx(0.1, rel=1e-6)
        assert not {ex["labels"]["trace_id"] for ex in found["0.01"]} & slow
        # and the request histogram's slowest bucket names a slow trace as well
        resp = httpx.get(
            f"{url}/api/v1/query_exemplars",
            params={"query": f'{sc.PROM_REQUEST_DURATION}_bucket{{service="ex"}}',
                    "start": time.time() - 600, "end": time.time() + 60},
        ).json()
        tail = max(resp["data"], key=lambda series: float(series["seriesLabels"]["le"]))
        assert tail["exemplars"][0]["labels"]["trace_id"] in slow
        # What Grafana asks for each dashboard query marked `exemplar`: exemplars come back,
        # the slow queue's among them.
        dashboard = json.loads(DASHBOARD.read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                if not target.get("exemplar"):
                    continue
                expr = (target["expr"].replace("$service", "ex").replace("$model", ".*")
                        .replace("$__rate_interval", "1m"))
                resp = httpx.get(
                    f"{url}/api/v1/query_exemplars",
                    params={"query": expr, "start": time.time() - 600, "end": time.time() + 60},
                ).json()
                assert resp["status"] == "success", (panel["title"], resp)
                ids = {ex["labels"]["trace_id"] for series in resp["data"]
                       for ex in series["exemplars"]}
                assert ids & slow, (panel["title"], expr)


def test_dashboard_cost_panels_read_the_breakdowns_cost(prometheus):
    from tests.collector.synth import gpu_metrics
    from tests.collector.test_cost import POWER, _workload

    base = time.time() - 30
    export, *_ = _workload(base)
    dashboard = json.loads(DASHBOARD.read_text())
    panels = {p["id"]: p for p in dashboard["panels"]}
    with running_app(gpu_hour_prices=(("", 3.6),)) as app:
        app.engine.ingest_traces(export)
        for gpu in ("GPU-0", "GPU-1"):
            app.engine.ingest_metrics(gpu_metrics(POWER, metric=sc.METRIC_GPU_POWER_DRAW,
                                                  hw_id=gpu, base_unix=base))
        app.engine.ingest_metrics(gpu_metrics([(0.15, 0.5), (0.25, 0.7)], base_unix=base))
        docs = {m: breakdown(app, "svc", model=m).json() for m in ("a", "b")}
        url = prometheus(f"127.0.0.1:{app.api_port}")

        def panel(pid: int, ref: str = "A") -> dict:
            (target,) = [t for t in panels[pid]["targets"] if t["refId"] == ref]
            expr = target["expr"].replace("$service", "svc").replace("$model", ".*")
            return {(r["metric"]["model"], r["metric"].get("stage", "")): float(r["value"][1])
                    for r in _query(url, expr)}

        def expected(field: str) -> dict:
            return {(m, st["stage"]): st[field] for m, doc in docs.items()
                    for st in doc["cost"]["stages"] if st[field] is not None}

        # (which model's series holds a batch's padding and compute windows depends on the
        # member folded first: compared per model, whichever it is)
        assert panel(13) == pytest.approx(expected("gpu_seconds_per_request"))
        assert panel(14) == pytest.approx(expected("energy_joules_per_request"))
        assert panel(15) == pytest.approx(expected("cost_per_request"))
        assert panel(15, "B") == pytest.approx(
            {(m, ""): doc["cost"]["cost_per_request"] for m, doc in docs.items()})
        assert panel(16, "A") == pytest.approx(
            {(m, ""): doc["padding"]["waste_ratio"] for m, doc in docs.items()
             if doc["padding"]["waste_ratio"] is not None})
        assert panel(16, "B") == pytest.approx(
            {(m, ""): doc["gpu"]["utilization_during_compute"]["mean"]
             for m, doc in docs.items() if doc["gpu"]["utilization_during_compute"]})
        assert len(panel(14)) >= 1 and len(panel(16, "A")) == 1


def test_dashboard_reads_one_series_per_stage_from_several_collectors(prometheus):
    # Scaled out (trace-ID load balancing), every collector reports the same service: the
    # dashboard's per-service panels must show one line per stage, not one per collector,
    # and the verdict panel one tile per verdict stated, counting the collectors.
    dashboard = json.loads(DASHBOARD.read_text())
    panels = {p["id"]: p for p in dashboard["panels"]}
    with running_app() as first, running_app() as second:
        for app in (first, second):
            exporter = OTLPSpanExporter(endpoint=app.otlp_grpc_endpoint, insecure=True, timeout=10)
            try:
                assert exporter.export(make_requests(60, service="fleet")) is SpanExportResult.SUCCESS
            finally:
                exporter.shutdown()
        url = prometheus(f"127.0.0.1:{first.api_port}", f"127.0.0.1:{second.api_port}")
        raw = f'{sc.PROM_STAGE_QUANTILE}{{service="fleet",quantile="0.95",stage="queue"}}'
        deadline = time.monotonic() + 20
        while len(_query(url, raw)) < 2 and time.monotonic() < deadline:
            time.sleep(0.25)
        assert len(_query(url, raw)) == 2  # one per collector

        def panel(pid: int) -> list[dict]:
            expr = panels[pid]["targets"][0]["expr"]
            return _query(url, expr.replace("$service", "fleet").replace("$model", ".*"))

        p95 = panel(1)
        stages = [r["metric"]["stage"] for r in p95]
        assert len(stages) == len(set(stages)) and {"queue", "compute"} <= set(stages)
        shares = panel(2)
        assert sum(float(r["value"][1]) for r in shares) == pytest.approx(1.0, abs=1e-6)
        (verdict,) = panel(3)
        assert float(verdict["value"][1]) == 2.0  # both collectors state it
        assert len(panel(10)) == 1
        # the alert rules' traffic guard is one series per (service, model) as well
        (_,) = _query(url, 'inferprof:requests_5m{service="fleet"}')


def test_promtool_accepts_and_unit_tests_the_alert_rules():
    if PROMTOOL is None:
        pytest.fail("promtool is not installed (apt-get install prometheus)")
    check = subprocess.run(
        [PROMTOOL, "check", "rules", str(RULES), str(BUDGETS), str(FLEET)],
        check=False, capture_output=True, text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS" in check.stdout
    unit = subprocess.run(
        [PROMTOOL, "test", "rules", str(RULES_TEST), str(BUDGETS_TEST), str(FLEET_TEST)],
        check=False,
        capture_output=True,
        text=True,
        cwd=RULES.parent,
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr
