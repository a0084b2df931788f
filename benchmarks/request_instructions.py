"""Instructions per request on the demo service's event loop, counted (not timed).

    python3 benchmarks/request_instructions.py [--modes none,off,production,discard,full]

Timing a few percent on a shared VM is noisy (docs/overhead.md); counting is not. Each
configuration of the demo app (``none``: uninstrumented; ``off``, ``production``,
``full``: inferprof) serves requests in-process, driven through ASGI by 32 concurrent
clients, under valgrind's callgrind, which counts the instructions every thread executes.
The event loop's count (thread 1: middleware, FastAPI, tokenizer, inferprof's request
path) is taken for two request counts and differenced, so start-up and import cancel out:
instructions per request = (Ir(N2) - Ir(N1)) / (N2 - N1). The table's first columns are
the event loop's; "all threads" adds the batch worker's (the model's and the batcher's
hooks), the summaries', the span exporter's and gRPC's. The model is the ``tiny`` one, to
keep callgrind's ~50x slow-down bearable (``--model-size small``, overhead.py's, takes
some 40 minutes). ``production`` and ``full`` export over OTLP/gRPC to a sink in this
process.

Work done once per period of time is counted too often under that slow-down: the timing
budget ends its 0.1 s period every ~4 requests instead of every ~34 at overhead.py's
saturation, and the summaries export every 5 s, some 50 requests instead of ~1,700.
``--virtual-rate R`` runs the budget's clock at R requests a second (its period's work
then counts per request as at that rate), folds the summaries every R requests (each
second at that rate) and exports them once, at the end (the 5 s exports' own work, a few
µs a request at saturation by overhead.py's per-thread CPU, is not counted: it cancels).

``discard`` is ``production`` keeping no trace after the tail sampler's warm-up: the
path of the ~85% of requests production mode does not keep; ``full`` keeps all.
``untimed`` (not in the default set: ``--modes off,untimed``) is ``production`` with a
timing budget that times (nearly) no request after its first tenth of a second: the path
of a request the budget leaves untimed, summarised with its stages (the default,
``untimed_stages``); ``counted``, the same with ``INFERPROF_UNTIMED_STAGES=false``: only
counted in the summaries (contract §15).

Instructions are not time: they leave out cache misses and how the CPU overlaps work.
They are the part of the overhead that does not depend on the machine's mood, and they
make a change of a few hundred instructions per request visible. ``--cache-sim`` adds
callgrind's simulated cache misses and its estimate of cycles (an L1 miss 10 cycles, a
last-level one 100), closer to time: inferprof's path misses the caches more often per
instruction than the code it wraps. Kept traces depend on
latencies (the tail sampler), so ``production`` varies by a few thousand instructions from
run to run.

Needs ``valgrind`` (Debian: ``apt-get install valgrind``). About 4 minutes on 2 cores
(twice that with ``--cache-sim``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODES = ("none", "off", "production", "discard", "full")
ALL_MODES = (*MODES, "untimed", "counted")
#: ``discard``: production mode keeping no trace after the tail sampler's warm-up (which
#: both request counts include, so it cancels): the path every unkept request takes.
_DISCARD_ENV = {"INFERPROF_SAMPLE_RATE": "0.000001", "INFERPROF_TAIL_QUANTILE": "1.0"}
#: ``untimed``: one request timed per 100 s per route after the budget's first period
#: (which both request counts include), when the route learns its model.
_MODE_ENV = {"discard": _DISCARD_ENV, "untimed": {"INFERPROF_MAX_TIMED_RATE": "0.01"},
             "counted": {"INFERPROF_MAX_TIMED_RATE": "0.01",
                         "INFERPROF_UNTIMED_STAGES": "false"}}
CLIENTS = 32
LABELS = {
    "none": "none (uninstrumented)",
    "off": "inferprof off",
    "production": "inferprof production",
    "discard": "inferprof production, no trace kept",
    "untimed": "inferprof production, untimed (summarised with its stages)",
    "counted": "inferprof production, untimed (counted only)",
    "full": "inferprof full",
}


def post_once(path: str, body: bytes) -> tuple[dict, Callable[[], Awaitable[dict]]]:
    """An ASGI HTTP POST of ``body`` to ``path`` (JSON), from a client that stays connected
    once it has sent it: the scope, and the ``receive`` to serve it with."""
    import asyncio

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }
    received = False

    async def receive() -> dict:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # a client that stays connected
        return {"type": "http.disconnect"}

    return scope, receive


def child(mode: str, n: int, endpoint: str | None, model_size: str = "tiny",
          virtual_rate: float = 0.0) -> None:
    """Serve ``n`` requests in-process (runs under callgrind). ``virtual_rate``: when
    set, the timing budget's clock runs at that many requests a second (``_virtual_clock``)
    and the summaries fold every ``virtual_rate`` requests, as each second at that rate,
    then once more and export at the end (``--virtual-rate``)."""
    import asyncio

    random.seed(0)
    if virtual_rate:  # no fold by the clock: by the count of requests waiting, below
        from inferprof.instrumentation import summaries

        summaries._FOLD_EVERY_S = float("inf")  # type: ignore[attr-defined]
    from inferprof.demo.loadgen import build_prompts
    from inferprof.demo.service import create_app
    from inferprof.demo.settings import DemoSettings

    exporting = mode in ("production", "discard", "full", "untimed", "counted")
    app = create_app(
        DemoSettings(
            instrumentation="production" if mode in _MODE_ENV else mode,
            endpoint=endpoint if exporting else None,
            service_name="request-instructions",
            model_size=model_size,
        )
    )
    bodies = [json.dumps({"text": p}).encode() for p in build_prompts(None, seed=0)]

    async def one(body: bytes) -> None:
        scope, receive = post_once("/v1/classify", body)
        status = []

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await app(scope, receive, send)
        if status != [200]:
            raise RuntimeError(f"the demo answered {status}")

    async def main() -> None:
        done = 0

        async def client() -> None:
            nonlocal done
            while done < n:
                done += 1
                await one(bodies[(done * 7919) % len(bodies)])

        async with app.router.lifespan_context(app):
            from inferprof._config import active_runtime

            rt = active_runtime()
            if virtual_rate and rt is not None and rt.timing_budget is not None:
                _virtual_clock(rt.timing_budget, virtual_rate)
            if virtual_rate and rt is not None and rt.summaries is not None:
                rt.summaries._fold_at = max(1, round(virtual_rate))  # type: ignore[attr-defined]
            await asyncio.gather(*(client() for _ in range(CLIENTS)))
            if rt is not None:
                print(f"KEPT {rt.snapshot().traces_kept}", flush=True)
            if virtual_rate and rt is not None:
                import inferprof

                # the last fold and the export, however slow callgrind makes them (the
                # lifespan's own shutdown gives the summaries 1.5 s)
                inferprof.shutdown(timeout_millis=600_000)
                stats = rt.stats
                print(f"SUMMARIES {stats.summary_exports} {stats.summary_dropped}", flush=True)

    asyncio.run(main())


def _virtual_clock(budget: object, rate: float) -> None:
    """Run ``budget``'s clock at ``rate`` requests a second: each request's read advances
    it by ``1 / rate`` s. Under callgrind the service runs some 50 times slower than at
    saturation, so a timing budget on the real clock ends its 0.1 s period every few
    requests instead of every ``rate / 10``: its period's work would count some ten times
    over."""
    ticks = iter(range(1, 1 << 62))
    budget._clock = lambda: next(ticks) / rate  # type: ignore[attr-defined]
    budget._period_start = 0.0  # type: ignore[attr-defined]
    budget._period_end = 0.1  # type: ignore[attr-defined]  # (sampling._BUDGET_PERIOD_S)


def count(
    mode: str, n: int, endpoint: str | None, workdir: Path, cache_sim: bool = False,
    model_size: str = "tiny", virtual_rate: float = 0.0,
) -> tuple[dict[str, int], int]:
    """Events of thread 1 serving ``n`` requests in ``mode`` (instructions ``Ir``; with
    ``cache_sim`` also simulated L1 misses: ``I1mr``, ``D1mr``, ``D1mw``), and the number
    of traces kept."""
    out = workdir / f"cg.{mode}.{n}"
    cmd = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes",
        f"--cache-sim={'yes' if cache_sim else 'no'}",
        f"--callgrind-out-file={out}.%p", sys.executable, __file__,
        "--child", mode, str(n), endpoint or "-", "--model-size", model_size,
        "--virtual-rate", str(virtual_rate),
    ]
    # INFERPROF_MAX_TIMED_RATE=0: every request timed (the path counted here; at the
    # request rates of callgrind, the timing budget would not apply anyway)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0",
               INFERPROF_MAX_TIMED_RATE="0")
    env.update(_MODE_ENV.get(mode, {}))
    if virtual_rate:  # the summaries export at the end only (child() folds them)
        env["INFERPROF_SUMMARY_INTERVAL"] = "100000"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} x {n} failed:\n{proc.stderr[-3000:]}")
    main_thread = [p for p in workdir.glob(f"cg.{mode}.{n}.*-01")]
    if len(main_thread) != 1:
        raise RuntimeError(f"no callgrind output for thread 1 of {mode} x {n}")
    kept = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("KEPT ")]
    for line in proc.stdout.splitlines():
        if line.startswith("SUMMARIES ") and line.split()[2] != "0":
            raise RuntimeError(f"{mode} x {n}: summaries dropped ({line}): the count is short")
    events = _events(main_thread[0])
    # every thread's instructions, as the event "all_Ir" (the batch worker's, the
    # summaries' and the span exporter's threads, gRPC's...)
    events["all_Ir"] = sum(_events(p).get("Ir", 0)
                           for p in workdir.glob(f"cg.{mode}.{n}.*-*"))
    return events, (kept[0] if kept else 0)


def _events(path: Path) -> dict[str, int]:
    """A callgrind output's event totals."""
    names: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith(("summary:", "totals:")) and names:
            # (callgrind leaves trailing zero counts off: events missing are 0)
            return dict(zip(names, map(int, line.split()[1:]), strict=False))
    raise RuntimeError(f"no event totals in {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--requests", default="100,400",
                        help="the two request counts differenced (default 100,400)")
    parser.add_argument("--cache-sim", action="store_true",
                        help="also simulate the L1 caches and print misses per request "
                             "(about twice as slow)")
    parser.add_argument("--model-size", default="tiny",
                        help="the demo model (default tiny; overhead.py's is small)")
    parser.add_argument("--virtual-rate", type=float, default=0.0, metavar="R",
                        help="run the timing budget's clock at R requests a second "
                             "(overhead.py's saturation rate, for its period's work per "
                             "request), fold the summaries every R requests (each second "
                             "at that rate) and export them once at the end")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, n, endpoint = args.child
        child(mode, int(n), None if endpoint == "-" else endpoint, args.model_size,
              args.virtual_rate)
        return 0
    if shutil.which("valgrind") is None:
        print("request_instructions.py needs valgrind (Debian: apt-get install valgrind)",
              file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(ALL_MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(ALL_MODES)}")
    n1, n2 = (int(x) for x in args.requests.split(","))
    if not 0 < n1 < n2:
        parser.error("--requests takes two counts, the first smaller")
    if args.virtual_rate and 0.1 * args.virtual_rate >= n1:
        # the timing budget's first period (every request timed) must end in both runs
        parser.error("--virtual-rate R needs R / 10 requests below the first count")

    from overhead import NullSink

    with NullSink() as sink, tempfile.TemporaryDirectory() as tmp:
        jobs = [(m, n) for m in modes for n in (n1, n2)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            futures = {
                job: pool.submit(count, *job, sink.endpoint, Path(tmp), args.cache_sim,
                                 args.model_size, args.virtual_rate)
                for job in jobs
            }
            ir = {job: f.result() for job, f in futures.items()}

    def per_req(m: str, event: str) -> float:
        return (ir[(m, n2)][0].get(event, 0) - ir[(m, n1)][0].get(event, 0)) / (n2 - n1)

    per_request = {m: per_req(m, "Ir") for m in modes}
    all_threads = {m: per_req(m, "all_Ir") for m in modes}
    kept = {m: (ir[(m, n2)][1] - ir[(m, n1)][1]) / (n2 - n1) for m in modes}

    base = per_request.get("none")
    base_all = all_threads.get("none")
    off = per_request.get("off")
    clock = (f"; the timing budget's clock at {args.virtual_rate:g} requests a second, the "
             f"summaries folded every {args.virtual_rate:g} requests" if args.virtual_rate
             else "")
    print(f"Instructions per request (callgrind; requests {n2} - {n1}, {CLIENTS} concurrent "
          f"clients, demo model `{args.model_size}`{clock}; Python "
          f"{sys.version.split()[0]}). Event loop: thread 1; all threads: the batch "
          "worker's, the summaries', the span exporter's and gRPC's too.\n")
    cache_cols = (" I1 misses / request | D1 misses / request | last-level misses / request "
                  "| est. cycles / request | x none |") if args.cache_sim else ""
    print("| config | event loop / request | x none | extra over off | all threads / request "
          f"| x none | traces kept |{cache_cols}")
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|" * 5 if args.cache_sim else ""))

    def last_level(m: str) -> float:
        return per_req(m, "ILmr") + per_req(m, "DLmr") + per_req(m, "DLmw")

    def cycles(m: str) -> float:
        # callgrind_annotate's and KCachegrind's estimate: an L1 miss 10 cycles, a
        # last-level one 100, every instruction 1
        l1 = per_req(m, "I1mr") + per_req(m, "D1mr") + per_req(m, "D1mw")
        return per_req(m, "Ir") + 10 * l1 + 100 * last_level(m)

    for m in modes:
        v = per_request[m]
        ratio = f"{v / base:.3f}" if base else "-"
        extra = f"{v - off:+,.0f}" if off is not None and m not in ("none", "off") else "-"
        share = f"{kept[m]:.1%}" if m not in ("none", "off") else "-"
        a = all_threads[m]
        ratio_all = f"{a / base_all:.4f}" if base_all else "-"
        row = f"| {LABELS[m]} | {v:,.0f} | {ratio} | {extra} | {a:,.0f} | {ratio_all} | {share} |"
        if args.cache_sim:
            est = f"{cycles(m) / cycles('none'):.3f}" if base else "-"
            row += (f" {per_req(m, 'I1mr'):,.0f} | {per_req(m, 'D1mr') + per_req(m, 'D1mw'):,.0f}"
                    f" | {last_level(m):,.0f} | {cycles(m):,.0f} | {est} |")
        print(row)
    if args.cache_sim:
        print("\nL1 misses: callgrind's simulated first-level caches (instruction; data read + "
              "write), sized like this machine's; last level: its simulated last-level cache. "
              "Estimated cycles: instructions + 10 per L1 miss + 100 per last-level miss "
              "(callgrind_annotate's estimate). The event loop's figures.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
