"""What inferprof costs a saturated model server: one command, one table.

    python3 benchmarks/overhead.py [--rounds 10] [--duration 4] [--concurrency 32]
                                   [--rate R]  # open loop at R req/s instead of saturation
                                   [--out docs/overhead.md]

The demo service (FastAPI + dynamic batcher + real tokenizer + numpy model, see
docs/demo.md) runs under uvicorn on 127.0.0.1, one process per configuration (fresh each
round), importing this checkout's inferprof (first on its ``PYTHONPATH``, whichever one
the interpreter has installed):

  (a) none        uninstrumented: no telemetry code at all; the same batching algorithm
                  as inferprof's DynamicBatcher (inferprof/demo/plain_batcher.py)
  (a2) none       the control: a second, identical uninstrumented process. Its ratios to
                  (a) are what this machine's noise alone produces; a configuration is
                  distinguishable from (a) only by more than that
  (b) otel        opentelemetry-instrumentation-fastapi alone, exporting OTLP/gRPC
  (c) full        inferprof, every stage of every request traced and exported
  (d) production  inferprof production mode, its defaults: summaries of every request
                  (untimed ones with their stage times); up to 10 requests a second
                  timed on such a route (100 on others; a random share above that),
                  and a tail-biased weighted sample of their full traces exported
  (d1) production inferprof production mode timing every request
                  (INFERPROF_MAX_TIMED_RATE=0): what (d) was before the timing budget
  (d2) production inferprof production mode with the requests the budget leaves untimed
                  only counted, not summarised with their stages
                  (INFERPROF_UNTIMED_STAGES=false): what (d) was before untimed_stages
  (d3) production inferprof production mode timing the routes whose untimed requests are
                  summarised at max_timed_rate (100 a second) too
                  (INFERPROF_MAX_TIMED_RATE_SUMMARISED=0): what (d) was before
                  max_timed_rate_summarised
  (e) off         inferprof installed and called everywhere, configured off
  (dx) production (with ``--compare-with DIR``) (d) again, the service importing the
                  inferprof source tree at DIR (another checkout) instead of this one: two
                  versions of the code side by side in the same run, the same rounds
                  (DIR's demo must take this one's settings: a checkout of the same wave)
  (c') full, exporter down        and        (d') production, exporter down

(b)-(d) export to an OTLP sink in this process that counts and drops what it receives:
(b) over gRPC, as its users run it; inferprof's configurations over OTLP/HTTP, its
recommended production protocol (``--protocol grpc`` for gRPC). (c')/(d') point at a
closed port, so every export fails.

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
* **Same batching, same model work.** ``/healthz`` of the demo reports batches run,
  requests batched and padded tokens; the table shows the mean batch size and padded
  tokens per request of each configuration. The model's weights are page-aligned
  (``inferprof/demo/model.py``): without that, two processes of the same service ran
  the same model up to 4% apart, depending on where numpy happened to put them.
  The model computes in a reused, page-aligned workspace (``inferprof/demo/model.py``):
  fresh activations every batch page-faulted back in (the table's page-fault column) as
  often as every other allocation in the process let them, and ran at whatever
  alignment the allocator gave them.
* **Latency quantiles are pooled**: every request's latency of every round, per
  configuration (a 4 s round at saturation holds only ~15 requests above its p99).
* **Uncertainty**: ``[lo, hi]`` is a 90% bootstrap interval over rounds (rounds resampled
  with replacement, the statistic recomputed). Throughput and CPU ratios are medians of
  per-round paired ratios; p50/p99 ratios are ratios of pooled quantiles.
* **What was exported.** For inferprof configurations ``/healthz`` also reports
  inferprof's own counters: the fraction of traces kept and spans emitted, exported and
  dropped per request (with the exporter down, everything is dropped and counted).
* **Memory.** VmRSS after warm-up and at the end (the last round's processes, or with
  ``--same-processes`` the processes of every round); with the exporter down,
  a flat RSS shows the bounded queue at work.

The service runs with one BLAS thread (see ``inferprof/demo/processes.py``).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from inferprof import semconv
from inferprof._config import ENV_MAX_TIMED_RATE, PROTOCOL_GRPC, PROTOCOL_HTTP
from inferprof.demo.processes import ServiceProcess, run_loadgen
from inferprof.demo.service import HEALTH_PATH
from inferprof.demo.settings import (
    INSTRUMENTATION_NONE,
    INSTRUMENTATION_OTEL,
    DemoSettings,
)

_CLK_TCK = os.sysconf("SC_CLK_TCK")
#: This checkout: the services import its inferprof (and its demo), first on their path,
#: whichever one the interpreter has installed (an editable install of another worktree)
ROOT = str(Path(__file__).resolve().parents[1])
#: Timed requests an inferprof service has served before it is measured: past the 64 of
#: the tail sampler's warm-up (``sampling._DEFAULT_WARMUP``), during which it keeps every
#: trace; ``WARM_MAX_S`` seconds of load at most
WARM_TIMED = 80
WARM_MAX_S = 30.0


# --- a null OTLP sink ---------------------------------------------------------------------

class NullSink:
    """OTLP/gRPC traces + metrics receiver that keeps the raw bytes and answers at once.

    It shares the client's CPU, so it must cost the client nothing measurable: requests
    are not deserialized while the benchmark runs (a gRPC handler without deserializer
    gets the bytes); their spans are counted once, at the end (:meth:`spans`).
    """

    _TRACES = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    _METRICS = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"

    def __init__(self) -> None:
        import grpc

        self._payloads: list[bytes] = []
        empty = b""  # an empty Export*ServiceResponse

        def traces(request: bytes, context: object) -> bytes:
            self._payloads.append(request)  # list.append: atomic under the GIL
            return empty

        def metrics(request: bytes, context: object) -> bytes:
            return empty

        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.unary_unary_rpc_method_handler(traces)},
        )
        metrics_handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.metrics.v1.MetricsService",
            {"Export": grpc.unary_unary_rpc_method_handler(metrics)},
        )
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                   handlers=[handler, metrics_handler])
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"
        self._http = _http_sink(self._payloads)
        #: OTLP/HTTP (protobuf) base endpoint: ``/v1/traces`` kept, ``/v1/metrics`` answered
        self.http_endpoint = f"http://127.0.0.1:{self._http.server_address[1]}"

    @property
    def spans(self) -> int:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        total = 0
        for payload in list(self._payloads):
            req = ExportTraceServiceRequest.FromString(payload)
            total += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        return total

    def __enter__(self) -> NullSink:  # noqa: PYI034
        self._server.start()
        threading.Thread(target=self._http.serve_forever, name="sink-http", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None).wait()
        self._http.shutdown()
        self._http.server_close()


def _http_sink(payloads: list[bytes]) -> http.server.ThreadingHTTPServer:
    """OTLP/HTTP receiver on 127.0.0.1:<ephemeral> that keeps ``/v1/traces`` bodies unparsed."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's requests session expects

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/v1/traces":
                payloads.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:  # no line per export
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    return server


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
    #: extra environment of the service
    env: dict = field(default_factory=dict)


