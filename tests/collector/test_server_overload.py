"""Back-pressure: past the pending-span cap the collector answers 429 / RESOURCE_EXHAUSTED,
accepts nothing of the refused export, and loses nothing it accepted."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export import SpanExportResult

from inferprof.collector.app import CollectorApp
from inferprof.collector.engine import Engine
from inferprof.collector.settings import CollectorSettings
from tests.collector.test_server_fixtures import (
    FAST,
    breakdown,
    make_requests,
    running_app,
    wait_until,
)

PB = {"content-type": "application/x-protobuf"}
REQUESTS_PER_EXPORT = 5
SPANS_PER_EXPORT = REQUESTS_PER_EXPORT * 4  # request span + 3 stages

# Traces never settle on their own during the test: only flush() frees the cap.
HELD = dict(max_pending_spans=50, settle_s=600.0, trace_timeout_s=600.0, advance_interval_s=60.0)


def test_http_and_grpc_refuse_past_the_cap_and_every_accepted_span_is_accounted_for():
    with running_app(**HELD) as app:
        url = f"{app.otlp_http_endpoint}/v1/traces"
        accepted_exports = 0
        statuses = []
        channel = grpc.insecure_channel(f"127.0.0.1:{app.otlp_grpc_port}")
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        try:
            for _round in range(3):
                for i in range(4):
                    body = encode_spans(make_requests(REQUESTS_PER_EXPORT, service="load"))
                    if i % 2 == 0:
                        resp = httpx.post(url, content=body.SerializeToString(), headers=PB)
                        statuses.append(resp.status_code)
                        if resp.status_code == 200:
                            accepted_exports += 1
                            answer = trace_service_pb2.ExportTraceServiceResponse.FromString(
                                resp.content
                            )
                            assert answer.partial_success.rejected_spans == 0
                        else:
                            assert resp.status_code == 429
                            assert int(resp.headers["retry-after"]) >= 1
                    else:
                        try:
                            stub.Export(body, timeout=5)
                            accepted_exports += 1
                            statuses.append(200)
                        except grpc.RpcError as exc:
                            assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                            statuses.append(429)
                            trailers = dict(exc.trailing_metadata())
                            info = error_details_pb2.RetryInfo.FromString(
                                trailers["google.rpc.retryinfo-bin"]
                            )
                            assert info.retry_delay.ToNanoseconds() > 0
                    # Memory stays under the cap whatever the clients do.
                    assert app.engine.pending_spans() <= HELD["max_pending_spans"]
                app.engine.flush()  # the cap frees up once held traces are folded
        finally:
            channel.close()
        # 50 spans fit two 20-span exports; the third and fourth of each round are refused.
        assert statuses == [200, 200, 429, 429] * 3
        stats = app.engine.stats
        assert stats.spans_received == accepted_exports * SPANS_PER_EXPORT
        assert breakdown(app, "load").json()["requests"] == accepted_exports * REQUESTS_PER_EXPORT
        metrics = httpx.get(f"{app.api_url}/metrics").text
        assert 'outcome="overloaded",signal="traces",transport="http"} 3.0' in metrics
        assert 'outcome="overloaded",signal="traces",transport="grpc"} 3.0' in metrics


def test_sdk_grpc_exporter_retries_after_resource_exhausted_and_delivers():
    with running_app(**{**HELD, "retry_after_s": 0.2}) as app:
        first = encode_spans(make_requests(10, service="retry"))  # 40 of 50
        with grpc.insecure_channel(f"127.0.0.1:{app.otlp_grpc_port}") as channel:
            trace_service_pb2_grpc.TraceServiceStub(channel).Export(first, timeout=5)
        exporter = OTLPSpanExporter(endpoint=app.otlp_grpc_endpoint, insecure=True, timeout=15)
        result = []
        worker = threading.Thread(
            target=lambda: result.append(exporter.export(make_requests(5, service="retry")))
        )
        worker.start()
        try:

            def text() -> str:
                return httpx.get(f"{app.api_url}/metrics").text

            assert wait_until(
                lambda: 'outcome="overloaded",signal="traces",transport="grpc"' in text()
            )
            app.engine.flush()  # room again: the exporter's retry (after 0.2 s) gets in
            worker.join(15)
        finally:
            exporter.shutdown()
        assert result == [SpanExportResult.SUCCESS]
        assert breakdown(app, "retry").json()["requests"] == 15


class _HeldEngine(Engine):
    """An engine whose first traces ingest waits until released: an export being
    processed for as long as the test needs."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.entered = threading.Event()
        self.release = threading.Event()

    def ingest_traces(self, request, peer=None, payload=None):
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(30)
        return super().ingest_traces(request, peer, payload)


