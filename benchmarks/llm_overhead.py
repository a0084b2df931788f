"""What inferprof costs the LLM demo: throughput and client p99 ITL, ``production`` and
``full`` against ``off``, measured in the same run.

    python3 benchmarks/llm_overhead.py [--rounds 3] [--slices 8] [--duration 5]
                                       [--concurrency 16]
                                       [--only off,off-control,production,production-http,full]

The LLM demo service (docs/demo.md, "The LLM demo") under uvicorn on 127.0.0.1, driven by
the streaming load generator (closed loop, httpx, the default prompt and output mixes).
Each round starts a fresh service process per configuration, each exporting OTLP/gRPC to
an inferprof collector of its own in the benchmark process (which folds what it receives,
as a deployment's would); ``production-http`` is ``production`` exporting OTLP/HTTP
(``http/protobuf``, the recommended production setting of docs/overhead.md) instead of
gRPC; ``off`` configures inferprof with ``mode="off"`` (the middleware, the step API and
the stages all present and returning at once); ``off-control`` is a second, identical
``off`` process, whose ratios to ``off`` show what two processes of one configuration read
apart (the noise floor of the other ratios); ``production-sink`` is ``production``
exporting to a null sink in the benchmark process (overhead.py's: it keeps the bytes and
decodes nothing during the load) instead of a collector: the difference between the two
is what the collector's folding, on the same two cores as the service and the load
generator, costs the measurement rather than the service. The service
processes run the inferprof of this checkout (``PYTHONPATH``), not whichever one is
installed. Every process is warmed with at least ``--warmup-requests`` requests (128: past
the 64 during which ``production``'s tail sampler keeps every trace, so that the figures
are its steady state); then the round runs ``--slices`` slices of ``--duration`` seconds
of load per configuration, one configuration at a time, interleaved (rotated), so that
each slice of a configuration is within seconds of ``off``'s slice of the same number:
on a machine shared with other work, whose load moves throughput by up to 3x over
minutes, the per-slice ratios are what resolves a few percent.

The KV cache defaults to 1024 blocks so the engine does not evict: evictions depend on
timing and would add their own variance to the figures (``--kv-blocks 96`` runs the
demo's default, eviction-bound set-up). Per configuration: output tokens per second and
requests per second (client side), client TTFT p50/p99 and ITL p50/p99, and the service
process's CPU time per output token (``/proc/<pid>/stat``, all threads: the model, the
event loop, the exporter), which other load on the machine moves less than throughput:
medians over all slices; ratios to ``off`` are medians of the per-slice ratios; and the
spans the collector received per request (step spans included). Targets (issue 22):
throughput >= 0.97x, client p99 ITL <= 1.05x.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))

sys.path.insert(0, str(_ROOT / "benchmarks"))

from overhead import NullSink  # noqa: E402

from inferprof.collector.app import CollectorApp  # noqa: E402
from inferprof.collector.settings import CollectorSettings  # noqa: E402
from inferprof.demo.llm.processes import LLMServiceProcess, run_llm_loadgen  # noqa: E402
from inferprof.demo.llm.settings import LLMSettings  # noqa: E402

CONFIGS = ("off", "off-control", "production", "production-http", "production-sink", "full")
#: Configuration -> (inferprof mode, OTLP protocol of its exporter). ``off-control`` is a
#: second ``off`` process: its ratios to ``off`` are what separate processes of the same
#: configuration read apart on this machine, the noise floor of the others' ratios.
_WIRING = {
    "off": ("off", "grpc"),
    "off-control": ("off", "grpc"),
    "production": ("production", "grpc"),
    "production-http": ("production", "http/protobuf"),
    "production-sink": ("production", "grpc"),
    "full": ("full", "grpc"),
}
#: Configurations exporting to a null sink in this process (it keeps the bytes, decodes
#: nothing while the load runs) instead of a collector of their own: the same service,
#: without the collector's folding on this machine's cores beside it.
_SINKED = {"production-sink"}
BASELINE = "off"
#: Warm-up load runs per process at most (each ``--warmup`` seconds).
_MAX_WARMUP_RUNS = 8
#: Longer than the span exporter's schedule delay (1 s).
_EXPORT_DRAIN_S = 1.5
_BOOTSTRAP = 2000


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _round(configs: list[str], args: argparse.Namespace, r: int) -> dict[str, list[dict]]:
    """One round: a fresh service per configuration (each exporting to a collector of its
    own), all warmed, then ``--slices`` slices of load per configuration, interleaved."""
    with contextlib.ExitStack() as stack:
        collectors: dict[str, Any] = {
            c: stack.enter_context(NullSink() if c in _SINKED else
                                   CollectorApp(CollectorSettings(grpc_port=0, http_port=0,
                                                                  api_port=0)))
            for c in configs}
        services = {}
        for c in configs:
            mode, protocol = _WIRING[c]
            http = protocol == "http/protobuf"
            settings = LLMSettings(instrumentation=mode,
                                   endpoint=_endpoint(collectors[c], http),
                                   kv_blocks=args.kv_blocks, model_size=args.model_size)
            # the service runs this checkout's inferprof, as this process does
            services[c] = stack.enter_context(
                LLMServiceProcess(settings, extra_env={"PYTHONPATH": _code_path(),
                                                       "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}))
        warm = {c: _warm(services[c], args, seed=r) for c in configs}
        time.sleep(_EXPORT_DRAIN_S)  # the warm-up's spans leave before the count starts
        spans = {c: _spans_received(collectors[c]) for c in configs}
        slices: dict[str, list[dict]] = {c: [] for c in configs}
        for k in range(args.slices):
            # rotated, so that no configuration always follows another
            shift = (r * args.slices + k) % len(configs)
            for c in configs[shift:] + configs[:shift]:
                svc = services[c]
                cpu = _cpu_s(svc.pid)
                summary = run_llm_loadgen(svc.url, duration_s=args.duration,
                                          concurrency=args.concurrency,
                                          seed=r * args.slices + k)
                cpu = _cpu_s(svc.pid) - cpu
                summary["cpu_ms_per_token"] = 1e3 * cpu / max(summary["output_tokens"], 1)
                summary["warmup_requests"] = warm[c]
                slices[c].append(summary)
                print(f"round {r + 1}/{args.rounds} slice {k + 1}/{args.slices} {c:<10} "
                      f"{summary['tokens_per_s']:7.1f} tokens/s  "
                      f"cpu {summary['cpu_ms_per_token']:.3f} ms/token  "
                      f"itl p99 {summary['itl_s']['p99'] * 1e3:7.1f} ms  "
                      f"errors {summary['errors']}  load {os.getloadavg()[0]:.1f}",
                      file=sys.stderr, flush=True)
        for c in configs:
            services[c].close()  # flushes its spans on the way out
            received = _spans_received(collectors[c]) - spans[c]
            requests = sum(s["requests"] for s in slices[c])
            for summary in slices[c]:
                summary["spans_per_request"] = received / max(requests, 1)
    return slices


def _warm(svc: LLMServiceProcess, args: argparse.Namespace, seed: int) -> int:
    warm = 0
    for i in range(_MAX_WARMUP_RUNS):
        if warm >= args.warmup_requests and i:
            break
        warm += run_llm_loadgen(svc.url, duration_s=args.warmup, concurrency=args.concurrency,
                                seed=seed + 1000 * (i + 1))["requests"]
    return warm


def _code_path() -> str:
    path = os.environ.get("PYTHONPATH")
    return str(_ROOT) + (os.pathsep + path if path else "")


def _endpoint(receiver: Any, http: bool) -> str:
    if isinstance(receiver, NullSink):
        return receiver.http_endpoint if http else receiver.endpoint
    return receiver.otlp_http_endpoint if http else receiver.otlp_grpc_endpoint


def _spans_received(receiver: Any) -> int:
    if isinstance(receiver, NullSink):
        return receiver.spans
    receiver.engine.flush()
    return receiver.engine.stats.spans_received


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slices", type=int, default=8,
                        help="slices of load per configuration and round, interleaved")
    parser.add_argument("--duration", type=float, default=5.0,
                        help="seconds of load per slice")
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="seconds per warm-up run (repeated up to --warmup-requests)")
    parser.add_argument("--warmup-requests", type=int, default=128,
                        help="requests served before the measured load, per process")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=1024)
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--only", default=",".join(CONFIGS),
                        help=f"configurations, comma-separated ({', '.join(CONFIGS)})")
    args = parser.parse_args(argv)
    configs = [c for c in args.only.split(",") if c]
    if BASELINE not in configs or any(c not in CONFIGS for c in configs):
        parser.error(f"--only must include {BASELINE} and name only {', '.join(CONFIGS)}")
    results: dict[str, list[dict]] = {c: [] for c in configs}
    started = time.monotonic()
    for r in range(args.rounds):
        # rotated, so that no configuration is always started or warmed first
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for c, slices in _round(order, args, r).items():
            results[c].extend(slices)
    print(_table(results, configs, args, time.monotonic() - started))
    return 0


def _ratio(results: dict[str, list[dict]], mode: str, get) -> float:
    return statistics.median(_ratios(results, mode, get))


def _ratios(results: dict[str, list[dict]], mode: str, get) -> list[float]:
    return [get(m) / get(b) for m, b in zip(results[mode], results[BASELINE])]


def _interval(results: dict[str, list[dict]], mode: str, get) -> str:
    """90% bootstrap interval of the median per-slice ratio."""
    ratios = _ratios(results, mode, get)
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(_BOOTSTRAP))
    return f"[{medians[_BOOTSTRAP // 20]:.3f}, {medians[_BOOTSTRAP - 1 - _BOOTSTRAP // 20]:.3f}]"


def _table(results: dict[str, list[dict]], configs: list[str], args: argparse.Namespace,
           elapsed: float) -> str:
    def med(mode: str, get) -> float:
        return statistics.median(get(s) for s in results[mode])

    def tps(s: dict) -> float:
        return s["tokens_per_s"]

    def rps(s: dict) -> float:
        return s["throughput_rps"]

    def itl99(s: dict) -> float:
        return s["itl_s"]["p99"]

    def cpu(s: dict) -> float:
        return s["cpu_ms_per_token"]

    lines = [
        (f"LLM demo, {args.rounds} rounds x {args.slices} slices x {args.duration:g} s "
         f"per configuration, closed loop of {args.concurrency} streams, model "
         f"{args.model_size}, KV cache {args.kv_blocks} blocks ({elapsed / 60:.1f} min); "
         f"medians over slices, ratios to `{BASELINE}` are medians of per-slice ratios "
         "[90% bootstrap interval]"),
        "",
        ("| mode | tokens/s | x off | req/s | ttft p50 ms | ttft p99 ms | itl p50 ms "
         "| itl p99 ms | itl p99 x off | service CPU ms/token | x off | spans/request "
         "| errors |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in configs:
        lines.append(
            f"| {mode} | {med(mode, tps):.1f} | {_ratio(results, mode, tps):.3f} "
            f"{_interval(results, mode, tps)} "
            f"| {med(mode, rps):.2f} "
            f"| {med(mode, lambda s: s['ttft_s']['p50']) * 1e3:.1f} "
            f"| {med(mode, lambda s: s['ttft_s']['p99']) * 1e3:.1f} "
            f"| {med(mode, lambda s: s['itl_s']['p50']) * 1e3:.2f} "
            f"| {med(mode, itl99) * 1e3:.2f} | {_ratio(results, mode, itl99):.3f} "
            f"{_interval(results, mode, itl99)} "
            f"| {med(mode, cpu):.3f} | {_ratio(results, mode, cpu):.3f} "
            f"{_interval(results, mode, cpu)} "
            f"| {med(mode, lambda s: s['spans_per_request']):.1f} "
            f"| {sum(s['errors'] for s in results[mode])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