def _service_path() -> str:
    """The services' ``PYTHONPATH``: this checkout, then the caller's."""
    return os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


def configs(endpoint_down: bool, compare_with: str | None = None) -> list[Config]:
    out = [
        Config("a", "uninstrumented", INSTRUMENTATION_NONE, "-"),
        Config("a2", "uninstrumented, second process (control)", INSTRUMENTATION_NONE, "-"),
        Config("b", "OTel FastAPI only", INSTRUMENTATION_OTEL, "sink"),
        Config("c", "inferprof full", semconv.MODE_FULL, "sink"),
        Config("d", "inferprof production", semconv.MODE_PRODUCTION, "sink"),
        Config("d1", "inferprof production, every request timed", semconv.MODE_PRODUCTION,
               "sink", env={ENV_MAX_TIMED_RATE: "0"}),
        Config("d2", "inferprof production, untimed requests only counted",
               semconv.MODE_PRODUCTION, "sink", env={"INFERPROF_UNTIMED_STAGES": "false"}),
        Config("d3", "inferprof production, summarised routes timed at max_timed_rate",
               semconv.MODE_PRODUCTION, "sink",
               env={"INFERPROF_MAX_TIMED_RATE_SUMMARISED": "0"}),
        Config("e", "inferprof off", semconv.MODE_OFF, "-"),
    ]
    if compare_with:
        path = os.pathsep.join(p for p in (compare_with, _service_path()) if p)
        out.append(Config("dx", f"inferprof production, the code at {compare_with}",
                          semconv.MODE_PRODUCTION, "sink", env={"PYTHONPATH": path}))
    if endpoint_down:
        out += [
            Config("c'", "inferprof full, exporter down", semconv.MODE_FULL, "down"),
            Config("d'", "inferprof production, exporter down", semconv.MODE_PRODUCTION, "down"),
        ]
    return out


