"""What inferprof costs a saturated model server: one command, one table.

    python3 benchmarks/overhead.py [--duration 8] [--reps 5] [--concurrency 32]
                                   [--out docs/overhead.md]

The demo service (FastAPI + dynamic batcher + real tokenizer + numpy model, see
docs/demo.md) runs under uvicorn on 127.0.0.1, one process per configuration:

  (a) none        uninstrumented: no telemetry code at all (a plain batcher)
  (b) otel        opentelemetry-instrumentation-fastapi alone, exporting OTLP/gRPC
  (c) full        inferprof, every stage of every request traced
  (d) production  inferprof production mode
  (e) off         inferprof installed and called, but configured off
  (c') full, exporter down        and        (d') production, exporter down

(b)-(d) export to a local OTLP/gRPC sink in this process that counts and drops what
it receives; (c')/(d') point at a closed port, so every export fails and retries.
Every configuration gets the same closed-loop load from the demo's load generator
(a separate process) for ``--duration`` seconds, repeated ``--reps`` times with the
configurations interleaved, so drift (thermal, other tenants) hits all of them
alike; the table shows medians. CPU per request is the service process's
utime+stime delta (``/proc/<pid>/stat``) over the load phase divided by completed
requests: it counts every thread of the server, exporters included. Each
measurement gets a fresh service process (started, warmed up, measured, stopped),
so a configuration's background work (an exporter retrying) never lands on
another's figures. RSS growth is VmRSS after the measurement minus VmRSS after
warm-up (median over repetitions). The service runs with one BLAS thread (see
``inferprof/demo/processes.py``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferprof import semconv
from inferprof.demo.processes import ServiceProcess, run_loadgen
from inferprof.demo.settings import (
    INSTRUMENTATION_NONE,
    INSTRUMENTATION_OTEL,
    DemoSettings,
)

_CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- a null OTLP sink ---------------------------------------------------------------------

class NullSink:
    """OTLP/gRPC traces + metrics receiver that counts and discards."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import (
            metrics_service_pb2,
            metrics_service_pb2_grpc,
        )
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        sink = self
        self.spans = 0
        self._lock = threading.Lock()

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with sink._lock:
                    sink.spans += n
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> NullSink:  # noqa: PYI034
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None).wait()


