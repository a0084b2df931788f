"""Collector engine ingest rate vs the protobuf-decode and minimal-Python-pass ceilings.

    python3 benchmarks/collector_ingest.py [--exports 10] [--requests-per-export 1250]
                                           [--rounds 7] [--cpu 0] [--no-memory]

Builds synthetic OTLP exports (8 spans per request: the request span and seven stage
spans, two of them with batch/token attributes; about 10k spans per export), serializes
them, pins the process to one core and measures, all in the same run:

* ``decode``       — ``ExportTraceServiceRequest.FromString`` alone;
* ``minimal pass`` — decode + read each span's trace_id, span_id, parent_span_id,
  start and end time and its ``inferprof.stage`` attribute, no more (the attribute scan
  stops at that key): the ceiling of any Python-level processing of the spans;
* ``engine reads`` — decode + every protobuf read the engine's contract needs and nothing
  else (ids, times, kind, the values of the eight ``inferprof.*`` attributes, links of
  stage spans): the floor of a Python engine, before it does anything with the values;
* ``engine``       — decode + ``Engine.ingest_traces`` handed the decoded message and its
  bytes, as the receivers do (spans read off the bytes as columns, ``wire.SpanReader``,
  the common traces assembled with numpy) + finalisation (``flush``): what the collector
  does per export, sketches included;
* ``engine, message only`` — the same, handed the message alone (OTLP/JSON bodies,
  ``inferprof report`` on files): the engine serializes it and reads the bytes;
* ``engine, span by span`` — ``engine`` with the columnar ingest path off
  (``Assembler.columnar``): every span read and assembled one at a time. Small exports
  (``--requests-per-export 1``) show where that path is the faster one
  (``Assembler.columnar_min_spans``).

Times are the process's CPU time (``time.process_time``), so rates are spans per
CPU-second and time spent waiting for the core on a shared machine is not counted.
Rounds are interleaved (each path once per round) and the table gives medians over
rounds; ratios are medians of the per-round ratios, so load from other processes on a
shared machine biases them less than the absolute rates.

Then (unless ``--no-memory``), with ``tracemalloc``: Python heap held per in-flight request
(8 spans pending, nothing finalised) and per (service, model) series once folded.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import tracemalloc
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
SPANS_PER_REQUEST = 1 + len(STAGES)


def build(n_exports: int, per_export: int, service: str = "bench", series: int = 1) -> list[bytes]:
    """Serialized exports; requests are spread over ``series`` services."""
    out = []
    for e in range(n_exports):
        builders = [
            TraceBuilder(f"{service}-{k}" if series > 1 else service, host="h1")
            for k in range(series)
        ]
        for i in range(per_export):
            b = builders[i % series]
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
        request = ExportTraceServiceRequest()
        for b in builders:
            request.resource_spans.extend(b.export().resource_spans)
        out.append(request.SerializeToString())
    return out


def bench_decode(blobs: list[bytes]) -> tuple[int, float]:
    n = 0
    t0 = _cpu()
    for blob in blobs:
        req = ExportTraceServiceRequest.FromString(blob)
        n += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    return n, _cpu() - t0


def bench_minimal(blobs: list[bytes]) -> tuple[int, float]:
    n = 0
    key = sc.ATTR_STAGE
    t0 = _cpu()
    for blob in blobs:
        req = ExportTraceServiceRequest.FromString(blob)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                spans = ss.spans
                n += len(spans)
                for span in spans:
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
                            break  # keys are unique (OTLP): nothing more to read
    return n, _cpu() - t0


_ENGINE_KEYS = frozenset(
    {
        sc.ATTR_REQUEST,
        sc.ATTR_SAMPLE_WEIGHT,
        sc.ATTR_MODEL_NAME,
        sc.ATTR_BATCH_ID,
        sc.ATTR_TOKENS_EFFECTIVE,
        sc.ATTR_TOKENS_PADDED,
        sc.ATTR_GPU_ID,
    }
)


def bench_engine_reads(blobs: list[bytes]) -> tuple[int, float]:
    n = 0
    key = sc.ATTR_STAGE
    wanted = _ENGINE_KEYS
    t0 = _cpu()
    for blob in blobs:
        req = ExportTraceServiceRequest.FromString(blob)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                spans = ss.spans
                n += len(spans)
                for span in spans:
                    _ = (
                        span.trace_id,
                        span.span_id,
                        span.parent_span_id,
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                        span.kind,
                    )
                    stage = None
                    for kv in span.attributes:
                        k = kv.key
                        if k == key:
                            stage = kv.value.string_value
                        elif k in wanted:
                            _ = kv.value.string_value  # one typed read, as the engine
                    if stage is not None:
                        _ = span.links
    return n, _cpu() - t0


def bench_engine(
    blobs: list[bytes], *, with_payload: bool = True, columnar: bool = True
) -> tuple[int, float]:
    engine = Engine(settle_s=0.0, max_pending_spans=10_000_000)
    engine._asm.columnar = columnar
    t0 = _cpu()
    for blob in blobs:
        req = ExportTraceServiceRequest.FromString(blob)
        engine.ingest_traces(req, payload=blob if with_payload else None)
    engine.flush()
    elapsed = _cpu() - t0
    stats = engine.stats
    assert stats.requests_finalised * SPANS_PER_REQUEST == stats.spans_accepted, stats
    return stats.spans_accepted, elapsed


def _cpu() -> float:
    """CPU seconds of this process: on a shared machine, time spent waiting for the core
    is not counted (rates are spans per CPU-second)."""
    return time.process_time()


PATHS = (
    ("decode", bench_decode),
    ("minimal pass", bench_minimal),
    ("engine reads", bench_engine_reads),
    ("engine", bench_engine),
    ("engine, message only", lambda blobs: bench_engine(blobs, with_payload=False)),
    ("engine, span by span", lambda blobs: bench_engine(blobs, columnar=False)),
)


def memory(per_export: int) -> list[tuple[str, float]]:
    """Python heap (tracemalloc) per in-flight request and per folded series."""
    out = []
    # In flight: nothing is due (settle far away), so every span stays pending.
    blobs = build(2, per_export)
    requests = [ExportTraceServiceRequest.FromString(b) for b in blobs]
    engine = Engine(settle_s=3600.0, trace_timeout_s=7200.0, max_pending_spans=10_000_000)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for req, blob in zip(requests, blobs, strict=True):
        engine.ingest_traces(req, payload=blob)  # as the receivers do
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    n_req = engine.stats.pending_spans // SPANS_PER_REQUEST
    out.append((f"per in-flight request ({SPANS_PER_REQUEST} spans pending)", held / n_req))
    del engine

    # Per series: 200 (service, model) series, 50 requests each, folded and flushed.
    n_series, per_series = 200, 50
    blobs = build(1, n_series * per_series, series=n_series)
    requests = [ExportTraceServiceRequest.FromString(b) for b in blobs]
    engine = Engine(settle_s=0.0)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for req, blob in zip(requests, blobs, strict=True):
        engine.ingest_traces(req, payload=blob)
    engine.flush()
    engine.breakdown("bench-0")  # compacts the slice's chunks, as the first read does
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert engine.stats.series == n_series, engine.stats
    out.append(
        (f"per series ({per_series} requests x {len(STAGES)} stages, one slice)", held / n_series)
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exports", type=int, default=10)
    parser.add_argument("--requests-per-export", type=int, default=1250)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--cpu", type=int, default=None, help="core to pin to (default: first)")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc part")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0)) if args.cpu is None else args.cpu
        os.sched_setaffinity(0, {cpu})
    blobs = build(args.exports, args.requests_per_export)
    rates: dict[str, list[float]] = {name: [] for name, _ in PATHS}
    counts: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, fn in PATHS:
            gc.collect()
            n, dt = fn(blobs)
            counts[name] = n
            rates[name].append(n / dt)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    print(f"{args.rounds} interleaved rounds, one core, {counts['engine']:,} spans per round, "
          "CPU time\n")
    print("| path | spans per CPU-s (median) | CPU µs/span | vs decode | vs minimal pass "
          "| vs engine reads |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, _ in PATHS:
        rate = statistics.median(rates[name])
        print(
            f"| {name} | {rate:,.0f} | {1e6 / rate:.2f} | {ratio(name, 'decode'):.3f} "
            f"| {ratio(name, 'minimal pass'):.2f} | {ratio(name, 'engine reads'):.2f} |"
        )
    if not args.no_memory:
        print("\n| memory (Python heap, tracemalloc) | bytes |")
        print("|---|---:|")
        for label, value in memory(args.requests_per_export):
            print(f"| {label} | {value:,.0f} |")


if __name__ == "__main__":
    main()
