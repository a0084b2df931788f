"""Instructions per output token of the LLM demo, thread by thread, counted (not timed).

    python3 benchmarks/llm_instructions.py [--modes off,production] [--warmup 80]
                                           [--requests 48] [--keep DIR]

Timing 1-2% on a shared VM is noisy (docs/overhead.md); counting is not. The LLM demo
(docs/demo.md, "The LLM demo"; its ``tiny`` model and a KV cache of 1024 blocks, so
nothing is evicted) serves streaming ``/v1/completions`` requests in-process, driven
through ASGI by 8 concurrent clients, each request the same prompt and ``max_tokens``
(32, argmax sampling: the same tokens every run). The engine, when idle, waits for 8 new
requests, and its step fits all 8 prompts, so every wave of 8 runs in the same 32 steps
in every mode. All of it runs under valgrind's callgrind, which counts the instructions
every thread executes (``--separate-threads=yes``). One process per mode: it serves
``--warmup`` requests (past ``production``'s tail-sampler warm-up, its first 64 requests,
all kept), pauses while the benchmark has callgrind dump its counts (``callgrind_control
--dump``, which starts them again from zero), serves ``--requests`` more, and pauses for a
second dump; start-up, imports, warm-up and shutdown fall outside the second dump, which
is the table: its instructions over the output tokens streamed meanwhile.

Clocks: callgrind slows the process ~50x, not the clock, so whatever runs on a timer
would run ~50x as often per token as in a real run. ``production`` exports over
OTLP/gRPC, through ``configure()``'s own exporter, to a sink in the benchmark process;
the span export thread's schedule is set longer than the run
(``OTEL_BSP_SCHEDULE_DELAY``), and at each pause the process flushes the span queue on a
thread counted as the export thread: the counted window exports its own spans, once (a
real run at 15-20 requests a second exports about 3 times per 48 requests). The step
API's ``STEPS_MAX_WAIT_S`` is stretched 50x likewise, so that the steps go out many to a
compact span, as in a real run (here each wave's 32, when the engine goes idle). The
metric export keeps its 15 s clock: it is in the table, and left out of the last total.
Which traces the tail sampler keeps follows latencies, so the event loop's and the
export's rows still move a little from run to run.

Threads are told apart by name: each Python thread announces itself when it starts (a
number of ``sys.getswitchinterval()`` calls unique to it, a power of two, which callgrind
records; a slot callgrind reused for a later thread sums its threads' numbers); the
event loop is thread 1; threads that never ran Python (gRPC's, the tokenizer's pool)
are "native".

Instructions are not time: they leave out cache misses, lock waits and how the CPU
overlaps work; handing the GIL between threads costs mostly time. ``--keep DIR`` keeps
the callgrind outputs: ``callgrind_annotate DIR/cg.production.<pid>.2-01`` gives the
event loop's functions.

Needs ``valgrind`` (Debian: ``apt-get install valgrind``). About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODES = ("none", "off", "production", "full")
CLIENTS = 8
MAX_TOKENS = 32
PROMPT = ("The quick brown fox jumps over the lazy dog while the scheduler batches "
          "every request it can fit into the next step.")
_EXPORT_THREAD = "inferprof-span-export"
#: Callgrind's slow-down, about: clock-driven intervals of the counted process are
#: stretched by it.
_SLOWDOWN = 50
#: The span export thread's schedule in the counted process (OTEL_BSP_SCHEDULE_DELAY):
#: longer than a run, so that it exports only when the benchmark flushes.
_SCHEDULE_DELAY_MS = 3_600_000
#: Thread name -> row of the table; threads not named here are "other Python".
_ROLES = {
    "MainThread": "event loop",
    "inferprof-demo-engine": "engine",
    _EXPORT_THREAD: "span export",
    "inferprof-summaries": "summaries",
    "OtelPeriodicExportingMetricReader": "metric export",
}
ROWS = ("event loop", "engine", "span export", "summaries", "metric export", "other Python",
        "native")
#: Threads past the 13th share one announcement (rows: "other Python" unless named).
_MAX_MARK_BIT = 12
_PER_TOKEN = "total less metric export"
_MARK = re.compile(r"^cfn=sys_getswitchinterval\s*$")


def child(mode: str, warm: int, n: int, endpoint: str | None) -> None:
    """Serve ``warm`` streaming requests, then the ``n`` measured, in-process (runs under
    callgrind)."""
    import threading

    names: dict[int, str] = {}
    lock = threading.Lock()
    run = threading.Thread.run

    def announced_run(self: threading.Thread) -> None:
        with lock:
            # a power of two: a thread slot callgrind gave several threads in turn sums them
            code = 1 << min(len(names), _MAX_MARK_BIT)
            names[code] = names[code] + "," + self.name if code in names else self.name
        for _ in range(code):
            sys.getswitchinterval()
        run(self)

    threading.Thread.run = announced_run  # type: ignore[method-assign]

    import asyncio
    import json
    import random

    from inferprof.instrumentation import engine as step_api

    # Production sends the steps held when the oldest is STEPS_MAX_WAIT_S old at a step's
    # end: on callgrind's stretched clock that is every step or two. Stretched as well (a
    # real run's ~50 steps of 10 ms), the steps go out when each wave ends, as the engine
    # goes idle.
    step_api._MAX_WAIT_NS *= _SLOWDOWN
    random.seed(0)

    from request_instructions import post_once

    from inferprof.demo.llm.engine import Engine
    from inferprof.demo.llm.service import COMPLETIONS_PATH, create_app
    from inferprof.demo.llm.settings import LLMSettings

    _waves(Engine)
    app = create_app(LLMSettings(instrumentation=mode, endpoint=endpoint,
                                 service_name="llm-instructions", model_size="tiny",
                                 kv_blocks=1024, max_batched_tokens=512))
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}).encode()
    chunks = 0

    async def one() -> None:
        nonlocal chunks
        scope, receive = post_once(COMPLETIONS_PATH, body)
        status = []

        async def send(message: dict) -> None:
            nonlocal chunks
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message.get("body", b"").startswith(b"data: {"):
                chunks += 1

        await app(scope, receive, send)
        if status != [200]:
            raise RuntimeError(f"the demo answered {status}")

    async def serve(n: int) -> None:
        started = 0

        async def client() -> None:
            nonlocal started
            while started < n:
                started += 1
                await one()

        await asyncio.gather(*(client() for _ in range(CLIENTS)))

    def pause(label: str) -> None:
        # The spans queued so far are exported now, on a thread counted as the export
        # thread: the window exports its own spans, once (_SCHEDULE_DELAY_MS keeps the
        # export thread from doing it on its clock, which callgrind's slow-down runs ~50x
        # as often per token as a real run).
        from inferprof._config import active_runtime

        rt = active_runtime()
        processor = getattr(rt, "owned_processor", None)
        if processor is not None:
            flush = threading.Thread(target=processor.force_flush, name=_EXPORT_THREAD)
            flush.start()
            flush.join()
        # the parent dumps callgrind's counts (and starts them again from zero) meanwhile
        steps = app.state.llm.require_engine().counts.steps
        print(f"{label} {steps} {chunks}", flush=True)
        sys.stdin.readline()

    async def main() -> None:
        async with app.router.lifespan_context(app):
            await serve(warm)
            pause("WARM")
            await serve(n)
            from inferprof._config import active_runtime

            rt = active_runtime()
            kept = rt.snapshot().traces_kept if rt is not None else 0
            pause(f"KEPT {kept} MEASURED")

    asyncio.run(main())
    for code, name in names.items():
        print(f"THREAD {code} {name}", flush=True)


def _waves(engine_class: type) -> None:
    """Make the demo engine, when idle, wait for ``CLIENTS`` new requests before it steps:
    every wave of requests (same prompt, same length) runs in the same steps in every
    mode, whenever each request arrives. Without it, the steps per token, and with them
    the engine's and the event loop's instructions per token, follow thread timing."""
    import threading

    gate = threading.Condition()
    waiting = [0]
    submit, drain, stop = engine_class.submit, engine_class._drain, engine_class.stop

    def gated_submit(self: Any, *args: Any, **kwargs: Any) -> Any:
        req = submit(self, *args, **kwargs)
        with gate:
            waiting[0] += 1
            gate.notify_all()
        return req

    def gated_drain(self: Any, block: bool) -> bool:
        if block:
            with gate:
                gate.wait_for(lambda: self._stopping or waiting[0] >= CLIENTS)
                waiting[0] = 0
        return drain(self, block)

    def gated_stop(self: Any, *args: Any, **kwargs: Any) -> None:
        self._stopping = True
        with gate:
            gate.notify_all()
        stop(self, *args, **kwargs)

    engine_class.submit = gated_submit
    engine_class._drain = gated_drain
    engine_class.stop = gated_stop


def _thread_ir(path: Path) -> tuple[int, int]:
    """(instructions, announcement calls) of one per-thread callgrind output."""
    code = 0
    total = None
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if _MARK.match(line) and i + 1 < len(lines) and lines[i + 1].startswith("calls="):
            code += int(lines[i + 1].split()[0].partition("=")[2])
        elif line.startswith(("summary:", "totals:")):
            total = int(line.split()[1])
    if total is None:
        raise RuntimeError(f"no event totals in {path}")
    return total, code


def _row(code: int, names: dict[int, str]) -> str:
    """The row of a thread slot whose threads announced ``code`` in all (the bits of the
    threads it held one after another): the first of theirs with a row of its own."""
    held = [n for bit, joined in names.items() if code & bit for n in joined.split(",")]
    return next((_ROLES[n] for n in held if n in _ROLES), "other Python")


def count(mode: str, warm: int, n: int, endpoint: str | None, workdir: Path) -> dict:
    """Instructions per row of the table while ``n`` requests are served in ``mode`` after
    ``warm``, and what was streamed and kept meanwhile."""
    out = workdir / f"cg.{mode}"
    cmd = [
        "valgrind", "--tool=callgrind", "--separate-threads=yes", "--compress-strings=no",
        "--compress-pos=no", f"--callgrind-out-file={out}.%p", sys.executable, __file__,
        "--child", mode, str(warm), str(n), endpoint or "-",
    ]
    # INFERPROF_MAX_TIMED_RATE=0: every request timed (at callgrind's request rates the
    # timing budget would not apply anyway)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0",
               INFERPROF_MAX_TIMED_RATE="0", OTEL_BSP_SCHEDULE_DELAY=str(_SCHEDULE_DELAY_MS))
    names: dict[int, str] = {}
    marks: dict[str, int] = {}
    errors = workdir / f"stderr.{mode}"
    with errors.open("w") as err, subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
            env=env) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        for line in proc.stdout:
            words = line.split()
            if line.startswith("THREAD "):
                names[int(words[1])] = line.split(maxsplit=2)[2].strip()
            elif words and words[0] in ("WARM", "KEPT"):
                # part 1 of the counts: start-up and warm-up; part 2: the measured requests
                marks[words[-3]] = int(words[-1])
                marks[f"steps.{words[-3]}"] = int(words[-2])
                if words[0] == "KEPT":
                    marks["kept"] = int(words[1])
                subprocess.run(["callgrind_control", f"--dump={words[-3]}", str(proc.pid)],
                               check=True, capture_output=True)
                proc.stdin.write("go\n")
                proc.stdin.flush()
    if proc.returncode != 0 or "MEASURED" not in marks:
        raise RuntimeError(f"{mode} failed:\n{errors.read_text()[-3000:]}")
    codes: dict[str, int] = {}
    for path in workdir.glob(f"cg.{mode}.{proc.pid}*-*"):
        codes[path.name[-2:]] = codes.get(path.name[-2:], 0) + _thread_ir(path)[1]
    rows = dict.fromkeys(ROWS, 0)
    for path in sorted(workdir.glob(f"cg.{mode}.{proc.pid}.2-*")):
        ir = _thread_ir(path)[0]
        tid = path.name[-2:]
        if tid == "01":
            row = "event loop"
        elif codes.get(tid):
            row = _row(codes[tid], names)
        else:
            row = "native"
        rows[row] += ir
    return {"rows": rows, "chunks": marks["MEASURED"] - marks["WARM"], "kept": marks["kept"],
            "steps": marks["steps.MEASURED"] - marks["steps.WARM"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="off,production",
                        help=f"comma-separated, from {', '.join(MODES)}; the first is the "
                             "baseline")
    parser.add_argument("--warmup", type=int, default=80,
                        help="requests served before the count starts (default 80: past "
                             "production's 64-request sampler warm-up)")
    parser.add_argument("--requests", type=int, default=48,
                        help="requests counted (default 48)")
    parser.add_argument("--keep", type=Path, help="keep the callgrind outputs in this folder")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, warm, n, endpoint = args.child
        child(mode, int(warm), int(n), None if endpoint == "-" else endpoint)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("llm_instructions.py needs valgrind (Debian: apt-get install valgrind)",
              file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    if args.warmup < 0 or args.requests < 1:
        parser.error("--warmup must be >= 0 and --requests >= 1")

    from overhead import NullSink

    with NullSink() as sink, tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            futures = {m: pool.submit(count, m, args.warmup, args.requests,
                                      sink.endpoint if m != "none" else None, workdir)
                       for m in modes}
            got = {m: f.result() for m, f in futures.items()}

    tokens = args.requests * MAX_TOKENS
    per_token: dict[str, dict[str, float]] = {}
    for m in modes:
        if got[m]["chunks"] != tokens:
            raise RuntimeError(f"{m}: {got[m]['chunks']} chunks streamed for {tokens} tokens")
        per_token[m] = {r: got[m]["rows"][r] / tokens for r in ROWS}
        per_token[m]["total"] = sum(per_token[m][r] for r in ROWS)
        per_token[m][_PER_TOKEN] = per_token[m]["total"] - per_token[m]["metric export"]
    base = modes[0]
    print(f"Instructions per output token, by thread (callgrind; {args.requests} requests "
          f"counted after {args.warmup}, {CLIENTS} concurrent streaming clients, "
          f"max_tokens {MAX_TOKENS}, demo model `tiny`; Python {sys.version.split()[0]}).\n")
    others = modes[1:]
    print("| thread | " + " | ".join(modes) + " | "
          + " | ".join(f"{m} - {base}" for m in others) + " |")
    print("|---|" + "---:|" * (len(modes) + len(others)))
    for r in (*ROWS, "total", _PER_TOKEN):
        cells = [f"{per_token[m][r]:,.0f}" for m in modes]
        cells += [f"{per_token[m][r] - per_token[base][r]:+,.0f}" for m in others]
        label = f"**{r}**" if r in ("total", _PER_TOKEN) else r
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("| engine steps / 100 tokens | " + " | ".join(
        f"{100 * got[m]['steps'] / tokens:.1f}" for m in modes) + " |" + " |" * len(others))
    print()
    for m in others:
        ratio = per_token[m][_PER_TOKEN] / per_token[base][_PER_TOKEN]
        kept = f"; traces kept: {got[m]['kept']}" if m != "none" else ""
        print(f"{m}: {ratio:.3f}x {base}'s instructions per token, metric export left out"
              f"{kept} (all requests so far, warm-up included)")
    print("\nThe metric export runs on a clock (every 15 s), which callgrind's slow-down makes "
          "about 50x as frequent per token as in a real run: it is left out of the last "
          "total.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
