"""Fleet merge: N engines' /metrics/fleet summed by le against one engine fed everything,
and what the fleet exposition costs against the usual /metrics.

    python3 benchmarks/fleet_merge.py [--requests 6000] [--collectors 1,2,3,8] [--repeat 5]

The requests (tests/collector/fleet_workload.py: five stages, a queue-bound tail, 30% of
requests sampled with weight 4) are split by request across N in-process engines, as
trace-ID routing splits them across collectors. Each engine's ``/metrics/fleet`` body is
parsed and summed by label set (what ``sum by (le)`` does in Prometheus), read back with
``fleet.document`` and compared with the breakdown of one engine fed every request: the
largest relative quantile error over every stage's p50/p95/p99 and the end-to-end
latency, the largest share difference (percentage points), whether the verdict and the
request count agree.

Second table, the baseline measured in the same run: one engine fed everything, the
rendering time (median of ``--repeat``) and size of ``/metrics`` (``EngineCollector``
through ``prometheus_client``) and of ``/metrics/fleet``, and their ratio.
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
from inferprof.collector.fleet import FleetExposition
from inferprof.collector.metrics import EngineCollector
from tests.collector.fleet_workload import engine_fed, exports, fleet_document


def _errors(got: dict, ref: dict) -> tuple[float, float]:
    q_err = max(
        abs(got["latency"][k] - ref["latency"][k]) / ref["latency"][k]
        for k in ("p50", "p95", "p99")
    )
    by_stage = {st["stage"]: st for st in got["stages"]}
    share_err = 0.0
    for st in ref["stages"]:
        g = by_stage[st["stage"]]
        if st["stage"] != sc.STAGE_UNATTRIBUTED:  # below the exported range
            q_err = max(q_err, *(abs(g[k] - st[k]) / st[k] for k in ("p50", "p95", "p99")))
        share_err = max(share_err, abs(g["share_of_p95"] - st["share_of_p95"]))
    return q_err, share_err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--collectors", default="1,2,3,8")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    counts = [int(c) for c in args.collectors.split(",")]

    everything = engine_fed([r for p in exports(args.requests, shares=1) for r in p])
    ref = everything.breakdown("fleet", "m", window_s=None)
    print(f"{args.requests} requests ({ref['requests']} weighted), verdict "
          f"{ref['verdict']['bottleneck']}\n")
    print("| collectors | max quantile error | max share error | verdict | requests |")
    print("|---:|---:|---:|---|---|")
    for n in counts:
        engines = [engine_fed(p) for p in exports(args.requests, shares=n)]
        got = fleet_document(engines)
        q_err, share_err = _errors(got, ref)
        same = got["verdict"]["bottleneck"] == ref["verdict"]["bottleneck"]
        print(f"| {n} | {q_err:.2e} | {share_err * 100:.2e} pp | "
              f"{'same' if same else 'DIFFERENT'} | "
              f"{'equal' if got['requests'] == ref['requests'] else 'DIFFERENT'} |")

    registry = CollectorRegistry()
    registry.register(EngineCollector(everything))
    fleet = FleetExposition(everything)
    rows = []
    for name, render in (("/metrics (baseline)", lambda: generate_latest(registry)),
                         ("/metrics/fleet", fleet)):
        times, body = [], b""
        for _ in range(args.repeat):
            t = time.perf_counter()
            body = render()
            times.append(time.perf_counter() - t)
        rows.append((name, statistics.median(times), len(body), body.count(b"\n")))
    print("\n| exposition | render (median) | ratio | bytes | lines |")
    print("|---|---:|---:|---:|---:|")
    for name, t, size, lines in rows:
        print(f"| {name} | {t * 1e3:.1f} ms | {t / rows[0][1]:.2f}x | {size:,} | {lines:,} |")


if __name__ == "__main__":
    main()
