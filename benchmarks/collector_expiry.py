"""Expiry cost per entry as the collector's retained state grows from 10k to 1M entries.

    python3 benchmarks/collector_expiry.py [--sizes 10000,100000,1000000] [--steps 20]

Steady state, in the engine (``inferprof.collector.engine.Engine``, fake clock): it holds
N entries spread over the trace timeout (60 s); each step adds ``--chunk`` (10 000) new
ones, moves the clock so that as many expire, and times ``advance()``. Per entry: the
median step over ``--steps`` steps, divided by the chunk. Three kinds of state:

* ``links``: link index entries of batch spans whose member requests never come (1000
  links per span), evicted as ``orphan_stage``;
* ``traces``: pending traces with a stage span and no request span, evicted as
  ``incomplete_trace``;
* ``finalised``: requests (a request span and a stage) folded at once (``--settle-s 0``)
  and remembered for the trace timeout (re-sent exports, late spans); each step folds a
  chunk and forgets as many: the fold is most of it.

And the data structure alone, in the same run: removing the oldest ``--chunk`` keys per
step from an insertion-ordered ``dict`` (what the engine used, ``next(iter(d))``: it
rescans the slots its deleted leading keys left) and from an ``OrderedDict`` (what it uses).
Ratios are to the smallest size, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferprof.collector.engine import Engine
from tests.collector.synth import FakeClock, TraceBuilder, bulk_export

TIMEOUT_S = 60.0
LINKS_PER_SPAN = 1000


class Steady:
    """An engine holding ``retained`` entries of one kind in steady state."""

    def __init__(self, kind: str, retained: int, chunk: int) -> None:
        self.kind = kind
        self.clock = FakeClock()
        self.engine = Engine(
            clock=self.clock, trace_timeout_s=TIMEOUT_S, settle_s=0.0,
            max_pending_spans=4 * retained + 10**6,
        )
        self.chunk = chunk
        self.dt = TIMEOUT_S * chunk / retained
        self.exports = 0
        for _ in range(retained // chunk):
            self._add()
            self.clock.tick(self.dt)
            self.engine.advance()

    def _add(self) -> None:
        if self.kind == "links":
            export = bulk_export(self.chunk // LINKS_PER_SPAN, links_per_span=LINKS_PER_SPAN)
        elif self.kind == "traces":
            export = bulk_export(self.chunk)
        else:
            b = TraceBuilder()
            for i in range(self.chunk):
                b.sequential(i * 1e-4, [("compute", 0.01)])
            export = b.export()
        self.engine.ingest_traces(export)

    def step(self) -> float:
        self._add()
        self.clock.tick(self.dt)
        started = time.perf_counter()
        self.engine.advance()
        return time.perf_counter() - started


def structure(kind: str, retained: int, chunk: int, steps: int) -> list[float]:
    """Seconds per removed key, per step, of the bare structure in steady state."""
    d: dict = OrderedDict() if kind == "OrderedDict" else {}
    next_key = 0
    for _ in range(retained):
        d[next_key] = 0.0
        next_key += 1
    out = []
    for _ in range(steps):
        for _ in range(chunk):
            d[next_key] = 1.0
            next_key += 1
        started = time.perf_counter()
        if kind == "OrderedDict":
            for _ in range(chunk):
                d.popitem(last=False)
        else:
            for _ in range(chunk):
                del d[next(iter(d))]
        out.append((time.perf_counter() - started) / chunk)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--chunk", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kinds", default="links,traces,finalised")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    print(f"`python3 benchmarks/collector_expiry.py --sizes {args.sizes} --chunk {args.chunk} "
          f"--steps {args.steps} --kinds {args.kinds}`\n")
    print("Per entry, median of the steps (µs); ratio to the smallest size in parentheses.\n")
    header = ["retained", *(f"engine: {k}" for k in kinds), "dict (before)", "OrderedDict (now)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---:|" * len(header))
    base: dict[str, float] = {}
    for n in sizes:
        row = [f"{n:,}"]
        cells: dict[str, float] = {}
        for kind in kinds:
            steady = Steady(kind, n, args.chunk)
            cells[kind] = statistics.median(steady.step() / args.chunk for _ in range(args.steps))
            del steady
        for kind in ("dict", "OrderedDict"):
            cells[kind] = statistics.median(structure(kind, n, args.chunk, args.steps))
        for key in [*kinds, "dict", "OrderedDict"]:
            base.setdefault(key, cells[key])
            row.append(f"{cells[key] * 1e6:.2f} ({cells[key] / base[key]:.1f}x)")
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
