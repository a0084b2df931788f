"""--forward: everything received is re-exported unchanged; a dead downstream costs nothing."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from inferprof.collector.forward import Forwarder, destination_label
from inferprof.collector.settings import CollectorSettings
from tests.collector.test_server_fixtures import breakdown, make_requests, running_app, wait_until

PB = {"content-type": "application/x-protobuf"}


def _hex_ids(doc):
    """OTLP/JSON wants hex ids where proto3 JSON gives base64."""
    import base64

    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return doc


def test_everything_received_reaches_a_grpc_downstream_byte_for_byte(otlp_sink):
    target = f"otlp-grpc://127.0.0.1:{otlp_sink.port}"
    with running_app(forward=(target,)) as app:
        # 1. OTLP/HTTP protobuf, including a span inferprof ignores and one it rejects.
        request = encode_spans(make_requests(3, service="fwd"))
        extra = request.resource_spans[0].scope_spans[0].spans.add()
        extra.CopyFrom(request.resource_spans[0].scope_spans[0].spans[0])
        extra.span_id = b"\x00" * 8  # invalid: the engine rejects it, forwarding keeps it
        extra.name = "not-a-stage"
        http_bytes = request.SerializeToString()
        resp = httpx.post(f"{app.otlp_http_endpoint}/v1/traces", content=http_bytes, headers=PB)
        assert resp.status_code == 200
        # 2. OTLP/JSON: forwarded as its protobuf encoding.
        json_request = encode_spans(make_requests(2, service="fwd-json"))
        doc = _hex_ids(json_format.MessageToDict(json_request))
        resp = httpx.post(
            f"{app.otlp_http_endpoint}/v1/traces",
            content=json.dumps(doc),
            headers={"content-type": "application/json"},
        )
        assert resp.status_code == 200, resp.text
        # 3. OTLP/gRPC through the SDK exporter.
        spans = make_requests(4, service="fwd-grpc")
        exporter = OTLPSpanExporter(endpoint=app.otlp_grpc_endpoint, insecure=True, timeout=10)
        try:
            assert exporter.export(spans) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()

        assert otlp_sink.wait_for(lambda s: len(s.trace_requests) == 3)
        received = {_service(r): r for r in otlp_sink.trace_requests}
        assert received["fwd"].SerializeToString() == http_bytes
        assert received["fwd-json"] == json_request
        assert len(received["fwd-grpc"].resource_spans[0].scope_spans[0].spans) == len(spans)
        # The engine saw the same data it forwarded.
        assert breakdown(app, "fwd").json()["requests"] == 3
        assert wait_until(lambda: _sent(app, "traces") == 3.0, timeout=5), httpx.get(
            f"{app.api_url}/metrics"
        ).text


def _service(request) -> str:
    attrs = request.resource_spans[0].resource.attributes
    return next(kv.value.string_value for kv in attrs if kv.key == "service.name")


def _sent(app, signal):
    text = httpx.get(f"{app.api_url}/metrics").text
    for line in text.splitlines():
        if line.startswith("inferprof_forward_sent_total{") and f'signal="{signal}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("compression", ["gzip", "none"])
def test_http_forwarding_to_a_second_inferprof_collector_with_its_token(compression):
    with running_app(auth_token="down-token") as downstream:
        with running_app(
            forward=(downstream.otlp_http_endpoint,),
            forward_headers=(("Authorization", "Bearer down-token"),),
            forward_compression=compression,
        ) as upstream:
            exporter = OTLPSpanExporter(
                endpoint=upstream.otlp_grpc_endpoint, insecure=True, timeout=10
            )
            try:
                spans = make_requests(6, service="chain")
                assert exporter.export(spans) is SpanExportResult.SUCCESS
            finally:
                exporter.shutdown()
        # upstream.stop() drained its queue: the downstream has every request.
        downstream.engine.flush()
        assert downstream.engine.breakdown("chain")["requests"] == 6
        # Without the header the downstream would have refused everything.
        sent = upstream.registry.get_sample_value(
            "inferprof_forward_sent_total",
            {"destination": downstream.otlp_http_endpoint, "signal": "traces"},
        )
        assert sent == 1.0
        received = upstream.registry.get_sample_value(
            "inferprof_otlp_request_body_bytes_sum", {"transport": "grpc", "signal": "traces"}
        )
        forwarded = downstream.registry.get_sample_value(
            "inferprof_otlp_request_body_bytes_sum", {"transport": "http", "signal": "traces"}
        )
        if compression == "gzip":
            assert forwarded < received / 2
        else:
            assert forwarded == received  # the same bytes


@pytest.fixture
def black_hole():
    """A TCP listener that never answers: connections succeed, replies never come."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def test_a_hung_downstream_never_slows_ingest_and_drops_are_counted(black_hole):
    with running_app(forward=(black_hole,), forward_queue_size=2, forward_timeout_s=1.0) as app:
        url = f"{app.otlp_http_endpoint}/v1/traces"
        # Distinct requests each time: the engine rejects duplicate spans.
        bodies = [
            encode_spans(make_requests(2, service="hole")).SerializeToString() for _ in range(10)
        ]
        started = time.monotonic()
        statuses = [httpx.post(url, content=body, headers=PB).status_code for body in bodies]
        elapsed = time.monotonic() - started
        assert statuses == [200] * 10
        # Forwarding inline would cost >= 1 s (the timeout) per export, 10 s in all; the
        # queue keeps ingest independent of the downstream (loose bound: shared CI machines).
        assert elapsed < 5.0
        destination = destination_label(black_hole)
        metrics = httpx.get(f"{app.api_url}/metrics").text
        line = next(
            ln
            for ln in metrics.splitlines()
            if ln.startswith("inferprof_forward_dropped_total{") and 'reason="queue_full"' in ln
        )
        assert f'destination="{destination}"' in line
        assert float(line.rsplit(" ", 1)[1]) >= 7  # 1 in flight + 2 queued at most
        assert breakdown(app, "hole").json()["requests"] == 20
        app.stop(timeout_s=0.5)  # shutdown is bounded too: what is left is dropped, counted


