"""Collector engine ingest rate vs the protobuf-decode and minimal-Python-pass ceilings.

    python3 benchmarks/collector_ingest.py [--exports 10] [--requests-per-export 1250]

Builds synthetic OTLP exports (8 spans per request: the request span and seven stage
spans with batch/model/token attributes, about 10k spans per export), serializes them,
then measures on one core, all in the same run:

* ``decode``       — ``ExportTraceServiceRequest.FromString`` alone;
* ``minimal pass`` — decode + a Python loop reading each span's ids, times and
  ``inferprof.stage`` (the ceiling of any Python-level processing);
* ``engine``       — decode + ``Engine.ingest_traces`` + finalisation (``flush``): what
  the collector does per export, sketches included.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from inferprof import semconv as sc
from inferprof.collector.engine import Engine
from tests.collector.synth import TraceBuilder

STAGES = [
    ("receive", 0.0005),
    ("tokenize", 0.001),
    ("queue", 0.01),
    ("batch_assembly", 0.0005),
    ("compute", 0.02),
    ("d2h", 0.0002),
    ("serialize", 0.0003),
]


def build(n_exports: int, per_export: int) -> list[bytes]:
    out = []
    for e in range(n_exports):
        b = TraceBuilder("bench", host="h1")
        for i in range(per_export):
            t = (e * per_export + i) * 0.001
            req = b.request(t, t + 0.05, model="m")
            cursor = t
            for stage, d in STAGES:
                extra = {}
                if stage in ("batch_assembly", "compute"):
                    extra = {
                        "batch_id": f"b{e}-{i // 8}",
                        "batch_size": 8,
                        "effective": 100,
                        "padded": 128,
                    }
                b.stage(req, stage, cursor, cursor + d, **extra)
                cursor += d
        out.append(b.export().SerializeToString())
    return out


def bench_decode(blobs):
    n = 0
    t0 = time.perf_counter()
    for blob in blobs:
        req = ExportTraceServiceRequest.FromString(blob)
        n += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    return n, time.perf_counter() - t0


def bench_minimal(blobs):
    n = 0
    key = sc.ATTR_STAGE
    t0 = time.perf_counter()
    for blob in blobs:
        req = ExportTraceServiceRequest.FromString(blob)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    _ = (
                        span.trace_id,
                        span.span_id,
                        span.parent_span_id,
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                    )
                    for kv in span.attributes:
                        if kv.key == key:
                            _ = kv.value.string_value
                    n += 1
    return n, time.perf_counter() - t0


def bench_engine(blobs):
    engine = Engine(settle_s=0.0, max_pending_spans=10_000_000)
    t0 = time.perf_counter()
    for blob in blobs:
        req = ExportTraceServiceRequest.FromString(blob)
        engine.ingest_traces(req)
    engine.flush()
    elapsed = time.perf_counter() - t0
    stats = engine.stats
    assert stats.requests_finalised == len(blobs) * (stats.spans_accepted // len(blobs) // 8), stats
    return stats.spans_accepted, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exports", type=int, default=10)
    parser.add_argument("--requests-per-export", type=int, default=1250)
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs")
    args = parser.parse_args()
    blobs = build(args.exports, args.requests_per_export)
    rows = []
    for name, fn in (
        ("decode", bench_decode),
        ("minimal pass", bench_minimal),
        ("engine", bench_engine),
    ):
        best = None
        for _ in range(args.repeat):
            n, dt = fn(blobs)
            rate = n / dt
            best = rate if best is None else max(best, rate)
        rows.append((name, n, best))
    decode_rate = rows[0][2]
    minimal_rate = rows[1][2]
    print(f"{'path':<14}{'spans':>10}{'spans/s':>14}{'vs decode':>11}{'vs minimal':>12}")
    for name, n, rate in rows:
        print(
            f"{name:<14}{n:>10}{rate:>14,.0f}{rate / decode_rate:>11.2f}{rate / minimal_rate:>12.2f}"
        )


if __name__ == "__main__":
    main()
