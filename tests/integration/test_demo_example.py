"""examples/demo_service.py, the how-to example, under real uvicorn: it must keep working."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from inferprof import semconv
from tests.otlp_sink import attributes

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def start_uvicorn(app: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """A uvicorn process serving ``app`` on an ephemeral 127.0.0.1 port (``env`` over
    this process's) and its base URL, once it listens; stopped and an AssertionError if
    it does not within 60 s."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", "0"],
        cwd=ROOT, env={**os.environ, **env}, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        m = _LISTENING.search(line)
        if m:
            return proc, f"http://127.0.0.1:{m.group(1)}"
    _stop(proc)
    proc.stderr.close()
    raise AssertionError(f"the service {app} did not start")


@pytest.fixture
def example_service(otlp_sink):
    proc, url = start_uvicorn(
        "examples.demo_service:app", {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_sink.endpoint}
    )
    try:
        yield url, lambda: _stop(proc)
    finally:
        _stop(proc)
        proc.stderr.close()


def _stop(proc):
    if proc.poll() is None:
        proc.terminate()  # graceful: the lifespan's inferprof.shutdown() flushes spans
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_example_answers_and_traces_every_stage(example_service, otlp_sink):
    url, stop = example_service
    texts = ["The tide came in over the harbour wall.", "Pruning apple trees in winter.",
             "The signal box released the token to the driver."]
    with httpx.Client(timeout=30) as client:
        answers = [client.post(url + "/v1/classify", json={"text": t}) for t in texts]
        assert client.post(url + "/v1/classify", json={"text": ""}).status_code == 422
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[0].json()["topic"] == "harbour"
    assert all(a.json()["top_tokens"] for a in answers)
    stop()

    want = {semconv.STAGE_RECEIVE, semconv.STAGE_TOKENIZE, semconv.STAGE_QUEUE,
            semconv.STAGE_BATCH_ASSEMBLY, semconv.STAGE_H2D, semconv.STAGE_COMPUTE,
            semconv.STAGE_D2H, semconv.STAGE_POSTPROCESS, semconv.STAGE_SERIALIZE}

    def seen(sink):
        return {attributes(s).get(semconv.ATTR_STAGE) for _, s in sink.spans()}

    assert otlp_sink.wait_for(lambda s: want <= seen(s), timeout=20), want - seen(otlp_sink)
    services = {r.get(semconv.RESOURCE_SERVICE_NAME) for r, _ in otlp_sink.spans()}
    assert services == {"demo-classifier"}