def test_a_dead_downstream_is_retried_then_dropped_and_counted():
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = f"otlp-grpc://127.0.0.1:{s.getsockname()[1]}"
    dropped = []
    fwd = Forwarder(
        dead,
        queue_size=10,
        timeout_s=0.5,
        on_dropped=lambda dest, reason, n: dropped.append((reason, n)),
    )
    fwd.start()
    try:
        assert fwd.submit("traces", b"")
        assert wait_until(lambda: [d for d in dropped if d[1]], timeout=10)
    finally:
        fwd.stop(timeout_s=1.0)
    # each drop reason's series is created at 0 up front, then the real drop counted
    assert [d for d in dropped if d[1]] == [("send_failed", 1)]
    assert {r for r, n in dropped if n == 0} == {"queue_full", "send_failed", "shutdown"}


def test_destination_labels_hide_credentials():
    assert destination_label("https://user:pw@tempo:4318/otlp") == "https://tempo:4318/otlp"


@pytest.mark.parametrize("url", ["tempo:4317", "grpc://x:1", "ftp://x", "http://", 5])
def test_bad_forward_urls_are_rejected(url):
    with pytest.raises(ValueError, match="forward"):
        CollectorSettings(forward=(url,))


def test_forward_queue_must_be_positive():
    with pytest.raises(ValueError):
        Forwarder("http://127.0.0.1:1", queue_size=0, timeout_s=1.0)


