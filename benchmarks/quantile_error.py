"""Quantile error of inferprof's sketch vs a Prometheus histogram, against exact quantiles.

    python3 benchmarks/quantile_error.py [--n 20000] [--seed 1]

For several latency distributions, draws ``--n`` request latencies, folds them through a
real ``Engine`` (OTLP request spans in, ``breakdown()`` out) and compares p50/p95/p99 with

* the exact quantiles of the same data (the lower quantile, the sketch's definition:
  the smallest value whose cumulative count reaches q·n);
* what Prometheus' ``histogram_quantile`` would report from a histogram with the
  OpenTelemetry Collector ``spanmetrics`` connector's default buckets (2, 4, 6, 8, 10,
  50, 100, 200, 400, 800, 1000, 1400, 2000, 5000, 10000, 15000 ms, then +Inf), with the
  linear interpolation inside the bucket that ``histogram_quantile`` does.

Prints one Markdown table: relative error |estimate - exact| / exact per quantile.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferprof import semconv as sc
from inferprof.collector.engine import Engine
from inferprof.collector.sketch import exact_weighted_quantile
from tests.collector.synth import FakeClock, TraceBuilder

#: spanmetrics connector default histogram buckets (explicit bounds, milliseconds).
SPANMETRICS_BUCKETS_MS = (
    2,
    4,
    6,
    8,
    10,
    50,
    100,
    200,
    400,
    800,
    1000,
    1400,
    2000,
    5000,
    10000,
    15000,
)


def distributions(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Latencies in seconds."""
    return {
        "tokenize-like: exponential, mean 3 ms": rng.exponential(0.003, n),
        "stage: lognormal, median 50 ms, sigma 0.5": rng.lognormal(math.log(0.050), 0.5, n),
        "e2e: lognormal, median 300 ms, sigma 1.0": rng.lognormal(math.log(0.300), 1.0, n),
        "bimodal: 85% ~20 ms, 15% ~600 ms": np.where(
            rng.random(n) < 0.85,
            rng.lognormal(math.log(0.020), 0.2, n),
            rng.lognormal(math.log(0.600), 0.3, n),
        ),
        "generation: uniform 1-3 s": rng.uniform(1.0, 3.0, n),
        "heavy tail: Pareto a=1.5, from 10 ms": 0.010 * (1.0 + rng.pareto(1.5, n)),
    }


def histogram_quantile(q: float, bounds_s: np.ndarray, counts: np.ndarray) -> float:
    """Prometheus ``histogram_quantile`` over per-bucket (non-cumulative) ``counts`` for
    upper bounds ``bounds_s`` followed by +Inf."""
    cum = np.cumsum(counts)
    total = cum[-1]
    rank = q * total
    b = int(np.searchsorted(cum, rank, side="left"))  # first bucket with cum >= rank
    if b == len(bounds_s):  # the +Inf bucket: the highest finite bound
        return float(bounds_s[-1])
    start = 0.0 if b == 0 else float(bounds_s[b - 1])
    end = float(bounds_s[b])
    below = 0.0 if b == 0 else float(cum[b - 1])
    count = float(counts[b])
    return start + (end - start) * ((rank - below) / count)


def engine_quantiles(values: np.ndarray) -> dict[str, float]:
    clock = FakeClock()
    engine = Engine(clock=clock, settle_s=0.0, retention_s=math.inf, max_pending_spans=10_000_000)
    b = TraceBuilder("qerr")
    for i, v in enumerate(values.tolist()):
        b.request(i * 1e-3, i * 1e-3 + v, model="m")
        if len(b.spans) >= 5_000:
            engine.ingest_traces(b.export())
    engine.ingest_traces(b.export())
    engine.flush()
    doc = engine.breakdown("qerr", window_s=None)
    assert doc is not None and doc["requests"] == len(values), doc
    return doc["latency"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="requests per distribution")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    bounds = np.asarray(SPANMETRICS_BUCKETS_MS, dtype=np.float64) / 1000.0
    names = ("p50", "p95", "p99")
    print(
        f"{args.n:,} requests per distribution, seed {args.seed}. Relative error vs exact "
        "(inferprof | Prometheus histogram, spanmetrics default buckets).\n"
    )
    print(
        "| distribution | exact p50 / p95 / p99 (ms) | inferprof p50 | p95 | p99 "
        "| Prometheus p50 | p95 | p99 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    worst_ip = worst_prom = 0.0
    for label, raw in distributions(rng, args.n).items():
        # Nanosecond spans: the engine sees latencies rounded to the ns, so does the
        # reference.
        values = np.round(raw * 1e9) / 1e9
        exact = {nm: exact_weighted_quantile(values, None, q) for nm, q in zip(names, sc.QUANTILES)}
        ours = engine_quantiles(values)
        counts = np.bincount(
            np.searchsorted(bounds, values, side="left"), minlength=len(bounds) + 1
        )
        prom = {nm: histogram_quantile(q, bounds, counts) for nm, q in zip(names, sc.QUANTILES)}
        err_ip = [abs(ours[nm] - exact[nm]) / exact[nm] for nm in names]
        err_prom = [abs(prom[nm] - exact[nm]) / exact[nm] for nm in names]
        worst_ip = max(worst_ip, *err_ip)
        worst_prom = max(worst_prom, *err_prom)
        ex = " / ".join(f"{exact[nm] * 1e3:.4g}" for nm in names)
        print(
            f"| {label} | {ex} | "
            + " | ".join(f"{e:.2%}" for e in err_ip)
            + " | "
            + " | ".join(f"{e:.1%}" for e in err_prom)
            + " |"
        )
    print(
        f"\nworst relative error: inferprof {worst_ip:.2%}, "
        f"Prometheus spanmetrics histogram {worst_prom:.1%}"
    )


if __name__ == "__main__":
    main()
