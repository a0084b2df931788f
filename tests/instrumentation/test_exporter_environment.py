"""The OTLP/HTTP span exporter reads its environment settings (proxy, CA bundle, .netrc)
once, when it is built, and posts through them: a real HTTP server on 127.0.0.1 stands in
for a forward proxy and records the requests it gets."""

from __future__ import annotations

import http.server
import threading

import pytest

from inferprof.instrumentation import _otel_compat as compat
from inferprof.instrumentation.accounting import EncodedSpans
from inferprof.instrumentation.exporters import http_span_exporter

_PROXY_VARS = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
               "all_proxy", "NO_PROXY", "no_proxy", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


class _Recorder(http.server.ThreadingHTTPServer):
    """Answers every POST with 200 and records its request line's target."""

    def __init__(self) -> None:
        self.targets: list[str] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                recorder.targets.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def servers(monkeypatch):
    for name in _PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent/netrc")  # none of the caller's
    proxy, collector = _Recorder(), _Recorder()
    yield proxy, collector
    for server in (proxy, collector):
        server.shutdown()
        server.server_close()


def _post(exporter) -> None:
    spans = EncodedSpans.__new__(EncodedSpans)
    spans.payload = b"\n\x00"  # an empty ResourceSpans
    assert exporter.export(spans).name == "SUCCESS"


def test_a_proxy_set_at_start_up_is_used_for_every_post_and_read_once(servers, monkeypatch):
    proxy, collector = servers
    endpoint = f"{collector.url}/v1/traces"
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    exporter = http_span_exporter(endpoint=endpoint)
    session = compat.http_session(exporter)
    assert session is not None and not session.trust_env  # settled: nothing read per post
    _post(exporter)
    monkeypatch.delenv("HTTP_PROXY")  # later changes are not read
    _post(exporter)
    # through the proxy (a request line with the absolute URL), never straight to it
    assert proxy.targets == [endpoint, endpoint] and collector.targets == []
    exporter.shutdown()


def test_no_proxy_for_the_endpoint_posts_straight_to_it(servers, monkeypatch):
    proxy, collector = servers
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    exporter = http_span_exporter(endpoint=f"{collector.url}/v1/traces")
    _post(exporter)
    assert collector.targets == ["/v1/traces"] and proxy.targets == []
    exporter.shutdown()


def test_a_ca_bundle_in_the_environment_wins_over_the_session_default(servers, monkeypatch,
                                                                      tmp_path):
    _, collector = servers
    bundle = tmp_path / "ca.pem"
    bundle.write_text("")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    exporter = http_span_exporter(endpoint=f"{collector.url}/v1/traces")
    # as requests reads it at each request with trust_env: the bundle replaces True
    assert compat.http_session(exporter).verify == str(bundle)
    _post(exporter)  # (plain HTTP: the bundle is not used)
    assert collector.targets == ["/v1/traces"]
    exporter.shutdown()


def test_a_session_from_a_credential_provider_is_left_as_it_is(servers, monkeypatch):
    # Such a session may be shared (other endpoints, the application): not inferprof's to
    # change, so requests keeps reading the environment at each post.
    import requests
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from inferprof.instrumentation.exporters import settle_exporter_environment

    _, collector = servers
    shared = requests.Session()
    exporter = OTLPSpanExporter(endpoint=f"{collector.url}/v1/traces", session=shared)
    monkeypatch.setenv("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER", "mine")
    settle_exporter_environment(exporter)
    assert compat.http_session(exporter) is shared and shared.trust_env
    monkeypatch.delenv("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER")
    settle_exporter_environment(exporter)  # (without one: the SDK's session, settled)
    assert not shared.trust_env
    exporter.shutdown()