def test_logs_are_received_and_forwarded_though_not_folded():
    # Services often point all three signals at one endpoint: logs must pass through.
    from opentelemetry._logs import LogRecord, SeverityNumber
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor

    with running_app() as downstream:
        target = f"otlp-grpc://127.0.0.1:{downstream.otlp_grpc_port}"
        with running_app(forward=(target,)) as upstream:
            provider = LoggerProvider()
            provider.add_log_record_processor(
                SimpleLogRecordProcessor(
                    OTLPLogExporter(endpoint=upstream.otlp_grpc_endpoint, insecure=True, timeout=10)
                )
            )
            try:
                provider.get_logger("inferprof-test").emit(
                    LogRecord(body="model warmed up", severity_number=SeverityNumber.WARN)
                )
            finally:
                provider.shutdown()
            doc = {
                "resourceLogs": [
                    {
                        "scopeLogs": [
                            {
                                "logRecords": [
                                    {
                                        "timeUnixNano": "1700000000000000000",
                                        "severityNumber": 9,
                                        "body": {"stringValue": "hello"},
                                        "traceId": "5b8efff798038103d269b633813fc60c",
                                        "spanId": "eee19b7ec3c1b174",
                                    }
                                ]
                            }
                        ]
                    }
                ]
            }
            resp = httpx.post(
                f"{upstream.otlp_http_endpoint}/v1/logs",
                content=json.dumps(doc),
                headers={"content-type": "application/json"},
            )
            assert resp.status_code == 200, resp.text
            assert (
                httpx.post(
                    f"{upstream.otlp_http_endpoint}/v1/logs", content=b"\x0a\xff", headers=PB
                ).status_code
                == 400
            )

        def logs_ok(app):
            return app.registry.get_sample_value(
                "inferprof_otlp_requests_total",
                {"transport": "grpc", "signal": "logs", "outcome": "ok"},
            )

        # upstream.stop() drained the queue: both log exports reached the downstream.
        assert logs_ok(downstream) == 2.0
        assert downstream.engine.stats.spans_received == 0


def test_a_failed_forward_is_logged_in_one_line_with_the_grpc_code():
    # A gRPC error's str() is a multi-line dump of the call; the warning gives its code and
    # details (e.g. a destination that wants a token: UNAUTHENTICATED).
    import grpc

    from inferprof.collector.forward import _reason

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAUTHENTICATED

        def details(self):
            return "missing or wrong bearer token"

        def __str__(self):
            return "<_InactiveRpcError of RPC that terminated with:\n\tstatus = ...\n>"

    assert _reason(Refused()) == "UNAUTHENTICATED: missing or wrong bearer token"
    assert _reason(ConnectionError("refused\n  by peer")) == "refused by peer"


def _log_export(nbytes: int, tag: int) -> bytes:
    """An OTLP logs export of about ``nbytes`` (one record, a string body)."""
    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2

    request = logs_service_pb2.ExportLogsServiceRequest()
    record = request.resource_logs.add().scope_logs.add().log_records.add()
    record.time_unix_nano = 1_700_000_000_000_000_000 + tag
    record.body.string_value = "x" * nbytes
    return request.SerializeToString()


def test_a_hung_downstream_holds_at_most_the_queue_bytes_and_the_rest_is_counted(black_hole):
    # Logs skip the engine's pending cap: only the forwarding queue bounds what they hold.
    cap = 1_000_000
    with running_app(forward=(black_hole,), forward_queue_size=1000, forward_queue_bytes=cap,
                     forward_timeout_s=30.0) as app:
        url = f"{app.otlp_http_endpoint}/v1/logs"
        statuses = [httpx.post(url, content=_log_export(200_000, i), headers=PB).status_code
                    for i in range(20)]
        assert statuses == [200] * 20  # ingest is never refused for a full forwarding queue
        destination = destination_label(black_hole)
        queued = app.registry.get_sample_value(
            "inferprof_forward_queue_bytes", {"destination": destination})
        assert 0 < queued <= cap
        dropped = app.registry.get_sample_value(
            "inferprof_forward_dropped_total",
            {"destination": destination, "reason": "queue_full"})
        # 1 in flight (taken off the queue) + at most 4 of ~200 KB queued under 1 MB
        assert dropped >= 20 - 1 - cap // 200_000
        app.stop(timeout_s=0.5)


def test_one_export_larger_than_the_queue_bytes_is_dropped_and_counted():
    dropped = []
    f = Forwarder("http://127.0.0.1:1", queue_size=10, queue_bytes=100, timeout_s=1.0,
                  on_dropped=lambda dest, reason, n: dropped.append((reason, n)))
    assert f.submit("logs", b"x" * 60)
    assert not f.submit("logs", b"x" * 60)  # 120 bytes would exceed the 100-byte bound
    assert not f.submit("logs", b"x" * 101)
    assert f.queue_bytes() == 60
    assert [d for d in dropped if d[1]] == [("queue_full", 1), ("queue_full", 1)]
    with pytest.raises(ValueError):
        Forwarder("http://127.0.0.1:1", queue_size=10, queue_bytes=0, timeout_s=1.0)
