"""What inferprof costs the LLM demo: throughput and client p99 ITL, ``production`` and
``full`` against ``off``, measured in the same run.

    python3 benchmarks/llm_overhead.py [--rounds 4] [--duration 10] [--concurrency 16]

The LLM demo service (docs/demo.md, "The LLM demo") under uvicorn on 127.0.0.1, driven by
the streaming load generator (closed loop, httpx, the default prompt and output mixes).
Each round starts a fresh service process per configuration, in a rotated order, warms
it with at least ``--warmup-requests`` requests (128: past the 64 during which
``production``'s tail sampler keeps every trace, so that the figures are its steady
state), and runs the load for ``--duration`` seconds. inferprof's configurations export
OTLP/gRPC to an inferprof collector in the benchmark process (which folds what it
receives, as a deployment's would); ``off`` configures inferprof with ``mode="off"``
(the middleware, the step API and the stages all present and returning at once). The
service processes run the inferprof of this checkout (``PYTHONPATH``), not whichever one
is installed.

The KV cache defaults to 1024 blocks so the engine does not evict: evictions depend on
timing and would add their own variance to the figures (``--kv-blocks 96`` runs the
demo's default, eviction-bound set-up). Per configuration: output tokens per second and
requests per second (client side), client TTFT p50/p99 and ITL p50/p99, and the service
process's CPU time per output token (``/proc/<pid>/stat``, all threads: the model, the
event loop, the exporter), which other load on the machine moves less than throughput;
ratios to ``off`` are medians of per-round ratios; and the spans the collector received
per request (step spans included). Targets (issue 22): throughput >= 0.97x,
client p99 ITL <= 1.05x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))

from inferprof.collector.app import CollectorApp  # noqa: E402
from inferprof.collector.settings import CollectorSettings  # noqa: E402
from inferprof.demo.llm.processes import LLMServiceProcess, run_llm_loadgen  # noqa: E402
from inferprof.demo.llm.settings import LLMSettings  # noqa: E402

CONFIGS = ("off", "production", "full")
BASELINE = "off"
#: Warm-up load runs per process at most (each ``--warmup`` seconds).
_MAX_WARMUP_RUNS = 8
#: Longer than the span exporter's schedule delay (1 s).
_EXPORT_DRAIN_S = 1.5


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(mode: str, collector: CollectorApp, args: argparse.Namespace, seed: int) -> dict:
    settings = LLMSettings(instrumentation=mode, endpoint=collector.otlp_grpc_endpoint,
                           kv_blocks=args.kv_blocks, model_size=args.model_size)
    # the service runs this checkout's inferprof, as this process does
    with LLMServiceProcess(settings, extra_env={"PYTHONPATH": _code_path()}) as svc:
        warm = 0
        for i in range(_MAX_WARMUP_RUNS):
            if warm >= args.warmup_requests and i:
                break
            warm += run_llm_loadgen(svc.url, duration_s=args.warmup,
                                    concurrency=args.concurrency,
                                    seed=seed + 1000 * (i + 1))["requests"]
        time.sleep(_EXPORT_DRAIN_S)  # the warm-up's spans leave before the count starts
        spans = _spans_received(collector)
        cpu = _cpu_s(svc.pid)
        summary = run_llm_loadgen(svc.url, duration_s=args.duration,
                                  concurrency=args.concurrency, seed=seed)
        cpu = _cpu_s(svc.pid) - cpu
    # the service has flushed its spans on the way out
    summary["spans_per_request"] = (
        (_spans_received(collector) - spans) / max(summary["requests"], 1))
    summary["cpu_ms_per_token"] = 1e3 * cpu / max(summary["output_tokens"], 1)
    summary["warmup_requests"] = warm
    return summary


def _code_path() -> str:
    path = os.environ.get("PYTHONPATH")
    return str(_ROOT) + (os.pathsep + path if path else "")


def _spans_received(collector: CollectorApp) -> int:
    collector.engine.flush()
    return collector.engine.stats.spans_received


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load")
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
    collector = CollectorApp(CollectorSettings(grpc_port=0, http_port=0, api_port=0)).start()
    results: dict[str, list[dict]] = {c: [] for c in configs}
    started = time.monotonic()
    try:
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for mode in order:
                summary = _measure(mode, collector, args, seed=r)
                results[mode].append(summary)
                print(f"round {r + 1}/{args.rounds} {mode:<10} "
                      f"{summary['tokens_per_s']:7.1f} tokens/s  "
                      f"cpu {summary['cpu_ms_per_token']:.3f} ms/token  "
                      f"itl p99 {summary['itl_s']['p99'] * 1e3:7.1f} ms  "
                      f"spans/request {summary['spans_per_request']:5.1f}  "
                      f"errors {summary['errors']}", file=sys.stderr, flush=True)
    finally:
        collector.stop()
    print(_table(results, configs, args, time.monotonic() - started))
    return 0


def _ratio(results: dict[str, list[dict]], mode: str, get) -> float:
    return statistics.median(get(m) / get(b) for m, b in zip(results[mode], results[BASELINE]))


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
        (f"LLM demo, {args.rounds} rounds x {args.duration:g} s, closed loop of "
         f"{args.concurrency} streams, model {args.model_size}, KV cache {args.kv_blocks} "
         f"blocks ({elapsed / 60:.1f} min); medians over rounds, ratios to `{BASELINE}` are "
         "medians of per-round ratios"),
        "",
        ("| mode | tokens/s | x off | req/s | ttft p50 ms | ttft p99 ms | itl p50 ms "
         "| itl p99 ms | itl p99 x off | service CPU ms/token | x off | spans/request "
         "| errors |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in configs:
        lines.append(
            f"| {mode} | {med(mode, tps):.1f} | {_ratio(results, mode, tps):.3f} "
            f"| {med(mode, rps):.2f} "
            f"| {med(mode, lambda s: s['ttft_s']['p50']) * 1e3:.1f} "
            f"| {med(mode, lambda s: s['ttft_s']['p99']) * 1e3:.1f} "
            f"| {med(mode, lambda s: s['itl_s']['p50']) * 1e3:.2f} "
            f"| {med(mode, itl99) * 1e3:.2f} | {_ratio(results, mode, itl99):.3f} "
            f"| {med(mode, cpu):.3f} | {_ratio(results, mode, cpu):.3f} "
            f"| {med(mode, lambda s: s['spans_per_request']):.1f} "
            f"| {sum(s['errors'] for s in results[mode])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
