"""A synthetic serving workload for the fleet tests and benchmarks/fleet_merge.py: OTLP
exports of requests whose stages have lognormal durations and whose tail waits in the
queue, some requests sampled (weight 4). ``exports(n, shares=3)`` splits the requests into
disjoint shares, as trace-ID routing to that many collectors would; ``engine_fed`` folds a
share in an engine, and ``summed_scrapes`` / ``fleet_document`` sum the engines'
``/metrics/fleet`` by label set, as ``sum by (le)`` does in Prometheus, and read the fleet
breakdown back."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from inferprof import semconv as sc
from inferprof.collector.engine import Engine
from inferprof.collector.fleet import E2E, Buckets, FleetExposition, document, tables_from_sums
from tests.collector.synth import FakeClock, TraceBuilder

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


def engine_fed(parts: Iterable[ExportTraceServiceRequest]) -> Engine:
    """An engine (no settling, a fake clock) that has folded every export of ``parts``."""
    engine = Engine(settle_s=0.0, clock=FakeClock())
    for request in parts:
        engine.ingest_traces(request)
    engine.flush()
    return engine


def summed_scrapes(engines: Sequence[Engine], service: str, model: str) -> tuple[dict, ...]:
    """What ``sum by (stage, le)`` over the engines' ``/metrics/fleet`` gives for one
    series: the cumulative stage buckets (end-to-end under ``E2E``), the tail's stage time,
    end-to-end time and traced count per end-to-end bucket."""
    stage_cum: dict = defaultdict(lambda: defaultdict(float))
    tail_stage: dict = defaultdict(lambda: defaultdict(float))
    tail_e2e: dict = defaultdict(float)
    tail_traced: dict = defaultdict(float)
    for engine in engines:
        text = FleetExposition(engine)().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = s.labels
                if labels.get("service") != service or labels.get("model") != model:
                    continue
                if s.name == sc.PROM_FLEET_STAGE_DURATION + "_bucket":
                    stage_cum[labels["stage"]][labels["le"]] += s.value
                elif s.name == sc.PROM_FLEET_REQUEST_DURATION + "_bucket":
                    stage_cum[E2E][labels["le"]] += s.value
                elif s.name == sc.PROM_FLEET_TAIL_STAGE:
                    tail_stage[labels["stage"]][labels["le"]] += s.value
                elif s.name == sc.PROM_FLEET_TAIL_REQUEST:
                    tail_e2e[labels["le"]] += s.value
                elif s.name == sc.PROM_FLEET_TAIL_TRACED:
                    tail_traced[labels["le"]] += s.value
    return stage_cum, tail_stage, tail_e2e, tail_traced


def fleet_document(engines: Sequence[Engine], service: str = "fleet", model: str = "m") -> dict:
    """The fleet breakdown of one series from the engines' summed ``/metrics/fleet``."""
    buckets = Buckets(engines[0].mapping)
    tables = tables_from_sums(buckets, *summed_scrapes(engines, service, model))
    return document(service, model, None, tables, buckets.mapping)
