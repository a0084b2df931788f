"""What the breakdown's examples, the histograms' exemplars and the cost figures add to ingest.

    python3 benchmarks/collector_extras.py [--exports 8] [--requests-per-export 1250]
                                           [--series 4] [--rounds 7] [--cpu 0]

The exports of ``collector_ingest.py`` (8 spans per request, batch and token attributes on
two stages; compute carries a batch size, so every request has a work span), decoded,
ingested and finalised by the engine, in interleaved rounds:

* ``engine``            — as the collector runs;
* ``without extras``    — the same engine with ``ExampleStore.add``, ``ExemplarStore.add``
  and ``CostStore.add`` replaced by no-ops: what it cost before them.

The table gives medians over rounds and the median of the per-round ratios (load from
other processes on a shared machine biases the ratio less than the rates).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collector_ingest import build
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

from inferprof.collector.cost import CostStore
from inferprof.collector.engine import Engine
from inferprof.collector.examples import ExampleStore
from inferprof.collector.exemplars import ExemplarStore


@contextlib.contextmanager
def without_extras() -> Iterator[None]:
    saved = [(cls, cls.add) for cls in (ExampleStore, ExemplarStore, CostStore)]
    for cls, _ in saved:
        cls.add = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, add in saved:
            cls.add = add  # type: ignore[method-assign]


def run(blobs: list[bytes]) -> tuple[int, float]:
    engine = Engine(settle_s=0.0, max_pending_spans=10_000_000)
    t0 = time.perf_counter()
    for blob in blobs:
        engine.ingest_traces(ExportTraceServiceRequest.FromString(blob))
    engine.flush()
    return engine.stats.spans_accepted, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exports", type=int, default=8)
    parser.add_argument("--requests-per-export", type=int, default=1250)
    parser.add_argument("--series", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cpu", type=int, default=None, help="core to pin to (default: first)")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0)) if args.cpu is None else args.cpu
        os.sched_setaffinity(0, {cpu})
    blobs = build(args.exports, args.requests_per_export, series=args.series)
    rates: dict[str, list[float]] = {"engine": [], "without extras": []}
    spans = 0
    for _ in range(args.rounds):
        for name in rates:
            gc.collect()
            with without_extras() if name == "without extras" else contextlib.nullcontext():
                spans, dt = run(blobs)
            rates[name].append(spans / dt)
    ratio = statistics.median(
        a / b for a, b in zip(rates["engine"], rates["without extras"], strict=True))
    print(f"{args.rounds} interleaved rounds, one core, {spans:,} spans per round, "
          f"{args.series} series\n")
    print("| path | spans/s (median) | µs/span | vs without extras |")
    print("|---|---:|---:|---:|")
    for name, values in rates.items():
        rate = statistics.median(values)
        shown = ratio if name == "engine" else 1.0
        print(f"| {name} | {rate:,.0f} | {1e6 / rate:.2f} | {shown:.3f} |")


if __name__ == "__main__":
    main()
