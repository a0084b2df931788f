"""CPU cost per stage of inferprof's in-process instrumentation, against the SDK's per-span cost.

    python3 benchmarks/stage_cost.py [--requests 20000]

One "request" = ``inferprof.request()`` around the 9 canonical stages. Spans go to a
``BatchSpanProcessor`` whose exporter discards them (``--encode`` makes it OTLP-encode them
first, as the real exporter does, in its own thread). CPU is ``time.process_time()`` over
the loop plus a final flush, so exporter-thread work is counted. The batch-encoding table
compares ``children`` and ``links`` for batches of 8 (see docs/batching.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

import inferprof  # noqa: E402

STAGES = ("receive", "tokenize", "queue", "batch_assembly", "h2d", "compute", "d2h",
          "postprocess", "serialize")


class Discard(SpanExporter):
    def __init__(self, encode: bool) -> None:
        self.encode = encode
        self.bytes = 0

    def export(self, spans):
        if self.encode:
            self.bytes += len(encode_spans(spans).SerializeToString())
        return SpanExportResult.SUCCESS


def provider(encode: bool):
    exporter = Discard(encode)
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 20,
                                             max_export_batch_size=512))
    return tp, exporter


def sdk_per_span(n: int, encode: bool) -> float:
    tp, _ = provider(encode)
    tracer = tp.get_tracer("bench")
    t0 = time.process_time()
    for _ in range(n):
        tracer.start_span("inferprof.compute", attributes={"inferprof.stage": "compute"}).end()
    tp.force_flush()
    cpu = time.process_time() - t0
    tp.shutdown()
    return cpu / n


def inferprof_per_stage(n: int, mode: str | None, encode: bool) -> float:
    tp, _ = provider(encode)
    if mode is not None:
        # production: every request timed (its timing budget would leave most of this
        # loop's requests untimed, and the row is the cost of recording stages)
        inferprof.configure(tracer_provider=tp, mode=mode, max_timed_rate=0)
    request, stage = inferprof.request, inferprof.stage
    t0 = time.process_time()
    for _ in range(n):
        with request(model="m"):
            for s in STAGES:
                with stage(s):
                    pass
    tp.force_flush()
    cpu = time.process_time() - t0
    inferprof.shutdown()
    tp.shutdown()
    return cpu / (n * len(STAGES))


def encoding_per_request(encoding: str, batches: int, size: int = 8) -> tuple[float, float]:
    """CPU and OTLP bytes per request for one batch encoding (hooks API, no event loop)."""
    tp, exporter = provider(True)
    inferprof.configure(tracer_provider=tp, batch_encoding=encoding)
    from inferprof.instrumentation.records import SCOPE

    t0 = time.process_time()
    for _ in range(batches):
        scopes, handles = [], []
        for i in range(size):
            r = inferprof.request(model="m")
            rec = r.__enter__()
            with inferprof.stage("tokenize"):
                pass
            handles.append(inferprof.enqueue(depth=i))
            scopes.append(r)
            SCOPE.set(None)  # park the request, as an awaiting handler would
        with inferprof.batch(handles, max_size=size) as b:
            for s in ("batch_assembly", "h2d", "compute", "d2h"):
                with b.stage(s):
                    pass
        for r in scopes:
            SCOPE.set((r._rec, None))
            with inferprof.stage("postprocess"):
                pass
            r.__exit__(None, None, None)
    tp.force_flush()
    cpu = time.process_time() - t0
    inferprof.shutdown()
    tp.shutdown()
    n = batches * size
    del rec
    return cpu / n, exporter.bytes / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    args = ap.parse_args()
    n = args.requests
    print("| | CPU per span/stage, discard | with OTLP encoding |")
    print("|---|---|---|")
    print(f"| SDK span (start_span().end()) | {sdk_per_span(n * 9, False) * 1e6:.1f} µs "
          f"| {sdk_per_span(n * 9, True) * 1e6:.1f} µs |")
    for mode in ("full", "production", "off", None):
        label = mode or "unconfigured"
        print(f"| inferprof {label} | {inferprof_per_stage(n, mode, False) * 1e6:.1f} µs "
              f"| {inferprof_per_stage(n, mode, True) * 1e6:.1f} µs |")
    print()
    print("| batch encoding (batches of 8) | CPU per request | OTLP bytes per request |")
    print("|---|---|---|")
    for enc in ("children", "links"):
        cpu, nbytes = encoding_per_request(enc, n // 8)
        print(f"| {enc} | {cpu * 1e6:.0f} µs | {nbytes:.0f} |")


if __name__ == "__main__":
    main()
