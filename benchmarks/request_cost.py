"""CPU per HTTP request of inferprof's request path, with no application work around it.

    python3 benchmarks/request_cost.py [--requests 20000] [--rounds 7]

One request = the ASGI middleware (``receive`` and ``serialize`` measured), ``tokenize``
and ``postprocess`` stages, an ``enqueue()`` into a batcher's queue: the per-request part
of what the demo service does, without the service. Configurations: no middleware at all
(``none``), and inferprof configured ``off``, ``production`` and ``full``, exporting
through ``configure()``'s own path (kept traces encoded to OTLP bytes when the request
ends and queued as bytes) into an exporter that discards them. This loop runs tens of
thousands of requests a second, so ``production``'s timing budget (100 timed a second)
leaves nearly all of them untimed: its row is the cost of a request not timed, and
``production-timed`` (``max_timed_rate=0``) that of one timed, with its summary
(contract §15, folded on the summaries' thread and exported into a metric exporter that
discards it); ``production-timed-nosum`` is the same without summaries (``summaries=False``).
``--breakdown`` adds the parts of a timed request's cost: never kept, with and without its
summary, and always kept (``BREAKDOWN``).

CPU is ``time.process_time()`` over the requests plus a flush of the export queue, so the
export thread's work is included; ``loop`` is the requesting thread's alone. Rounds are
interleaved (every configuration once per round, inferprof reconfigured each time); the
table gives medians over rounds and the extra over ``off``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.sdk.metrics.export import (  # noqa: E402
    MetricExporter,
    MetricExportResult,
)
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult  # noqa: E402

import inferprof  # noqa: E402
import inferprof.fastapi  # noqa: E402
from inferprof.batching.hooks import enqueue  # noqa: E402

#: configuration -> configure() arguments (None: no middleware)
CONFIGS: dict[str, dict | None] = {
    "none": None,
    "off": {"mode": "off"},
    "production": {"mode": "production"},
    "production-timed": {"mode": "production", "max_timed_rate": 0},
    "production-timed-nosum": {"mode": "production", "max_timed_rate": 0, "summaries": False},
    "full": {"mode": "full"},
}
MODES = tuple(CONFIGS)
#: --breakdown: the parts of a timed request's cost. Never kept (the tail sampler keeps
#: a request at or above the window's maximum only, and one in 10**9 by chance), with and
#: without its summary; and every request kept.
_NEVER_KEPT = {"mode": "production", "max_timed_rate": 0, "sample_rate": 1e-9,
               "tail_quantile": 1.0}
BREAKDOWN: dict[str, dict | None] = {
    "timed-unkept-nosum": {**_NEVER_KEPT, "summaries": False},
    "timed-unkept": _NEVER_KEPT,
    "timed-all-kept-nosum": {"mode": "production", "max_timed_rate": 0, "sample_rate": 1.0,
                             "summaries": False},
}


class DiscardEncoded(SpanExporter):
    """Takes what inferprof's OTLP exporter takes (encoded bytes) and drops it."""

    accepts_encoded = True

    def export(self, spans) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class DiscardMetrics(MetricExporter):
    """Takes the summaries' metrics and drops them."""

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


async def app(scope, receive, send) -> None:
    await receive()
    with inferprof.stage("tokenize"):
        pass
    handle = enqueue(depth=3)
    if handle.stage is not None:
        handle.stage.end = time.time_ns()  # the batch took it
    with inferprof.stage("postprocess"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b'{"label": "x"}'})


SCOPE = {"type": "http", "method": "POST", "path": "/v1/classify", "scheme": "http",
         "headers": [(b"content-type", b"application/json")]}


async def receive() -> dict:
    return {"type": "http.request", "body": b'{"text": "a prompt"}', "more_body": False}


async def send(message: dict) -> None:
    pass


async def drive(target, n: int) -> None:
    for _ in range(n):
        await target(SCOPE, receive, send)


def one_round(mode: str, n: int) -> tuple[float, float]:
    """(process CPU, requesting-thread CPU) per request, in µs."""
    target = app
    settings = CONFIGS[mode]
    if settings is not None:
        inferprof.configure(**settings, span_exporter=DiscardEncoded(), set_global=False,
                            metric_readers=[], summary_exporter=DiscardMetrics())
        target = inferprof.fastapi.InferprofMiddleware(app, model_name="m")
    # Warm up: the tail sampler's threshold, and the timing budget's request rate (in its
    # first tenth of a second, every request is timed).
    warm_until = time.monotonic() + 0.3
    while time.monotonic() < warm_until:
        asyncio.run(drive(target, 500))
    c0, t0 = time.process_time(), time.thread_time()
    asyncio.run(drive(target, n))
    loop = time.thread_time() - t0
    inferprof.shutdown()  # flushes the export queue: its CPU is part of the cost
    cpu = time.process_time() - c0
    return cpu / n * 1e6, loop / n * 1e6


def main() -> None:
    # A queue that never fills: every kept trace is built, encoded and counted.
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(1 << 22)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--breakdown", action="store_true",
                    help="also the parts of a timed request's cost (BREAKDOWN)")
    args = ap.parse_args()
    modes = MODES
    if args.breakdown:
        CONFIGS.update(BREAKDOWN)
        modes = MODES + tuple(BREAKDOWN)
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            results[mode].append(one_round(mode, args.requests))
    off = statistics.median(c for c, _ in results["off"])
    print(f"{args.requests} requests x {args.rounds} interleaved rounds; medians.\n")
    print("| configuration | CPU per request (µs) | of which the requesting thread | extra over off |")
    print("|---|---:|---:|---:|")
    for mode in modes:
        cpu = statistics.median(c for c, _ in results[mode])
        loop = statistics.median(t for _, t in results[mode])
        print(f"| {mode} | {cpu:.1f} | {loop:.1f} | {cpu - off:+.1f} |")


if __name__ == "__main__":
    main()
