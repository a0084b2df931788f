"""How often the service's threads are switched out, per request: OTLP/gRPC against OTLP/HTTP.

    python3 benchmarks/context_switches.py [--rounds 2] [--duration 5]

The demo service (``small`` model) under saturated closed-loop load, pinned to CPU 0 as in
``overhead.py``, in four configurations: uninstrumented, inferprof ``off``, and
``production`` exporting OTLP/gRPC and OTLP/HTTP to a local sink. Per request, from
``/proc/<pid>/task/*/status``: voluntary and involuntary context switches of the event
loop (the main thread), of the model's thread (the busiest other thread), and wake-ups of
the gRPC client's native threads (``event_engine``, ``grpc_global_tim``...). Involuntary
switches are preemptions: on a core shared by the event loop and the model, each costs
the preempted thread its caches. Ratios are to ``off`` in the same round; the table gives
medians over rounds. See docs/overhead.md, "The exporter's threads".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import NullSink, _pin

from inferprof._config import PROTOCOL_GRPC, PROTOCOL_HTTP
from inferprof.demo.processes import ServiceProcess, run_loadgen
from inferprof.demo.settings import DemoSettings

_GRPC_THREADS = ("event_engine", "grpc_global_tim", "lifeguard", "resolver", "default-executo")


def threads(pid: int) -> dict[int, tuple[str, int, int, int]]:
    """tid -> (name, voluntary switches, involuntary switches, CPU ticks)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            name = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        vol = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        invol = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[int(task.name)] = (name, vol, invol, int(stat[11]) + int(stat[12]))
    return out


@dataclass
class Config:
    key: str
    instrumentation: str
    protocol: str | None = None
    rows: list[dict[str, float]] = field(default_factory=list)


def measure(c: Config, sink: NullSink, args: argparse.Namespace, cpus: tuple) -> dict:
    endpoint = None
    extra = {}
    if c.protocol:
        endpoint = sink.http_endpoint if c.protocol == PROTOCOL_HTTP else sink.endpoint
        extra = {"OTEL_EXPORTER_OTLP_PROTOCOL": c.protocol, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    settings = DemoSettings(instrumentation=c.instrumentation, endpoint=endpoint)
    _pin(cpus[0])  # the service and all its threads inherit CPU 0
    try:
        service = ServiceProcess(settings, extra_env=extra).__enter__()
    finally:
        _pin(cpus[1])
    try:
        pid = service.pid
        run_loadgen(service.url, duration_s=args.warmup, concurrency=args.concurrency)
        before = threads(pid)
        summary = run_loadgen(service.url, duration_s=args.duration, concurrency=args.concurrency)
        after = threads(pid)
    finally:
        service.__exit__(None, None, None)
    n = max(summary["requests"], 1)
    delta = {tid: (name, v - before[tid][1], iv - before[tid][2], t - before[tid][3])
             for tid, (name, v, iv, t) in after.items() if tid in before}
    main = delta.pop(pid)
    model = max((d for d in delta.values() if not d[0].startswith(_GRPC_THREADS)),
                key=lambda d: d[3])
    grpc = [d for d in delta.values() if d[0].startswith(_GRPC_THREADS)]
    return {
        "rps": summary["throughput_rps"],
        "loop_vol": main[1] / n, "loop_invol": main[2] / n,
        "model_vol": model[1] / n, "model_invol": model[2] / n,
        "grpc_wakeups": sum(d[1] + d[2] for d in grpc) / n,
        "threads": len(after),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    pinned = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    configs = [Config("uninstrumented", "none"), Config("off", "off"),
               Config("production, OTLP/gRPC", "production", PROTOCOL_GRPC),
               Config("production, OTLP/HTTP", "production", PROTOCOL_HTTP)]
    with NullSink() as sink:
        for r in range(args.rounds):
            for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                c.rows.append(measure(c, sink, args, pinned))
                print(f"round {r + 1}/{args.rounds} {c.key}: {c.rows[-1]['rps']:.0f} req/s",
                      file=sys.stderr)
    base = configs[1]
    cols = [("loop_invol", "event loop, involuntary"), ("loop_vol", "event loop, voluntary"),
            ("model_invol", "model thread, involuntary"), ("model_vol", "model thread, voluntary"),
            ("grpc_wakeups", "gRPC threads' switches")]
    print(f"Context switches per request (medians of {args.rounds} rounds x {args.duration:g} s, "
          f"closed loop, {args.concurrency} clients; service pinned to CPU {pinned[0]}); "
          f"`x off`: median of per-round ratios to inferprof `off`.\n")
    print("| config | req/s | threads | " + " | ".join(f"{t} | x off" for _, t in cols) + " |")
    print("|---|---:|---:|" + "---:|---:|" * len(cols))
    for c in configs:
        cells = [f"{statistics.median(r['rps'] for r in c.rows):.0f}",
                 f"{statistics.median(r['threads'] for r in c.rows):.0f}"]
        for key, _ in cols:
            value = statistics.median(r[key] for r in c.rows)
            ratios = [r[key] / b[key] for r, b in zip(c.rows, base.rows) if b[key]]
            cells += [f"{value:.3f}", f"{statistics.median(ratios):.2f}" if ratios else "-"]
        print(f"| {c.key} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
