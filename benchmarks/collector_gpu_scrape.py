"""A /metrics scrape with many GPUs' samples retained, against one with none.

    python3 benchmarks/collector_gpu_scrape.py [--series 50] [--gpus 0,1000,8000]
                                               [--samples 1000000] [--rounds 5]

Builds one engine per row: ``--series`` (service, model) series of traced requests whose
compute spans each name one GPU of ``host-1``, and ``--samples`` GPU samples (``hw.gpu.utilization``)
spread over ``--gpus`` GPUs (8 per host) inside the retention; the first row, 0 GPUs,
is the baseline. Each round renders the whole ``/metrics`` exposition
(``prometheus_client.generate_latest``) once per row, rows in a rotated order; the table
gives the median scrape time and its ratio to the baseline's (medians of per-round
ratios, so load from other processes biases them less).

Every series' breakdown joins the samples of the GPU its spans name and counts the
window's samples: that work must not grow with the GPUs retained.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry, generate_latest

from inferprof import semconv as sc
from inferprof.collector.engine import Engine
from inferprof.collector.metrics import EngineCollector
from tests.collector.synth import FakeClock, TraceBuilder, gpu_metrics

NOW = 1_800_000_000.0


def build(series: int, gpus: int, samples: int) -> CollectorRegistry:
    clock = FakeClock(NOW)
    engine = Engine(clock=clock, settle_s=0.0, max_gpu_samples=max(samples, 1),
                    max_gpus_per_host=8, max_gpu_hosts=max(1, gpus // 8 + 1))
    per_gpu = samples // gpus if gpus else 0
    for g in range(gpus):
        period = 200.0 / per_gpu  # spread over the last 200 s
        engine.ingest_metrics(gpu_metrics(
            [(k * period, 0.5) for k in range(per_gpu)], host=f"host-{g // 8}",
            hw_id=f"GPU-{g % 8}", base_unix=NOW - 200.0))
    b = TraceBuilder(host="host-1", base_unix=NOW - 100.0)
    for s in range(series):
        for i in range(50):
            t = i * 1.0
            req = b.request(t, t + 0.03, model=f"m-{s}")
            b.stage(req, "queue", t, t + 0.01)
            b.stage(req, "compute", t + 0.01, t + 0.03, gpu_id=f"GPU-{s % 8}")
    engine.ingest_traces(b.export())
    engine.advance()
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, window_s=300.0, max_series=series + 1))
    return registry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--series", type=int, default=50)
    ap.add_argument("--gpus", default="0,1000,8000")
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    gpus = [int(g) for g in args.gpus.split(",")]
    registries = [build(args.series, g, args.samples if g else 0) for g in gpus]
    times: list[list[float]] = [[] for _ in gpus]
    for r in range(args.rounds):
        order = list(range(len(gpus)))
        order = order[r % len(order):] + order[: r % len(order)]
        for i in order:
            started = time.perf_counter()
            generate_latest(registries[i])
            times[i].append(time.perf_counter() - started)
    base = times[0]
    print(f"`python3 benchmarks/collector_gpu_scrape.py --series {args.series} "
          f"--gpus {args.gpus} --samples {args.samples} --rounds {args.rounds}`\n")
    print("| GPUs retained | samples retained | scrape, median (ms) | ratio to 0 GPUs |")
    print("|---:|---:|---:|---:|")
    for g, ts in zip(gpus, times):
        ratio = statistics.median(t / b for t, b in zip(ts, base))
        print(f"| {g} | {args.samples if g else 0} | {1000 * statistics.median(ts):.1f} | "
              f"{ratio:.2f} |")


if __name__ == "__main__":
    main()