_TELEMETRY_KEYS = ("spans_emitted", "spans_exported", "spans_dropped_queue_full",
                   "spans_dropped_export_failed", "traces_kept", "traces_discarded",
                   "requests_untimed", "requests_summarised", "summaries_dropped",
                   "requests_untimed_counted", "requests_untimed_summarised")


def measure(service: ServiceProcess, duration: float, concurrency: int, seed: int,
            rate: float | None = None) -> dict:
    pid = service.pid
    h0 = health(service.base_url)
    cpu0 = cpu_seconds(pid)
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as lat_file:
        extra = ["--latencies-out", lat_file.name]
        if rate is not None:  # open loop: latency at a given load, not at saturation
            summary = run_loadgen(service.url, duration_s=duration, rate=rate, seed=seed,
                                  extra_args=extra)
        else:
            summary = run_loadgen(service.url, duration_s=duration, concurrency=concurrency,
                                  seed=seed, extra_args=extra)
        cpu = cpu_seconds(pid) - cpu0
        latencies = np.loadtxt(lat_file.name, ndmin=1)
    h1 = health(service.base_url)
    n = max(summary["requests"], 1)
    batches = h1["batches"] - h0["batches"]
    batched = h1["batched_requests"] - h0["batched_requests"]
    run = {
        "rps": summary["throughput_rps"],
        "p50": summary["latency_s"]["p50"],
        "p99": summary["latency_s"]["p99"],
        "latencies": latencies,
        "cpu_per_req": cpu / n,
        "errors": summary["errors"],
        "requests": summary["requests"],
        "batch_mean": batched / batches if batches else float("nan"),
        "padded_per_req": (h1["padded_tokens"] - h0["padded_tokens"]) / batched
        if batched else float("nan"),
        "faults_per_req": (h1.get("minor_faults", 0) - h0.get("minor_faults", 0)) / n,
        # the garbage collector's runs per 1 000 requests, by generation
        "gc_per_kreq": [(b - a) / n * 1000 for a, b in
                        zip(h0.get("gc_collections", ()), h1.get("gc_collections", ()))],
        # ... and the time it ran, µs per request, all generations
        "gc_us_per_req": (sum(h1.get("gc_seconds", ())) - sum(h0.get("gc_seconds", ()))) / n * 1e6,
        "thread_us_per_req": {
            name: (cpu_s - h0.get("thread_cpu_s", {}).get(name, 0.0)) / n * 1e6
            for name, cpu_s in h1.get("thread_cpu_s", {}).items()
        },
    }
    t0, t1 = h0.get("telemetry"), h1.get("telemetry")
    if t0 and t1:
        run.update({k: t1.get(k, 0) - t0.get(k, 0) for k in _TELEMETRY_KEYS})
    return run


