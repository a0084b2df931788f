"""Where the LLM demo service's CPU goes, thread by thread: ``production`` against ``off``.

    python3 benchmarks/llm_threads.py [--rounds 2] [--duration 10] [--only off,production]

The set-up of ``llm_overhead.py`` (the LLM demo under uvicorn on 127.0.0.1, a collector of
its own per service in this process, the streaming load generator, the services warmed
past ``production``'s sampler warm-up), but one configuration loaded at a time for
``--duration`` seconds, and the service's CPU read per thread (``/proc/<pid>/task/*/stat``,
utime + stime) before and after: CPU per output token of each thread, grouped by name
(the event loop is the main thread, ``inferprof-demo-engine`` the model's, the gRPC
client's native threads summed). Medians over rounds; the configurations' order rotates.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))

from llm_overhead import _WIRING, _code_path, _warm  # noqa: E402

from inferprof.collector.app import CollectorApp  # noqa: E402
from inferprof.collector.settings import CollectorSettings  # noqa: E402
from inferprof.demo.llm.processes import LLMServiceProcess, run_llm_loadgen  # noqa: E402
from inferprof.demo.llm.settings import LLMSettings  # noqa: E402

_GRPC = ("event_engine", "grpc_global_tim", "lifeguard", "resolver", "default-executo")


def threads(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
            out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def group(name: str, tid: int, pid: int) -> str:
    if tid == pid:
        return "event loop (main)"
    if name.startswith(_GRPC):
        return "gRPC client threads"
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--warmup-requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--only", default="off,production")
    args = ap.parse_args(argv)
    configs = args.only.split(",")
    per_token: dict[str, dict[str, list[float]]] = {c: {} for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[: r % len(configs)]
        with contextlib.ExitStack() as stack:
            for c in order:
                collector = stack.enter_context(
                    CollectorApp(CollectorSettings(grpc_port=0, http_port=0, api_port=0)))
                mode, protocol = _WIRING[c]
                http = protocol == "http/protobuf"
                settings = LLMSettings(instrumentation=mode,
                                       endpoint=collector.otlp_http_endpoint if http
                                       else collector.otlp_grpc_endpoint,
                                       kv_blocks=1024)
                svc = stack.enter_context(LLMServiceProcess(
                    settings, extra_env={"PYTHONPATH": _code_path(),
                                         "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}))
                _warm(svc, args, seed=r)
                before = threads(svc.pid)
                summary = run_llm_loadgen(svc.url, duration_s=args.duration,
                                          concurrency=args.concurrency, seed=r)
                after = threads(svc.pid)
                tokens = max(summary["output_tokens"], 1)
                cpu: dict[str, float] = {}
                for tid, (name, t) in after.items():
                    g = group(name, tid, svc.pid)
                    cpu[g] = cpu.get(g, 0.0) + t - before.get(tid, (name, 0.0))[1]
                cpu["all threads"] = sum(cpu.values())
                for g, t in cpu.items():
                    per_token[c].setdefault(g, []).append(1e6 * t / tokens)
                print(f"round {r + 1}/{args.rounds} {c:<16} {summary['tokens_per_s']:7.1f} "
                      f"tokens/s, {1e6 * cpu['all threads'] / tokens:6.1f} µs CPU per token, "
                      f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
                svc.close()
    names = sorted({g for c in configs for g in per_token[c]},
                   key=lambda g: (g == "all threads", -max(
                       statistics.median(per_token[c].get(g, [0.0])) for c in configs)))
    print(f"{args.rounds} rounds x {args.duration:g} s per configuration; µs of CPU per "
          "output token, medians over rounds\n")
    print("| thread | " + " | ".join(configs) + " | " +
          " | ".join(f"{c} - {configs[0]}" for c in configs[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(configs) - 1))
    for g in names:
        vals = [statistics.median(per_token[c].get(g, [0.0])) for c in configs]
        print(f"| {g} | " + " | ".join(f"{v:.1f}" for v in vals) + " | " +
              " | ".join(f"{v - vals[0]:+.1f}" for v in vals[1:]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
