"""Soak: the default collector under sustained load at 25%, 50% and 75% of its capacity.

    python3 benchmarks/collector_soak.py                  # capacity, then 3 levels x 5 min
    python3 benchmarks/collector_soak.py --minutes 2      # shorter levels (still past the
                                                          # 60 s trace timeout)

``inferprof collect`` with its default settings (ports aside) as a subprocess on
127.0.0.1. First its capacity, in the same run: ``--senders`` processes send OTLP/HTTP
exports (``--requests`` requests of 4 spans each: a SERVER span and three stage spans,
as ``collector_http_ingest.py`` builds them, every trace distinct) back to back for
``--capacity-s`` seconds; capacity = spans answered 200 per second, after a warm-up.
Then, each level with a fresh collector, the senders offer that fraction of it in an open
loop (an export refused with 429 is counted and not retried) for ``--minutes``, long
enough for folded traces to pass the 60 s trace timeout and be forgotten, while

* a probe exports one small request every second and times the answer;
* a scraper times ``GET /metrics`` every second;
* the collector's RSS is read from /proc every second.

Each level ends with SIGTERM under load, timed until the process exits. Prints the
capacity, a table per level (whole level) and, per level, the same figures per minute.
Targets (issue 20): no probe over 1 s, refusals under 1% at 50%, flat RSS.
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collector_http_ingest import build_export

SPANS_PER_REQUEST = 4
_MARKER = bytes.fromhex("5eed5eed5eed5eed")


class Exports:
    """Serialized exports of distinct traces: one template whose trace ids start with a
    marker, replaced per export by (sender, counter) (a protobuf build per export would
    cost the sender more than the collector)."""

    def __init__(self, requests: int, sender: int) -> None:
        template = build_export(requests, 0)
        for rs in template.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    span.trace_id = _MARKER + span.trace_id[8:]
        self.body = template.SerializeToString()
        self.sender = sender
        self.count = 0
        self.spans = requests * SPANS_PER_REQUEST

    def next(self) -> bytes:
        self.count += 1
        prefix = (self.sender << 40 | self.count).to_bytes(8, "big")
        return self.body.replace(_MARKER, prefix)


def _post(conn: http.client.HTTPConnection, body: bytes) -> int:
    conn.request("POST", "/v1/traces", body=body,
                 headers={"Content-Type": "application/x-protobuf"})
    resp = conn.getresponse()
    resp.read()
    return resp.status


def sender(index: int, port: int, requests: int, rate: float, seconds: float,
           results: mp.Queue) -> None:
    """Open loop at ``rate`` exports/s (0: back to back) for ``seconds``; puts
    (ok spans, refused exports, other failures, exports sent, ok spans after warm-up)."""
    exports = Exports(requests, index + 1)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    ok = refused = failed = sent = ok_late = 0
    start = time.monotonic()
    warm = start + min(5.0, seconds / 4)
    end = start + seconds
    next_t = start
    while True:
        now = time.monotonic()
        if now >= end:
            break
        if rate:
            if next_t > now:
                time.sleep(next_t - now)
            next_t = max(next_t + 1.0 / rate, time.monotonic() - 1.0)  # no burst past 1 s
        try:
            status = _post(conn, exports.next())
        except (OSError, http.client.HTTPException):
            failed += 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            continue
        sent += 1
        if status == 200:
            ok += exports.spans
            if time.monotonic() >= warm:
                ok_late += exports.spans
        elif status == 429:
            refused += 1
        else:
            failed += 1
    results.put((ok, refused, failed, sent, ok_late, time.monotonic() - warm))


class Collector:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from inferprof.cli import main; main()", "collect",
             "--grpc-port", "0", "--http-port", "0", "--api-port", "0",
             "--log-level", "WARNING"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        ports: dict[str, int] = {}
        while len(ports) < 3:  # the lines it prints once every listener accepts
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the collector exited: {self.proc.wait()}")
            m = re.match(r"(OTLP/gRPC|OTLP/HTTP|API)\s+\S+:(\d+)", line)
            if m:
                ports[m.group(1)] = int(m.group(2))
        self.http_port, self.api_port = ports["OTLP/HTTP"], ports["API"]
        # Keep reading its output, so that it never blocks on a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as fh:
            m = re.search(r"VmRSS:\s+(\d+) kB", fh.read())
        return int(m.group(1)) / 1024 if m else float("nan")

    def stop(self) -> float:
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return float("inf")
        return time.monotonic() - started


def run_senders(port: int, n: int, requests: int, rate: float, seconds: float) -> list[tuple]:
    results: mp.Queue = mp.Queue()
    procs = [mp.Process(target=sender, args=(i, port, requests, rate / n, seconds, results))
             for i in range(n)]
    for p in procs:
        p.start()
    out = [results.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    return out


def capacity(args: argparse.Namespace) -> tuple[float, float]:
    collector = Collector()
    try:
        res = run_senders(collector.http_port, args.senders, args.requests, 0.0, args.capacity_s)
    finally:
        collector.stop()
    spans = sum(r[4] for r in res)
    seconds = statistics.mean(r[5] for r in res)
    sent = sum(r[3] for r in res)
    return spans / seconds, (sum(r[1] for r in res) / sent if sent else 0.0)


def q(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def level(args: argparse.Namespace, fraction: float, cap: float) -> dict:
    collector = Collector()
    seconds = args.minutes * 60
    samples: list[tuple[float, str, float, int]] = []  # (t, kind, value, status)
    stop = threading.Event()
    t0 = time.monotonic()
    probe = Exports(1, 999)

    def probe_loop() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", collector.http_port, timeout=30)
        while not stop.wait(1.0):
            started = time.monotonic()
            try:
                status = _post(conn, probe.next())
            except (OSError, http.client.HTTPException):
                status = 0
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", collector.http_port, timeout=30)
            samples.append((started - t0, "probe", time.monotonic() - started, status))

    def scrape_loop() -> None:
        while not stop.wait(1.0):
            started = time.monotonic()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", collector.api_port, timeout=30)
                conn.request("GET", "/metrics")
                resp = conn.getresponse()
                resp.read()
                status = resp.status
                conn.close()
            except (OSError, http.client.HTTPException):
                status = 0
            samples.append((started - t0, "scrape", time.monotonic() - started, status))
            samples.append((started - t0, "rss", collector.rss_mib(), 0))

    threads = [threading.Thread(target=probe_loop, daemon=True),
               threading.Thread(target=scrape_loop, daemon=True)]
    for t in threads:
        t.start()
    rate = fraction * cap / (args.requests * SPANS_PER_REQUEST)
    res: list[tuple] = []
    runner = threading.Thread(target=lambda: res.extend(
        run_senders(collector.http_port, args.senders, args.requests, rate, seconds)))
    runner.start()
    runner.join(timeout=seconds - 5)  # SIGTERM while the load still runs
    loaded_s = time.monotonic() - t0
    shutdown_s = collector.stop()
    stop.set()
    runner.join()
    for t in threads:
        t.join(timeout=60)
    sent = sum(r[3] for r in res)
    return {
        "fraction": fraction,
        "offered": rate * args.requests * SPANS_PER_REQUEST,
        "accepted": sum(r[0] for r in res) / loaded_s,
        # exports sent after SIGTERM fail (connection refused): not refusals
        "refused": sum(r[1] for r in res) / sent if sent else float("nan"),
        "failed": sum(r[2] for r in res),
        "samples": samples,
        "shutdown_s": shutdown_s,
    }


def summary(samples: list, kind: str) -> str:
    values = [v for _, k, v, _ in samples if k == kind]
    return (f"{q(values, 0.5) * 1e3:.0f} / {q(values, 0.99) * 1e3:.0f} / "
            f"{max(values, default=float('nan')) * 1e3:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="per level")
    parser.add_argument("--levels", default="0.25,0.5,0.75")
    parser.add_argument("--capacity-s", type=float, default=30.0)
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--requests", type=int, default=100, help="requests per export")
    args = parser.parse_args()
    mp.set_start_method("fork")
    print(f"`python3 benchmarks/collector_soak.py --minutes {args.minutes:g} --levels "
          f"{args.levels} --capacity-s {args.capacity_s:g} --senders {args.senders} "
          f"--requests {args.requests}` on {os.cpu_count()} CPUs\n")
    cap, cap_refused = capacity(args)
    print(f"Capacity: {cap:,.0f} spans/s answered 200 with {args.senders} senders back to back "
          f"({cap_refused:.1%} of exports refused with 429)\n", flush=True)
    results = []
    for fraction in (float(f) for f in args.levels.split(",")):
        results.append(level(args, fraction, cap))
        r = results[-1]
        print(f"level {fraction:.0%} done: shutdown {r['shutdown_s']:.1f} s", flush=True)
    print("\n| load | offered spans/s | accepted spans/s | refused (429) | probe p50 / p99 / "
          "max (ms) | /metrics p50 / p99 / max (ms) | RSS start → end (max) MiB | "
          "SIGTERM to exit |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        rss = [(t, v) for t, k, v, _ in r["samples"] if k == "rss"]
        rss_text = (f"{rss[0][1]:.0f} → {rss[-1][1]:.0f} ({max(v for _, v in rss):.0f})"
                    if rss else "-")
        print(f"| {r['fraction']:.0%} | {r['offered']:,.0f} | {r['accepted']:,.0f} | "
              f"{r['refused']:.2%} | {summary(r['samples'], 'probe')} | "
              f"{summary(r['samples'], 'scrape')} | {rss_text} | {r['shutdown_s']:.1f} s |")
    for r in results:
        print(f"\nLoad {r['fraction']:.0%}, per minute:\n")
        print("| minute | probe p50 / p99 / max (ms) | probes refused | /metrics p50 / p99 / "
              "max (ms) | RSS (MiB, end of minute) |")
        print("|---:|---:|---:|---:|---:|")
        minutes = int(max((t for t, *_ in r["samples"]), default=0) // 60) + 1
        for m in range(minutes):
            part = [s for s in r["samples"] if m * 60 <= s[0] < (m + 1) * 60]
            probes = [s for s in part if s[1] == "probe"]
            refused = sum(1 for s in probes if s[3] != 200)
            rss = [v for _, k, v, _ in part if k == "rss"]
            print(f"| {m + 1} | {summary(part, 'probe')} | {refused} / {len(probes)} | "
                  f"{summary(part, 'scrape')} | {rss[-1] if rss else float('nan'):.0f} |")


if __name__ == "__main__":
    main()
