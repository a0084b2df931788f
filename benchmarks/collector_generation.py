"""Collector CPU per generated token (contract §7, encoding §14), against the same spans
without generation.

    python3 benchmarks/collector_generation.py [--requests 400] [--tokens 256] [--rounds 5]
                                               [--cpu 0]

Builds one synthetic continuous-batching run (``tests/collector/gen_synth.simulate``): a
single engine, about ``--tokens`` output tokens per request, every engine step a span, each
request with its ``queue``/``prefill``/``decode`` stages and its token times. Serializes the
exports, pins the process to one core and measures, interleaved per round, decode +
``Engine.ingest_traces`` + ``flush`` + one ``breakdown`` of:

* ``generation``         — the run as inferprof's producer exports it (step spans, token
  times on the request spans): what the collector does per generated token;
* ``generation, compact steps`` — the same, the steps as compact step spans of 256 steps
  each (``production``'s encoding);
* ``generation, no steps`` — the same requests without the engine's step spans (gaps not
  joined to steps: the cost of the per-token arrays alone);
* ``baseline``           — the same number of spans, the same request spans and stages, but
  no generation attribute (no token times or counts) and the step spans as plain spans: the
  collector's cost for those spans when nothing generates.

Reports medians over rounds of CPU seconds (``time.process_time``), µs per generated token
and per span, and the median of the per-round ratios to the baseline.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from inferprof import semconv as sc
from inferprof.collector.engine import Engine
from tests.collector.gen_synth import inferprof_exports, simulate

_GEN_KEYS = {
    sc.ATTR_GEN_EMIT_OFFSETS_S, sc.ATTR_GEN_EMIT_TOKENS, sc.ATTR_TOKENS_OUTPUT,
    sc.ATTR_TOKENS_PROMPT, sc.ATTR_ENGINE_ID, sc.ATTR_STEP_PREFILL_TOKENS,
    sc.ATTR_STEP_DECODE_TOKENS, sc.ATTR_STEP_REQUESTS, sc.ATTR_STEP_KV_CACHE_USAGE,
}


def _strip(export: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    """The export without any generation attribute."""
    out = ExportTraceServiceRequest()
    out.CopyFrom(export)
    for rs in out.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                keep = [kv for kv in span.attributes if kv.key not in _GEN_KEYS]
                del span.attributes[:]
                span.attributes.extend(keep)
    return out


def build(requests: int, tokens: int) -> tuple[dict[str, list[bytes]], int, int]:
    rng = np.random.default_rng(7)
    # About 32 requests decode at once; the run leaves every request room for its tokens.
    scen = simulate(rng, n_requests=requests, n_steps=max(6 * tokens, requests * tokens // 32),
                    prefill_every=0.05, output_tokens=(tokens, tokens + 1))
    gen = inferprof_exports(scen, per_export=2000)
    no_steps = inferprof_exports(scen, steps=False, per_export=2000)
    compact = inferprof_exports(scen, per_export=2000, compact=256)
    paths = {
        "generation": [e.SerializeToString() for e in gen],
        "generation, compact steps": [e.SerializeToString() for e in compact],
        "generation, no steps": [e.SerializeToString() for e in no_steps],
        "baseline": [_strip(e).SerializeToString() for e in gen],
    }
    n_tokens = sum(r.output for r in scen.requests)
    n_spans = sum(len(ss.spans) for e in gen for rs in e.resource_spans
                  for ss in rs.scope_spans)
    return paths, n_tokens, n_spans


def run_once(bodies: list[bytes]) -> float:
    gc.collect()
    t0 = time.process_time()
    engine = Engine(settle_s=0.0, retention_s=float("inf"), max_pending_spans=10_000_000)
    for body in bodies:
        engine.ingest_traces(ExportTraceServiceRequest.FromString(body))
    engine.flush()
    engine.breakdown("llm", window_s=None)
    return time.process_time() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per request (about)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu", type=int, default=0, help="core to pin to (-1: no pinning)")
    args = ap.parse_args(argv)
    if args.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    paths, n_tokens, n_spans = build(args.requests, args.tokens)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, bodies in paths.items():
            times[name].append(run_once(bodies))
    base = times["baseline"]
    print(f"{args.requests} requests, {n_tokens} generated tokens, {n_spans} spans "
          f"(step spans included); medians of {args.rounds} rounds, one core\n")
    print("| path | CPU s | µs per token | µs per span | x baseline |")
    print("|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        ratio = statistics.median(t / b for t, b in zip(ts, base, strict=True))
        print(f"| {name} | {med:.3f} | {med / n_tokens * 1e6:.2f} | "
              f"{med / n_spans * 1e6:.2f} | {ratio:.2f} |")
    extra = statistics.median(t - b for t, b in zip(times["generation"], base, strict=True))
    print(f"\ngeneration's extra CPU over the baseline: {extra / n_tokens * 1e6:.2f} µs per "
          "generated token")


if __name__ == "__main__":
    main()
