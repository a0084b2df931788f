"""What summaries (contract §15) cost the collector, against counting the same requests
from their traces.

    python3 benchmarks/collector_summaries.py            # 5 s of one replica, 7 rounds
    python3 benchmarks/collector_summaries.py --seconds 2 --rounds 3

One replica's ``--seconds`` of each SYNTHETIC batching service of
``benchmarks/sampling_error.py`` (every request timed), three ways into a fresh real
``Engine`` each round, timed in CPU seconds of this process (``time.process_time``) from
the first ``ingest_*`` call to the end of the flush:

* **all traces**: every request's trace (10 spans), as without sampling: the baseline;
* **summaries**: the producer's one DELTA export of those requests (its own accumulator,
  ``instrumentation.summaries.Summaries``, encoded by the SDK's OTLP encoder);
* **summaries + kept traces**: the same export plus the traces the default sampler keeps
  (0.05, 0.9), marked ``inferprof.summary.counted``: what production mode sends.

Prints the median over rounds, and each against the baseline of the same run.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import sampling_error as se
from inferprof.collector.engine import Engine
from inferprof.instrumentation.sampling import TailSampler
from tests.collector.synth import FakeClock, TraceBuilder


def _cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _inputs(scen: se.Scenario, seconds: float) -> tuple:
    """The workload's request count, every request's traces, the kept traces (marked
    counted) and the summaries' exports."""
    rng = np.random.default_rng([1, zlib.crc32(scen.name.encode())])
    w = se.simulate(scen, se.window_requests(scen, seconds), rng)
    n = len(w.bounds)
    order = np.argsort(w.bounds[:, -1], kind="stable").tolist()
    random.seed(1)
    sampler = TailSampler(*se.DEFAULT_SETTING)
    head = (rng.random(n) < se.DEFAULT_SETTING[0]).tolist()
    e2e = w.e2e_ns.tolist()
    kept = np.full(n, np.nan)
    for i in order:
        weight = sampler.decide(e2e[i], head[i], (se.REQUEST_NAME, se.MODEL))
        if weight is not None:
            kept[i] = weight
    spans = se.Spans(w)
    builder = TraceBuilder(se.SERVICE)
    every = builder.export(
        [s for i in order for s in (spans.request(i, 1.0), *spans.stages(i))])
    sampled = builder.export(
        [s for i in order if not math.isnan(kept[i])
         for s in (spans.request(i, kept[i], counted=True), *spans.stages(i))])
    return n, every, sampled, se.summary_exports(w, np.ones(n, bool), np.ones(n))


def _run(n: int, traces, summaries) -> float:
    """CPU seconds a fresh engine takes to fold ``summaries`` and ``traces``."""
    engine = Engine(clock=FakeClock(), settle_s=0.0)

    def work() -> None:
        for export in summaries:
            engine.ingest_metrics(export)
        if traces is not None:
            engine.ingest_traces(traces)
        engine.flush()

    cpu = _cpu(work)
    doc = engine.breakdown(se.SERVICE, window_s=None)
    assert doc is not None and doc["requests"] == n, (doc and doc["requests"], n)
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="seconds of one replica's traffic (default 5: one export)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"SYNTHETIC batching services of benchmarks/sampling_error.py, one replica's "
          f"{args.seconds:g} s, every request timed. CPU of this process from the first "
          f"ingest to the end of the flush, median of {args.rounds} rounds; ratios against "
          "all traces in the same run.\n")
    print("| scenario: the collector gets | requests | traces | summary data points "
          "| CPU (ms) | µs per request | x all traces |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for scen in se.SCENARIOS.values():
        n, every, sampled, exports = _inputs(scen, args.seconds)
        points = sum(len(m.exponential_histogram.data_points)
                     for e in exports for rm in e.resource_metrics
                     for sm in rm.scope_metrics for m in sm.metrics)
        n_sampled = sum(1 for rs in sampled.resource_spans for ss in rs.scope_spans
                        for span in ss.spans if not span.parent_span_id)
        cases = {
            "all traces (baseline)": (every, [], n, 0),
            "summaries": (None, exports, 0, points),
            "summaries + kept traces": (sampled, exports, n_sampled, points),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (traces, summaries, _, _) in cases.items():
                times[name].append(_run(n, traces, summaries))
        base = statistics.median(times["all traces (baseline)"])
        for name, (_, _, traced, pts) in cases.items():
            m = statistics.median(times[name])
            print(f"| {scen.name}: {name} | {n:,} | {traced:,} | {pts} | {m * 1e3:.1f} "
                  f"| {m / n * 1e6:.2f} | {m / base:.3f} |")

if __name__ == "__main__":
    main()
