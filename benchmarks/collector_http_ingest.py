"""End-to-end ingest throughput of ``inferprof collect``'s OTLP receivers, in one process.

Starts a CollectorApp on ephemeral ports, sends pre-built OTLP exports (each request
= one SERVER span + 3 stage spans) over OTLP/HTTP (protobuf, protobuf+gzip) and
OTLP/gRPC from a client in the same process, and reports spans/s received and
folded (median of runs; the clock stops after ``engine.flush()``, so folding every
request is included).
The process is pinned to one core, so the client's cost is included: the figure is
a lower bound on what the receiver does alone.

    python benchmarks/collector_http_ingest.py [--runs 5] [--exports 100] [--requests 100]
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import os
import statistics
import time
import urllib.parse

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from inferprof import semconv as sc
from inferprof.collector.app import CollectorApp
from inferprof.collector.settings import CollectorSettings

STAGES = (
    (sc.STAGE_TOKENIZE, 2_000_000),
    (sc.STAGE_QUEUE, 10_000_000),
    (sc.STAGE_COMPUTE, 20_000_000),
)


def _kv(key: str, value: str) -> common_pb2.KeyValue:
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))


def build_export(n_requests: int, seed: int) -> trace_service_pb2.ExportTraceServiceRequest:
    request = trace_service_pb2.ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.append(_kv(sc.RESOURCE_SERVICE_NAME, "bench"))
    spans = rs.scope_spans.add().spans
    t0 = time.time_ns() - 10_000_000_000
    for i in range(n_requests):
        trace_id = (seed * 1_000_003 + i + 1).to_bytes(16, "big")
        root_id = (2 * i + 1).to_bytes(8, "big")
        start = t0 + i * 1000
        cursor = start + 100_000
        for j, (stage, dur) in enumerate(STAGES):
            spans.add(
                trace_id=trace_id,
                span_id=(1_000_000 + 4 * i + j).to_bytes(8, "big"),
                parent_span_id=root_id,
                name=sc.span_name(stage),
                kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
                start_time_unix_nano=cursor,
                end_time_unix_nano=cursor + dur,
                attributes=[_kv(sc.ATTR_STAGE, stage)],
            )
            cursor += dur
        spans.add(
            trace_id=trace_id,
            span_id=root_id,
            name="POST /predict",
            kind=trace_pb2.Span.SPAN_KIND_SERVER,
            start_time_unix_nano=start,
            end_time_unix_nano=cursor + 100_000,
            attributes=[_kv(sc.ATTR_MODEL_NAME, "m")],
        )
    return request


class NullEngine:
    """Accepts and counts, folds nothing: isolates the transport's own cost."""

    def __init__(self) -> None:
        self.received = 0

    def ingest_traces(self, request):
        from inferprof.collector.records import IngestResult

        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        self.received += n
        return IngestResult(n, 0, ())

    def advance(self, now=None) -> None:
        pass

    def flush(self, timeout_s=None) -> None:
        pass

    @property
    def stats(self):
        return type("Stats", (), {"spans_received": self.received})()


ENGINE = {"factory": None}


def _app(settings: CollectorSettings) -> CollectorApp:
    # Nothing scrapes /metrics here, so the null engine never meets the Prometheus collector.
    factory = ENGINE["factory"]
    return CollectorApp(settings, engine=factory() if factory else None)


def run_http(bodies: list[bytes], gzipped: bool) -> float:
    settings = CollectorSettings(grpc_port=0, http_port=0, api_port=0, settle_s=0.5)
    with _app(settings) as app:
        url = urllib.parse.urlsplit(app.otlp_http_endpoint)
        conn = http.client.HTTPConnection(url.hostname, url.port)
        headers = {"Content-Type": "application/x-protobuf"}
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        started = time.perf_counter()
        for body in bodies:
            conn.request("POST", "/v1/traces", body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, resp.status
        app.engine.flush()  # count folding too, not just acceptance
        elapsed = time.perf_counter() - started
        conn.close()
        spans = app.engine.stats.spans_received
    return spans / elapsed


def run_grpc(bodies: list[bytes]) -> float:
    settings = CollectorSettings(grpc_port=0, http_port=0, api_port=0, settle_s=0.5)
    with _app(settings) as app:
        channel = grpc.insecure_channel(f"127.0.0.1:{app.otlp_grpc_port}")
        export = channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=None,
            response_deserializer=None,
        )
        started = time.perf_counter()
        for body in bodies:
            export(body, timeout=30)
        app.engine.flush()
        elapsed = time.perf_counter() - started
        channel.close()
        spans = app.engine.stats.spans_received
    return spans / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--exports", type=int, default=100, help="exports per run")
    parser.add_argument("--requests", type=int, default=100, help="requests per export")
    parser.add_argument("--cores", type=int, default=1, help="pin to this many cores")
    parser.add_argument(
        "--null-engine",
        action="store_true",
        help="accept and count without folding: the transport's cost alone",
    )
    args = parser.parse_args()
    if args.null_engine:
        ENGINE["factory"] = NullEngine
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: args.cores]))
    exports = [build_export(args.requests, seed) for seed in range(args.exports)]
    raw = [e.SerializeToString() for e in exports]
    packed = [gzip.compress(b, 6) for b in raw]
    spans = args.exports * args.requests * (len(STAGES) + 1)
    print(
        f"{args.runs} runs x {args.exports} exports x {args.requests} requests "
        f"= {spans} spans/run, {sum(map(len, raw)) / len(raw) / 1024:.0f} KiB/export "
        f"({sum(map(len, packed)) / len(packed) / 1024:.0f} KiB gzipped), "
        f"cores={len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'}, "
        f"engine={'null' if args.null_engine else 'real'}"
    )
    for name, fn in (
        ("OTLP/HTTP protobuf", lambda: run_http(raw, False)),
        ("OTLP/HTTP protobuf+gzip", lambda: run_http(packed, True)),
        ("OTLP/gRPC", lambda: run_grpc(raw)),
    ):
        rates = [fn() for _ in range(args.runs)]
        print(
            f"{name:26s} median {statistics.median(rates):>9,.0f} spans/s "
            f"(min {min(rates):,.0f}, max {max(rates):,.0f})"
        )


if __name__ == "__main__":
    main()
