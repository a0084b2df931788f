"""``inferprof collect`` as a process: starts, serves, forwards, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from tests.collector.test_server_fixtures import make_requests

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-c", "from inferprof.cli import main; main()"]


def _start(args, env=None):
    proc = subprocess.Popen(
        [*CLI, "collect", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    urls = {}
    deadline = time.monotonic() + 30
    while len(urls) < 3 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.match(r"(OTLP/gRPC|OTLP/HTTP|API)\s+(\S+)", line)
        if m:
            urls[m.group(1)] = m.group(2)
    return proc, urls


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out


def test_collect_serves_forwards_and_stops_on_sigterm(otlp_sink):
    proc, urls = _start(
        [
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--api-port",
            "0",
            "--settle-s",
            "0.1",
            "--forward",
            f"otlp-grpc://127.0.0.1:{otlp_sink.port}",
        ],
        env={"INFERPROF_AUTH_TOKEN": "tok"},
    )
    try:
        assert set(urls) == {"OTLP/gRPC", "OTLP/HTTP", "API"}, proc.stdout
        assert all("127.0.0.1" in u for u in urls.values())  # loopback by default
        exporter = OTLPSpanExporter(
            endpoint=f"{urls['OTLP/HTTP']}/v1/traces",
            headers={"authorization": "Bearer tok"},
            timeout=10,
        )
        try:
            assert exporter.export(make_requests(5, service="cli")) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        api = urls["API"]
        assert httpx.get(f"{api}/api/v1/services").status_code == 401  # the env token applies

        def services():
            r = httpx.get(f"{api}/api/v1/services", headers={"authorization": "Bearer tok"})
            return r.json()["services"]

        deadline = time.monotonic() + 10
        while not services() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert services()[0]["service"] == "cli" and services()[0]["requests"] == 5
    finally:
        code, out = _stop(proc)
    assert code == 0, out
    assert "stopping" in out
    assert otlp_sink.wait_for(lambda s: len(s.spans()) == 20, timeout=5)


@pytest.mark.parametrize(("flag", "listener"), [
    ("--http-port", "OTLP/HTTP"), ("--api-port", "the API"), ("--grpc-port", "OTLP/gRPC"),
])
def test_collect_fails_clearly_when_a_port_is_taken(flag, listener):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        ports = {"--grpc-port": "0", "--http-port": "0", "--api-port": "0", flag: str(port)}
        proc = subprocess.run(
            [*CLI, "collect", *(x for kv in ports.items() for x in kv)],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode != 0
    # which listener, on which address
    assert "cannot start the collector" in proc.stderr
    assert f"cannot listen for {listener} on 127.0.0.1:{port}" in proc.stderr
    assert "add_port.cc" not in proc.stderr  # grpc's own C-level log line: not shown


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--forward", "tempo:4317"], "forward"),
        # in (0, 1) but outside the sketch's range: once a traceback at start-up
        (["--relative-accuracy", "0.1"], "--relative-accuracy must be in [0.0015, 0.05]"),
        (["--log-level", "bogus"], "Invalid value for '--log-level'"),
    ],
)
def test_collect_rejects_bad_flags_with_a_usage_error(flags, named):
    proc = subprocess.run(
        [*CLI, "collect", "--grpc-port", "0", "--http-port", "0", "--api-port", "0", *flags],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert named in proc.stderr
    assert "Traceback" not in proc.stderr
