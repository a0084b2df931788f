"""What inferprof costs a saturated model server: one command, one table.

    python3 benchmarks/overhead.py [--rounds 10] [--duration 4] [--concurrency 32]
                                   [--rate R]  # open loop at R req/s instead of saturation
                                   [--out docs/overhead.md]

The demo service (FastAPI + dynamic batcher + real tokenizer + numpy model, see
docs/demo.md) runs under uvicorn on 127.0.0.1, one long-lived process per configuration:

  (a) none        uninstrumented: no telemetry code at all; the same batching algorithm
                  as inferprof's DynamicBatcher (inferprof/demo/plain_batcher.py)
  (b) otel        opentelemetry-instrumentation-fastapi alone, exporting OTLP/gRPC
  (c) full        inferprof, every stage of every request traced and exported
  (d) production  inferprof production mode (stage timings of every request, a
                  tail-biased weighted sample of full traces exported)
  (e) off         inferprof installed and called everywhere, configured off
  (c') full, exporter down        and        (d') production, exporter down

(b)-(d) export to an OTLP/gRPC sink in this process that counts and drops what it
receives; (c')/(d') point at a closed port, so every export fails.

How the figures are made precise on a small, shared machine:

* **Pinning.** With two or more CPUs the services run on CPU 0 and this process, its
  sink and the load generator on CPU 1, so client and server never compete for a core
  and the server is CPU-bound on exactly one core (throughput is then the inverse of
  its CPU per request, and the two columns must agree).
* **Interleaving.** All services start up front and stay up (an idle one costs
  nothing); each round measures every configuration once, in an order rotated from
  round to round, so drift (other tenants, thermal) hits all of them alike. Ratios to
  (a) are taken *within* a round and the table gives the median ratio over rounds and
  its interquartile range: a ratio whose range straddles 1.00 is not measurable here.
* **CPU per request** is the service process's utime+stime delta (``/proc/<pid>/stat``;
  every thread of it, exporter and span processor included) over a measurement,
  divided by the requests completed in it.
* **Same batching.** ``/healthz`` of the demo reports batches run and requests batched;
  the table shows the mean batch size of each configuration.
* **What was exported.** For inferprof configurations ``/healthz`` also reports
  inferprof's own counters: the fraction of traces kept and spans emitted, exported and
  dropped per request (with the exporter down, everything is dropped and counted).
* **Memory.** VmRSS after warm-up and after the last round; with the exporter down,
  a flat RSS shows the bounded queue at work.

The service runs with one BLAS thread (see ``inferprof/demo/processes.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
import urllib.request
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferprof import semconv
from inferprof.demo.processes import ServiceProcess, run_loadgen
from inferprof.demo.service import HEALTH_PATH
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
    # fields[11], fields[12] are utime, stime (the 14th and 15th fields of the whole line);
    # they include threads that have exited.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def health(base_url: str) -> dict:
    with urllib.request.urlopen(base_url + HEALTH_PATH, timeout=10) as resp:
        return json.loads(resp.read())


@dataclass
class Config:
    key: str
    label: str
    instrumentation: str
    exporter: str  # "sink", "down" or "-"
    service: ServiceProcess | None = None
    runs: list[dict] = field(default_factory=list)
    rss_start: int = 0
    rss_end: int = 0
    telemetry_end: dict | None = None


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


_TELEMETRY_KEYS = ("spans_emitted", "spans_exported", "spans_dropped_queue_full",
                   "spans_dropped_export_failed", "traces_kept", "traces_discarded")


def measure(service: ServiceProcess, duration: float, concurrency: int, seed: int,
            rate: float | None = None) -> dict:
    pid = service.pid
    h0 = health(service.base_url)
    cpu0 = cpu_seconds(pid)
    if rate is not None:  # open loop: latency at a given load, not at saturation
        summary = run_loadgen(service.url, duration_s=duration, rate=rate, seed=seed)
    else:
        summary = run_loadgen(service.url, duration_s=duration, concurrency=concurrency,
                              seed=seed)
    cpu = cpu_seconds(pid) - cpu0
    h1 = health(service.base_url)
    n = max(summary["requests"], 1)
    batches = h1["batches"] - h0["batches"]
    run = {
        "rps": summary["throughput_rps"],
        "p50": summary["latency_s"]["p50"],
        "p99": summary["latency_s"]["p99"],
        "cpu_per_req": cpu / n,
        "errors": summary["errors"],
        "requests": summary["requests"],
        "batch_mean": (h1["batched_requests"] - h0["batched_requests"]) / batches
        if batches else float("nan"),
    }
    t0, t1 = h0.get("telemetry"), h1.get("telemetry")
    if t0 and t1:
        run.update({k: t1[k] - t0[k] for k in _TELEMETRY_KEYS})
    return run


def med(values: list[float]) -> float:
    values = [v for v in values if v is not None and v == v]
    return statistics.median(values) if values else float("nan")


def quartiles(values: list[float]) -> tuple[float, float]:
    values = sorted(v for v in values if v == v)
    if len(values) < 4:
        return (values[0], values[-1]) if values else (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def paired_ratios(c: Config, base: Config, key: str) -> list[float]:
    return [r[key] / b[key] for r, b in zip(c.runs, base.runs) if r[key] and b[key]]


def _fmt_ratio(values: list[float]) -> str:
    lo, hi = quartiles(values)
    return f"{med(values):.3f} ({lo:.2f}-{hi:.2f})"


def table(cfgs: list[Config], args: argparse.Namespace, sink_spans: int, pinned: bool) -> str:
    base = cfgs[0]
    load = (f"open loop, {args.rate:g} req/s" if args.rate is not None
            else f"closed loop, {args.concurrency} clients")
    lines = [
        (f"Demo service on 127.0.0.1 (model `{args.model_size}`, batch <= "
         f"{args.max_batch_size}); {load}; {args.rounds} "
         f"interleaved rounds x {args.duration:g} s per configuration. {os.cpu_count()} "
         f"CPU(s), {'service pinned to CPU 0, client to CPU 1' if pinned else 'not pinned'}; "
         f"Python {sys.version.split()[0]}. Figures: median over rounds; `x (a)`: median of "
         f"the per-round ratios to (a), with their interquartile range in brackets."),
        "",
        ("| config | throughput (req/s) | x (a) | client p50 (ms) | x (a) | client p99 (ms) "
         "| x (a) | service CPU / req (ms) | x (a) | mean batch |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cfgs:
        lines.append(
            f"| ({c.key}) {c.label} "
            f"| {med([r['rps'] for r in c.runs]):.0f} | {_fmt_ratio(paired_ratios(c, base, 'rps'))} "
            f"| {med([r['p50'] for r in c.runs]) * 1e3:.1f} "
            f"| {_fmt_ratio(paired_ratios(c, base, 'p50'))} "
            f"| {med([r['p99'] for r in c.runs]) * 1e3:.1f} "
            f"| {_fmt_ratio(paired_ratios(c, base, 'p99'))} "
            f"| {med([r['cpu_per_req'] for r in c.runs]) * 1e3:.3f} "
            f"| {_fmt_ratio(paired_ratios(c, base, 'cpu_per_req'))} "
            f"| {med([r['batch_mean'] for r in c.runs]):.2f} |"
        )
    lines += [
        "",
        ("| config | errors | traces kept | spans emitted / req | spans exported / req "
         "| spans dropped (queue full + export failed) | RSS after warm-up -> end (MiB) |"),
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cfgs:
        errors = sum(r["errors"] for r in c.runs)
        reqs = sum(r["requests"] for r in c.runs) or 1
        if "spans_emitted" in c.runs[0]:
            tot = {k: sum(r[k] for r in c.runs) for k in _TELEMETRY_KEYS}
            traces = tot["traces_kept"] + tot["traces_discarded"]
            kept = f"{tot['traces_kept'] / traces:.1%}" if traces else "-"
            tel = (f"{kept} | {tot['spans_emitted'] / reqs:.2f} "
                   f"| {tot['spans_exported'] / reqs:.2f} "
                   f"| {tot['spans_dropped_queue_full']} + {tot['spans_dropped_export_failed']}")
        else:
            tel = "- | - | - | -"
        lines.append(f"| ({c.key}) {c.label} | {errors} | {tel} "
                     f"| {c.rss_start / 2**20:.1f} -> {c.rss_end / 2**20:.1f} |")
    lines += ["", (f"Spans received by the local sink: {sink_spans}. Spans exported are counted "
                   "by inferprof when the exporter reports success; the last partial export "
                   "batch of a round may land in the next round.")]
    return "\n".join(lines)


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=4.0,
                        help="seconds per measurement (default 4)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="interleaved rounds, each measuring every configuration once")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rate", type=float,
                        help="open loop at this many requests/s (Poisson arrivals) instead "
                             "of the closed loop: latency at a load below saturation")
    parser.add_argument("--warmup", type=float, default=3.0,
                        help="seconds of load per service before the first round")
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--only", help="comma-separated configuration keys, e.g. a,d,e "
                        "(a is always included: it is the reference)")
    parser.add_argument("--no-endpoint-down", action="store_true",
                        help="skip the exporter-down configurations")
    parser.add_argument("--no-pin", action="store_true", help="do not pin CPUs")
    parser.add_argument("--out", help="also write the tables to this Markdown file")
    args = parser.parse_args(argv)

    cfgs = configs(not args.no_endpoint_down)
    if args.only:
        keep = {"a", *(k.strip() for k in args.only.split(","))}
        cfgs = [c for c in cfgs if c.key in keep]
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2 and not args.no_pin
    server_cpu, client_cpu = (cpus[0], cpus[1]) if pinned else (None, None)
    original = os.sched_getaffinity(0)

    with NullSink() as sink, ExitStack() as stack:
        down = closed_port_endpoint()
        for c in cfgs:
            endpoint = {"sink": sink.endpoint, "down": down}.get(c.exporter)
            settings = DemoSettings(
                instrumentation=c.instrumentation, model_size=args.model_size,
                max_batch_size=args.max_batch_size, endpoint=endpoint,
                service_name=f"overhead-{c.instrumentation}",
            )
            # Nothing but the endpoint we chose: no OTLP env from the caller's shell.
            extra = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint or down}
            # The child (and every thread it ever starts) inherits the affinity it is
            # started with, so the service is pinned from its first instruction.
            _pin(server_cpu)
            try:
                c.service = stack.enter_context(ServiceProcess(settings, extra_env=extra))
            finally:
                _pin(client_cpu)
            print(f"started ({c.key}) {c.label}", file=sys.stderr)
        for c in cfgs:
            assert c.service is not None
            run_loadgen(c.service.url, duration_s=args.warmup, concurrency=args.concurrency)
            c.rss_start = rss_bytes(c.service.pid)
        for rnd in range(args.rounds):
            shift = rnd % len(cfgs)
            for c in cfgs[shift:] + cfgs[:shift]:
                assert c.service is not None
                run = measure(c.service, args.duration, args.concurrency, seed=rnd,
                              rate=args.rate)
                run["round"] = rnd
                c.runs.append(run)
                print(f"round {rnd + 1}/{args.rounds} ({c.key}) {run['rps']:.0f} req/s, "
                      f"p99 {run['p99'] * 1e3:.0f} ms, cpu/req {run['cpu_per_req'] * 1e3:.3f} "
                      f"ms, batch {run['batch_mean']:.2f}", file=sys.stderr)
            for c in cfgs:  # keep each config's runs in round order for pairing
                c.runs.sort(key=lambda r: r["round"])
        time.sleep(1.0)
        for c in cfgs:
            assert c.service is not None
            c.rss_end = rss_bytes(c.service.pid)
        report = table(cfgs, args, sink.spans, pinned)
    os.sched_setaffinity(0, original)
    print(report)
    if args.out:
        cmd = "python3 benchmarks/overhead.py " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
        Path(args.out).write_text(f"Command: `{cmd.strip()}`\n\n{report}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
