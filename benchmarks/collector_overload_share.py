"""Two replicas flooding a saturated collector: how the pending-span cap is shared.

    python3 benchmarks/collector_overload_share.py [--rounds 3] [--duration 20]

Starts ``inferprof collect`` on 127.0.0.1 with a small cap (``--max-pending-spans 3000
--settle-s 2``: room for about 1 500 spans/s) and two replica processes in ``full`` mode,
one exporting OTLP/gRPC and one OTLP/HTTP, each sending ``--rate`` requests/s of 5 spans
(8 000 spans/s in all with the defaults) for ``--duration`` seconds; each round once with
the cap shared (the default) and once with ``--no-share-pending-cap`` (the baseline), in
alternating order. Prints, per run, the requests the collector folded for each replica,
their ratio (larger over smaller) and the refusals per transport, then the medians. Both
replicas keep sending whatever happens: what one loses, its exporter drops after retrying
(docs/collector.md, Backpressure).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

SENDER = r"""
import sys, time
import inferprof
proto, port, name, rate, duration = sys.argv[1:6]
rate, duration = float(rate), float(duration)
inferprof.configure(service_name=name, endpoint=f"http://127.0.0.1:{port}", protocol=proto,
                    mode="full", metric_readers=[],
                    resource_attributes={"service.instance.id": name})
t_end = time.time() + duration
next_t = time.time()
while time.time() < t_end:
    with inferprof.request(name="infer", model="m"):
        for s in ("tokenize", "queue", "compute", "postprocess"):
            with inferprof.stage(s):
                pass
    next_t += 1.0 / rate
    if next_t > time.time():
        time.sleep(next_t - time.time())
inferprof.shutdown()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def one_run(args: argparse.Namespace, share: bool) -> dict:
    grpc_port, http_port, api_port = free_port(), free_port(), free_port()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    collector = subprocess.Popen(
        [sys.executable, "-c", "import sys; from inferprof.cli import main; sys.exit(main())",
         "collect", "--grpc-port", str(grpc_port),
         "--http-port", str(http_port), "--api-port", str(api_port),
         "--max-pending-spans", str(args.cap), "--settle-s", str(args.settle_s),
         "--share-pending-cap" if share else "--no-share-pending-cap", "--log-level", "ERROR"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{api_port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                get(f"{api}/healthz")
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        senders = [
            subprocess.Popen(
                [sys.executable, "-c", SENDER, proto, str(port), name, str(args.rate),
                 str(args.duration)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            for proto, port, name in (("grpc", grpc_port, "replica-grpc"),
                                      ("http/protobuf", http_port, "replica-http"))
        ]
        for p in senders:
            p.wait(timeout=args.duration + 120)
        time.sleep(args.settle_s + 3)  # let the last traces fold
        services = json.loads(get(f"{api}/api/v1/services"))["services"]
        requests = {s["service"]: s["requests"] for s in services}
        metrics = get(f"{api}/metrics")
        refused = {
            m.group(1): float(m.group(2))
            for m in re.finditer(
                r'inferprof_otlp_requests_total\{outcome="overloaded",signal="traces",'
                r'transport="(\w+)"\} ([0-9.e+]+)', metrics)
        }
        return {"grpc": requests.get("replica-grpc", 0), "http": requests.get("replica-http", 0),
                "refused": refused}
    finally:
        collector.terminate()
        collector.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=800.0, help="requests/s per replica")
    ap.add_argument("--cap", type=int, default=3000, help="--max-pending-spans")
    ap.add_argument("--settle-s", type=float, default=2.0)
    args = ap.parse_args()
    print(f"2 replicas x {args.rate:g} req/s x 5 spans for {args.duration:g} s; collector "
          f"--max-pending-spans {args.cap} --settle-s {args.settle_s:g}\n")
    print("| round | cap | requests folded, gRPC replica | HTTP replica | larger / smaller | "
          "in all | exports refused (gRPC / HTTP) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    results: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    for r in range(args.rounds):
        for share in ((True, False) if r % 2 == 0 else (False, True)):
            res = one_run(args, share)
            g, h = res["grpc"], res["http"]
            ratio = max(g, h) / min(g, h) if min(g, h) else float("inf")
            results[share].append((ratio, g + h))
            ref = res["refused"]
            print(f"| {r + 1} | {'shared' if share else 'not shared'} | {g} | {h} | "
                  f"{ratio:.2f} | {g + h} | {ref.get('grpc', 0):.0f} / "
                  f"{ref.get('http', 0):.0f} |", flush=True)
    print("\n| cap | median larger / smaller | median requests in all | x not shared |")
    print("|---|---:|---:|---:|")
    base = statistics.median(t for _, t in results[False])
    for share in (True, False):
        ratio = statistics.median(x for x, _ in results[share])
        total = statistics.median(t for _, t in results[share])
        print(f"| {'shared' if share else 'not shared'} | {ratio:.2f} | {total:.0f} | "
              f"{total / base:.3f} |")


if __name__ == "__main__":
    main()
