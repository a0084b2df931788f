"""OTLP/HTTP receiver and API, end to end: the SDK's real exporters -> CollectorApp -> HTTP API."""

from __future__ import annotations

import gzip
import json
import time
import zlib

import httpx
import pytest
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace.export import SpanExportResult

from inferprof import semconv as sc
from tests.collector.test_server_fixtures import (
    breakdown,
    make_requests,
    running_app,
    stage_counts,
    wait_until,
)

PB = {"content-type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def app():
    with running_app(max_body_bytes=256 * 1024) as running:
        yield running


def _export_http(app, spans, **kwargs) -> SpanExportResult:
    exporter = OTLPSpanExporter(
        endpoint=f"{app.otlp_http_endpoint}/v1/traces", timeout=10, **kwargs
    )
    try:
        return exporter.export(spans)
    finally:
        exporter.shutdown()


@pytest.mark.parametrize("compression", [None, Compression.Gzip, Compression.Deflate])
def test_sdk_http_exporter_spans_become_a_breakdown(compression):
    # A fresh app per case: counts are exact only when nothing else was sent to it.
    with running_app() as app:
        spans = make_requests(40)
        assert _export_http(app, spans, compression=compression) is SpanExportResult.SUCCESS
        resp = breakdown(app)
        assert resp.status_code == 200, resp.text
        doc = resp.json()
        assert doc["service"] == "svc" and doc["model"] == "m"
        assert doc["requests"] == 40
        counts = stage_counts(doc)
        assert counts[sc.STAGE_QUEUE] == counts[sc.STAGE_COMPUTE] == counts[sc.STAGE_TOKENIZE] == 40
        assert sum(s["share_of_p95"] for s in doc["stages"]) == pytest.approx(1.0, abs=1e-6)
        # 4 of 40 requests (10%) are slow: their queue takes 100 of 123 ms, so the tail
        # (latency >= p95) is those 4 and queuing holds ~81% of it.
        shares = {s["stage"]: s["share_of_p95"] for s in doc["stages"]}
        assert shares[sc.STAGE_QUEUE] == pytest.approx(100 / 123, rel=0.02)
        queue = next(s for s in doc["stages"] if s["stage"] == sc.STAGE_QUEUE)
        assert queue["p95"] == pytest.approx(0.100, rel=0.01)
        assert queue["p50"] == pytest.approx(0.010, rel=0.01)


def test_otel_collector_shaped_json_payload_is_accepted_and_answered_in_json():
    # What an OpenTelemetry Collector's otlphttp exporter with encoding: json sends:
    # hex ids, int64 as strings, lowerCamelCase keys, enum as integers.
    trace_id = "5b8efff798038103d269b633813fc60c"
    root_id, child_id = "eee19b7ec3c1b174", "eee19b7ec3c1b173"
    start = 1_700_000_000_000_000_000

    def attr(key, value):
        return {"key": key, "value": {"stringValue": value}}

    payload = {
        "resourceSpans": [
            {
                "resource": {"attributes": [attr("service.name", "json-svc")]},
                "scopeSpans": [
                    {
                        "scope": {"name": "otelcol"},
                        "spans": [
                            {
                                "traceId": trace_id,
                                "spanId": root_id,
                                "name": "POST /v1/generate",
                                "kind": 2,
                                "startTimeUnixNano": str(start),
                                "endTimeUnixNano": str(start + 50_000_000),
                                "attributes": [attr(sc.ATTR_MODEL_NAME, "gpt")],
                                "status": {},
                            },
                            {
                                "traceId": trace_id,
                                "spanId": child_id,
                                "parentSpanId": root_id,
                                "name": "inferprof.queue",
                                "kind": 1,
                                "startTimeUnixNano": str(start + 1_000_000),
                                "endTimeUnixNano": str(start + 31_000_000),
                                "attributes": [attr(sc.ATTR_STAGE, sc.STAGE_QUEUE)],
                            },
                        ],
                    }
                ],
            }
        ]
    }
    with running_app() as app:
        resp = httpx.post(
            f"{app.otlp_http_endpoint}/v1/traces",
            content=json.dumps(payload),
            headers={"content-type": "application/json"},
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("application/json")
        assert "partialSuccess" not in resp.json()
        doc = breakdown(app, "json-svc").json()
        assert doc["requests"] == 1 and doc["model"] == "gpt"
        queue = next(s for s in doc["stages"] if s["stage"] == sc.STAGE_QUEUE)
        assert queue["p50"] == pytest.approx(0.030, rel=0.01)


def test_partial_success_reports_rejected_spans_in_protobuf_and_json(app):
    spans = make_requests(2, service="partial")
    request = encode_spans(spans)
    bad = request.resource_spans[0].scope_spans[0].spans[0]
    bad.trace_id = b"\x00" * 16  # an all-zero trace id is invalid per OTLP
    resp = httpx.post(
        f"{app.otlp_http_endpoint}/v1/traces", content=request.SerializeToString(), headers=PB
    )
    assert resp.status_code == 200
    answer = trace_service_pb2.ExportTraceServiceResponse.FromString(resp.content)
    assert answer.partial_success.rejected_spans >= 1
    assert answer.partial_success.error_message


@pytest.mark.parametrize(
    "body, headers, status",
    [
        (b"\x0a\xff\xff\xff\xff\x0f", PB, 400),  # a length prefix running past the end
        (b"{not json", {"content-type": "application/json"}, 400),
        (b'{"resourceSpans": "nope"}', {"content-type": "application/json"}, 400),
        (b"\xff\xfe", {"content-type": "application/json"}, 400),  # not UTF-8
        (b"", {"content-type": "text/plain"}, 415),
        (b"", {}, 415),
        (b"x", {**PB, "content-encoding": "br"}, 415),
        (b"not gzip at all", {**PB, "content-encoding": "gzip"}, 400),
        (gzip.compress(b"\x0a\x02")[:-6], {**PB, "content-encoding": "gzip"}, 400),  # truncated
    ],
)
def test_bad_bodies_get_a_clear_status_and_reason(app, body, headers, status):
    resp = httpx.post(f"{app.otlp_http_endpoint}/v1/traces", content=body, headers=headers)
    assert resp.status_code == status, resp.text
    code = 3  # google.rpc.Code INVALID_ARGUMENT, for 400 and 415 alike
    if headers.get("content-type") == PB["content-type"]:
        answer = status_pb2.Status.FromString(resp.content)
        assert answer.message and answer.code == code
    else:
        assert resp.json()["message"] and resp.json()["code"] == code


@pytest.mark.parametrize(
    "body, headers, reason",
    [
        (b"[1, 2]", {"content-type": "application/json"},
         "malformed OTLP json traces request: OTLP/JSON: the document must be a JSON object"),
        (b'{"resourceSpans": 5}', {"content-type": "application/json"},
         "malformed OTLP json traces request: resourceSpans: expected a list"),
        (b"x", {**PB, "content-encoding": "br"},
         "unsupported content encoding 'br': use gzip, deflate or identity"),
    ],
)
def test_bad_body_reasons_name_the_problem_in_the_documents_terms(app, body, headers, reason):
    resp = httpx.post(f"{app.otlp_http_endpoint}/v1/traces", content=body, headers=headers)
    message = (
        status_pb2.Status.FromString(resp.content).message
        if headers.get("content-type") == PB["content-type"]
        else resp.json()["message"]
    )
    assert message == reason


def test_oversized_bodies_and_gzip_bombs_get_413(app):
    limit = app.settings.max_body_bytes
    url = f"{app.otlp_http_endpoint}/v1/traces"
    big = b"\x00" * (limit + 1)
    # Declared length over the limit.
    assert httpx.post(url, content=big, headers=PB).status_code == 413

    # Chunked (no Content-Length): the limit applies while reading.
    def chunks():
        for _ in range(8):
            yield b"\x00" * (limit // 4)

    assert httpx.post(url, content=chunks(), headers=PB).status_code == 413
    # 64 MiB of zeros gzip to ~64 KiB: under the wire limit, far over it decompressed.
    bomb = gzip.compress(b"\x00" * (64 * 1024 * 1024), compresslevel=9)
    assert len(bomb) < limit
    resp = httpx.post(url, content=bomb, headers={**PB, "content-encoding": "gzip"})
    assert resp.status_code == 413
    assert "decompressed" in status_pb2.Status.FromString(resp.content).message
    deflate_bomb = zlib.compress(b"\x00" * (8 * 1024 * 1024), 9)
    resp = httpx.post(url, content=deflate_bomb, headers={**PB, "content-encoding": "deflate"})
    assert resp.status_code == 413


def test_valid_exports_still_work_after_bad_input_and_outcomes_are_counted():
    with running_app() as app:
        url = f"{app.otlp_http_endpoint}/v1/traces"
        assert httpx.post(url, content=b"\x0a\xff\xff\xff\xff\x0f", headers=PB).status_code == 400
        assert httpx.post(url, content=b"", headers={"content-type": "text/csv"}).status_code == 415
        assert _export_http(app, make_requests(5)) is SpanExportResult.SUCCESS
        assert breakdown(app).json()["requests"] == 5
        text = httpx.get(f"{app.api_url}/metrics").text
        assert (
            'inferprof_otlp_requests_total{outcome="ok",signal="traces",transport="http"} 1.0'
            in text
        )
        bad = 'outcome="bad_request",signal="traces",transport="http"'
        assert f"inferprof_otlp_requests_total{{{bad}}} 1.0" in text
        assert (
            'inferprof_otlp_requests_total{outcome="unsupported_media_type",signal="traces",'
            'transport="http"} 1.0' in text
        )
        assert 'inferprof_otlp_decode_errors_total{reason="protobuf",transport="http"} 1.0' in text


def test_metrics_endpoint_serves_engine_series_for_received_spans():
    with running_app() as app:
        assert _export_http(app, make_requests(20)) is SpanExportResult.SUCCESS
        app.engine.flush()
        text = httpx.get(f"{app.api_url}/metrics").text
        assert _has_series(
            text, sc.PROM_STAGE_QUANTILE, service="svc", stage="queue", quantile="0.95"
        )
        assert _has_series(text, sc.PROM_STAGE_SHARE_OF_P95, service="svc", stage="queue")
        assert _has_series(text, sc.PROM_SPANS_RECEIVED)


def _has_series(text: str, name: str, **labels: str) -> bool:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return True
    return False


@pytest.mark.parametrize("window", ["abc", "-5", "0", "nan", "inf"])
def test_breakdown_rejects_bad_windows_with_400(app, window):
    resp = httpx.get(f"{app.api_url}/api/v1/breakdown", params={"service": "svc", "window": window})
    assert resp.status_code == 400
    assert "window" in resp.json()["error"]


def test_breakdown_needs_a_service_and_404s_an_unknown_one(app):
    assert httpx.get(f"{app.api_url}/api/v1/breakdown").status_code == 400
    resp = httpx.get(f"{app.api_url}/api/v1/breakdown", params={"service": "never-seen"})
    assert resp.status_code == 404
    assert "never-seen" in resp.json()["error"]


def test_an_empty_model_parameter_selects_the_requests_without_a_model():
    with running_app() as app:
        with_model = encode_spans(make_requests(3, service="mixed", model="m1"))
        without = encode_spans(make_requests(2, service="mixed", model="m1"))
        for rs in without.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    keep = [kv for kv in span.attributes if kv.key != sc.ATTR_MODEL_NAME]
                    del span.attributes[:]
                    span.attributes.extend(keep)
        app.engine.ingest_traces(with_model)
        app.engine.ingest_traces(without)
        none = breakdown(app, "mixed", model="")
        assert none.status_code == 200 and none.json()["requests"] == 2
        assert none.json()["model"] == ""
        assert breakdown(app, "mixed", model="m1").json()["requests"] == 3
        assert breakdown(app, "mixed").json()["requests"] == 5
        gone = breakdown(app, "a-service", model="")
        assert gone.status_code == 404 and "with model ''" in gone.json()["error"]


def test_services_lists_what_was_received_and_window_param_is_honoured():
    with running_app() as app:
        assert (
            _export_http(app, make_requests(3, service="a", model="m1")) is SpanExportResult.SUCCESS
        )
        assert (
            _export_http(app, make_requests(2, service="b", model="m2")) is SpanExportResult.SUCCESS
        )
        app.engine.flush()
        services = httpx.get(f"{app.api_url}/api/v1/services").json()["services"]
        assert {s["service"]: s["requests"] for s in services} == {"a": 3, "b": 2}
        doc = breakdown(app, "a", window="60").json()
        assert doc["window_s"] == 60 and doc["requests"] == 3
        assert breakdown(app, "a", model="m1").json()["requests"] == 3
        assert breakdown(app, "a", model="other").status_code == 404


def test_healthz_and_wrong_method():
    with running_app() as app:
        assert httpx.get(f"{app.api_url}/healthz").json() == {"status": "ok"}
        assert httpx.get(f"{app.otlp_http_endpoint}/healthz").status_code == 200
        assert httpx.get(f"{app.otlp_http_endpoint}/v1/traces").status_code == 405


def test_a_metrics_window_past_what_is_kept_is_warned_about_at_start(caplog):
    caplog.set_level("WARNING", logger="inferprof.collector.app")
    with running_app(windows_s=(10.0,), slice_s=1.0, metrics_window_s=300.0):
        pass
    assert any("--metrics-window-s 300 is longer than the longest of --windows-s (10 s"
               in r.getMessage() for r in caplog.records)


def _trickler(port: int, stop, length: int = 10_000):
    """A connection announcing a ``length``-byte body and sending one byte of it every
    0.2 s until ``stop`` is set (or the server closes it); returns the answer's status
    line, or None when none came."""
    import socket

    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(0.2)
    head = (f"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/x-protobuf\r\nContent-Length: {length}\r\n\r\n")
    answer = b""
    try:
        sock.sendall(head.encode())
        while not stop.is_set() and not answer:
            try:
                sock.sendall(b"\x0a")
            except OSError:
                break
            try:
                answer = sock.recv(200)
            except TimeoutError:
                continue
            except OSError:
                break
    finally:
        sock.close()
    return answer.split(b"\r\n", 1)[0].decode() if answer else None


def test_slow_uploads_cannot_starve_ingest_and_are_cut_at_the_body_deadline():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    with running_app(max_concurrent_requests=4, body_timeout_s=3.0) as app:
        stop = threading.Event()
        with ThreadPoolExecutor(16) as pool:
            try:
                trickling = [pool.submit(_trickler, app.otlp_http_port, stop)
                             for _ in range(16)]
                # The tricklers are in their bodies, more of them than processing slots.
                assert wait_until(lambda: (app.registry.get_sample_value(
                    "inferprof_otlp_requests_in_flight", {"transport": "http"}) or 0) >= 4)
                time.sleep(0.5)
                body = encode_spans(make_requests(3)).SerializeToString()
                resp = httpx.post(f"{app.otlp_http_endpoint}/v1/traces", content=body,
                                  headers=PB, timeout=30)
                assert resp.status_code == 200, resp.text
                answers = [f.result(timeout=60) for f in trickling]
            finally:
                stop.set()
        # Each trickler is cut off at the deadline with 408, counted.
        assert answers == ["HTTP/1.1 408 Request Timeout"] * 16
        assert app.registry.get_sample_value(
            "inferprof_otlp_requests_total",
            {"transport": "http", "signal": "traces", "outcome": "body_timeout"}) == 16
        assert breakdown(app).json()["requests"] == 3


def test_bodies_being_read_hold_at_most_what_the_processing_slots_may():
    import socket

    # One slot of 4000 bytes: a body held half-sent with 3500 bytes leaves room for 500.
    with running_app(max_concurrent_requests=1, max_body_bytes=4000, body_timeout_s=30.0) as app:
        sock = socket.create_connection(("127.0.0.1", app.otlp_http_port))
        try:
            sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/x-protobuf\r\nContent-Length: 4000\r\n\r\n" + b"\x0a" * 3500)
            assert wait_until(lambda: (app.registry.get_sample_value(
                "inferprof_otlp_requests_in_flight", {"transport": "http"}) or 0) >= 1)
            time.sleep(0.3)  # the 3500 bytes are read
            body = encode_spans(make_requests(2)).SerializeToString()
            assert 500 < len(body) < 4000
            resp = httpx.post(f"{app.otlp_http_endpoint}/v1/traces", content=body, headers=PB)
            assert resp.status_code == 429
            assert "being received" in resp.text
        finally:
            sock.close()
        # The held bytes are released with their connection.
        assert wait_until(lambda: httpx.post(
            f"{app.otlp_http_endpoint}/v1/traces", content=body, headers=PB).status_code == 200)