def closed_port_endpoint() -> str:
    """An endpoint nothing listens on (bound then released, so it is free and closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- measurements ---------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # fields[11], fields[12] are utime, stime (the 14th and 15th fields of the whole line).
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Config:
    key: str
    label: str
    instrumentation: str
    exporter: str  # "sink", "down" or "-"
    service: ServiceProcess | None = None
    runs: list[dict] = field(default_factory=list)


def configs(endpoint_down: bool) -> list[Config]:
    out = [
        Config("a", "uninstrumented", INSTRUMENTATION_NONE, "-"),
        Config("b", "OTel FastAPI only", INSTRUMENTATION_OTEL, "sink"),
        Config("c", "inferprof full", semconv.MODE_FULL, "sink"),
        Config("d", "inferprof production", semconv.MODE_PRODUCTION, "sink"),
        Config("e", "inferprof off", semconv.MODE_OFF, "-"),
    ]
    if endpoint_down:
        out += [
            Config("c'", "inferprof full, exporter down", semconv.MODE_FULL, "down"),
            Config("d'", "inferprof production, exporter down", semconv.MODE_PRODUCTION, "down"),
        ]
    return out


def measure(cfg: Config, duration: float, concurrency: int, seed: int) -> dict:
    assert cfg.service is not None
    pid = cfg.service.pid
    cpu0 = cpu_seconds(pid)
    summary = run_loadgen(cfg.service.url, duration_s=duration, concurrency=concurrency, seed=seed)
    cpu = cpu_seconds(pid) - cpu0
    n = max(summary["requests"], 1)
    return {
        "rps": summary["throughput_rps"],
        "p50": summary["latency_s"]["p50"],
        "p99": summary["latency_s"]["p99"],
        "cpu_per_req": cpu / n,
        "errors": summary["errors"],
    }


def med(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else float("nan")


def table(cfgs: list[Config], args: argparse.Namespace, sink_spans: int) -> str:
    base = {k: med(cfgs[0].runs, k) for k in ("rps", "p50", "p99", "cpu_per_req")}
    lines = [
        (f"Demo service saturated on 127.0.0.1 (model `{args.model_size}`, batch <= "
         f"{args.max_batch_size}); closed loop, {args.concurrency} clients, {args.duration:g} s x "
         f"{args.reps} interleaved repetitions; medians. {os.cpu_count()} CPU(s); Python "
         f"{sys.version.split()[0]}."),
        "",
        ("| config | exporter | throughput (req/s) | x (a) | client p50 (ms) | x (a) "
         "| client p99 (ms) | x (a) | service CPU / req (ms) | range | x (a) | errors "
         "| RSS growth (MiB) |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cfgs:
        m = {k: med(c.runs, k) for k in ("rps", "p50", "p99", "cpu_per_req")}
        errors = sum(r["errors"] for r in c.runs)
        growth = med(c.runs, "rss_growth") / 2**20
        lo, hi = min(r["cpu_per_req"] for r in c.runs), max(r["cpu_per_req"] for r in c.runs)
        lines.append(
            f"| ({c.key}) {c.label} | {c.exporter} | {m['rps']:.0f} | {m['rps'] / base['rps']:.2f} "
            f"| {m['p50'] * 1e3:.1f} | {m['p50'] / base['p50']:.2f} "
            f"| {m['p99'] * 1e3:.1f} | {m['p99'] / base['p99']:.2f} "
            f"| {m['cpu_per_req'] * 1e3:.2f} | {lo * 1e3:.2f}-{hi * 1e3:.2f} "
            f"| {m['cpu_per_req'] / base['cpu_per_req']:.2f} "
            f"| {errors} | {growth:+.1f} |"
        )
    lines += ["", (f"Spans received by the local sink: {sink_spans}. `range`: the lowest and "
                   "highest CPU per request over the repetitions; ratios within that spread of "
                   "1.00 are noise, not overhead.")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="seconds of load before measuring")
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--no-endpoint-down", action="store_true",
                        help="skip the exporter-down configurations")
    parser.add_argument("--out", help="also write the table to this Markdown file")
    args = parser.parse_args(argv)

    cfgs = configs(not args.no_endpoint_down)
    with NullSink() as sink:
        down = closed_port_endpoint()
        # A fresh service process per measurement, one at a time: an idle service whose
        # exporter is still retrying would otherwise steal CPU from the one being measured.
        for rep in range(args.reps):
            for c in cfgs:
                endpoint = {"sink": sink.endpoint, "down": down}.get(c.exporter)
                settings = DemoSettings(
                    instrumentation=c.instrumentation, model_size=args.model_size,
                    max_batch_size=args.max_batch_size, endpoint=endpoint,
                    service_name=f"overhead-{c.instrumentation}",
                )
                # Nothing but the endpoint we chose: no OTLP env from the caller's shell.
                extra = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint or down}
                with ServiceProcess(settings, extra_env=extra) as service:
                    c.service = service
                    # warm-up: caches, allocator, exporter connections
                    run_loadgen(service.url, duration_s=args.warmup, concurrency=args.concurrency)
                    rss0 = rss_bytes(service.pid)
                    run = measure(c, args.duration, args.concurrency, seed=rep)
                    run["rss_growth"] = rss_bytes(service.pid) - rss0
                    c.runs.append(run)
                    c.service = None
                print(f"rep {rep + 1}/{args.reps} ({c.key}) {run['rps']:.0f} req/s, "
                      f"p99 {run['p99'] * 1e3:.0f} ms, cpu/req {run['cpu_per_req'] * 1e3:.2f} ms",
                      file=sys.stderr)
        time.sleep(0.5)
        report = table(cfgs, args, sink.spans)
    print(report)
    if args.out:
        Path(args.out).write_text("# inferprof overhead\n\nMeasured with `python3 benchmarks/"
                                  "overhead.py`; see `benchmarks/README.md`.\n\n" + report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
