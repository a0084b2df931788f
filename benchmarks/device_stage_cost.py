"""Host CPU cost of a device stage on a real CUDA GPU, against its baselines.

    python3 benchmarks/device_stage_cost.py [--batches 3000]

Needs torch with a CUDA device (exits with a message otherwise). One "batch" is one request
in a batch of one, with ``h2d``/``compute``/``d2h`` stages around a tiny copy-in, a small
kernel and a synchronising copy-out; the model work is the same in every row. Rows,
interleaved over rounds, medians reported:

* bare: the same work with no inferprof at all (the baseline the ratios are against);
* request + batch: ``inferprof.request()`` and ``inferprof.batch()`` around the work, no
  stages (the baseline the per-stage extra is against);
* host timers: ``inferprof.stage(name)`` (no ``device=``): what the stages cost when they
  time the host only (and so, on a GPU, measure launches instead of work);
* device stages: ``inferprof.stage(name, device="cuda:0")``: two ``torch.cuda.Event`` per
  stage, resolved at the batch end;
* bare CUDA events: the same event pairs recorded and read by hand, no inferprof: what the
  events themselves cost.

Spans go through a ``SimpleSpanProcessor`` into an exporter that discards them (every
request kept), so all of their CPU is on the measured thread. Also
prints the accuracy check: the ``compute`` span's duration against an independent event pair
around a ~5 ms kernel sequence (a host timer around the launch for comparison).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

import inferprof  # noqa: E402


class Discard(SpanExporter):
    def __init__(self) -> None:
        self.spans: list = []
        self.keep = False

    def export(self, spans):
        if self.keep:
            self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=3000, help="batches per row per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch is not installed: this benchmark needs a CUDA GPU")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a CUDA GPU")
        return 2

    dev = "cuda:0"
    w = torch.randn(256, 256, device=dev)
    host = torch.randn(8, 256).pin_memory()
    exporter = Discard()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    inferprof.configure(tracer_provider=tp, mode="full")

    def work_bare():
        x = host.to(dev, non_blocking=True)
        y = x @ w
        return y.cpu()

    def batch_bare():
        work_bare()

    def batch_nostages():
        with inferprof.request(), inferprof.batch([inferprof.enqueue()], max_size=8):
            work_bare()

    def batch_host():
        with inferprof.request(), inferprof.batch([inferprof.enqueue()], max_size=8):
            with inferprof.stage("h2d"):
                x = host.to(dev, non_blocking=True)
            with inferprof.stage("compute"):
                y = x @ w
            with inferprof.stage("d2h"):
                y.cpu()

    def batch_device():
        with inferprof.request(), inferprof.batch([inferprof.enqueue()], max_size=8):
            with inferprof.stage("h2d", device=dev):
                x = host.to(dev, non_blocking=True)
            with inferprof.stage("compute", device=dev):
                y = x @ w
            with inferprof.stage("d2h", device=dev):
                y.cpu()

    def batch_events():
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
        ev[0].record()
        x = host.to(dev, non_blocking=True)
        ev[1].record()
        ev[2].record()
        y = x @ w
        ev[3].record()
        ev[4].record()
        y.cpu()
        ev[5].record()
        ev[5].query()
        ev[5].synchronize()
        [ev[0].elapsed_time(e) for e in ev[1:]]

    rows = {
        "bare (no stages)": batch_bare,
        "request + batch, no stages": batch_nostages,
        "host-timer stages": batch_host,
        "device stages (CUDA events)": batch_device,
        "bare CUDA events, no inferprof": batch_events,
    }
    for fn in rows.values():  # warm-up
        for _ in range(200):
            fn()
    results: dict[str, list[float]] = {k: [] for k in rows}
    for r in range(args.rounds):
        order = list(rows)[r % len(rows):] + list(rows)[: r % len(rows)]
        for name in order:
            fn = rows[name]
            torch.cuda.synchronize()
            t0 = time.process_time()
            for _ in range(args.batches):
                fn()
            results[name].append((time.process_time() - t0) / args.batches)
    medians = {name: statistics.median(vals) for name, vals in results.items()}
    base = medians["bare (no stages)"]
    # rows with stages -> the row their extra per stage is measured against
    reference = {
        "host-timer stages": "request + batch, no stages",
        "device stages (CUDA events)": "request + batch, no stages",
        "bare CUDA events, no inferprof": "bare (no stages)",
    }
    print(f"Host CPU per batch on {torch.cuda.get_device_name(0)} "
          f"(torch {torch.__version__}); median of {args.rounds} rounds x {args.batches} "
          f"batches; spans exported (mode full) to a discarding exporter.\n")
    print("| row | CPU per batch (µs) | x bare | extra per stage (µs) |")
    print("|---|---:|---:|---:|")
    for name, med in medians.items():
        ref = reference.get(name)
        extra = f"{(med - medians[ref]) / 3 * 1e6:+.1f}" if ref else "-"
        print(f"| {name} | {med * 1e6:.1f} | {med / base:.2f} | {extra} |")
    print("\nextra per stage: over `request + batch, no stages` (over `bare` for the bare "
          "events), divided by 3 stages.")

    # Accuracy: compute stage against an independent event pair.
    a = torch.randn(4096, 4096, device=dev)
    b = torch.randn(4096, 4096, device=dev)
    a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    a @ b
    e.record()
    e.synchronize()
    reps = max(1, round(5.0 / s.elapsed_time(e)))
    print("\n| trial | launch on host (ms) | GPU time, own events (ms) | compute span (ms) |")
    print("|---:|---:|---:|---:|")
    exporter.keep = True
    for trial in range(5):
        exporter.spans.clear()
        s.record()
        for _ in range(reps):
            a @ b
        e.record()
        e.synchronize()
        truth = s.elapsed_time(e)
        with inferprof.request(), inferprof.batch([inferprof.enqueue()], max_size=1):
            t0 = time.perf_counter()
            with inferprof.stage("compute", device=dev):
                for _ in range(reps):
                    y = a @ b
            launch = (time.perf_counter() - t0) * 1e3
            with inferprof.stage("d2h", device=dev):
                y[0, :8].cpu()
        span = next(sp for sp in exporter.spans
                    if (sp.attributes or {}).get("inferprof.stage") == "compute")
        print(f"| {trial} | {launch:.3f} | {truth:.3f} | "
              f"{(span.end_time - span.start_time) / 1e6:.3f} |")
    inferprof.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
