"""Fixtures of the GPU sampler tests: a real HTTP server standing where dcgm-exporter would."""

from __future__ import annotations

import http.server
import os
import pathlib
import subprocess
import sys
import threading

import pytest

DATA = pathlib.Path(__file__).resolve().parent / "data"
_CLI = [sys.executable, "-c", "from inferprof.cli import main; main()"]


def start_gpu_sidecar(*args: str) -> subprocess.Popen:
    """``inferprof gpu ARGS`` in a process of its own, stdout and stderr piped together as
    text, without this process's ``OTEL_*`` variables (its options alone configure it)."""
    return subprocess.Popen(
        [*_CLI, "gpu", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
#: A dcgm-exporter /metrics page (RECORDED/SYNTHETIC; see the comment at its top).
DCGM_PAGE = (DATA / "dcgm_exporter_metrics.txt").read_text()


class MetricsServer:
    """Serves ``body`` at ``/metrics`` with ``status`` (both changeable while it runs), on
    127.0.0.1 with an ephemeral port; counts the scrapes."""

    def __init__(self, body: str) -> None:
        self.body = body
        self.status = 200
        self.scrapes = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.scrapes += 1
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                payload = outer.body.encode()
                self.send_response(outer.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


@pytest.fixture
def dcgm_exporter():
    """A real HTTP server on 127.0.0.1 serving the recorded dcgm-exporter page."""
    server = MetricsServer(DCGM_PAGE).start()
    try:
        yield server
    finally:
        server.stop()