def med(values: list[float]) -> float:
    values = [v for v in values if v is not None and v == v]
    return statistics.median(values) if values else float("nan")


_BOOTSTRAP = 2000
_INTERVAL = (5.0, 95.0)  # a 90% interval


def paired_ratio(c: Config, base: Config, key: str) -> tuple[float, float, float]:
    """Median over rounds of c's per-round ``key`` over base's, with a bootstrap interval."""
    ratios = np.array([r[key] / b[key] for r, b in zip(c.runs, base.runs) if r[key] and b[key]])
    if not len(ratios):
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(ratios), size=(_BOOTSTRAP, len(ratios)))
    lo, hi = np.percentile(np.median(ratios[picks], axis=1), _INTERVAL)
    return float(np.median(ratios)), float(lo), float(hi)


def pooled_quantile_ratio(c: Config, base: Config, q: float) -> tuple[float, float, float]:
    """c's quantile ``q`` of every latency of its rounds over base's, with a bootstrap
    interval (the same resampled rounds for both: they were measured side by side)."""
    rounds = min(len(c.runs), len(base.runs))

    def ratio(idx: np.ndarray) -> float:
        a = np.concatenate([c.runs[i]["latencies"] for i in idx])
        b = np.concatenate([base.runs[i]["latencies"] for i in idx])
        return float(np.quantile(a, q) / np.quantile(b, q))

    rng = np.random.default_rng(1)
    boots = [ratio(rng.integers(0, rounds, size=rounds)) for _ in range(_BOOTSTRAP // 4)]
    lo, hi = np.percentile(boots, _INTERVAL)
    return ratio(np.arange(rounds)), float(lo), float(hi)


def pooled_quantile(c: Config, q: float) -> float:
    return float(np.quantile(np.concatenate([r["latencies"] for r in c.runs]), q))


def _fmt(ratio: tuple[float, float, float]) -> str:
    mid, lo, hi = ratio
    return f"{mid:.3f} [{lo:.3f}, {hi:.3f}]"


def table(cfgs: list[Config], args: argparse.Namespace, sink_spans: int, pinned: bool) -> str:
    base = cfgs[0]
    load = (f"open loop, {args.rate:g} req/s" if args.rate is not None
            else f"closed loop, {args.concurrency} clients")
    lines = [
        (f"Demo service on 127.0.0.1 (model `{args.model_size}`, batch <= "
         f"{args.max_batch_size}); {load}; {args.rounds} "
         f"interleaved rounds x {args.duration:g} s per configuration. {os.cpu_count()} "
         f"CPU(s), {'service pinned to CPU 0, client to CPU 1' if pinned else 'not pinned'}; "
         f"Python {sys.version.split()[0]}; services "
         f"{'without' if args.no_gc_freeze else 'with'} gc.freeze() after start-up, "
         f"young-GC threshold {args.gc_threshold or 'left at 700'}; inferprof exports "
         f"OTLP/{'HTTP' if args.protocol == PROTOCOL_HTTP else 'gRPC'}. "
         f"`x (a)`: throughput and CPU, the median over rounds of the per-round ratio to "
         f"(a); p50 and p99, the ratio of the quantiles of all rounds' latencies pooled. `[lo, hi]`: 90% bootstrap interval over rounds. "
         f"(a2), a second uninstrumented process, shows the noise floor."),
        "",
        ("| config | throughput (req/s) | x (a) | service CPU / req (ms) | x (a) "
         "| client p50 (ms) | x (a) | client p99 (ms) | x (a) | mean batch "
         "| padded tokens / req | page faults / req |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cfgs:
        lines.append(
            f"| ({c.key}) {c.label} "
            f"| {med([r['rps'] for r in c.runs]):.0f} | {_fmt(paired_ratio(c, base, 'rps'))} "
            f"| {med([r['cpu_per_req'] for r in c.runs]) * 1e3:.3f} "
            f"| {_fmt(paired_ratio(c, base, 'cpu_per_req'))} "
            f"| {pooled_quantile(c, 0.5) * 1e3:.1f} "
            f"| {_fmt(pooled_quantile_ratio(c, base, 0.5))} "
            f"| {pooled_quantile(c, 0.99) * 1e3:.1f} "
            f"| {_fmt(pooled_quantile_ratio(c, base, 0.99))} "
            f"| {med([r['batch_mean'] for r in c.runs]):.2f} "
            f"| {med([r['padded_per_req'] for r in c.runs]):.1f} "
            f"| {med([r['faults_per_req'] for r in c.runs]):.1f} |"
        )
    off = next((c for c in cfgs if c.key == "e"), None)
    recording = [c for c in cfgs if c.instrumentation in (semconv.MODE_FULL,
                                                          semconv.MODE_PRODUCTION)]
    if off is not None and recording:
        lines += [
            "",
            ("Against (e), inferprof installed but off (the same batcher and middleware "
             "stack: what recording and exporting add):"),
            "",
            "| config | throughput x (e) | CPU / req x (e) | p50 x (e) | p99 x (e) |",
            "|---|---:|---:|---:|---:|",
        ]
        for c in recording:
            lines.append(
                f"| ({c.key}) {c.label} | {_fmt(paired_ratio(c, off, 'rps'))} "
                f"| {_fmt(paired_ratio(c, off, 'cpu_per_req'))} "
                f"| {_fmt(pooled_quantile_ratio(c, off, 0.5))} "
                f"| {_fmt(pooled_quantile_ratio(c, off, 0.99))} |"
            )
    lines += [
        "",
        ("| config | errors | requests timed | requests counted by summaries (timed + untimed) "
         "| traces kept (of those timed) "
         "| spans emitted / req | spans exported / req "
         "| spans dropped (queue full + export failed) | RSS after warm-up -> end (MiB) |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cfgs:
        errors = sum(r["errors"] for r in c.runs)
        reqs = sum(r["requests"] for r in c.runs) or 1
        if "spans_emitted" in c.runs[0]:
            tot = {k: sum(r[k] for r in c.runs) for k in _TELEMETRY_KEYS}
            traces = tot["traces_kept"] + tot["traces_discarded"]
            kept = f"{tot['traces_kept'] / traces:.1%}" if traces else "-"
            served = traces + tot["requests_untimed"]
            timed = f"{traces / served:.1%}" if served else "-"
            counted = (tot["requests_summarised"] + tot["requests_untimed_counted"]
                       - tot["summaries_dropped"])
            summed = f"{counted / served:.1%}" if served else "-"
            tel = (f"{timed} | {summed} | {kept} | {tot['spans_emitted'] / reqs:.2f} "
                   f"| {tot['spans_exported'] / reqs:.2f} "
                   f"| {tot['spans_dropped_queue_full']} + {tot['spans_dropped_export_failed']}")
        else:
            tel = "- | - | - | - | - | -"
        lines.append(f"| ({c.key}) {c.label} | {errors} | {tel} "
                     f"| {c.rss_start / 2**20:.1f} -> {c.rss_end / 2**20:.1f} |")
    lines += ["", *thread_table(cfgs)]
    lines += ["", (f"Spans received by the local sink: {sink_spans}. Spans exported are counted "
                   "by inferprof when the exporter reports success; the last partial export "
                   "batch of a round may land in the next round.")]
    return "\n".join(lines)


def thread_table(cfgs: list[Config]) -> list[str]:
    """Service CPU per request by thread (medians over rounds), from the demo's /healthz."""
    names: dict[str, float] = {}
    for c in cfgs:
        for r in c.runs:
            for name, us in r.get("thread_us_per_req", {}).items():
                names[name] = max(names.get(name, 0.0), us)
    shown = [n for n, us in sorted(names.items(), key=lambda kv: -kv[1]) if us >= 0.5]
    if not shown:
        return []
    lines = [
        "Service CPU per request by thread (µs, median over rounds; `native`: threads Python "
        "did not start, such as gRPC's), and the garbage collector's runs per 1 000 requests "
        "by generation and the time it ran per request, all threads (median over rounds):",
        "",
        "| config | " + " | ".join(shown)
        + " | GC runs / 1 000 req (gen 0 / 1 / 2) | GC µs / req |",
        "|---|" + "---:|" * len(shown) + "---:|---:|",
    ]
    for c in cfgs:
        cells = [med([r.get("thread_us_per_req", {}).get(n, 0.0) for r in c.runs])
                 for n in shown]
        gc_runs = [med([r["gc_per_kreq"][g] for r in c.runs if len(r.get("gc_per_kreq", ())) > g])
                   for g in range(3)]
        gc_us = med([r.get("gc_us_per_req", float("nan")) for r in c.runs])
        lines.append(f"| ({c.key}) {c.label} | " + " | ".join(f"{v:.1f}" for v in cells)
                     + " | " + " / ".join(f"{v:.2f}" for v in gc_runs) + f" | {gc_us:.1f} |")
    return lines


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
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="seconds of load per service before it is measured")
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--only", help="comma-separated configuration keys, e.g. d,e "
                        "(a, the reference, and a2, the control, are always included)")
    parser.add_argument("--no-control", action="store_true",
                        help="skip (a2), the second uninstrumented process")
    parser.add_argument("--no-endpoint-down", action="store_true",
                        help="skip the exporter-down configurations")
    parser.add_argument("--no-pin", action="store_true", help="do not pin CPUs")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="services do not gc.freeze() after start-up (see docs/overhead.md)")
    parser.add_argument("--gc-threshold", type=int, default=DemoSettings().gc_threshold,
                        help="young-generation GC threshold every service sets after "
                             "start-up (default %(default)s; 0 leaves CPython's 700; see "
                             "docs/overhead.md)")
    parser.add_argument("--protocol", choices=(PROTOCOL_HTTP, PROTOCOL_GRPC), default=PROTOCOL_HTTP,
                        help="OTLP protocol of inferprof's configurations (default "
                             "http/protobuf, the recommended production setting; see "
                             "docs/overhead.md. (b) always exports OTLP/gRPC)")
    parser.add_argument("--same-processes", action="store_true",
                        help="start each service once and keep it for every round (faster; "
                             "process-to-process differences then stay in the ratios)")
    parser.add_argument("--compare-with", metavar="DIR",
                        help="also run (dx): (d) with the inferprof source tree at DIR (a "
                             "folder holding the inferprof package, e.g. another checkout) "
                             "first on the service's path")
    parser.add_argument("--out", help="also write the tables to this Markdown file")
    args = parser.parse_args(argv)
    compare_with = None
    if args.compare_with:
        compare_with = os.path.abspath(args.compare_with)
        if not os.path.isfile(os.path.join(compare_with, "inferprof", "__init__.py")):
            parser.error(f"--compare-with: no inferprof package in {compare_with}")

    cfgs = configs(not args.no_endpoint_down, compare_with)
    if args.only:
        keep = {"a", "a2", *(k.strip() for k in args.only.split(","))}
        if compare_with:
            keep.add("dx")
        cfgs = [c for c in cfgs if c.key in keep]
    if args.no_control:
        cfgs = [c for c in cfgs if c.key != "a2"]
    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2 and not args.no_pin
    server_cpu, client_cpu = (cpus[0], cpus[1]) if pinned else (None, None)
    original = os.sched_getaffinity(0)

    with NullSink() as sink:
        down = closed_port_endpoint()

        def start(c: Config, stack: ExitStack) -> None:
            # inferprof's configurations use --protocol; (b) is the SDK's gRPC exporter
            protocol = args.protocol if c.instrumentation not in (
                INSTRUMENTATION_NONE, INSTRUMENTATION_OTEL) else PROTOCOL_GRPC
            live = sink.http_endpoint if protocol == PROTOCOL_HTTP else sink.endpoint
            endpoint = {"sink": live, "down": down}.get(c.exporter)
            settings = DemoSettings(
                instrumentation=c.instrumentation, model_size=args.model_size,
                max_batch_size=args.max_batch_size, endpoint=endpoint,
                service_name=f"overhead-{c.instrumentation}",
                gc_freeze=not args.no_gc_freeze, gc_threshold=args.gc_threshold,
            )
            # Nothing but the endpoint we chose: no OTLP env from the caller's shell.
            extra = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint or down,
                     "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "PYTHONPATH": _service_path(),
                     **c.env}
            # The child (and every thread it ever starts) inherits the affinity it is
            # started with, so the service is pinned from its first instruction.
            _pin(server_cpu)
            try:
                c.service = stack.enter_context(ServiceProcess(settings, extra_env=extra))
            finally:
                _pin(client_cpu)
            young = health(c.service.base_url)["gc_threshold"][0]
            if args.gc_threshold and young != args.gc_threshold:
                raise SystemExit(f"({c.key}) runs with young-GC threshold {young}, "
                                 f"not {args.gc_threshold}")

        def warm(c: Config) -> None:
            assert c.service is not None
            run_loadgen(c.service.url, duration_s=args.warmup, concurrency=args.concurrency)
            # An inferprof service is measured in its steady state: past its tail
            # sampler's warm-up, which keeps every timed request's trace until it has seen
            # 64 (at saturation the timing budget times some 8-10 a second, so a fresh
            # process needs about 8 s of load for that)
            deadline = time.monotonic() + WARM_MAX_S
            while c.instrumentation == semconv.MODE_PRODUCTION and time.monotonic() < deadline:
                tel = health(c.service.base_url).get("telemetry")
                if not tel or tel.get("traces_kept", 0) + tel.get("traces_discarded", 0) >= WARM_TIMED:
                    break
                run_loadgen(c.service.url, duration_s=1.0, concurrency=args.concurrency)

        with ExitStack() as long_lived:
            if args.same_processes:
                for c in cfgs:
                    start(c, long_lived)
                    warm(c)
                    c.rss_start = rss_bytes(c.service.pid)
            for rnd in range(args.rounds):
                with ExitStack() as this_round:
                    if not args.same_processes:
                        # Fresh processes every round: where a process's code and data
                        # land in memory (ASLR, hash seeds, the allocator) moves its speed
                        # by a few percent for its whole life, so one process per
                        # configuration would be a sample of one. Restarting turns that
                        # into round-to-round noise, which the intervals then include.
                        for c in cfgs:
                            start(c, this_round)
                        for c in cfgs:
                            warm(c)
                            c.rss_start = rss_bytes(c.service.pid)  # the last round's stays
                    shift = rnd % len(cfgs)
                    for c in cfgs[shift:] + cfgs[:shift]:
                        assert c.service is not None
                        run = measure(c.service, args.duration, args.concurrency, seed=rnd,
                                      rate=args.rate)
                        run["round"] = rnd
                        c.runs.append(run)
                        print(f"round {rnd + 1}/{args.rounds} ({c.key}) {run['rps']:.0f} req/s, "
                              f"p99 {run['p99'] * 1e3:.0f} ms, cpu/req "
                              f"{run['cpu_per_req'] * 1e3:.3f} ms, batch {run['batch_mean']:.2f}",
                              file=sys.stderr)
                    for c in cfgs:  # keep each config's runs in round order for pairing
                        c.runs.sort(key=lambda r: r["round"])
                    if not args.same_processes and rnd == args.rounds - 1:
                        time.sleep(1.0)
                        for c in cfgs:
                            c.rss_end = rss_bytes(c.service.pid)
            if args.same_processes:
                time.sleep(1.0)
                for c in cfgs:
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
