"""The recommended production setting end to end, as docs/overhead.md gives it: the example
service in ``production`` mode exporting OTLP/HTTP into a real ``inferprof collect``, whose
breakdown then holds every contract stage with weighted counts."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from inferprof import semconv
from tests.integration.test_collector_cli import _start
from tests.integration.test_collector_cli import _stop as _stop_collector
from tests.integration.test_demo_example import _stop as _stop_service
from tests.integration.test_demo_example import start_uvicorn

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 400


def _start_example(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    return start_uvicorn("examples.demo_service:app", env)


def test_production_mode_over_otlp_http_into_the_collector_gives_every_stage():
    collector, urls = _start(["--grpc-port", "0", "--http-port", "0", "--api-port", "0",
                              "--settle-s", "0.1"])
    try:
        assert {"OTLP/HTTP", "API"} <= set(urls), collector.stdout
        service, url = _start_example({
            "INFERPROF_MODE": "production",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": urls["OTLP/HTTP"],
        })
        try:
            texts = ["The tide came in over the harbour wall.", "Pruning apple trees in winter.",
                     "The signal box released the token to the driver."]

            def post(i: int) -> int:
                body = {"text": " ".join([texts[i % 3]] * (1 + i % 7))}
                return httpx.post(url + "/v1/classify", json=body, timeout=30).status_code

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                codes = list(pool.map(post, range(REQUESTS)))
            assert codes == [200] * REQUESTS
        finally:
            _stop_service(service)  # the lifespan's inferprof.shutdown() flushes the spans
            errors = service.stderr.read()
            service.stderr.close()
        assert not re.search(r"Failed to export|Connection refused", errors), errors

        def breakdown() -> dict | None:
            r = httpx.get(urls["API"] + "/api/v1/breakdown", params={"service": "demo-classifier"})
            return r.json() if r.status_code == 200 else None

        deadline = time.monotonic() + 15
        body = breakdown()
        while (body is None or not body.get("stages")) and time.monotonic() < deadline:
            time.sleep(0.2)
            body = breakdown()
        assert body is not None, "the collector never heard of the service"
        metrics = httpx.get(urls["API"] + "/metrics").text
    finally:
        code, out = _stop_collector(collector)
    assert code == 0, out

    stages = {s["stage"]: s for s in body["stages"]}
    want = {semconv.STAGE_RECEIVE, semconv.STAGE_TOKENIZE, semconv.STAGE_QUEUE,
            semconv.STAGE_BATCH_ASSEMBLY, semconv.STAGE_H2D, semconv.STAGE_COMPUTE,
            semconv.STAGE_D2H, semconv.STAGE_POSTPROCESS, semconv.STAGE_SERIALIZE}
    assert want <= set(stages), want - set(stages)
    # Every timed request is counted by the summaries (contract §15), each with the weight
    # of the timing budget's share; the traces are a sample of them, marked counted, so
    # nothing is counted twice. traced_requests counts the requests measured (summarised
    # or traced), unweighted: all of them when every request was timed, and then the
    # request count is exact; above the budget of 100 a second a random share is timed
    # and the weighted count estimates every request served (a loose bound: about 400 +-
    # 100 when a quarter is timed).
    summarised = re.search(rf"^{semconv.PROM_SUMMARISED_REQUESTS} (\S+)$", metrics, re.M)
    assert summarised is not None and float(summarised.group(1)) > 0, "no summaries came"
    assert body["traced_requests"] == float(summarised.group(1)) <= REQUESTS
    if body["traced_requests"] == REQUESTS:
        assert body["requests"] == REQUESTS
    assert 0.25 * REQUESTS < body["requests"] < 2.5 * REQUESTS
