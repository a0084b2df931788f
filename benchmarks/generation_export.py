"""CPU of the step API's whole path in one process: an engine loop reporting to
``inferprof.Engine``, inferprof's export thread, and an inferprof collector receiving over
OTLP/gRPC on 127.0.0.1 and folding; per engine step and per output token, ``production``
and ``full`` against ``off``.

    python3 benchmarks/generation_export.py [--rounds 3] [--duration 10] [--streams 16]

The loop mimics the LLM demo's engine without its model: ``--streams`` requests run at
once, each of a prompt of 32-256 tokens (one prefill chunk) and 8-192 output tokens (one
decode token per step), a finished request replaced at the next step; each step sleeps
``--step-ms`` (the model's wall time, not CPU), so that requests and steps arrive at the
demo's rates (tens of requests and about a hundred steps a second), which the timing budget
and the tail sampler of ``production`` see as in the demo. Requests are opened by the step
API itself (``inferprof.request`` spans), not by HTTP middleware. Each run configures
inferprof afresh against a fresh collector, runs ``--warmup`` seconds of load, then
``--duration`` seconds measured, shuts inferprof down (its spans flushed) and has the
collector fold everything held; the figure is the process's CPU time
(``time.process_time``: every thread) from the measurement's start to that end, and the
loop thread's own (``time.thread_time``). Configurations rotate over rounds; medians reported.
Run it from a checkout to measure that checkout's inferprof.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import inferprof
from inferprof.collector.app import CollectorApp
from inferprof.collector.settings import CollectorSettings

CONFIGS = ("off", "production", "full")


def run(mode: str, args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    with CollectorApp(CollectorSettings(grpc_port=0, http_port=0, api_port=0)) as collector:
        http = args.protocol == "http/protobuf"
        inferprof.configure(service_name="bench", mode=mode, set_global=False,
                            protocol=args.protocol,
                            endpoint=collector.otlp_http_endpoint if http
                            else collector.otlp_grpc_endpoint)
        engine = inferprof.Engine("0")
        running: list[list] = []  # [handle, prompt tokens (0: prefilled), tokens left]
        steps = tokens = requests = 0
        cpu0 = thread0 = 0.0
        spans0 = 0
        warm_until = time.monotonic() + args.warmup
        deadline = warm_until + args.duration
        while (now := time.monotonic()) < deadline:
            if warm_until and now >= warm_until:  # the measurement starts
                warm_until = 0.0
                steps = tokens = requests = 0
                cpu0, thread0 = time.process_time(), time.thread_time()
                spans0 = _received(collector)
            while len(running) < args.streams:
                prompt = rng.randint(32, 256)
                running.append([engine.request(prompt_tokens=prompt), prompt,
                                rng.randint(8, 192)])
                requests += 1
            with engine.step(kv_cache_usage=0.5) as step:
                for member in running:
                    if member[1]:
                        step.prefill(member[0], member[1])
                    else:
                        step.decode(member[0])
                with inferprof.stage("compute"):
                    time.sleep(args.step_ms / 1e3)
            steps += 1
            still = []
            for member in running:
                member[1] = 0
                member[2] -= 1
                tokens += 1
                if member[2]:
                    still.append(member)
                else:
                    member[0].finish()
            running = still
        for member in running:
            member[0].cancel()
        loop_cpu = time.thread_time() - thread0
        inferprof.shutdown()
        collector.engine.flush()
        cpu = time.process_time() - cpu0
        received = _received(collector) - spans0
    return {"cpu": cpu, "loop": loop_cpu, "steps": steps, "tokens": tokens,
            "requests": requests, "spans": received}


def _received(collector: CollectorApp) -> int:
    return collector.engine.stats.spans_received


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=5.0,
                    help="seconds of load before the measurement, per run: past the 64 "
                         "requests during which production's tail sampler keeps every trace")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--only", default=",".join(CONFIGS))
    ap.add_argument("--protocol", default="grpc", choices=("grpc", "http/protobuf"),
                    help="inferprof's OTLP protocol to the collector")
    args = ap.parse_args(argv)
    configs = [c for c in CONFIGS if c in args.only.split(",")]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    run(configs[0], argparse.Namespace(**{**vars(args), "duration": 1.0, "warmup": 1.0}), 0)
    for r in range(args.rounds):
        for c in configs[r % len(configs):] + configs[: r % len(configs)]:
            out = run(c, args, seed=r)
            runs[c].append(out)
            print(f"round {r + 1}/{args.rounds} {c:<10} {1e6 * out['cpu'] / out['steps']:7.1f} "
                  f"µs CPU per step, {out['steps']} steps, {out['spans']} spans",
                  file=sys.stderr, flush=True)

    def per(c: str, key: str, unit: str) -> float:
        return statistics.median(x[key] / x[unit] for x in runs[c])

    print(f"{args.rounds} rounds x {args.duration:g} s per configuration, {args.streams} "
          f"streams, steps of {args.step_ms:g} ms (sleep), OTLP {args.protocol}; medians\n")
    print("| mode | process CPU per step (µs) | extra over off per step (µs) "
          "| extra per token (µs) | loop thread per step (µs) | spans per request "
          "| spans per step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = per("off", "cpu", "steps") if "off" in runs else None
    for c in configs:
        step_cpu = per(c, "cpu", "steps")
        tokens_per_step = statistics.median(x["tokens"] / x["steps"] for x in runs[c])
        extra = "-" if base is None else f"{1e6 * (step_cpu - base):+.1f}"
        extra_token = "-" if base is None else \
            f"{1e6 * (step_cpu - base) / tokens_per_step:+.2f}"
        print(f"| {c} | {1e6 * step_cpu:.1f} | {extra} | {extra_token} | "
              f"{1e6 * per(c, 'loop', 'steps'):.1f} | {per(c, 'spans', 'requests'):.2f} | "
              f"{per(c, 'spans', 'steps'):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
