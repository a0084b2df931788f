"""SIGTERM stops ``inferprof collect`` within a bounded time, whatever it holds: pending
traces (settled or not, with and without request spans), linked batch spans, batches
remembered, GPU samples, and a forwarding queue whose destination never answers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.collector.synth import TraceBuilder, bulk_export, gpu_metrics

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-c", "from inferprof.cli import main; main()"]
#: gRPC grace (2 s) + flush (5 s) + forwarding (5 s) + HTTP (a few s), with room for a
#: loaded machine; the forwarding timeout alone (60 s) is well past it.
BOUND_S = 30.0


def _post(client: httpx.Client, url: str, message) -> None:
    r = client.post(url, content=message.SerializeToString(),
                    headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 200, r.text


def test_sigterm_returns_in_bounded_time_with_pending_state_of_every_kind():
    with contextlib.ExitStack() as stack:
        hung = stack.enter_context(socket.socket())
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)  # accepts connections (the kernel does) and never answers
        proc = subprocess.Popen(
            [*CLI, "collect", "--grpc-port", "0", "--http-port", "0", "--api-port", "0",
             "--settle-s", "120", "--forward", f"http://127.0.0.1:{hung.getsockname()[1]}",
             "--forward-timeout-s", "60", "--log-level", "WARNING"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        try:
            urls = {}
            while len(urls) < 3:
                line = proc.stdout.readline()
                assert line, "the collector exited before listening"
                m = re.match(r"(OTLP/HTTP|API|OTLP/gRPC)\s+(\S+)", line)
                if m:
                    urls[m.group(1)] = m.group(2)
            otlp = urls["OTLP/HTTP"]
            with httpx.Client(timeout=60) as client:
                # Linked batch spans whose members have not come: 300,000 index entries.
                for _ in range(3):
                    _post(client, f"{otlp}/v1/traces", bulk_export(100, links_per_span=1000))
                # 150,000 stage spans of traces with no request span yet.
                for _ in range(3):
                    _post(client, f"{otlp}/v1/traces", bulk_export(50_000))
                # 20,000 requests not settled yet (--settle-s 120), their batches remembered
                # once folded.
                b = TraceBuilder(base_unix=time.time() - 1)
                for i in range(20_000):
                    req = b.request(i * 1e-4, i * 1e-4 + 0.05)
                    b.stage(req, "compute", i * 1e-4 + 0.01, i * 1e-4 + 0.04,
                            batch_id=f"b{i // 8}", batch_size=8, effective=60, padded=64)
                    if i % 5000 == 4999:
                        _post(client, f"{otlp}/v1/traces", b.export())
                # GPU samples.
                now = time.time()
                for gpu in range(8):
                    _post(client, f"{otlp}/v1/metrics", gpu_metrics(
                        [(t * 0.01, 50.0) for t in range(2000)], hw_id=f"GPU-{gpu}",
                        base_unix=now - 30))
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=BOUND_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"SIGTERM did not stop the collector within {BOUND_S} s")
            elapsed = time.monotonic() - started
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, out
    assert "stopping" in out
    assert elapsed < BOUND_S, elapsed
