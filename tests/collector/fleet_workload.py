"""A synthetic serving workload for the fleet tests: OTLP exports of requests whose
stages have lognormal durations and whose tail waits in the queue, some requests
sampled (weight 4). ``exports(n, shares=3)`` splits the requests into disjoint shares,
as trace-ID routing to that many collectors would."""

from __future__ import annotations

import math

import numpy as np
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.collector.synth import TraceBuilder

#: (stage, median seconds, sigma of the log)
STAGES = (
    ("receive", 0.0008, 0.3),
    ("tokenize", 0.002, 0.4),
    ("queue", 0.025, 1.3),
    ("compute", 0.030, 0.25),
    ("serialize", 0.001, 0.3),
)


def exports(
    n: int,
    *,
    shares: int = 1,
    service: str = "fleet",
    model: str = "m",
    seed: int = 7,
    per_export: int = 200,
    base_unix: float | None = None,
) -> list[list[ExportTraceServiceRequest]]:
    """Per share, the exports holding its requests (request ``i`` goes to share
    ``i % shares``)."""
    rng = np.random.default_rng(seed)
    durations = {
        stage: rng.lognormal(math.log(median), sigma, n) for stage, median, sigma in STAGES
    }
    gaps = rng.uniform(0.0, 0.0005, n)
    weights = np.where(rng.random(n) < 0.3, 4.0, 1.0)
    kw = {} if base_unix is None else {"base_unix": base_unix}
    builders = [TraceBuilder(service, instance=f"i-{k}", **kw) for k in range(shares)]
    out: list[list[ExportTraceServiceRequest]] = [[] for _ in range(shares)]
    for i in range(n):
        b = builders[i % shares]
        weight = float(weights[i])
        b.sequential(
            i * 2.0,  # apart: no request queues behind another one's compute
            [(stage, float(durations[stage][i])) for stage, _, _ in STAGES],
            tail_gap=float(gaps[i]),
            model=model,
            weight=weight if weight != 1.0 else None,
        )
        if len(b.spans) >= per_export * (len(STAGES) + 1):
            out[i % shares].append(b.export())
    for k, b in enumerate(builders):
        if b.spans:
            out[k].append(b.export())
    return out