def test_http_concurrency_bound_answers_429_while_the_intake_is_full():
    settings = CollectorSettings(**{**FAST, "max_concurrent_requests": 1})
    engine = _HeldEngine(**settings.engine_kwargs())
    with CollectorApp(settings, engine) as app:
        url = f"{app.otlp_http_endpoint}/v1/traces"
        body = encode_spans(make_requests(1)).SerializeToString()
        first = []
        worker = threading.Thread(
            target=lambda: first.append(httpx.post(url, content=body, headers=PB, timeout=30)))
        worker.start()
        try:
            assert engine.entered.wait(10)  # the first export holds the only slot
            resp = httpx.post(url, content=encode_spans(make_requests(1)).SerializeToString(),
                              headers=PB)
            assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
        finally:
            engine.release.set()
            worker.join(30)
        assert first[0].status_code == 200
        assert wait_until(lambda: _in_flight(app) == 0)
        again = encode_spans(make_requests(1)).SerializeToString()
        assert httpx.post(url, content=again, headers=PB).status_code == 200


def test_a_stalled_body_holds_no_processing_slot():
    with running_app(max_concurrent_requests=1) as app:
        host, port = "127.0.0.1", app.otlp_http_port
        # A client that sends half its body and stalls: it is still being read.
        with socket.create_connection((host, port)) as stalled:
            stalled.sendall(
                b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/x-protobuf\r\nContent-Length: 2\r\n\r\n\x0a"
            )
            assert wait_until(lambda: _in_flight(app) == 1)
            body = encode_spans(make_requests(1)).SerializeToString()
            url = f"{app.otlp_http_endpoint}/v1/traces"
            assert httpx.post(url, content=body, headers=PB).status_code == 200
            stalled.sendall(b"\x00")  # the rest of an (empty) export: it completes normally
            assert stalled.recv(4096).startswith(b"HTTP/1.1 200")
        assert wait_until(lambda: _in_flight(app) == 0)


def _in_flight(app) -> float:
    return (
        app.registry.get_sample_value("inferprof_otlp_requests_in_flight", {"transport": "http"})
        or 0.0
    )


@pytest.mark.parametrize("bad", [0, -1, "5"])
def test_caps_must_be_positive(bad):
    with pytest.raises(ValueError):
        CollectorSettings(max_concurrent_requests=bad)


def test_concurrent_clients_that_retry_get_every_request_in_exactly_once():
    # Small cap, traces fold quickly: clients hit 429/RESOURCE_EXHAUSTED now and then and
    # retry, as the OTLP exporters do. In the end every request is in, none twice.
    threads, exports_each = 6, 8
    with running_app(max_pending_spans=60, settle_s=0.05, advance_interval_s=0.02) as app:
        url = f"{app.otlp_http_endpoint}/v1/traces"
        refusals = []
        errors = []

        def client(k: int) -> None:
            channel = grpc.insecure_channel(f"127.0.0.1:{app.otlp_grpc_port}")
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            try:
                for _ in range(exports_each):
                    body = encode_spans(make_requests(REQUESTS_PER_EXPORT, service="many"))
                    for _attempt in range(200):
                        if k % 2:
                            resp = httpx.post(url, content=body.SerializeToString(), headers=PB)
                            if resp.status_code == 200:
                                break
                            assert resp.status_code == 429, resp.status_code
                        else:
                            try:
                                stub.Export(body, timeout=5)
                                break
                            except grpc.RpcError as exc:
                                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                        refusals.append(k)
                        time.sleep(0.02)
                    else:
                        raise AssertionError("export never accepted")
            except BaseException as exc:  # surfaced to the test thread below
                errors.append(exc)
            finally:
                channel.close()

        workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert not errors, errors
        total = threads * exports_each * REQUESTS_PER_EXPORT
        assert app.engine.stats.spans_received == total * 4
        assert breakdown(app, "many").json()["requests"] == total
